"""Atomic JSON writes for files that replicas share (calibration, budget profile)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` atomically: a temporary file of this writer's own in the same directory, then a rename.

    Replicas that share a volume may start together with the same missing file and all save it: each writes its
    own uniquely named temporary file (a shared fixed name would let one writer rename another's half-written file
    into place), flushes it to disk, and renames it over `path`. The rename is atomic within one file system, so
    a reader sees either no file or one complete file, and the last writer wins.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; other replicas (other users) must read it
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
