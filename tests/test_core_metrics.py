"""EchoMetrics by hand, and the whole core step loop (draft -> gates -> budget -> verify -> calibrate)."""

from __future__ import annotations

import math

import pytest
import torch

from echo_vllm.core import (
    CalibrationRecorder,
    EchoMetrics,
    SyntheticDrafter,
    calibrate,
    compact_selection,
    depth_confidence,
    gate_caps,
    grow_tree,
    select_budget_reference,
    verify_greedy,
)
from echo_vllm.core.verify import VerifyResult


def _selection(order_depths: list[list[int]]):
    """A selection whose request b selects one node per listed depth (a chain)."""
    batch, num = len(order_depths), 4
    selected = torch.zeros(batch, num, dtype=torch.bool)
    for b, ds in enumerate(order_depths):
        selected[b, : len(ds)] = True
    depth = torch.tensor([[1, 2, 3, 4]] * batch, dtype=torch.int32)
    parent = torch.tensor([[-1, 0, 1, 2]] * batch, dtype=torch.int32)
    return compact_selection(selected, depth, parent)


def _result(accepted_len: list[int]) -> VerifyResult:
    acc = torch.tensor(accepted_len, dtype=torch.int32)
    return VerifyResult(
        acc,
        torch.zeros(len(acc), 4, dtype=torch.int32),
        torch.zeros(len(acc), 5, dtype=torch.int64),
        acc + 1,
        torch.zeros(len(acc), dtype=torch.int64),
        torch.zeros(len(acc), 4, dtype=torch.bool),
    )


def test_metrics_by_hand():
    m = EchoMetrics(max_depth=4)
    # step 1: depths drafted 3 and 1, accepted 2 and 0; request 1 truncated at depth 1
    m.update(
        _selection([[1, 2, 3], [1]]),
        _result([2, 0]),
        k_max=8,
        depth_cap=torch.tensor([4, 1], dtype=torch.int32),
        truncated=torch.tensor([False, True]),
    )
    # step 2: depths 4 and 0 (nothing selected), accepted 4 and 0
    m.update(
        _selection([[1, 2, 3, 4], []]),
        _result([4, 0]),
        k_max=4,
        depth_cap=torch.tensor([2, 4], dtype=torch.int32),
        truncated=torch.tensor([True, False]),
    )
    s = m.summary()
    assert s["steps"] == 2 and s["request_steps"] == 4
    assert s["mat"] == pytest.approx((3 + 1 + 5 + 1) / 4)
    assert s["mean_depth"] == pytest.approx((3 + 1 + 4 + 0) / 4)
    assert s["utilization"] == pytest.approx(2.5 / 2.0)
    assert s["accepted_per_verified_draft"] == pytest.approx(6 / 8)
    assert s["verified_per_emitted"] == pytest.approx(8 / 10)
    assert s["truncations_per_depth"] == [1, 1, 0, 0]
    assert s["truncation_rate"] == pytest.approx(0.5)
    assert s["budget_used"] == pytest.approx((4 / 8 + 4 / 4) / 2)
    # the raw sums behind the ratios (the Prometheus counters)
    assert m.totals() == {
        "request_steps": 4.0,
        "emitted": 10.0,
        "accepted": 6.0,
        "verified": 8.0,
        "bound_steps": 1.0,  # step 2 used all of K_max = 4 while 2 requests x depth 4 could draft more
        "truncations_per_depth": [1, 1, 0, 0],
    }
    assert s["budget_bound_steps"] == 1
    assert EchoMetrics(max_depth=3).totals()["truncations_per_depth"] == [0, 0, 0]


def test_metrics_active_mask_and_empty():
    m = EchoMetrics(max_depth=4)
    s = m.summary()
    assert s["steps"] == 0 and math.isnan(s["mat"]) and s["truncations_per_depth"] == [0] * 4
    m.update(_selection([[1, 2], [1, 2, 3]]), _result([1, 3]), k_max=0, active=torch.tensor([True, False]))
    s = m.summary()
    assert s["request_steps"] == 1 and s["mat"] == 2.0 and s["mean_depth"] == 2.0
    assert math.isnan(s["budget_used"])  # K_max = 0 steps are not counted
    with pytest.raises(ValueError, match="depth_cap"):
        m.update(_selection([[1]]), _result([0]), k_max=1, truncated=torch.tensor([True]))


