"""Extension modules for setup.py: `extensions(root) -> (ext_modules, cmdclass)`.

* Always: the CPU op, `echo_vllm._C` (a torch CppExtension).
* Additionally, when torch is a CUDA build (`torch.version.cuda`) and nvcc is found (CUDA_HOME / PATH), the
  CUDA kernel and its binding, in the same module (a CUDAExtension). `ECHO_SKIP_CUDA=1` forces the CPU-only
  build; `ECHO_SKIP_CSRC=1` (handled in setup.py) builds nothing.

Nothing here needs a GPU: the architectures come from TORCH_CUDA_ARCH_LIST, or torch's default (the visible
GPU, else a list of common ones).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CPU_SOURCES = (
    "csrc/ops.cpp",
    "csrc/budget_cpu.cpp",
    "csrc/tree_cpu.cpp",
    "csrc/chain_cpu.cpp",
    "csrc/feedback_cpu.cpp",
)
CUDA_SOURCES = ("csrc/budget_cuda.cu", "csrc/budget_cuda_binding.cpp")
MODULE_NAME = "echo_vllm._C"


def cuda_build_reason() -> tuple[bool, str]:
    """(build the CUDA kernel?, why). torch's own CUDA_HOME lookup (CUDA_HOME, CUDA_PATH, nvcc on PATH,
    /usr/local/cuda) decides which toolkit CUDAExtension uses, so it decides here too."""
    if os.environ.get("ECHO_SKIP_CUDA") == "1":
        return False, "ECHO_SKIP_CUDA=1"
    import torch
    from torch.utils import cpp_extension

    if not torch.version.cuda:
        return False, f"torch {torch.__version__} is not a CUDA build"
    home = cpp_extension.CUDA_HOME
    if not home or not (Path(home) / "bin" / "nvcc").exists():
        return False, "no CUDA toolkit with nvcc found (set CUDA_HOME)"
    return True, f"torch CUDA {torch.version.cuda}, toolkit {home}"


def extensions(root: Path | str):
    """(ext_modules, cmdclass) for setup(); ([], {}) when torch's build helpers are missing."""
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError:
        return [], {}

    root = Path(root)
    # setup() wants paths relative to the project root.
    rel = os.path.relpath(root, Path.cwd()) if Path.cwd() != root else "."
    include_dirs = [str(root / "csrc")]
    # -fno-trapping-math: lets float clamps become selects so that the draft log-prob loop vectorises at the
    # baseline ISA (chain_cpu.cpp); results are unchanged (no reassociation, unlike -ffast-math).
    cxx_flags = ["-O3", "-fno-trapping-math"]
    with_cuda, _reason = cuda_build_reason()
    if with_cuda:
        ext = cpp_extension.CUDAExtension(
            MODULE_NAME,
            sources=[os.path.join(rel, s) for s in CPU_SOURCES + CUDA_SOURCES],
            include_dirs=include_dirs,
            define_macros=[("ECHO_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
        )
    else:
        ext = cpp_extension.CppExtension(
            MODULE_NAME,
            sources=[os.path.join(rel, s) for s in CPU_SOURCES],
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
        )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)
    return [ext], {"build_ext": build_ext}
