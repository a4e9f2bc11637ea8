"""The time-aware budget: the chooser, ECHO's order, the exact early exit of drafting, the draft plan, acceptance."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.core.acceptance import AcceptanceModel
from echo_vllm.core.auto_budget import (
    DraftController,
    DraftPlan,
    LevelMemory,
    choose_budget,
    drafting_can_stop,
    drafts_below_confidence,
    load_bucket,
    priority_rank,
    select_auto,
    select_by_rank,
)
from echo_vllm.core.budget import add_surplus_tails
from echo_vllm.core.gating import Gates, depth_confidence
from echo_vllm.core.time_budget import level_counts
from echo_vllm.core.tree import DraftTree
from echo_vllm.ops import select_budget


def _chains(logps: torch.Tensor, valid_rows: torch.Tensor | None = None) -> DraftTree:
    batch, depth = logps.shape
    scores = torch.cumsum(logps, dim=1)
    valid = torch.isfinite(scores)
    if valid_rows is not None:
        valid &= valid_rows.unsqueeze(1)
    return DraftTree(
        tokens=torch.arange(batch * depth).reshape(batch, depth),
        scores=scores.contiguous(),
        parent=torch.arange(-1, depth - 1, dtype=torch.int32).expand(batch, depth).contiguous(),
        depth=torch.arange(1, depth + 1, dtype=torch.int32).expand(batch, depth).contiguous(),
        valid=valid,
        spine=torch.ones((batch, depth), dtype=torch.bool),
    )


class _Cal:
    """A calibration stand-in: gates at `gated` depths with thresholds `tau` (what Gates.evaluate reads)."""

    def __init__(self, gated: list[bool], tau: list[float]) -> None:
        self.max_depth = len(gated)
        self._gated, self._tau = torch.tensor(gated), torch.tensor(tau, dtype=torch.float32)

    def gate_tensors(self, device):
        return self._gated.to(device), self._tau.to(device)


def _gates(confidence: torch.Tensor, cal: _Cal | None, max_depth: int) -> Gates:
    batch, depth = confidence.shape
    pad = torch.full((batch, max_depth - depth), float("inf"))
    return Gates.evaluate(torch.cat([confidence, pad], dim=1), cal)


# -- the chooser ---------------------------------------------------------------------------------------------------


def test_chooser_picks_zero_when_verification_is_linear_and_acceptance_low():
    gains = torch.full((8,), 0.1, dtype=torch.float64)
    depth = torch.tensor([1, 1, 2, 2, 3, 3, 4, 4])
    rest = 0.01 * (1 + torch.arange(9, dtype=torch.float64))  # every verified token costs a full step's worth
    choice = choose_budget(
        gains, depth, torch.ones(8, dtype=torch.bool), rest, torch.zeros(5), base_tokens=1.0, k_cap=8
    )
    assert int(choice.k) == 0 and int(choice.depth) == 0 and int(choice.last_position) == -1


def test_chooser_picks_the_knee_of_a_flat_then_linear_curve():
    # B = 1; the step costs the same up to 8 tokens, then 0.2 per token; every candidate is accepted w.p. 0.6.
    n = 16
    tokens = 1 + torch.arange(n + 1, dtype=torch.float64)
    rest = 1.0 + 0.2 * (tokens - 8).clamp(min=0)
    choice = choose_budget(
        torch.full((n,), 0.6, dtype=torch.float64),
        torch.arange(1, n + 1),
        torch.ones(n, dtype=torch.bool),
        rest,
        torch.zeros(n + 1),
        base_tokens=1.0,
        k_cap=n,
    )
    assert int(choice.k) == 7  # 1 + 7 = 8 tokens: the knee
    assert float(choice.predicted_accepted) == pytest.approx(4.2)


def test_chooser_charges_tree_steps_for_their_nodes_off_the_spine():
    # Four spine candidates, then four width candidates, all at depth 1, on a flat verification curve: width is
    # free by tokens alone, so it is bought; once tree steps cost their measured extra, it is not.
    gains = torch.tensor([0.8, 0.7, 0.6, 0.5, 0.3, 0.3, 0.2, 0.2], dtype=torch.float64)
    width = torch.tensor([False] * 4 + [True] * 4)
    args = (gains, torch.ones(8, dtype=torch.long), torch.ones(8, dtype=torch.bool), torch.ones(9), torch.zeros(2))
    free = choose_budget(*args, base_tokens=1.0, k_cap=8, ordered_width=width)
    assert int(free.k) == 8
    costly = choose_budget(*args, base_tokens=1.0, k_cap=8, ordered_width=width, tree_terms=(0.5, 0.05))
    assert int(costly.k) == 4  # the spines only: a chain step
    cheap = choose_budget(*args, base_tokens=1.0, k_cap=8, ordered_width=width, tree_terms=(0.05, 0.01))
    assert int(cheap.k) == 8


def test_chooser_charges_width_the_drafting_of_trees():
    # The same candidates on a flat curve (1 s) with drafting that costs 1 s as chains: the spines give
    # (1 + 2.6) / 2 = 1.8 tokens/s. Width pays while drafting trees costs no more, or 0.4 s more, and not at 1 s more.
    gains = torch.tensor([0.8, 0.7, 0.6, 0.5, 0.3, 0.3, 0.2, 0.2], dtype=torch.float64)
    width = torch.tensor([False] * 4 + [True] * 4)
    args = (gains, torch.ones(8, dtype=torch.long), torch.ones(8, dtype=torch.bool), torch.ones(9), torch.ones(2))
    same = choose_budget(*args, base_tokens=1.0, k_cap=8, ordered_width=width, tree_draft_seconds=torch.ones(2))
    assert int(same.k) == 8  # (1 + 3.6) / 2 = 2.3 against the spines' (1 + 2.6) / 2 = 1.8
    dear = choose_budget(*args, base_tokens=1.0, k_cap=8, ordered_width=width, tree_draft_seconds=torch.full((2,), 2.0))
    assert int(dear.k) == 4  # (1 + 3.6) / 3 = 1.53 < 1.8: a chain step
    near = choose_budget(*args, base_tokens=1.0, k_cap=8, ordered_width=width, tree_draft_seconds=torch.full((2,), 1.4))
    assert int(near.k) == 8  # (1 + 3.6) / 2.4 = 1.92 > 1.8
    # Only prefixes with width pay the tree drafting: the spines' prefixes keep their chain price.
    spines = choose_budget(
        *args, base_tokens=1.0, k_cap=4, ordered_width=width, tree_draft_seconds=torch.full((2,), 9.0)
    )
    assert int(spines.k) == 4


def test_chooser_charges_the_draft_depth_and_respects_cap_and_floor():
    gains = torch.tensor([0.9, 0.9, 0.05, 0.05], dtype=torch.float64)
    depth = torch.tensor([1, 1, 2, 2])  # two requests, depth 2 each, in rank order
    rest = torch.ones(5, dtype=torch.float64)
    draft = torch.tensor([0.0, 0.1, 0.5], dtype=torch.float64)  # depth 2 costs more than its gains are worth
    eligible = torch.ones(4, dtype=torch.bool)
    choice = choose_budget(gains, depth, eligible, rest, draft, base_tokens=2.0, k_cap=4)
    assert int(choice.depth) == 1 and int(choice.k) == 2
    capped = choose_budget(gains, depth, eligible, rest, draft, base_tokens=2.0, k_cap=1)
    assert int(capped.k) == 1
    low = torch.full((4,), 0.0, dtype=torch.float64)
    floored = choose_budget(low, depth, eligible, rest + torch.arange(5), draft, base_tokens=2.0, k_cap=4, k_min=2)
    assert int(floored.k) == 2  # a probe step verifies at least k_min although nothing pays
    # A floor above what is eligible (a row dropped as a partial prefill): the probe verifies all there is, where
    # it used to find no allowed cut and decode plain.
    short = torch.tensor([True, False, True, False])
    all_there_is = choose_budget(low, depth, short, rest + torch.arange(5), draft, base_tokens=2.0, k_cap=4, k_min=4)
    assert (int(all_there_is.k), int(all_there_is.depth)) == (2, 2)
    nothing = choose_budget(
        low, depth, torch.zeros(4, dtype=torch.bool), rest, draft, base_tokens=2.0, k_cap=4, k_min=4
    )
    assert int(nothing.k) == 0 and int(nothing.last_position) == -1  # nothing eligible: plain decoding


def _random_tree(seed: int, batch: int, depth: int):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand((batch, depth), generator=gen) * 2.5
    logps[torch.rand((batch, depth), generator=gen) < 0.1] = float("-inf")
    return _chains(logps), gen


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 6),
    depth=st.integers(1, 5),
    k=st.integers(0, 30),
    gated=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_rank_order_is_the_fixed_rule(seed, batch, depth, k, gated):
    """The first k of ECHO's order = select_budget(k) + add_surplus_tails(k): both modes cut the same order."""
    tree, gen = _random_tree(seed, batch, depth)
    cal = _Cal(gated[:depth], torch.rand(depth, generator=gen).tolist())
    gates = _gates(depth_confidence(tree), cal, depth)
    rank, eligible = priority_rank(tree, gates, surplus_tail=True)
    by_rank = select_by_rank(tree, rank, eligible, k)
    fixed = add_surplus_tails(select_budget(tree, gates, k), tree, gates, k)
    assert torch.equal(by_rank.selected, fixed.selected)
    no_tail_rank, no_tail_eligible = priority_rank(tree, gates, surplus_tail=False)
    assert torch.equal(
        select_by_rank(tree, no_tail_rank, no_tail_eligible, k).selected, select_budget(tree, gates, k).selected
    )


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 8),
    depth=st.integers(2, 6),
    k_cap=st.integers(0, 40),
    gated=st.lists(st.booleans(), min_size=6, max_size=6),
    surplus_tail=st.booleans(),
    auto=st.booleans(),
)
def test_early_exit_selects_what_full_drafting_selects(seed, batch, depth, k_cap, gated, surplus_tail, auto):
    """Stop at the first depth where drafting_can_stop says so: the selection equals the full tree's."""
    full, gen = _random_tree(seed, batch, depth)
    cal = _Cal(gated[:depth], (torch.rand(depth, generator=gen) * 0.6).tolist())
    gains = torch.rand((batch, depth), generator=gen).sort(dim=1, descending=True).values
    rest = torch.linspace(1.0, 3.0, batch * depth + 1, dtype=torch.float64) + torch.rand(1, generator=gen).double()
    draft = torch.linspace(0.0, 0.5, depth + 1, dtype=torch.float64)

    def select(tree: DraftTree, drafted: int):
        gates = _gates(depth_confidence(tree)[:, :drafted], cal, depth)
        if auto:
            return select_auto(
                tree, gates, gains, rest, draft, base_tokens=float(batch), k_cap=k_cap, surplus_tail=surplus_tail
            ).selection.selected
        rank, eligible = priority_rank(tree, gates, surplus_tail)
        return select_by_rank(tree, rank, eligible, k_cap).selected

    stop = depth
    for d in range(1, depth):
        scores, valid = full.scores[:, :d], full.valid[:, :d]
        conf = torch.exp(torch.where(valid, scores, torch.full_like(scores, float("-inf"))))
        if bool(drafting_can_stop(scores, valid, _gates(conf, cal, depth), k_cap, surplus_tail)):
            stop = d
            break
    truncated_valid = full.valid.clone()
    truncated_valid[:, stop:] = False
    truncated = full._replace(valid=truncated_valid)
    assert torch.equal(select(truncated, stop), select(full, depth))