class _GreedyTarget:
    """A target that agrees with the drafter's argmax most of the time (per request and depth)."""

    def __init__(self, drafter: SyntheticDrafter, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.drafter = drafter
        self.noise = torch.randint(0, drafter.vocab_size, (drafter.batch, 64), generator=gen)
        self.flip = torch.rand(drafter.batch, 64, generator=gen) < 0.35

    def argmax(self, tree, sel):
        order_tokens = torch.gather(tree.tokens, 1, sel.order.long().clamp(min=0))
        order_depth = sel.order_depth.long()
        root = self.drafter.root_logprobs().argmax(-1, keepdim=True)
        variant = (torch.arange(tree.tokens.shape[0]) % self.drafter.variants).unsqueeze(1)
        after = self.drafter._table[
            (order_depth + 1).clamp(max=self.drafter._table.shape[0] - 1), variant, order_tokens
        ].argmax(-1)
        out = torch.cat([root, after], 1)
        return torch.where(self.flip[:, : out.shape[1]], self.noise[:, : out.shape[1]], out)


def test_core_step_loop_end_to_end():
    batch, max_depth, top_k, k_max = 8, 4, 3, 20
    recorder = CalibrationRecorder(max_depth)
    metrics = EchoMetrics(max_depth)
    calibration = None
    for step in range(6):
        drafter = SyntheticDrafter(batch, 10, max_depth, seed=step, sharpness=2.0)
        tree = grow_tree(drafter, batch, max_depth, top_k)
        conf = depth_confidence(tree)
        cap, trunc = gate_caps(conf, calibration)
        sel = select_budget_reference(tree.scores, tree.depth, tree.parent, tree.valid, tree.spine, cap, trunc, k_max)
        assert int(sel.counts.sum()) <= k_max
        res = verify_greedy(tree.tokens, sel, _GreedyTarget(drafter, step).argmax(tree, sel), max_depth=max_depth)
        metrics.update(sel, res, k_max, cap, trunc)
        if calibration is None:
            recorder.record(conf, res.accepted_depth_mask, sel.order_depth.amax(1))
            if step == 2:
                calibration = calibrate(recorder, "dense", delta=0.5, min_samples_per_class=1)
    s = metrics.summary()
    assert s["steps"] == 6 and s["mat"] >= 1.0
    assert 0 < s["budget_used"] <= 1.0
    assert calibration is not None and len(calibration.tau) == max_depth


def test_two_half_steps_equal_one_update():
    """The vLLM proposer records selection and verification a step apart; the figures are the same."""
    sel, res = _selection([[1, 2, 3], [1]]), _result([2, 0])
    cap, trunc = torch.tensor([4, 1], dtype=torch.int32), torch.tensor([False, True])
    whole, halves = EchoMetrics(max_depth=4), EchoMetrics(max_depth=4)
    whole.update(sel, res, 4, cap, trunc)
    halves.record_selection(sel.counts, 4, cap, trunc)
    halves.record_verification(res.num_emitted, res.accepted_len, sel.counts, sel.order_depth.amax(1))
    assert whole.summary() == halves.summary()
    s = whole.summary()
    assert s["k_max"] == 4 and s["max_step_sum"] == 4 and s["mean_step_sum"] == 4.0
    assert s["budget_bound_steps"] == 1  # all of K_max used while 2 x 4 draft tokens were possible


def test_stats_line_is_what_the_soak_parses(tmp_path):
    from echo_vllm.soak import checks
    from echo_vllm.vllm.stats_log import format_stats_line

    m = EchoMetrics(max_depth=4)
    m.update(_selection([[1, 2, 3], [1]]), _result([2, 0]), 4, torch.tensor([4, 1]), torch.tensor([False, True]))
    stats = {
        **m.summary(),
        "calibration": "calibrated after 3 steps",
        "sweet_spots": [1],
        "faults": 0,
        "disabled": False,
        "budget_mode": "fixed",
        "phase": "fixed",
        "cost_fit_error": None,
    }
    log = tmp_path / "server.log"
    log.write_text(f"(Worker pid=1) INFO [proposer.py:1] {format_stats_line(stats)}\n")
    parsed = checks.last_echo_stats(log)
    assert parsed["steps"] == 1 and parsed["k_max"] == 4 and parsed["max_step_sum"] == 4
    assert parsed["budget_used"] == pytest.approx(1.0) and parsed["budget_bound_steps"] == 1
    assert parsed["MAT"] == pytest.approx(2.0) and parsed["accepted/verified"] == pytest.approx(0.5)
    assert parsed["truncations_per_depth"] == "[1, 0, 0, 0]" and parsed["calibration"] == "calibrated after 3 steps"
    assert checks.check_echo_stats(parsed, 4).passed


def test_stats_line_with_the_time_aware_budget(tmp_path):
    from echo_vllm.soak import checks
    from echo_vllm.vllm.stats_log import format_stats_line

    m = EchoMetrics(max_depth=4)
    m.record_plan(3, torch.tensor(1.5, dtype=torch.float64))
    m.update(_selection([[1, 2, 3], [1]]), _result([2, 0]), 8, torch.tensor([4, 1]), torch.tensor([False, True]))
    m.record_realised(torch.tensor([2, 0]))
    stats = {
        **m.summary(),
        "k_max": "auto",
        "calibration": "file x.json",
        "sweet_spots": [],
        "faults": 0,
        "disabled": False,
        "budget_mode": "auto",
        "phase": "auto",
        "cost_fit_error": 0.0625,
    }
    line = format_stats_line(stats)
    assert "budget=auto phase=auto draft_depth=3.00" in line
    assert "predicted=1.50 realised=2.00 cost_fit_error=0.062" in line
    log = tmp_path / "server.log"
    log.write_text(f"INFO {line}\n")
    assert checks.last_echo_stats(log)["k_max"] == "auto"


@pytest.mark.parametrize("seed", range(6))
def test_host_accumulators_give_the_tensor_paths_figures(seed):
    """CPU records into host numbers (a dozen tiny tensor ops per step cost more than 1 % of a batch-1 step); the
    figures must be the tensor path's, with and without `active` rows, truncations, predictions."""
    rng = torch.Generator().manual_seed(seed)
    host, tensors = EchoMetrics(4, host_accumulators=True), EchoMetrics(4, host_accumulators=False)
    summed = EchoMetrics(4, host_accumulators=True)  # given the step's sum as a host int (the chain proposer's)
    for step in range(25 if seed % 2 else 150):  # 150: truncations also counted in batches mid-run
        batch = int(torch.randint(1, 9, (1,), generator=rng))
        counts = torch.randint(0, 5, (batch,), generator=rng)
        depth_cap = torch.randint(1, 6, (batch,), generator=rng)  # 5: beyond the drafted depths (dropped bin)
        truncated = torch.rand(batch, generator=rng) < 0.3
        active = (torch.rand(batch, generator=rng) < 0.8) if step % 3 == 0 else None
        k_max = int(torch.randint(0, 20, (1,), generator=rng))
        accepted = torch.minimum(torch.randint(0, 5, (batch,), generator=rng), counts)
        predicted = torch.rand((), generator=rng, dtype=torch.float64) * batch
        for m in (host, tensors, summed):
            step_sum = int(counts.sum()) if m is summed else None
            m.record_selection(
                counts, k_max, depth_cap, truncated if step % 4 else None, active, host_step_sum=step_sum
            )
            m.record_plan(int(counts.max()), predicted if step % 2 else None)
            m.record_verification(accepted + 1, accepted, counts, counts, active)
            m.record_realised(accepted)
    assert host._host and not tensors._host
    a, b = host.summary(), tensors.summary()
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], float) and math.isnan(a[key]):
            assert math.isnan(b[key]), key
        else:
            assert a[key] == pytest.approx(b[key]), key
    assert host.totals() == tensors.totals()  # sums of small integers: exact in float64
    assert summed.summary() == a and summed.totals() == host.totals()
    assert sum(a["truncations_per_depth"]) > 0  # the truncation bins were exercised
