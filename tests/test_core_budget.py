"""Properties of the elastic budget selection (the spec in echo_vllm/core/budget.py), on grown trees."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.core.budget import (
    CLASS_DEPTH,
    CLASS_EXCLUDED,
    CLASS_WIDTH,
    candidate_class,
    select_budget_reference,
)
from echo_vllm.core.tree import DraftTree, SyntheticDrafter, depth_major_layout, grow_tree

SETTINGS = settings(deadline=None, max_examples=300, database=None, derandomize=True)


@st.composite
def grown_inputs(draw, max_batch: int = 16):
    batch = draw(st.integers(1, max_batch))
    max_depth = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, 4))
    vocab = top_k + draw(st.integers(0, 4))
    seed = draw(st.integers(0, 2**20))
    levels = draw(st.sampled_from([0, 0, 2, 3]))  # quantized logits -> many equal scores
    tree = grow_tree(SyntheticDrafter(batch, vocab, max_depth, seed=seed, levels=levels), batch, max_depth, top_k)
    gen = torch.Generator().manual_seed(seed)
    valid = tree.valid.clone()
    if draw(st.booleans()):  # knock out random subtrees (a child of an invalid node is invalid)
        valid &= torch.rand(valid.shape, generator=gen) > 0.15
        for n in range(valid.shape[1]):
            p = tree.parent[:, n].long()
            valid[:, n] &= torch.where(p >= 0, valid.gather(1, p.clamp(min=0).unsqueeze(1)).squeeze(1), True)
    depth_cap = torch.randint(0, max_depth + 1, (batch,), generator=gen, dtype=torch.int32)
    truncated = torch.rand(batch, generator=gen) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    num = batch * max_depth * top_k
    k_max = draw(st.one_of(st.integers(0, num + 3), st.sampled_from([0, 1, num])))
    tree = tree._replace(valid=valid)
    return tree, depth_cap, truncated, k_max


def run(tree: DraftTree, depth_cap, truncated, k_max):
    return select_budget_reference(
        tree.scores, tree.depth, tree.parent, tree.valid, tree.spine, depth_cap, truncated, k_max
    )


def brute_force_select(scores, depth, valid, spine, depth_cap, truncated, k_max) -> set[tuple[int, int]]:
    """The documented total order, in plain Python."""
    batch, num = scores.shape
    ranked = []
    for b in range(batch):
        for n in range(num):
            s = float(scores[b, n])
            usable = bool(valid[b, n]) and int(depth[b, n]) <= int(depth_cap[b]) and not math.isnan(s)
            if usable and bool(spine[b, n]):
                cls = 0
            elif usable and bool(truncated[b]):
                cls = 1
            else:
                continue
            ranked.append((cls, -s, int(depth[b, n]), b * num + n, (b, n)))
    ranked.sort(key=lambda r: r[:4])
    return {r[4] for r in ranked[:k_max]}


def check_compaction(sel, parent, depth):
    batch, num = sel.selected.shape
    for b in range(batch):
        idx = [n for n in range(num) if sel.selected[b, n]]
        k = len(idx)
        assert int(sel.counts[b]) == k
        assert sel.order[b].tolist() == idx + [-1] * (num - k)
        pos = {n: j for j, n in enumerate(idx)}
        exp_parent = [pos.get(int(parent[b, n]), -1) for n in idx] + [-1] * (num - k)
        assert sel.parent_local[b].tolist() == exp_parent
        assert sel.order_depth[b].tolist() == [int(depth[b, n]) for n in idx] + [0] * (num - k)
    assert sel.counts.dtype == torch.int32 and sel.order.dtype == torch.int32
    assert sel.parent_local.dtype == torch.int32 and sel.order_depth.dtype == torch.int32


@SETTINGS
@given(grown_inputs())
def test_budget_properties_on_grown_trees(inputs):
    tree, depth_cap, truncated, k_max = inputs
    sel = run(tree, depth_cap, truncated, k_max)
    cls = candidate_class(tree.scores, tree.depth, tree.valid, tree.spine, depth_cap, truncated)
    eligible = int((cls != CLASS_EXCLUDED).sum())
    total = int(sel.counts.sum())
    assert total <= k_max
    assert total == min(k_max, eligible)
    assert not bool((sel.selected & (cls == CLASS_EXCLUDED)).any())
    # ancestor closure
    parent = tree.parent.long()
    has_parent = parent >= 0
    parent_sel = sel.selected.gather(1, parent.clamp(min=0))
    assert bool((~sel.selected | ~has_parent | parent_sel).all())
    # Priority 2 only once every depth-eligible node in the batch is in
    if bool((sel.selected & (cls == CLASS_WIDTH)).any()):
        assert bool(sel.selected[cls == CLASS_DEPTH].all())
    check_compaction(sel, tree.parent, tree.depth)
    expected = brute_force_select(tree.scores, tree.depth, tree.valid, tree.spine, depth_cap, truncated, k_max)
    got = {(b, n) for b, n in zip(*torch.nonzero(sel.selected, as_tuple=True), strict=True)}
    assert {(int(b), int(n)) for b, n in got} == expected


@st.composite
def raw_inputs(draw):
    """Arbitrary rows (no tree structure): scores from a tiny set with -0.0/0.0/NaN/-inf to stress the order."""
    batch = draw(st.integers(1, 16))
    num = draw(st.integers(1, 24))
    pool = [0.0, -0.0, -1.0, -1.0, -2.5, float("-inf"), float("nan"), -0.5]
    flat = draw(st.lists(st.sampled_from(pool), min_size=batch * num, max_size=batch * num))
    scores = torch.tensor(flat, dtype=torch.float32).reshape(batch, num)
    depth = torch.tensor(
        draw(st.lists(st.integers(1, 6), min_size=batch * num, max_size=batch * num)), dtype=torch.int32
    ).reshape(batch, num)
    bools = st.lists(st.booleans(), min_size=batch * num, max_size=batch * num)
    valid = torch.tensor(draw(bools)).reshape(batch, num)
    spine = torch.tensor(draw(bools)).reshape(batch, num)
    cap = torch.tensor(draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch)), dtype=torch.int32)
    trunc = torch.tensor(draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
    k_max = draw(st.integers(0, batch * num + 2))
    parent = torch.full((batch, num), -1, dtype=torch.int32)
    return scores, depth, parent, valid, spine, cap, trunc, k_max


@SETTINGS
@given(raw_inputs())
def test_total_order_matches_brute_force_with_ties(inputs):
    scores, depth, parent, valid, spine, cap, trunc, k_max = inputs
    sel = select_budget_reference(scores, depth, parent, valid, spine, cap, trunc, k_max)
    expected = brute_force_select(scores, depth, valid, spine, cap, trunc, k_max)
    got = {(int(b), int(n)) for b, n in torch.nonzero(sel.selected).tolist()}
    assert got == expected
    check_compaction(sel, parent, depth)


@settings(deadline=None, max_examples=250, database=None, derandomize=True)
@given(grown_inputs(max_batch=1), st.integers(0, 6))
def test_single_truncated_request_gets_full_width(inputs, cap):
    tree, _, _, _ = inputs
    tree = tree._replace(valid=torch.ones_like(tree.valid))
    cap = min(cap, tree.max_depth)
    depth_cap = torch.tensor([cap], dtype=torch.int32)
    truncated = torch.tensor([True])
    sel = run(tree, depth_cap, truncated, tree.scores.numel() + 5)
    assert sel.selected[0].tolist() == (tree.depth[0] <= cap).tolist()
    if cap >= 1:  # full width at the truncation depth
        assert int(sel.selected[0][tree.depth[0] == cap].sum()) == tree.top_k
    # not truncated: the same budget only buys the spine (depth extension)
    sel2 = run(tree, depth_cap, torch.tensor([False]), tree.scores.numel() + 5)
    assert sel2.selected[0].tolist() == ((tree.depth[0] <= cap) & tree.spine[0]).tolist()


@settings(deadline=None, max_examples=150, database=None, derandomize=True)
@given(grown_inputs())
def test_zero_budget_selects_nothing(inputs):
    tree, depth_cap, truncated, _ = inputs
    sel = run(tree, depth_cap, truncated, 0)
    assert not bool(sel.selected.any())
    assert bool((sel.counts == 0).all()) and bool((sel.order == -1).all())
    assert bool((sel.parent_local == -1).all()) and bool((sel.order_depth == 0).all())


def _tree_from_probs(probs: list[list[float]], parents: list[list[int]], top_k: int) -> DraftTree:
    scores = torch.log(torch.tensor(probs, dtype=torch.float32))
    batch, num = scores.shape
    depth, spine = depth_major_layout(batch, num // top_k, top_k)
    return DraftTree(
        tokens=torch.arange(num).expand(batch, num).clone(),
        scores=scores,
        parent=torch.tensor(parents, dtype=torch.int32),
        depth=depth,
        valid=torch.ones((batch, num), dtype=torch.bool),
        spine=spine,
    )


def test_doc_example_single_request_truncate_and_widen():
    # docs/algorithm.md, example 1: D = 3, k = 2, gate at depth 2 with tau_2 = 0.3; c_2 = 0.2 closes it.
    tree = _tree_from_probs([[0.5, 0.3, 0.2, 0.15, 0.05, 0.04]], [[-1, -1, 0, 1, 2, 3]], top_k=2)
    cap, trunc = torch.tensor([2], dtype=torch.int32), torch.tensor([True])
    assert run(tree, cap, trunc, 6).selected[0].tolist() == [True, True, True, True, False, False]
    assert run(tree, cap, trunc, 3).selected[0].tolist() == [True, True, True, False, False, False]
    assert run(tree, cap, trunc, 3).order[0].tolist()[:3] == [0, 1, 2]
    # gate open: the request deepens along its spine only
    open_cap, open_trunc = torch.tensor([3], dtype=torch.int32), torch.tensor([False])
    assert run(tree, open_cap, open_trunc, 6).selected[0].tolist() == [True, False, True, False, True, False]


def test_doc_example_saturated_batch():
    # docs/algorithm.md, example 2: B = 3, D = 3, k = 2; request 2 is truncated at depth 2.
    probs = [
        [0.9, 0.05, 0.8, 0.04, 0.7, 0.03],
        [0.8, 0.1, 0.6, 0.05, 0.3, 0.02],
        [0.4, 0.35, 0.2, 0.15, 0.1, 0.05],
    ]
    parents = [[-1, -1, 0, 0, 2, 2], [-1, -1, 0, 0, 2, 2], [-1, -1, 0, 1, 2, 3]]
    tree = _tree_from_probs(probs, parents, top_k=2)
    cap = torch.tensor([3, 3, 2], dtype=torch.int32)
    trunc = torch.tensor([False, False, True])
    sel = run(tree, cap, trunc, 6)
    assert sel.counts.tolist() == [3, 2, 1]
    assert sel.selected.tolist() == [
        [True, False, True, False, True, False],
        [True, False, True, False, False, False],
        [True, False, False, False, False, False],
    ]
    assert run(tree, cap, trunc, 8).counts.tolist() == [3, 3, 2]
    sel9 = run(tree, cap, trunc, 9)
    assert sel9.counts.tolist() == [3, 3, 3] and sel9.selected[2].tolist()[:4] == [True, True, True, False]
    assert run(tree, cap, trunc, 100).counts.tolist() == [3, 3, 4]


def _args(batch=2, num=4):
    depth, spine = depth_major_layout(batch, 2, num // 2)
    return dict(
        scores=torch.zeros(batch, num),
        depth=depth,
        parent=torch.full((batch, num), -1, dtype=torch.int32),
        valid=torch.ones(batch, num, dtype=torch.bool),
        spine=spine,
        depth_cap=torch.full((batch,), 2, dtype=torch.int32),
        truncated=torch.zeros(batch, dtype=torch.bool),
        k_max=3,
    )


@pytest.mark.parametrize(
    "field, value, error, match",
    [
        ("scores", torch.zeros(2, 4, dtype=torch.float64), TypeError, "scores must be float32"),
        ("scores", torch.zeros(8), ValueError, "scores must be"),
        ("depth", torch.ones(2, 4, dtype=torch.int64), TypeError, "depth must be torch.int32"),
        ("parent", torch.zeros(2, 3, dtype=torch.int32), ValueError, "parent must have the shape"),
        ("valid", torch.ones(2, 4, dtype=torch.int32), TypeError, "valid must be torch.bool"),
        ("spine", torch.ones(2, 4), TypeError, "spine must be torch.bool"),
        ("depth_cap", torch.ones(3, dtype=torch.int32), ValueError, "depth_cap must be"),
        ("truncated", torch.zeros(2, dtype=torch.int32), TypeError, "truncated must be"),
        ("k_max", -1, ValueError, "k_max must be an integer >= 0"),
        ("k_max", True, ValueError, "k_max must be an integer"),
        ("k_max", 2.0, ValueError, "k_max must be an integer"),
    ],
)
def test_bad_budget_inputs(field, value, error, match):
    args = _args()
    args[field] = value
    with pytest.raises(error, match=match):
        select_budget_reference(**args)


def test_huge_k_max_selects_every_eligible_node():
    args = _args()
    args["k_max"] = 10**30
    sel = select_budget_reference(**args)
    assert sel.counts.tolist() == [2, 2]  # spine only: nothing truncated


@SETTINGS
@given(grown_inputs())
def test_surplus_tails_brute_force(inputs):
    """Priority 3: leftover budget goes to truncated requests' spines past their cap, best path scores first."""
    from echo_vllm.core.budget import add_surplus_tails
    from echo_vllm.core.gating import Gates

    tree, depth_cap, truncated, k_max = inputs
    base = run(tree, depth_cap, truncated, k_max)
    sel = add_surplus_tails(base, tree, Gates(depth_cap, truncated, truncated), k_max)
    batch, num = tree.scores.shape
    leftover = k_max - int(base.counts.sum())
    tails = sorted(
        (-float(tree.scores[b, n]), int(tree.depth[b, n]), b * num + n, (b, n))
        for b in range(batch)
        for n in range(num)
        if bool(tree.valid[b, n])
        and bool(tree.spine[b, n])
        and bool(truncated[b])
        and int(tree.depth[b, n]) > int(depth_cap[b])
        and not math.isnan(float(tree.scores[b, n]))
    )
    expected = {(int(b), int(n)) for b, n in zip(*torch.nonzero(base.selected, as_tuple=True), strict=True)}
    expected |= {t[3] for t in tails[: max(leftover, 0)]}
    got = {(int(b), int(n)) for b, n in zip(*torch.nonzero(sel.selected, as_tuple=True), strict=True)}
    assert got == expected
    assert int(sel.counts.sum()) <= k_max
    if leftover <= 0:
        assert torch.equal(sel.selected, base.selected)
    parent = tree.parent.long()
    parent_sel = sel.selected.gather(1, parent.clamp(min=0))
    assert bool((~sel.selected | (parent < 0) | parent_sel).all()), "tails must stay ancestor-closed"
    check_compaction(sel, tree.parent, tree.depth)


