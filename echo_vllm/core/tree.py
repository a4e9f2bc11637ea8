"""Batched draft trees in a fixed depth-major layout.

Request b's tree has D depths of `top_k` nodes each: node n sits at depth n // top_k + 1 (depth 1 = the first
draft token) in slot n % top_k. Slot 0 of every depth is the request's *spine*: the chain grown from the best
child of the previous spine node, which is what depth extension adds one node at a time. Parents always have a
smaller index (parent[b, n] < n), as the budget selection requires.
"""

from __future__ import annotations

from collections.abc import Callable
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
        """[B, k, V] log-probs of the children of the k frontier nodes.

        `depth` is the depth of the children being drafted (2..D); the frontier nodes are the k nodes of depth
        `depth - 1`, in slot order. `frontier_tokens` [B, k] int64 are their tokens; `frontier_parent_slots`
        [B, k] int64 is, for each frontier node, the slot (0..k-1) of its parent within depth `depth - 2` (all 0
        for the depth-1 frontier: the root counts as slot 0 of depth 0), so a drafter that keeps per-slot state
        can gather it along the path.
        """
        ...


def depth_major_layout(batch: int, max_depth: int, top_k: int, device: torch.device | str = "cpu"):
    """(depth [B, N] int32, spine [B, N] bool) for the fixed layout."""
    num_nodes = max_depth * top_k
    node = torch.arange(num_nodes, device=device)
    depth = (node // top_k + 1).to(torch.int32).expand(batch, num_nodes).contiguous()
    spine = (node % top_k == 0).expand(batch, num_nodes).contiguous()
    return depth, spine


def topk_stable(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(values, k, dim=-1)` with a deterministic tie rule: equal values come lower index first.

    torch.topk leaves the order (and, at the k-th value, the choice) of ties unspecified, and it differs between
    devices. Here the k-th largest value `thr` is found with torch.topk (its *value* is unambiguous), then the
    chosen set is every entry > thr plus the lowest-indexed entries == thr, and the result is sorted by value
    descending with a stable sort over ascending indices. NaN must be removed by the caller.
    Returns (values [..., k], indices [..., k] int64).
    """
    size = values.shape[-1]
    if k > size:
        raise ValueError(f"top_k={k} exceeds the vocabulary size {size}")
    if k == 1:  # argmax returns the first maximal index: the same tie rule, in one op instead of seven
        index = values.argmax(dim=-1, keepdim=True)
        return torch.gather(values, -1, index), index
    thr = torch.topk(values, k, dim=-1, sorted=True).values[..., -1:]
    index = torch.arange(size, device=values.device, dtype=torch.int32).expand_as(values)
    # Unique int32 keys: entries above thr first (in index order), then entries equal to thr, then the rest.
    key = torch.where(values > thr, index - size, torch.where(values == thr, index, index + size))
    chosen = torch.topk(key, k, dim=-1, largest=False, sorted=True).values
    chosen = torch.where(chosen < 0, chosen + size, chosen).to(torch.int64)  # ascending within each group
    chosen = torch.sort(chosen, dim=-1).values  # ascending node index overall
    chosen_values = torch.gather(values, -1, chosen)
    perm = torch.sort(chosen_values, dim=-1, descending=True, stable=True).indices
    return torch.gather(chosen_values, -1, perm), torch.gather(chosen, -1, perm)


def _checked_root(drafter: Drafter, batch: int, max_depth: int, top_k: int) -> torch.Tensor:
    """The arguments of a tree builder checked, and the drafter's cleaned root log-probs [B, V]."""
    if max_depth < 1 or top_k < 1:
        raise ValueError(f"max_depth and top_k must be >= 1; got max_depth={max_depth}, top_k={top_k}")
    if drafter.vocab_size < top_k:
        raise ValueError(f"top_k={top_k} exceeds the drafter vocabulary ({drafter.vocab_size})")
    root = _clean_logprobs(drafter.root_logprobs())
    if root.dim() != 2 or root.shape[0] != batch:
        raise ValueError(f"root_logprobs must be [B={batch}, V]; got {tuple(root.shape)}")
    return root


def _clean_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """float32, NaN -> -inf, and clamped to <= 0 so that path scores never increase along a path."""
    logprobs = logprobs.to(torch.float32)
    logprobs = torch.nan_to_num(logprobs, nan=float("-inf"), posinf=0.0, neginf=float("-inf"))
    return logprobs.clamp(max=0.0)


def grow_tree(
    drafter: Drafter,
    batch: int,
    max_depth: int,
    top_k: int,
    stop_after: Callable[[int, torch.Tensor], bool] | None = None,
) -> DraftTree:
    """Grow a [B, max_depth * top_k] draft tree in the depth-major layout (no per-request Python loops).

    Depth 1: the top_k tokens of `drafter.root_logprobs()` (slot 0 = argmax). Depth d > 1: every frontier node
    (the top_k nodes of depth d-1) is expanded with `drafter.expand`; child score = parent path score + log-prob.
    Of each frontier node's children only its top_k are candidates (top_k * top_k in all). Slot 0 of depth d is
    the best child of the depth-(d-1) spine node (slot 0); slots 1..top_k-1 are the best top_k-1 of the other
    candidates. Siblings therefore carry distinct tokens.

    Tie rules (deterministic on every device): within one node's children, equal log-probs -> lower token id first
    (`topk_stable`); among the candidates of a depth, equal scores -> lower candidate index first, where candidate
    index = frontier slot * top_k + child rank. Slots are filled in descending score order.

    Log-probs are cleaned first: NaN -> -inf and values > 0 clamped to 0 (so a child never scores above its
    parent, which the budget selection's ancestor closure relies on). A node is valid iff its score is finite;
    a node with a -inf score (zero draft probability, or under an invalid parent) is invalid.

    `stop_after(depth, scores [B, k])`, if given, is asked after each depth < max_depth whether drafting deeper is
    useless (e.g. every request's gate has closed); the remaining depths are then filled with invalid nodes, so
    the tree keeps its shape. It costs a host sync per depth: the HF engine (B = 1) uses it, batched paths don't.
    """
    root = _checked_root(drafter, batch, max_depth, top_k)
    device = root.device
    scores, tokens = topk_stable(root, top_k)  # [B, k]
    all_tokens = [tokens]
    all_scores = [scores]
    all_parents = [torch.full((batch, top_k), -1, dtype=torch.int32, device=device)]
    parent_slots = torch.zeros((batch, top_k), dtype=torch.int64, device=device)  # the root is slot 0 of depth 0
    num_cand = top_k * top_k
    for depth in range(2, max_depth + 1):
        if stop_after is not None and stop_after(depth - 1, scores):
            _pad_invalid(all_tokens, all_scores, all_parents, depth, max_depth, batch, top_k, device)
            break
        logp = _clean_logprobs(drafter.expand(tokens, parent_slots, depth))
        if logp.shape[:2] != (batch, top_k) or logp.dim() != 3:
            raise ValueError(f"expand must return [B={batch}, k={top_k}, V]; got {tuple(logp.shape)}")
        child_logp, child_tok = topk_stable(logp, top_k)  # [B, k, k]
        cand_scores = (scores.unsqueeze(2) + child_logp).reshape(batch, num_cand)
        cand_tokens = child_tok.reshape(batch, num_cand)
        # Candidate 0 is the spine child (best child of slot 0); the best k-1 of the others fill slots 1..k-1.
        rest_scores = cand_scores[:, 1:]
        perm = torch.sort(rest_scores, dim=1, descending=True, stable=True).indices[:, : top_k - 1] + 1
        pick = torch.cat([torch.zeros((batch, 1), dtype=perm.dtype, device=device), perm], dim=1)  # [B, k]
        scores = torch.gather(cand_scores, 1, pick)
        tokens = torch.gather(cand_tokens, 1, pick)
        parent_slots = pick // top_k
        all_tokens.append(tokens)
        all_scores.append(scores)
        all_parents.append((parent_slots + (depth - 2) * top_k).to(torch.int32))
    return _assemble(all_tokens, all_scores, all_parents, batch, max_depth, top_k, device)


def grow_spine_siblings(drafter: Drafter, batch: int, max_depth: int, top_k: int) -> DraftTree:
    """The spine plus its sibling leaves, in the depth-major layout of `grow_tree` (issue #13, Stage 0).

    Only the spine is expanded (one frontier node per depth: the head forwards of a chain); at each depth the top_k
    children of the spine node are kept: slot 0 (the best) continues the spine, slots 1..top_k-1 are leaves. This
    is what a chain drafter gets for free from the distributions it already computes, as opposed to a full tree
    (`grow_tree`), which expands top_k frontier nodes per depth. Same tie rules and log-prob cleaning as
    `grow_tree`; slot 0 of depth d is `grow_tree`'s spine node of depth d.
    """
    root = _checked_root(drafter, batch, max_depth, top_k)
    device = root.device
    scores, tokens = topk_stable(root, top_k)
    all_tokens, all_scores = [tokens], [scores]
    all_parents = [torch.full((batch, top_k), -1, dtype=torch.int32, device=device)]
    spine_slot = torch.zeros((batch, 1), dtype=torch.int64, device=device)
    for depth in range(2, max_depth + 1):
        logp = _clean_logprobs(drafter.expand(tokens[:, :1], spine_slot, depth))
        if logp.shape[:2] != (batch, 1) or logp.dim() != 3:
            raise ValueError(f"expand must return [B={batch}, 1, V] for a one-node frontier; got {tuple(logp.shape)}")
        child_logp, tokens = topk_stable(logp[:, 0], top_k)
        scores = scores[:, :1] + child_logp
        all_tokens.append(tokens)
        all_scores.append(scores)
        all_parents.append(torch.full((batch, top_k), (depth - 2) * top_k, dtype=torch.int32, device=device))
    return _assemble(all_tokens, all_scores, all_parents, batch, max_depth, top_k, device)


def _assemble(all_tokens, all_scores, all_parents, batch, max_depth, top_k, device) -> DraftTree:
    """The per-depth [B, k] pieces of a tree builder as one depth-major DraftTree (valid = finite score)."""
    tree_scores = torch.cat(all_scores, dim=1)
    depth_t, spine = depth_major_layout(batch, max_depth, top_k, device)
    return DraftTree(
        tokens=torch.cat(all_tokens, dim=1),
        scores=tree_scores,
        parent=torch.cat(all_parents, dim=1),
        depth=depth_t,
        valid=torch.isfinite(tree_scores),
        spine=spine,
    )


def _pad_invalid(all_tokens, all_scores, all_parents, first_depth, max_depth, batch, top_k, device) -> None:
    """Fill depths first_depth..max_depth with invalid nodes hanging off the previous depth's slots."""
    for depth in range(first_depth, max_depth + 1):
        all_tokens.append(torch.zeros((batch, top_k), dtype=torch.int64, device=device))
        all_scores.append(torch.full((batch, top_k), float("-inf"), dtype=torch.float32, device=device))
        slots = torch.arange(top_k, dtype=torch.int32, device=device).expand(batch, top_k)
        all_parents.append(slots + (depth - 2) * top_k)


class SyntheticDrafter:
    """A fixed random drafter for tests: log-probs depend on (request, depth, parent token).

    root_logprobs()[b] = log_softmax(sharpness * R[b]); expand(tokens, slots, d)[b, j] =
    log_softmax(sharpness * T[d, b % variants, tokens[b, j]]), with R and T drawn once from `seed`.
    `levels` > 0 quantizes the logits to that many integer levels, which makes many log-probs (and path scores)
    exactly equal, to exercise tie rules.
    """

    def __init__(
        self,
        batch: int,
        vocab_size: int,
        max_depth: int,
        seed: int = 0,
        sharpness: float = 1.0,
        levels: int = 0,
        variants: int = 3,
        device: torch.device | str = "cpu",
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.batch = batch
        self.variants = variants
        root = torch.randn(batch, vocab_size, generator=gen)
        table = torch.randn(max_depth + 1, variants, vocab_size, vocab_size, generator=gen)
        if levels > 0:
            root = torch.randint(0, levels, root.shape, generator=gen).float()
            table = torch.randint(0, levels, table.shape, generator=gen).float()
        self._root = torch.log_softmax(sharpness * root, dim=-1).to(device)
        self._table = torch.log_softmax(sharpness * table, dim=-1).to(device)
        self._variant = (torch.arange(batch) % variants).to(device)
        self.calls: list[tuple[int, torch.Tensor]] = []

    def root_logprobs(self) -> torch.Tensor:
        return self._root

    def expand(self, frontier_tokens: torch.Tensor, frontier_parent_slots: torch.Tensor, depth: int) -> torch.Tensor:
        self.calls.append((depth, frontier_parent_slots.clone()))
        variant = self._variant.unsqueeze(1).expand_as(frontier_tokens)
        return self._table[depth, variant, frontier_tokens]

    def child_logprobs(self, batch_index: int, depth: int, parent_token: int) -> torch.Tensor:
        """[V] log-probs of the children (at `depth`) of a node with token `parent_token` (for brute force)."""
        if depth == 1:
            return self._root[batch_index]
        return self._table[depth, batch_index % self.variants, parent_token]
