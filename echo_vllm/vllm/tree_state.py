"""Per-request draft trees in vLLM's ragged draft lists: the plans, one step's tree batch, and its hand-offs.

A tree reaches vLLM's scheduler as a flat draft list in a *spine-first* topological order: the request's spine
(its chain of best children) first, then the other nodes in depth-major order. Every prefix of such a list is
ancestor-closed, so when the scheduler truncates a request's drafts to a prefix (token budget), what it schedules is
still a tree. The proposer keeps each request's topology as a `TreePlan`; the next step checks the plan against
the tokens the scheduler actually scheduled (a mismatch is a bug and raises) and builds the step's `TreeBatch`:

- every draft row keeps its *linear* KV slot (context + 1 + j for draft j), so siblings never collide, but its
  RoPE position is its tree position (context + depth);
- rows whose ancestors are not exactly the rows before them ("fix-up rows": in spine-first order, the non-spine
  nodes) get their attention recomputed under the tree mask by the tree attention backend (`tree_attn_cpu`);
- the tree rejection sampler (`tree_sampler`) walks each tree and writes the accepted path in vLLM's chain format,
  then records which draft positions were accepted, from which the KV compaction of the same step moves the
  accepted path's KV to the slots right after the root (the scheduler's rollback assumes a chain layout).

The batch is published in a module-level holder (`publish` / `current` / `clear`) for the length of one target
forward and its sampling: the attention backend and the sampler read it from there, as they are called deep
inside vLLM with no room for extra arguments. It is cleared before drafting, so the EAGLE head never sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

MAX_TREE_NODES = 63  # ancestor sets travel as int64 bit masks over a request's draft positions


class TreeMismatchError(RuntimeError):
    """The scheduled draft tokens are not a prefix of the plan the proposer made for them (strict mode)."""


@dataclass(frozen=True)
class TreePlan:
    """One request's drafted tree in spine-first topological order.

    tokens[j]: draft token j; parent_local[j]: the position of its parent in this order (-1 = the root, i.e. the
    request's last committed token). Parents precede their children, and the spine (the chain) comes first.
    """

    tokens: tuple[int, ...]
    parent_local: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parent_local):
            raise ValueError(f"TreePlan: {len(self.tokens)} tokens but {len(self.parent_local)} parents")
        if len(self.tokens) > MAX_TREE_NODES:
            raise ValueError(f"TreePlan: {len(self.tokens)} nodes exceed the tree capacity {MAX_TREE_NODES}")

    def validate(self) -> TreePlan:
        """Parents precede their children (the proposer's plans satisfy it by construction; tests check it)."""
        for j, p in enumerate(self.parent_local):
            if not -1 <= p < j:
                raise ValueError(f"TreePlan: node {j} has parent {p}; parents must precede their children")
        return self

    @classmethod
    def chain(cls, tokens: list[int]) -> TreePlan:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def is_chain(self, n: int | None = None) -> bool:
        """Whether the first n nodes (default all) form a chain (each node's parent is the node before it)."""
        parents = self.parent_local if n is None else self.parent_local[:n]
        return all(p == j - 1 for j, p in enumerate(parents))


@dataclass
class TreeBatch:
    """One target forward's trees, over the whole batch (B = num_reqs of the step; requests without drafts have
    num_draft 0). Tensors live on the runner's device; Nmax = the most drafts of one request in this step.

    num_draft [B] int64; parent_local / order_depth / draft_tokens [B, Nmax] int64 (padding: parent -2, depth 0,
    token 0); context_len [B] int64 = the request's computed tokens before this step = the root's position; a
    draft j sits at logical KV position context_len + 1 + j and RoPE position context_len + depth_j.
    root_row [B] int64: the request's first row in the step's flat token order (query_start_loc).
    fix_rows / fix_req / fix_bits [F]: the rows whose attention the tree backend recomputes, their request, and
    the draft positions each may see (bit j = draft j; the row's own bit is set). Every tree row also sees the
    request's logical positions 0..context_len (its context and the root).
    accepted_local [B, Dmax] int64 / accepted_len [B] int64: set by the tree sampler (draft position of the
    accepted node at depth d+1, -1 past the path), read by the KV compaction.
    """

    num_draft: torch.Tensor
    parent_local: torch.Tensor
    order_depth: torch.Tensor
    draft_tokens: torch.Tensor
    context_len: torch.Tensor
    root_row: torch.Tensor
    fix_rows: torch.Tensor
    fix_req: torch.Tensor
    fix_bits: torch.Tensor
    max_depth: int
    draft_rows: np.ndarray = field(repr=False)  # host copy: the flat rows of every draft (positions, compaction)
    tree_positions: np.ndarray = field(repr=False)  # their RoPE positions (context + depth)
    linear_positions: np.ndarray = field(repr=False)  # their linear positions (context + 1 + j), to restore
    accepted_local: torch.Tensor | None = None
    accepted_len: torch.Tensor | None = None
    # Per-step work the attention backend shares across layers (index plans keyed by cache geometry).
    layer_plans: dict = field(default_factory=dict, repr=False)

    @property
    def num_reqs(self) -> int:
        return int(self.num_draft.shape[0])

    @property
    def num_fix_rows(self) -> int:
        return int(self.fix_rows.shape[0])


def build_tree_batch(
    plans: list[TreePlan | None],
    scheduled: list[list[int]],
    context_len: np.ndarray,
    root_row: np.ndarray,
    device: torch.device | str,
    mismatched: list[int] | None = None,
) -> TreeBatch | None:
    """The step's TreeBatch, or None when every scheduled prefix is a chain (the stock chain path is exact then).

    plans[i]: the plan the proposer made for request i of this step's batch; None: no plan (a new or resumed
    request, whose scheduled drafts are the scheduler's placeholders), verified as a chain. scheduled[i]: the draft
    tokens the scheduler scheduled for it, normally a prefix of its plan. vLLM may replace a step's drafts on
    its own (zeros when the batch nears max_model_len, placeholders for resumed requests): a request whose
    scheduled drafts are not a prefix of its plan is verified as a chain, which is exact for any token list, and
    its row is appended to `mismatched`; with `mismatched=None` (tests) it raises TreeMismatchError.
    """
    num_reqs = len(scheduled)
    if len(plans) != num_reqs or len(context_len) < num_reqs or len(root_row) < num_reqs:
        raise ValueError(
            f"build_tree_batch: {len(plans)} plans, {num_reqs} scheduled lists, {len(context_len)} context "
            f"lengths and {len(root_row)} root rows must agree"
        )
    counts = np.array([len(s) for s in scheduled], dtype=np.int64)
    plans = list(plans)  # completed below with the chain plans of unplanned drafts
    tree = False
    for i, drafts in enumerate(scheduled):
        if not drafts:
            continue
        plan = plans[i]
        n = len(drafts)
        if plan is None:  # drafts the proposer did not plan (the scheduler's placeholders): a chain is exact
            plans[i] = TreePlan.chain(list(drafts))
            continue
        if len(plan.tokens) < n or list(plan.tokens[:n]) != list(drafts):
            if mismatched is None:
                raise TreeMismatchError(
                    f"request row {i}: scheduled drafts {list(drafts)[:8]}... are not a prefix of the tree plan "
                    f"{list(plan.tokens)[:8]}..."
                )
            mismatched.append(i)
            plans[i] = TreePlan.chain(list(drafts))
            continue
        tree = tree or not plan.is_chain(n)
    if not tree:
        return None
    width = max(1, int(counts.max()))
    parent = np.full((num_reqs, width), -2, dtype=np.int64)
    tokens = np.zeros((num_reqs, width), dtype=np.int64)
    for i, drafts in enumerate(scheduled):
        n = len(drafts)
        if n:
            plan = plans[i]
            assert plan is not None
            parent[i, :n] = plan.parent_local[:n]
            tokens[i, :n] = drafts
    real = parent >= -1
    depth, bits, pure = tree_columns(parent)
    fix = real & ~pure
    fix_req, fix_pos = np.nonzero(fix)
    root = root_row[:num_reqs].astype(np.int64)
    ctx = context_len[:num_reqs].astype(np.int64)
    req_of, pos_of = np.nonzero(real)
    draft_rows = root[req_of] + 1 + pos_of
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return TreeBatch(
        num_draft=to(counts),
        parent_local=to(parent),
        order_depth=to(depth),
        draft_tokens=to(tokens),
        context_len=to(ctx),
        root_row=to(root),
        fix_rows=to(root[fix_req] + 1 + fix_pos),
        fix_req=to(fix_req.astype(np.int64)),
        fix_bits=to(bits[fix_req, fix_pos]),
        max_depth=int(depth.max()) if depth.size else 0,
        draft_rows=draft_rows,
        tree_positions=ctx[req_of] + depth[req_of, pos_of],
        linear_positions=ctx[req_of] + 1 + pos_of,
    )


def tree_columns(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(depth, ancestor-or-self bits, pure) [B, N] of spine-first parent arrays (padding: parent -2 -> 0, 0,
    False). pure: the row's ancestors are exactly the rows before it (the causal kernel is exact for it).

    Vectorised over the batch and the nodes: pure is a running AND along the row, depth and bits come by walking
    every node's ancestor pointer up one level per round (as many rounds as the deepest node, not one per column:
    the per-column loop cost ~0.3 ms for a 16-node tree on the CPU testbed)."""
    num_reqs, width = parent.shape
    real = parent >= -1
    cols = np.arange(width, dtype=np.int64)
    pure = np.logical_and.accumulate(real & (parent == cols - 1), axis=1)
    own = np.where(real, np.left_shift(np.int64(1), cols), np.int64(0))
    bits = own.copy()
    depth = real.astype(np.int64)
    ancestor = np.where(real, parent, -1)
    rows = np.arange(num_reqs)[:, None]
    for _ in range(width):  # a path has at most `width` nodes (bounded even for a plan that breaks the order)
        up = ancestor >= 0
        if not up.any():
            break
        at = np.clip(ancestor, 0, None)
        bits |= np.where(up, own[rows, at], 0)
        depth += up
        ancestor = np.where(up, parent[rows, at], -1)
    return depth, bits, pure


def compaction_rows(batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) flat rows of the accepted path's KV moves: the accepted node of depth d (draft position a_d)
    moves from row root + 1 + a_d to row root + d, for the nodes not already there. Sources are never earlier
    destinations (a_d >= d - 1, and a descendant sits after its ancestor), so a gather-then-scatter is exact."""
    if batch.accepted_local is None or batch.accepted_len is None:
        raise RuntimeError("compaction_rows: the tree sampler has not recorded the accepted paths")
    acc = batch.accepted_local.long()
    d = torch.arange(acc.shape[1], device=acc.device).unsqueeze(0)
    on_path = d < batch.accepted_len.long().unsqueeze(1)
    moved = on_path & (acc != d)
    root = batch.root_row.unsqueeze(1)
    src = (root + 1 + acc)[moved]
    dst = (root + 1 + d).expand_as(acc)[moved]
    return src, dst


_CURRENT: TreeBatch | None = None


def publish(batch: TreeBatch | None) -> None:
    """Make `batch` this step's tree batch (None clears it)."""
    global _CURRENT
    _CURRENT = batch


def current() -> TreeBatch | None:
    """The tree batch of the target forward running now, or None (chains, prefills, the EAGLE head, dummy runs)."""
    return _CURRENT


def clear() -> None:
    publish(None)
