"""The time-aware per-step budget (`k_max: "auto"`): how many of ECHO's candidates to verify this step.

ECHO's priority order is unchanged: every node gets its rank in the total order of `echo_vllm.core.budget`
(class: depth extension, then width, then - with `surplus_tail` - the drafted tails of truncated requests; then
path score descending, depth ascending, flat index). The fixed rule verifies the first K_max. The time-aware rule
verifies the first K, with K chosen to maximise the expected tokens per second of the step that verifies them:
    rate(K) = (B + sum_{j < K} g_j) / (rest(B + K, B) + draft(B, d))
where g_j is the j-th candidate's probability of being accepted (`AcceptanceModel`) and the denominator the
`CostModel`. K = 0 is allowed (plain decoding for the step); the first maximum wins (the cheapest of equals).
Ties of the rank with the fixed rule's: `select_by_rank(rank, eligible, K)` equals
`add_surplus_tails(select_budget(tree, gates, K), tree, gates, K)` (tested), so a fixed K_max and the chosen K
select through the same order.

`drafting_can_stop` is the exact early exit of the draft loop for chains: once no node deeper than the current
depth can be among the first `k_cap` candidates, drafting on cannot change the selection.
`DraftController` picks each step's draft depth (the depth worth most in hindsight) and candidate cap (host numbers only),
with a periodic probe at full depth so that the acceptance statistics stay fresh.
No vLLM import here; no host sync except where a docstring says so.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import torch

from .budget import CLASS_DEPTH, CLASS_WIDTH, BudgetSelection, candidate_class, compact_selection, total_order_rank
from .gating import Gates
from .tree import DraftTree

CLASS_TAIL = 2
CLASS_NONE = 3
# The depth plan's averaging weight per request-step (DraftController): ~40 steps of memory at batch 1.
REQUEST_WEIGHT = 0.05
# The depth plan drafts to full depth until its values rest on at least this many verified request-steps: one
# rejected request-step alone put every depth below plain and the plan decoded plain until the next probe.
MIN_MEASURED_REQUESTS = 8


def priority_rank(tree: DraftTree, gates: Gates, surplus_tail: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank [B, N] int64, eligible [B, N] bool): each node's position in ECHO's order; ineligible nodes rank last."""
    scores = tree.scores
    cls = candidate_class(scores, tree.depth, tree.valid, tree.spine, gates.depth_cap, gates.widen)
    prio = torch.where(
        (cls == CLASS_DEPTH) | (cls == CLASS_WIDTH), cls, torch.full_like(cls, CLASS_NONE)
    )  # candidate_class's "excluded" becomes NONE (3), so that tails can sit between width and the rest
    if surplus_tail:
        tail = (
            tree.valid
            & tree.spine
            & gates.truncated.unsqueeze(1)
            & (tree.depth > gates.depth_cap.unsqueeze(1))
            & ~torch.isnan(scores)
        )
        prio = torch.where(tail, torch.full_like(prio, CLASS_TAIL), prio)
    # +0.0 folds -0.0 into 0.0, as the selection does.
    rank = total_order_rank(prio.reshape(-1), (scores + 0.0).reshape(-1), tree.depth.reshape(-1))
    return rank.reshape(scores.shape), prio != CLASS_NONE


def select_by_rank(
    tree: DraftTree, rank: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor | int
) -> BudgetSelection:
    """The first `k` eligible candidates (k may be a 0-d tensor: no host sync)."""
    return compact_selection(eligible & (rank < k), tree.depth, tree.parent)


