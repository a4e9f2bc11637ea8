"""`k_max: "auto"`: the time-aware budget's state, shared by the vLLM proposer and the HF engine.

Phases (`phase`):
  warmup   the gates are calibrating: the engine's warm-up budget (everything drafted, every depth recorded);
  profile  `profile_steps` steps that draft to a cycle of depths (D, 0, D-1, 1, ...) and verify a cycle of
           fractions of the candidates (PROFILE_FRACTIONS), so that the step cost is sampled across token counts
           and draft depths; then the first fit (saved to the budget profile file if it does not exist);
  auto     every step: `DraftController` plans the draft depth and candidate cap, `select_auto` cuts ECHO's order
           where expected tokens per second peak (acceptance from `AcceptanceModel`, time from `CostModel`); the
           cost model is refit every REFIT_INTERVAL steps from the samples the engine adds.
A loaded budget profile skips the profile phase. `share` (identity for one process; the vLLM proposer passes a
broadcast from TP rank 0) makes every rank use rank 0's fit. No vLLM import; the engines measure the time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .acceptance import AcceptanceModel
from .auto_budget import DraftController, DraftPlan, priority_rank, select_auto, select_by_rank
from .budget import BudgetSelection
from .budget_profile import load_profile, save_profile
from .cost_model import MAX_KNOT_EXPONENT, CostModel, StepSample, StepSamples, fit_cost_model, vector_length
from .gating import Gates
from .tree import DraftTree

REFIT_INTERVAL = 64  # steps between refits of the cost model (and refreshes of the acceptance table)
# Profile steps verify these fractions of the candidates in turn: step costs across the token range, plain steps too.
PROFILE_FRACTIONS = (0.0, 0.5, 1.0, 0.25, 0.75, 0.125)
IDLE_FACTOR = 4.0  # a step slower than this x the model's prediction waited for work (idle engine): not a sample
MAX_PROFILE_SAMPLES = 256
COST_VECTOR_LENGTH = vector_length(MAX_KNOT_EXPONENT + 1)

Share = Callable[[Sequence[float]], list[float]]


def _no_share(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values]


class TimeAwareBudget:
    def __init__(
        self,
        max_depth: int,
        *,
        profile_steps: int,
        probe_interval: int,
        surplus_tail: bool,
        profile_path: Path | None,
        device: Any = "cpu",
        is_writer: bool = True,
        share: Share = _no_share,
    ) -> None:
        self.max_depth = max_depth
        self.profile_steps = profile_steps
        self.surplus_tail = surplus_tail
        self.profile_path = profile_path
        self.is_writer = is_writer
        self.share = share
        self.controller = DraftController(max_depth, probe_interval=probe_interval)
        self.acceptance = AcceptanceModel(max_depth, device=device)
        # Trees: the nodes off the spine, learned online from the tree steps (not saved: the prior is the node's own
        # path confidence, which a few hundred verified siblings correct).
        self.width_acceptance = AcceptanceModel(max_depth, device=device)
        self.cost_model: CostModel | None = None
        self.samples = StepSamples()
        self.source = "none"
        if profile_path is not None and profile_path.exists():
            self.cost_model, self.acceptance = load_profile(profile_path, max_depth, device)
            self.source = f"file {profile_path}"
        self.profile_done = 0
        self.steps_seen = 0
        self._curve_cache: dict[tuple[int, int, int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    # -- per step ---------------------------------------------------------------------------------------------

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
        elif phase == "auto" and self.steps_seen % REFIT_INTERVAL == 0:
            self.refit(first=False)
        phase = self.phase(warming_up)
        ceiling = batch * self.max_depth * nodes_per_depth
        if phase == "auto":
            return self.controller.plan(batch, ceiling)
        if phase == "profile":
            self.profile_done += 1
            d = self.max_depth
            cycle = [x for pair in zip(range(d, -1, -1), range(d + 1)) for x in pair]
            return DraftPlan(cycle[(self.profile_done - 1) % len(cycle)], ceiling, False)
        return DraftPlan(self.max_depth, min(ceiling, warmup_cap), False)

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
            fraction = PROFILE_FRACTIONS[(self.profile_done - 1) % len(PROFILE_FRACTIONS)]
            return select_by_rank(tree, rank, eligible, (eligible.sum() * fraction).floor().long()), None
        rest_s, draft_s = self.curves(batch, tree.scores.numel(), depth, plan.depth, tree.scores.device)
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
            tree_terms=self.cost_model.tree_terms if self.cost_model is not None else (0.0, 0.0),
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
        each cut as if its drafting could still be saved, which cut chains short.)"""
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
        return cached

    def observe_selection(self, budget: int) -> None:
        """After the step's host sync: the drafts it selected."""
        self.controller.observe(budget)

    def observe_verification(
        self, accepted: torch.Tensor, verified_depths: torch.Tensor, batch: int, drafted_depth: int
    ) -> None:
        """A verified step in hindsight, for the depth plan: accepted [R] drafts per request, verified_depths [R, N]
        the depth of each verified node (0 = none), batch the requests of that step, drafted_depth how deep it
        drafted. Cut at depth d it would have emitted B + sum_i min(accepted_i, d) tokens for the verified nodes of
        depth <= d and the drafting to depth d; the cost model prices it, and the plan averages each depth's rate
        over the step's plain-decoding rate. (One small host sync: the counts.)"""
        cost = self.cost_model
        if cost is None or drafted_depth < 1 or batch < 1:
            return
        levels = torch.arange(drafted_depth + 1, device=accepted.device)
        emitted = torch.minimum(accepted.long().unsqueeze(1), levels.unsqueeze(0)).sum(dim=0)
        depths = verified_depths.long().reshape(-1)
        nodes = ((depths.unsqueeze(0) <= levels.unsqueeze(1)) & (depths.unsqueeze(0) > 0)).sum(dim=1)
        host = torch.stack([emitted, nodes]).tolist()
        # Per depth level, not per request; a level that verifies anything pays verify(B) on top.
        rest = [cost.rest_at(batch + n, batch) + cost.verify_at(batch, n) for n in host[1]]
        rates = [
            (batch + host[0][d]) / max(rest[d] + cost.draft_seconds(batch, d), 1e-12) for d in range(drafted_depth + 1)
        ]
        # Relative to the step's own plain-decoding rate: steps of different batch sizes average on one scale.
        self.controller.observe_levels([r / max(rates[0], 1e-12) for r in rates])

    def add_sample(self, sample: StepSample, warming_up: bool) -> None:
        """A measured step; a step much slower than predicted waited for work and is dropped."""
        if self.cost_model is not None:
            cost = self.cost_model
            predicted = (
                cost.rest_at(sample.num_tokens, sample.batch)
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
        if shared[0] == 0:  # rank 0 had too few samples: keep what there is
            return
        self.cost_model = CostModel.from_vector(shared)
        self._curve_cache.clear()
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
            # What the depth plan believes each draft depth 0..D is worth (expected tokens/s; None unmeasured).
            "depth_values": [None if v is None else round(v, 3) for v in self.controller.value],
            "acceptance_table": [[round(p, 3) for p in row] for row in self.acceptance.table.tolist()],
            "budget_profile_file": str(self.profile_path) if self.profile_path is not None else None,
        }
