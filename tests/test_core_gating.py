"""depth_confidence and gate_caps."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.core.calibration import Calibration, CalibrationRecorder, calibrate
from echo_vllm.core.gating import depth_confidence, gate_caps
from echo_vllm.core.tree import SyntheticDrafter, grow_tree

SETTINGS = settings(deadline=None, max_examples=150, database=None, derandomize=True)


def make_cal(gated, tau, mode="sparse"):
    depth = len(gated)
    return Calibration(mode, depth, 0.6, [None] * depth, tau, gated, [0] * depth, [0] * depth)


@SETTINGS
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 4), st.integers(0, 1000))
def test_depth_confidence_brute_force(batch, max_depth, top_k, seed):
    tree = grow_tree(SyntheticDrafter(batch, top_k + 3, max_depth, seed=seed), batch, max_depth, top_k)
    gen = torch.Generator().manual_seed(seed)
    valid = tree.valid & (torch.rand(tree.valid.shape, generator=gen) > 0.3)
    tree = tree._replace(valid=valid)
    conf = depth_confidence(tree)
    assert conf.shape == (batch, max_depth) and conf.dtype == torch.float32
    for b in range(batch):
        for d in range(1, max_depth + 1):
            vals = [
                math.exp(float(tree.scores[b, n]))
                for n in range(tree.scores.shape[1])
                if int(tree.depth[b, n]) == d and bool(valid[b, n])
            ]
            assert float(conf[b, d - 1]) == pytest.approx(max(vals, default=0.0), rel=1e-6)


@SETTINGS
@given(
    st.integers(1, 10),
    st.integers(1, 6),
    st.integers(0, 10_000),
)
def test_gate_caps_brute_force(batch, max_depth, seed):
    gen = torch.Generator().manual_seed(seed)
    conf = torch.rand(batch, max_depth, generator=gen).round(decimals=1)  # ties with tau happen
    gated = (torch.rand(max_depth, generator=gen) < 0.5).tolist()
    tau = torch.rand(max_depth, generator=gen).round(decimals=1).tolist()
    cal = make_cal(gated, tau)
    cap, trunc = gate_caps(conf, cal)
    assert cap.dtype == torch.int32 and trunc.dtype == torch.bool
    for b in range(batch):
        closed = [d + 1 for d in range(max_depth) if gated[d] and not float(conf[b, d]) >= tau[d]]
        assert int(cap[b]) == (closed[0] if closed else max_depth)
        assert bool(trunc[b]) == bool(closed)


def test_first_closed_gate_wins_and_depth_nodes_are_kept():
    conf = torch.tensor([[0.9, 0.2, 0.05], [0.9, 0.5, 0.05], [0.9, 0.5, 0.4], [0.1, 0.1, 0.1]])
    cal = make_cal([False, True, True], [None, 0.3, 0.3])
    cap, trunc = gate_caps(conf, cal)
    assert cap.tolist() == [2, 3, 3, 2]
    assert trunc.tolist() == [True, True, False, True]  # a closed gate at D still truncates (width allowed)


def test_uncalibrated_means_no_gates():
    conf = torch.zeros(5, 4)
    cap, trunc = gate_caps(conf, None)
    assert cap.tolist() == [4] * 5 and not bool(trunc.any())


def test_nan_confidence_closes_the_gate():
    cap, trunc = gate_caps(torch.tensor([[float("nan"), 1.0]]), make_cal([True, False], [0.1, None]))
    assert cap.tolist() == [1] and trunc.tolist() == [True]


def test_modes_decide_which_depths_gate():
    rec = CalibrationRecorder(3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        conf = torch.rand(64, 3, generator=gen)
        acc = torch.rand(64, 3, generator=gen) < 0.5
        conf[:, 1] = torch.where(acc[:, 1], 0.6 + 0.3 * conf[:, 1], 0.1 + 0.3 * conf[:, 1])
        rec.record(conf, acc, torch.full((64,), 3))
    low = torch.full((1, 3), 0.05)  # below every tau
    sparse = calibrate(rec, "auc", 0.6, 8)
    assert gate_caps(low, sparse)[0].tolist() == [2]  # only the sweet spot (depth 2) gates
    dense = calibrate(rec, "dense", 0.6, 8)
    assert gate_caps(low, dense)[0].tolist() == [1]
    fixed = calibrate(rec, "fixed", 0.6, 8)
    assert gate_caps(low, fixed)[0].tolist() == [1]
    high = torch.full((1, 3), 0.999)
    for cal in (sparse, dense, fixed):
        assert gate_caps(high, cal)[1].tolist() == [False]


def test_depth_mismatch_is_an_error():
    with pytest.raises(ValueError, match="calibration covers 2 depths"):
        gate_caps(torch.zeros(1, 3), make_cal([True, False], [0.1, None]))
    with pytest.raises(ValueError, match=r"\[B, D\]"):
        gate_caps(torch.zeros(3), None)


def test_width_eligible_policies():
    from echo_vllm.core import select_budget_reference, width_eligible

    truncated = torch.tensor([True, False, False])
    assert width_eligible(truncated, "truncated").tolist() == [True, False, False]
    assert width_eligible(truncated, "all").tolist() == [True, True, True]
    with pytest.raises(ValueError, match="surplus_width"):
        width_eligible(truncated, "some")
    # B = 1, every gate open, K_max beyond the spine: 'truncated' leaves the surplus unused, 'all' spends it on
    # the best width nodes (the spine still comes first).
    tree = grow_tree(SyntheticDrafter(1, 12, 3, seed=5), 1, 3, 3)
    cap = torch.tensor([3], dtype=torch.int32)
    open_gate = torch.tensor([False])
    strict = select_budget_reference(
        tree.scores, tree.depth, tree.parent, tree.valid, tree.spine, cap, width_eligible(open_gate, "truncated"), 6
    )
    surplus = select_budget_reference(
        tree.scores, tree.depth, tree.parent, tree.valid, tree.spine, cap, width_eligible(open_gate, "all"), 6
    )
    assert int(strict.counts[0]) == 3 and strict.selected[0].eq(tree.spine[0]).all()
    assert int(surplus.counts[0]) == 6 and surplus.selected[0][tree.spine[0]].all()
    width_scores = tree.scores[0][~tree.spine[0]]
    chosen = tree.scores[0][surplus.selected[0] & ~tree.spine[0]]
    assert torch.equal(chosen.sort(descending=True).values, width_scores.sort(descending=True).values[:3])
