"""scripts/step_log_summary.py: the share of the draft loop's deeper levels that the selection verified."""

from __future__ import annotations

import pytest
from script_module import load_script


def test_deep_levels_counts_the_verified_row_levels_past_depth_one() -> None:
    script = load_script("step_log_summary")
    lines = [
        {"drafted_depth": 3, "counts": [3, 1, 0, 2]},  # row-levels past 1: 2 + 0 + 0 + 1 = 3 of 4 x 2
        {"drafted_depth": 3, "counts": [3, 3, 3, 3]},  # 8 of 8
        {"drafted_depth": 2, "counts": [2, 2, 0, 1]},  # 2 of 4
        {"drafted_depth": 3, "counts": [3, 3, 3, 3], "probe": True},  # probes verify everything: left out
        {"drafted_depth": 3, "counts": [3, 3, 3, 3], "probe_rows": 1},  # a partial probe too
        {"drafted_depth": 1, "counts": [1, 1, 1, 1]},  # nothing past depth 1
        {"drafted_depth": 0, "counts": [0, 0, 0, 0]},
    ]
    levels = script.deep_levels(lines)
    assert set(levels) == {2, 3}
    steps, rows, deep_rows, share = levels[3]
    assert (steps, rows, deep_rows) == (2, 4.0, 3.0)  # rows verified past 1: 2 then 4, 3 per step
    assert share == pytest.approx(11 / 16)
    assert levels[2] == (1, 4.0, 2.0, pytest.approx(2 / 4))
    assert script.deep_levels([]) == {}
