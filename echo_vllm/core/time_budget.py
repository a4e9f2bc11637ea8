"""`k_max: "auto"`: the time-aware budget's state, shared by the vLLM proposer and the HF engine.

Phases (`phase`):
  warmup   the gates are calibrating: the engine's warm-up budget (everything drafted, every depth recorded);
  profile  `profile_steps` steps that draft to a cycle of depths (D, 0, D-1, 1, ...), each held for a few
           steps that verify every candidate, then a fraction of them (PROFILE_FRACTIONS; `profile_step`), so that
           the step cost is sampled at every depth's steady shape and between; then the first fit (saved to the
           budget profile file if it does not exist);
  auto     every step: `DraftController` plans the draft depth and candidate cap, `select_auto` cuts ECHO's order
           where expected tokens per second peak (acceptance from `AcceptanceModel`, time from `CostModel`); the
           cost model is refit from the samples the engine adds, REFIT_INTERVAL steps apart and up to
           MAX_REFIT_INTERVAL while refits keep finding the same curve.
A loaded budget profile skips the profile phase. `share` (identity for one process; the vLLM proposer passes a
broadcast from TP rank 0) makes every rank use rank 0's fit. No vLLM import; the engines measure the time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .acceptance import WIDTH_LOG_FLOOR, AcceptanceModel
from .auto_budget import (
    DraftController,
    DraftPlan,
    load_bucket,
    priority_rank,
    select_auto,
    select_by_rank,
    tree_probe_selection,
)
from .budget import BudgetSelection
from .budget_profile import load_profile, save_profile
from .chain_feedback import level_histograms
from .cost_model import (
    MAX_KNOTS,
    CostModel,
    StepSample,
    StepSamples,
    fit_cost_model,
    model_change,
    vector_length,
)
from .gating import Gates
from .tree import DraftTree

REFIT_INTERVAL = 64  # steps between refreshes of the acceptance table (and, at first, refits of the cost model)
# A refit that moved the model's steady step prices by less than REFIT_STABLE (median relative change,
# `model_change`) doubles the interval to the next one, up to MAX_REFIT_INTERVAL; a larger move resets it. Why: a
# refit costs ~4 ms on the testbed's CPU (0.06 ms of every batch-4 step at one per 64 steps) and, once the step
# cost is learned, mostly refits the same curve.
MAX_REFIT_INTERVAL = 512
REFIT_STABLE = 0.02
# Profile steps verify these fractions of the candidates in turn: step costs across the token range, plain steps too.
PROFILE_FRACTIONS = (0.0, 0.5, 1.0, 0.25, 0.75, 0.125)
# The profile holds each depth of its cycle for this many steps (`profile_step`).
PROFILE_HOLD = 3
IDLE_FACTOR = 4.0  # a step slower than this x the model's prediction waited for work (idle engine): not a sample
MAX_PROFILE_SAMPLES = 256
# The depth plan's continuation rates (imputed deeper levels): per-depth counts decay by this per request-step
# counted, and shrink towards the pooled rate with this many pseudo-samples.
CONTINUATION_DECAY = 0.01
CONTINUATION_PRIOR = 4.0
COST_VECTOR_LENGTH = vector_length(MAX_KNOTS)
# The average head rows per request of a step (its forward's tokens less the drafts it verified: each request's
# next-token row plus its prompt rows): weight of one step in the exponential average.
HEAD_ROWS_WEIGHT = 0.05
# Warm-up steps kept for the depth plan's first values (`observe_sweep`): at most this many, the newest.
SEED_STEPS = 64
# Step shapes (tokens in the forward, batch) remembered as seen (`add_sample`: a shape's first step is no sample);
# past this many the filter stops (every shape then counts as seen): a bound on memory, not a tuning knob.
MAX_SEEN_SHAPES = 1 << 16

Share = Callable[[Sequence[float]], list[float]]


def profile_step(index: int, max_depth: int) -> tuple[int, float]:
    """(draft depth, fraction of the candidates verified) of the profile's step `index` (0-based).

    The depths cycle D, 0, D - 1, 1, ...; each is held for PROFILE_HOLD steps, all but the last verifying every
    candidate, the last a fraction from PROFILE_FRACTIONS (so the next depth starts from a partial step).

    Why held: a step's forward verifies what the step before it selected, so only a step that follows one of the
    same depth verifying everything has the steady shape of that depth (N = B (1 + d) tokens, a d-deep drafter), the
    shape the depth plan prices. A cycle that changed the depth and the fraction every step sampled those shapes
    only by chance (batch 4 on the testbed: one step of 24 at depth 2's shape), and a step shape's first step is no
    sample (`add_sample`); the step cost on the testbed's CPU is not smooth in N (batch 4, steady steps of static
    depths, medians: +0.7 ms from depth 1 to 2, +2.4 ms from 2 to 3), so the fit's curve between the shapes it saw
    missed depth 2 by ~1 ms and the plan drafted deeper than the best static depth. Held, each depth's shape comes
    twice per pass of the cycle."""
    cycle = [x for pair in zip(range(max_depth, -1, -1), range(max_depth + 1)) for x in pair]
    block, within = divmod(index, PROFILE_HOLD)
    fraction = 1.0 if within < PROFILE_HOLD - 1 else PROFILE_FRACTIONS[block % len(PROFILE_FRACTIONS)]
    return cycle[block % len(cycle)], fraction


def _no_share(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values]


def tree_probe_cap(batch: int, depth: int, nodes_per_depth: int) -> int:
    """Nodes a tree probe verifies: every request's spine to `depth`, plus one request's worth of siblings
    (`tree_probe_selection`)."""
    return batch * depth + depth * (nodes_per_depth - 1)


def level_counts(
    accepted: torch.Tensor, verified_depths: torch.Tensor, drafted: int
) -> tuple[list[int], list[int], list[int], list[int], int, int]:
    """A verified step's hindsight counts, on the host (one sync), for cuts at depth d = 0..drafted:
    emitted[d] = sum_i min(accepted_i, d); nodes[d] = verified nodes of depth 1..d; per depth j = 1..drafted,
    tried[j - 1] = requests verified to j (reach_i >= j) having accepted j - 1 and passed[j - 1] those that accepted
    j; and the requests verified to the drafted depth and those of them that accepted all of it.

    accepted [R]; verified_depths [R, N]: the depth of each verified node, 0 = none (reach_i = its row's max).
    Counted through two histograms - (reach, accepted) jointly and the node depths - so that the step costs a
    handful of tensor ops whatever R is, and the sums over the (drafted + 2)^2 table run in Python on the host (a
    tensor op on the CPU costs ~5-10 us inside the engine; the direct formulation took ~30 of them per step)."""
    return level_counts_from_histograms(level_histograms(accepted, verified_depths, drafted).tolist(), drafted)


def level_counts_from_histograms(
    host: Sequence[int], drafted: int
) -> tuple[list[int], list[int], list[int], list[int], int, int]:
    """`level_counts` from its two histograms on the host (`level_histograms`, or `echo::chain_feedback`'s)."""
    n = drafted + 1
    size = n + 1  # values 0..drafted, and one bucket for anything deeper (never counted at a level <= drafted)
    table = [host[r * size : (r + 1) * size] for r in range(size)]  # table[reach][accepted]
    node_hist = host[size * size :]
    # Suffix sums, built once: tail[r][a] = sum of table[r'][a'] over r' >= r, a' >= a (the double sums of tried
    # and passed each read one entry; a step's feedback runs this on the host, where every Python op counts).
    tail = [[0] * (size + 1) for _ in range(size + 1)]
    for r in range(size - 1, -1, -1):
        row, below, here = table[r], tail[r + 1], tail[r]
        for a in range(size - 1, -1, -1):
            here[a] = row[a] + here[a + 1] + below[a] - below[a + 1]
    emitted = [0] * n
    for d in range(1, n):
        emitted[d] = emitted[d - 1] + tail[0][d]  # + the requests that accepted d or more
    nodes_at = [0] * n
    for d in range(1, n):
        nodes_at[d] = nodes_at[d - 1] + node_hist[d]
    tried = [tail[j][j - 1] for j in range(1, n)]
    passed = [tail[j][j] for j in range(1, n)]
    verified_to_end = tail[drafted][0] - tail[drafted + 1][0]
    accepted_to_end = tail[drafted][drafted] - tail[drafted + 1][drafted]
    return emitted, nodes_at, tried, passed, verified_to_end, accepted_to_end


class TimeAwareBudget:
    def __init__(
        self,
        max_depth: int,
        *,
        profile_steps: int,
        probe_interval: int,
        surplus_tail: bool,
        profile_path: Path | None,
        plain_hindsight: bool = False,
        probe_load_scale: int = 0,
        probe_next: bool = False,
        switch_margin: float = 0.0,
        catch_up: float = 0.0,
        stale_slot_steps: int = 0,
        continuation_memory: str = "steps",
        plain_head_rows: str = "measured",
        device: Any = "cpu",
        is_writer: bool = True,
        share: Share = _no_share,
    ) -> None:
        self.max_depth = max_depth
        self.profile_steps = profile_steps
        self.surplus_tail = surplus_tail
        self.profile_path = profile_path
        self.plain_hindsight = plain_hindsight
        if continuation_memory not in ("tries", "steps", "slots"):
            raise ValueError(f"continuation_memory must be 'tries', 'steps' or 'slots'; got {continuation_memory!r}")
        self.continuation_memory = continuation_memory
        if plain_head_rows not in ("batch", "measured"):
            raise ValueError(f"plain_head_rows must be 'batch' or 'measured'; got {plain_head_rows!r}")
        self.plain_head_rows = plain_head_rows
        self._head_rows_per_request: float | None = None  # exponential average over steps (see plain_head_seconds)
        self._head_rows_paid: float | None = None  # exponential average of merged / deferred rows per merge
        self.is_writer = is_writer
        self.share = share
        self.controller = DraftController(
            max_depth,
            probe_interval=probe_interval,
            probe_load_scale=probe_load_scale,
            probe_next=probe_next,
            switch_margin=switch_margin,
            catch_up=catch_up,
            stale_slot_steps=stale_slot_steps,
        )
        self.acceptance = AcceptanceModel(max_depth, device=device)
        # Trees: the nodes off the spine, learned online from the tree steps (not saved: the prior is the node's own
        # path confidence, which a few hundred verified siblings correct), in bins on the log scale.
        self.width_acceptance = AcceptanceModel(max_depth, device=device, log_floor=WIDTH_LOG_FLOOR)
        self.cost_model: CostModel | None = None
        self.samples = StepSamples()
        self._seen_shapes: set[tuple[int, int]] = set()  # (num_tokens, batch) of every step measured so far
        self.source = "none"
        if profile_path is not None and profile_path.exists():
            self.cost_model, self.acceptance = load_profile(profile_path, max_depth, device)
            self.source = f"file {profile_path}"
        self.profile_done = 0
        self.steps_seen = 0
        self.refit_interval = REFIT_INTERVAL  # steps from one refit to the next (doubles while the fit is stable)
        self._next_refit = REFIT_INTERVAL  # `steps_seen` of the next refit in the auto phase
        self._tried = [0.0] * max_depth  # continuation counts per depth 1..D (decayed)
        self._passed = [0.0] * max_depth
        # continuation_memory "slots": the same counts per load slot (`load_bucket`), faded on the same clock
        self._slot_tried: dict[int, list[float]] = {}
        self._slot_passed: dict[int, list[float]] = {}
        # Warm-up steps' level counts (batch, emitted, nodes, verified to end, accepted to end), kept until the cost
        # model can price them (`observe_sweep`): the depth plan's first values.
        self._seed_levels: deque[tuple[int, list[int], list[int], int, int, float]] = deque(maxlen=SEED_STEPS)
        # The current step's requests' tokens already in the KV cache (`set_step_context`): what the cost model's
        # context term prices in this step's selection and in the hindsight of the step it verified.
        self.context = 0.0
        self._curve_cache: dict[tuple[int, int, int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    # -- per step ---------------------------------------------------------------------------------------------

    def set_step_context(self, context: float) -> None:
        """At the start of every step, before its feedback, plan and selection: the tokens already in the KV cache
        of the step's requests, summed (data every TP rank has; 0 where the engine does not measure it). The
        feedback's hindsight prices the forward that just verified (this step's), the selection the next forward,
        whose context is this one plus one step's tokens: close enough for a term worth ~2.7 ms per 1,000 tokens."""
        self.context = float(context)

    def phase(self, warming_up: bool) -> str:
        if warming_up:
            return "warmup"
        return "profile" if self.cost_model is None else "auto"

    def plan(self, batch: int, nodes_per_depth: int, warming_up: bool, warmup_cap: int) -> DraftPlan:
        """This step's draft depth and candidate cap; refit points come first (the same step on every rank)."""
        self.steps_seen += 1
        phase = self.phase(warming_up)
        if phase == "profile" and self.profile_done >= self.profile_steps:
            self.refit(first=True)
        elif phase == "auto" and self.steps_seen >= self._next_refit:
            self.refit(first=False)
        elif phase == "auto" and self.steps_seen % REFIT_INTERVAL == 0:
            # The acceptance table keeps its REFIT_INTERVAL pace whatever the fit's: a stale table cuts the
            # budget on old acceptance (cheap: a few ops on [D, bins] counts every rank holds alike).
            self.acceptance.refresh()
            self.width_acceptance.refresh()
        phase = self.phase(warming_up)
        ceiling = batch * self.max_depth * nodes_per_depth
        if phase == "auto":
            plan = self.controller.plan(batch, ceiling)
            if plan.probe and nodes_per_depth > 1:  # a tree probe: the spines and one request's siblings
                plan = plan._replace(k_cap=tree_probe_cap(batch, plan.depth, nodes_per_depth))
            return plan
        if phase == "profile":
            self.profile_done += 1
            return DraftPlan(profile_step(self.profile_done - 1, self.max_depth)[0], ceiling, False)
        return DraftPlan(self.max_depth, min(ceiling, warmup_cap), False)

    def probe_due(self, batch: int, warming_up: bool) -> bool:
        """Whether this step's plan (the next `plan` call) is a depth-plan probe, asked before drafting. A refit
        inside `plan` may move the phase on that very step; then this answer is one step stale (harmless: it only
        decides whether the step drafts siblings)."""
        return self.phase(warming_up) == "auto" and self.controller.probe_due(batch)

    def select(
        self,
        tree: DraftTree,
        gates: Gates,
        batch: int,
        plan: DraftPlan,
        warming_up: bool,
        *,
        depth: int,
        chain: bool = False,
    ) -> tuple[BudgetSelection | None, torch.Tensor | None]:
        """(selection, predicted accepted drafts) in the profile and auto phases; (None, None) in warm-up, where
        the engine applies its own warm-up budget. depth: the tree's depth; chain: one node per depth."""
        phase = self.phase(warming_up)
        if phase == "warmup":
            return None, None
        if phase == "profile":
            rank, eligible = priority_rank(tree, gates, self.surplus_tail)
            fraction = profile_step(self.profile_done - 1, self.max_depth)[1]
            return select_by_rank(tree, rank, eligible, (eligible.sum() * fraction).floor().long()), None
        if plan.probe and not chain:
            # One request's siblings: a spine-sibling tree has N = depth x top_k nodes per request (no host sync).
            selection = tree_probe_selection(tree, tree.scores.shape[1] - depth)
            gains = self.acceptance.node_gain(tree, depth, False, self.width_acceptance)
            return selection, (gains * selection.selected).sum(dtype=torch.float64)
        rest_s, draft_s = self.curves(batch, tree.scores.numel(), depth, plan.depth, tree.scores.device)
        cost = self.cost_model
        # Width bought keeps the engine drafting trees (WidthSchedule): the prefixes with width are charged the next
        # step's drafting as a tree's, so siblings are bought only where they pay for that too.
        tree_draft_s = None if chain or cost is None else draft_s + cost.tree_draft_at(batch, plan.depth)
        auto = select_auto(
            tree,
            gates,
            self.acceptance.node_gain(tree, depth, chain, None if chain else self.width_acceptance),
            rest_s,
            draft_s,
            base_tokens=float(batch),
            k_cap=plan.k_cap,
            surplus_tail=self.surplus_tail,
            k_min=plan.k_cap if plan.probe else 0,  # a probe measures every depth: it verifies all it drafted
            tree_terms=cost.tree_terms if cost is not None else (0.0, 0.0),
            tree_draft_seconds=tree_draft_s,
        )
        return auto.selection, auto.choice.predicted_accepted

    def curves(
        self, batch: int, num_nodes: int, depth: int, planned_depth: int, device: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cost model's seconds for k = 0..num_nodes verified drafts at `batch`, and the drafting charged to a
        cut at depth 0..depth, on `device`; cached per shape until the next refit (most steps repeat the last).

        The drafting charged is the same for every cut: the next step's, at the planned depth. This step's drafts
        are already drafted when the selection runs (sunk: a shallower cut saves none of it), and what the next
        step drafts is the plan's choice, whatever this step verifies. (Charging draft(d) per cut depth d priced
        each cut as if its drafting could still be saved, which cut chains short.)

        The context term (`set_step_context`) is the same for every cut, added to the cached curve per step: it
        changes every step, and the best cut depends on it (tokens per second of the whole step)."""
        key = (batch, num_nodes, depth, planned_depth, str(device))
        cached = self._curve_cache.get(key)
        if cached is None:
            cost = self.cost_model
            assert cost is not None
            sizes = batch + torch.arange(num_nodes + 1, dtype=torch.float64)
            draft = torch.full((depth + 1,), cost.draft_seconds(batch, planned_depth), dtype=torch.float64)
            rest = cost.rest_seconds(sizes, batch)
            rest[1:] += cost.verify_at(batch, 1)  # any cut that verifies something pays verify(B)
            cached = (rest.to(device), draft.to(device))
            if len(self._curve_cache) > 256:  # batch sizes churn under load: keep the cache small
                self._curve_cache.clear()
            self._curve_cache[key] = cached
        context_s = self.cost_model.context_s if self.cost_model is not None else 0.0
        if context_s > 0.0 and self.context > 0.0:
            return cached[0] + context_s * self.context, cached[1]
        return cached

    def observe_selection(self, budget: int) -> None:
        """After the step's host sync: the drafts it selected."""
        self.controller.observe(budget)

    def observe_verification(
        self,
        accepted: torch.Tensor,
        verified_depths: torch.Tensor,
        batch: int,
        drafted_depth: int,
        *,
        stopped: bool = False,
    ) -> None:
        """A verified step in hindsight, for the depth plan: accepted [R] drafts per request, verified_depths [R, N]
        the depth of each verified node (0 = none), batch the requests of that step, drafted_depth how deep it
        drafted. Cut at depth d <= drafted it would have emitted B + sum_i min(accepted_i, d) tokens for the
        verified nodes of depth <= d and the drafting to depth d; the cost model prices it, and the plan averages
        each depth's rate over the step's plain-decoding rate. (One small host sync: the counts.)

        Depths deeper than drafted are imputed, so that every level is compared on the same step: the requests
        that were verified to the drafted depth would each have had the deeper nodes verified too (their cost), and
        those that accepted all of it would have gone on with the measured continuation rates P(accept depth j |
        reached j - 1) (`_continuation_rates`, counted over every request-step that verified depth j). Without this the
        deeper levels were measured only by probes (one step in 16, an average over one noisy step each) and the
        plan sat at a shallow depth between probes (batch 1 on the testbed: 2.3 where depth 4 is best).

        stopped: the draft loop ended at `drafted_depth` short of its plan because every chain's confidence was
        below draft_stop_confidence; any deeper plan would have stopped there too (the test reads only the drafts,
        which do not depend on the plan), so the deeper levels are this level, not imputed ones."""
        if self.cost_model is None or batch < 1:
            return
        if drafted_depth < 1:
            return self.observe_plain(batch)
        drafted = min(drafted_depth, self.max_depth)
        histograms = level_histograms(accepted, verified_depths, drafted).tolist()
        self.observe_verification_levels(histograms, batch, drafted, stopped=stopped)

    def observe_verification_levels(
        self, histograms: Sequence[int], batch: int, drafted_depth: int, *, stopped: bool = False
    ) -> None:
        """`observe_verification` from the step's level histograms on the host (`level_histograms` of its accepted
        drafts and verified depths at min(drafted_depth, D), or `echo::chain_feedback`'s)."""
        if self.cost_model is None or batch < 1:
            return
        if drafted_depth < 1:
            return self.observe_plain(batch)
        drafted = min(drafted_depth, self.max_depth)
        emitted_h, nodes_h, tried_h, passed_h, verified_to_end, accepted_to_end = level_counts_from_histograms(
            histograms, drafted
        )
        if nodes_h[drafted] == 0:  # drafted, but the budget verified nothing: a plain step
            return self.observe_plain(batch)
        self._count_continuation(tried_h, passed_h, batch)
        self._observe_levels(batch, emitted_h, nodes_h, verified_to_end, accepted_to_end, self.context, stopped=stopped)

    def observe_sweep(
        self, accepted: torch.Tensor, verified_depths: torch.Tensor, batch: int, drafted_depth: int, *, full: bool
    ) -> None:
        """A warm-up or profile step (its selection was the sweep's, not the plan's), in hindsight: its continuation
        events always (P(accept depth j | reached j - 1) needs only what was verified), and with `full` (a warm-up
        step: every drafted node verified, so only acceptance cut each request) its levels as the depth plan's
        first values - at once if the cost model exists, else kept (the newest SEED_STEPS) until the first fit
        prices them (`refit`). Profile steps verify fractions of their drafts, which cap the deeper levels by the
        sweep's cut: their levels stay out.

        Why: without them the plan started from its first two auto steps (MIN_MEASURED_REQUESTS at batch 4) and
        continuation rates resting on a handful of request-steps and the prior; on the testbed one such step
        that accepted 1 of 8 drafts put every depth below plain at batch 4, and the probes from plain (one depth
        deeper, the deeper levels imputed from those rates) held it there on 167 of ~500 steps where depth 4 pays ~1.5x.
        A warm-up of 16 steps at batch 4 is 64 request-steps verified to full depth: the same evidence a probe
        gives, sixteen times over."""
        if batch < 1 or drafted_depth < 1:
            return
        drafted = min(drafted_depth, self.max_depth)
        histograms = level_histograms(accepted, verified_depths, drafted).tolist()
        self.observe_sweep_levels(histograms, batch, drafted, full=full, requests=accepted.shape[0])

    def observe_sweep_levels(
        self, histograms: Sequence[int], batch: int, drafted_depth: int, *, full: bool, requests: int
    ) -> None:
        """`observe_sweep` from the step's level histograms on the host (see `observe_verification_levels`);
        requests: the verified requests of the step (R)."""
        if batch < 1 or drafted_depth < 1:
            return
        drafted = min(drafted_depth, self.max_depth)
        emitted_h, nodes_h, tried_h, passed_h, verified_to_end, accepted_to_end = level_counts_from_histograms(
            histograms, drafted
        )
        self._count_continuation(tried_h, passed_h, batch)
        if not full or nodes_h[drafted] == 0 or verified_to_end < requests:
            return  # a request cut short (e.g. by the scheduler's token budget) would cap the deeper levels
        if self.cost_model is None:
            self._seed_levels.append((batch, emitted_h, nodes_h, verified_to_end, accepted_to_end, self.context))
        else:
            self._observe_levels(batch, emitted_h, nodes_h, verified_to_end, accepted_to_end, self.context)

    def observe_plain(self, batch: int) -> None:
        """A step of `batch` requests that verified nothing (the plan or the budget chose plain decoding), in
        hindsight: every depth imputed from the continuation rates, as if each request had reached depth 0 and
        accepted it (`observe_verification` with nothing drafted). Without this a plain step adds nothing to the
        depth plan, so only probes can lift it out of plain decoding (batch 64 on the testbed with one probe in 256
        steps: plain on most steps where depth 1 paid 1.2x). The continuation rates move only with verified steps
        and probes, so a plain stretch tracks what the probes last measured instead of freezing the average. With
        the hindsight off (the default) the step only ages its load slot's values (`DraftController.step_weight`)."""
        if self.cost_model is None or batch < 1:
            return
        if not self.plain_hindsight:
            return self.controller.observe_unmeasured(batch)
        self._observe_levels(batch, [0.0], [0.0], float(batch), float(batch), self.context)

    def _observe_levels(
        self,
        batch: int,
        emitted_h: Sequence[float],
        nodes_h: Sequence[float],
        verified_to_end: float,
        accepted_to_end: float,
        context: float = 0.0,
        *,
        stopped: bool = False,
    ) -> None:
        """Level d = 0..D: the measured levels (emitted drafts and verified nodes per cut depth, up to the drafted
        depth), the deeper ones imputed (stopped: the drafted level itself, drafting included); each priced by the
        cost model, relative to the step's plain rate."""
        cost = self.cost_model
        assert cost is not None
        drafted = len(emitted_h) - 1
        emitted_h, nodes_h = list(emitted_h), list(nodes_h)
        rates = self._continuation_rates(batch)
        expected_extra = 0.0
        reach_p = 1.0
        for d in range(drafted + 1, self.max_depth + 1):  # imputed levels
            if stopped:
                emitted_h.append(emitted_h[drafted])
                nodes_h.append(nodes_h[drafted])
                continue
            reach_p *= rates[d - 1]
            expected_extra += reach_p
            emitted_h.append(emitted_h[drafted] + accepted_to_end * expected_extra)
            nodes_h.append(nodes_h[drafted] + verified_to_end * (d - drafted))
        # Per depth level, not per request; a level that verifies anything pays verify(B) on top, and plain decoding
        # the head work it defers to a later first pass (0 without defer_plain_head: nothing is deferred).
        rates_per_level = [
            (batch + emitted_h[d]) / max(cost.rest_at(batch + nodes_h[d], batch, context) + cost.verify_at(batch, nodes_h[d])
                                         + cost.draft_seconds(batch, min(d, drafted) if stopped else d)
                                         + (self.plain_head_seconds(batch) if d == 0 else 0.0), 1e-12)
            for d in range(len(emitted_h))
        ]  # fmt: skip
        # Relative to the step's own plain-decoding rate: steps of different batch sizes average on one scale.
        self.controller.observe_levels([r / max(rates_per_level[0], 1e-12) for r in rates_per_level], batch)

    def _count_continuation(self, tried: list[int], passed: list[int], batch: int | None = None) -> None:
        """Decayed counts of the continuation events, memory ~ 1 / CONTINUATION_DECAY request-steps: 'tries' counts a
        depth's own tries (a depth the plan does not draft keeps its counts until probes replace them); 'steps'
        every verified request-step (tried[0]: every verified request tries depth 1), for every depth, so that a
        depth only probes reach forgets stretches long past and leans on the pooled rate of recent steps.

        Why 'steps': on the testbed at batch 16 the depth-2 rate the timed job started from was the warm-up job's
        drain (its hardest requests at batch 2-7: 0.42), while its probes measured 0.67-0.92; the plan, at depth 1,
        valued depth 2 from that rate ~8 % below depth 1 and stayed there (probes add ~12 tries in 16 steps against
        a memory of ~100), where static depth 2 ran ~5 % faster."""
        keep = 1.0 - CONTINUATION_DECAY
        if self.continuation_memory in ("steps", "slots"):
            fade = keep ** (tried[0] if tried else 0)
            slot = load_bucket(batch) if self.continuation_memory == "slots" and batch is not None else None
            if slot is not None and slot not in self._slot_tried:
                self._slot_tried[slot] = [0.0] * self.max_depth
                self._slot_passed[slot] = [0.0] * self.max_depth
            counts = [(self._tried, self._passed)] + [
                (self._slot_tried[k], self._slot_passed[k]) for k in self._slot_tried
            ]  # every slot fades on the global clock: a slot not seen for long falls back to the global rates
            for tried_d, passed_d in counts:
                for d in range(len(tried_d)):
                    tried_d[d] *= fade
                    passed_d[d] *= fade
            added = [(self._tried, self._passed)]
            if slot is not None:
                added.append((self._slot_tried[slot], self._slot_passed[slot]))
            for tried_d, passed_d in added:
                for d, (t, a) in enumerate(zip(tried, passed)):
                    tried_d[d] += t
                    passed_d[d] += a
            return
        for d, (t, a) in enumerate(zip(tried, passed)):
            if t:
                self._tried[d] = keep**t * self._tried[d] + t
                self._passed[d] = keep**t * self._passed[d] + a

    def continuation_rates(self, batch: int | None = None) -> list[float]:
        """The continuation rates the depth plan imputes undrafted depths from at `batch` (the step log records
        them)."""
        return self._continuation_rates(batch)

    def _continuation_rates(self, batch: int | None = None) -> list[float]:
        """P(accept depth j | reached j - 1) per depth: each depth's counts shrunk towards the rate pooled over all
        depths (a depth no probe reached yet takes the pooled rate). With continuation_memory "slots" and a batch:
        the batch's load slot's counts, shrunk towards those global rates.

        Why slots: the rates value the depths a step did not draft, and a plan that drafts shallow measures them
        only through these rates. On the testbed each job's warm-up ended in its drain (batch 5 -> 1: the last and
        hardest requests), which left the depth-2 rate at 0.36 where the full batch's steps measure ~0.8; the
        timed job's batch-8 plan opened at depth 1, valued depth 2-4 from that rate below depth 1, and stayed there
        for 17-30 steps (docs/benchmarks.md, thirty-ninth session)."""
        pooled = (sum(self._passed) + CONTINUATION_PRIOR * 0.5) / (sum(self._tried) + CONTINUATION_PRIOR)
        rates = [
            (a + CONTINUATION_PRIOR * pooled) / (t + CONTINUATION_PRIOR) for t, a in zip(self._tried, self._passed)
        ]
        if self.continuation_memory != "slots" or batch is None:
            return rates
        slot = load_bucket(batch)
        tried, passed = self._slot_tried.get(slot), self._slot_passed.get(slot)
        if tried is None or passed is None:
            return rates
        return [(a + CONTINUATION_PRIOR * g) / (t + CONTINUATION_PRIOR) for t, a, g in zip(tried, passed, rates)]

    def plain_head_seconds(self, batch: int) -> float:
        """The head work a plain step of `batch` requests defers (`defer_plain_head`): h x the rows it defers.

        'batch' charges B rows, one per request. But a plain step defers every row of its first pass: each
        request's next-token row and the prompt rows of requests joining (a server admits a new request as one
        finishes, so under load most steps carry prompt tokens). A drafting step pays those rows' head work in its
        first pass, which the cost model's f + g B absorbs on average; charged B rows only, plain decoding looked
        cheaper than it is by h x the prompt rows of a step (batch 64 on the testbed: ~2 of ~32 ms, the size of
        depth 1's measured gain over plain there). 'measured' charges h x B x the average head rows per request
        of recent steps (forward tokens less verified drafts, per request: data every TP rank shares) x the share
        of deferred rows that later merges took (`record_head_merge`: below 1 with `deferred_head_window`)."""
        cost = self.cost_model
        if cost is None:
            return 0.0
        if self.plain_head_rows == "batch" or self._head_rows_per_request is None:
            return cost.plain_head_seconds(batch)
        paid = 1.0 if self._head_rows_paid is None else self._head_rows_paid
        return cost.plain_head_seconds(batch) * max(1.0, self._head_rows_per_request) * paid

    def record_head_merge(self, merged: int, deferred: int) -> None:
        """A first pass merged `merged` of the `deferred` head rows plain steps kept since the previous merge;
        the rest (finished requests, rows outside `deferred_head_window`) never cost head work, so 'measured'
        charges a plain step only this share of its rows. Counts every TP rank has alike."""
        if deferred <= 0:
            return
        share = min(1.0, merged / deferred)
        last = self._head_rows_paid
        self._head_rows_paid = share if last is None else last + HEAD_ROWS_WEIGHT * (share - last)

    def add_sample(self, sample: StepSample, warming_up: bool) -> None:
        """A measured step. Not a sample: the first step of each shape (tokens in the forward, batch), and a step
        much slower than predicted (it waited for work).

        Why the first of a shape: it pays one-off work that its later steps do not (kernel primitives and buffers
        created for a new row count, in the target forward and in the drafter's first pass, which reads the same
        rows). Measured in four batch-4 runs on the testbed: a token count's first step took 1.10-1.24x the median
        of its later ones outside the proposer, 1.2-1.3x inside (medians over 6-17 shapes). The start-up profile
        sweeps draft depths and verified fractions, so most of its token counts are new, while the warm-up's are
        all one (every depth drafted and verified): fitted on every step, the first model of one batch-4 run priced
        depths 1-2 2.5 and 2.4 ms above their steady steps (8.2 and 9.0 ms in static runs), depths 3-4 within
        0.7 ms, so the plan drafted deeper than the best static depth; on the same steps without each shape's
        first, 0.5 and 1.1 ms above, depths 3-4 within 0.1 ms."""
        if sample.batch > 0 and sample.num_tokens > 0:  # rows per request: counted for every step, slow or not
            rows = max(sample.num_tokens - sample.verified, sample.batch) / sample.batch
            last = self._head_rows_per_request
            self._head_rows_per_request = rows if last is None else last + HEAD_ROWS_WEIGHT * (rows - last)
        shape = (sample.num_tokens, sample.batch)
        if shape not in self._seen_shapes and len(self._seen_shapes) < MAX_SEEN_SHAPES:
            self._seen_shapes.add(shape)
            return
        if self.cost_model is not None:
            cost = self.cost_model
            predicted = (
                cost.rest_at(sample.num_tokens, sample.batch, sample.context)
                + cost.verify_at(sample.batch, sample.verified)
                + cost.tree_at(sample.width)
            )
            if sample.rest_s > IDLE_FACTOR * max(predicted, 1e-6):
                return
        profiling = self.phase(warming_up) != "auto" and len(self.samples.profile) < MAX_PROFILE_SAMPLES
        self.samples.add(sample, profile=profiling)

    # -- refits -----------------------------------------------------------------------------------------------

    def refit(self, *, first: bool) -> None:
        """Fit on the writer (rank 0) and share it, so that every rank decides identically; refresh acceptance."""
        fitted = fit_cost_model(self.samples.all()) if self.is_writer else None
        vector = [0.0] * COST_VECTOR_LENGTH
        if fitted is not None:
            packed = fitted.to_vector()
            vector[: len(packed)] = packed
        shared = self.share(vector)
        self.acceptance.refresh()
        self.width_acceptance.refresh()
        self._next_refit = self.steps_seen + self.refit_interval
        if shared[0] == 0:  # rank 0 had too few samples: keep what there is
            return
        old, self.cost_model = self.cost_model, CostModel.from_vector(shared)
        if not first and old is not None:  # both models are rank 0's: every rank spaces its refits alike
            stable = model_change(old, self.cost_model, self.max_depth) < REFIT_STABLE
            self.refit_interval = min(2 * self.refit_interval, MAX_REFIT_INTERVAL) if stable else REFIT_INTERVAL
            self._next_refit = self.steps_seen + self.refit_interval
        self._curve_cache.clear()
        while self._seed_levels:  # the warm-up's levels, priced now (oldest first, as they ran)
            self._observe_levels(*self._seed_levels.popleft())
        if first:
            self.source = f"profiled over {self.profile_done} steps"
            if self.is_writer and self.profile_path is not None and not self.profile_path.exists():
                try:
                    save_profile(self.profile_path, self.cost_model, self.acceptance)
                    self.source += f", saved to {self.profile_path}"
                except OSError as err:  # e.g. a read-only volume: the fit still applies in this process
                    self.source += f", NOT saved to {self.profile_path} ({err.strerror or err})"

    def summary(self, warming_up: bool) -> dict[str, Any]:
        return {
            "budget_mode": "auto",
            "phase": self.phase(warming_up),
            "cost_fit_error": self.cost_model.fit_error if self.cost_model is not None else None,
            "cost_model": self.cost_model.to_vector() if self.cost_model is not None else None,
            "budget_source": self.source,
            "refit_interval": self.refit_interval,
            # What the depth plan believes each draft depth 0..D is worth (expected tokens/s; None unmeasured).
            "depth_values": [None if v is None else round(v, 3) for v in self.controller.value],
            "acceptance_table": [[round(p, 3) for p in row] for row in self.acceptance.table.tolist()],
            "budget_profile_file": str(self.profile_path) if self.profile_path is not None else None,
        }
