"""Where the testbed lives and where its training text comes from."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from echo_vllm.errors import InputError

DEFAULT_TESTBED_DIR = Path("~/.cache/echo-vllm/testbed")


class TestbedError(InputError, RuntimeError):
    """A user-facing testbed problem (bad --out, missing sources): printed without a traceback."""


def testbed_dir(explicit: str | os.PathLike | None = None) -> Path:
    """--out, else $ECHO_TESTBED_DIR, else ~/.cache/echo-vllm/testbed."""
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("ECHO_TESTBED_DIR") or DEFAULT_TESTBED_DIR).expanduser()


def stdlib_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The Python standard library sources (present on every machine with CPython)."""
    path = Path(explicit or os.environ.get("ECHO_STDLIB_DIR") or sysconfig.get_paths()["stdlib"]).expanduser()
    if not path.is_dir():
        raise TestbedError(
            f"stdlib sources not found at {path}: pass --stdlib DIR (or set ECHO_STDLIB_DIR) to a directory of "
            "Python sources to train on"
        )
    if not any(path.glob("*.py")):
        raise TestbedError(f"no .py files in {path}: pass --stdlib DIR pointing at the Python standard library")
    return path


def ensure_writable(out: Path) -> Path:
    """Create `out` (and parents) and prove it writable before hours of nothing are spent on training."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise TestbedError(
            f"--out {out} is not writable ({err.strerror}): choose a directory you can write to"
        ) from None
    return out
