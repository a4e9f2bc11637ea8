"""A measured cost model of one engine step, for the time-aware budget (`k_max: "auto"`).

One step of a speculative engine costs
    step_seconds(N, B, d) = rest(N, B) + draft(B, d)
where N is the number of tokens in the step's target forward (B running requests plus the drafts verified plus
prefill chunks), B the number of running requests and d the draft depth drafted in the step.
  rest(N, B)  = everything outside the proposer (scheduler, target forward, sampling and acceptance, host work):
                a piecewise-linear, non-decreasing curve in N over power-of-two knots (flat below the hardware's
                saturation knee on a GPU, about linear on a small CPU) plus a per-request term;
  draft(B, d) = a + b B + [d >= 1] (f + g B) + d (c + e B): the proposer's fixed work, the drafter's first
                pass (which also feeds the accepted tokens of the last step: on the testbed it costs 2-3x a chained
                pass, so a model linear in d overprices deep drafts) and d chained passes at batch B (plus
                loop(B), below, from d = 2).
A step whose forward verifies any drafts (V > 0) adds
  verify(B)   = [V > 0] (v0 + v1 B): what verifying at all costs over a plain step, whatever the number of drafts:
                multi-token queries (vLLM's CPU attention takes its prefill path for them), the rejection sampler,
                the padded drafter inputs. On the testbed at batch 8 one verified draft costs ~3 ms more than none
                and 32 cost ~5 ms: a curve through power-of-two knots alone spreads that jump over N = B..2B and
                prices small budgets far too low, so the budget buys them on many steps and pays the jump each time.
A step that verifies a tree with W nodes off the spine (rows whose attention needs the tree mask) adds
  tree(W)     = t0 [W > 0] + t1 W: the tree step's fixed work (positions, masks, compaction) and the masked
                attention per such row, which a step of N chain tokens does not pay.
A step whose requests hold C tokens in the KV cache already (their context, summed) adds
  context(C)  = k C: reading that cache in the target forward's attention. On the testbed's CPU at batch 64 it is
                ~2.7 ms per 1,000 context tokens, the same in four runs, and the same for a plain step and for one
                verifying 1-4 drafts per request (the forward reads each request's cache once, whatever its query
                rows). Without it the curve in N took the contexts of the steps it was fitted on: samples from the
                warm-up's long contexts (11-19k tokens) priced the timed steps (7-15k) up to 27 ms high at batch 64, the
                drafting shapes the plan ran rarely the most, and the plan swung between plain decoding and depth 3
                where static depths 1-2 were best. A sample without a context (C = 0, e.g. the HF engine) leaves k
                at 0.
A step whose drafter drafted trees (the per-depth top-k siblings, `top_k > 1`) adds to its drafting
  tree_draft(B, d) = p0 + p1 B d: the top-k of every drafted depth and the tree's listing in the selection,
                which a chain-drafting step does not pay. On the testbed at batch 8 a tree-drafting step's proposer
                took 4.4 / 6.1 ms at depths 1 / 2 against 2.8 / 4.6 for chains (medians, s27 profile job). Without
                the term that extra was spread over every step's draft terms (chain steps priced high) and the
                selection bought siblings as if drafting them were free: the next step drafts trees again because
                of them (`WidthSchedule`), so the budget charges a prefix with width the next step's tree drafting
                (`TimeAwareBudget.curves`), and width is bought only where it pays for that too.
A step that drafts deeper than one (d >= 2) adds to its drafting
  loop(B)     = [d >= 2] (l0 + l1 B): entering vLLM's chained draft loop at all, on top of each chained pass. On the
                testbed the first chained pass cost more than the later ones: proposer medians by drafted depth,
                batch 64 (one s32 profile job), 12.1 / 22.5 / 28.9 / 35.5 ms at depths 1-4 (+10.4 ms, then +6.4
                and +6.6); batch 16 ~+2.1-2.9 ms, then +1.5. A model linear in d from the first pass on put that
                step between depth 1 and 2 into the per-depth slope, so it priced depth 2 below its steps and depth
                4 above: a bias towards depth 2 over depth 1 of ~2 % of a batch-64 step, where depth 1 was best.
A drafting step (d >= 1) whose forward carried P prompt rows (requests joining: rows beyond one per request and
the verified drafts) adds to its drafting
  prompt(P)   = [d >= 1] r P: the draft head's first pass runs over every row of the forward, prompt chunks
                included. Decode steps (P = 0) are what the budget prices, but without this term the fit spread
                the joining steps' rows over every step's terms: refitted offline from s32 profile logs
                (`scripts/refit_step_log.py`), decode steps' drafting came out priced 0.2 ms (batch 16) and 1.5 ms
                (batch 64, ~13 % of a depth-1 proposer) above their medians, joining steps 4.7 and 6.9 ms below;
                the joining steps' median residual was 0.023-0.029 ms per prompt row.
A step whose first pass also carries R head rows deferred from earlier plain steps (`defer_plain_head`) adds
  deferred(R) = h R: the head's work those plain steps skipped. Without this term the merged backlog was charged
                to the first-pass terms of every drafting step (f + g B) and plain steps looked free of head work:
                a bias towards plain decoding of about the head's per-row cost x B (batch 32 on the testbed:
                ~3.5 of ~28 ms). A plain step is then priced with the h B its rows will cost (`plain_head_seconds`).

The samples are the step times the proposer observes (`StepSample`); `fit_cost_model` fits both parts with a few
Huber-reweighted least-squares passes (robust to the +-20 % noise and to the odd idle gap), a penalty on the
curve's changes of slope (`_slope_changes`) so that knots without samples follow their neighbours' line, under the
constraints (knots non-decreasing, terms >= 0) enforced in the fit by an active set (`_monotone_rest_fit`), not by
clamping afterwards.
`CostModel` is a frozen value: the proposer replaces it at refit points (identically on every TP rank: rank 0's
fit is broadcast as `to_vector()`), saves it as JSON (`budget_profile.py`) and reloads it at start.
No vLLM import here.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAX_KNOT_EXPONENT = 16  # knots up to 65536 tokens: more than any step's max_num_batched_tokens here
MAX_KNOTS = 2 * MAX_KNOT_EXPONENT  # `_knots_for` at its largest: 2^0..2^16 and 3 x 2^0..3 x 2^14
DRAFT_TERMS = 4  # a, b, c, e of draft(B, d)
TREE_TERMS = 2  # t0, t1 of tree(W)
FIRST_PASS_TERMS = 2  # f, g of draft(B, d): the step cost of drafting at all (d >= 1)
VERIFY_TERMS = 2  # v0, v1 of verify(B): the step cost of verifying at all (V >= 1)
DEFERRED_TERMS = 1  # h of deferred(R): seconds per deferred head row merged into a first pass
CONTEXT_TERMS = 1  # k of context(C): seconds per token already in the KV cache of the step's requests
TREE_DRAFT_TERMS = 2  # p0, p1 of tree_draft(B, d): the extra drafting of a step that drafts trees
LOOP_TERMS = 2  # l0, l1 of loop(B): entering the chained draft loop (d >= 2)
PROMPT_ROW_TERMS = 1  # r of prompt(P): seconds per prompt row in a drafting step's first pass


@dataclass(frozen=True)
class StepSample:
    """One observed engine step: tokens in its target forward, running requests, draft depth drafted, and the
    seconds spent outside (`rest_s`) and inside (`draft_s`) the proposer."""

    num_tokens: int
    batch: int
    draft_depth: int
    rest_s: float
    draft_s: float
    width: int = 0  # verified nodes off the spine in this step's forward (tree rows)
    verified: int = 0  # draft tokens verified in this step's forward (0: a plain step)
    merged: int = 0  # head rows of earlier plain steps merged into this step's first pass (defer_plain_head)
    context: int = 0  # tokens already in the KV cache of the step's requests, summed (0: not measured)
    tree_drafted: bool = False  # this step's drafter drafted trees (per-depth top-k siblings), not chains
    # Prompt rows this step's first pass left out at no cost (`prompt_head_window` with `prompt_head_kv` off or
    # impossible); rows whose head K/V were still written cost the proposer per row and count as prompt rows.
    head_free: int = 0

    @property
    def prompt_rows(self) -> int:
        """Rows of the forward beyond the decode rows (one per request, the verified drafts, the tree rows): prompt
        chunks of joining requests, which the draft head's first pass runs too (less those it left out)."""
        return max(0, self.num_tokens - self.batch - self.verified - self.width - self.head_free)


