"""Faults inside ECHO never take the engine down (echo_vllm/vllm/faults.py), and output stays exact.

A test-only switch (ECHO_VLLM_INJECT_FAULT=<stage>[:<every>]) raises inside the proposer. Intermittent faults:
those steps run without drafts, the cause is logged once and counted, ECHO keeps drafting in the other steps.
Persistent faults: after `fault_limit` consecutive faulty steps ECHO turns itself off with one loud line. In
every case the greedy output equals no-spec token for token.
"""

from __future__ import annotations

import pytest
from testbed_fixture import shipped_testbed

from echo_vllm.bench.datasets import humaneval_prompts
from echo_vllm.config import EchoConfigError
from echo_vllm.vllm.faults import FaultGuard, FaultInjection, InjectedFault
from echo_vllm.vllm.offline import run_in_subprocess

DEPTH = 4


def test_injection_parses_and_rejects_bad_values():
    assert FaultInjection.from_env(None) is None
    assert FaultInjection.from_env("select:3") == FaultInjection("select", 3)
    assert FaultInjection.from_env("draft") == FaultInjection("draft", 1)
    for bad in ("nope", "select:0", "select:x"):
        with pytest.raises(EchoConfigError, match="ECHO_VLLM_INJECT_FAULT"):
            FaultInjection.from_env(bad)


def test_guard_logs_each_cause_once_and_disables_after_the_limit(caplog):
    guard = FaultGuard(limit=3, injection=FaultInjection("gates", 2))
    guard.maybe_inject("gates")  # 1st entry: no fault
    with pytest.raises(InjectedFault):
        guard.maybe_inject("gates")
    guard.maybe_inject("select")  # other stages never fault
    with caplog.at_level("WARNING", logger="vllm.echo_vllm"):
        err = ValueError("boom")
        guard.record_fault("select", err)
        guard.record_fault("select", err)
        guard.record_success()  # a good step resets the run of faults
        guard.record_fault("select", err)
        guard.record_fault("select", err)
        assert not guard.disabled
        guard.record_fault("gates", RuntimeError("other"))
    assert guard.disabled and guard.total == 5
    assert guard.by_cause == {"select: ValueError: boom": 4, "gates: RuntimeError: other": 1}
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(warnings) == 2, "each cause is logged once"
    assert len(errors) == 1 and "ECHO DISABLED" in errors[0].getMessage()


@pytest.fixture(scope="module")
def baseline():
    root = shipped_testbed()
    job = {"model": str(root / "target"), "prompts": humaneval_prompts(16), "max_tokens": 32, "max_num_seqs": 8}
    return job, run_in_subprocess(job)


def _echo(job, fault: str, **echo):
    root = shipped_testbed()
    spec = {
        "method": "echo",
        "model": str(root / "eagle3"),
        "num_speculative_tokens": DEPTH,
        "echo": {"k_max": 8, "warmup_steps": 4, "min_samples_per_class": 2, **echo},
    }
    return run_in_subprocess(
        {**job, "speculative_config": spec},
        extra_env={"ECHO_VLLM_INJECT_FAULT": fault, "ECHO_VLLM_FAULTS": "contain", "ECHO_VLLM_LOG_INTERVAL": "0"},
    )


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["draft", "gates", "select", "feedback"])
def test_intermittent_faults_run_those_steps_without_drafts(baseline, stage):
    job, plain = baseline
    out = _echo(job, f"{stage}:3")
    assert out["token_ids"] == plain["token_ids"], "a contained fault changed the output"
    assert out["spec"]["num_drafts"] > 0, "ECHO should keep drafting between faults"
    first = [line for line in out["echo_log"] if f"ECHO fault in {stage}" in line]
    assert len(first) == 1, f"the cause must be logged exactly once, got {len(first)}"
    assert not any("ECHO DISABLED" in line for line in out["echo_log"])
    stats = [line for line in out["echo_log"] if "ECHO stats:" in line]
    assert stats and "faults=0 " not in stats[-1], "the faults are counted in ECHO stats"


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["select", "feedback"])
def test_persistent_faults_disable_echo_and_serving_goes_on(baseline, stage):
    """A fault in every step disables ECHO after fault_limit steps, also one that hits only the feedback (the
    drafts of those steps still go out, so only the count of faulty steps can stop it)."""
    job, plain = baseline
    out = _echo(job, stage, fault_limit=3)
    assert out["token_ids"] == plain["token_ids"]
    disabled = [line for line in out["echo_log"] if "ECHO DISABLED" in line]
    assert len(disabled) == 1, out["echo_log"][-10:]
    assert "after 3 consecutive faulty steps" in disabled[0]
    if stage == "select":
        # Every drafted step faulted before its drafts reached the scheduler: nothing was ever verified.
        assert out["spec"]["num_drafts"] == 0


@pytest.mark.engine
@pytest.mark.slow
def test_two_engines_starting_together_share_one_missing_calibration_file(baseline, tmp_path):
    """Two replicas start at once with the same missing calibration_file: both calibrate, either may save (each
    through its own temp file + rename), and the file left behind is valid; a third start loads it and skips
    warm-up. (tests/test_core_calibration.py races many writers against a reader.)"""
    from concurrent.futures import ThreadPoolExecutor

    from echo_vllm.core import Calibration

    job, plain = baseline
    root = shipped_testbed()
    cal = tmp_path / "shared" / "calibration.json"
    cal.parent.mkdir()
    spec = {
        "method": "echo",
        "model": str(root / "eagle3"),
        "num_speculative_tokens": DEPTH,
        "echo": {"k_max": 8, "warmup_steps": 4, "min_samples_per_class": 2, "calibration_file": str(cal)},
    }
    echo_job = {**job, "speculative_config": spec}
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: run_in_subprocess(echo_job), range(2)))
    for out in runs:
        assert out["token_ids"] == plain["token_ids"]
        assert any("ECHO calibration: calibrated after" in line for line in out["echo_log"]), out["echo_log"][-5:]
    # Whoever finished warm-up first saved; the other saved too or found the file already there.
    assert any(f"saved to {cal}" in line for out in runs for line in out["echo_log"])
    assert Calibration.load(cal, expected_max_depth=DEPTH, expected_mode="sparse")
    assert sorted(p.name for p in cal.parent.iterdir()) == ["calibration.json"], "temporary files left behind"
    third = run_in_subprocess(echo_job)
    assert any(f"calibration=file {cal}" in line for line in third["echo_log"])
    assert third["token_ids"] == plain["token_ids"]
