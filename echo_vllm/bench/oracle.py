"""The oracle bound of a recorded ECHO run: how long a policy would have taken that verified exactly the drafts
that were accepted, on the same measured cost curve.

Inputs: the ECHO per-step log (ECHO_VLLM_STEP_LOG, one JSON line per step) and the cost model of one engine step
(`step_seconds(num_tokens, batch, draft_depth)`; ECHO's budget profile, `echo_vllm.core.cost_model.CostModel`).
Per step, with `accepted` the accepted drafts per request of the verification result that arrived in that step:

    oracle_time = sum_steps step_seconds(batch + sum(accepted), batch, max(accepted, default 0))
    policy_time = sum_steps step_seconds(num_tokens, batch, draft_depth)
    oracle_ratio = oracle_time / policy_time

Both times come from the same model, not from the wall clock, so the machine's noise cancels: the ratio is ECHO's
tokens/s over the oracle's for the same emitted tokens (1.0 = ECHO wasted nothing). The functions here are pure
(no engine, no torch); `CostModel` is imported only when a profile file is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from echo_vllm.vllm.step_log import read_step_log

# The step-log keys the bound needs (written by EchoProposer once the adaptive budget is in; older logs lack them).
STEP_KEYS = ("batch", "num_tokens", "draft_depth", "accepted")


class StepCost(Protocol):
    def step_seconds(
        self, num_tokens: float, batch: int, draft_depth: int, verified: float = 0, context: float = 0.0
    ) -> float: ...


@dataclass(frozen=True)
class OracleBound:
    ratio: float | None
    oracle_seconds: float | None
    policy_seconds: float | None
    steps: int
    reason: str | None = None  # why ratio is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "oracle_ratio": self.ratio,
            "oracle_seconds": self.oracle_seconds,
            "policy_seconds": self.policy_seconds,
            "oracle_steps": self.steps,
            "oracle_reason": self.reason,
        }


def unavailable(reason: str, steps: int = 0) -> OracleBound:
    return OracleBound(None, None, None, steps, reason)


def oracle_bound(records: Iterable[Mapping[str, Any]], cost: StepCost) -> OracleBound:
    """The bound over `records` (step-log lines of one rank). Records missing a key make the bound unavailable:
    a bound over part of the steps would look better or worse than the run for no reason."""
    oracle = policy = 0.0
    steps = 0
    for record in records:
        missing = [k for k in STEP_KEYS if k not in record]
        if missing:
            return unavailable(f"step log lacks {', '.join(missing)} (this ECHO build does not record them)", steps)
        batch = int(record["batch"])
        accepted = [int(a) for a in record["accepted"]]
        context = float(record.get("context_tokens", 0))  # the same cached tokens for the policy and the oracle
        oracle += cost.step_seconds(
            float(batch + sum(accepted)), batch, max(accepted, default=0), sum(accepted), context
        )
        drafted = int(record.get("drafted_depth", record["draft_depth"]))  # the early exit may stop short of the plan
        # A step whose forward verified drafts lists each verified request's accepted count (verify(B) applies).
        policy += cost.step_seconds(float(record["num_tokens"]), batch, drafted, len(accepted), context)
        steps += 1
    if steps == 0:
        return unavailable("no ECHO steps were recorded in the timed part")
    if policy <= 0:
        return unavailable("the cost model gives the run's steps no time", steps)
    return OracleBound(oracle / policy, oracle, policy, steps)


def load_cost_model(path: str | Path) -> StepCost:
    """ECHO's budget profile; imported lazily (the cost model lives in the core, which needs torch)."""
    from echo_vllm.core.budget_profile import load_cost_model

    return load_cost_model(path)


def oracle_for_run(step_log: str | Path | None, offset: int, profile: str | Path | None) -> OracleBound:
    """The bound of one recorded run, or the reason there is none (missing log, profile or cost model)."""
    if step_log is None or not Path(step_log).is_file():
        return unavailable("no ECHO step log was written")
    if profile is None or not Path(profile).is_file():
        return unavailable(f"no budget profile file was written ({profile or 'no budget_profile_file set'})")
    try:
        cost = load_cost_model(profile)
    except Exception as err:  # noqa: BLE001 - a corrupt profile is a reported reason, not a failed benchmark
        return unavailable(f"budget profile {profile} does not load: {err}")
    return oracle_bound(read_step_log(step_log, offset=offset, rank=0), cost)