class StepSamples:
    """The samples a fit uses: the start-up profile's (kept for good: they span the token range) and a ring of the
    most recent online ones (the curve follows drift, e.g. longer contexts)."""

    def __init__(self, recent: int = 512) -> None:
        self.profile: list[StepSample] = []
        self.recent: deque[StepSample] = deque(maxlen=recent)

    def add(self, sample: StepSample, *, profile: bool = False) -> None:
        if not (math.isfinite(sample.rest_s) and math.isfinite(sample.draft_s)):
            return
        if sample.rest_s <= 0 or sample.draft_s < 0 or sample.num_tokens <= 0 or sample.batch <= 0:
            return
        (self.profile if profile else self.recent).append(sample)

    def all(self) -> list[StepSample]:
        return [*self.profile, *self.recent]

    def __len__(self) -> int:
        return len(self.profile) + len(self.recent)


def _knots_for(max_tokens: float) -> list[float]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to a power of two past `max_tokens`: neighbours at most 1.5x apart.

    Why not powers of two alone: the depth plan prices each depth at its steady shape N = B (1 + d), and the step
    cost on the testbed's CPU is not smooth in N (batch 4, static depths, medians: +0.7 ms from N = 8 to 12, +2.4 ms
    from 12 to 16, in the target forward and in vLLM's draft loop, whose first pass reads the same rows). Between
    knots 8 and 16 the curve is one line, so depth 2 (N = 12) was priced at the mean of its neighbours, ~0.7 ms
    above its steps; a knot at 12 can follow them. Knots without samples follow their neighbours' line
    (`_slope_changes`), so the extra knots cost nothing where there is no data."""
    top = max(1, min(MAX_KNOT_EXPONENT, math.ceil(math.log2(max(1.0, max_tokens))) + 1))
    return sorted([float(2**i) for i in range(top + 1)] + [float(3 * 2**i) for i in range(top - 1)])


def _hat_basis(num_tokens: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """[S, K] linear-interpolation weights of each N over the knots; beyond the last knot the last two knots'
    weights extrapolate linearly (the curve continues with its last slope)."""
    n = np.maximum(np.asarray(num_tokens, dtype=np.float64), knots[0])
    k = knots.shape[0]
    idx = np.clip(np.searchsorted(knots, n, side="right"), 1, k - 1) - 1  # left knot of each N's segment
    left, right = knots[idx], knots[idx + 1]
    frac = (n - left) / (right - left)  # > 1 beyond the last knot: linear extrapolation
    basis = np.zeros((n.shape[0], k), dtype=np.float64)
    rows = np.arange(n.shape[0])
    basis[rows, idx] = 1.0 - frac
    basis[rows, idx + 1] += frac
    return basis


def _lower_median(values: np.ndarray) -> float:
    """The lower of the two middle values for an even count (torch.median's convention, which the fit used)."""
    if values.shape[0] == 0:
        return 0.0
    middle = (values.shape[0] - 1) // 2
    return float(np.partition(values, middle)[middle])


def _robust_lstsq(x: np.ndarray, y: np.ndarray, ridge: np.ndarray, passes: int = 4) -> np.ndarray:
    """argmin sum_s w_s (y_s - x_s . v)^2 + v' R v with Huber weights (threshold 1.5 x the MAD of the residuals)."""
    w = np.ones_like(y)
    v = np.zeros(x.shape[1], dtype=np.float64)
    for _ in range(passes):
        xtw = x.T * w
        v = np.linalg.solve(xtw @ x + ridge, xtw @ y)
        resid = np.abs(y - x @ v)
        scale = 1.5 * max(_lower_median(resid), 1e-9)
        w = np.where(resid <= scale, 1.0, scale / np.maximum(resid, 1e-12))
    return v


@dataclass(frozen=True)
class CostModel:
    """rest(N, B) over `knots` (seconds per knot, non-decreasing) + `per_request_s` x B; draft terms (a, b, c, e);
    tree terms (t0, t1) of a step verifying W > 0 nodes off the spine; first-pass terms (f, g) of a step that
    drafts at all (absent from profiles written before them: 0, the old linear model); h = `deferred_row_s`, the
    head's work per row deferred from a plain step (0 in older profiles, and without `defer_plain_head`); k =
    `context_s`, seconds per context token (0 in older profiles); (p0, p1) = `tree_draft_terms`, the extra
    drafting of a tree-drafting step (0 in older profiles and in chain engines).

    fit_error: median relative error |predicted - observed| / observed of the step time over the fitted samples.
    """

    knots: tuple[float, ...]
    rest_s: tuple[float, ...]
    per_request_s: float
    draft_terms: tuple[float, float, float, float]
    fit_error: float
    num_samples: int
    tree_terms: tuple[float, float] = (0.0, 0.0)
    first_pass_terms: tuple[float, float] = (0.0, 0.0)
    verify_terms: tuple[float, float] = (0.0, 0.0)
    deferred_row_s: float = 0.0
    context_s: float = 0.0
    tree_draft_terms: tuple[float, float] = (0.0, 0.0)
    loop_terms: tuple[float, float] = (0.0, 0.0)
    prompt_row_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.knots) < 2 or len(self.knots) != len(self.rest_s):
            raise ValueError("a cost model needs >= 2 knots and one rest time per knot")
        if any(b <= a for a, b in zip(self.knots, self.knots[1:])):
            raise ValueError("cost model knots must be strictly increasing")
        values = [
            *self.rest_s, self.per_request_s, *self.draft_terms, *self.tree_terms, *self.first_pass_terms,
            *self.verify_terms, self.deferred_row_s, self.context_s, *self.tree_draft_terms, *self.loop_terms,
            self.prompt_row_s,
        ]  # fmt: skip
        if (
            len(self.draft_terms) != DRAFT_TERMS
            or len(self.tree_terms) != TREE_TERMS
            or len(self.first_pass_terms) != FIRST_PASS_TERMS
            or len(self.verify_terms) != VERIFY_TERMS
            or len(self.tree_draft_terms) != TREE_DRAFT_TERMS
            or len(self.loop_terms) != LOOP_TERMS
        ):
            raise ValueError(
                "a cost model has 4 draft terms, 2 tree terms, 2 first-pass terms, 2 verify terms, 2 tree-draft terms "
                "and 2 loop terms"
            )
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError("cost model times must be finite and >= 0")

    # -- evaluation -------------------------------------------------------------------------------------------

    def rest_seconds(self, num_tokens: torch.Tensor, batch: int, context: float = 0.0) -> torch.Tensor:
        """Seconds outside the proposer for steps of `num_tokens` tokens (any shape) at `batch` requests holding
        `context` tokens in the KV cache."""
        flat = num_tokens.reshape(-1).to("cpu", torch.float64).numpy()
        curve = _hat_basis(flat, np.asarray(self.knots, dtype=np.float64)) @ np.asarray(self.rest_s, dtype=np.float64)
        rest = torch.from_numpy(curve + (self.per_request_s * batch + self.context_s * context))
        return rest.reshape(num_tokens.shape)

    def rest_at(self, num_tokens: float, batch: int, context: float = 0.0) -> float:
        """`rest_seconds` of one step, on the host (no tensors: the proposer calls it on every step)."""
        knots, values = self.knots, self.rest_s
        n = max(float(num_tokens), knots[0])
        i = min(max(bisect.bisect_right(knots, n), 1), len(knots) - 1) - 1  # the segment's left knot
        frac = (n - knots[i]) / (knots[i + 1] - knots[i])  # > 1 beyond the last knot: linear extrapolation
        return (1.0 - frac) * values[i] + frac * values[i + 1] + self.per_request_s * batch + self.context_s * context

    def verify_at(self, batch: int, verified: float) -> float:
        """verify(B): the extra seconds of a step whose forward verifies `verified` > 0 drafts (0 otherwise)."""
        v0, v1 = self.verify_terms
        return v0 + v1 * batch if verified > 0 else 0.0

    def tree_at(self, width: int) -> float:
        """`tree_seconds` of one step, on the host."""
        t0, t1 = self.tree_terms
        return t0 + t1 * width if width > 0 else 0.0

    def tree_seconds(self, width: torch.Tensor) -> torch.Tensor:
        """Extra seconds of steps verifying `width` nodes off the spine (any shape; 0 for chains)."""
        t0, t1 = self.tree_terms
        w = width.to(torch.float64)
        return torch.where(w > 0, t0 + t1 * w, torch.zeros_like(w))

    def draft_seconds(self, batch: int, draft_depth: int, trees: bool = False) -> float:
        """The proposer's seconds drafting `draft_depth` deep at `batch` (trees: with the per-depth siblings)."""
        a, b, c, e = self.draft_terms
        f, g = self.first_pass_terms
        first = f + g * batch if draft_depth >= 1 else 0.0
        l0, l1 = self.loop_terms
        loop = l0 + l1 * batch if draft_depth >= 2 else 0.0
        return (
            a
            + b * batch
            + first
            + loop
            + draft_depth * (c + e * batch)
            + (self.tree_draft_at(batch, draft_depth) if trees else 0.0)
        )

    def tree_draft_at(self, batch: int, draft_depth: int) -> float:
        """tree_draft(B, d): what drafting trees adds to drafting chains (0 at depth 0: nothing drafted)."""
        p0, p1 = self.tree_draft_terms
        return p0 + p1 * batch * draft_depth if draft_depth >= 1 else 0.0

    def plain_head_seconds(self, batch: int) -> float:
        """The head's deferred work a plain step of `batch` requests leaves for a later first pass (h B)."""
        return self.deferred_row_s * batch

    def step_seconds(
        self, num_tokens: float, batch: int, draft_depth: int, verified: float = 0, context: float = 0.0
    ) -> float:
        rest = float(self.rest_seconds(torch.tensor([float(num_tokens)]), batch, context)[0])
        return rest + self.verify_at(batch, verified) + self.draft_seconds(batch, draft_depth)

    # -- transport (TP broadcast) -----------------------------------------------------------------------------

    def to_vector(self) -> list[float]:
        """Flat floats: [K, knots..., rest..., per_request, draft terms..., fit_error, num_samples, tree terms...,
        first-pass terms..., verify terms..., h, k, tree-draft terms..., loop terms..., r]."""
        return [
            float(len(self.knots)),
            *self.knots,
            *self.rest_s,
            self.per_request_s,
            *self.draft_terms,
            self.fit_error,
            float(self.num_samples),
            *self.tree_terms,
            *self.first_pass_terms,
            *self.verify_terms,
            self.deferred_row_s,
            self.context_s,
            *self.tree_draft_terms,
            *self.loop_terms,
            self.prompt_row_s,
        ]

    @classmethod
    def from_vector(cls, vector: Sequence[float]) -> CostModel:
        k = int(vector[0])
        knots = tuple(float(x) for x in vector[1 : 1 + k])
        rest = tuple(float(x) for x in vector[1 + k : 1 + 2 * k])
        tail = [float(x) for x in vector[1 + 2 * k :]]
        draft = (tail[1], tail[2], tail[3], tail[4])
        tree = (tail[7], tail[8]) if len(tail) >= 9 else (0.0, 0.0)
        first = (tail[9], tail[10]) if len(tail) >= 11 else (0.0, 0.0)
        verify = (tail[11], tail[12]) if len(tail) >= 13 else (0.0, 0.0)
        deferred = tail[13] if len(tail) >= 14 else 0.0
        context = tail[14] if len(tail) >= 15 else 0.0
        tree_draft = (tail[15], tail[16]) if len(tail) >= 17 else (0.0, 0.0)
        loop = (tail[17], tail[18]) if len(tail) >= 19 else (0.0, 0.0)
        prompt_row = tail[19] if len(tail) >= 20 else 0.0
        return cls(
            knots, rest, tail[0], draft, tail[5], int(tail[6]), tree, first, verify, deferred, context, tree_draft, loop,
            prompt_row,
        )  # fmt: skip