def test_early_exit_fires_when_the_budget_is_full_and_not_before():
    logps = torch.log(torch.tensor([[0.9, 0.9, 0.9], [0.2, 0.2, 0.2]]))
    tree = _chains(logps)
    gates = Gates.open(2, 3)
    # After depth 1: scores 0.9 and 0.2; one slot is filled by a node at least as good as any frontier -> stop.
    assert bool(drafting_can_stop(tree.scores[:, :1], tree.valid[:, :1], gates, 1, surplus_tail=True))
    # Two slots: request 0's depth-2 node (0.81) beats request 1's depth-1 node (0.2): keep drafting.
    assert not bool(drafting_can_stop(tree.scores[:, :1], tree.valid[:, :1], gates, 2, surplus_tail=True))
    # Every frontier invalid: nothing deeper exists.
    dead = torch.zeros((2, 1), dtype=torch.bool)
    assert bool(drafting_can_stop(tree.scores[:, :1], dead, gates, 5, surplus_tail=True))


def test_the_confidence_stop_needs_every_kept_row_below_the_threshold():
    """draft_stop_confidence: the loop stops only when no kept row's frontier reaches the threshold (a deeper node
    never scores above its frontier); discarded rows do not keep it going, NaN rows do (never read as low)."""
    threshold = math.log(0.1)
    low_high = torch.log(torch.tensor([0.05, 0.3]))
    assert not drafts_below_confidence(low_high, None, threshold)  # row 1 is still worth drafting for
    assert drafts_below_confidence(torch.log(torch.tensor([0.05, 0.09])), None, threshold)
    assert drafts_below_confidence(low_high, torch.tensor([True, False]), threshold)  # row 1's drafts are dropped
    assert not drafts_below_confidence(low_high, torch.tensor([False, False]), threshold)  # no row to decide on
    assert not drafts_below_confidence(torch.tensor([math.log(0.01), float("nan")]), None, threshold)
    # At the threshold itself the row is not below: the loop goes on.
    assert not drafts_below_confidence(torch.tensor([threshold]), None, threshold)


# -- the draft plan ------------------------------------------------------------------------------------------------


def test_draft_controller_drafts_to_the_depth_worth_most_and_probes():
    control = DraftController(3, window=2, probe_interval=6, alpha=0.5)
    first = control.plan(batch=8, ceiling=24)
    assert first.depth == 3 and first.k_cap == 24  # nothing measured yet: full depth
    control.observe(6)
    control.observe_levels([1.0, 1.5, 2.0, 1.8])
    plan = control.plan(8, 24)
    assert plan.depth == 2 and plan.k_cap == 24 and not plan.probe  # depth 2 was worth most
    control.observe(2)
    control.observe_levels([1.0, 1.2, 1.0])  # drafted to 2: depths 0..2 averaged, depth 3 kept
    # Bias-corrected averages with weight a = 0.5: (0.5 x 0.5 x old + 0.5 x new) / (0.5 x 0.5 + 0.5).
    assert control.value == pytest.approx([1.0, (0.25 * 1.5 + 0.5 * 1.2) / 0.75, (0.25 * 2.0 + 0.5 * 1.0) / 0.75, 1.8])
    assert control.plan(8, 24).depth == 3  # depth 3's (older) value now leads
    for _ in range(2):
        control.observe(0)
        control.observe_levels([3.0, 1.0, float("-inf"), float("nan")])
    plan = control.plan(8, 24)
    assert plan.depth == 0 and plan.k_cap == 16  # plain decoding leads (the cap keeps >= 2 B)
    control.observe(0)  # a plain step: nothing measured
    probe = control.plan(8, 24)  # step 6: a probe
    assert probe.probe and probe.depth == 3 and probe.k_cap == 24


def test_the_paired_lead_of_one_depth_over_another_and_its_standard_error():
    """LevelMemory.lead: the weighted mean of the per-step difference and its standard error over the effective
    sample size of the exponential weights (checked against a direct computation)."""
    memory = LevelMemory(2)
    assert memory.lead(1, 0) == (0.0, float("inf"))
    steps = [[1.0, 1.30, 1.10], [1.0, 1.05, 1.40], [1.0, 1.20, float("nan")], [1.0, 1.10, 1.00]]
    a = 0.3
    for levels in steps:
        memory.add(levels, a, 8)
    weights = [a * (1 - a) ** (len(steps) - 1 - i) for i in range(len(steps))]
    diffs = [levels[1] - levels[0] for levels in steps]
    w, w2 = sum(weights), sum(x * x for x in weights)
    mean = sum(x * d for x, d in zip(weights, diffs)) / w
    n_eff = w * w / w2
    var = (sum(x * d * d for x, d in zip(weights, diffs)) / w - mean * mean) * n_eff / (n_eff - 1)
    got_mean, got_error = memory.lead(1, 0)
    assert got_mean == pytest.approx(mean) and got_error == pytest.approx((var / n_eff) ** 0.5)
    assert memory.lead(0, 1)[0] == pytest.approx(-mean) and memory.lead(0, 1)[1] == pytest.approx(got_error)
    # Depth 2 was not measured on the third step: its pair with depth 1 counts three steps, not four.
    kept = [i for i, levels in enumerate(steps) if levels[2] == levels[2]]
    w3 = [a * (1 - a) ** sum(1 for j in kept if j > i) for i in kept]
    mean21 = sum(x * (steps[i][2] - steps[i][1]) for x, i in zip(w3, kept)) / sum(w3)
    assert memory.lead(2, 1)[0] == pytest.approx(mean21)
    one = LevelMemory(1)
    one.add([1.0, 2.0], a, 8)
    assert one.lead(1, 0) == (pytest.approx(1.0), float("inf"))  # one step: no error estimate, no switch on it


def test_level_memory_skips_the_paired_sums_unless_a_switch_margin_reads_them():
    """Without a switch margin nothing reads `lead`: the controller's memories keep the values only (the same
    values), and asking one for a lead is an error, not a silent zero."""
    steps = [[1.0, 1.30, 1.10], [1.0, 1.05, 1.40], [1.0, 1.20, float("nan")], [1.0, 1.10, 1.00]]
    full, lean = LevelMemory(2), LevelMemory(2, pairs=False)
    for levels in steps:
        full.add(levels, 0.3, 8)
        lean.add(levels, 0.3, 8)
    assert lean.value == full.value and lean.measured_requests == full.measured_requests
    with pytest.raises(ValueError, match="pairs=True"):
        lean.lead(1, 0)
    for margin, pairs in ((0.0, False), (1.0, True)):
        control = DraftController(2, probe_interval=0, switch_margin=margin)
        control.observe_levels([1.0, 1.1, 1.2], 16)
        assert control._memory_of(load_bucket(16)).pairs is pairs


def _plan_switches(margin: float, lead_of_two: float, seed: int, steps: int = 400) -> tuple[int, list[int]]:
    """A batch-16 plan over depths 0..2 whose per-step worths are noisy (s.d. 0.1 of plain, as measured on the
    testbed) around 1.0 / 1.15 / 1.15 + lead_of_two: the number of times the plan changed depth, and its depths."""
    gen = torch.Generator().manual_seed(seed)
    control = DraftController(2, probe_interval=0, switch_margin=margin)
    depths = []
    for _ in range(steps):
        plan = control.plan(16, 32)
        depths.append(plan.depth)
        control.observe(16)
        noise = torch.randn(2, generator=gen).tolist()
        control.observe_levels([1.0, 1.15 + 0.1 * noise[0], 1.15 + lead_of_two + 0.1 * noise[1]], 16)
    return sum(1 for x, y in zip(depths[1:], depths[2:]) if x != y), depths


def test_a_switch_margin_keeps_the_plan_still_between_depths_worth_the_same():
    """Depths 1 and 2 worth the same: the argmax follows the noise; with a margin of 2 standard errors the plan
    changes depth a handful of times; it never goes plain (far below both)."""
    for seed in range(3):
        loose, _ = _plan_switches(0.0, 0.0, seed)
        still, depths = _plan_switches(2.0, 0.0, seed)
        assert loose > 40, loose
        assert still < loose / 4, (still, loose)
        assert 0 not in depths


def test_a_switch_margin_still_follows_a_real_lead():
    """Depth 2 worth 0.1 of plain more than depth 1 (one per-step s.d.): with the margin the plan settles at depth
    2 and stays there on most steps."""
    for seed in range(3):
        _, depths = _plan_switches(2.0, 0.1, seed)
        assert depths[-200:].count(2) > 180, depths[-200:].count(2)


def _steps_to_leave_a_collapsed_depth(margin: float) -> int:
    gen = torch.Generator().manual_seed(0)
    control = DraftController(2, probe_interval=0, switch_margin=margin)
    for step in range(120):
        plan = control.plan(16, 32)
        if step == 60:
            assert plan.depth == 2
        if step >= 60:
            after = step - 60
            if plan.depth == 1:
                break
        control.observe(16)
        noise = torch.randn(2, generator=gen).tolist()
        two = 1.4 if step < 60 else 0.9
        control.observe_levels([1.0, 1.15 + 0.05 * noise[0], two + 0.05 * noise[1]], 16)
    assert plan.depth == 1
    return after


def test_a_switch_margin_leaves_a_depth_whose_worth_collapses():
    """The plan sits at depth 2; then depth 2 turns much worse than depth 1 (text got hard): with the margin it
    moves within ~10 steps (the change itself inflates the difference's variance), the argmax within ~4."""
    assert _steps_to_leave_a_collapsed_depth(0.0) <= 4
    assert _steps_to_leave_a_collapsed_depth(2.0) <= 10


