"""The acceptance model of the time-aware budget: P(a drafted node is accepted | its depth, its confidence).

The calibration already records, per verified request-step and depth d, (c_{i,d}, accepted_{i,d}): the depth
confidence and whether the accepted path reached depth d. For a chain (vLLM's drafts) that is exactly the event
"the depth-d node is accepted", so the model is a table over (depth, confidence bin):
    p[d, j] = (accepted[d, j] + m * q_j) / (seen[d, j] + m),  q_j = (sum_d accepted[d, j] + m c_j) / (sum_d seen[d, j] + m)
with c_j the bin centre and m = `prior_strength`: with no samples the draft's own confidence is the estimate, then
the bin's rate over all depths, and the depth's own measured rate takes over as its samples come in. `node_gain`
turns a tree's path scores into each node's probability of being accepted, capped by its parent's (a path cannot
be accepted more often than its prefix).

Counts are device tensors updated in place (`record`, no host sync); the table is recomputed at `refresh()`,
which the proposer calls at its refit points, so every TP rank uses the same table at the same step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

DEFAULT_BINS = 16
DEFAULT_PRIOR_STRENGTH = 4.0
# The width model's bins (`log_floor`): nodes off the spine have small path confidences (on the testbed at batch 1,
# most below 1/16, i.e. all in the first of 16 linear bins, accepted ~5 % there on average while those in the
# second bin were accepted ~24 % of the time), so its bins are equal in log2(c) over [2^-8, 1].
WIDTH_LOG_FLOOR = 2.0**-8


def confidence_bins(confidence: torch.Tensor, num_bins: int, log_floor: float | None = None) -> torch.Tensor:
    """The table column of each confidence: floor(c x bins) of c clamped to [0, 1] (NaN: 0), the top bin closed.
    log_floor f: bins of equal width in log2(c) over [f, 1] instead (everything below f in the first)."""
    c = torch.nan_to_num(confidence.to(torch.float32), nan=0.0).clamp(0.0, 1.0)
    if log_floor is not None:
        span = -math.log2(log_floor)
        c = (torch.log2(c.clamp(min=log_floor)) + span) / span  # [0, 1] on the log scale
    return (c * num_bins).long().clamp(min=0, max=num_bins - 1)


class AcceptanceModel:
    def __init__(
        self,
        max_depth: int,
        *,
        num_bins: int = DEFAULT_BINS,
        prior_strength: float = DEFAULT_PRIOR_STRENGTH,
        device: torch.device | str = "cpu",
        log_floor: float | None = None,
    ) -> None:
        if max_depth < 1 or num_bins < 1 or prior_strength <= 0:
            raise ValueError("AcceptanceModel needs max_depth >= 1, num_bins >= 1 and prior_strength > 0")
        if log_floor is not None and not 0.0 < log_floor < 1.0:
            raise ValueError(f"AcceptanceModel log_floor must be in (0, 1); got {log_floor}")
        self.max_depth = max_depth
        self.num_bins = num_bins
        self.prior_strength = float(prior_strength)
        self.log_floor = log_floor
        self.device = torch.device(device)
        self.accepted = torch.zeros((max_depth, num_bins), dtype=torch.float64, device=self.device)
        self.seen = torch.zeros((max_depth, num_bins), dtype=torch.float64, device=self.device)
        # Each bin's prior: its centre (log bins: the geometric centre).
        mid = (torch.arange(num_bins, dtype=torch.float64, device=self.device) + 0.5) / num_bins
        self.centres = mid if log_floor is None else torch.exp2((mid - 1.0) * -math.log2(log_floor))
        self.table = self.centres.to(torch.float32).expand(max_depth, num_bins).clone()

    def _bins(self, confidence: torch.Tensor) -> torch.Tensor:
        return confidence_bins(confidence, self.num_bins, self.log_floor)

    def record(self, confidence: torch.Tensor, accepted: torch.Tensor, recorded: torch.Tensor) -> None:
        """Add samples: confidence, accepted, recorded [B, D] (recorded = the depth was verified for the row)."""
        depth = confidence.shape[1]
        if depth > self.max_depth or accepted.shape != confidence.shape or recorded.shape != confidence.shape:
            raise ValueError(
                f"confidence, accepted and recorded must be [B, <= {self.max_depth}] alike; got "
                f"{tuple(confidence.shape)}, {tuple(accepted.shape)}, {tuple(recorded.shape)}"
            )
        rows = torch.arange(depth, device=confidence.device).expand_as(confidence)
        flat = (rows * self.num_bins + self._bins(confidence)).reshape(-1).to(self.device)
        keep = recorded.reshape(-1).to(self.device, torch.float64)
        hit = (accepted.reshape(-1).to(self.device, torch.bool)).to(torch.float64) * keep
        self.seen.view(-1).index_add_(0, flat, keep)
        self.accepted.view(-1).index_add_(0, flat, hit)

    def record_nodes(self, depth: torch.Tensor, confidence: torch.Tensor, accepted: torch.Tensor) -> None:
        """Add one sample per verified node: its depth [M] (1-based), its own path confidence [M] and whether the
        accepted path went through it [M] (trees: the nodes off the spine, whose acceptance is not their depth's)."""
        if depth.numel() == 0:
            return
        row = (depth.long() - 1).clamp(0, self.max_depth - 1)
        flat = (row * self.num_bins + self._bins(confidence)).reshape(-1).to(self.device)
        hit = accepted.reshape(-1).to(self.device, torch.float64)
        self.seen.view(-1).index_add_(0, flat, torch.ones_like(hit))
        self.accepted.view(-1).index_add_(0, flat, hit)

    def refresh(self) -> None:
        """Recompute the table: each (depth, bin) shrinks towards the bin's rate pooled over all depths, which
        shrinks towards the bin's confidence. A path's confidence already carries its depth, so the pooled rate is
        a better guess than the confidence for a depth with few samples in that bin (heads are seldom calibrated:
        on the testbed mid-confidence drafts are accepted more often than their confidence says)."""
        m = self.prior_strength
        pooled = (self.accepted.sum(dim=0) + m * self.centres) / (self.seen.sum(dim=0) + m)
        self.table = ((self.accepted + m * pooled) / (self.seen + m)).to(torch.float32)

    def node_gain(
        self, tree: Any, max_depth: int, chain: bool = False, width: AcceptanceModel | None = None
    ) -> torch.Tensor:
        """[B, N] probability that each node of `tree` (a DraftTree) is accepted: the table at the node's depth and
        its own path confidence exp(score), capped by its parent's (a path is never accepted more often than its
        prefix); 0 for invalid nodes. Parents precede children (depth-major rows), so D - 1 passes settle the caps
        (`chain`: one cumulative minimum). `max_depth` comes from the caller, which knows it (no host sync).
        `width`: the model of the nodes off the spine (a sibling is accepted far less often than a spine node of
        the same confidence would be: the spine takes the likely token), used for those nodes."""
        scores, depth = tree.scores, tree.depth.long()
        usable = tree.valid & ~torch.isnan(scores)
        conf = torch.exp(torch.where(usable, scores.float(), torch.full_like(scores.float(), float("-inf"))))
        table = self.table.to(scores.device)
        row = (depth - 1).clamp(0, self.max_depth - 1)
        bins = self._bins(conf)
        p = table[row, bins]
        if width is not None:  # its own table and bins
            p = torch.where(tree.spine, p, width.table.to(scores.device)[row, width._bins(conf)])
        p = torch.where(usable, p, torch.zeros_like(conf))
        if chain:  # one node per depth, depth-major: the parent is the node to the left
            return torch.cummin(p, dim=1).values
        parent = tree.parent.long()
        has_parent = parent >= 0
        for _ in range(max_depth - 1):
            parent_p = torch.gather(p, 1, parent.clamp(min=0))
            p = torch.where(has_parent, torch.minimum(p, parent_p), p)
        return p

    # -- JSON (inside the budget profile) ---------------------------------------------------------------------

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "num_bins": self.num_bins,
            "prior_strength": self.prior_strength,
            **({"log_floor": self.log_floor} if self.log_floor is not None else {}),
            "accepted": self.accepted.cpu().tolist(),
            "seen": self.seen.cpu().tolist(),
        }

    @classmethod
    def from_json_dict(
        cls, data: dict[str, Any], max_depth: int, device: torch.device | str = "cpu"
    ) -> AcceptanceModel:
        floor = data.get("log_floor")
        model = cls(
            max_depth,
            num_bins=int(data["num_bins"]),
            prior_strength=float(data["prior_strength"]),
            device=device,
            log_floor=None if floor is None else float(floor),
        )
        accepted = torch.tensor(data["accepted"], dtype=torch.float64)
        seen = torch.tensor(data["seen"], dtype=torch.float64)
        shape = (max_depth, model.num_bins)
        if accepted.shape != shape or seen.shape != shape:
            raise ValueError(f"acceptance tables must be {max_depth} x {model.num_bins}; got {tuple(seen.shape)}")
        if (seen < 0).any() or (accepted < 0).any() or (accepted > seen).any():
            raise ValueError("acceptance counts must satisfy 0 <= accepted <= seen")
        model.accepted.copy_(accepted)
        model.seen.copy_(seen)
        model.refresh()
        return model
