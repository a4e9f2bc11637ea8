"""scripts/confidence_stop_replay.py: acceptance past a frontier by its confidence, and the stop's replay."""

from __future__ import annotations

from script_module import load_script


def _line(depth, confidence, accepted, probe=False, batch=1):
    return {"phase": "auto", "batch": batch, "probe": probe, "drafted_depth": depth, "confidence": confidence,
            "accepted": accepted}  # fmt: skip


def test_the_replay_stops_where_every_row_is_below_and_counts_what_it_loses():
    replay = load_script("confidence_stop_replay")
    lines = [
        _line(4, [[0.5, 0.01, 0.001, 0.0001]], []),  # lost after depth 2; the next line: accepted 1
        _line(4, [[0.9, 0.8, 0.7, 0.6]], [1]),  # confident; the next line: accepted 4
        _line(4, [[0.5, 0.01, 0.005, 0.001]], [4], probe=True),  # a probe: left out
        _line(4, [[0.5, 0.01, 0.001, 0.0001]], [0]),  # the last line has no next: left out
    ]
    steps = replay.decode_steps(lines)
    assert [(depth, accepted) for depth, _, accepted in steps] == [(4, [1]), (4, [4])]
    table = replay.acceptance_by_confidence(steps)
    assert table[2][-7] == [1, 0]  # c_2 = 0.01 (2^-6.6): drafted past depth 2, not accepted there
    assert table[3][-1] == [1, 1]  # c_3 = 0.7: accepted through depth 4
    # Stopping below 2^-6 ends the first step at depth 2 (its 1 accepted draft kept), the second drafts on.
    result = replay.replay(steps, -6, base_ms=10.0, level_ms=1.0)
    assert result == {"steps": 2, "stopped": 1, "tokens_lost": 0, "ratio": round((2 + 5) / 26 / ((2 + 5) / 28), 4)}
    # A threshold no row reaches stops nothing.
    assert replay.replay(steps, -20, base_ms=10.0, level_ms=1.0)["stopped"] == 0


def test_a_stop_costs_the_tokens_a_row_accepted_past_it():
    replay = load_script("confidence_stop_replay")
    lines = [_line(3, [[0.2, 0.01, 0.009], [0.3, 0.02, 0.01]], [], batch=2), _line(3, [], [3, 0], batch=2)]
    steps = replay.decode_steps(lines)
    result = replay.replay(steps, -5, base_ms=10.0, level_ms=1.0)  # both rows below 2^-5 = 0.031 at depth 2
    assert result["stopped"] == 1 and result["tokens_lost"] == 1  # row 0 had accepted 3: 2 kept


def test_lost_chain_costs_count_the_levels_drafted_past_every_rows_first_rejection():
    replay = load_script("confidence_stop_replay")

    def line(depth, accepted, total, probe=False, batch=2):
        return {"phase": "auto", "batch": batch, "probe": probe, "drafted_depth": depth, "sum": total,
                "accepted": accepted}  # fmt: skip

    lines = [
        line(4, [], 8),  # all 8 drafts verified; the next line: rows accepted 0 and 1 -> levels 3-4 past both
        line(4, [0, 1], 6),  # a cut; the next line: both rows accepted 4
        line(3, [4, 4], 6, probe=True),  # a probe: left out
        line(4, [0, 0], 8),  # the next line: nothing accepted -> levels 2-4 drafted past
        line(2, [0, 0], 4, batch=1),  # another batch size: left out (and its next line lacks a row)
        line(0, [0], 0),
    ]
    costs = replay.lost_chain_costs(lines, base_ms=10.0, level_ms=1.0)
    assert costs["batch"] == 2 and costs["steps"] == 3 and costs["verified_all"] == 2
    assert costs["levels_after_first_rejection"] == {4: {"steps": 3, "none": 1, "all": 1, "after": round(5 / 3, 2)}}
    assert costs["oracle_stop_saves"] == round(5 / 42, 4)  # 5 levels of 3 x (10 + 4) ms


def test_the_sum_rule_stops_only_when_the_rows_together_are_below_and_prices_verified_drafts():
    replay = load_script("confidence_stop_replay")
    lines = [_line(3, [[0.2, 0.01, 0.009], [0.3, 0.025, 0.01]], [], batch=2), _line(3, [], [1, 0], batch=2)]
    steps = replay.decode_steps(lines)
    assert replay.replay(steps, -5, 10.0, 1.0, rule="every")["stopped"] == 1  # 0.01 and 0.025 both below 0.03125
    assert replay.replay(steps, -5, 10.0, 1.0, rule="sum")["stopped"] == 0  # 0.035 together: not below
    assert replay.replay(steps, -4, 10.0, 1.0, rule="sum")["stopped"] == 1  # below 0.0625
    # With 0.5 ms per verified draft a level costs 1 + 2 x 0.5 ms: (3 tokens / 14 ms) against (3 / 16), nothing lost.
    result = replay.replay(steps, -4, 10.0, 1.0, token_ms=0.5, rule="sum")
    assert result["tokens_lost"] == 0 and result["ratio"] == round(16 / 14, 4)
