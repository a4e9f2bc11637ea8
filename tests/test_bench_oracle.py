"""The oracle bound (echo_vllm.bench.oracle) on a fake cost model and synthetic step records, by hand."""

from __future__ import annotations

import json

import pytest

from echo_vllm.bench.oracle import oracle_bound, oracle_for_run
from echo_vllm.vllm.step_log import read_step_log


class LinearCost:
    """1 ms per step + 0.5 ms per token + 2 ms per draft depth (the batch term makes batch visible) + 0.01 ms per
    cached context token."""

    def step_seconds(
        self, num_tokens: float, batch: int, draft_depth: int, verified: float = 0, context: float = 0.0
    ) -> float:
        return 1e-3 * (1.0 + 0.5 * num_tokens + 0.1 * batch + 2.0 * draft_depth + 0.01 * context)


def _step(batch, num_tokens, draft_depth, accepted, **extra):
    return {"batch": batch, "num_tokens": num_tokens, "draft_depth": draft_depth, "accepted": accepted, **extra}


def test_oracle_is_the_cost_of_verifying_only_what_was_accepted():
    steps = [
        _step(2, 2 + 8, 4, [1, 3]),  # verified 4 + 4, accepted 1 + 3: oracle verifies 4 and drafts 3 deep
        _step(2, 2 + 2, 1, [0, 0]),  # nothing accepted: the oracle decodes plainly (depth 0)
    ]
    cost = LinearCost()
    bound = oracle_bound(steps, cost)
    oracle = cost.step_seconds(2 + 4, 2, 3) + cost.step_seconds(2 + 0, 2, 0)
    policy = cost.step_seconds(10, 2, 4) + cost.step_seconds(4, 2, 1)
    assert bound.steps == 2 and bound.reason is None
    assert bound.oracle_seconds == pytest.approx(oracle) and bound.policy_seconds == pytest.approx(policy)
    assert bound.ratio == pytest.approx(oracle / policy) and bound.ratio < 1


def test_a_steps_context_costs_the_oracle_what_it_costs_the_policy():
    # The cached context is read whatever the step verifies: both times carry it, step by step.
    steps = [_step(2, 2 + 8, 4, [1, 3], context_tokens=600), _step(2, 2 + 2, 1, [0, 0], context_tokens=0)]
    cost = LinearCost()
    bound = oracle_bound(steps, cost)
    oracle = cost.step_seconds(2 + 4, 2, 3, 4, 600) + cost.step_seconds(2 + 0, 2, 0)
    policy = cost.step_seconds(10, 2, 4, 2, 600) + cost.step_seconds(4, 2, 1, 2)
    assert bound.oracle_seconds == pytest.approx(oracle) and bound.policy_seconds == pytest.approx(policy)
    without = oracle_bound([{k: v for k, v in s.items() if k != "context_tokens"} for s in steps], cost)
    assert without.ratio < bound.ratio < 1  # a cost both pay moves the bound towards 1


def test_a_policy_that_verifies_exactly_the_accepted_tokens_is_the_oracle():
    steps = [_step(3, 3 + 5, 2, [2, 2, 1]), _step(1, 1, 0, [])]
    assert oracle_bound(steps, LinearCost()).ratio == pytest.approx(1.0)


def test_missing_keys_or_steps_give_a_reason_not_a_number():
    old = [{"step": 1, "rank": 0, "k_max": 8, "sum": 4, "batch": 2, "counts": [2, 2]}]  # today's step log
    bound = oracle_bound(old, LinearCost())
    assert bound.ratio is None and "num_tokens" in bound.reason and "accepted" in bound.reason
    assert oracle_bound([], LinearCost()).ratio is None


def test_step_log_from_the_timed_offset_and_rank_0(tmp_path):
    log = tmp_path / "steps.jsonl"
    warm = json.dumps(_step(1, 5, 4, [4], rank=0)) + "\n"
    timed = [_step(2, 4, 1, [1, 0], rank=0), _step(2, 4, 1, [1, 0], rank=1), _step(2, 3, 1, [0, 1], rank=0)]
    log.write_text(warm + "".join(json.dumps(r) + "\n" for r in timed))
    records = read_step_log(log, offset=len(warm.encode()), rank=0)
    assert [r["num_tokens"] for r in records] == [4, 3]


def test_oracle_for_run_reasons_and_the_real_profile(tmp_path):
    from echo_vllm.core.acceptance import AcceptanceModel
    from echo_vllm.core.budget_profile import save_profile
    from echo_vllm.core.cost_model import CostModel

    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps(_step(2, 6, 2, [1, 1], rank=0)) + "\n")
    profile = tmp_path / "profile.json"
    assert "step log" in oracle_for_run(None, 0, profile).reason
    assert "budget profile" in oracle_for_run(log, 0, profile).reason
    cost = CostModel((1.0, 2.0, 4.0, 8.0), (0.01, 0.012, 0.016, 0.024), 0.001, (0.002, 0.0005, 0.001, 0.0001), 0.02, 40)
    save_profile(profile, cost, AcceptanceModel(3))
    bound = oracle_for_run(log, 0, profile)
    assert bound.ratio == pytest.approx(cost.step_seconds(4, 2, 1) / cost.step_seconds(6, 2, 2))
    profile.write_text('{"kind": "something else"}')
    assert "does not load" in oracle_for_run(log, 0, profile).reason
