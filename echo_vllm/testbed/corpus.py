"""Training text: Python stdlib sources, split by file into train / held-out, deterministically."""

from __future__ import annotations

import hashlib
from pathlib import Path

# Skip generated tables and test data: they teach the tiny model nothing about Python.
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "encodings", "pydoc_data"}
MAX_FILE_BYTES = 200_000


def source_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS.intersection(rel.parts[:-1]):
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
        except OSError:
            continue
        files.append(path)
    return files


def is_heldout(path: Path, root: Path, fraction: float = 0.03) -> bool:
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return digest[0] < int(256 * fraction)


def read_texts(root: Path, max_chars: int | None) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts), capped at max_chars of training text."""
    train, heldout, total = [], [], 0
    for path in source_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if is_heldout(path, root):
            heldout.append(text)
            continue
        if max_chars is not None and total >= max_chars:
            continue
        train.append(text)
        total += len(text)
    return train, heldout
