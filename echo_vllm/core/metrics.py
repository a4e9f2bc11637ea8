"""ECHO's statistics, one vocabulary for both engines: device-side accumulators in, host numbers out.

`EchoMetrics` holds the data only (as vLLM's `SpecDecodingStats`): float64/int64 tensors on the batch's device,
added to in place, so recording a step never syncs with the host. `snapshot()` is the one host sync; it returns an
`EchoStatsSnapshot` whose `as_dict()` is the JSON form. On CPU there is no device to sync with and every tiny
tensor op costs microseconds (record_selection + record_verification took ~0.12 ms per step at batch 1 on the testbed, ~1 % of a step):
there the accumulators are host numbers (`host_accumulators`, chosen by the first step's device), with the same
figures (tested against the tensor path). The log line of the vLLM plugin is formatted elsewhere
(`echo_vllm.vllm.stats_log`), from that dict.

A step is recorded in two halves, because vLLM learns a step's verification result one step after its selection:
  record_selection     - at selection: sum_i K_i against K_max, gate truncations (HF engine and EchoProposer);
  record_verification  - when the result is known: emitted, accepted, verified, depth per request-step.
`update(selection, result, ...)` records both for an engine that verifies in the same step (HF).

Per request ("request-step"):
  emitted   = accepted draft tokens + 1 bonus token;
  accepted  = accepted draft tokens;
  verified  = draft tokens submitted for verification (K_i);
  depth     = the deepest selected depth (HF: max order_depth; chains: = verified).
Summary (`EchoStatsSnapshot` fields):
  steps, request_steps           - selection steps; verified request-steps
  k_max                          - the last step's K_max
  mean_step_sum, max_step_sum    - sum_i K_i per step, mean and maximum (max <= K_max by construction)
  budget_used                    - mean over steps with K_max > 0 of sum_i K_i / K_max (NaN if none)
  budget_bound_steps             - steps that used all of K_max while the requests could have drafted more
  mat                            - sum(emitted) / request_steps            (Mean Accepted Tokens)
  mean_depth                     - sum(depth) / request_steps
  utilization (u)                - mat / mean_depth (ratio of the two means; includes the bonus token, as MAT
                                   does, so it can exceed 1; NaN if nothing was drafted)
  accepted_per_verified_draft    - sum(accepted) / sum(verified)            (NaN if nothing was verified)
  verified_per_emitted           - sum(verified) / sum(emitted)
  truncations_per_depth          - [request-steps truncated by a gate with depth_cap == d, d = 1..D]
  truncation_rate                - truncated request-steps / selected request-steps
  mean_draft_depth               - draft depth drafted per step (`record_plan`; NaN if never recorded)
  predicted_accepted_per_step    - expected accepted drafts of the selections per step (time-aware budget)
  realised_accepted_per_step     - accepted drafts per verified step of those predicted (`record_realised`): what
                                   the prediction is judged by
Only rows with `active` True count (default: all rows). `totals()` gives the raw running sums behind these
(request-steps, emitted, accepted, verified, bound steps, truncations per depth) for the Prometheus counters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .budget import BudgetSelection
from .verify import VerifyResult

# Slots of the float64 accumulator tensors.
_SEL_REQUESTS, _SEL_STEP_SUM, _SEL_TRUNCATED, _SEL_BUDGET, _SEL_BOUND = range(5)
_VER_REQUESTS, _VER_EMITTED, _VER_ACCEPTED, _VER_VERIFIED, _VER_DEPTH = range(5)
TRUNCATION_BATCH = 64  # host accumulators: steps whose gate truncations are counted together


@dataclass(frozen=True)
class EchoStatsSnapshot:
    """Host numbers of an `EchoMetrics` at one moment (see the module docstring for each field)."""

    steps: int
    request_steps: int
    k_max: int | None
    mean_step_sum: float
    max_step_sum: int
    budget_used: float
    budget_bound_steps: int
    mat: float
    mean_depth: float
    utilization: float
    accepted_per_verified_draft: float
    verified_per_emitted: float
    truncations_per_depth: list[int]
    truncation_rate: float
    mean_draft_depth: float
    predicted_accepted_per_step: float
    realised_accepted_per_step: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


class EchoMetrics:
    def __init__(self, max_depth: int, *, host_accumulators: bool | None = None) -> None:
        """host_accumulators: None = host numbers when the first recorded step is on CPU, tensors otherwise."""
        if max_depth < 0:
            raise ValueError(f"max_depth must be >= 0; got {max_depth}")
        self.max_depth = max_depth
        self._host_choice = host_accumulators
        self.reset()

    def reset(self) -> None:
        self.steps = 0  # host int: counting steps needs no tensor
        self.budget_steps = 0  # steps with K_max > 0
        self.k_max: int | None = None
        # Device accumulators, created on the first step's device.
        self._selection: torch.Tensor | None = None  # [5] float64, slots _SEL_*
        self._verification: torch.Tensor | None = None  # [5] float64, slots _VER_*
        self._max_step_sum: torch.Tensor | None = None  # [] int64
        self._trunc: torch.Tensor | None = None  # [D] int64
        self.verify_steps = 0  # steps whose verification result was recorded
        self.plan_steps = 0  # steps with a recorded draft plan
        self.draft_depth_sum = 0  # host: the plan's depth is a host int
        self._predicted: torch.Tensor | None = None  # [] float64, sum of predicted accepted drafts
        self.predicted_steps = 0
        self._realised: torch.Tensor | None = None  # [] float64, accepted drafts of the predicted steps
        self.realised_steps = 0
        # Host accumulators (CPU): the same slots as the tensors above.
        self._host: bool | None = self._host_choice
        self._sel_h = [0.0] * 5
        self._ver_h = [0.0] * 5
        self._max_step_sum_h = 0
        self._trunc_h = [0] * self.max_depth
        self._trunc_pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (depth_cap, truncated) not yet counted
        self._predicted_h: float | None = None
        self._realised_h: float | None = None

    def _on_host(self, device: torch.device) -> bool:
        if self._host is None:
            self._host = device.type == "cpu"
        return self._host

    def _accumulators(self, device: torch.device) -> None:
        if self._selection is None:
            self._selection = torch.zeros(5, dtype=torch.float64, device=device)
            self._verification = torch.zeros(5, dtype=torch.float64, device=device)
            self._max_step_sum = torch.zeros((), dtype=torch.int64, device=device)
            self._trunc = torch.zeros(self.max_depth, dtype=torch.int64, device=device)

    def record_selection(
        self,
        counts: torch.Tensor,
        k_max: int,
        depth_cap: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
        host_step_sum: int | None = None,
    ) -> None:
        """One selection step: counts [B] = K_i; gates' depth_cap / truncated [B] when truncations are counted.
        host_step_sum: sum(counts) when the caller already holds it as a host int (host accumulators, all rows active:
        one tensor reduction fewer per step); ignored otherwise."""
        if truncated is not None and depth_cap is None:
            raise ValueError("truncated needs depth_cap to count truncations per depth")
        if self._on_host(counts.device):
            self._record_selection_host(counts, k_max, depth_cap, truncated, active, host_step_sum)
            return
        self._accumulators(counts.device)
        assert self._selection is not None and self._max_step_sum is not None and self._trunc is not None
        act = torch.ones_like(counts, dtype=torch.bool) if active is None else active.to(torch.bool)
        act64 = act.to(torch.float64)
        rows = act64.sum()
        step_sum = (counts.to(torch.float64) * act64).sum()
        if truncated is not None and depth_cap is not None:
            hit = truncated.to(torch.bool) & act
            # Untruncated rows go to the extra bin D, dropped below.
            cap = torch.where(hit, depth_cap.long() - 1, torch.full_like(depth_cap, self.max_depth, dtype=torch.long))
            per_depth = torch.zeros(self.max_depth + 1, dtype=torch.int64, device=counts.device)
            per_depth.scatter_add_(0, cap.clamp(min=0, max=self.max_depth), torch.ones_like(cap))
            self._trunc += per_depth[: self.max_depth]
            truncated_rows = hit.to(torch.float64).sum()
        else:
            truncated_rows = rows.new_zeros(())
        # Bound: all of K_max used although the rows could have drafted more (B x D > K_max).
        bound = ((step_sum == k_max) & (rows * self.max_depth > k_max)).to(torch.float64)
        budget = step_sum / k_max if k_max > 0 else rows.new_zeros(())
        self._selection += torch.stack([rows, step_sum, truncated_rows, budget, bound])
        torch.maximum(self._max_step_sum, step_sum.to(torch.int64), out=self._max_step_sum)
        self.steps += 1
        self.budget_steps += int(k_max > 0)
        self.k_max = k_max

    def _record_selection_host(
        self,
        counts: torch.Tensor,
        k_max: int,
        depth_cap: torch.Tensor | None,
        truncated: torch.Tensor | None,
        active: torch.Tensor | None,
        host_sum: int | None = None,
    ) -> None:
        """`record_selection` into host numbers: the same figures in a few ops."""
        if active is None:
            rows = float(counts.numel())
            step_sum = float(host_sum) if host_sum is not None else float(counts.sum())
            hit = truncated.to(torch.bool) if truncated is not None else None
        else:
            act = active.to(torch.bool)
            rows, step_sum = float(act.sum()), float((counts.to(torch.float64) * act).sum())
            hit = truncated.to(torch.bool) & act if truncated is not None else None
        if hit is not None and depth_cap is not None:
            # Counted in batches (`_count_truncations`): the masked select and histogram of one step took ~0.05 ms
            # of a 20 ms batch-4 step in the engine; the readers (snapshot, totals) count what is pending first.
            self._trunc_pending.append((depth_cap, hit))
            if len(self._trunc_pending) >= TRUNCATION_BATCH:
                self._count_truncations()
        bound = float(step_sum == k_max and rows * self.max_depth > k_max)
        budget = step_sum / k_max if k_max > 0 else 0.0
        for slot, value in zip(
            (_SEL_REQUESTS, _SEL_STEP_SUM, _SEL_BUDGET, _SEL_BOUND), (rows, step_sum, budget, bound)
        ):
            self._sel_h[slot] += value
        self._max_step_sum_h = max(self._max_step_sum_h, int(step_sum))
        self.steps += 1
        self.budget_steps += int(k_max > 0)
        self.k_max = k_max

    def _count_truncations(self) -> None:
        """The pending steps' gate truncations into the host sums: rows whose gate closed, per cap depth."""
        if not self._trunc_pending:
            return
        caps = torch.cat([cap.reshape(-1) for cap, _ in self._trunc_pending])
        hits = torch.cat([hit.reshape(-1) for _, hit in self._trunc_pending])
        self._trunc_pending = []
        caps = caps[hits]
        if caps.numel():
            self._sel_h[_SEL_TRUNCATED] += float(caps.numel())
            # Caps beyond the drafted depths go to the extra bin D, dropped (the tensor path's rule).
            per_depth = torch.bincount((caps.long() - 1).clamp(0, self.max_depth), minlength=self.max_depth + 1)
            for d, n in enumerate(per_depth[: self.max_depth].tolist()):
                self._trunc_h[d] += n

    def record_plan(self, draft_depth: int, predicted_accepted: torch.Tensor | None = None) -> None:
        """One step's draft depth, and (time-aware budget) the expected accepted drafts of its selection."""
        self.plan_steps += 1
        self.draft_depth_sum += int(draft_depth)
        if predicted_accepted is not None and self._on_host(predicted_accepted.device):
            self._predicted_h = (self._predicted_h or 0.0) + float(predicted_accepted)
            self.predicted_steps += 1
        elif predicted_accepted is not None:
            if self._predicted is None:
                self._predicted = torch.zeros((), dtype=torch.float64, device=predicted_accepted.device)
            self._predicted += predicted_accepted.to(torch.float64)
            self.predicted_steps += 1

    def record_realised(self, accepted: torch.Tensor) -> None:
        """The accepted drafts [R] of a verified step whose selection was predicted (`record_plan`)."""
        if self._on_host(accepted.device):
            self._realised_h = (self._realised_h or 0.0) + float(accepted.sum())
            self.realised_steps += 1
            return
        total = accepted.to(torch.float64).sum()
        self._realised = total if self._realised is None else self._realised + total
        self.realised_steps += 1

    def record_verification_sums(self, sums: Sequence[float], realised: bool) -> None:
        """A verified step's figures already summed on the host ([rows, emitted, accepted, verified, depth]:
        `echo::chain_feedback`'s sums), as `record_verification` and, with `realised`, `record_realised` of its
        accepted drafts would add them (host accumulators: CPU engines only)."""
        self._on_host(torch.device("cpu"))
        if not self._host:
            raise RuntimeError("record_verification_sums needs the host accumulators (a CPU engine)")
        self.verify_steps += 1
        for slot, value in zip(range(5), sums):
            self._ver_h[slot] += float(value)
        if realised:
            self._realised_h = (self._realised_h or 0.0) + float(sums[2])
            self.realised_steps += 1

    def record_verification(
        self,
        emitted: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor,
        depth: torch.Tensor,
        active: torch.Tensor | None = None,
    ) -> None:
        """One verification result, per request-step [R]: emitted, accepted and verified tokens, selected depth."""
        if self._on_host(emitted.device):
            parts = torch.stack([t.reshape(-1).to(torch.float64) for t in (emitted, accepted, verified, depth)])
            if active is None:
                rows, sums = float(emitted.numel()), parts.sum(dim=1).tolist()
            else:
                act = active.reshape(-1).to(torch.float64)
                rows, sums = float(act.sum()), (parts * act).sum(dim=1).tolist()
            self.verify_steps += 1
            for slot, value in zip(range(5), (rows, *sums)):
                self._ver_h[slot] += value
            return
        self._accumulators(emitted.device)
        assert self._verification is not None
        self.verify_steps += 1
        act = torch.ones_like(emitted, dtype=torch.float64) if active is None else active.to(torch.float64)
        self._verification += torch.stack(
            [act.sum()] + [(t.to(torch.float64) * act).sum() for t in (emitted, accepted, verified, depth)]
        )

    def update(
        self,
        selection: BudgetSelection,
        result: VerifyResult,
        k_max: int,
        depth_cap: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
    ) -> None:
        """A step selected and verified at once (HF engine)."""
        counts = selection.counts
        batch = counts.shape[0]
        if result.num_emitted.shape != (batch,):
            raise ValueError(f"result.num_emitted must be [B={batch}]; got {tuple(result.num_emitted.shape)}")
        if truncated is not None and depth_cap is None:
            raise ValueError("truncated needs depth_cap to count truncations per depth")
        depth = selection.order_depth.amax(dim=1) if selection.order_depth.shape[1] else torch.zeros_like(counts)
        self.record_verification(result.num_emitted, result.accepted_len, counts, depth, active)
        self.record_selection(counts, k_max, depth_cap, truncated, active)

    def snapshot(self) -> EchoStatsSnapshot:
        """The host sync: every figure as a Python number."""
        if self._host:
            self._count_truncations()
            sel, ver, max_sum, trunc = self._sel_h, self._ver_h, self._max_step_sum_h, self._trunc_h
        elif self._selection is None:
            sel, ver, max_sum, trunc = [0.0] * 5, [0.0] * 5, 0, [0] * self.max_depth
        else:
            assert self._verification is not None and self._max_step_sum is not None and self._trunc is not None
            sel, ver = self._selection.tolist(), self._verification.tolist()
            max_sum, trunc = int(self._max_step_sum.item()), self._trunc.tolist()
        request_steps, emitted, accepted, verified, depth = (ver[i] for i in range(5))
        predicted = self._predicted_h if self._host else (None if self._predicted is None else float(self._predicted))
        realised = self._realised_h if self._host else (None if self._realised is None else float(self._realised))
        mat = _ratio(emitted, request_steps)
        mean_depth = _ratio(depth, request_steps)
        return EchoStatsSnapshot(
            steps=self.steps,
            request_steps=int(request_steps),
            k_max=self.k_max,
            mean_step_sum=_ratio(sel[_SEL_STEP_SUM], self.steps) if self.steps else 0.0,
            max_step_sum=max_sum,
            budget_used=_ratio(sel[_SEL_BUDGET], self.budget_steps),
            budget_bound_steps=int(sel[_SEL_BOUND]),
            mat=mat,
            mean_depth=mean_depth,
            utilization=_ratio(mat, mean_depth) if not math.isnan(mean_depth) else math.nan,
            accepted_per_verified_draft=_ratio(accepted, verified),
            verified_per_emitted=_ratio(verified, emitted),
            truncations_per_depth=[int(x) for x in trunc],
            truncation_rate=_ratio(sel[_SEL_TRUNCATED], sel[_SEL_REQUESTS]),
            mean_draft_depth=_ratio(self.draft_depth_sum, self.plan_steps),
            predicted_accepted_per_step=_ratio(predicted, self.predicted_steps) if predicted is not None else math.nan,
            realised_accepted_per_step=_ratio(realised, self.realised_steps) if realised is not None else math.nan,
        )

    def summary(self) -> dict[str, Any]:
        """The JSON form of `snapshot()`."""
        return self.snapshot().as_dict()

    def totals(self) -> dict[str, Any]:
        """The raw running sums (one host sync), for exporters that need counters rather than ratios:
        request_steps, emitted, accepted, verified, bound_steps and truncations_per_depth."""
        if self._host:
            self._count_truncations()
            ver_h, sel_h = self._ver_h, self._sel_h
            return {
                "request_steps": ver_h[_VER_REQUESTS],
                "emitted": ver_h[_VER_EMITTED],
                "accepted": ver_h[_VER_ACCEPTED],
                "verified": ver_h[_VER_VERIFIED],
                "bound_steps": sel_h[_SEL_BOUND],
                "truncations_per_depth": list(self._trunc_h),
            }
        if self._selection is None:
            return {
                "request_steps": 0.0,
                "emitted": 0.0,
                "accepted": 0.0,
                "verified": 0.0,
                "bound_steps": 0.0,
                "truncations_per_depth": [0] * self.max_depth,
            }
        assert self._verification is not None and self._trunc is not None
        sel, ver = self._selection.tolist(), self._verification.tolist()
        return {
            "request_steps": ver[_VER_REQUESTS],
            "emitted": ver[_VER_EMITTED],
            "accepted": ver[_VER_ACCEPTED],
            "verified": ver[_VER_VERIFIED],
            "bound_steps": sel[_SEL_BOUND],
            "truncations_per_depth": [int(x) for x in self._trunc.tolist()],
        }