def vector_length(num_knots: int) -> int:
    return (
        1 + 2 * num_knots + 1 + DRAFT_TERMS + 2 + TREE_TERMS + FIRST_PASS_TERMS + VERIFY_TERMS + DEFERRED_TERMS
        + CONTEXT_TERMS + TREE_DRAFT_TERMS + LOOP_TERMS + PROMPT_ROW_TERMS
    )  # fmt: skip


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, ridge: float) -> np.ndarray:
    """`_robust_lstsq` with every coefficient >= 0: a term that would go negative is fixed at 0 and the rest refitted
    (clamping it afterwards would leave the others fitted to the negative value)."""
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1], dtype=np.float64)
    while free:
        u = _robust_lstsq(x[:, free], y, ridge * np.eye(len(free), dtype=np.float64))
        if bool((u >= 0).all()):
            coef[free] = u
            break
        free.pop(int(u.argmin()))
    return coef


def _slope_changes(knots: np.ndarray) -> np.ndarray:
    """[K - 2, K]: the change of the curve's slope (seconds per token) at each inner knot, scaled by the mean width
    of its two segments, so that on evenly spaced knots a row is the second difference (1, -2, 1).

    The smoothness prior of the rest curve. Second differences of the knot values in knot *index* (the penalty
    used before) are zero for a curve linear in log N: over power-of-two knots they pulled a sparsely sampled
    curve towards equal increments per doubling, i.e. concave in N. On the testbed's CPU, where a step's cost is
    about linear in its tokens from batch 8 up, the first fit after a batch-32 start-up profile (N 32-160) put the
    128 -> 256-token increment at 6.8 ms against 17.4 ms for 64 -> 128, and beyond the profiled range the curve
    fell further behind the line (a 640-token step at 69 % of a linear truth in the unit test): a load that grows
    after the profile verifies steps there. A change of slope costs the same here whatever the knot spacing: a
    curve linear in N is free, and a GPU's flat-then-linear curve pays for its one knee."""
    k = knots.shape[0]
    rows = np.zeros((max(0, k - 2), k), dtype=np.float64)
    for i in range(k - 2):
        left, right = float(knots[i + 1] - knots[i]), float(knots[i + 2] - knots[i + 1])
        scale = 0.5 * (left + right)
        rows[i, i], rows[i, i + 1], rows[i, i + 2] = scale / left, -scale * (1.0 / left + 1.0 / right), scale / right
    return rows