def test_next_depth_probes_draft_one_deeper_than_the_best():
    """probe_depth 'next': a probe drafts one depth deeper than the plan's best and verifies all of it (its cap is
    that depth's share of the ceiling), not B x D drafts; a plan at plain decoding probes one deeper than its best
    drafting depth; before the plan has measurements, and at the max depth, the probe is a full one."""
    control = DraftController(3, window=2, probe_interval=3, alpha=0.5, probe_next=True)
    first = control.plan(batch=8, ceiling=24)
    assert (first.depth, first.k_cap) == (3, 24)  # nothing measured yet: full depth
    for _ in range(2):
        control.observe(0)
        control.observe_levels([3.0, 1.0, 0.5, 0.2])
    probe = control.plan(8, 24)  # step 2: plain decoding leads, depth 1 is the best drafting depth; a probe is due
    assert probe.probe and (probe.depth, probe.k_cap) == (2, 16)
    control.observe(8)
    for _ in range(3):
        control.observe(16)
        control.observe_levels([1.0, 1.5, 2.0, 2.5])
    plan = control.plan(8, 24)  # step 6: depth 3 (the max) leads; the probe is full
    assert plan.probe and (plan.depth, plan.k_cap) == (3, 24)
    control.observe(24)
    for _ in range(2):
        control.observe_levels([1.0, 1.5, 2.0, 1.0])
    assert control.plan(8, 24) == DraftPlan(2, 24, False)  # step 7: depth 2 leads
    control.observe(16)
    control.observe(16)
    assert control.plan(8, 24) == DraftPlan(3, 24, True)  # depth 2 leads: the probe drafts and verifies 3
    # Plain leads and depth 2 is the best drafting depth (a stretch where depth 1 alone pays less than plain): the
    # probe drafts 3 (measuring 1..3 directly), not depth 1.
    from_plain = DraftController(3, probe_interval=1, alpha=0.5, probe_next=True)
    from_plain.observe(0)
    from_plain.observe_levels([1.0, 0.8, 0.95, 0.9])
    assert from_plain.plan(8, 24) == DraftPlan(3, 24, True)
    full = DraftController(3, probe_interval=1, alpha=0.5)
    full.observe(0)
    full.observe_levels([3.0, 1.0, 0.5, 0.2])
    assert full.plan(8, 24) == DraftPlan(3, 24, True)  # 'full' (the default): every probe at the max depth


def _probe_steps(control: DraftController, batches: list[int]) -> list[int]:
    steps = []
    for t, batch in enumerate(batches):
        if control.plan(batch, 4 * batch).probe:
            steps.append(t)
        control.observe(batch)
    return steps


def test_probes_come_every_interval_or_scaled_by_the_load():
    """probe_load_scale 0: every probe_interval steps at any batch; S > 0: every probe_interval x ceil(B / S)
    steps, following the batch as it changes (counted from the last probe)."""
    assert _probe_steps(DraftController(3, probe_interval=8), [64] * 40) == [7, 15, 23, 31, 39]
    assert _probe_steps(DraftController(3, probe_interval=8, probe_load_scale=4), [4] * 20) == [7, 15]
    assert _probe_steps(DraftController(3, probe_interval=8, probe_load_scale=4), [16] * 70) == [31, 63]
    # 20 steps at batch 16 (no probe yet: 32 are due), then batch 1: due at once, then every 8 steps
    mixed = [16] * 20 + [1] * 20
    assert _probe_steps(DraftController(3, probe_interval=8, probe_load_scale=4), mixed) == [20, 28, 36]
    assert DraftController(3, probe_interval=0, probe_load_scale=4).probe_every(64) == 0


def test_a_plan_at_plain_probes_every_interval_at_any_load():
    """With probe_load_scale S > 0, a load slot whose plan chose plain decoding probes every probe_interval steps
    (its probes are its only way back to drafting); once it drafts again, the scaled interval returns."""
    control = DraftController(3, probe_interval=8, probe_load_scale=4, alpha=1.0)
    batch = 64
    for _ in range(40):  # enough measured request-steps; plain worth most
        control.observe_levels([1.0, 0.8, 0.7, 0.6], batch)
    assert control.probe_every(batch) == 8 * 16  # no plan chosen yet in this slot: scaled
    assert control.plan(batch, 4 * batch) == DraftPlan(0, 2 * batch, False)
    control.observe(0)
    assert control.probe_every(batch) == 8
    assert control.probe_every(16) == 8 * 4  # another load slot keeps its own scaled interval
    probes = []
    for t in range(1, 30):
        plan = control.plan(batch, 4 * batch)
        if plan.probe:
            probes.append(t)
        control.observe(0)
    assert probes == [7, 15, 23]  # every 8 steps from the start (scaled: none before step 127)
    for _ in range(3):  # drafting pays again: the plan leaves plain, and the scaled interval returns
        control.observe_levels([1.0, 1.5, 1.2, 1.1], batch)
    assert control.plan(batch, 4 * batch).depth == 1
    assert control.probe_every(batch) == 8 * 16


def test_load_slots_keep_the_usual_batch_sizes_inside():
    from echo_vllm.core.auto_budget import load_bucket

    slots = {b: load_bucket(b) for b in (1, 2, 3, 5, 6, 8, 11, 12, 16, 23, 24, 31, 32, 47, 48, 64, 95, 96, 128, 256)}
    assert slots == {
        1: 0, 2: 1, 3: 2, 5: 2, 6: 3, 8: 3, 11: 3, 12: 4, 16: 4, 23: 4, 24: 5, 31: 5, 32: 5, 47: 5, 48: 6, 64: 6,
        95: 6, 96: 7, 128: 7, 256: 8,
    }  # fmt: skip


def test_the_depth_plan_remembers_each_load_separately():
    """A busy stretch where plain decoding is best must not decide a quiet stretch where depth pays (and back)."""
    control = DraftController(4, probe_interval=0)
    busy, quiet = [1.0, 0.9, 0.85, 0.8, 0.75], [1.0, 1.2, 1.35, 1.45, 1.5]
    for _ in range(20):
        assert control.plan(32, 128).depth in (0, 4)  # 4 until measured, then plain
        control.observe_levels(busy, batch=32)
    assert control.plan(32, 128).depth == 0 and control.plan(31, 124).depth == 0  # one slot for 24-47
    # The first steps at batch 4: no memory of that load yet -> full depth (the shared average said plain).
    assert control.plan(4, 16).depth == 4 and control.value == [None] * 5
    for _ in range(3):
        control.observe_levels(quiet, batch=4)
    assert control.plan(4, 16).depth == 4 and control.value == pytest.approx(quiet)
    assert control.plan(32, 128).depth == 0  # the busy slot kept its verdict
    assert control.value == pytest.approx(busy)


def _run_steps(control: DraftController, batch: int, levels: list[float], steps: int) -> None:
    """`steps` planned and measured steps at `batch`, each worth `levels` in hindsight."""
    for _ in range(steps):
        control.plan(batch, 4 * batch)
        control.observe_levels(levels, batch=batch)
        control.observe(2 * batch)


def test_a_stale_load_slot_entered_from_a_fresh_neighbour_starts_from_its_values():
    """A queue draining into loads last measured long ago (e.g. the warm-up's drain, its hardest requests) must not
    decode plain on those old values: the slot starts from the neighbouring slot's fresh values at one step's
    weight, and its own steps take over at once. Fresh slots, slots across a jump and stale_slot_steps 0 keep
    their own values."""
    hard, good, worse = [1.0, 0.95, 0.9, 0.85, 0.8], [1.0, 1.4, 1.55, 1.65, 1.6], [1.0, 1.1, 1.05, 0.95, 0.9]
    for stale_slot_steps, drain_depth in ((64, 3), (0, 0)):
        control = DraftController(4, probe_interval=0, stale_slot_steps=stale_slot_steps)
        _run_steps(control, 8, hard, 10)  # batch 6-11: measured, then left for 100 steps
        _run_steps(control, 16, good, 100)
        assert control.plan(16, 64).depth == 3
        assert control.plan(11, 44).depth == drain_depth  # the drain enters batch 6-11 from 12-23
        if stale_slot_steps:
            assert control.value == pytest.approx(good)
            control.observe_levels(worse, batch=11)  # its own first step outweighs the seed (0.2 against 0.16)
            seeded = [(0.8 * 0.2 * g + 0.2 * w) / (0.8 * 0.2 + 0.2) for g, w in zip(good, worse)]
            assert control.value == pytest.approx(seeded, rel=1e-6)
            assert control.plan(11, 44).depth == 2
        else:
            assert control.value == pytest.approx(hard)

    control = DraftController(4, probe_interval=0, stale_slot_steps=64)
    _run_steps(control, 8, hard, 10)
    _run_steps(control, 16, good, 40)  # batch 6-11 measured 40 steps ago: fresh, kept
    assert control.plan(11, 44).depth == 0 and control.value == pytest.approx(hard)

    control = DraftController(4, probe_interval=0, stale_slot_steps=64)
    _run_steps(control, 4, hard, 10)  # batch 3-5, two slots away from 12-23
    _run_steps(control, 16, good, 100)
    assert control.plan(4, 16).depth == 0 and control.value == pytest.approx(hard)  # a jump: its own old values

    control = DraftController(4, probe_interval=0, stale_slot_steps=64)
    _run_steps(control, 16, good, 100)
    control.plan(11, 44)  # a neighbour never measured starts from the fresh one too
    assert control.value == pytest.approx(good)


