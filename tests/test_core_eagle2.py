"""core.eagle2: EAGLE-2's full pool, its rerank and DDD's stopping rule against brute-force Python versions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.core.budget import compact_selection
from echo_vllm.core.eagle2 import (
    DDDSettings,
    beam_log_mass,
    grow_eagle2,
    grow_eagle2_pool,
    pool_depth_start,
    pool_size,
)
from echo_vllm.core.tree import SyntheticDrafter
from echo_vllm.ops import select_eagle2

SETTINGS = settings(deadline=None, max_examples=60, database=None, derandomize=True)


def f32_add(a: float, b: float) -> float:
    return float(torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32))


def _children(drafter: SyntheticDrafter, b: int, depth: int, parent_token: int, top_k: int):
    """The top_k (log-prob, token) children of a node, ties -> lower token id."""
    logp = drafter.child_logprobs(b, depth, parent_token).clamp(max=0.0).tolist()
    ranked = sorted(range(len(logp)), key=lambda t: (-logp[t], t))[:top_k]
    return [(logp[t], t) for t in ranked]


def brute_force_pool(drafter: SyntheticDrafter, b: int, max_depth: int, top_k: int, stop=None):
    """topK_genrate (eagle/model/cnets.py) in plain Python for request b: the pool as (tokens, scores, parents)
    lists in the official pool order, and the frontier node indices of every drafted depth."""
    tokens, scores, parents = [], [], []
    for lp, tok in _children(drafter, b, 1, -1, top_k):
        tokens.append(tok)
        scores.append(lp)
        parents.append(-1)
    frontier = list(range(top_k))  # depth 1's frontier: every root child
    frontiers = [frontier]
    for depth in range(2, max_depth + 1):
        if stop is not None and stop(depth - 1, [scores[n] for n in frontier]):
            break
        start = len(tokens)
        for node in frontier:  # every expanded node's top k children go into the pool
            for lp, tok in _children(drafter, b, depth, tokens[node], top_k):
                tokens.append(tok)
                scores.append(f32_add(scores[node], lp))
                parents.append(node)
        cands = range(start, len(tokens))
        frontier = sorted(cands, key=lambda n: (-scores[n], n))[:top_k]  # top k of the k*k, ties lower index
        frontiers.append(frontier)
    return tokens, scores, parents, frontiers


@SETTINGS
@given(
    batch=st.integers(1, 4),
    max_depth=st.integers(1, 5),
    top_k=st.integers(1, 4),
    extra_vocab=st.integers(0, 4),
    seed=st.integers(0, 10_000),
    levels=st.sampled_from([0, 2, 3]),
)
def test_pool_matches_the_official_construction(batch, max_depth, top_k, extra_vocab, seed, levels):
    """Every expanded child is in the pool, with its parent; the frontier is the top k of the k*k candidates."""
    vocab = top_k + extra_vocab
    drafter = SyntheticDrafter(batch, vocab, max_depth, seed=seed, levels=levels)
    pool = grow_eagle2(drafter, batch, max_depth, top_k)
    tree = pool.tree
    n = pool_size(max_depth, top_k)
    assert tree.tokens.shape == (batch, n) and pool.depth == max_depth
    assert bool((tree.parent < torch.arange(n)).all())
    for b in range(batch):
        tokens, scores, parents, frontiers = brute_force_pool(drafter, b, max_depth, top_k)
        assert tree.tokens[b].tolist() == tokens
        assert tree.scores[b].tolist() == scores
        assert tree.parent[b].tolist() == parents
        for d, front in enumerate(frontiers, start=1):
            assert pool.frontier[b, d - 1].tolist() == front
        depth_of = [1] * top_k + [d for d in range(2, max_depth + 1) for _ in range(top_k * top_k)]
        assert tree.depth[b].tolist() == depth_of
    # The drafter expanded exactly the frontiers, each node with its parent's frontier slot.
    assert [d for d, _ in drafter.calls] == list(range(2, max_depth + 1))
    for d, slots in drafter.calls:
        if d == 2:
            assert slots.eq(0).all()
        else:
            prev = pool.frontier[:, d - 3]
            parent_of_frontier = torch.gather(tree.parent.long(), 1, pool.frontier[:, d - 2])
            expect = (parent_of_frontier.unsqueeze(2) == prev.unsqueeze(1)).int().argmax(dim=2)
            assert torch.equal(slots, expect)


def test_siblings_are_distinct_and_children_of_expanded_nodes_only():
    drafter = SyntheticDrafter(3, 9, 4, seed=7, levels=3)
    pool = grow_eagle2(drafter, 3, 4, 3)
    tree = pool.tree
    for b in range(3):
        expanded = set(pool.frontier[b, :-1].flatten().tolist())
        kids: dict[int, list[int]] = {}
        for node, par in enumerate(tree.parent[b].tolist()):
            kids.setdefault(par, []).append(int(tree.tokens[b, node]))
        assert set(kids) - {-1} == expanded
        assert all(len(toks) == len(set(toks)) == 3 for toks in kids.values())


def test_spine_is_the_best_child_chain_while_it_is_expanded():
    drafter = SyntheticDrafter(4, 8, 5, seed=11)
    pool = grow_eagle2(drafter, 4, 5, 3)
    tree = pool.tree
    for b in range(4):
        chain, node = [0], 0
        for d in range(2, 6):
            if node not in pool.frontier[b, d - 2].tolist():
                break
            kids = [n for n in range(tree.tokens.shape[1]) if int(tree.parent[b, n]) == node]
            node = kids[0]  # rank 0 = best child
            chain.append(node)
        assert torch.nonzero(tree.spine[b]).flatten().tolist() == chain


@pytest.mark.parametrize(("levels", "total"), [(0, 7), (0, 30), (2, 9), (3, 20)])
def test_rerank_takes_the_best_total_tokens_ancestor_closed(levels, total):
    """select_eagle2 over the pool = the total_tokens best path scores (ties: shallower, then lower pool index,
    i.e. lower official pool index), and the set is ancestor-closed."""
    drafter = SyntheticDrafter(1, 7, 5, seed=5, levels=levels, sharpness=2.0)
    tree = grow_eagle2_pool(drafter, 1, 5, 3)
    sel = select_eagle2(tree, total)
    n = tree.tokens.shape[1]
    ranked = sorted(range(n), key=lambda i: (-float(tree.scores[0, i]), int(tree.depth[0, i]), i))
    best = set(ranked[: min(total, n)])
    assert set(torch.nonzero(sel.selected[0]).flatten().tolist()) == best
    for node in best:
        par = int(tree.parent[0, node])
        assert par == -1 or par in best
    assert torch.equal(sel.order, compact_selection(sel.selected, tree.depth, tree.parent).order)


def test_rerank_stays_ancestor_closed_when_child_and_parent_tie():
    """Probability-1 children score exactly their parent's score: the parent (shallower) must still be chosen."""

    class Certain(SyntheticDrafter):
        def expand(self, frontier_tokens, frontier_parent_slots, depth):
            out = torch.full((*frontier_tokens.shape, self.vocab_size), float("-inf"))
            out[..., 1] = 0.0
            out[..., 2] = -1.0
            return out

    drafter = Certain(1, 4, 4, seed=0)
    tree = grow_eagle2_pool(drafter, 1, 4, 2)
    for total in range(1, 8):
        sel = select_eagle2(tree, total)
        chosen = set(torch.nonzero(sel.selected[0]).flatten().tolist())
        assert all(int(tree.parent[0, c]) in chosen | {-1} for c in chosen), total


