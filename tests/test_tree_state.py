"""tree_state: the step's TreeBatch from plans and scheduled drafts, and the compaction rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from echo_vllm.vllm.tree_state import (
    TreeBatch,
    TreeMismatchError,
    TreePlan,
    build_tree_batch,
    compaction_rows,
    tree_columns,
)

# Request 0: spine 5 -> 6 -> 7, then 8 (a sibling of 5) and 9 (a sibling of 6). Request 1: nothing. Request 2: a chain.
TREE = TreePlan((5, 6, 7, 8, 9), (-1, 0, 1, -1, 0))


def _batch(plans, scheduled, mismatched=None) -> TreeBatch | None:
    return build_tree_batch(plans, scheduled, np.array([10, 3, 7]), np.array([0, 6, 7]), "cpu", mismatched)


def test_tree_batch_positions_fix_rows_and_ancestor_bits():
    batch = _batch([TREE, None, TreePlan.chain([1, 2])], [[5, 6, 7, 8, 9], [], [1, 2]])
    assert batch is not None
    assert batch.order_depth[0].tolist() == [1, 2, 3, 1, 2]
    assert batch.fix_rows.tolist() == [4, 5] and batch.fix_req.tolist() == [0, 0]  # rows root + 1 + (3, 4)
    assert batch.fix_bits.tolist() == [0b01000, 0b10001]  # node 3 sees itself; node 4 sees node 0 and itself
    assert batch.draft_rows.tolist() == [1, 2, 3, 4, 5, 8, 9]
    assert batch.tree_positions.tolist() == [11, 12, 13, 11, 12, 8, 9]  # context + depth
    assert batch.linear_positions.tolist() == [11, 12, 13, 14, 15, 8, 9]
    assert batch.max_depth == 3


def test_chains_only_need_no_tree_batch_and_unplanned_drafts_are_chains():
    assert _batch([TreePlan.chain([5, 6]), None, None], [[5, 6], [], [1, 2, 3]]) is None
    # A truncated tree whose prefix is the spine is a chain too.
    assert _batch([TREE, None, None], [[5, 6, 7], [], []]) is None


def test_a_scheduled_list_that_is_not_the_plan_verifies_as_a_chain():
    with pytest.raises(TreeMismatchError):
        _batch([TREE, None, None], [[0, 0, 0, 0], [], []])
    mismatched: list[int] = []
    assert _batch([TREE, None, None], [[0, 0, 0, 0], [], []], mismatched) is None
    assert mismatched == [0]
    # Mixed: request 0 mismatches (a chain now), request 2 is a real tree.
    mismatched = []
    batch = _batch([TREE, None, TREE], [[0, 0], [], [5, 6, 7, 8]], mismatched)
    assert mismatched == [0] and batch is not None
    assert batch.parent_local[0, :2].tolist() == [-1, 0] and batch.fix_req.tolist() == [2]


def test_compaction_rows_move_the_accepted_path_next_to_the_root():
    batch = _batch([TREE, None, TreePlan.chain([1, 2])], [[5, 6, 7, 8, 9], [], [1, 2]])
    assert batch is not None
    with pytest.raises(RuntimeError, match="sampler"):
        compaction_rows(batch)
    # Request 0 accepted 5 then 9 (draft positions 0, 4); request 2 its chain (nothing moves).
    batch.accepted_local = torch.tensor([[0, 4, -1], [-1, -1, -1], [0, 1, -1]])
    batch.accepted_len = torch.tensor([2, 0, 2])
    src, dst = compaction_rows(batch)
    assert src.tolist() == [5] and dst.tolist() == [2]


def test_plans_check_their_topology():
    TREE.validate()
    with pytest.raises(ValueError, match="precede"):
        TreePlan((1, 2), (1, -1)).validate()
    with pytest.raises(ValueError, match="capacity"):
        TreePlan(tuple(range(64)), tuple(range(-1, 63)))


def _columns_one_by_one(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference: one column at a time in position order (parents precede their children)."""
    num_reqs, width = parent.shape
    depth, bits = np.zeros_like(parent), np.zeros_like(parent)
    pure = np.zeros(parent.shape, dtype=bool)
    for i in range(num_reqs):
        for j in range(width):
            p = int(parent[i, j])
            if p < -1:
                continue
            depth[i, j] = 1 if p == -1 else depth[i, p] + 1
            bits[i, j] = (0 if p == -1 else bits[i, p]) | (1 << j)
            pure[i, j] = p == j - 1 and (j == 0 or pure[i, j - 1])
    return depth, bits, pure


@pytest.mark.parametrize("seed", range(20))
def test_tree_columns_match_a_node_by_node_walk(seed):
    rng = np.random.default_rng(seed)
    num_reqs, width = int(rng.integers(1, 9)), int(rng.integers(1, 64))
    parent = np.full((num_reqs, width), -2, dtype=np.int64)
    for i in range(num_reqs):
        n = int(rng.integers(0, width + 1))
        spine = int(rng.integers(0, n + 1))  # a chain prefix, then random parents that precede their children
        for j in range(n):
            parent[i, j] = j - 1 if j < spine else int(rng.integers(-1, j))
    got = tree_columns(parent)
    want = _columns_one_by_one(parent)
    for g, w in zip(got, want):
        assert g.tolist() == w.tolist()