def _monotone_rest_fit(
    hat: np.ndarray, extra: np.ndarray, rest: np.ndarray, smooth: float, knots: np.ndarray | None = None
) -> np.ndarray:
    """The rest curve's knot values (non-decreasing) and the extra terms (>= 0), fitted under those constraints.

    Clamping an unconstrained fit afterwards is wrong when columns are collinear: at one batch size B every plain
    step has N = B and every verifying step N > B, so the verify jump and the knots above B explain the same steps;
    an unconstrained fit let those knots fall below rest(B) and put the difference into the jump (batch 1 on the
    testbed: knots 8.3, 6.2, 4.1 ms, jump 4.9 ms), and raising the knots afterwards priced a verifying step ~4 ms
    too high, so the depth plan chose plain decoding where drafting paid 1.5x. Instead an active set: knots whose
    values would fall are pooled with their left neighbour (one shared value, as isotonic regression pools
    violators), an extra term that would go negative is fixed at 0, and the fit is redone until none does.
    Returns [knots..., extra...] like the unconstrained solution.
    """
    k, e = hat.shape[1], extra.shape[1]
    group_of = list(range(k))  # knot -> its pool (pools are runs of neighbouring knots)
    free_extra = list(range(e))
    # Changes of slope at the knots (`_slope_changes`; evenly spaced when no knots are given) tie unobserved knots
    # to their neighbours; the extra terms get a plain ridge, so that with B and N collinear (pure decode) the curve
    # takes the cost and a column of zeros (no tree step, no plain step) stays solvable.
    diff = _slope_changes(knots if knots is not None else np.arange(k, dtype=np.float64))
    for _ in range(k + e + 1):
        pools = sorted(set(group_of))
        expand = np.zeros((k, len(pools)), dtype=np.float64)  # knot values = expand @ pool values
        for knot, pool in enumerate(group_of):
            expand[knot, pools.index(pool)] = 1.0
        x = np.concatenate([hat @ expand, extra[:, free_extra]], axis=1)
        penalty = np.zeros((x.shape[1], x.shape[1]), dtype=np.float64)
        penalty[: len(pools), : len(pools)] = smooth * (expand.T @ diff.T @ diff @ expand)
        penalty[len(pools) :, len(pools) :] += 1e-6 * rest.shape[0] * np.eye(len(free_extra), dtype=np.float64)
        u = _robust_lstsq(x, rest, penalty)
        values = expand @ u[: len(pools)]
        terms = np.zeros(e, dtype=np.float64)
        terms[free_extra] = u[len(pools) :]
        falls = [j for j in range(1, k) if group_of[j] != group_of[j - 1] and values[j] < values[j - 1] - 1e-12]
        negative = [c for c in free_extra if terms[c] < 0]
        if not falls and not negative:
            break
        if falls:  # pool the steepest fall first: its neighbours may rise once it is pooled
            j = min(falls, key=lambda j: float(values[j] - values[j - 1]))
            old, new = group_of[j], group_of[j - 1]
            group_of = [new if g == old else g for g in group_of]
        if negative:
            free_extra.remove(min(negative, key=lambda c: float(terms[c])))
    return np.concatenate([np.maximum(values, 0.0), np.maximum(terms, 0.0)])