def _frontier_masses(drafter_args, max_depth, top_k):
    pool = grow_eagle2(SyntheticDrafter(*drafter_args), 1, max_depth, top_k)
    masses = []
    for d in range(1, max_depth + 1):
        front = pool.frontier[0, d - 1]
        masses.append(float(beam_log_mass(pool.tree.scores[0, front].unsqueeze(0))[0]))
    return pool, masses


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ddd_stops_exactly_when_the_rule_says(seed):
    args = (1, 6, 8, seed)
    full, masses = _frontier_masses(args, 8, 3)
    checks = (2, 4, 6)
    # H never increases with depth here (each frontier's mass is at most its parents'); pick thresholds around
    # each checked value, so the stop depth moves from "never" to each check.
    for threshold in [*(masses[c - 1] + eps for c in checks for eps in (-1e-4, 1e-4)), 0.0, -1e9]:
        rule = DDDSettings(threshold=min(threshold, 0.0), max_depth=8, check_depths=checks)
        stop_at = next((c for c in checks if masses[c - 1] < rule.threshold), 8)
        drafter = SyntheticDrafter(*args)
        pool = grow_eagle2(drafter, 1, 8, 3, stop_after=rule.should_stop)
        assert pool.depth == stop_at, (threshold, masses)
        assert [d for d, _ in drafter.calls] == list(range(2, stop_at + 1))
        tree, ref = pool.tree, full.tree
        keep = pool_depth_start(stop_at + 1, 3) if stop_at < 8 else tree.tokens.shape[1]
        assert torch.equal(tree.tokens[:, :keep], ref.tokens[:, :keep])
        assert torch.equal(tree.scores[:, :keep], ref.scores[:, :keep])
        assert not tree.valid[:, keep:].any()
        assert bool((tree.parent < torch.arange(tree.tokens.shape[1])).all())


def test_ddd_checks_only_its_depths():
    rule = DDDSettings(threshold=-1.0, max_depth=6, check_depths=(3,))
    low = torch.full((1, 4), -50.0)
    assert not rule.should_stop(2, low) and rule.should_stop(3, low) and not rule.should_stop(4, low)
    assert not rule.should_stop(3, torch.tensor([[-0.1, -5.0, -5.0, -5.0]]))
    assert math.isclose(float(beam_log_mass(torch.log(torch.tensor([[0.25, 0.25]])))[0]), math.log(0.5), rel_tol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"threshold": 0.5}, "ddd.threshold"),
        ({"threshold": float("nan")}, "ddd.threshold"),
        ({"threshold": True}, "ddd.threshold"),
        ({"max_depth": 0}, "ddd.max_depth"),
        ({"max_depth": 2.5}, "ddd.max_depth"),
        ({"max_depth": 6, "check_depths": (6,)}, "ddd.check_depths"),
        ({"check_depths": (0,)}, "ddd.check_depths"),
        ({"check_depths": 3}, "ddd.check_depths"),
    ],
)
def test_ddd_settings_name_the_bad_field(kwargs, field):
    problems = DDDSettings(**kwargs).problems()
    assert len(problems) == 1 and problems[0].startswith(field)
    with pytest.raises(ValueError, match=field):
        DDDSettings(**kwargs).validate()
    assert DDDSettings().problems() == []
