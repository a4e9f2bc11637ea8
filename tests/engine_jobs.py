"""Offline vLLM jobs on the shipped testbed for the engine tests: the job, ECHO's speculative config, an ECHO run
with its step log, and no-spec baselines.

Each job is a fresh engine in a subprocess (~15 s on the 2-core CI machine), so a no-spec baseline is run once per
test session for each distinct job and shared by every test that asks for the same one (the same prompts, tokens,
batch and settings: greedy no-spec output is a function of those). Callers get their own copy.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from testbed_fixture import shipped_testbed

from echo_vllm.vllm.offline import run_in_subprocess
from echo_vllm.vllm.step_log import read_step_log

DEPTH = 4  # the head's draft depth in the engine tests (num_speculative_tokens)

_NO_SPEC: dict[str, dict[str, Any]] = {}


def target_job(prompts: list[str], *, max_tokens: int, max_num_seqs: int, **extra: Any) -> dict[str, Any]:
    """A job for the testbed's target (`extra`: any other job key, e.g. ignore_eos, seed, structured_regex)."""
    root = shipped_testbed()
    return {"model": str(root / "target"), "prompts": prompts, "max_tokens": max_tokens, "max_num_seqs": max_num_seqs,
            **extra}  # fmt: skip


def echo_config(echo: dict[str, Any], depth: int = DEPTH) -> dict[str, Any]:
    """The speculative config of an ECHO job with the testbed's EAGLE-3 head."""
    return {"method": "echo", "model": str(shipped_testbed() / "eagle3"), "num_speculative_tokens": depth, "echo": echo}


def run_echo(
    job: dict[str, Any],
    echo: dict[str, Any],
    step_log: Path,
    *,
    depth: int = DEPTH,
    extra_env: dict[str, str] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run `job` with ECHO (its stats on) writing the step log to `step_log`; the result and the log's lines."""
    spec_job = {**job, "echo_stats": True, "speculative_config": echo_config(echo, depth)}
    result = run_in_subprocess(spec_job, extra_env={**(extra_env or {}), "ECHO_VLLM_STEP_LOG": str(step_log)})
    return result, read_step_log(step_log)


def no_spec(job: dict[str, Any], extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """`job` without speculative decoding, run once per session per distinct (job, environment)."""
    plain = {key: value for key, value in job.items() if key not in ("speculative_config", "echo_stats")}
    key = json.dumps([plain, extra_env or {}], sort_keys=True)
    if key not in _NO_SPEC:
        _NO_SPEC[key] = run_in_subprocess(plain, extra_env=extra_env)
    return copy.deepcopy(_NO_SPEC[key])