def test_draft_controller_weighs_a_step_by_its_requests_and_needs_enough_of_them():
    """A step of one request is one accept-or-reject draw: it moves the depth values by 5 % (REQUEST_WEIGHT), a
    step of 4 requests by ~19 %, of 5 or more by alpha (0.2). The plan drafts to full depth until 8 request-steps are
    measured, and the average is bias-corrected: one early rejection does not stand for the whole memory."""
    from echo_vllm.core.auto_budget import MIN_MEASURED_REQUESTS, REQUEST_WEIGHT

    rejected, accepted = [1.0, 0.8, 0.7, 0.6], [1.0, 1.7, 2.3, 2.8]
    control = DraftController(3, probe_interval=0)
    control.observe_levels(rejected, batch=1)  # the first verified step rejected its draft
    assert control.value == pytest.approx(rejected)  # one sample: the average is that sample
    for _ in range(MIN_MEASURED_REQUESTS - 2):
        assert control.plan(1, 3).depth == 3  # not yet measured enough: full depth, not plain
        control.observe_levels(accepted, batch=1)
    assert control.plan(1, 3).depth == 3
    control.observe_levels(rejected, batch=1)
    assert control.measured_requests == MIN_MEASURED_REQUESTS
    # Two rejections among 8 steps: a plain average, not the last sample: depth 3 leads.
    assert control.value[3] == pytest.approx((2 * 0.6 + 6 * 2.8) / 8, rel=0.03)
    assert control.plan(1, 3).depth == 3
    # Three more rejections in a row at batch 1 (5 % each): still close to the plain average of the 11 steps (with
    # a = 0.2 per step, as before, the last steps dominate: 0.6 + (v - 0.6) x 0.8^3), depth 3 ahead.
    for _ in range(3):
        control.observe_levels(rejected, batch=1)
    assert control.value[3] == pytest.approx((5 * 0.6 + 6 * 2.8) / 11, rel=0.1)
    assert control.plan(1, 3).depth == 3
    # The weight per step: batch 4 moves the values by 1 - 0.95^4, batch 32 by alpha (0.2).
    for batch, weight in ((4, 1 - (1 - REQUEST_WEIGHT) ** 4), (32, 0.2)):
        fresh = DraftController(3, probe_interval=0)
        for _ in range(200):  # long enough that the bias correction no longer matters
            fresh.observe_levels([1.0, 1.0, 1.0, 1.0], batch=batch)
        fresh.observe_levels([1.0, 2.0, 2.0, 2.0], batch=batch)
        assert fresh.value[1] == pytest.approx(1.0 + weight, rel=1e-6)


def test_a_measured_step_after_a_plain_stretch_weighs_as_the_stretch_aged_the_average():
    """A plan at plain decoding measures only its probes: with plan_catch_up the first measured step after k steps
    that measured nothing weighs 1 - (1 - a)^(1 + k), at most catch_up, where a < alpha (batch 1-4), so one good
    probe lifts values a bad stretch left below plain (batch 4 on the testbed: 25 plain steps, two probes, at one
    step's weight). Stale steps age only their own load slot; the step after a measured one weighs a again."""
    from echo_vllm.core.auto_budget import REQUEST_WEIGHT
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    a4 = 1 - (1 - REQUEST_WEIGHT) ** 4
    bad, good = [1.0, 0.8, 0.8, 0.8], [1.0, 1.6, 1.6, 1.6]

    def settled(catch_up):
        control = DraftController(3, probe_interval=0, catch_up=catch_up)
        for _ in range(200):  # long enough that the bias correction no longer matters
            control.observe_levels(bad, batch=4)
        assert control.plan(4, 12).depth == 0
        return control

    on, off = settled(0.5), settled(0.0)
    for control in (on, off):
        for _ in range(15):
            control.observe_unmeasured(4)
        control.observe_unmeasured(32)  # another load slot's plain step: ages that slot, not batch 4's
        control.observe_levels(good, batch=4)
    assert on.value[1] == pytest.approx(0.8 + 0.5 * 0.8)  # capped at catch_up (1 - (1 - a)^16 ~ 0.96)
    assert on.plan(4, 12).depth == 1  # left plain decoding on the first good measurement
    assert off.value[1] == pytest.approx(0.8 + a4 * 0.8)
    assert off.plan(4, 12).depth == 0  # one step's weight: still below plain
    on.observe_levels(bad, batch=4)  # no stale steps before it: one step's weight again
    assert on.value[1] == pytest.approx(1.2 - a4 * 0.4)
    # The weight itself: no stale steps -> a; a few at batch 1 -> compounded; many -> the cap; a cap below a -> a.
    control = DraftController(3, probe_interval=0, catch_up=0.5)
    assert control.step_weight(4, 0) == pytest.approx(a4)
    assert control.step_weight(1, 3) == pytest.approx(1 - (1 - REQUEST_WEIGHT) ** 4)
    assert control.step_weight(4, 100) == pytest.approx(0.5)
    assert DraftController(3, probe_interval=0, catch_up=0.1).step_weight(4, 100) == pytest.approx(a4)
    assert DraftController(3, probe_interval=0).step_weight(4, 100) == pytest.approx(a4)
    # Through the budget: plain steps with the hindsight off are the stale steps (with it on they are measured).
    cost = CostModel((1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4)
    budget = TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, catch_up=0.5)
    budget.cost_model = cost
    for _ in range(200):
        budget.controller.observe_levels(bad, batch=4)
    for _ in range(15):
        budget.observe_plain(4)
    budget.controller.observe_levels(good, batch=4)
    assert budget.controller.value[1] == pytest.approx(1.2)


def test_hindsight_level_rates_price_the_selection_cut_at_each_depth():
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    budget = TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    budget.cost_model = CostModel((1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 2.0), 0.0, (0.0, 0.0, 0.5, 0.0), 0.0, 4)
    # Two requests: 3 drafts verified, 2 accepted; 1 verified, 0 accepted.
    depths = torch.tensor([[1, 2, 3], [1, 0, 0]])
    budget.observe_verification(torch.tensor([2, 0]), depths, batch=2, drafted_depth=3)
    # Cut at d: tokens 2 + sum min(acc, d); nodes of depth <= d; rest(2 + nodes) + 0.5 d.
    expected = [2 / 1.0, 3 / (1.0 + 0.5), 4 / (1.25 + 1.0), 4 / (1.5 + 1.5)]
    assert budget.controller.value == pytest.approx([r / expected[0] for r in expected])  # relative to plain


def test_hindsight_charges_plain_decoding_the_head_rows_it_defers():
    """With defer_plain_head a plain step leaves its B head rows to a later first pass (h per row): the plain level
    pays h B, so drafting is not compared with a plain step that looks free of head work."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    budget = TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    budget.cost_model = CostModel(
        (1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 2.0), 0.0, (0.0, 0.0, 0.5, 0.0), 0.0, 4, deferred_row_s=0.25
    )
    depths = torch.tensor([[1, 2, 3], [1, 0, 0]])
    budget.observe_verification(torch.tensor([2, 0]), depths, batch=2, drafted_depth=3)
    # As the test above, but the plain level costs rest(2) + h x 2 = 1.5 s.
    expected = [2 / 1.5, 3 / (1.0 + 0.5), 4 / (1.25 + 1.0), 4 / (1.5 + 1.5)]
    assert budget.controller.value == pytest.approx([r / expected[0] for r in expected])


def test_measured_plain_head_rows_charge_the_prompt_rows_a_plain_step_defers():
    """plain_head_rows 'measured': a plain step defers every row of its first pass - each request's next-token row
    and the prompt rows of joining requests - so the plain level pays h x B x the average head rows per request of
    recent steps (forward tokens less verified drafts), not h x B; never less than h x B."""
    from echo_vllm.core.cost_model import CostModel, StepSample
    from echo_vllm.core.time_budget import HEAD_ROWS_WEIGHT, TimeAwareBudget

    def budget(mode: str) -> TimeAwareBudget:
        b = TimeAwareBudget(
            3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, plain_head_rows=mode
        )
        b.cost_model = CostModel(
            (1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 2.0), 0.0, (0.0, 0.0, 0.5, 0.0), 0.0, 4, deferred_row_s=0.25
        )
        return b

    measured, per_batch = budget("measured"), budget("batch")
    assert measured.plain_head_seconds(2) == pytest.approx(0.5)  # nothing measured yet: B rows
    # Steps of 2 requests: 2 next-token rows + 6 prompt rows + 3 verified drafts (4 rows per request), then 2 + 2.
    for b in (measured, per_batch):
        b.add_sample(StepSample(11, 2, 3, 1.0, 0.1, verified=3), warming_up=False)
        b.add_sample(StepSample(4, 2, 3, 1.0, 0.1, verified=2), warming_up=False)
    rows = 4.0 + HEAD_ROWS_WEIGHT * (1.0 - 4.0)
    assert measured.plain_head_seconds(2) == pytest.approx(0.25 * 2 * rows)
    assert per_batch.plain_head_seconds(2) == pytest.approx(0.25 * 2)
    # A step of verified drafts only (no prompt rows) never charges less than one row per request.
    fresh = budget("measured")
    fresh.add_sample(StepSample(6, 2, 3, 1.0, 0.1, verified=6), warming_up=False)
    assert fresh.plain_head_seconds(2) == pytest.approx(0.5)
    # In hindsight the plain level pays the measured rows: every depth is worth more relative to it.
    depths = torch.tensor([[1, 2, 3], [1, 0, 0]])
    for b in (measured, per_batch):
        b.observe_verification(torch.tensor([2, 0]), depths, batch=2, drafted_depth=3)
    plain_batch, plain_measured = 1.0 + 0.25 * 2, 1.0 + 0.25 * 2 * rows
    expected = [3 / (1.0 + 0.5), 4 / (1.25 + 1.0), 4 / (1.5 + 1.5)]
    assert per_batch.controller.value[1:] == pytest.approx([r / (2 / plain_batch) for r in expected])
    assert measured.controller.value[1:] == pytest.approx([r / (2 / plain_measured) for r in expected])
    with pytest.raises(ValueError, match="plain_head_rows must be 'batch' or 'measured'; got 'rows'"):
        TimeAwareBudget(
            3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, plain_head_rows="rows"
        )


def test_plain_steps_are_charged_only_the_share_of_deferred_rows_that_merges_pay():
    """With deferred_head_window (or requests finishing in a plain stretch) later merges take only some of the rows
    plain steps deferred; the rest never cost head work, so 'measured' charges that share (an exponential average
    over merges), never more than every row; 'batch' is unchanged."""
    from echo_vllm.core.cost_model import CostModel, StepSample
    from echo_vllm.core.time_budget import HEAD_ROWS_WEIGHT, TimeAwareBudget

    def budget(mode: str) -> TimeAwareBudget:
        b = TimeAwareBudget(
            3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, plain_head_rows=mode
        )
        b.cost_model = CostModel(
            (1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 2.0), 0.0, (0.0, 0.0, 0.5, 0.0), 0.0, 4, deferred_row_s=0.25
        )
        b.add_sample(StepSample(8, 2, 3, 1.0, 0.1, verified=0), warming_up=False)  # 4 rows per request
        return b

    measured, per_batch = budget("measured"), budget("batch")
    assert measured.plain_head_seconds(2) == pytest.approx(0.25 * 2 * 4)
    measured.record_head_merge(0, 0)  # nothing deferred: no evidence
    assert measured.plain_head_seconds(2) == pytest.approx(0.25 * 2 * 4)
    for b in (measured, per_batch):
        b.record_head_merge(10, 40)
        b.record_head_merge(30, 20)  # more merged than deferred since (rows kept over a reset): capped at all
    share = 0.25 + HEAD_ROWS_WEIGHT * (1.0 - 0.25)
    assert measured.plain_head_seconds(2) == pytest.approx(0.25 * 2 * 4 * share)
    assert per_batch.plain_head_seconds(2) == pytest.approx(0.25 * 2)


# -- acceptance ----------------------------------------------------------------------------------------------------


def test_acceptance_model_learns_rates_and_caps_children_by_parents():
    model = AcceptanceModel(2, num_bins=4, prior_strength=1.0)
    conf = torch.tensor([[0.9, 0.3]]).expand(400, 2)
    accepted = torch.zeros((400, 2), dtype=torch.bool)
    accepted[:100, 0] = True  # depth 1 at confidence 0.9 is accepted 25 % of the time
    accepted[:80, 1] = True  # depth 2 at 0.3: 20 %
    model.record(conf, accepted, torch.ones((400, 2), dtype=torch.bool))
    before = model.node_gain(_chains(torch.log(torch.tensor([[0.9, 1 / 3]]))), 2)
    assert before[0, 0] == pytest.approx(0.875, abs=0.01)  # no refresh yet: the prior (bin centre)
    model.refresh()
    gain = model.node_gain(_chains(torch.log(torch.tensor([[0.9, 1 / 3]]))), 2)
    assert gain[0, 0] == pytest.approx(0.25, abs=0.01) and gain[0, 1] == pytest.approx(0.2, abs=0.01)
    model.accepted[1] = model.seen[1]  # depth 2 always accepted: still capped by its parent
    model.refresh()
    capped = model.node_gain(_chains(torch.log(torch.tensor([[0.9, 1 / 3]]))), 2)
    assert capped[0, 1] == pytest.approx(capped[0, 0])
    invalid = model.node_gain(_chains(torch.tensor([[float("-inf"), -0.1]])), 2)
    assert torch.equal(model.node_gain(_chains(torch.log(torch.tensor([[0.9, 1 / 3]]))), 2, chain=True), capped)
    assert torch.equal(invalid, torch.zeros(1, 2))


def test_nodes_off_the_spine_get_their_own_acceptance():
    """A sibling of the same path confidence as a spine node is accepted far less often: with the width model the
    gain of the nodes off the spine is their own measured rate, capped by their parent's."""
    from echo_vllm.core.tree_order import spine_sibling_tree

    spine, width = AcceptanceModel(2, num_bins=4), AcceptanceModel(2, num_bins=4)
    n = 400
    spine.record(torch.full((n, 2), 0.9), torch.ones((n, 2), dtype=torch.bool), torch.ones((n, 2), dtype=torch.bool))
    accepted = torch.zeros(n, dtype=torch.bool)
    accepted[:40] = True  # siblings at depth 2 with confidence ~0.6: accepted 10 % of the time
    width.record_nodes(torch.full((n,), 2), torch.full((n,), 0.6), accepted)
    spine.refresh()
    width.refresh()
    # One request, depth 2, top_k 2: spine 0.95 -> 0.95; siblings 0.05 at depth 1 and 0.6 / 0.95 at depth 2.
    logprobs = torch.log(torch.tensor([[[0.95, 0.05], [0.95, 0.6 / 0.95]]]))
    tree = spine_sibling_tree(torch.tensor([[[1, 2], [3, 4]]]), logprobs)
    shared = spine.node_gain(tree, 2)
    own = spine.node_gain(tree, 2, width=width)
    assert torch.equal(own[0, tree.spine[0]], shared[0, tree.spine[0]])  # spine nodes unchanged
    assert own[0, 3] == pytest.approx(0.1, abs=0.03) and shared[0, 3] > 0.5  # the depth-2 sibling
    width.record_nodes(torch.empty(0, dtype=torch.long), torch.empty(0), torch.empty(0, dtype=torch.bool))  # no-op