def tree_probe_selection(tree: DraftTree, siblings: int) -> BudgetSelection:
    """A tree probe's selection: every valid spine node (each depth measured for the depth plan's hindsight, as a
    chain probe does) and the `siblings` best-scored valid nodes off the spine (the width model's samples).

    A probe used to verify every drafted node: B x D x top_k, 242 nodes at batch 32 on the testbed, a step of 110 ms
    against 45 ms for a chain step, every probe_interval steps. The siblings a budget would consider are the
    best-scored ones, so those are the samples worth their cost; a spine-sibling tree's siblings hang off spine
    nodes, so the selection is ancestor-closed. Deterministic for equal inputs (every TP rank selects alike)."""
    usable = tree.valid & ~torch.isnan(tree.scores)
    off_spine = usable & ~tree.spine
    flat = torch.where(off_spine, tree.scores.float(), torch.full_like(tree.scores.float(), float("-inf")))
    flat = flat.reshape(-1)
    chosen = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    count = min(max(siblings, 0), flat.numel())
    if count:
        chosen[torch.topk(flat, count, sorted=False).indices] = True
    selected = (usable & tree.spine) | (chosen.reshape(off_spine.shape) & off_spine)
    return compact_selection(selected, tree.depth, tree.parent)


def in_rank_order(rank: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[B * N]: position j holds the value of the node of rank j."""
    flat_rank = rank.reshape(-1)
    ordered = torch.empty(flat_rank.numel(), dtype=values.dtype, device=rank.device)
    ordered.scatter_(0, flat_rank, values.reshape(-1))
    return ordered


class BudgetChoice(NamedTuple):
    depth: torch.Tensor  # 0-d int64: the deepest depth the choice may use (its drafting cost is charged)
    last_position: torch.Tensor  # 0-d int64: candidates of rank <= this (and depth <= `depth`) are selected; -1 none
    k: torch.Tensor  # 0-d int64: drafts selected
    predicted_accepted: torch.Tensor  # 0-d float64: expected accepted drafts of the selection


def choose_budget(
    ordered_gains: torch.Tensor,
    ordered_depth: torch.Tensor,
    ordered_eligible: torch.Tensor,
    rest_seconds: torch.Tensor,
    draft_seconds: torch.Tensor,
    *,
    base_tokens: float,
    k_cap: int,
    k_min: int = 0,
    ordered_width: torch.Tensor | None = None,
    tree_terms: tuple[float, float] = (0.0, 0.0),
    tree_draft_seconds: torch.Tensor | None = None,
) -> BudgetChoice:
    """The (draft depth d, prefix of ECHO's order) with the highest expected tokens per second (no host sync).

    ordered_* [M]: gain, depth and eligibility of the candidates in rank order; rest_seconds [M + 1]: predicted
    seconds outside the proposer of a step verifying k = 0..M drafts; draft_seconds [D + 1]: drafting to depth
    0..D. For each d the candidates deeper than d drop out and the rate of every prefix of the rest is
    (base + sum of gains) / (rest(k) + draft(d)); plain decoding (k = 0 at d = 0) comes first, so among equal
    rates the cheapest wins. k_cap bounds and k_min (probe steps) floors the count (at most at the eligible count).
    ordered_width [M]: the candidates off the spine; a prefix holding W > 0 of them pays tree_terms (t0 + t1 W)
    and drafts with tree_draft_seconds [D + 1] in place of draft_seconds (None: the same drafting either way).
    """
    device = ordered_gains.device
    m = ordered_gains.numel()
    levels = torch.arange(draft_seconds.numel(), device=device)
    mask = ordered_eligible.unsqueeze(0) & (ordered_depth.unsqueeze(0) <= levels.unsqueeze(1))  # [D + 1, M]
    gain = torch.cumsum(mask.to(torch.float64) * ordered_gains.to(torch.float64).unsqueeze(0), dim=1)
    count = torch.cumsum(mask.to(torch.int64), dim=1)
    rest = rest_seconds.to(device, torch.float64)
    draft = draft_seconds.to(device, torch.float64)
    step_rest = rest[count]
    step_draft = draft.unsqueeze(1)  # [D + 1, 1]: every prefix of a cut depth drafts alike ...
    if ordered_width is not None and (any(tree_terms) or tree_draft_seconds is not None):
        # A prefix that verifies W > 0 nodes off the spine is a tree step: it pays t0 + t1 W on top of its tokens,
        # and its width keeps the engine drafting trees (`WidthSchedule`): the drafting it is charged is a tree's.
        width = torch.cumsum((mask & ordered_width.unsqueeze(0)).to(torch.float64), dim=1)
        step_rest = step_rest + torch.where(width > 0, tree_terms[0] + tree_terms[1] * width, torch.zeros_like(width))
        if tree_draft_seconds is not None:  # ... but for the prefixes with width
            step_draft = torch.where(width > 0, tree_draft_seconds.to(device, torch.float64).unsqueeze(1), step_draft)
    rate = (base_tokens + gain) / (step_rest + step_draft).clamp(min=1e-12)
    plain = (base_tokens / (rest[0] + draft[0]).clamp(min=1e-12)).reshape(1)
    # A probe's floor is what it can verify: with fewer eligible candidates than k_min (rows dropped as partial
    # prefills, drafting stopped at a closed gate) it verifies them all; a floor above them made every cut
    # ineligible and the probe decoded plain.
    floor = torch.clamp(ordered_eligible.sum(), max=k_min)
    allowed = mask & (count <= k_cap) & (count >= floor)
    rate = torch.where(allowed, rate, torch.full_like(rate, float("-inf")))
    plain = torch.where(floor > 0, torch.full_like(plain, float("-inf")), plain)
    flat = torch.cat([plain, rate.reshape(-1)])
    pick = torch.argmax(flat)  # the first maximum: plain decoding, then shallower, then shorter prefixes
    cell = (pick - 1).clamp(min=0)
    depth, position = cell // max(m, 1), cell % max(m, 1)
    is_plain = pick == 0
    k = torch.where(is_plain, torch.zeros_like(pick), count.reshape(-1)[cell] if m else torch.zeros_like(pick))
    predicted = torch.where(
        is_plain, torch.zeros((), dtype=torch.float64, device=device), gain.reshape(-1)[cell] if m else 0.0
    )
    return BudgetChoice(
        torch.where(is_plain, torch.zeros_like(depth), depth),
        torch.where(is_plain, torch.full_like(position, -1), position),
        k,
        predicted,
    )


class AutoSelection(NamedTuple):
    selection: BudgetSelection
    choice: BudgetChoice


def select_auto(
    tree: DraftTree,
    gates: Gates,
    gains: torch.Tensor,
    rest_seconds: torch.Tensor,
    draft_seconds: torch.Tensor,
    *,
    base_tokens: float,
    k_cap: int,
    surplus_tail: bool,
    k_min: int = 0,
    tree_terms: tuple[float, float] = (0.0, 0.0),
    tree_draft_seconds: torch.Tensor | None = None,
) -> AutoSelection:
    """ECHO's order, cut where expected tokens per second peak (see `choose_budget` and the module docstring).

    gains [B, N]: each node's probability of being accepted; rest_seconds [B * N + 1]; draft_seconds [D + 1];
    tree_terms: the cost model's (t0, t1), charged to prefixes that verify nodes off the spine; tree_draft_seconds
    [D + 1]: the drafting charged to those prefixes (None: draft_seconds).
    """
    rank, eligible = priority_rank(tree, gates, surplus_tail)
    choice = choose_budget(
        in_rank_order(rank, gains.to(torch.float64)),
        in_rank_order(rank, tree.depth.to(torch.int64)),
        in_rank_order(rank, eligible),
        rest_seconds,
        draft_seconds,
        base_tokens=base_tokens,
        k_cap=k_cap,
        k_min=k_min,
        ordered_width=in_rank_order(rank, eligible & ~tree.spine),
        tree_terms=tree_terms,
        tree_draft_seconds=tree_draft_seconds,
    )
    chosen = eligible & (rank <= choice.last_position) & (tree.depth <= choice.depth)
    return AutoSelection(compact_selection(chosen, tree.depth, tree.parent), choice)


def drafting_can_stop(
    scores: torch.Tensor, valid: torch.Tensor, gates: Gates, k_cap: int, surplus_tail: bool
) -> torch.Tensor:
    """0-d bool: drafting deeper than the current depth d cannot change the first `k_cap` candidates (chains).

    scores, valid [B, d]: the chains' cumulative path scores so far; gates: evaluated on the depths drafted so
    far (gates of deeper depths treated as open). Deeper nodes of an untruncated request are depth candidates with
    scores <= its frontier score f (log-probs <= 0), so they rank after every current depth candidate scoring >= f
    (equal scores: the shallower first): if k_cap of those exist, none enters. Deeper nodes of a truncated request
    are tails, ranked after every depth candidate: none enters once k_cap depth candidates exist. A gate that
    closes deeper only turns deeper nodes into tails, so the test stays exact. (Chains have no width candidates.)
    """
    batch, depth = scores.shape
    if depth == 0 or batch == 0:
        return torch.tensor(False)
    usable = valid & ~torch.isnan(scores)
    depths = torch.arange(1, depth + 1, device=scores.device, dtype=torch.int32)
    in_cap = depths.unsqueeze(0) <= gates.depth_cap.unsqueeze(1)
    candidates = usable & in_cap
    num_candidates = candidates.sum()
    frontier_open = usable[:, -1]
    depth_open = frontier_open & ~gates.truncated
    tail_open = frontier_open & gates.truncated
    neg_inf = torch.full_like(scores[:, -1], float("-inf"))
    best_frontier = torch.where(depth_open, scores[:, -1], neg_inf).max()
    ahead = (candidates & (scores >= best_frontier)).sum()
    depth_done = ~depth_open.any() | (ahead >= k_cap)
    tails_done = ~(surplus_tail & (tail_open.any() | depth_open.any())) | (num_candidates >= k_cap)
    return depth_done & tails_done


def drafts_below_confidence(path_logps: torch.Tensor, kept: torch.Tensor | None, log_threshold: float) -> bool:
    """Whether every kept row's chain so far has a path log-probability below `log_threshold` (ECHO's
    `draft_stop_confidence`): then the draft loop stops, as no node deeper than these is worth a draft level.

    path_logps [B]: each row's cumulative draft log-prob through the deepest drafted level (its depth
    confidence, in logs); kept [B] bool or None (every row): rows whose drafts vLLM keeps. A deeper node's path
    score is at most its frontier's (log-probs <= 0), so once every frontier is below the threshold every deeper
    node is too. NaN rows never count as below (the loop goes on); no kept row: False (nothing to decide on).
    A host decision on CPU tensors (no device sync there; the proposer applies it on CPU only)."""
    below = path_logps < log_threshold  # NaN compares False: such a row keeps the loop going
    if kept is not None:
        if not bool(kept.any()):
            return False
        below = below | ~kept
    return bool(below.all())


class DraftPlan(NamedTuple):
    depth: int  # draft depth for this step (0 = no drafts, the drafter's first pass still runs)
    k_cap: int  # at most this many candidates may be verified
    probe: bool  # a probe step: full depth, and every draft verified (each depth measured in hindsight)


def load_bucket(batch: int) -> int:
    """The depth plan's memory slot for a batch size: 1, 2, 3-5, 6-11, 12-23, 24-47, 48-95, ... (edges at 1.5 x
    powers of two, so that the usual max_num_seqs - 1, 4, 8, 16, 32, 64 - sit inside a slot: a batch of 32 that
    dips to 31 as requests finish keeps its memory)."""
    if batch <= 1:
        return 0
    return int(math.floor(math.log2(batch / 1.5) + 1e-9)) + 1


class LevelMemory:
    """The bias-corrected exponential average of each depth's worth, for one load slot (`load_bucket`), and of
    the paired differences between depths (for the standard error of one depth's lead over another)."""

    def __init__(self, max_depth: int, *, pairs: bool = True) -> None:
        """pairs: keep the paired differences (only `DraftController._settle` with a switch margin reads `lead`;
        without one, the (D + 1)^2 updates per step are skipped)."""
        n = max_depth + 1
        self.pairs = pairs
        self.sums = [0.0] * n  # decayed sums of the rates and of their weights, per depth
        self.weights = [0.0] * n
        self.value: list[float | None] = [None] * n  # per depth: average worth, None unmeasured
        self.measured_requests = 0  # request-steps observed
        # Per pair (d, e), over the steps that measured both: decayed sums of w, w^2, w x and w x^2 for the
        # difference x = rate_d - rate_e. The levels of one step share its batch, its text and its step time, so
        # the paired difference is far less noisy than either level (and its error is what a switch risks).
        self._pair = [[[0.0, 0.0, 0.0, 0.0] for _ in range(n)] for _ in range(n)]

    def seeded(self, weight: float, requests: int) -> LevelMemory:
        """A new memory holding this one's values at `weight` (one step's worth: the next measured steps of the
        new memory's own slot outweigh them at once) and `requests` measured request-steps; no paired differences."""
        seed = LevelMemory(len(self.value) - 1, pairs=self.pairs)
        for d, value in enumerate(self.value):
            if value is not None:
                seed.sums[d], seed.weights[d], seed.value[d] = weight * value, weight, value
        seed.measured_requests = requests
        return seed

    def add(self, level_rates: list[float], weight: float, requests: int) -> None:
        self.measured_requests += requests
        keep = 1.0 - weight
        finite = [rate == rate and rate != float("-inf") for rate in level_rates]  # skip NaN and unmeasured depths
        for d, rate in enumerate(level_rates):
            if finite[d]:
                self.sums[d] = keep * self.sums[d] + weight * rate
                self.weights[d] = keep * self.weights[d] + weight
                self.value[d] = self.sums[d] / self.weights[d]
                if not self.pairs:
                    continue
                for e, other in enumerate(level_rates):
                    if e != d and finite[e]:
                        pair, x = self._pair[d][e], rate - other
                        pair[0] = keep * pair[0] + weight
                        pair[1] = keep * keep * pair[1] + weight * weight
                        pair[2] = keep * pair[2] + weight * x
                        pair[3] = keep * pair[3] + weight * x * x

    def lead(self, d: int, e: int) -> tuple[float, float]:
        """(mean, standard error) of depth d's worth minus depth e's over the steps that measured both; the error
        is inf until two steps did (a weighted mean's variance over its effective sample size w^2 / sum w^2)."""
        if not self.pairs:
            raise ValueError("LevelMemory(pairs=False) keeps no paired differences: construct it with pairs=True")
        w, w2, wx, wxx = self._pair[d][e]
        if w <= 0.0:
            return 0.0, float("inf")
        mean = wx / w
        n_eff = w * w / w2
        if n_eff < 2.0 - 1e-9:
            return mean, float("inf")
        variance = max(wxx / w - mean * mean, 0.0) * n_eff / (n_eff - 1.0)  # unbiased for the weights' n_eff
        return mean, math.sqrt(variance / n_eff)


class DraftController:
    """Each step's draft depth and candidate cap, from what recent steps were worth at each depth.

    After every verified step the engine reports, in hindsight, the tokens per second its selection would have
    had if cut at depth d = 0..drafted (`level_rates`: realised accepted drafts, modelled step time; see
    `TimeAwareBudget.observe_verification`). An exponential average per depth over the steps that reported it
    estimates each depth's worth; the plan drafts to the best. The average's weight per step grows with the
    requests the step verified, a = min(alpha, 1 - (1 - request_weight)^B): one step of one request is one
    accept-or-reject draw (at batch 1 a depth-4 level ranged 0.6-3.2x plain from step to step on the testbed), so
    with a = 0.2 at every batch a few rejections in a row put the plan to plain decoding, where only probes could
    lift it again (batch 1: plain on 15 % of steps, depth 1-2 on 34 %, where depth 4 pays 1.5x). With the weight
    per request the average spans ~40 steps at batch 1 (a = 0.05); from 5 requests up it is `alpha`, as before (a
    smaller weight per request would also slow the adaptation of batches 2-4 to easy and hard stretches).
    The average is bias-corrected (sums of weights kept), so the first steps count equally instead of the very
    first one standing for the whole memory, and the plan drafts to full depth until MIN_MEASURED_REQUESTS
    request-steps are in it. Realised acceptance, not the model's, so that a pessimistic acceptance table cannot
    keep drafting shallow. Depths deeper than the plan
    are re-measured by probe steps (every `probe_interval` steps: full depth, every draft verified — a probe that
    verified only what the budget wanted would see deeper depths capped by its own cut, and plain decoding,
    once chosen, would never be left) and, until measured, by drafting to full depth. k_cap: four times the largest budget of the last
    `window` steps, at least twice the batch size (a trust region that can quadruple per step; it is what lets the
    early exit of drafting fire at large batches), the ceiling on probes. Decisions depend on step counts and on
    data every TP rank shares.

    The averages are kept per load slot (`load_bucket` of the step's batch size): what a depth is worth relative
    to plain decoding depends on the load (on the testbed depth 4 pays ~1.5x at batch 1 and breaks even at batch
    32), so one average over every batch size carried the verdict of a busy period into a quiet one (and back):
    after a stretch at batch 32 had settled on plain decoding, the batch-4 steps that followed decoded plain
    until enough probes had moved the shared average. A slot with too few measured request-steps drafts to full
    depth, as the whole plan did before its first measurements.
    """

    def __init__(
        self,
        max_depth: int,
        *,
        window: int = 8,
        probe_interval: int = 16,
        probe_load_scale: int = 0,
        probe_next: bool = False,
        alpha: float = 0.2,
        request_weight: float = REQUEST_WEIGHT,
        switch_margin: float = 0.0,
        catch_up: float = 0.0,
        stale_slot_steps: int = 0,
    ) -> None:
        self.max_depth = max_depth
        self.switch_margin = switch_margin
        self.catch_up = catch_up
        self.stale_slot_steps = stale_slot_steps
        self._refreshed_at: dict[int, int] = {}  # per load slot: the step count at its last measured (or seeded) step
        self._unmeasured: dict[int, int] = {}  # per load slot: steps since its last measured one that added nothing
        self._current: dict[int, int] = {}  # per load slot: the depth the plan last chose (not probes)
        self.probe_interval = probe_interval
        self.probe_load_scale = probe_load_scale
        self.probe_next = probe_next
        self._last_probe = -1  # the step count at the last probe
        self.alpha = alpha
        self.request_weight = request_weight
        self._memory: dict[int, LevelMemory] = {}  # per load slot
        self._slot = 0  # the load slot of the last planned or observed step: the one `value` shows
        self._budget: deque[int] = deque(maxlen=window)
        self.last_levels: list[float] = []  # the last verified step's level rates (the step log shows them)
        self.steps = 0

    def _memory_of(self, slot: int) -> LevelMemory:
        memory = self._memory.get(slot)
        if memory is None:
            memory = self._memory[slot] = LevelMemory(self.max_depth, pairs=self.switch_margin > 0.0)
        return memory

    @property
    def value(self) -> list[float | None]:
        """Per depth 0..D: the average worth relative to plain decoding in the current load slot (None unmeasured)."""
        memory = self._memory.get(self._slot)
        return list(memory.value) if memory is not None else [None] * (self.max_depth + 1)

    @property
    def measured_requests(self) -> int:
        """Verified request-steps behind the current load slot's values."""
        memory = self._memory.get(self._slot)
        return memory.measured_requests if memory is not None else 0

    def probe_every(self, batch: int) -> int:
        """Steps between probes at `batch`: `probe_interval`, or with `probe_load_scale` S > 0 that times
        ceil(B / S), so that the request-steps a probe adds per step stay the same at every load (a probe drafts
        B x D nodes and verifies them all, a cost that grows with B where verification is linear in tokens).

        A plan that decodes plain in this load slot probes every `probe_interval` steps whatever the load: there
        probes are its only measurements and the only way back to drafting, and a probe costs little next to a
        plain step that is worth about as much as drafting (otherwise it would not be plain). Scaled, batch 256
        waited 1024 steps between looks, long enough to miss a whole easy phase of the workload; on the testbed
        at batch 64, where the plan sits at plain on most steps, this rule ran 1.011 of the scaled one (paired
        rounds, docs/benchmarks.md, thirty-ninth session)."""
        if self.probe_interval <= 0:
            return 0
        if self.probe_load_scale <= 0 or self._current.get(load_bucket(batch)) == 0:
            return self.probe_interval
        return self.probe_interval * max(1, math.ceil(batch / self.probe_load_scale))

    def probe_due(self, batch: int) -> bool:
        """Whether the next `plan` at `batch` is a probe (no state changes)."""
        interval = self.probe_every(batch)
        return interval > 0 and self.steps - self._last_probe >= interval

    def plan(self, batch: int, ceiling: int) -> DraftPlan:
        """ceiling: the most candidates this step can have (B x nodes per request)."""
        previous, self._slot = self._slot, load_bucket(batch)
        if self._slot != previous:
            self._reseed_stale(self._slot, previous)
        probe = self.probe_due(batch)
        if probe:
            self._last_probe = self.steps
        memory = self._memory_of(self._slot)
        if any(v is None for v in memory.value) or memory.measured_requests < MIN_MEASURED_REQUESTS:
            return DraftPlan(self.max_depth, ceiling, probe)
        values = [v if v is not None else float("-inf") for v in memory.value]
        depth = max(range(len(values)), key=lambda d: (values[d], -d))  # the best; the shallowest among equals
        depth = self._settle(memory, depth)
        if probe:
            if not self.probe_next:
                return DraftPlan(self.max_depth, ceiling, True)
            # One deeper than the best: every draft of it verified, so the best and its deeper neighbour are
            # measured on the same step (ceiling = B x D x nodes per depth; the probe's cap is its depth's share).
            # From plain decoding, one deeper than the best drafting depth: plain's rival is that depth, not depth
            # 1, whose step pays drafting's fixed costs (the first pass, verify(B)) for one draft per request.
            # Probing depth 1 from plain measured only that, the deeper levels imputed from continuation rates
            # of a bad stretch that nothing re-measured: batch 4 on the testbed sat at plain for ~130 steps
            # (probe after probe at depth 1 below plain) where depth 3-4 paid ~1.2x.
            base = depth if depth > 0 else max(range(1, len(values)), key=lambda d: (values[d], -d))
            probe_depth = min(self.max_depth, base + 1)
            return DraftPlan(probe_depth, ceiling // self.max_depth * probe_depth, True)
        self._current[self._slot] = depth
        return DraftPlan(depth, min(ceiling, max(4 * max(self._budget, default=0), 2 * batch)), False)

    def _fresh(self, slot: int) -> bool:
        at = self._refreshed_at.get(slot)
        return at is not None and self.steps - at <= self.stale_slot_steps

    def _reseed_stale(self, slot: int, previous: int) -> None:
        """With `stale_slot_steps` S > 0: a plan moving into a neighbouring load slot that measured nothing in the
        last S steps starts from the slot it leaves (its values at one step's weight), if that one is fresh.

        Why: a slot's values are what drafting was worth when it last ran at that load, which may be another phase
        of the workload altogether. On the testbed every job's drain (the queue empty, the batch shrinking) passed
        through slots last measured in the warm-up job's drain, whose few requests were its hardest: values of
        0.94-1.0x plain for depths the job's own steps had just measured at 1.4-1.65x. The plan decoded plain at
        batch 3-11 for ~10 steps until a probe (batch 16, 3 of 3 jobs), and the drain took 0.70-0.83 s against
        EAGLE-3@2's 0.57-0.60 s. The neighbouring slot's fresh values are the better prior: the load differs by at
        most ~2x, and the new slot's own steps replace them within a few steps. Only neighbours: a jump across
        slots (a warm-up's batch-1 tail into a full batch) keeps the slot's own values. Step counts only: every TP
        rank decides alike."""
        if self.stale_slot_steps <= 0 or abs(slot - previous) != 1 or self._fresh(slot) or not self._fresh(previous):
            return
        source = self._memory.get(previous)
        if source is None or source.measured_requests < MIN_MEASURED_REQUESTS or None in source.value:
            return
        self._memory[slot] = source.seeded(self.alpha, MIN_MEASURED_REQUESTS)
        self._refreshed_at[slot] = self.steps
        self._unmeasured.pop(slot, None)
        if previous in self._current:
            self._current[slot] = self._current[previous]

    def _settle(self, memory: LevelMemory, best: int) -> int:
        """With `switch_margin` z > 0: the plan leaves its current depth c only for a depth whose paired lead over
        c exceeds z standard errors (`LevelMemory.lead`), the best of those; otherwise it stays at c.

        Why: neighbouring depths are often worth nearly the same (batch 16 on the testbed: the per-step depth-2
        increment over depth 1 had mean 0.067 and s.d. 0.10 of the plain rate, over an average of ~9 steps), and
        an argmax over values that close follows the noise: one batch-64 run's plan swung between plain decoding
        and depth 4 (78 plain, 21 / 23 / 12 / 9 steps at depths 1-4) where static depths 1 and 2 ran within 5 %
        of each other, and paid for the swings (a plain stretch defers head work, a deep step drafts for nothing).
        """
        current = self._current.get(self._slot)
        if self.switch_margin <= 0.0 or current is None or current == best:
            return best
        leads = [memory.lead(d, current) for d in range(self.max_depth + 1)]
        clear = [d for d, (mean, error) in enumerate(leads) if d != current and mean > self.switch_margin * error]
        if not clear:
            return current
        return max(clear, key=lambda d: (leads[d][0], -d))

    def observe(self, budget: int) -> None:
        """One step's verified drafts (every step, plain ones too)."""
        self._budget.append(budget)
        self.steps += 1

    def observe_unmeasured(self, batch: int) -> None:
        """A step of `batch` requests that added no levels (plain decoding, its hindsight off): its load slot's
        values grow one step older unmeasured (see `observe_levels`)."""
        slot = load_bucket(batch)
        self._unmeasured[slot] = self._unmeasured.get(slot, 0) + 1

    def step_weight(self, batch: int, stale_steps: int = 0) -> float:
        """The averaging weight of one measured step of `batch` requests that follows `stale_steps` steps of its
        slot that measured nothing: a = min(alpha, 1 - (1 - request_weight)^B) per step; with `catch_up` c > 0,
        stale steps and a below alpha (few requests: batch 1-4 at the defaults), the weight the average would have
        given the step had it aged on every one of them, 1 - (1 - a)^(1 + stale), at most c.

        Why: the average ages per measured step, and a plan at plain decoding measures only its probes (one step
        in 16), so values from a bad stretch stood for 16 steps per probe. On the testbed at batch 4 the warm-up
        ended on one: every depth below plain (0.72-0.83), the first probe measured depth 1-4 at 1.24-1.77x plain
        and moved them only to 0.90-0.95 at one step's weight; the plan sat at plain for 25 steps (two probes)
        where drafting paid ~1.2x. The cap keeps one step's draw from replacing the average outright. Only at
        small batches: there drafting pays clearly (1.2-1.5x) and one text's hard stretch is what put the plan at
        plain; at batch 16, where plain decoding and drafting run close, the rule cost 2-5 % (3 of 3 paired
        rounds: one probe's noise flips the plan), while batch 1 gained ~8 % (scripts/variants_ab.py,
        docs/benchmarks.md)."""
        a = min(self.alpha, 1.0 - (1.0 - self.request_weight) ** max(1, batch))
        if self.catch_up <= 0.0 or stale_steps <= 0 or a >= self.alpha:
            return a
        return max(a, min(self.catch_up, 1.0 - (1.0 - a) ** (1 + stale_steps)))

    def observe_levels(self, level_rates: list[float], batch: int | None = None) -> None:
        """What a verified step of `batch` requests was worth cut at depth 0..len - 1 (relative to plain decoding),
        into that batch's load slot, at `step_weight` (the slot's stale steps since its last measured one); batch
        None: the current slot, the step weighs `alpha` and counts as measured enough."""
        self.last_levels = list(level_rates)
        if batch is None:
            self._memory_of(self._slot).add(self.last_levels, self.alpha, MIN_MEASURED_REQUESTS)
            self._refreshed_at[self._slot] = self.steps
            return
        self._slot = load_bucket(batch)
        a = self.step_weight(batch, self._unmeasured.pop(self._slot, 0))
        self._memory_of(self._slot).add(self.last_levels, a, batch)
        self._refreshed_at[self._slot] = self.steps
