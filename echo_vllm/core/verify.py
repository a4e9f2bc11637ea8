"""Tree verification over a budget selection: greedy and exact rejection sampling, batched over requests.

Verifier input of request b: [root token, tree tokens of order[b, 0], order[b, 1], ...]. Target row 0 is the
distribution after the root (it predicts depth 1), row j + 1 the distribution after node order[b, j]; so the row
that predicts a selected node at position j is parent_local[b, j] + 1. Rows past counts[b] are padding and are
never read. Selected siblings must carry distinct tokens (grow_tree guarantees it); then the accepted nodes form
a single path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .budget import BudgetSelection


class VerifyResult(NamedTuple):
    accepted_len: torch.Tensor  # [B] int32, draft tokens accepted
    accepted_local: torch.Tensor  # [B, D] int32, position in order of the accepted node at depth d (-1 pad)
    accepted_tokens: torch.Tensor  # [B, D + 1] int64, accepted draft tokens then the bonus token (-1 pad)
    num_emitted: torch.Tensor  # [B] int32 = accepted_len + 1
    bonus: torch.Tensor  # [B] int64, token emitted after the accepted path
    accepted_depth_mask: torch.Tensor  # [B, D] bool, the accepted path reached depth d


def _check(
    tree_tokens: torch.Tensor,
    selection: BudgetSelection,
    rows: torch.Tensor,
    name: str,
    ndim: int,
    row_index: torch.Tensor | None = None,
) -> None:
    """Shapes only (no syncs). Dense: `rows` is [B, N + 1] (argmax) or [B, N + 1, V] (probs). Flat: `rows` is
    [R] or [R, V] and `row_index` [B, N + 1] holds each request's row numbers into it."""
    if tree_tokens.dim() != 2:
        raise ValueError(f"tree_tokens must be [B, N]; got {tuple(tree_tokens.shape)}")
    batch, num_nodes = tree_tokens.shape
    if selection.order.shape != (batch, num_nodes) or selection.parent_local.shape != (batch, num_nodes):
        raise ValueError(f"selection must be [B, N] = [{batch}, {num_nodes}]; got {tuple(selection.order.shape)}")
    if row_index is not None:
        if row_index.shape != (batch, num_nodes + 1):
            raise ValueError(f"row_index must be [B, N + 1] = [{batch}, {num_nodes + 1}]; got {tuple(row_index.shape)}")
        if row_index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"row_index must be an integer tensor; got {row_index.dtype}")
        if rows.dim() != ndim - 1:
            raise ValueError(
                f"{name} must be flat [R{', V' if ndim == 3 else ''}] with row_index; got {tuple(rows.shape)}"
            )
        return
    if rows.dim() != ndim or rows.shape[:2] != (batch, num_nodes + 1):
        raise ValueError(
            f"{name} must be [B, N + 1{', V' if ndim == 3 else ''}] with B={batch}, N={num_nodes}; "
            f"got {tuple(rows.shape)}"
        )


def _gather_rows(values: torch.Tensor, index: torch.Tensor, row_index: torch.Tensor | None) -> torch.Tensor:
    """values at rows `index` [B, K] of each request: dense values [B, N + 1] or flat [R] with row_index."""
    if row_index is None:
        return torch.gather(values, 1, index)
    return values[torch.gather(row_index.long(), 1, index)]


def _resolve_depth(selection: BudgetSelection, max_depth: int | None) -> int:
    if max_depth is None:  # one host sync; pass max_depth to avoid it and fix the output width
        return int(selection.order_depth.max()) if selection.order_depth.numel() else 0
    return max_depth


def _finish(
    tokens_in_order: torch.Tensor,
    accepted_local: torch.Tensor,
    bonus: torch.Tensor,
) -> VerifyResult:
    batch, max_depth = accepted_local.shape
    mask = accepted_local >= 0
    accepted_len = mask.sum(dim=1, dtype=torch.int32)
    drafts = torch.where(
        mask,
        torch.gather(tokens_in_order, 1, accepted_local.clamp(min=0).long()),
        torch.full_like(accepted_local, -1, dtype=torch.int64),
    )
    accepted_tokens = torch.cat([drafts, torch.full((batch, 1), -1, dtype=torch.int64, device=drafts.device)], 1)
    accepted_tokens.scatter_(1, accepted_len.long().unsqueeze(1), bonus.unsqueeze(1))
    return VerifyResult(
        accepted_len=accepted_len,
        accepted_local=accepted_local,
        accepted_tokens=accepted_tokens,
        num_emitted=accepted_len + 1,
        bonus=bonus,
        accepted_depth_mask=mask,
    )


