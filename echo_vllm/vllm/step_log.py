"""ECHO's per-step log (ECHO_VLLM_STEP_LOG): one JSON line per step, kept in memory and written in batches.

The log is the benchmark's oracle input and the tests' evidence; it is off in production. Written line by line
it cost ~0.2 ms of every step inside the engine on the testbed's 2-core CPU (JSON encoding, the selection hash,
the cost model's per-depth figures and a write call, slowed by the engine's busy worker threads) - time the
benchmark charged to ECHO's steps and to no baseline's. So a step only appends its raw values (`StepRecord`:
references to fresh lists, no encoding); `flush` encodes and writes them.

Flushes: when `max_buffered` records are waiting (bounded memory), when `flush_seconds` have passed since the last
flush (0: never by time), on request (`flush_all`: the offline runner asks through `LLM.collective_rpc` before it
reads the log's size and after its timed generate, so a benchmark's timed part encodes nothing) and at interpreter
exit. A process killed without exit handlers loses what is buffered: a debug log, never the engine's output.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

FLUSH_SECONDS_ENV = "ECHO_VLLM_STEP_LOG_FLUSH_S"  # seconds between flushes by time; 0 = none (benchmarks)
DEFAULT_FLUSH_SECONDS = 1.0
MAX_BUFFERED = 4096  # records kept before a flush regardless of time (~1-2 KB each as Python objects)


class StepRecord(NamedTuple):
    """One step's raw values. `fields` is the JSON object less the derived entries; `ragged` each request's
    chosen draft tokens (tuples: a snapshot, whatever vLLM does with its lists later); `model_ms` a function that
    returns the cost model's per-depth step (None: no cost model), evaluated at flush."""

    fields: dict[str, Any]
    ragged: tuple[tuple[int, ...], ...]
    rounded: dict[str, Sequence[float | None]]
    model_ms: Callable[[], list[float]] | None


def encode(record: StepRecord) -> str:
    """The record's JSON line (without the newline), in the log's field order."""
    # The selection hash covers every request's chosen draft tokens: equal hashes on every TP rank in every step
    # mean the ranks made the same budget decision (vLLM uses only the output rank's lists).
    out = dict(record.fields)
    out["selection_hash"] = hashlib.sha1(json.dumps(record.ragged).encode()).hexdigest()[:16]
    for key, values in record.rounded.items():
        out[key] = [None if v is None else round(v, 4) for v in values]
    if record.model_ms is not None:
        out["model_ms"] = record.model_ms()
    if out.get("confidence"):  # [B][d] path confidences: 6 decimals keep 2^-12 to ~0.2 % (and the line short)
        out["confidence"] = [[round(c, 6) for c in row] for row in out["confidence"]]
    return json.dumps(out)


class StepLogWriter:
    def __init__(self, path: str, *, flush_seconds: float | None = None, max_buffered: int = MAX_BUFFERED) -> None:
        self.path = path
        if flush_seconds is None:
            flush_seconds = float(os.environ.get(FLUSH_SECONDS_ENV) or DEFAULT_FLUSH_SECONDS)
        self.flush_seconds = flush_seconds
        self.max_buffered = max(1, max_buffered)
        self._pending: list[StepRecord] = []
        self._last_flush = time.monotonic()
        _WRITERS.add(self)

    def append(self, record: StepRecord) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.max_buffered or (
            self.flush_seconds > 0 and time.monotonic() - self._last_flush >= self.flush_seconds
        ):
            self.flush()

    def flush(self) -> int:
        """Encode and append every waiting record to the file; returns how many."""
        pending, self._pending = self._pending, []
        self._last_flush = time.monotonic()
        if not pending:
            return 0
        with open(self.path, "a") as handle:
            handle.write("".join(encode(record) + "\n" for record in pending))
        return len(pending)


_WRITERS: weakref.WeakSet[StepLogWriter] = weakref.WeakSet()


def flush_all() -> int:
    """Flush every live writer of this process; returns the records written."""
    return sum(writer.flush() for writer in list(_WRITERS))


atexit.register(flush_all)


def read_step_log(path: str | Path, last: int = 0, *, offset: int = 0, rank: int | None = None) -> list[dict[str, Any]]:
    """The log's lines as dicts, in step order: from byte `offset` on (where a benchmark's timed generate starts,
    its warm-up's lines before it), only `rank`'s lines if given (TP ranks share one log), then the newest `last`
    if > 0. Blank lines (a flush cut by a kill) are skipped."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        text = handle.read().decode("utf-8")
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    if rank is not None:
        lines = [line for line in lines if int(line.get("rank", 0)) == rank]
    return lines[-last:] if last > 0 else lines
