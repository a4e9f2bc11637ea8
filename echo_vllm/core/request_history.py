"""Each request's recent acceptance against what the acceptance table expected of it (`request_history`).

A request whose drafts were accepted more often than their confidences said (a repetitive completion, code the
head knows) keeps being accepted more often, and the other way round: on the testbed the averaged accepted length
over a request's earlier steps correlates with its next one (r = 0.5 at batch 16 and 64), and a factor from it picks
drafts accepted 1-5 % more often at an equal verification budget (docs/benchmarks.md, twenty-third and
twenty-fourth sessions). `RequestHistory` holds, per row of the drafting step's batch, the exponential averages of
accepted drafts and of the drafts the table expected of the same verified nodes ([rows, 2] float64); the chain ops
read the factor (accepted + prior) / (expected + prior) (`core.chain_select`) and the feedback op moves the pair
(`core.chain_feedback.update_history`).

The rows follow the engine's batch order, which usually does not change between steps: `align` compares the
request ids as lists (in C) and only when the order changed maps rows one by one. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .chain_select import HISTORY_PRIOR


class RequestHistory:
    def __init__(self, alpha: float, prior: float = HISTORY_PRIOR, capacity: int = 8) -> None:
        """alpha: the weight of one verified step in a request's averages (0 < alpha <= 1); prior: pseudo-drafts on
        both sides of the factor (a new request's factor is 1)."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"request_history must be in (0, 1] (a step's weight in the averages); got {alpha}")
        if prior <= 0.0:
            raise ValueError(f"prior must be > 0; got {prior}")
        self.alpha = alpha
        self.prior = prior
        self.rows = torch.zeros((max(1, capacity), 2), dtype=torch.float64)
        self.req_ids: list[str] = []  # the request of each row (the drafting step's batch order)

    def align(self, req_ids: Sequence[str]) -> torch.Tensor:
        """Rows in the order of `req_ids` (this step's batch); new requests start at zero (factor 1), requests no
        longer listed are forgotten. Returns the [>= B, 2] tensor the ops read (its first B rows)."""
        ids = list(req_ids)
        batch, known = len(ids), self.req_ids
        shared = min(batch, len(known))
        if ids[:shared] == known[:shared]:  # most steps: the same rows, requests joined or left at the end
            if batch > self.rows.shape[0]:
                self.rows = torch.cat([self.rows, torch.zeros((batch - self.rows.shape[0], 2), dtype=torch.float64)])
            if batch > len(known):
                self.rows[len(known) : batch].zero_()
        else:
            index_of = {rid: i for i, rid in enumerate(known)}
            pairs = [(i, index_of[rid]) for i, rid in enumerate(ids) if rid in index_of]
            rows = torch.zeros((max(batch, self.rows.shape[0]), 2), dtype=torch.float64)
            if pairs:
                dst = torch.tensor([p[0] for p in pairs], dtype=torch.long)
                src = torch.tensor([p[1] for p in pairs], dtype=torch.long)
                rows[dst] = self.rows[src]
            self.rows = rows
        self.req_ids = ids
        return self.rows

    def factors(self) -> torch.Tensor:
        """[B] float64: each listed request's factor (reporting; the ops compute theirs from `rows`)."""
        rows = self.rows[: len(self.req_ids)]
        return (rows[:, 0] + self.prior) / (rows[:, 1] + self.prior)

    def summary(self) -> dict[str, Any]:
        """For echo_stats: the weight and the spread of the batch's factors (one small host read)."""
        factors = self.factors()
        if factors.numel() == 0:
            return {"alpha": self.alpha, "requests": 0, "factor_min": None, "factor_median": None, "factor_max": None}
        return {
            "alpha": self.alpha,
            "requests": int(factors.numel()),
            "factor_min": round(float(factors.min()), 3),
            "factor_median": round(float(factors.median()), 3),
            "factor_max": round(float(factors.max()), 3),
        }
