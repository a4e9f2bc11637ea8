"""scripts/held_out_best.py: each round's baseline is picked on the other rounds, never on the round it scores."""

from __future__ import annotations

import pytest
from script_module import load_script


def _row(method, rounds, depth=None, batch=4):
    return {"method": method, "depth": depth, "batch_size": batch, "tokens_per_s_rounds": rounds}


def test_the_pick_comes_from_the_other_rounds():
    tool = load_script("held_out_best")
    results = [
        _row("nospec", [100.0, 100.0, 100.0]),
        _row("eagle3", [150.0, 90.0, 90.0], depth=1),  # one lucky round: the best median is @2's, not @1's
        _row("eagle3", [95.0, 110.0, 105.0], depth=2),
        _row("echo-auto", [100.0, 100.0, 100.0]),
        _row("eagle3-best", [999.0, 999.0, 999.0], depth=2),  # the benchmark's own pick is no candidate
    ]
    (row,) = tool.held_out(results, "echo-auto")
    assert row["ratio_vs_best_median"] == pytest.approx(100.0 / 105.0)
    # Round 0 scored against the best of rounds 1-2 (@2: 107.5; nospec 100; @1 90): @2's 95.
    assert row["held_out_picks"] == ["eagle3@2", "eagle3@1", "eagle3@1"]
    assert row["held_out_ratios"] == pytest.approx([100 / 95, 100 / 90, 100 / 90])
    assert row["held_out_ratio"] == pytest.approx(100 / 90)


def test_batches_without_the_method_are_skipped_and_one_round_has_no_held_out_pick():
    tool = load_script("held_out_best")
    results = [_row("nospec", [100.0], batch=4), _row("echo-auto", [90.0], batch=4), _row("nospec", [1.0], batch=8)]
    (row,) = tool.held_out(results, "echo-auto")
    assert row["batch_size"] == 4 and row["held_out_ratio"] is None and row["ratio_vs_best_median"] == 0.9
