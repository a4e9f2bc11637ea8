"""Is this a CUDA machine? The one answer for the launcher, the vLLM patches and the tools (no vLLM import)."""

from __future__ import annotations

import os
from collections.abc import Mapping


def cuda_available() -> bool:
    """A CUDA build of torch with a visible device (a ROCm build's `torch.cuda` does not count)."""
    try:
        import torch  # lazy: torch is optional for the launcher and the manifest checks
    except ImportError:
        return False
    try:
        return bool(torch.version.cuda) and torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken driver means "not a CUDA machine", not a crash at start-up
        return False


def is_cuda_machine(env: Mapping[str, str] | None = None) -> bool:
    """`cuda_available()`, unless ECHO_DEVICE=cuda|cpu (the Makefile's switch) says otherwise."""
    forced = (os.environ if env is None else env).get("ECHO_DEVICE")
    if forced:
        return forced == "cuda"
    return cuda_available()
