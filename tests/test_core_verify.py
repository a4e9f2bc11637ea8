"""Tree verification: greedy against a per-request walk; sampling against the target by chi-square tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.core.budget import compact_selection, select_budget_reference
from echo_vllm.core.tree import SyntheticDrafter, grow_tree
from echo_vllm.core.verify import _verify_sampling_impl, verify_greedy, verify_sampling

SETTINGS = settings(deadline=None, max_examples=200, database=None, derandomize=True)


def children_of(selection, b, pos):
    """Positions in order[b] of the selected children of position `pos` (-1 = root), ascending."""
    count = int(selection.counts[b])
    return [j for j in range(count) if int(selection.parent_local[b, j]) == pos]


def walk_greedy(tokens, selection, argmax, b):
    pos, path = -1, []
    while True:
        row = pos + 1
        nxt = [
            j
            for j in children_of(selection, b, pos)
            if int(tokens[b, int(selection.order[b, j])]) == int(argmax[b, row])
        ]
        assert len(nxt) <= 1
        if not nxt:
            return path, int(argmax[b, row])
        pos = nxt[0]
        path.append(pos)


@st.composite
def verify_case(draw):
    batch = draw(st.integers(1, 12))
    max_depth = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, 4))
    vocab = top_k + draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**20))
    tree = grow_tree(
        SyntheticDrafter(batch, vocab, max_depth, seed=seed, levels=draw(st.sampled_from([0, 3]))),
        batch,
        max_depth,
        top_k,
    )
    gen = torch.Generator().manual_seed(seed)
    cap = torch.randint(0, max_depth + 1, (batch,), generator=gen, dtype=torch.int32)
    trunc = torch.rand(batch, generator=gen) < 0.6
    k_max = draw(st.integers(0, tree.scores.numel()))
    sel = select_budget_reference(tree.scores, tree.depth, tree.parent, tree.valid, tree.spine, cap, trunc, k_max)
    num = tree.scores.shape[1]
    # target argmax: mostly the token of some selected child of the row's node, so paths get accepted
    argmax = torch.randint(0, vocab, (batch, num + 1), generator=gen)
    order_tokens = torch.gather(tree.tokens, 1, sel.order.long().clamp(min=0))
    for b in range(batch):
        for row in range(num + 1):
            kids = children_of(sel, b, row - 1)
            if kids and float(torch.rand(1, generator=gen)) < 0.8:
                pick = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                argmax[b, row] = order_tokens[b, pick]
    return tree, sel, argmax, max_depth


@SETTINGS
@given(verify_case())
def test_greedy_matches_per_request_walk(case):
    tree, sel, argmax, max_depth = case
    res = verify_greedy(tree.tokens, sel, argmax, max_depth=max_depth)
    batch = tree.tokens.shape[0]
    for b in range(batch):
        path, bonus = walk_greedy(tree.tokens, sel, argmax, b)
        assert int(res.accepted_len[b]) == len(path)
        assert res.accepted_local[b].tolist() == path + [-1] * (max_depth - len(path))
        toks = [int(tree.tokens[b, int(sel.order[b, j])]) for j in path]
        assert res.accepted_tokens[b].tolist() == toks + [bonus] + [-1] * (max_depth - len(path))
        assert int(res.bonus[b]) == bonus and int(res.num_emitted[b]) == len(path) + 1
        assert res.accepted_depth_mask[b].tolist() == [d < len(path) for d in range(max_depth)]
    # the default max_depth is the deepest selected depth
    res2 = verify_greedy(tree.tokens, sel, argmax)
    width = int(sel.order_depth.max())
    assert torch.equal(res2.accepted_local, res.accepted_local[:, :width])
    assert torch.equal(res2.accepted_len, res.accepted_len)
    # sampling with one-hot targets is greedy
    onehot = torch.nn.functional.one_hot(argmax, num_classes=int(tree.tokens.max()) + 1 + int(argmax.max())).float()
    res3 = verify_sampling(tree.tokens, sel, onehot, torch.Generator().manual_seed(0), max_depth=max_depth)
    for name in ("accepted_len", "accepted_local", "accepted_tokens", "bonus", "accepted_depth_mask"):
        assert torch.equal(getattr(res3, name), getattr(res, name)), name


# ---------------------------------------------------------------------------------------------------------------
# Sampling: exactness by chi-square
# ---------------------------------------------------------------------------------------------------------------

V = 6


def chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square test; cells with expected count < 5 are pooled. Survival via gammaincc."""
    n = observed.sum()
    expected = expected_p.double() * n
    assert float(observed[expected_p == 0].sum()) == 0, "a zero-probability outcome was emitted"
    small = expected < 5
    obs = torch.cat([observed[~small].double(), observed[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def target_model(seed: int):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(torch.randn(V, generator=gen), 0)
    p0[5] = 0.0  # one impossible token: a draft of it must always be rejected
    p0 = p0 / p0.sum()
    nxt = torch.softmax(0.7 * torch.randn(V, V, generator=gen), 1)  # row after token t
    return p0, nxt


# (tokens, parents, selected): one small tree each, repeated over the batch
SHAPES = {
    "chain": ([2, 0, 3], [-1, 0, 1], [True, True, True]),  # k = 1, D = 3
    "wide": ([0, 1, 2, 5], [-1, -1, -1, -1], [True, True, True, True]),  # k = 4, D = 1
    "mixed": ([1, 0, 4, 2, 3, 0], [-1, -1, -1, 0, 0, 1], [True, True, True, True, True, False]),  # k = 3, D = 2
    "unlikely": ([5, 4, 1, 5], [-1, -1, 0, 1], [True, True, True, True]),  # k = 2, D = 2
}


def run_shape(shape: str, batch: int, seed: int, zero_rejected: bool = True):
    tokens, parents, selected = SHAPES[shape]
    num = len(tokens)
    depth = [1] * num
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
    tree_tokens = torch.tensor(tokens).expand(batch, num).contiguous()
    sel = compact_selection(
        torch.tensor(selected).expand(batch, num).contiguous(),
        torch.tensor(depth, dtype=torch.int32).expand(batch, num).contiguous(),
        torch.tensor(parents, dtype=torch.int32).expand(batch, num).contiguous(),
    )
    p0, nxt = target_model(seed)
    order_tokens = torch.gather(tree_tokens, 1, sel.order.long().clamp(min=0))
    probs = torch.cat([p0.expand(batch, 1, V), nxt[order_tokens]], 1)  # rows: root, then each node in order
    gen = torch.Generator().manual_seed(1234 + seed)
    res = _verify_sampling_impl(tree_tokens, sel, probs, gen, max(depth), None, zero_rejected)
    return res, p0, nxt, gen


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_first_token_matches_target(shape):
    res, p0, _, _ = run_shape(shape, 20_000, seed=3)
    first = res.accepted_tokens[:, 0]
    assert bool((first >= 0).all())
    counts = torch.bincount(first, minlength=V)
    assert chi2_pvalue(counts, p0) > 1e-4


@pytest.mark.parametrize("shape", ["chain", "mixed", "unlikely"])
def test_first_two_tokens_match_target(shape):
    res, p0, nxt, gen = run_shape(shape, 20_000, seed=5)
    t1 = res.accepted_tokens[:, 0]
    # when only one token was emitted, the next step samples t2 from the target's row after t1
    fresh = torch.multinomial(nxt[t1], 1, generator=gen).squeeze(1)
    t2 = torch.where(res.num_emitted >= 2, res.accepted_tokens[:, 1], fresh)
    counts = torch.bincount(t1 * V + t2, minlength=V * V)
    joint = (p0.unsqueeze(1) * nxt).reshape(-1)
    assert chi2_pvalue(counts, joint) > 1e-4
    assert bool((res.num_emitted >= 2).any()) and bool((res.num_emitted == 1).any())


@pytest.mark.parametrize("shape", ["wide", "mixed"])
def test_broken_residual_fails_the_same_test(shape):
    res, p0, _, _ = run_shape(shape, 20_000, seed=3, zero_rejected=False)
    counts = torch.bincount(res.accepted_tokens[:, 0], minlength=V)
    assert chi2_pvalue(counts, p0) < 1e-6


def test_sampling_result_layout():
    res, _, _, _ = run_shape("mixed", 500, seed=1)
    assert res.accepted_local.shape == (500, 2) and res.accepted_tokens.shape == (500, 3)
    assert torch.equal(res.num_emitted, res.accepted_len + 1)
    assert torch.equal(res.accepted_depth_mask, res.accepted_local >= 0)
    rows = torch.arange(500)
    assert torch.equal(res.accepted_tokens[rows, res.accepted_len.long()], res.bonus)
    # the accepted path is a chain: the depth-2 node's parent is the depth-1 node
    deep = res.accepted_len == 2
    sel_parent = torch.tensor([-1, -1, -1, 0, 0])  # parent_local of the compacted "mixed" tree
    assert torch.equal(sel_parent[res.accepted_local[deep, 1].long()], res.accepted_local[deep, 0].long())


def test_bad_verify_inputs():
    res_tokens = torch.zeros(2, 3, dtype=torch.int64)
    sel = compact_selection(
        torch.ones(2, 3, dtype=torch.bool),
        torch.ones(2, 3, dtype=torch.int32),
        torch.full((2, 3), -1, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="target_argmax"):
        verify_greedy(res_tokens, sel, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_probs"):
        verify_sampling(res_tokens, sel, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="selection"):
        verify_greedy(torch.zeros(2, 5, dtype=torch.int64), sel, torch.zeros(2, 6, dtype=torch.int64))


def test_empty_selection_emits_one_token():
    tokens = torch.zeros(3, 4, dtype=torch.int64)
    sel = compact_selection(
        torch.zeros(3, 4, dtype=torch.bool),
        torch.ones(3, 4, dtype=torch.int32),
        torch.full((3, 4), -1, dtype=torch.int32),
    )
    argmax = torch.tensor([[2, 0, 0, 0, 0]] * 3)
    res = verify_greedy(tokens, sel, argmax, max_depth=2)
    assert res.accepted_tokens.tolist() == [[2, -1, -1]] * 3 and res.num_emitted.tolist() == [1, 1, 1]
    probs = torch.nn.functional.one_hot(argmax, 4).float()
    res = verify_sampling(tokens, sel, probs, torch.Generator().manual_seed(0))
    assert res.accepted_tokens.tolist() == [[2]] * 3


# ---------------------------------------------------------------------------------------------------------------
# Flat rows (row_index) == dense rows
# ---------------------------------------------------------------------------------------------------------------


def flat_layout(dense: torch.Tensor, counts: torch.Tensor, gen: torch.Generator):
    """Each request's counts[b] + 1 real rows of `dense` [B, N + 1, ...] packed ragged into one flat tensor, with a
    junk row before every request; row_index points padding entries at a junk row (never read)."""
    batch = dense.shape[0]
    pieces, index, offset = [], torch.zeros((batch, dense.shape[1]), dtype=torch.int64), 0
    for b in range(batch):
        junk = offset
        real = int(counts[b]) + 1
        if dense.dim() == 3:
            pieces.append(torch.rand((1,) + dense.shape[2:], generator=gen))
        else:
            pieces.append(torch.randint(0, 50, (1,), generator=gen))
        pieces.append(dense[b, :real])
        index[b] = junk
        index[b, :real] = torch.arange(offset + 1, offset + 1 + real)
        offset += 1 + real
    return torch.cat(pieces, 0), index


@settings(deadline=None, max_examples=60, database=None, derandomize=True)
@given(verify_case())
def test_flat_rows_match_dense(case):
    tree, sel, argmax, max_depth = case
    gen = torch.Generator().manual_seed(7)
    flat_argmax, index = flat_layout(argmax, sel.counts, gen)
    dense = verify_greedy(tree.tokens, sel, argmax, max_depth=max_depth)
    flat = verify_greedy(tree.tokens, sel, flat_argmax, max_depth=max_depth, row_index=index)
    for name in dense._fields:
        assert torch.equal(getattr(flat, name), getattr(dense, name)), name
    vocab = int(tree.tokens.max()) + 3
    probs = torch.softmax(2 * torch.randn(argmax.shape + (vocab,), generator=gen), -1)
    flat_probs, index = flat_layout(probs, sel.counts, gen)
    for index_dtype in (torch.int64, torch.int32):
        dense = verify_sampling(tree.tokens, sel, probs, torch.Generator().manual_seed(11), max_depth=max_depth)
        flat = verify_sampling(
            tree.tokens,
            sel,
            flat_probs,
            torch.Generator().manual_seed(11),
            max_depth=max_depth,
            row_index=index.to(index_dtype),
        )
        for name in dense._fields:
            assert torch.equal(getattr(flat, name), getattr(dense, name)), name


def test_bad_flat_inputs():
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    sel = compact_selection(
        torch.ones(2, 3, dtype=torch.bool),
        torch.ones(2, 3, dtype=torch.int32),
        torch.full((2, 3), -1, dtype=torch.int32),
    )
    index = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="row_index"):
        verify_greedy(tokens, sel, torch.zeros(8, dtype=torch.int64), row_index=index[:, :3])
    with pytest.raises(ValueError, match="target_argmax must be flat"):
        verify_greedy(tokens, sel, torch.zeros(2, 4, dtype=torch.int64), row_index=index)
    with pytest.raises(ValueError, match="target_probs must be flat"):
        verify_sampling(tokens, sel, torch.zeros(2, 4, 5), row_index=index)
    with pytest.raises(TypeError, match="integer"):
        verify_sampling(tokens, sel, torch.zeros(8, 5), row_index=index.float())