def fit_cost_model(samples: Iterable[StepSample], *, ridge: float = 1e-3) -> CostModel | None:
    """The robust fit of `CostModel` to the samples; None with fewer than 4 samples (nothing to fit yet)."""
    rows = list(samples)
    if len(rows) < 4:
        return None
    # numpy, not torch: the fit is a few hundred small host ops (on the testbed's CPU ~9 ms a refit in torch, most
    # of it per-op dispatch; the proposer refits on the step path every 64-512 steps).
    n = np.array([s.num_tokens for s in rows], dtype=np.float64)
    batch = np.array([s.batch for s in rows], dtype=np.float64)
    depth = np.array([s.draft_depth for s in rows], dtype=np.float64)
    rest = np.array([s.rest_s for s in rows], dtype=np.float64)
    draft = np.array([s.draft_s for s in rows], dtype=np.float64)
    width = np.array([s.width for s in rows], dtype=np.float64)
    verifying = np.array([1.0 if s.verified > 0 else 0.0 for s in rows], dtype=np.float64)
    merged = np.array([s.merged for s in rows], dtype=np.float64)
    context = np.array([s.context for s in rows], dtype=np.float64)
    trees = np.array([1.0 if s.tree_drafted and s.draft_depth >= 1 else 0.0 for s in rows], dtype=np.float64)

    knots = np.array(_knots_for(float(n.max())), dtype=np.float64)
    k = knots.shape[0]
    tree_cols = np.stack([(width > 0).astype(np.float64), width], axis=1)
    verify_cols = np.stack([verifying, verifying * batch], axis=1)
    # per request, tree, verify, context (context in 1e3 tokens: a column on the scale of the others for the ridge)
    extra_cols = np.concatenate([batch[:, None], tree_cols, verify_cols, (context / 1e3)[:, None]], axis=1)
    hat = _hat_basis(n, knots)
    v = _monotone_rest_fit(hat, extra_cols, rest, ridge * len(rows), knots)
    curve = np.maximum.accumulate(np.maximum(v[:k], 0.0))  # a no-op but for float rounding
    per_request = float(v[k])
    tree = (float(v[k + 1]), float(v[k + 2]))
    verify = (float(v[k + 3]), float(v[k + 4]))
    context_s = float(v[k + 5]) / 1e3

    drafts = (depth >= 1).astype(np.float64)
    looped = (depth >= 2).astype(np.float64)
    prompt_rows = np.array([float(s.prompt_rows) for s in rows], dtype=np.float64)
    x_draft = np.stack(
        [
            np.ones_like(batch),
            batch,
            depth,
            depth * batch,
            drafts,
            drafts * batch,
            merged,
            trees,
            trees * batch * depth,
            looped,
            looped * batch,
            drafts * prompt_rows,
        ],
        axis=1,
    )
    w = _nonnegative_lstsq(x_draft, draft, 1e-9 * len(rows))
    terms = tuple(float(t) for t in w)

    predicted = (
        hat @ curve
        + per_request * batch
        + tree_cols @ np.array(tree, dtype=np.float64)
        + verify_cols @ np.array(verify, dtype=np.float64)
        + context_s * context
        + x_draft @ np.array(terms, dtype=np.float64)
    )
    observed = rest + draft
    error = _lower_median(np.abs(predicted - observed) / np.maximum(observed, 1e-12))
    return CostModel(
        tuple(float(x) for x in knots),
        tuple(float(x) for x in curve),
        per_request,
        (terms[0], terms[1], terms[2], terms[3]),
        error,
        len(rows),
        tree,
        (terms[4], terms[5]),
        verify,
        terms[6],
        context_s,
        (terms[7], terms[8]),
        (terms[9], terms[10]),
        terms[11],
    )


def model_change(old: CostModel, new: CostModel, max_depth: int) -> float:
    """The median relative difference of two models' steady step prices (`step_seconds` at N = B (1 + d) tokens,
    every draft verified) over batches 1, 2, 4, ... and depths 0..max_depth, where N lies within both models'
    knots. A function of the two models only, so that every TP rank, which holds rank 0's models, gets the same
    number (`TimeAwareBudget.refit` spaces its refits by it)."""
    top = min(old.knots[-1], new.knots[-1])
    changes = []
    batch = 1
    while batch <= top:
        for depth in range(max_depth + 1):
            tokens = batch * (1 + depth)
            if tokens > top:
                break
            verified = batch * depth
            a = old.rest_at(tokens, batch) + old.verify_at(batch, verified) + old.draft_seconds(batch, depth)
            b = new.rest_at(tokens, batch) + new.verify_at(batch, verified) + new.draft_seconds(batch, depth)
            changes.append(abs(b - a) / max(b, 1e-9))
        batch *= 2
    return statistics.median(changes) if changes else float("inf")
