"""Spine-first order of a selection and the spine + sibling tree built from a chain drafter's per-depth top-k."""

from __future__ import annotations

import pytest
import torch

from echo_vllm.core.budget import select_budget_reference
from echo_vllm.core.gating import Gates
from echo_vllm.core.tree import SyntheticDrafter, grow_spine_siblings, grow_tree
from echo_vllm.core.tree_order import spine_first_order, spine_hindsight, spine_sibling_tree


def _select(tree, k_max, batch, max_depth, cap=None, widen=True):
    depth_cap = torch.full((batch,), max_depth if cap is None else cap, dtype=torch.int32)
    truncated = torch.full((batch,), widen, dtype=torch.bool)
    gates = Gates(depth_cap, truncated, truncated)
    return select_budget_reference(
        tree.scores, tree.depth, tree.parent, tree.valid, tree.spine, gates.depth_cap, gates.widen, k_max
    )


@pytest.mark.parametrize("builder", [grow_tree, grow_spine_siblings])
@pytest.mark.parametrize("k_max", [1, 5, 13, 40])
def test_spine_first_order_is_an_ancestor_closed_relisting(builder, k_max):
    batch, depth, top_k = 5, 4, 3
    tree = builder(SyntheticDrafter(batch, 11, depth, seed=3, sharpness=2.0), batch, depth, top_k)
    selection = _select(tree, k_max, batch, depth, cap=3)
    order = spine_first_order(selection, tree)
    assert torch.equal(order.counts, selection.counts.long())
    for b in range(batch):
        n = int(order.counts[b])
        chosen = torch.nonzero(selection.selected[b]).flatten().tolist()
        spine_nodes = [i for i in chosen if bool(tree.spine[b, i])]
        others = [i for i in chosen if not bool(tree.spine[b, i])]
        listed = spine_nodes + others
        assert order.tokens[b, :n].tolist() == [int(tree.tokens[b, i]) for i in listed]
        assert order.depth[b, :n].tolist() == [int(tree.depth[b, i]) for i in listed]
        assert int(order.spine_len[b]) == len(spine_nodes)
        for j, node in enumerate(listed):
            parent = int(tree.parent[b, node])
            expected = -1 if parent < 0 else listed.index(parent)
            assert int(order.parent_local[b, j]) == expected
            assert expected < j  # every prefix is ancestor-closed
        # The spine rows are a chain: causal attention is exact for them.
        assert order.parent_local[b, : len(spine_nodes)].tolist() == list(range(-1, len(spine_nodes) - 1))
        assert (order.parent_local[b, n:] == -1).all() and (order.tokens[b, n:] == 0).all()


def test_spine_sibling_tree_matches_the_core_builder():
    batch, depth, top_k = 4, 5, 3
    ref = grow_spine_siblings(SyntheticDrafter(batch, 13, depth, seed=1, sharpness=1.5), batch, depth, top_k)
    scores = ref.scores.reshape(batch, depth, top_k)
    spine = scores[:, :, 0]
    before = torch.cat([torch.zeros(batch, 1), spine[:, :-1]], dim=1)
    logprobs = scores - before.unsqueeze(2)
    tree = spine_sibling_tree(ref.tokens.reshape(batch, depth, top_k), logprobs)
    for name in ("tokens", "parent", "depth", "valid", "spine"):
        assert torch.equal(getattr(tree, name), getattr(ref, name)), name
    torch.testing.assert_close(tree.scores, ref.scores)


def test_spine_sibling_tree_marks_unusable_rows_and_dead_paths_invalid():
    tokens = torch.arange(2 * 3 * 2).reshape(2, 3, 2)
    logprobs = torch.full((2, 3, 2), -0.5)
    logprobs[0, 1, 0] = float("-inf")  # request 0's spine dies at depth 2: depth 3 hangs off it
    tree = spine_sibling_tree(tokens, logprobs, usable=torch.tensor([True, False]))
    assert tree.valid[0].tolist() == [True, True, False, True, False, False]
    assert not tree.valid[1].any()
    assert tree.parent[0].tolist() == [-1, -1, 0, 0, 2, 2]


def test_spine_hindsight_counts_a_tree_step_as_its_spines_chains():
    """The depth plan's view of a tree step: only spine nodes verified, and a path that left the spine through an
    accepted sibling at depth a counts a - 1 accepted drafts (what the chain would have had)."""
    node_depths = torch.tensor([[1, 2, 3, 1, 2], [1, 2, 0, 0, 0], [1, 2, 1, 0, 0]])  # spine first, then siblings
    spine_len = torch.tensor([3, 2, 2])
    spine_ok = torch.tensor(
        [
            [True, False, False, False],  # spine depth 1 accepted, then the sibling at depth 2 (path length 2)
            [True, True, False, False],  # both spine nodes accepted
            [False, False, False, False],  # the depth-1 sibling accepted: no spine draft
        ]
    )
    accepted, depths = spine_hindsight(node_depths, spine_len, spine_ok)
    assert accepted.tolist() == [1, 2, 0]
    assert depths.tolist() == [[1, 2, 3, 0, 0], [1, 2, 0, 0, 0], [1, 2, 0, 0, 0]]
