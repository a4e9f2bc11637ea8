"""WidthSchedule: which steps of a tree-mode engine draft siblings."""

from __future__ import annotations

import pytest

from echo_vllm.core.width_schedule import WidthSchedule


def _run(schedule: WidthSchedule, steps: int, probe_every: int, buys: set[int] | None = None) -> list[bool]:
    """Simulate the proposer's calls: probes every `probe_every` steps (depth plan), width bought on the tree steps
    listed in `buys` (and by every probe, which verifies all it drafted)."""
    drafted = []
    for step in range(steps):
        probe = step % probe_every == 0
        trees = schedule.drafts_trees("auto", probe)
        drafted.append(trees)
        schedule.after_plan(probe)
        if trees:
            schedule.observe(probe or step in (buys or set()), probe)
    return drafted


def test_warmup_drafts_chains_and_profile_drafts_trees() -> None:
    schedule = WidthSchedule(patience=2)
    assert not schedule.drafts_trees("warmup", True)
    assert schedule.drafts_trees("profile", False)


@pytest.mark.parametrize("max_depth", [2, 3, 4, 6])
def test_the_profile_drafts_every_depth_once_as_trees_and_once_as_chains(max_depth) -> None:
    """Trees on the profile's even depth blocks, chains on the odd ones: the cost fit sees verifying steps with
    and without tree rows at every depth (with trees everywhere the tree steps' fixed cost could pass for the jump
    of verifying at all, which chain steps then paid)."""
    from echo_vllm.core.time_budget import PROFILE_HOLD, profile_step

    schedule = WidthSchedule()
    cycle = 2 * (max_depth + 1) * PROFILE_HOLD
    shapes = {(profile_step(i, max_depth)[0], schedule.drafts_trees("profile", False, i)) for i in range(cycle)}
    assert shapes == {(d, t) for d in range(max_depth + 1) for t in (True, False)}
    for block in range(2 * (max_depth + 1)):  # whole blocks: a held depth keeps its shape
        held = {schedule.drafts_trees("profile", False, block * PROFILE_HOLD + j) for j in range(PROFILE_HOLD)}
        assert held == {block % 2 == 0}


def test_a_probe_does_not_restart_patience() -> None:
    """The regression: a probe verifies every sibling by rule; counted as bought width, every probe restarted
    `patience` tree-drafting steps and most steps drafted trees although the budget never bought a sibling."""
    drafted = _run(WidthSchedule(patience=3), steps=64, probe_every=16)
    # Patience (three non-probe tree steps after the probe at 0) runs out once; then only each probe and the step
    # after it draft trees.
    expected = [s <= 3 or s % 16 in (0, 1) for s in range(64)]
    assert drafted == expected
    assert sum(drafted) == 4 + 2 * 3


def test_width_bought_at_a_look_restarts_patience() -> None:
    schedule = WidthSchedule(patience=3)
    drafted = _run(schedule, steps=40, probe_every=16, buys={17})
    # Step 17 is the look after the probe at 16: it bought width, so steps 18-20 draft trees too.
    assert [s for s in range(16, 24) if drafted[s]] == [16, 17, 18, 19, 20]
    assert not drafted[21]


def test_without_a_depth_plan_looks_come_from_the_own_clock() -> None:
    schedule = WidthSchedule(patience=1, interval=4)
    drafted = []
    for _ in range(12):
        trees = schedule.drafts_trees("fixed", None)
        drafted.append(trees)
        if trees:
            schedule.observe(False, False)
    assert drafted == [True, False, False, True, False, False, False, True, False, False, False, True]
