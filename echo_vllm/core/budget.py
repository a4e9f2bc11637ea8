"""Elastic budget selection: the batch-wide K_max shared by all requests (ECHO, Sec. "Elastic Budget").

This vectorized torch function is the *specification*: the csrc op (`echo::select_budget`) must return the
same tensors bit for bit. The rule, in full:

Every candidate node (b, n) falls in one class:
  * class 0, depth extension (Priority 1): valid, on request b's spine (its best chain), depth <= depth_cap[b];
  * class 1, width (Priority 2): valid, not on the spine, request b truncated by a gate, depth <= depth_cap[b];
  * class 2, excluded: everything else, and any NaN score.
All class 0 and class 1 nodes of the whole batch are ranked by the total order
  (class ascending, path score descending, depth ascending, flat index b * N + n ascending)
and the first K_max are selected. So width is spent only once every depth-eligible node in the batch is in
(Priority 2 only when no request can deepen), and within a class the most likely paths win across requests.

Ancestor closure follows from the order: a child's path score never exceeds its parent's (log-probs <= 0),
parents are shallower, and a node's parent is in the same class or, for a width node hanging off the spine, in
class 0. Callers must pass topologically numbered rows (parent[b, n] < n), as the depth-major tree layout is.

Outputs are fixed-shape so that the verifier can consume them without host syncs:
  selected     [B, N] bool   selection mask
  counts       [B]    int32  K_i, draft tokens submitted for request b (sum <= K_max)
  order        [B, N] int32  selected node indices of row b in ascending order, then -1
  parent_local [B, N] int32  for order[b, j]: position in order[b] of its parent, -1 for the root's children/pad
  order_depth  [B, N] int32  depth of order[b, j], 0 for padding
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .gating import Gates
from .tree import DraftTree

CLASS_DEPTH = 0
CLASS_WIDTH = 1
CLASS_EXCLUDED = 2


class BudgetSelection(NamedTuple):
    selected: torch.Tensor
    counts: torch.Tensor
    order: torch.Tensor
    parent_local: torch.Tensor
    order_depth: torch.Tensor


def check_budget_inputs(
    scores: torch.Tensor,
    depth: torch.Tensor,
    parent: torch.Tensor,
    valid: torch.Tensor,
    spine: torch.Tensor,
    depth_cap: torch.Tensor,
    truncated: torch.Tensor,
    k_max: int,
) -> None:
    """Shape/dtype checks shared by the reference and the op wrapper (no data-dependent syncs)."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, N]; got shape {tuple(scores.shape)}")
    if scores.dtype != torch.float32:
        raise TypeError(f"scores must be float32; got {scores.dtype}")
    shape = scores.shape
    for name, tensor, dtype in (
        ("depth", depth, torch.int32),
        ("parent", parent, torch.int32),
        ("valid", valid, torch.bool),
        ("spine", spine, torch.bool),
    ):
        if tensor.shape != shape:
            raise ValueError(f"{name} must have the shape of scores {tuple(shape)}; got {tuple(tensor.shape)}")
        if tensor.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}; got {tensor.dtype}")
    for name, tensor, dtype in (("depth_cap", depth_cap, torch.int32), ("truncated", truncated, torch.bool)):
        if tensor.shape != shape[:1]:
            raise ValueError(f"{name} must be [B] = [{shape[0]}]; got {tuple(tensor.shape)}")
        if tensor.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}; got {tensor.dtype}")
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 0:
        raise ValueError(f"k_max must be an integer >= 0; got {k_max!r}")


def candidate_class(
    scores: torch.Tensor,
    depth: torch.Tensor,
    valid: torch.Tensor,
    spine: torch.Tensor,
    depth_cap: torch.Tensor,
    truncated: torch.Tensor,
) -> torch.Tensor:
    """[B, N] int32 class per node (see module docstring)."""
    within_cap = depth <= depth_cap.unsqueeze(1)
    usable = valid & within_cap & ~torch.isnan(scores)
    depth_ok = usable & spine
    width_ok = usable & ~spine & truncated.unsqueeze(1)
    cls = torch.full_like(depth, CLASS_EXCLUDED)
    cls = torch.where(width_ok, torch.full_like(cls, CLASS_WIDTH), cls)
    return torch.where(depth_ok, torch.full_like(cls, CLASS_DEPTH), cls)