@SETTINGS
@given(grown_inputs())
def test_verifier_inputs_match_a_walk_up_the_tree(inputs):
    """verifier_inputs: row 0 is the root, rows 1..K_i the selected nodes in order; each row attends to itself
    and exactly its ancestors (a per-node walk up `parent`), positions are depths, padding rows see only
    themselves."""
    from echo_vllm.core.budget import verifier_inputs

    tree, depth_cap, truncated, k_max = inputs
    sel = run(tree, depth_cap, truncated, k_max)
    roots = torch.arange(tree.tokens.shape[0]) + 1000
    got = verifier_inputs(tree, sel, roots)
    batch, num = tree.scores.shape
    assert got.mask.shape == (batch, num + 1, num + 1)
    assert got.num_rows.tolist() == (sel.counts + 1).tolist()
    for b in range(batch):
        order = [int(n) for n in sel.order[b] if int(n) >= 0]
        row_of = {n: i + 1 for i, n in enumerate(order)}
        assert int(got.tokens[b, 0]) == 1000 + b and int(got.positions[b, 0]) == 0
        expected = torch.eye(num + 1, dtype=torch.bool)
        for row, node in enumerate(order, start=1):
            assert int(got.tokens[b, row]) == int(tree.tokens[b, node])
            assert int(got.positions[b, row]) == int(tree.depth[b, node])
            parent = int(tree.parent[b, node])
            assert int(got.parent_rows[b, row]) == (row_of[parent] if parent >= 0 else 0)
            expected[row, 0] = True
            while parent >= 0:
                expected[row, row_of[parent]] = True  # ancestor closure: every ancestor is selected
                parent = int(tree.parent[b, parent])
        assert torch.equal(got.mask[b], expected), f"request {b}"


def test_eagle2_rule_is_a_pure_path_score_rerank():
    """select_eagle2: the K_max best-scoring valid nodes, whatever the spine says (no spine priority)."""
    from echo_vllm.core.gating import Gates
    from echo_vllm.ops import select_budget, select_eagle2

    tree = grow_tree(SyntheticDrafter(2, 6, 3, seed=3), 2, 3, 3)
    k_max = 5
    sel = select_eagle2(tree, k_max)
    flat = [(-float(tree.scores[b, n]), int(tree.depth[b, n]), b * 9 + n) for b in range(2) for n in range(9)]
    best = {idx for *_, idx in sorted(flat)[:k_max]}
    chosen = {int(b) * 9 + int(n) for b, n in zip(*torch.nonzero(sel.selected, as_tuple=True), strict=True)}
    assert chosen == best
    # ECHO's rule with every gate open (no width) takes only spine nodes instead.
    echo = select_budget(tree, Gates.open(2, 3), k_max)
    assert int(echo.selected[tree.spine].sum()) == int(echo.counts.sum()) == min(k_max, int(tree.spine.sum()))
    assert not torch.equal(echo.selected, sel.selected), "the example must tell the two rules apart"
