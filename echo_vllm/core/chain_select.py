"""One chain step's gates, ECHO order and budget cut, from the drafted chains' path scores: the specification of
the fused CPU op `echo::chain_select` (csrc/chain_cpu.cpp, called through `echo_vllm.ops.chain`).

`chain_select_reference` is the composition the vLLM proposer runs for chains (top_k = 1) without the op: the
chain as a DraftTree, `gate_caps` on the depth confidences (undrafted depths open), `priority_rank`, and either
the fixed rule (the first `k_cap` candidates: `select_by_rank`, which equals `select_budget` + `add_surplus_tails`)
or the time-aware cut (`select_auto` with the acceptance table's chain gains). The op must return the same
tensors bit for bit (tests/test_chain_select.py); it exists because the composition is ~60 small torch ops, about
1 ms of host time per step on a 2-core CPU.

`history` (optional, [B, 2] float64 per request: running averages of its accepted drafts and of the drafts the
table expected of the same verified nodes, `echo_vllm.core.chain_feedback`) turns each request's factor
f = (accepted + prior) / (expected + prior) into its estimates: a node's gain is min(f x table, 1) and its place
in ECHO's order is by f x confidence (class first, then that key descending, depth ascending, index ascending), so a
request that has been accepted more often than its draft confidences said gets its drafts verified first. Gates
read the raw confidence (their thresholds were calibrated on it). Why: the request's own recent acceptance
predicts its next drafts beyond the confidence (r = 0.5 with the next accepted length on the testbed;
docs/benchmarks.md, twenty-third and twenty-fourth sessions).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .acceptance import confidence_bins
from .auto_budget import priority_rank, select_auto, select_by_rank
from .gating import Gates, caps_from_thresholds
from .tree import DraftTree

HISTORY_PRIOR = 2.0  # pseudo-drafts on both sides of a request's factor: a new request's factor is 1


class ChainInputs(NamedTuple):
    scores: torch.Tensor  # [B, d] float32 cumulative draft log-probs
    valid: torch.Tensor  # [B, d] bool: finite score and the row's drafts are kept
    confidence: torch.Tensor  # [B, d] float32 exp(score) where valid, else 0 (= the chain's depth confidence)


class ChainSelection(NamedTuple):
    counts: torch.Tensor  # [B] int32 K_i: request i verifies the first K_i drafts of its chain
    depth_cap: torch.Tensor  # [B] int32 the gates' cap (D when no gate closed)
    truncated: torch.Tensor  # [B] bool a gate closed
    predicted: torch.Tensor  # [] float64 expected accepted drafts of the cut (0 under the fixed rule)


def chain_inputs(logps: torch.Tensor, kept: torch.Tensor | None) -> ChainInputs:
    """From the draft log-probs [B, d] and the rows whose drafts vLLM keeps [B] (None: every row): what both
    implementations read (computed here with torch: its cumsum and exp are the reference's)."""
    scores = torch.cumsum(logps.to(torch.float32), dim=1)
    valid = torch.isfinite(scores)
    if kept is not None:
        valid &= kept.to(torch.bool).unsqueeze(1)
    confidence = torch.exp(torch.where(valid, scores, float("-inf")))  # a scalar: no [B, d] of -inf to allocate
    return ChainInputs(scores.contiguous(), valid.contiguous(), confidence.contiguous())


def chain_tree(scores: torch.Tensor, valid: torch.Tensor) -> DraftTree:
    """The chains as a depth-major DraftTree (top_k = 1; tokens are not needed by the selection)."""
    batch, depth = scores.shape
    device = scores.device
    node_depth = torch.arange(1, depth + 1, dtype=torch.int32, device=device).expand(batch, depth).contiguous()
    return DraftTree(
        tokens=torch.zeros((batch, depth), dtype=torch.int64, device=device),
        scores=scores,
        parent=(node_depth - 2).contiguous(),
        depth=node_depth,
        valid=valid,
        spine=torch.ones((batch, depth), dtype=torch.bool, device=device),
    )


def chain_gates(confidence: torch.Tensor, gate_on: torch.Tensor, tau: torch.Tensor) -> Gates:
    """`gate_caps` over D = len(gate_on) depths, the depths beyond the drafted ones open (+inf confidence)."""
    batch, depth = confidence.shape
    max_depth = gate_on.numel()
    padded = torch.cat(
        [confidence, torch.full((batch, max_depth - depth), float("inf"), device=confidence.device)], dim=1
    )
    depth_cap, truncated = caps_from_thresholds(padded, gate_on, tau)
    return Gates(depth_cap, truncated, torch.ones_like(truncated))  # chains have no width to widen


def chain_gains(
    confidence: torch.Tensor, valid: torch.Tensor, gain_table: torch.Tensor, factor: torch.Tensor | None = None
) -> torch.Tensor:
    """`AcceptanceModel.node_gain(chain=True)` from the table: P(accepted) at (depth, confidence bin), 0 for
    invalid nodes, capped by the parent's (a running minimum along the chain). factor [B] float32: each row's
    history factor, applied as min(factor x p, 1) before the running minimum."""
    max_depth, num_bins = gain_table.shape
    depth = confidence.shape[1]
    rows = torch.arange(depth, device=confidence.device).clamp(max=max_depth - 1).expand_as(confidence)
    p = gain_table.to(confidence.device)[rows, confidence_bins(confidence, num_bins)]
    if factor is not None:
        p = torch.clamp(p * factor.unsqueeze(1), max=1.0)
    p = torch.where(valid, p, torch.zeros_like(p))
    return torch.cummin(p, dim=1).values


def history_factor(history: torch.Tensor, batch: int, prior: float) -> torch.Tensor:
    """[B] float32: (accepted + prior) / (expected + prior) of the first `batch` rows of `history` [B', 2] float64,
    computed in float64 and rounded once (the op computes it the same way)."""
    rows = history[:batch]
    return ((rows[:, 0] + prior) / (rows[:, 1] + prior)).to(torch.float32)


def chain_select_reference(
    inputs: ChainInputs,
    gate_on: torch.Tensor,
    tau: torch.Tensor,
    gain_table: torch.Tensor | None,
    rest_seconds: torch.Tensor,
    draft_seconds: torch.Tensor,
    *,
    base_tokens: float,
    k_cap: int,
    k_min: int,
    surplus_tail: bool,
    history: torch.Tensor | None = None,
    history_prior: float = HISTORY_PRIOR,
) -> ChainSelection:
    """gain_table None: the fixed rule (first k_cap candidates); else the time-aware cut (see module docstring).
    history [B', 2] float64 (B' >= B): the requests' factors (module docstring); None: none."""
    scores, valid, confidence = inputs
    factor = None
    if history is not None:
        factor = history_factor(history, scores.shape[0], history_prior)
        # The order's key: f x confidence (>= 0; 0 for invalid nodes, which are not candidates anyway).
        tree = chain_tree(confidence * factor.unsqueeze(1), valid)
    else:
        tree = chain_tree(scores, valid)
    gates = chain_gates(confidence, gate_on, tau)
    if gain_table is None:
        rank, eligible = priority_rank(tree, gates, surplus_tail)
        selection = select_by_rank(tree, rank, eligible, k_cap)
        predicted = torch.zeros((), dtype=torch.float64, device=scores.device)
    else:
        auto = select_auto(
            tree,
            gates,
            chain_gains(confidence, valid, gain_table, factor),
            rest_seconds,
            draft_seconds,
            base_tokens=base_tokens,
            k_cap=k_cap,
            surplus_tail=surplus_tail,
            k_min=k_min,
        )
        selection, predicted = auto.selection, auto.choice.predicted_accepted.to(torch.float64)
    return ChainSelection(selection.counts, gates.depth_cap, gates.truncated, predicted)
