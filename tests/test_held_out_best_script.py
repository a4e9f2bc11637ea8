"""scripts/held_out_best.py: each round's baseline is picked on the other rounds, never on the round it scores."""

from __future__ import annotations

import json

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


def test_runs_pool_their_rounds_paired_within_each_run():
    tool = load_script("held_out_best")
    run_a = [
        _row("nospec", [100.0, 100.0]),
        _row("eagle3", [120.0, 110.0], depth=1),
        _row("echo-auto", [130.0, 121.0]),
        _row("eagle3", [1.0, 1.0], depth=3),  # only run a measured @3: not a candidate in the pool
    ]
    run_b = [  # a slower night: every method ~20 % lower; three rounds for the baselines, two for ECHO
        _row("nospec", [80.0, 80.0, 80.0]),
        _row("eagle3", [96.0, 88.0, 90.0], depth=1),
        _row("echo-auto", [80.0, 99.0]),
    ]
    pooled = tool.pool_rounds([run_a, run_b], "echo-auto")
    rounds = {(r["method"], r["depth"]): r["tokens_per_s_rounds"] for r in pooled}
    assert rounds == {
        ("nospec", None): [100.0, 100.0, 80.0, 80.0],
        ("eagle3", 1): [120.0, 110.0, 96.0, 88.0],  # b's third round dropped: ECHO has two there
        ("echo-auto", None): [130.0, 121.0, 80.0, 99.0],
    }
    (row,) = tool.held_out(pooled, "echo-auto")
    assert row["held_out_picks"] == ["eagle3@1"] * 4
    assert row["held_out_ratios"] == pytest.approx([130 / 120, 121 / 110, 80 / 96, 99 / 88])
    # A run without the method at a batch size leaves that size out of the pool.
    assert tool.pool_rounds([run_a, [_row("nospec", [1.0])]], "echo-auto") == []


def test_the_command_pools_several_documents(tmp_path, capsys):
    tool = load_script("held_out_best")
    paths = []
    for k, scale in enumerate((1.0, 0.8)):
        rows = [
            _row("nospec", [100.0 * scale, 100.0 * scale]),
            _row("eagle3", [120.0 * scale, 110.0 * scale], depth=2),
            _row("echo-auto", [121.0 * scale, 110.0 * scale]),
        ]
        path = tmp_path / f"run{k}.json"
        path.write_text(json.dumps({"results": rows}))
        paths.append(str(path))
    assert tool.main(paths) == 0
    out = capsys.readouterr().out
    assert out.startswith("batch   4: echo-auto / best median") and out.count("eagle3@2") == 4
