"""A budget selection in spine-first topological order: how a tree travels through a chain-shaped engine.

vLLM's scheduler sees a request's drafts as one flat list and may cut it to a prefix when the step's token budget
is short. Listing the selected spine nodes first (by depth) and then every other selected node in depth-major
order keeps every prefix ancestor-closed: a spine node's ancestors are spine nodes of smaller depth, and any other
node's parent is a spine node or a non-spine node of the previous depth, listed earlier. The spine rows then form
a plain chain, so causal attention is exact for them and only the other rows need the tree mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .budget import BudgetSelection
from .tree import DraftTree


class SpineFirstOrder(NamedTuple):
    tokens: torch.Tensor  # [B, N] int64 the selected nodes' draft tokens in spine-first order (0 padding)
    parent_local: torch.Tensor  # [B, N] int64 position of each node's parent in this order (-1 root / padding)
    depth: torch.Tensor  # [B, N] int64 (0 padding)
    counts: torch.Tensor  # [B] int64 selected nodes per request
    spine_len: torch.Tensor  # [B] int64 selected spine nodes per request (= the rows before the first non-spine)
    scores: torch.Tensor  # [B, N] float32 path log-probs of the listed nodes (-inf padding)


def spine_first_order(selection: BudgetSelection, tree: DraftTree) -> SpineFirstOrder:
    """The nodes of `selection` (over `tree`, parents before children) in spine-first order; no host sync."""
    selected = selection.selected
    batch, num_nodes = selected.shape
    device = selected.device
    node = torch.arange(num_nodes, device=device, dtype=torch.int64).expand(batch, num_nodes)
    key = torch.where(selected, torch.where(tree.spine, node, node + num_nodes), torch.full_like(node, 2 * num_nodes))
    sorted_key, order = torch.sort(key, dim=1)
    real = sorted_key < 2 * num_nodes
    # local[b, n]: position of node n in the new order; column N is the root / padding sentinel (-1).
    local = torch.full((batch, num_nodes + 1), -1, dtype=torch.int64, device=device)
    local.scatter_(1, torch.where(real, order, torch.full_like(order, num_nodes)), torch.where(real, node, -1))
    local[:, num_nodes] = -1
    parent = torch.gather(tree.parent.to(torch.int64), 1, order)
    parent_local = torch.gather(local, 1, torch.where(parent >= 0, parent, torch.full_like(parent, num_nodes)))
    zero = torch.zeros_like(order)
    return SpineFirstOrder(
        tokens=torch.where(real, torch.gather(tree.tokens.to(torch.int64), 1, order), zero),
        parent_local=torch.where(real, parent_local, torch.full_like(order, -1)),
        depth=torch.where(real, torch.gather(tree.depth.to(torch.int64), 1, order), zero),
        counts=real.sum(dim=1),
        spine_len=(selected & tree.spine).sum(dim=1),
        scores=torch.where(real, torch.gather(tree.scores, 1, order), torch.full_like(tree.scores, float("-inf"))),
    )


def spine_sibling_tree(tokens: torch.Tensor, logprobs: torch.Tensor, usable: torch.Tensor | None = None) -> DraftTree:
    """The spine and its sibling leaves from a chain drafter's per-depth top-k, in the depth-major layout.

    tokens / logprobs [B, D, k]: at depth d the top-k children of the depth-(d-1) spine node (slot 0 = the child
    the chain continues with), logprobs cleaned (<= 0, NaN -> -inf). usable [B] (optional): rows whose drafts may be
    used at all. Path scores: slot 0 is the spine's cumulative log-prob; slot j > 0 = spine score of depth d-1 plus
    its own log-prob. Depth-d nodes hang off the depth-(d-1) spine node (node (d-2)·k), depth 1 off the root.
    """
    batch, max_depth, top_k = tokens.shape
    device = tokens.device
    logprobs = logprobs.to(torch.float32)
    spine_scores = torch.cumsum(logprobs[:, :, 0], dim=1)
    before = torch.cat([torch.zeros((batch, 1), device=device), spine_scores[:, :-1]], dim=1)
    scores = (before.unsqueeze(2) + logprobs).reshape(batch, max_depth * top_k)
    parent = (torch.arange(max_depth, device=device, dtype=torch.int32) - 1) * top_k
    parent = torch.where(parent < 0, torch.full_like(parent, -1), parent)
    parent = parent.repeat_interleave(top_k).expand(batch, max_depth * top_k).contiguous()
    node = torch.arange(max_depth * top_k, device=device)
    valid = torch.isfinite(scores)
    if usable is not None:
        valid = valid & usable.to(torch.bool).unsqueeze(1)
    return DraftTree(
        tokens=tokens.reshape(batch, max_depth * top_k).to(torch.int64),
        scores=scores.contiguous(),
        parent=parent,
        depth=(node // top_k + 1).to(torch.int32).expand(batch, max_depth * top_k).contiguous(),
        valid=valid.contiguous(),
        spine=(node % top_k == 0).expand(batch, max_depth * top_k).contiguous(),
    )


def spine_hindsight(
    node_depths: torch.Tensor, spine_len: torch.Tensor, spine_ok: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A verified tree step as its spines alone would have verified as chains: (accepted drafts [R], the verified
    nodes' depths [R, N] with every node off the spine set to 0 = none), for the depth plan's hindsight.

    node_depths [R, N]: the depths of each request's verified nodes in spine-first order (0 = not verified);
    spine_len [R]: its listed spine nodes; spine_ok [R, D]: whether the spine node of depth d + 1 was on the
    accepted path. A path that left the spine at depth a (an accepted sibling) counts a - 1 accepted spine drafts.
    """
    accepted = torch.cumprod(spine_ok.to(torch.int64), dim=1).sum(dim=1)
    columns = torch.arange(node_depths.shape[1], device=node_depths.device).unsqueeze(0)
    on_spine = columns < spine_len.to(node_depths.device).unsqueeze(1)
    return accepted, torch.where(on_spine, node_depths, torch.zeros_like(node_depths))