def total_order_rank(cls: torch.Tensor, scores: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Rank (0 = first) of every flat node in the order (class asc, score desc, depth asc, flat index asc).

    Lexicographic order by successive stable sorts, least significant key first; the flat index is the initial
    order, so it breaks every remaining tie. All inputs are 1-D over the flattened batch.
    """
    perm = torch.sort(depth, stable=True).indices
    perm = perm[torch.sort(scores[perm], descending=True, stable=True).indices]
    perm = perm[torch.sort(cls[perm], stable=True).indices]
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(perm.numel(), device=perm.device)
    return rank


def select_budget_reference(
    scores: torch.Tensor,
    depth: torch.Tensor,
    parent: torch.Tensor,
    valid: torch.Tensor,
    spine: torch.Tensor,
    depth_cap: torch.Tensor,
    truncated: torch.Tensor,
    k_max: int,
) -> BudgetSelection:
    check_budget_inputs(scores, depth, parent, valid, spine, depth_cap, truncated, k_max)
    batch, num_nodes = scores.shape
    cls = candidate_class(scores, depth, valid, spine, depth_cap, truncated).reshape(-1)
    # +0.0 folds -0.0 into 0.0 so both compare equal, as they do in the C++/CUDA comparators.
    flat_scores = (scores + 0.0).reshape(-1)
    flat_depth = depth.reshape(-1)

    rank = total_order_rank(cls, flat_scores, flat_depth)
    # min(): a k_max beyond int64 (any Python int is allowed) selects everything instead of overflowing.
    selected = ((cls != CLASS_EXCLUDED) & (rank < min(k_max, rank.numel()))).reshape(batch, num_nodes)
    return compact_selection(selected, depth, parent)


def compact_selection(selected: torch.Tensor, depth: torch.Tensor, parent: torch.Tensor) -> BudgetSelection:
    """Per-row compaction of a selection mask into order / parent_local / order_depth (fixed shapes)."""
    batch, num_nodes = selected.shape
    device = selected.device
    node_index = torch.arange(num_nodes, device=device, dtype=torch.int64).expand(batch, num_nodes)
    sort_key = torch.where(selected, node_index, torch.full_like(node_index, num_nodes))
    sorted_key, order = torch.sort(sort_key, dim=1)
    is_real = sorted_key < num_nodes
    order = torch.where(is_real, order, torch.full_like(order, -1))

    # local[b, n] = position of node n in order[b] (or -1).
    local = torch.full((batch, num_nodes + 1), -1, dtype=torch.int64, device=device)
    positions = torch.arange(num_nodes, device=device, dtype=torch.int64).expand(batch, num_nodes)
    local.scatter_(1, torch.where(is_real, order, torch.full_like(order, num_nodes)), positions)
    local[:, num_nodes] = -1
    safe_order = order.clamp(min=0)
    order_parent = torch.gather(parent.to(torch.int64), 1, safe_order)
    parent_local = torch.gather(local, 1, torch.where(order_parent >= 0, order_parent, num_nodes))
    parent_local = torch.where(is_real, parent_local, torch.full_like(parent_local, -1))
    order_depth = torch.where(is_real, torch.gather(depth, 1, safe_order), torch.zeros_like(depth))
    return BudgetSelection(
        selected=selected,
        counts=selected.sum(dim=1, dtype=torch.int32),
        order=order.to(torch.int32),
        parent_local=parent_local.to(torch.int32),
        order_depth=order_depth.to(torch.int32),
    )


def add_surplus_tails(selection: BudgetSelection, tree: DraftTree, gates: Gates, k_max: int) -> BudgetSelection:
    """Priority 3: budget left after depth and width goes back to truncated requests' drafted tails.

    A closed gate says "probably rejected", which matters only when someone else can use the tokens. Where
    drafting already ran past the gate (vLLM's EAGLE loop always drafts all D tokens) and the batch leaves budget
    unused, verifying the tail costs nothing extra below the knee and can only add accepted tokens. Tails (valid
    spine nodes deeper than depth_cap of a truncated request) are ranked by the same order as everything else
    (path score descending, depth ascending, flat index ascending) and the first K_max - sum(counts) are added.

    No host sync. Ancestor closure: leftover budget > 0 means every class-0/1 node was selected (see
    select_budget_reference), so each request's spine is in up to its cap, and along a tail the parent scores no
    lower and is shallower, so it ranks first.
    """
    scores, depth = tree.scores, tree.depth
    batch, num_nodes = scores.shape
    leftover = (k_max - selection.counts.sum(dtype=torch.int64)).clamp(min=0)
    tail = (
        tree.valid
        & tree.spine
        & gates.truncated.unsqueeze(1)
        & (depth > gates.depth_cap.unsqueeze(1))
        & ~torch.isnan(scores)
        & ~selection.selected
    )
    # Tails are class 0 here, everything else class 1; +0.0 folds -0.0 as in the selection.
    rank = total_order_rank((~tail).reshape(-1).to(torch.int32), (scores + 0.0).reshape(-1), depth.reshape(-1))
    take = tail & (rank.reshape(batch, num_nodes) < leftover)
    return compact_selection(selection.selected | take, depth, tree.parent)


class VerifierInputs(NamedTuple):
    """What one target forward needs to verify every request's selected nodes at once (fixed shapes, row 0 =
    the root, i.e. the request's last emitted token; rows 1..counts[b] = order[b]; the rest is padding).

    tokens      [B, N + 1] int64  root token, then the selected nodes' draft tokens (0 for padding)
    positions   [B, N + 1] int32  offset from the root's position: the node's depth (0 for the root and padding)
    parent_rows [B, N + 1] int64  row of each row's parent (0 = the root for depth-1 nodes; -1 root and padding)
    mask        [B, N + 1, N + 1] bool  row r may attend to row c iff c is r or an ancestor of r (tree attention;
                                        every row also sees the whole KV cache before the root)
    num_rows    [B] int32         counts + 1
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    parent_rows: torch.Tensor
    mask: torch.Tensor
    num_rows: torch.Tensor


def verifier_inputs(tree: DraftTree, selection: BudgetSelection, root_tokens: torch.Tensor) -> VerifierInputs:
    """The verifier's inputs for `selection` of `tree` (no host sync); `root_tokens` [B] are the last emitted
    tokens. Rows follow `selection.order` (ascending node index, so parents come before children)."""
    batch, num_nodes = selection.order.shape
    device = selection.order.device
    is_real = selection.order >= 0
    safe_order = selection.order.clamp(min=0).long()
    node_tokens = torch.where(is_real, torch.gather(tree.tokens.long(), 1, safe_order), 0)
    tokens = torch.cat([root_tokens.long().reshape(batch, 1).to(device), node_tokens], dim=1)
    positions = torch.cat([torch.zeros((batch, 1), dtype=torch.int32, device=device), selection.order_depth], dim=1)
    node_parent = torch.where(is_real, selection.parent_local.long() + 1, -1)  # -1 + 1 = 0: the root
    parent_rows = torch.cat([torch.full((batch, 1), -1, dtype=torch.int64, device=device), node_parent], dim=1)
    rows = num_nodes + 1
    # reach[b, r, c]: c is r or r's parent; repeated squaring of this relation (log2(N + 1) passes, shapes only,
    # so no host sync) closes it over every ancestor.
    reach = torch.eye(rows, dtype=torch.float32, device=device).expand(batch, rows, rows).clone()
    has_parent = parent_rows >= 0
    reach.scatter_add_(2, parent_rows.clamp(min=0).unsqueeze(2), has_parent.unsqueeze(2).float())
    reach = (reach > 0).float()
    for _ in range(max(1, (rows - 1).bit_length())):
        reach = (torch.bmm(reach, reach) > 0).float()
    mask = reach > 0
    return VerifierInputs(tokens, positions, parent_rows, mask, selection.counts + 1)
