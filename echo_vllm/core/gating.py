"""Depth confidence and the sparse confidence gates (ECHO, "Sparse Confidence Gating").

c_{i,d} = max over the valid depth-d nodes of request i of exp(path score): whether some path to depth d is
likely. A gate at depth d is open iff c_{i,d} >= tau_d. A closed gate at depth d truncates request i *after*
depth d: its depth-d nodes stay eligible, nothing deeper is (depth_cap = d), and the request may be widened at
depths <= d. The shallowest closed gate wins. Which depths carry a gate is decided by the calibration (sparse:
sweet spots; dense: every calibrated depth; fixed: every depth, one tau). Without a calibration (warm-up) there
are no gates: depth_cap = D and nothing is truncated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .calibration import Calibration
from .tree import DraftTree


def depth_confidence(tree: DraftTree) -> torch.Tensor:
    """[B, D] float32: c_{b,d} = max over valid depth-d nodes of exp(score); 0 where a depth has no valid node."""
    batch, num_nodes = tree.scores.shape
    max_depth = tree.max_depth
    if max_depth == 0:
        return torch.zeros((batch, 0), dtype=torch.float32, device=tree.scores.device)
    if num_nodes % max_depth != 0:
        raise ValueError(f"tree is not in the depth-major layout: N={num_nodes} is not a multiple of D={max_depth}")
    top_k = num_nodes // max_depth
    scores = tree.scores.to(torch.float32)
    usable = tree.valid & ~torch.isnan(scores)
    scores = torch.where(usable, scores, torch.full_like(scores, float("-inf")))
    return torch.exp(scores.reshape(batch, max_depth, top_k).amax(dim=2))


def gate_caps(confidence: torch.Tensor, calibration: Calibration | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth_cap [B] int32, truncated [B] bool) from the depth confidences and the calibrated gates.

    A NaN confidence closes its gate (NaN >= tau is false). `calibration=None` (warm-up) gates nothing.
    """
    if confidence.dim() != 2:
        raise ValueError(f"confidence must be [B, D]; got shape {tuple(confidence.shape)}")
    batch, max_depth = confidence.shape
    device = confidence.device
    if calibration is None:
        return (
            torch.full((batch,), max_depth, dtype=torch.int32, device=device),
            torch.zeros((batch,), dtype=torch.bool, device=device),
        )
    if calibration.max_depth != max_depth:
        raise ValueError(
            f"the calibration covers {calibration.max_depth} depths but the tree has {max_depth}; recalibrate"
        )
    gated, tau = calibration.gate_tensors(device)
    return caps_from_thresholds(confidence, gated, tau)


def caps_from_thresholds(
    confidence: torch.Tensor, gated: torch.Tensor, tau: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gate_caps` from the gate tensors themselves: gated [D] bool, tau [D] float32 over confidence [B, D]."""
    batch, max_depth = confidence.shape
    closed = gated.unsqueeze(0) & ~(confidence.to(torch.float32) >= tau.unsqueeze(0))
    depths = torch.arange(1, max_depth + 1, dtype=torch.int32, device=confidence.device).expand(batch, max_depth)
    first_closed = torch.where(closed, depths, torch.full_like(depths, max_depth + 1)).amin(dim=1)
    truncated = closed.any(dim=1)
    depth_cap = torch.where(truncated, first_closed, torch.full_like(first_closed, max_depth))
    return depth_cap.to(torch.int32), truncated


def width_eligible(truncated: torch.Tensor, surplus_width: str = "all") -> torch.Tensor:
    """[B] bool: the requests Priority 2 may widen (the `truncated` argument of `select_budget`).

    Width is only reached once every request's spine is in (class 0 first), i.e. once no request can deepen.
    A request then stopped either at a closed gate (truncated) or at the depth ceiling D with every gate open.
    'truncated' widens only the former, the paper's wording, which assumes depth is unbounded; with a ceiling it
    leaves the budget unused whenever no gate closes (at B = 1 most steps). 'all' also widens the latter, at
    depths up to D: the same truncate-and-widen rule applied to a request truncated by the ceiling.
    """
    if surplus_width == "truncated":
        return truncated
    if surplus_width == "all":
        return torch.ones_like(truncated, dtype=torch.bool)
    raise ValueError(f"surplus_width must be 'all' or 'truncated'; got {surplus_width!r}")


@dataclass(frozen=True)
class Gates:
    """One step's gate outcome per request: what the budget selection reads besides the tree.

    depth_cap [B] int32: the deepest depth that may be verified (the first closed gate, else D);
    truncated [B] bool: a calibrated gate closed (Priority 3 tails and the truncation counters read it);
    widen [B] bool: Priority 2 may add non-spine nodes (`width_eligible`; the op's `truncated` input).
    """

    depth_cap: torch.Tensor
    truncated: torch.Tensor
    widen: torch.Tensor

    @classmethod
    def evaluate(cls, confidence: torch.Tensor, calibration: Calibration | None, surplus_width: str = "all") -> Gates:
        """The calibrated gates on the depth confidences (`gate_caps`), and who may be widened."""
        depth_cap, truncated = gate_caps(confidence, calibration)
        return cls(depth_cap, truncated, width_eligible(truncated, surplus_width))

    @classmethod
    def open(cls, batch: int, max_depth: int, device: torch.device | str = "cpu") -> Gates:
        """No gate anywhere and no width priority: every request may go to depth D."""
        closed = torch.zeros((batch,), dtype=torch.bool, device=device)
        return cls(torch.full((batch,), max_depth, dtype=torch.int32, device=device), closed, closed)
