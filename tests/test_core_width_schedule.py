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
        schedule.after_plan(probe and trees)  # the proposer: a look follows a probe that drafted trees
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
    drafted = _run(WidthSchedule(patience=3, max_backoff=0), steps=64, probe_every=16)  # looks without back-off
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


def _run_without_plan(schedule: WidthSchedule, steps: int) -> list[bool]:
    """No depth plan (an integer k_max): looks from the schedule's own clock; no tree step buys width."""
    drafted = []
    for _ in range(steps):
        trees = schedule.drafts_trees("fixed", None)
        drafted.append(trees)
        if trees:
            schedule.observe(False, False)
    return drafted


def test_without_a_depth_plan_looks_come_from_the_own_clock() -> None:
    drafted = _run_without_plan(WidthSchedule(patience=1, interval=4, max_backoff=0), steps=12)
    assert drafted == [True, False, False, True, False, False, False, True, False, False, False, True]


def test_looks_that_buy_nothing_back_off_and_a_bought_sibling_resets_them() -> None:
    """Where width never pays, a tree probe (its siblings verified) and the tree drafting of its next step are pure
    cost: after q quiet looks in a row only every 2^min(q, 3)-th due probe drafts trees (the rest are chain probes)."""
    probe_every, probes = 16, 26
    drafted = _run(WidthSchedule(patience=3), steps=probe_every * probes, probe_every=probe_every)
    looked = [p for p in range(1, probes) if drafted[p * probe_every]]  # the probe at 0 is inside patience
    # Due looks 1, 2 (after one quiet look: every 2nd), 4 (every 4th), 8, 16, 24 (every 8th at most).
    assert looked == [1, 2, 4, 8, 16, 24]
    for p in looked:  # each look is the probe and the step after it; nothing else drafts trees
        assert drafted[p * probe_every + 1]
    assert sum(drafted) == 4 + 2 * len(looked)
    # A look that buys a sibling resets the back-off: the next due probes draft trees again.
    schedule = WidthSchedule(patience=3)
    drafted = _run(schedule, steps=probe_every * 12, probe_every=probe_every, buys={8 * probe_every + 1})
    assert all(drafted[8 * probe_every + j] for j in range(5))  # the look bought: patience restarts (3 steps)
    assert drafted[9 * probe_every] and drafted[10 * probe_every]  # without the reset the next look came at 16
    assert not drafted[11 * probe_every]  # two quiet looks since: every 4th due one again


def test_without_a_depth_plan_looks_back_off_too() -> None:
    drafted = _run_without_plan(WidthSchedule(patience=1, interval=4), steps=40)
    # Step 0 is patience; looks due at steps 3, 7, 11, ...: taken at due counts 1, 2, 4, 8.
    assert [i for i, t in enumerate(drafted) if t] == [0, 3, 7, 15, 31]
