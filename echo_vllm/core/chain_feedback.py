"""A verified chain step's feedback to ECHO: accepted drafts per request, the step's sums for the statistics, the
acceptance table's counts and the depth plan's level histograms, from what vLLM sampled.

`chain_feedback_reference` is the specification of `echo::chain_feedback` (csrc/feedback_cpu.cpp) and its
fallback: the composition the proposer ran op by op (~45 small torch ops per step). Every output is a count or a
float64 sum of counts, so the compiled op equals it exactly. No vLLM import.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .acceptance import confidence_bins


class ChainFeedback(NamedTuple):
    accepted: torch.Tensor  # [R] int64: accepted drafts per verified request (emitted - 1, >= 0)
    sums: torch.Tensor  # [5] float64: rows, emitted, accepted, verified, verified depth (`EchoMetrics`)
    levels: torch.Tensor  # int64: the (reach, accepted) then node-depth histograms (`level_histograms`)


def level_histograms(accepted: torch.Tensor, verified_depths: torch.Tensor, drafted: int) -> torch.Tensor:
    """[(n + 1)^2 + (n + 1)] int64, n = drafted + 1: the histogram of (reach_i, accepted_i) (row-major, values
    clamped to n) and the histogram of the depths in `verified_depths` [R, N] (0 = none; reach_i = its row's
    max), in one tensor so that the host needs one transfer (`level_counts_from_histograms`)."""
    n = drafted + 1
    size = n + 1
    depths = verified_depths.long()
    reach = depths.amax(dim=1) if depths.shape[1] else torch.zeros_like(accepted, dtype=torch.long)
    acc = accepted.long().clamp(0, n)
    joint = torch.bincount(reach.clamp(0, n) * size + acc, minlength=size * size)
    nodes = torch.bincount(depths.reshape(-1).clamp(0, n), minlength=size)
    return torch.cat([joint, nodes])


def chain_feedback_reference(
    sampled: torch.Tensor,
    cur: torch.Tensor,
    old: torch.Tensor,
    verified: torch.Tensor,
    confidence: torch.Tensor,
    seen: torch.Tensor,
    hits: torch.Tensor,
    drafted: int,
    record_acceptance: bool,
    history: torch.Tensor | None = None,
    gain_table: torch.Tensor | None = None,
    alpha: float = 0.0,
) -> ChainFeedback:
    """sampled [B', W] (-1 = no token), cur / old / verified [R] int64 (rows in `sampled`, rows in `confidence`,
    drafts verified), confidence [B, D] float32; seen / hits [D, bins] float64: an acceptance table's counts
    (linear bins), added to in place when `record_acceptance` (`AcceptanceModel.record`).
    history [B'', 2] float64 (rows of `confidence`'s batch) with gain_table [D, bins'] float32: each verified row's
    running averages of accepted drafts and of the drafts the table expected of its verified prefix move by weight
    `alpha` towards this step's (`update_history`; the requests' factors of `chain_select_reference`)."""
    emitted = (sampled[cur] != -1).sum(dim=1)
    accepted = (emitted - 1).clamp(min=0)
    d = confidence.shape[1]
    depths = torch.arange(d, device=confidence.device).unsqueeze(0)
    node_depths = torch.where(depths < verified.unsqueeze(1), depths + 1, torch.zeros_like(depths))
    parts = torch.stack([t.reshape(-1).to(torch.float64) for t in (emitted, accepted, verified, verified)])
    sums = torch.cat([torch.tensor([float(emitted.numel())], dtype=torch.float64), parts.sum(dim=1)])
    if record_acceptance:
        num_bins = seen.shape[1]
        rows = depths.expand(cur.numel(), d)
        flat = (rows * num_bins + confidence_bins(confidence[old], num_bins)).reshape(-1)
        keep = (depths < verified.unsqueeze(1)).reshape(-1).to(torch.float64)
        hit = (depths < accepted.unsqueeze(1)).reshape(-1).to(torch.float64) * keep
        seen.view(-1).index_add_(0, flat, keep)
        hits.view(-1).index_add_(0, flat, hit)
    if history is not None and history.numel():
        assert gain_table is not None, "a history needs the gain table"
        update_history(history, old, verified, accepted, confidence[old], gain_table, alpha)
    return ChainFeedback(accepted, sums, level_histograms(accepted, node_depths, drafted))


def expected_accepted(confidence: torch.Tensor, verified: torch.Tensor, gain_table: torch.Tensor) -> torch.Tensor:
    """[R] float64: the table's expected accepted drafts of each row's verified prefix - the gains at (depth, bin
    of the confidence) with a running minimum along the chain, summed in depth order (the op's order)."""
    rows, d = confidence.shape
    num_bins = gain_table.shape[1]
    columns = torch.arange(d, device=confidence.device).expand(rows, d)
    p = gain_table.to(confidence.device)[columns, confidence_bins(confidence, num_bins)]
    p = torch.cummin(p, dim=1).values.to(torch.float64)
    expected = torch.zeros(rows, dtype=torch.float64, device=confidence.device)
    for j in range(d):
        expected = expected + torch.where(verified > j, p[:, j], torch.zeros_like(expected))
    return expected


def update_history(
    history: torch.Tensor,
    old: torch.Tensor,
    verified: torch.Tensor,
    accepted: torch.Tensor,
    confidence: torch.Tensor,
    gain_table: torch.Tensor,
    alpha: float,
) -> None:
    """history[old] <- (1 - alpha) history[old] + alpha (accepted, expected), in place (confidence: [R, D], the
    verified rows' own)."""
    expected = expected_accepted(confidence, verified, gain_table)
    pair = history[old]
    history[old, 0] = (1.0 - alpha) * pair[:, 0] + alpha * accepted.to(torch.float64)
    history[old, 1] = (1.0 - alpha) * pair[:, 1] + alpha * expected
