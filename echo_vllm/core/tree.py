"""Batched draft trees in a fixed depth-major layout.

Request b's tree has D depths of `top_k` nodes each: node n sits at depth n // top_k + 1 (depth 1 = the first
draft token) in slot n % top_k. Slot 0 of every depth is the request's *spine*: the chain grown from the best
child of the previous spine node, which is what depth extension adds one node at a time. Parents always have a
smaller index (parent[b, n] < n), as the budget selection requires.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class DraftTree(NamedTuple):
    tokens: torch.Tensor  # [B, N] int64 draft token ids
    scores: torch.Tensor  # [B, N] float32 path log-prob (sum of draft log-probs from the root)
    parent: torch.Tensor  # [B, N] int32 parent node index, -1 for depth-1 nodes
    depth: torch.Tensor  # [B, N] int32 in 1..D
    valid: torch.Tensor  # [B, N] bool
    spine: torch.Tensor  # [B, N] bool, slot 0 of every depth

    @property
    def top_k(self) -> int:
        return int((self.depth[0] == 1).sum()) if self.depth.numel() else 0

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.depth.numel() else 0


class Drafter(Protocol):
    """What grows a tree: an EAGLE-3 head, a small draft model, or a synthetic table in tests.

    `root_logprobs` and `expand` return draft log-probs over the *target* vocabulary. The drafter keeps any
    state it needs (KV cache, hidden states) between the calls of one tree; `expand` receives the tokens and
    parent slots of the frontier so that it can attend along each node's path.
    """

    vocab_size: int

    def root_logprobs(self) -> torch.Tensor:
        """[B, V] log-probs of the first draft token of every request."""
        ...

    def expand(self, frontier_tokens: torch.Tensor, frontier_parent_slots: torch.Tensor, depth: int) -> torch.Tensor:
        """[B, k, V] log-probs of the children of the k frontier nodes at `depth` (their tokens given)."""
        ...


def depth_major_layout(batch: int, max_depth: int, top_k: int, device: torch.device | str = "cpu"):
    """(depth [B, N] int32, spine [B, N] bool) for the fixed layout."""
    num_nodes = max_depth * top_k
    node = torch.arange(num_nodes, device=device)
    depth = (node // top_k + 1).to(torch.int32).expand(batch, num_nodes).contiguous()
    spine = (node % top_k == 0).expand(batch, num_nodes).contiguous()
    return depth, spine
