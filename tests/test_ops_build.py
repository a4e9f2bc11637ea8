"""Build-side checks that need no GPU: the CUDA kernel compiles with a bare nvcc, and csrc/build.py's hook."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "csrc" / "budget_cuda.cu"


def _nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def test_kernel_depends_only_on_the_cuda_runtime():
    text = (
        KERNEL.read_text()
        + (ROOT / "csrc" / "budget_cuda.h").read_text()
        + (ROOT / "csrc" / "budget_key.h").read_text()
    )
    for forbidden in ("torch/", "ATen/", "c10/", "pybind11"):
        assert forbidden not in text, f"csrc/budget_cuda.cu must not depend on {forbidden}"


def test_nvcc_compiles_the_kernel(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME): the CUDA kernel compile check needs the CUDA toolkit")
    # No torch include paths: the kernel must build from the CUDA runtime alone. sm_90 = H100/H200.
    cmd = [
        nvcc,
        "-c",
        str(KERNEL),
        "-o",
        str(tmp_path / "budget_cuda.o"),
        "-std=c++17",
        "-O3",
        "-arch=sm_90",
        "-Werror",
        "all-warnings",
        "-Xcompiler",
        "-Wall,-Wextra",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "budget_cuda.o").stat().st_size > 0


def test_build_hook_returns_the_cpu_extension(monkeypatch):
    pytest.importorskip("torch.utils.cpp_extension")
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)
    from csrc import build

    ext_modules, cmdclass = build.extensions(ROOT)
    assert [ext.name for ext in ext_modules] == ["echo_vllm._C"]
    sources = ext_modules[0].sources
    assert {"csrc/ops.cpp", "csrc/budget_cpu.cpp"} <= {os.path.normpath(s) for s in sources}
    assert all((ROOT / s).exists() for s in sources)
    with_cuda, reason = build.cuda_build_reason()
    assert any(s.endswith(".cu") for s in sources) == with_cuda, reason
    assert "build_ext" in cmdclass

    monkeypatch.setenv("ECHO_SKIP_CUDA", "1")
    ext_modules, _ = build.extensions(ROOT)
    assert not any(s.endswith((".cu", "_binding.cpp")) for s in ext_modules[0].sources)
