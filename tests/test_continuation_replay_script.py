"""scripts/continuation_replay.py: a step's continuation events come from its selection and the next line's result."""

from __future__ import annotations

import pytest
from script_module import load_script


def _line(step, depth, counts, accepted):
    return {"step": step, "batch": len(counts), "drafted_depth": depth, "counts": counts, "accepted": accepted}


def test_the_replay_pairs_each_selection_with_the_next_lines_result_and_both_memories_count_it():
    replay = load_script("continuation_replay")
    lines = [
        _line(1, 2, [2, 2], []),  # selection: both requests verify 2 drafts
        _line(2, 0, [0, 0], [2, 0]),  # its result: one accepted both, one neither; then a plain step
        _line(3, 1, [1, 0], []),  # a depth-1 selection for one request
        _line(4, 1, [1, 1], [1]),  # its result
    ]
    steps = replay.verified_steps(lines)
    assert [(line["step"], counts, accepted) for line, counts, accepted in steps] == [
        (1, [2, 2], [2, 0]),
        (3, [1], [1]),
    ]
    rows = replay.replay(lines, max_depth=2)
    assert [row["step"] for row in rows] == [1, 3]
    # After step 1: depth 1 tried 2, passed 1; depth 2 tried 1 (the one that accepted depth 1), passed 1.
    first = rows[0]
    assert first["tries"] == pytest.approx(first["steps"])
    pooled = (2 + 2) / (3 + 4)
    assert first["tries"] == pytest.approx([(1 + 4 * pooled) / (2 + 4), (1 + 4 * pooled) / (1 + 4)])
    # Step 3 tried depth 1 only: 'tries' leaves depth 2's counts as they were, 'steps' fades them one request-step.
    assert rows[1]["tries"][1] != pytest.approx(rows[1]["steps"][1], abs=1e-12)
