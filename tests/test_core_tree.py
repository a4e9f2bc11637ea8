"""grow_tree / topk_stable / SyntheticDrafter against a brute-force Python reimplementation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.core.tree import (
    DraftTree,
    SyntheticDrafter,
    depth_major_layout,
    grow_spine_siblings,
    grow_tree,
    topk_stable,
)

SETTINGS = settings(deadline=None, max_examples=80, database=None, derandomize=True)


def f32_add(a: float, b: float) -> float:
    return float(torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32))


def _children(drafter: SyntheticDrafter, b: int, depth: int, parent_token: int, top_k: int):
    """The top_k (log-prob, token) children of a node, ties -> lower token id."""
    logp = drafter.child_logprobs(b, depth, parent_token).clamp(max=0.0).tolist()
    ranked = sorted(range(len(logp)), key=lambda t: (-logp[t], t))[:top_k]
    return [(logp[t], t) for t in ranked]


def brute_force_tree(drafter: SyntheticDrafter, batch: int, max_depth: int, top_k: int):
    """Per-request Python version of the documented growth rule; returns lists tokens/scores/parents."""
    out = []
    for b in range(batch):
        level = [(lp, tok, -1) for lp, tok in _children(drafter, b, 1, -1, top_k)]
        tokens, scores, parents = [], [], []
        for depth in range(1, max_depth + 1):
            if depth > 1:
                cands = []  # (score, candidate index, token, parent slot)
                for slot, (ps, ptok, _) in enumerate(level):
                    for rank, (lp, tok) in enumerate(_children(drafter, b, depth, ptok, top_k)):
                        cands.append((f32_add(ps, lp), slot * top_k + rank, tok, slot))
                spine = cands[0]
                rest = sorted(cands[1:], key=lambda c: (-c[0], c[1]))[: top_k - 1]
                level = [(c[0], c[2], (depth - 2) * top_k + c[3]) for c in [spine, *rest]]
            for score, tok, par in level:
                tokens.append(tok)
                scores.append(score)
                parents.append(par)
        out.append((tokens, scores, parents))
    return out


@SETTINGS
@given(
    batch=st.integers(1, 5),
    max_depth=st.integers(1, 5),
    top_k=st.integers(1, 4),
    extra_vocab=st.integers(0, 5),
    seed=st.integers(0, 10_000),
    levels=st.sampled_from([0, 2, 3]),
)
def test_grow_tree_matches_brute_force(batch, max_depth, top_k, extra_vocab, seed, levels):
    vocab = top_k + extra_vocab
    drafter = SyntheticDrafter(batch, vocab, max_depth, seed=seed, levels=levels)
    tree = grow_tree(drafter, batch, max_depth, top_k)
    expected = brute_force_tree(drafter, batch, max_depth, top_k)
    for b, (tokens, scores, parents) in enumerate(expected):
        assert tree.tokens[b].tolist() == tokens
        assert tree.scores[b].tolist() == scores
        assert tree.parent[b].tolist() == parents
    depth, spine = depth_major_layout(batch, max_depth, top_k)
    assert torch.equal(tree.depth, depth) and torch.equal(tree.spine, spine)
    assert tree.scores.dtype == torch.float32 and tree.parent.dtype == torch.int32
    assert tree.top_k == top_k and tree.max_depth == max_depth
    # parents precede children; siblings have distinct tokens; scores never increase along a path
    n = torch.arange(max_depth * top_k)
    assert bool((tree.parent < n).all())
    for b in range(batch):
        seen = {}
        for i in range(max_depth * top_k):
            key = (int(tree.parent[b, i]), int(tree.tokens[b, i]))
            assert key not in seen, "duplicate sibling token"
            seen[key] = i
            p = int(tree.parent[b, i])
            if p >= 0:
                assert float(tree.scores[b, i]) <= float(tree.scores[b, p])
    # the expand calls received the frontier's parent slots (root = slot 0)
    assert [d for d, _ in drafter.calls] == list(range(2, max_depth + 1))
    for d, slots in drafter.calls:
        if d == 2:
            assert bool((slots == 0).all())
        else:
            frontier = slice((d - 2) * top_k, (d - 1) * top_k)
            assert torch.equal(slots, tree.parent[:, frontier].long() - (d - 3) * top_k)


def test_spine_is_best_child_of_spine():
    drafter = SyntheticDrafter(4, 12, 4, seed=3, sharpness=2.0)
    tree = grow_tree(drafter, 4, 4, 3)
    for b in range(4):
        for d in range(2, 5):
            node = (d - 1) * 3
            parent = int(tree.parent[b, node])
            assert parent == (d - 2) * 3
            logp = drafter.child_logprobs(b, d, int(tree.tokens[b, parent]))
            assert int(tree.tokens[b, node]) == int(torch.argmax(logp))


class _TableDrafter:
    def __init__(self, root: torch.Tensor, child: torch.Tensor) -> None:
        self.vocab_size = root.shape[1]
        self._root, self._child = root, child

    def root_logprobs(self) -> torch.Tensor:
        return self._root

    def expand(self, frontier_tokens, frontier_parent_slots, depth):
        return self._child[frontier_tokens]


def test_zero_probability_and_nan_children_are_invalid():
    inf = float("inf")
    root = torch.tensor([[-0.1, -2.5, -inf, -inf], [float("nan"), -0.5, -1.0, -inf]])
    child = torch.log(torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 4))  # one possible child per node
    tree = grow_tree(_TableDrafter(root, child), 2, 2, 3)
    assert tree.valid[0].tolist() == [True, True, False, True, True, False]
    assert tree.valid[1].tolist() == [True, True, False, True, True, False]
    assert tree.tokens[:, 3:5].tolist() == [[0, 0], [0, 0]]
    assert tree.parent[:, 3:5].tolist() == [[0, 1], [0, 1]]
    assert not bool(torch.isnan(tree.scores).any())
    # an invalid parent has only invalid children
    for b in range(2):
        for i in range(3, 6):
            p = int(tree.parent[b, i])
            if not tree.valid[b, p]:
                assert not tree.valid[b, i]


def test_positive_logprobs_are_clamped():
    root = torch.tensor([[0.3, -1.0]])
    child = torch.tensor([[0.2, -0.5], [0.1, -0.7]])
    tree = grow_tree(_TableDrafter(root, child), 1, 2, 2)
    assert float(tree.scores.max()) <= 0.0


def test_topk_stable_ties_lower_index_first():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    values, index = topk_stable(x, 4)
    assert index.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]
    assert values.tolist() == [[3.0, 3.0, 3.0, 2.0], [5.0] * 4]
    big = torch.zeros(3, 1000)
    assert topk_stable(big, 5)[1].tolist() == [[0, 1, 2, 3, 4]] * 3


def test_bad_arguments():
    drafter = SyntheticDrafter(2, 3, 2)
    with pytest.raises(ValueError, match="top_k"):
        grow_tree(drafter, 2, 2, 4)
    with pytest.raises(ValueError, match="max_depth"):
        grow_tree(drafter, 2, 0, 2)
    with pytest.raises(ValueError, match="root_logprobs"):
        grow_tree(drafter, 3, 2, 2)


def test_large_batch_shapes():
    drafter = SyntheticDrafter(256, 50, 6, seed=1)
    tree = grow_tree(drafter, 256, 6, 4)
    assert isinstance(tree, DraftTree)
    assert tree.tokens.shape == (256, 24) and bool(tree.valid.all())


def test_stop_after_keeps_shape_and_invalidates_deeper_depths():
    batch, max_depth, top_k = 3, 5, 2
    full = grow_tree(SyntheticDrafter(batch, 9, max_depth, seed=4), batch, max_depth, top_k)
    asked = []

    def stop(depth, scores):
        asked.append((depth, tuple(scores.shape)))
        return depth == 2

    cut = grow_tree(SyntheticDrafter(batch, 9, max_depth, seed=4), batch, max_depth, top_k, stop_after=stop)
    assert asked == [(1, (batch, top_k)), (2, (batch, top_k))]
    assert cut.tokens.shape == full.tokens.shape
    kept = 2 * top_k
    assert torch.equal(cut.tokens[:, :kept], full.tokens[:, :kept])
    assert torch.equal(cut.scores[:, :kept], full.scores[:, :kept])
    assert not cut.valid[:, kept:].any()
    assert (cut.parent[:, kept:] < torch.arange(kept, max_depth * top_k)).all()  # still topologically numbered


@pytest.mark.parametrize(("batch", "max_depth", "top_k", "seed"), [(1, 4, 3, 0), (3, 5, 4, 1), (2, 1, 2, 2)])
def test_spine_siblings_tree_is_the_spine_and_its_leaves(batch, max_depth, top_k, seed):
    """grow_spine_siblings: slot 0 is grow_tree's spine; slots 1..k-1 of depth d are the spine node's next-best
    children (leaves); only the spine is expanded (one frontier node per head call)."""
    vocab = 12
    full = grow_tree(SyntheticDrafter(batch, vocab, max_depth, seed=seed), batch, max_depth, top_k)
    drafter = SyntheticDrafter(batch, vocab, max_depth, seed=seed)
    tree = grow_spine_siblings(drafter, batch, max_depth, top_k)
    assert tree.tokens.shape == full.tokens.shape and torch.equal(tree.depth, full.depth)
    assert torch.equal(tree.spine, full.spine)
    spine = tree.spine[0]
    assert torch.equal(tree.tokens[:, spine], full.tokens[:, spine])
    assert torch.allclose(tree.scores[:, spine], full.scores[:, spine])
    assert all(slots.shape[1] == 1 for _, slots in drafter.calls)  # one frontier node per expansion
    for b in range(batch):
        for d in range(1, max_depth + 1):
            first = (d - 1) * top_k
            parent = -1 if d == 1 else (d - 2) * top_k
            assert tree.parent[b, first : first + top_k].tolist() == [parent] * top_k
            parent_token = None if d == 1 else int(tree.tokens[b, parent])
            logp = drafter.child_logprobs(b, d, parent_token if parent_token is not None else 0)
            base = 0.0 if d == 1 else float(tree.scores[b, parent])
            best = torch.sort(logp, descending=True, stable=True)
            assert tree.tokens[b, first : first + top_k].tolist() == best.indices[:top_k].tolist()
            assert torch.allclose(tree.scores[b, first : first + top_k], base + best.values[:top_k])