def _accepted_by_depth(accepted: torch.Tensor, order_depth: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N] accepted positions -> [B, D] int32 position per depth (-1 none); deterministic (amax)."""
    batch, num_nodes = accepted.shape
    positions = torch.arange(num_nodes, device=accepted.device, dtype=torch.int64).expand(batch, num_nodes)
    column = torch.where(accepted, order_depth.long() - 1, torch.full_like(positions, max_depth))
    column = column.clamp(min=0, max=max_depth)
    out = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=accepted.device)
    out.scatter_reduce_(1, column, torch.where(accepted, positions, torch.full_like(positions, -1)), reduce="amax")
    return out[:, :max_depth].to(torch.int32)


def verify_greedy(
    tree_tokens: torch.Tensor,
    selection: BudgetSelection,
    target_argmax: torch.Tensor,
    max_depth: int | None = None,
    row_index: torch.Tensor | None = None,
) -> VerifyResult:
    """Greedy verification. A selected node is correct iff its token == the target argmax at its parent's row;
    it is accepted iff it and all its ancestors are correct. The accepted path ends at the deepest accepted node
    (unique, as siblings have distinct tokens); the bonus token is the target argmax at that node's row (row 0 if
    nothing was accepted). `max_depth` sets the width D of the per-depth outputs (default: deepest selected
    depth, at the cost of one host sync).

    `target_argmax` is dense [B, N + 1], or flat [R] with `row_index` [B, N + 1]: request b's row r is
    target_argmax[row_index[b, r]] (no padded copy; entries for padding rows are never read, any valid row)."""
    _check(tree_tokens, selection, target_argmax, "target_argmax", 2, row_index)
    max_depth = _resolve_depth(selection, max_depth)
    target_argmax = target_argmax.to(torch.int64)
    real = selection.order >= 0
    order = selection.order.long().clamp(min=0)
    tokens_in_order = torch.gather(tree_tokens.to(torch.int64), 1, order)
    parent_row = selection.parent_local.long() + 1  # 0 = root row
    correct = real & (tokens_in_order == _gather_rows(target_argmax, parent_row, row_index))
    batch = tree_tokens.shape[0]
    root = torch.ones((batch, 1), dtype=torch.bool, device=tree_tokens.device)
    accepted = correct
    for _ in range(max_depth - 1):  # each pass propagates acceptance one more level down
        accepted = correct & torch.gather(torch.cat([root, accepted], 1), 1, parent_row)
    accepted_local = _accepted_by_depth(accepted, selection.order_depth, max_depth)
    last = torch.cat([torch.full((batch, 1), -1, dtype=torch.int32, device=accepted_local.device), accepted_local], 1)
    accepted_len = (accepted_local >= 0).sum(1, keepdim=True)
    last_pos = torch.gather(last, 1, accepted_len).long()  # -1 if none
    bonus = _gather_rows(target_argmax, last_pos + 1, row_index).squeeze(1)
    return _finish(tokens_in_order, accepted_local, bonus)


def _normalize(probs: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = probs.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, probs / total.clamp(min=torch.finfo(probs.dtype).tiny), fallback)


def verify_sampling(
    tree_tokens: torch.Tensor,
    selection: BudgetSelection,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    max_depth: int | None = None,
    max_children: int | None = None,
    row_index: torch.Tensor | None = None,
) -> VerifyResult:
    """Exact multi-draft recursive rejection sampling for deterministic (top-k) drafts (SpecInfer; SGLang's
    tree_speculative_sampling_target_only with one-hot draft probabilities).

    Start at the root with p_res = its target row. Walk the current node's selected children in order: accept
    child x iff u < p_res(x) (a fresh uniform u per try); on rejection set p_res(x) = 0 and renormalize. An
    accepted child becomes the current node with p_res = its target row. If every child is rejected, or the node
    has no selected child, emit a token sampled from p_res and stop. The emitted sequence is distributed exactly
    as sampling from the target. Rows are renormalized on entry; a residual that underflows to all zeros falls
    back to the node's target row (a measure-zero event in exact arithmetic).

    `max_depth` / `max_children` (the most selected children of one node) bound the loops; each defaults to a
    value read from `selection` (one host sync each). `target_probs` is dense [B, N + 1, V], or flat [R, V] with
    `row_index` [B, N + 1] (request b's row r is target_probs[row_index[b, r]]; padding entries: any valid row).
    """
    return _verify_sampling_impl(
        tree_tokens, selection, target_probs, generator, max_depth, max_children, True, row_index
    )


def _verify_sampling_impl(
    tree_tokens: torch.Tensor,
    selection: BudgetSelection,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    max_depth: int | None,
    max_children: int | None,
    zero_rejected: bool,
    row_index: torch.Tensor | None = None,
) -> VerifyResult:
    """`zero_rejected=False` is a deliberately wrong variant, used only by the tests to show they can fail."""
    _check(tree_tokens, selection, target_probs, "target_probs", 3, row_index)
    max_depth = _resolve_depth(selection, max_depth)
    batch, num_nodes = tree_tokens.shape
    device = tree_tokens.device
    real = selection.order >= 0
    order = selection.order.long().clamp(min=0)
    tokens_in_order = torch.gather(tree_tokens.to(torch.int64), 1, order)
    parent_local = torch.where(real, selection.parent_local.long(), torch.full_like(order, -2))  # pad: no parent
    if max_children is None:
        per_parent = torch.zeros((batch, num_nodes + 2), dtype=torch.int64, device=device)
        per_parent.scatter_add_(1, parent_local + 2, torch.ones_like(parent_local))
        max_children = int(per_parent[:, 1:].max()) if num_nodes else 0

    vocab = target_probs.shape[-1]
    uniform = torch.full((batch, vocab), 1.0 / vocab, dtype=torch.float32, device=device)

    def row_at(local: torch.Tensor) -> torch.Tensor:
        """[B, V] normalized float32 target row (rows are read lazily: no [B, N+1, V] copy)."""
        row = target_probs[rows, local] if row_index is None else target_probs[row_index[rows, local].long()]
        row = row.to(torch.float32).clamp(min=0)
        return _normalize(row, uniform)

    rows = torch.arange(batch, device=device)
    positions = torch.arange(num_nodes, device=device).expand(batch, num_nodes)

    cur = torch.full((batch,), -1, dtype=torch.int64, device=device)  # position of the current node, -1 = root
    cur_row = row_at(torch.zeros(batch, dtype=torch.int64, device=device))
    p_res = cur_row.clone()
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    bonus = torch.zeros(batch, dtype=torch.int64, device=device)
    accepted_local = torch.full((batch, max_depth), -1, dtype=torch.int32, device=device)

    for level in range(max_depth + 1):
        tried = torch.zeros((batch, num_nodes), dtype=torch.bool, device=device)
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        nxt = cur.clone()
        is_child = parent_local == cur.unsqueeze(1)
        for _ in range(max_children if level < max_depth else 0):
            untried = is_child & ~tried
            has = untried.any(dim=1)
            child = torch.where(untried, positions, torch.full_like(positions, num_nodes)).amin(dim=1)
            child = torch.where(has, child, torch.zeros_like(child))
            active = has & ~done & ~moved
            tried |= (positions == child.unsqueeze(1)) & has.unsqueeze(1)
            token = tokens_in_order[rows, child]
            p_x = p_res[rows, token]
            u = torch.rand(batch, generator=generator, device=device)
            accept = active & (u < p_x)
            reject = active & ~accept
            moved |= accept
            nxt = torch.where(accept, child, nxt)
            if zero_rejected:  # p_res never aliases cur_row or target_probs: edit in place
                p_res[rows, token] = torch.where(reject, torch.zeros_like(p_x), p_x)
                p_res = torch.where(reject.unsqueeze(1), _normalize(p_res, cur_row), p_res)
        # Requests whose children were all rejected, or that sit on a leaf, emit a residual sample and stop.
        stop = ~done & ~moved
        # Sampled for every request (no host sync, fixed RNG consumption); kept only where the walk stops.
        sample = torch.multinomial(p_res, 1, generator=generator).squeeze(1)
        bonus = torch.where(stop, sample, bonus)
        done |= stop
        if level < max_depth:
            accepted_local[:, level] = torch.where(moved, nxt, torch.full_like(nxt, -1)).to(torch.int32)
        cur = nxt
        if level < max_depth:
            cur_row = torch.where(moved.unsqueeze(1), row_at((cur + 1).clamp(min=0)), cur_row)
        p_res = torch.where(moved.unsqueeze(1), cur_row, p_res)
    return _finish(tokens_in_order, accepted_local, bonus)
