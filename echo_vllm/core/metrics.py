"""Acceleration metrics for ECHO (tensors in, Python floats out; no host sync until `summary`).

Per verification step and request ("request-step"):
  emitted      = num_emitted = accepted draft tokens + 1 bonus token;
  depth        = the deepest selected depth of the request (max order_depth; 0 if nothing was selected);
  verified     = counts[b], draft tokens submitted for verification (K_i).
Summary:
  mat                          = sum(emitted) / request_steps                    (Mean Accepted Tokens)
  mean_depth                   = sum(depth) / request_steps
  utilization (u)              = mat / mean_depth (ratio of the two means; NaN if nothing was drafted).
                                 It includes the bonus token, as MAT does, so it can exceed 1.
  verified_per_accepted_draft  = sum(verified) / sum(accepted draft tokens)        (NaN if none accepted)
  verified_per_emitted         = sum(verified) / sum(emitted)
  truncations_per_depth        = [number of request-steps truncated by a gate with depth_cap == d, d = 1..D]
  truncation_rate              = truncated request-steps / request_steps
  budget_utilization           = mean over steps with K_max > 0 of sum(counts) / K_max
  steps, request_steps
Only rows with `active` True count (default: all rows).
"""

from __future__ import annotations

import math

import torch

from .budget import BudgetSelection
from .verify import VerifyResult


class EchoMetrics:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 0:
            raise ValueError(f"max_depth must be >= 0; got {max_depth}")
        self.max_depth = max_depth
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self._totals: torch.Tensor | None = None  # [6] float64 device sums
        self._trunc: torch.Tensor | None = None  # [D] int64
        self._budget_sum: torch.Tensor | None = None
        self._budget_steps = 0

    def update(
        self,
        selection: BudgetSelection,
        result: VerifyResult,
        k_max: int,
        depth_cap: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
    ) -> None:
        counts = selection.counts
        batch = counts.shape[0]
        device = counts.device
        if result.num_emitted.shape != (batch,):
            raise ValueError(f"result.num_emitted must be [B={batch}]; got {tuple(result.num_emitted.shape)}")
        if active is None:
            active = torch.ones(batch, dtype=torch.bool, device=device)
        act = active.to(torch.float64)
        depth = selection.order_depth.amax(dim=1) if selection.order_depth.shape[1] else torch.zeros_like(counts)
        row = torch.stack(
            [
                act.sum(),
                (result.num_emitted.to(torch.float64) * act).sum(),
                (depth.to(torch.float64) * act).sum(),
                (counts.to(torch.float64) * act).sum(),
                (result.accepted_len.to(torch.float64) * act).sum(),
                ((truncated.to(torch.float64) * act).sum() if truncated is not None else act.new_zeros(())),
            ]
        )
        self._totals = row if self._totals is None else self._totals + row
        if truncated is not None:
            if depth_cap is None:
                raise ValueError("truncated needs depth_cap to count truncations per depth")
            hit = truncated.to(torch.bool) & active.to(torch.bool)
            cap = torch.where(hit, depth_cap.long() - 1, torch.full_like(depth_cap, self.max_depth, dtype=torch.long))
            per_depth = torch.zeros(self.max_depth + 1, dtype=torch.int64, device=device)
            per_depth.scatter_add_(0, cap.clamp(min=0, max=self.max_depth), torch.ones_like(cap))
            per_depth = per_depth[: self.max_depth]
            self._trunc = per_depth if self._trunc is None else self._trunc + per_depth
        if k_max > 0:
            used = (counts.to(torch.float64) * act).sum() / k_max
            self._budget_sum = used if self._budget_sum is None else self._budget_sum + used
            self._budget_steps += 1
        self.steps += 1

    def summary(self) -> dict[str, float | int | list[int]]:
        totals = [0.0] * 6 if self._totals is None else [float(x) for x in self._totals.cpu()]
        request_steps, emitted, depth, verified, accepted, truncated = totals

        def ratio(a: float, b: float) -> float:
            return a / b if b > 0 else math.nan

        mat = ratio(emitted, request_steps)
        mean_depth = ratio(depth, request_steps)
        trunc = [0] * self.max_depth if self._trunc is None else [int(x) for x in self._trunc.cpu()]
        budget = math.nan if self._budget_sum is None else float(self._budget_sum) / self._budget_steps
        return {
            "steps": self.steps,
            "request_steps": int(request_steps),
            "mat": mat,
            "mean_depth": mean_depth,
            "utilization": ratio(mat, mean_depth) if not math.isnan(mean_depth) else math.nan,
            "verified_per_accepted_draft": ratio(verified, accepted),
            "verified_per_emitted": ratio(verified, emitted),
            "truncations_per_depth": trunc,
            "truncation_rate": ratio(truncated, request_steps),
            "budget_utilization": budget,
        }
