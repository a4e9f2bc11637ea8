"""The one table printer of the benchmarks, and their JSON writer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from echo_vllm.errors import InputError


def format_cell(value: Any) -> str:
    """Floats to 3 decimals, None as '-', anything else (pre-formatted strings included) as str()."""
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


def format_row(cells: Sequence[str], widths: Sequence[int], *, align: str = "<", sep: str = "  ") -> str:
    """One line; `align` '<' pads on the right, '>' on the left. Used alone for tables printed row by row."""
    return sep.join(f"{cell:{align}{width}}" for cell, width in zip(cells, widths, strict=True))


def format_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[str], *, headers: Sequence[str] | None = None, align: str = "<"
) -> str:
    """Header + one line per row, every column as wide as its widest cell."""
    headers = list(columns if headers is None else headers)
    cells = [[format_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    return "\n".join(format_row(line, widths, align=align) for line in [headers, *cells])


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    print(format_table(rows, columns))


def write_text(path: str | Path, text: str, what: str = "--json") -> None:
    """Write a result file; an unwritable path is a one-line InputError naming the option, not a traceback."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as err:
        raise InputError(
            f"{what} {path}: cannot be written ({err.strerror}); give a path in a writable directory"
        ) from None