def test_this_steps_drafting_is_sunk_so_a_cut_saves_none_of_it():
    """The selection runs after drafting: a shallower cut saves no drafting, so with every draft likely accepted
    and verification free, the whole chain is verified however dear drafting is (charging draft(d) per cut depth
    chose plain decoding here)."""
    from echo_vllm.core.auto_budget import DraftPlan
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    budget = TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    budget.cost_model = CostModel((1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 1.0, 0.0), 0.0, 4)
    budget.acceptance.table.fill_(0.9)
    tree = _chains(torch.log(torch.tensor([[0.95, 0.95, 0.95]])))
    selection, predicted = budget.select(tree, Gates.open(1, 3), 1, DraftPlan(3, 3, False), False, depth=3, chain=True)
    assert selection.counts.tolist() == [3] and float(predicted) == pytest.approx(2.7)
    # Verification that costs more than a draft is worth still cuts: the cut is priced by the tokens it verifies.
    budget.cost_model = CostModel((1.0, 2.0, 4.0, 8.0), (1.0, 10.0, 20.0, 40.0), 0.0, (0.0, 0.0, 1.0, 0.0), 0.0, 4)
    budget._curve_cache.clear()
    selection, _ = budget.select(tree, Gates.open(1, 3), 1, DraftPlan(3, 3, False), False, depth=3, chain=True)
    assert selection.counts.tolist() == [0]


def test_the_jump_of_verifying_at_all_is_charged_once_to_every_cut_that_verifies():
    """verify(B) (multi-token queries, the rejection sampler) is paid by any step that verifies a draft, however
    few: a jump worth more than the likely drafts makes plain decoding the choice, and every cut's price carries
    it once; in hindsight the depth levels that verified something pay it too."""
    from echo_vllm.core.auto_budget import DraftPlan
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    flat = CostModel((1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 0.0, 0.0), 0.0, 4)
    budget = TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    budget.acceptance.table.fill_(0.5)
    tree = _chains(torch.log(torch.tensor([[0.6, 0.6, 0.6]])))
    plan = DraftPlan(3, 3, False)
    for jump, expected in ((0.0, [3]), (2.0, [0])):  # 1.5 likely tokens: worth a free verify, not a 2 s jump
        budget.cost_model = dataclasses.replace(flat, verify_terms=(jump, 0.0))
        budget._curve_cache.clear()
        rest, _ = budget.curves(1, 3, 3, 3, "cpu")
        assert rest.tolist() == [1.0] + [1.0 + jump] * 3
        selection, _ = budget.select(tree, Gates.open(1, 3), 1, plan, False, depth=3, chain=True)
        assert selection.counts.tolist() == expected
    budget.cost_model = dataclasses.replace(flat, verify_terms=(1.0, 0.0))
    budget.observe_verification(torch.tensor([1]), torch.tensor([[1, 2, 3]]), batch=1, drafted_depth=3)
    assert budget.controller.value == pytest.approx([1.0, 2 / 2.0, 2 / 2.0, 2 / 2.0])


def test_the_steps_context_is_priced_in_the_selection_and_in_hindsight():
    """The cost model's context term (k x the cached tokens of the step's requests, `set_step_context`) is a cost
    every cut pays: a long context makes the step dear whatever it verifies, so drafts that do not pay at a short
    context pay at a long one (tokens per second of the whole step), and the hindsight values depth at the
    context of the forward that verified."""
    from echo_vllm.core.auto_budget import DraftPlan
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    cost = CostModel(
        (1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 0.0, 0.0), 0.0, 4,
        verify_terms=(2.0, 0.0), context_s=0.001,
    )  # fmt: skip
    budget = TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    budget.cost_model = cost
    budget.acceptance.table.fill_(0.5)
    tree = _chains(torch.log(torch.tensor([[0.6, 0.6, 0.6]])))
    plan = DraftPlan(3, 3, False)
    for context, expected in ((0, [0]), (10_000, [3])):  # 1.5 likely tokens: not worth a 2 s jump on a 1 s step
        budget.set_step_context(context)
        rest, _ = budget.curves(1, 3, 3, 3, "cpu")
        assert rest.tolist() == pytest.approx([1.0 + context / 1000] + [3.0 + context / 1000] * 3)
        selection, _ = budget.select(tree, Gates.open(1, 3), 1, plan, False, depth=3, chain=True)
        assert selection.counts.tolist() == expected
    budget.cost_model = dataclasses.replace(cost, verify_terms=(1.0, 0.0))
    budget.set_step_context(2_000)  # 2 s of context on every level: plain 1 / 3 s, a verifying level 2 / 4 s
    budget.observe_verification(torch.tensor([1]), torch.tensor([[1, 2, 3]]), batch=1, drafted_depth=3)
    assert budget.controller.value == pytest.approx([1.0, 1.5, 1.5, 1.5])


def test_a_probe_verifies_every_draft_even_where_nothing_pays():
    """A probe is a measurement: cut by the budget (at least one draft per request, as before), the hindsight
    values of deeper depths were capped by the probe's own cut, so a plan that chose plain decoding saw every
    depth below plain at every probe and never drafted again (batch 1 on the testbed: 0.74x EAGLE-3@4)."""
    from echo_vllm.core.auto_budget import DraftPlan
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    budget = TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    budget.cost_model = CostModel((1.0, 2.0, 4.0, 8.0), (1.0, 2.0, 4.0, 8.0), 0.0, (0.0, 0.0, 0.0, 0.0), 0.0, 4)
    budget.acceptance.table.fill_(0.05)  # verifying anything costs more than it brings
    tree = _chains(torch.log(torch.tensor([[0.3, 0.3, 0.3], [0.2, 0.2, 0.2]])))
    plain, _ = budget.select(tree, Gates.open(2, 3), 2, DraftPlan(3, 6, False), False, depth=3, chain=True)
    probe, _ = budget.select(tree, Gates.open(2, 3), 2, DraftPlan(3, 6, True), False, depth=3, chain=True)
    assert plain.counts.tolist() == [0, 0] and probe.counts.tolist() == [3, 3]


