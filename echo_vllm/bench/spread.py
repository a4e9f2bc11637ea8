"""Median and min-max of a figure over rounds: what every speed number of `bench vllm` is reported as."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float
    n: int


def spread(values: Iterable[float | None]) -> Spread | None:
    """None when no round produced the figure; missing (None/NaN) rounds are left out, not counted as zero."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not kept:
        return None
    return Spread(statistics.median(kept), min(kept), max(kept), len(kept))


def median_or_none(values: Iterable[float | None]) -> float | None:
    s = spread(values)
    return None if s is None else s.median