def test_a_step_the_confidence_stop_ended_values_deeper_depths_as_its_own():
    """draft_stop_confidence ended the loop at depth 2 of a planned 4: a plan 3 or 4 deep would have stopped there
    too (the test reads only the drafts), so depths 3 and 4 are worth what depth 2 was - the same tokens and the
    same drafting - not levels imputed from the continuation rates with two more draft levels to pay."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    cheap = CostModel((1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4)
    values = {}
    for stopped in (True, False):
        budget = TimeAwareBudget(4, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
        budget.cost_model = cheap
        budget.observe_verification(torch.tensor([2]), torch.tensor([[1, 2]]), 1, 2, stopped=stopped)
        values[stopped] = budget.controller.value
    # 1 + min(accepted, d) tokens for 1 + 0.1 d seconds (drafting priced at depth 2 past the stop)
    expected = [1 / 1.0, 2 / 1.1, 3 / 1.2, 3 / 1.2, 3 / 1.2]
    assert values[True] == pytest.approx(expected, rel=1e-6)
    assert values[False][3] != pytest.approx(values[False][2])  # without the stop: imputed, and priced deeper


def test_depths_deeper_than_drafted_are_imputed_from_the_continuation_rates():
    """A step that drafted 2 of 4 depths still values depths 3 and 4 (the plan compares every level on the same
    step): requests verified to depth 2 pay the deeper nodes, and those that accepted both go on with the measured
    P(accept j | reached j - 1); requests rejected early add cost and no tokens."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import CONTINUATION_PRIOR, TimeAwareBudget

    cheap = CostModel((1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4)
    budget = TimeAwareBudget(4, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    budget.cost_model = cheap
    # A probe first: 10 requests verified 4 deep, all accepted -> continuation rates near 1 at every depth.
    budget.observe_verification(torch.full((10,), 4), torch.tensor([[1, 2, 3, 4]] * 10), batch=10, drafted_depth=4)
    rates = budget._continuation_rates()
    assert all(
        r == pytest.approx((10 + CONTINUATION_PRIOR * rates[0]) / (10 + CONTINUATION_PRIOR), rel=0.02) for r in rates
    )
    assert min(rates) > 0.8
    fresh = TimeAwareBudget(4, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    fresh.cost_model, fresh._tried, fresh._passed = cheap, list(budget._tried), list(budget._passed)
    fresh.observe_verification(torch.tensor([2]), torch.tensor([[1, 2]]), batch=1, drafted_depth=2)
    after = fresh._continuation_rates()  # its own step counted too (depths 1 and 2)
    r3, r4 = after[2], after[2] * after[3]
    expected = [1 / 1.0, 2 / 1.1, 3 / 1.2, (3 + r3) / 1.3, (3 + r3 + r4) / 1.4]
    assert fresh.controller.value == pytest.approx([v / expected[0] for v in expected], rel=1e-6)
    # Rejected at depth 1: the deeper levels only cost.
    rejected = TimeAwareBudget(4, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    rejected.cost_model = cheap
    rejected.observe_verification(torch.tensor([0]), torch.tensor([[1, 2]]), batch=1, drafted_depth=2)
    values = rejected.controller.value
    assert values[0] > values[1] > values[2] > values[3] > values[4]
    # A request the budget cut at depth 1 of 2 drafted is neither charged nor credited the deeper nodes.
    cut = TimeAwareBudget(4, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    cut.cost_model = cheap
    cut.observe_verification(torch.tensor([1]), torch.tensor([[1, 0]]), batch=1, drafted_depth=2)
    assert cut.controller.value[2:] == pytest.approx([2 / 1.2 / 1.0, 2 / 1.3, 2 / 1.4])


def test_at_batch_one_a_few_rejections_do_not_put_the_plan_to_plain_decoding():
    """Batch 1, a completion of easy and hard 12-step stretches (continuation 0.9 / 0.4), a latency-bound step
    (verifying 4 drafts costs 6 % more than 1 token) and 1 ms per drafted depth: drafting pays in both stretches
    (hard: depth 1-2 best at ~1.18x plain; easy: depth 4 at ~2.4x), so plain decoding is never right. With the
    old average (a = 0.2 per step, the first sample standing for all) a few rejections put 12 % of the steps to
    plain decoding, where only probes could lift the plan again (the testbed at batch 1: 15 %)."""
    import random

    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    cost = CostModel(
        (1.0, 2.0, 4.0, 8.0), (0.010, 0.010, 0.0105, 0.011), 0.0, (0.0, 0.0, 0.001, 0.0), 0.0, 4,
        first_pass_terms=(0.001, 0.0),
    )  # fmt: skip
    plain_steps = steps = 0
    for seed in range(4):
        rng = random.Random(seed)
        budget = TimeAwareBudget(4, profile_steps=4, probe_interval=16, surplus_tail=True, profile_path=None)
        budget.cost_model = cost
        for t in range(400):
            p = 0.9 if (t // 12) % 2 == 0 else 0.4
            depth = budget.plan(1, 1, False, 0).depth
            budget.observe_selection(depth)
            steps += 1
            if depth == 0:
                plain_steps += 1
                budget.observe_plain(1)  # as the engines do
                continue
            accepted = 0
            while accepted < depth and rng.random() < p:
                accepted += 1
            budget.observe_verification(torch.tensor([accepted]), torch.arange(1, depth + 1).unsqueeze(0), 1, depth)
    assert plain_steps / steps < 0.02


def _steps_to_leave_plain(plain_hindsight: bool, seed: int, catch_up: float = 0.0) -> tuple[float, int | None]:
    """Batch 64, a latency-flat-then-linear step (depth 1 pays 1.2x at continuation 0.8, loses at 0.05): 150 steps
    of hard text (0.05) put the plan to plain decoding, then the text turns easy (0.8). Returns (the plain share of
    non-probe steps in steps 100-149, the steps after the switch until a non-probe step drafts again)."""
    import random

    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    cost = CostModel((1.0, 64.0, 128.0, 256.0, 512.0), (0.02, 0.064, 0.09, 0.15, 0.28), 0.0, (0, 0, 0, 1e-4), 0.0, 4)
    batch, switch = 64, 150
    rng = random.Random(seed)
    budget = TimeAwareBudget(
        4,
        profile_steps=4,
        probe_interval=16,
        surplus_tail=True,
        profile_path=None,
        plain_hindsight=plain_hindsight,
        catch_up=catch_up,
    )
    budget.cost_model = cost
    plans = []
    for t in range(switch + 100):
        p = 0.05 if t < switch else 0.8
        plan = budget.plan(batch, 1, False, 0)
        budget.observe_selection(plan.depth * batch)
        plans.append(plan)
        if plan.depth == 0:
            budget.observe_plain(batch)  # what the proposer reports for a step that verified nothing
            continue
        accepted = []
        for _ in range(batch):
            a = 0
            while a < plan.depth and rng.random() < p:
                a += 1
            accepted.append(a)
        verified = torch.arange(1, plan.depth + 1).expand(batch, plan.depth)
        budget.observe_verification(torch.tensor(accepted), verified, batch, plan.depth)
    hard = [q for q in plans[100:switch] if not q.probe]
    left = next((t - switch for t in range(switch, len(plans)) if plans[t].depth > 0 and not plans[t].probe), None)
    return sum(q.depth == 0 for q in hard) / len(hard), left


def test_plain_steps_update_the_depth_plan_so_it_leaves_plain_decoding_when_drafting_pays_again():
    """A step that verifies nothing values every depth from the continuation rates (as deeper-than-drafted depths
    are): when probes find the text easy again, the plan leaves plain decoding after about one probe instead of
    waiting for enough probes to move the average alone; on hard text it stays plain exactly as before."""
    for seed in range(3):
        plain_share_on, left_on = _steps_to_leave_plain(True, seed)
        plain_share_off, left_off = _steps_to_leave_plain(False, seed)
        assert plain_share_on == plain_share_off == 1.0
        assert left_on is not None and left_on <= 32  # within two probe intervals
        assert left_off is None or left_off > 48


def test_catch_up_leaves_a_large_batch_plan_as_it_was():
    """Catch-up applies only where a step weighs less than alpha (few requests): at batch 64 a probe after a plain
    stretch weighs one step, and the plan leaves plain decoding exactly when it did without catch-up."""
    for seed in range(2):
        assert _steps_to_leave_plain(False, seed, catch_up=0.5) == _steps_to_leave_plain(False, seed)
    control = DraftController(3, probe_interval=0, catch_up=0.5)
    assert control.step_weight(5, 100) == pytest.approx(0.2) and control.step_weight(64, 100) == pytest.approx(0.2)


def test_a_step_that_verified_nothing_is_a_plain_step_in_hindsight():
    """observe_verification with nothing drafted, or drafted but nothing verified, is observe_plain (imputed
    levels), not a step that paid for drafts and got nothing."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    cost = CostModel((1.0, 2.0, 4.0, 8.0), (1.0, 1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4)

    def fresh(plain_hindsight=True):
        b = TimeAwareBudget(
            3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, plain_hindsight=plain_hindsight
        )
        b.cost_model = cost
        return b

    plain = fresh()
    plain.observe_plain(2)
    cut = fresh()
    cut.observe_verification(torch.tensor([0, 0]), torch.zeros((2, 3), dtype=torch.long), batch=2, drafted_depth=3)
    nothing = fresh()
    nothing.observe_verification(torch.tensor([0, 0]), torch.zeros((2, 0), dtype=torch.long), batch=2, drafted_depth=0)
    assert plain.controller.value == cut.controller.value == nothing.controller.value
    # the pooled prior continuation 0.5 per depth: level d emits 2 (1/2 + ... + 1/2^d) drafts for 0.1 d seconds
    assert plain.controller.value == pytest.approx([1.0, 3 / 1.1 / 2, 3.5 / 1.2 / 2, 3.75 / 1.3 / 2])
    off = fresh(plain_hindsight=False)
    off.observe_plain(2)
    assert off.controller.value == [None] * 4


def test_the_width_model_tells_small_confidences_apart():
    """Siblings mostly have small path confidences: in 16 linear bins 0.05 and 0.002 share the first bin (and its
    pooled rate); the width model's log-scale bins keep them apart, so it learns that one is worth verifying."""
    from echo_vllm.core.acceptance import WIDTH_LOG_FLOOR
    from echo_vllm.core.tree_order import spine_sibling_tree

    n = 400
    conf = torch.cat([torch.full((n,), 0.05), torch.full((n,), 0.002)])
    accepted = torch.zeros(2 * n, dtype=torch.bool)
    accepted[: n // 5] = True  # the 0.05 siblings: 20 % accepted; the 0.002 ones never
    models = {
        "linear": AcceptanceModel(2),
        "log": AcceptanceModel(2, log_floor=WIDTH_LOG_FLOOR),
    }
    spine = AcceptanceModel(2)
    spine.record(torch.full((n, 2), 0.9), torch.ones((n, 2), dtype=torch.bool), torch.ones((n, 2), dtype=torch.bool))
    spine.refresh()
    # One request, depth 2, top_k 3: depth-1 siblings of confidence 0.05 and 0.002.
    logprobs = torch.log(torch.tensor([[[0.9, 0.05, 0.002], [0.9, 0.05, 0.002]]]))
    tree = spine_sibling_tree(torch.tensor([[[1, 2, 3], [4, 5, 6]]]), logprobs)
    depth1 = (tree.depth[0] == 1) & ~tree.spine[0]
    gains = {}
    for name, model in models.items():
        model.record_nodes(torch.ones(2 * n, dtype=torch.long), conf, accepted)
        model.refresh()
        gains[name] = spine.node_gain(tree, 2, width=model)[0, depth1].tolist()
    assert gains["linear"][0] == pytest.approx(gains["linear"][1])  # one bin: one rate (~10 %)
    high, low = gains["log"]
    assert high == pytest.approx(0.2, abs=0.03) and low == pytest.approx(0.0, abs=0.01)
    again = AcceptanceModel.from_json_dict(models["log"].to_json_dict(), 2)  # the floor survives JSON
    assert again.log_floor == WIDTH_LOG_FLOOR and torch.equal(again.table, models["log"].table)
    with pytest.raises(ValueError, match="log_floor"):
        AcceptanceModel(2, log_floor=1.5)


def test_a_tree_probe_verifies_every_spine_node_and_one_requests_siblings():
    """A tree probe measures every depth (all valid spine nodes, as a chain probe) and feeds the width model with
    the best-scored siblings only: one request's worth, not B x D x (top_k - 1) (242 nodes at batch 32)."""
    from echo_vllm.core.auto_budget import tree_probe_selection
    from echo_vllm.core.time_budget import TimeAwareBudget, tree_probe_cap
    from echo_vllm.core.tree_order import spine_sibling_tree

    g = torch.Generator().manual_seed(3)
    batch, depth, k = 6, 3, 4
    logprobs = torch.log_softmax(torch.randn(batch, depth, k, generator=g) * 2, dim=-1).sort(dim=-1, descending=True)
    ids = torch.arange(batch * depth * k).view(batch, depth, k)
    kept = torch.ones(batch, dtype=torch.bool)
    kept[4] = False  # a row with no drafts (e.g. a partial prefill)
    tree = spine_sibling_tree(ids, logprobs.values, kept)
    siblings = depth * (k - 1)
    selection = tree_probe_selection(tree, siblings)
    chosen = selection.selected
    usable = tree.valid & ~torch.isnan(tree.scores)
    assert torch.equal(chosen & tree.spine, usable & tree.spine)  # every usable spine node
    off = chosen & ~tree.spine
    assert int(off.sum()) == siblings
    # ... and they are the best-scored siblings of the batch.
    worst_in = tree.scores[off].min()
    best_out = tree.scores[usable & ~tree.spine & ~chosen].max()
    assert worst_in >= best_out
    # Ancestor-closed: every chosen node's parent is chosen.
    parent = tree.parent.long()
    has_parent = chosen & (parent >= 0)
    assert torch.gather(chosen, 1, parent.clamp(min=0))[has_parent].all()
    assert tree_probe_cap(batch, depth, k) == batch * depth + siblings

    # The plan of a probe in tree mode carries that cap; a chain probe's stays B x D.
    from echo_vllm.core.cost_model import CostModel

    budget = TimeAwareBudget(depth, profile_steps=0, probe_interval=1, surplus_tail=True, profile_path=None)
    budget.cost_model = CostModel((1.0, 2.0, 4.0), (1.0, 1.0, 1.0), 0.0, (0.0,) * 4, 0.0, depth)
    tree_plan = budget.plan(batch, k, False, warmup_cap=0)
    assert tree_plan.probe and tree_plan.k_cap == tree_probe_cap(batch, tree_plan.depth, k)
    budget.controller.observe(0)
    chain_plan = budget.plan(batch, 1, False, warmup_cap=0)
    assert chain_plan.probe and chain_plan.k_cap == batch * chain_plan.depth


def _level_counts_direct(accepted: torch.Tensor, verified_depths: torch.Tensor, drafted: int):
    """The hindsight counts as first written (one broadcast per count): the specification of `level_counts`."""
    levels = torch.arange(drafted + 1)
    acc = accepted.long()
    emitted = torch.minimum(acc.unsqueeze(1), levels.unsqueeze(0)).sum(dim=0)
    depths = verified_depths.long()
    flat = depths.reshape(-1)
    nodes = ((flat.unsqueeze(0) <= levels.unsqueeze(1)) & (flat.unsqueeze(0) > 0)).sum(dim=1)
    reach = depths.amax(dim=1) if depths.shape[1] else torch.zeros_like(acc)
    j = levels[1:].unsqueeze(0)
    tried = ((reach.unsqueeze(1) >= j) & (acc.unsqueeze(1) >= j - 1)).sum(dim=0)
    passed = ((reach.unsqueeze(1) >= j) & (acc.unsqueeze(1) >= j)).sum(dim=0)
    at_end = reach == drafted
    return (
        emitted.tolist(), nodes.tolist(), tried.tolist(), passed.tolist(),
        int(at_end.sum()), int((at_end & (acc >= drafted)).sum()),
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(0, 40),
    width=st.integers(0, 12),
    drafted=st.integers(1, 8),
    deeper=st.booleans(),
)
def test_level_counts_equal_the_direct_formulation(seed, rows, width, drafted, deeper):
    """`level_counts` (two histograms and sums on the host) equals the direct broadcasts on random inputs: chains,
    ragged trees (any node depths, zeros = not verified), acceptances beyond the verified depth and - with `deeper` -
    node depths and acceptances past the drafted depth, which no level may count."""
    gen = torch.Generator().manual_seed(seed)
    top = drafted + (3 if deeper else 0)
    depths = torch.randint(0, top + 1, (rows, width), generator=gen)
    accepted = torch.randint(0, top + 1, (rows,), generator=gen)
    assert level_counts(accepted, depths, drafted) == _level_counts_direct(accepted, depths, drafted)
    # Chains: K_i nodes at depths 1..K_i and accepted <= K_i, as the engines record them.
    counts = torch.randint(0, drafted + 1, (rows,), generator=gen)
    chain = torch.where(torch.arange(drafted) < counts.unsqueeze(1), torch.arange(1, drafted + 1), 0)
    chain_accepted = (torch.rand(rows, generator=gen) * (counts + 1)).long()
    assert level_counts(chain_accepted, chain, drafted) == _level_counts_direct(chain_accepted, chain, drafted)


def _seeded_budget(model, max_depth: int):
    """A budget whose refit takes `model` (the share hook stands in for rank 0's fit), for observe_sweep tests."""
    from echo_vllm.core.time_budget import COST_VECTOR_LENGTH, TimeAwareBudget

    packed = model.to_vector()
    vector = packed + [0.0] * (COST_VECTOR_LENGTH - len(packed))
    return TimeAwareBudget(
        max_depth, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, share=lambda _: vector
    )


def test_warmup_steps_seed_the_depth_plan_once_the_cost_model_can_price_them():
    """observe_sweep: a warm-up step (every drafted node verified) counts its continuation events at once and its
    levels when the first fit arrives - the same values observe_verification gives the same steps with the model
    in place; a profile step (a fraction verified) counts continuation only; a warm-up step with a request cut
    short is not a level sample."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    model = CostModel((1.0, 2.0, 4.0, 8.0, 16.0), (1.0, 1.0, 1.05, 1.1, 1.2), 0.0, (0.0, 0.0, 0.05, 0.0), 0.0, 4)
    steps = [torch.tensor([3, 1, 0, 3]), torch.tensor([2, 3, 3, 0]), torch.tensor([3, 3, 1, 2])]
    full = torch.tensor([[1, 2, 3]] * 4)
    seeded = _seeded_budget(model, 3)
    for accepted in steps:
        seeded.observe_sweep(accepted, full, batch=4, drafted_depth=3, full=True)
    assert seeded.controller.value == [None] * 4  # nothing priced before the fit
    assert seeded._tried[0] == pytest.approx(12.0, rel=0.05)  # continuation counted already: 3 steps x 4 requests
    seeded.refit(first=True)
    assert seeded.cost_model == model
    direct = TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    direct.cost_model = model
    for accepted in steps:
        direct.observe_verification(accepted, full, batch=4, drafted_depth=3)
    assert seeded.controller.value == pytest.approx(direct.controller.value)
    assert seeded.controller.measured_requests == 12
    assert not seeded._seed_levels  # replayed once
    # Profile steps: continuation only.
    profile = _seeded_budget(model, 3)
    profile.observe_sweep(steps[0], full, batch=4, drafted_depth=3, full=False)
    profile.refit(first=True)
    assert profile.controller.measured_requests == 0 and profile._tried[0] > 0
    # A request verified to depth 1 of 3 drafted (the scheduler's token budget): not a level sample.
    cut = _seeded_budget(model, 3)
    cut.observe_sweep(steps[0], torch.tensor([[1, 2, 3]] * 3 + [[1, 0, 0]]), batch=4, drafted_depth=3, full=True)
    cut.refit(first=True)
    assert cut.controller.measured_requests == 0
    # With the model already there (a loaded budget profile), a warm-up step is priced at once.
    loaded = TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    loaded.cost_model = model
    loaded.observe_sweep(steps[0], full, batch=4, drafted_depth=3, full=True)
    assert loaded.controller.measured_requests == 4


def test_a_bad_first_auto_step_does_not_put_a_seeded_plan_to_plain_decoding():
    """The testbed at batch 4: a warm-up of 16 full-depth steps accepted ~2 of 4 drafts per request, where depth 4
    pays ~1.5x plain; the first auto steps drafted depth 4 (accepted 2, 1, 0, 1) and depth 2 (1, 0, 0, 0). Without
    the warm-up's evidence those two steps were the plan's whole memory and its continuation rates rested on
    them: every depth fell below plain and the probes (one depth deeper than plain, deeper levels imputed from
    those rates) held it there. Seeded from the warm-up, the plan keeps drafting."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    # The run's fitted step at batch 4 (its step log's model_ms): 6.34 ms plain, 10.4 / 10.95 / 11.5 / 12.05 ms at
    # depth 1-4 with every draft verified (the first pass and verify(B) make depth 1 the big jump).
    model = CostModel(
        (4.0, 8.0, 12.0, 16.0, 20.0, 32.0),
        (0.00634, 0.0065, 0.00665, 0.0068, 0.00695, 0.0074),
        0.0,
        (0.0, 0.0, 0.0004, 0.0),
        0.0,
        4,
        first_pass_terms=(0.002, 0.0),
        verify_terms=(0.0015, 0.0),
    )
    # That run's warm-up (accepted drafts per request, 4 drafted and verified): ~1.9 of 4.
    warmup = [
        torch.tensor(row)
        for row in (
            [0, 0, 1, 0], [0, 4, 0, 4], [4, 4, 2, 2], [4, 4, 4, 1], [4, 4, 0, 0], [4, 4, 1, 0], [4, 4, 1, 2],
            [4, 4, 1, 1], [4, 1, 2, 2], [4, 0, 1, 1], [3, 0, 2, 0], [4, 0, 1, 0], [4, 0, 1, 0], [4, 0, 0, 1],
            [4, 3, 0, 0],
        )
    ]  # fmt: skip
    full = torch.tensor([[1, 2, 3, 4]] * 4)

    def first_auto_steps(budget: TimeAwareBudget) -> None:
        budget.observe_verification(torch.tensor([2, 1, 0, 1]), full, batch=4, drafted_depth=4)
        budget.observe_verification(torch.tensor([1, 0, 0, 0]), torch.tensor([[1, 2]] * 4), batch=4, drafted_depth=2)

    seeded = _seeded_budget(model, 4)
    for accepted in warmup:
        seeded.observe_sweep(accepted, full, batch=4, drafted_depth=4, full=True)
    seeded.refit(first=True)
    assert max(v for v in seeded.controller.value if v is not None) > 1.2  # depth pays after the warm-up
    first_auto_steps(seeded)
    unseeded = TimeAwareBudget(4, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    unseeded.cost_model = model
    first_auto_steps(unseeded)
    assert unseeded.controller.plan(4, 16).depth == 0  # the trap the seed removes
    assert seeded.controller.plan(4, 16).depth >= 2


def test_the_first_step_of_each_shape_is_no_cost_sample():
    """A step shape's (tokens in the forward, batch) first step pays one-off work its later steps do not; it is
    no sample. A start-up profile that sweeps depths sees mostly new shapes, the warm-up one shape many times:
    with every first step inflated, the fit must still price the swept depths at their steady cost."""
    from echo_vllm.core.cost_model import StepSample
    from echo_vllm.core.time_budget import TimeAwareBudget

    batch = 4

    def steady_rest(n: int) -> float:  # a linear curve, as on the testbed's CPU
        return 0.004 + 0.0002 * n

    budget = TimeAwareBudget(4, profile_steps=32, probe_interval=0, surplus_tail=True, profile_path=None)
    seen: set[int] = set()

    def step(n: int, depth: int) -> None:
        cold = 1.3 if n not in seen else 1.0  # a shape's first step: 1.3x, outside and inside the proposer
        seen.add(n)
        sample = StepSample(n, batch, depth, cold * steady_rest(n), cold * 0.0005 * depth, verified=n - batch)
        budget.add_sample(sample, warming_up=False)

    for _ in range(16):  # the warm-up: one shape
        step(batch * 5, 4)
    # The profile: each depth's shape twice in a row, so every shape has one steady step besides its first.
    for depth in (0, 1, 2, 3):
        for _ in range(2):
            step(batch * (1 + depth), depth)
    stored = budget.samples.all()
    assert len(stored) == 15 + 4  # each shape's first step left out, and only those
    assert all(s.rest_s == pytest.approx(steady_rest(s.num_tokens)) for s in stored)
    budget.refit(first=True)
    model = budget.cost_model
    assert model is not None
    for depth in (0, 1, 2, 3, 4):
        n = batch * (1 + depth)
        predicted = model.rest_at(n, batch) + model.verify_at(batch, n - batch)
        assert predicted == pytest.approx(steady_rest(n), rel=0.05)


def test_the_profile_holds_each_depth_so_its_steady_shape_is_measured():
    """Each depth of the profile's cycle is held for PROFILE_HOLD steps that verify everything but the last (a
    fraction): the held steps after the first have the steady shape N = B (1 + d), twice per depth and pass."""
    from echo_vllm.core.time_budget import PROFILE_FRACTIONS, PROFILE_HOLD, profile_step

    depth, batch = 4, 4
    steps = [profile_step(i, depth) for i in range(PROFILE_HOLD * 2 * (depth + 1))]
    cycle = [4, 0, 3, 1, 2, 2, 1, 3, 0, 4]
    assert [d for d, _ in steps] == [d for d in cycle for _ in range(PROFILE_HOLD)]
    assert [f for _, f in steps[PROFILE_HOLD - 1 :: PROFILE_HOLD]] == [
        PROFILE_FRACTIONS[b % len(PROFILE_FRACTIONS)] for b in range(len(cycle))
    ]
    # A step's forward verifies its predecessor's selection: steady when that one drafted the same depth, all verified.
    steady: dict[int, int] = {}
    for (d0, f0), (d1, _) in zip(steps, steps[1:]):
        if d0 == d1 and f0 == 1.0:
            steady[d1] = steady.get(d1, 0) + 1
    assert steady == dict.fromkeys(range(depth + 1), 4)  # every depth: twice per hold, two holds per pass
    # The budget runs the same sweep: the plan's depths and the selection's fractions.
    from echo_vllm.core.time_budget import TimeAwareBudget

    budget = TimeAwareBudget(depth, profile_steps=30, probe_interval=0, surplus_tail=True, profile_path=None)
    planned = [budget.plan(batch, 1, warming_up=False, warmup_cap=16).depth for _ in range(9)]
    assert planned == [d for d, _ in steps[:9]]


def test_knots_are_at_most_one_and_a_half_apart_so_a_lumpy_curve_fits():
    """The step cost on the testbed's CPU jumps between N = 12 and 16 (batch 4, depths 2 and 3); with knots at
    powers of two alone N = 12 sat mid-segment and was priced at its neighbours' mean. A knot at 12 follows it."""
    from echo_vllm.core.cost_model import StepSample, _knots_for, fit_cost_model

    assert _knots_for(20) == [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0]
    measured = {4: 0.0059, 8: 0.0083, 12: 0.0090, 16: 0.0111, 20: 0.0120}  # batch-4 steady steps, seconds
    samples = [StepSample(n, 4, 0, t, 0.0, verified=n - 4) for n, t in measured.items() for _ in range(3)]
    model = fit_cost_model(samples)
    assert model is not None
    for n, t in measured.items():
        predicted = model.rest_at(n, 4) + model.verify_at(4, n - 4)
        assert predicted == pytest.approx(t, rel=0.03), n


def _continuation_after_a_shallow_stretch(memory: str) -> list[float]:
    """A stretch where every request verified depth 2 and was rejected there (rate 0 at depth 2), then 80 steps
    (640 request-steps) that draft depth 1 only, every request accepting it: the continuation rates at the end."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    budget = TimeAwareBudget(
        3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, continuation_memory=memory
    )
    budget.cost_model = CostModel((1.0, 64.0), (1.0, 2.0), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4)
    for _ in range(10):
        budget.observe_verification(torch.ones(8, dtype=torch.long), torch.tensor([[1, 2]] * 8), 8, 2)
    for _ in range(80):
        budget.observe_verification(torch.ones(8, dtype=torch.long), torch.tensor([[1]] * 8), 8, 1)
    return budget._continuation_rates()


def test_step_memory_lets_a_depth_only_probes_reach_forget_a_stretch_long_past():
    """continuation_memory 'steps': every depth's counts fade with each verified request-step, so a depth the plan
    stopped drafting leans on the pooled rate of recent steps; 'tries' keeps its old rate until it is tried again.
    A bad value is one clear error."""
    from echo_vllm.config import EchoSettings
    from echo_vllm.core.time_budget import TimeAwareBudget

    kept = _continuation_after_a_shallow_stretch("tries")
    faded = _continuation_after_a_shallow_stretch("steps")
    assert kept[1] < 0.15  # the old stretch's rejections still decide depth 2
    assert faded[0] > 0.95 and faded[1] > 0.85  # depth 2 now follows the recent steps' (pooled) rate
    with pytest.raises(ValueError, match="continuation_memory"):
        TimeAwareBudget(3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None,
                        continuation_memory="forever")  # fmt: skip
    with pytest.raises(ValueError, match="continuation_memory"):
        EchoSettings(continuation_memory="forever")


def _rates_after_a_full_batch_then_its_drain(memory: str) -> tuple[list[float], list[float]]:
    """20 steps at batch 8 where every request accepts depths 1 and 2 (rate 1 at both), then a drain of 100 steps
    at batch 1 whose request accepts depth 1 and is rejected at 2 (rate 0 at depth 2): the continuation rates the
    batch-8 and batch-1 load slots then impute from."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.time_budget import TimeAwareBudget

    budget = TimeAwareBudget(
        3, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, continuation_memory=memory
    )
    budget.cost_model = CostModel((1.0, 64.0), (1.0, 2.0), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4)
    for _ in range(20):
        budget.observe_verification(torch.full((8,), 2, dtype=torch.long), torch.tensor([[1, 2]] * 8), 8, 2)
    for _ in range(100):
        budget.observe_verification(torch.ones(1, dtype=torch.long), torch.tensor([[1, 2]]), 1, 2)
    return budget.continuation_rates(8), budget.continuation_rates(1)


def test_slot_memory_keeps_a_drains_hard_requests_out_of_the_full_batchs_rates():
    """continuation_memory 'slots': the counts are kept per load slot too (on the global clock), so a full batch's
    plan values its undrafted depths from its own slot's steps, not from the drain that came after; 'steps' pools
    them (the drain's 100 request-steps outweigh the batch's older 160); the drain's own slot sees its rate."""
    full_pooled, _ = _rates_after_a_full_batch_then_its_drain("steps")
    full_slot, drain_slot = _rates_after_a_full_batch_then_its_drain("slots")
    assert full_pooled[1] < 0.45  # the drain's rejections set depth 2's rate for batch 8 too
    assert full_slot[1] > 0.7  # batch 8's own steps: every depth-2 draft accepted
    assert drain_slot[1] < 0.15  # the drain's slot: rejected every time
    assert full_slot[0] > 0.95 and drain_slot[0] > 0.95  # depth 1 accepted everywhere
