"""Per-phase host time of ECHO steps in vLLM on the CPU testbed (issue #13): where a tree step's extra time goes.

    PYTHONPATH=. python scripts/profile_tree_step.py --methods echo-auto,echo-tree --batch-sizes 1,4 --repeats 2

Each (method, batch) runs in a fresh engine process, built exactly as `echo-vllm bench vllm` builds it (same
job, warm-up and ECHO settings); in that process perf_counter wrappers around the step's pieces (engine step,
target forward, stock CPU attention, tree fix-up rows and their plan, tree batch, sampler, KV compaction, the
proposer's selection and tree listing) time the timed generate only. Wrappers nest, so every figure is inclusive;
printed as ms per engine step (and calls per step). Timings on a shared CPU are noisy: compare phases of the
same run and repeat (--repeats, methods interleaved) before believing a difference. Not a test, not a benchmark.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

# (label, module, attribute path): what gets a timer. Class methods are wrapped on the class that defines them.
TIMED = [
    ("execute_model", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model"),
    ("prepare_inputs", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs"),
    ("  publish_tree_batch", "echo_vllm.vllm.patches", "_publish_tree_batch"),
    ("    build_tree_batch", "echo_vllm.vllm.tree_state", "build_tree_batch"),
    ("model_forward", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
    ("  attn_total(tree impl)", "echo_vllm.vllm.tree_attn_cpu", "EchoTreeCPUAttentionImpl.forward"),
    ("  attn_stock_kernel", "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward"),
    ("  fix_tree_rows", "echo_vllm.vllm.tree_attn_cpu", "EchoTreeCPUAttentionImpl._fix_tree_rows"),
    ("    fix_plan(lookup+build)", "echo_vllm.vllm.tree_attn_cpu", "_fix_plan"),
    ("    build_fix_plan", "echo_vllm.vllm.tree_attn_cpu", "_build_fix_plan"),
    ("sample_tokens", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
    ("  rejection_sampler", "vllm.v1.sample.rejection_sampler", "RejectionSampler.forward"),
    ("  tree_sampler", "echo_vllm.vllm.tree_sampler", "EchoTreeRejectionSampler._tree_forward"),
    ("  update_states_after", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states_after_model_execute"),
    ("    compact_tree_step", "echo_vllm.vllm.patches", "_compact_tree_step"),
    ("  base_propose(vLLM loop)", "vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.propose"),
    ("    greedy_sample(vLLM)", "vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._greedy_sample"),
    (
        "    combine_hidden_states",
        "vllm.model_executor.models.llama_eagle3",
        "Eagle3LlamaForCausalLM.combine_hidden_states",
    ),
    ("    set_inputs_first_pass", "echo_vllm.vllm.proposer", "EchoProposer.set_inputs_first_pass"),
    ("      first_pass_rows", "echo_vllm.vllm.proposer", "EchoProposer._first_pass_rows"),
    ("      deferred_merge", "echo_vllm.vllm.deferred_head", "DeferredHeadRows.take_merge"),
    ("  propose_draft_token_ids", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids"),
    ("  bookkeeping_sync", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._bookkeeping_sync"),
    ("  sampler", "vllm.v1.sample.sampler", "Sampler.forward"),
    ("  propose(total)", "echo_vllm.vllm.proposer", "EchoProposer.propose"),
    ("    before_drafting(plan)", "echo_vllm.vllm.proposer", "EchoProposer._before_drafting"),
    ("      budget.plan", "echo_vllm.core.time_budget", "TimeAwareBudget.plan"),
    ("        budget.refit", "echo_vllm.core.time_budget", "TimeAwareBudget.refit"),
    ("    trees_allowed", "echo_vllm.vllm.proposer", "EchoProposer._trees_allowed"),
    ("    defer_newest_rows", "echo_vllm.vllm.proposer", "EchoProposer._defer_newest_rows"),
    ("    sample_draft_tokens", "echo_vllm.vllm.proposer", "EchoProposer._sample_draft_tokens"),
    ("    can_stop(early exit)", "echo_vllm.vllm.proposer", "EchoProposer._can_stop"),
    ("    after_step(cost sample)", "echo_vllm.vllm.proposer", "EchoProposer._after_step"),
    ("    select", "echo_vllm.vllm.proposer", "EchoProposer._select"),
    ("      fused_chain_selection", "echo_vllm.vllm.proposer", "EchoProposer._fused_chain_selection"),
    ("        chain_select_steps(op)", "echo_vllm.vllm.proposer", "chain_select_steps"),
    ("        chain_inputs(torch path)", "echo_vllm.vllm.proposer", "chain_inputs"),
    ("        budget.curves", "echo_vllm.core.time_budget", "TimeAwareBudget.curves"),
    ("      chain_tree", "echo_vllm.vllm.proposer", "EchoProposer._chain_tree"),
    ("      depth_confidence", "echo_vllm.vllm.proposer", "depth_confidence"),
    ("      gates", "echo_vllm.vllm.proposer", "EchoProposer._gates"),
    ("      capped_selection", "echo_vllm.vllm.proposer", "EchoProposer._capped_selection"),
    ("      budget.select", "echo_vllm.core.time_budget", "TimeAwareBudget.select"),
    ("        select_auto", "echo_vllm.core.time_budget", "select_auto"),
    ("        node_gain", "echo_vllm.core.acceptance", "AcceptanceModel.node_gain"),
    ("      stats.record_selection", "echo_vllm.core.metrics", "EchoMetrics.record_selection"),
    ("      stats.record_plan", "echo_vllm.core.metrics", "EchoMetrics.record_plan"),
    ("      account", "echo_vllm.vllm.proposer", "EchoProposer._account"),
    ("        write_step_log", "echo_vllm.vllm.proposer", "EchoProposer._write_step_log"),
    ("        prom.on_step", "echo_vllm.vllm.prom_metrics", "PromExporter.on_step"),
    ("        stats_line", "echo_vllm.vllm.proposer", "format_stats_line"),
    ("      sibling_tree", "echo_vllm.vllm.proposer", "EchoProposer._sibling_tree"),
    ("      emit_trees", "echo_vllm.vllm.proposer", "EchoProposer._emit_trees"),
    ("      spine_first_order", "echo_vllm.vllm.proposer", "spine_first_order"),
    ("    observe_verification", "echo_vllm.vllm.proposer", "EchoProposer.observe_verification"),
    ("      record_realised", "echo_vllm.core.metrics", "EchoMetrics.record_realised"),
    ("      record_verification", "echo_vllm.core.metrics", "EchoMetrics.record_verification"),
    ("      acceptance.record", "echo_vllm.core.acceptance", "AcceptanceModel.record"),
    ("      budget.observe_verif", "echo_vllm.core.time_budget", "TimeAwareBudget.observe_verification"),
    ("      observe_chain(fused)", "echo_vllm.vllm.proposer", "EchoProposer._observe_chain"),
    ("        chain_feedback(op)", "echo_vllm.vllm.proposer", "chain_feedback"),
    ("        record_verif_sums", "echo_vllm.core.metrics", "EchoMetrics.record_verification_sums"),
    ("        budget.observe_levels", "echo_vllm.core.time_budget", "TimeAwareBudget.observe_verification_levels"),
]

_ACC: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])


def _timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc = _ACC[label]
            acc[0] += time.perf_counter() - start
            acc[1] += 1

    return wrapper


def install_timers() -> list[str]:
    missing = []
    for label, module_name, path in TIMED:
        try:
            owner: Any = importlib.import_module(module_name)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            setattr(owner, name, _timed(label, getattr(owner, name)))
        except (ImportError, AttributeError):
            missing.append(label)
    return missing


_FORWARDS: list[tuple[int, float]] = []  # per target forward: (tokens, seconds)


def _record_forwards() -> None:
    """(tokens, seconds) of every target forward: compares methods' forward cost at equal token counts."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    forward = GPUModelRunner._model_forward

    def recorded(self, input_ids=None, positions=None, *a, **k):
        start = time.perf_counter()
        try:
            return forward(self, input_ids, positions, *a, **k)
        finally:
            tokens = positions.shape[-1] if isinstance(positions, torch.Tensor) else -1
            _FORWARDS.append((int(tokens), time.perf_counter() - start))

    GPUModelRunner._model_forward = recorded


_SCHEDULED: list[tuple[int, int, int]] = []  # per engine step: (requests, tokens, scheduled draft tokens)


def _record_schedule() -> None:
    """Requests and tokens the scheduler put in each step: methods may differ in how full their steps are."""
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule

    def recorded(self, *a, **k):
        out = schedule(self, *a, **k)
        spec = sum(len(v) for v in (out.scheduled_spec_decode_tokens or {}).values())
        _SCHEDULED.append((len(out.num_scheduled_tokens), int(out.total_num_scheduled_tokens), spec))
        return out

    Scheduler.schedule = recorded


_STEP: dict[str, Any] = {"tree": False, "drafted_tree": False}
_STEPS: list[tuple[bool, bool, float]] = []  # per engine step: (verified a tree, drafted a tree, seconds)


def _classify_steps() -> None:
    """Per engine step: did it verify a published TreeBatch, did its proposer draft trees; and its time."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from echo_vllm.vllm import patches, proposer

    step, publish, sibling = LLMEngine.step, patches._publish_tree_batch, proposer.EchoProposer._sibling_tree

    def timed_step(self, *a, **k):
        _STEP.update(tree=False, drafted_tree=False)
        start = time.perf_counter()
        try:
            return step(self, *a, **k)
        finally:
            _STEPS.append((_STEP["tree"], _STEP["drafted_tree"], time.perf_counter() - start))

    def flagged_publish(runner, *a, **k):
        from echo_vllm.vllm import tree_state

        out = publish(runner, *a, **k)
        _STEP["tree"] = tree_state.current() is not None
        return out

    def flagged_sibling(self, *a, **k):
        _STEP["drafted_tree"] = True
        return sibling(self, *a, **k)

    LLMEngine.step, patches._publish_tree_batch = timed_step, flagged_publish
    proposer.EchoProposer._sibling_tree = flagged_sibling


def child() -> int:
    """One job (stdin); timers on from the warm-up on (--all-steps) or after it; prints the accumulators as JSON."""
    from echo_vllm.vllm import offline

    job = json.loads(sys.stdin.read())
    all_steps = os.environ.get("ECHO_PROFILE_ALL_STEPS") == "1"
    original_warm_up = offline._warm_up
    missing: list[str] = []

    cprofile_top = int(os.environ.get("ECHO_PROFILE_CPROFILE", "0"))
    profiler = None

    def warm_up_then_time(llm, job_, params):
        nonlocal profiler
        if all_steps:
            _classify_steps()
            missing.extend(install_timers())
        result = original_warm_up(llm, job_, params)
        if not all_steps:
            _classify_steps()
            missing.extend(install_timers())
        _record_forwards()
        _record_schedule()
        if cprofile_top:  # function-level view of the timed generate (the engine core runs in this process)
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        return result

    offline._warm_up = warm_up_then_time
    result = offline.run_job(job)
    steps = _ACC["execute_model"][1] or 1
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
        stats.print_stats(r"echo_vllm|spec_decode|torch/_tensor|builtins", cprofile_top)
        sys.stderr.write(f"CPROFILE ({steps} steps)\n" + out.getvalue())
    kinds = {}
    for name, pick in (("chain", (False, False)), ("drafts_tree", (False, True)), ("verifies_tree", (True, None))):
        sel = [t for v, d, t in _STEPS if v == pick[0] and (pick[1] is None or d == pick[1])]
        kinds[name] = {"n": len(sel), "ms": 1e3 * sum(sel) / max(1, len(sel))}
    report = {
        "steps": steps,
        "step_kinds": kinds,
        "forwards": _FORWARDS,
        "scheduled": _SCHEDULED,
        "step_kinds_raw": _STEPS,
        "generate_seconds": result["generate_seconds"],
        "tok_s": result["num_generated"] / result["generate_seconds"],
        "tokens_per_step": result["num_generated"] / steps,
        "phases": {
            label: {"ms": 1e3 * t / steps, "calls": n / steps, "ms_per_call": 1e3 * t / max(1, n)}
            for label, (t, n) in _ACC.items()
        },
        "missing": missing,
        "trees": (result.get("echo_stats") or {}).get("trees"),
        "echo_stats": result.get("echo_stats"),
        "finish_steps": result.get("finish_steps"),
    }
    sys.stdout.write("PROFILE:" + json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


def run_one(method: str, batch_size: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from echo_vllm.bench.vllm_cli import plan_from_args
    from echo_vllm.bench.vllm_run import build_job
    from echo_vllm.runtime_env import cpu_runtime_env, job_temp_dir

    ns = argparse.Namespace(
        methods=method, eagle3_depths=[args.eagle3_depth], depth=args.echo_depth, top_k=4, k_max=args.k_max if args.k_max == "auto" else int(args.k_max), warmup_steps=16,
        profile_steps=30,
        surplus_tail=True, dataset="humaneval", testbed=None, limit=args.limit, max_tokens=args.max_tokens,
        batch_sizes=[batch_size], rounds=1,
    )  # fmt: skip
    plan = plan_from_args(ns)
    work.mkdir(parents=True, exist_ok=True)
    job, env_extra = build_job(plan, plan.variants[-1], batch_size, work, profile_key=True)
    echo_block = (job.get("speculative_config") or {}).get("echo")
    if args.echo and echo_block is not None:  # KEY=VALUE settings into an ECHO job's echo block (JSON values)
        echo = echo_block
        for item in args.echo:
            key, _, value = item.partition("=")
            try:
                echo[key] = json.loads(value)
            except json.JSONDecodeError:
                echo[key] = value
    env = cpu_runtime_env(os.environ, in_process=True)
    env.update(env_extra)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    env["ECHO_PROFILE_ALL_STEPS"] = "1" if args.all_steps else "0"
    env["ECHO_PROFILE_CPROFILE"] = str(args.cprofile)
    with job_temp_dir(env) as job_env:  # sockets, temp files go with the job (it ends with os._exit)
        proc = subprocess.run(
            [sys.executable, __file__, "--child"], input=json.dumps(job), capture_output=True, text=True,
            env=job_env, timeout=1200,
        )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROFILE:")]
    if args.cprofile:
        text = proc.stderr
        print(text[text.find("CPROFILE") :] if "CPROFILE" in text else "(no cProfile output)")
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"profile job failed (rc={proc.returncode}):\n" + "\n".join(proc.stderr.splitlines()[-30:]))
    return json.loads(lines[-1][len("PROFILE:") :])


def phase_split(sched: list[tuple[int, int, int]], times: list[float], batch_size: int) -> str:
    """Where a job's time went: the ramp (steps before the batch first fills), the full phase (from the first full
    step to the last) and the drain (after the last full step: the queue is empty and the batch shrinks). A method
    that spreads its requests' progress (deep drafts for some, none for others) drains longer at low batch, where a
    step is cheap but emits little; the drain's steps and seconds show it beside the full phase's."""
    full = [i for i, (r, _, _) in enumerate(sched) if r >= batch_size]
    if not full:
        return f"phases: no full step (all {len(sched)} steps below {batch_size} requests, {sum(times):.2f} s)"
    first, last = full[0], full[-1]
    parts = {"ramp": range(0, first), "full": range(first, last + 1), "drain": range(last + 1, len(sched))}
    return "phases: " + ", ".join(
        f"{name} {len(idx)} steps {sum(times[i] for i in idx):.2f} s" for name, idx in parts.items()
    )


def work_split(sched: list[tuple[int, int, int]], times: list[float], batch_size: int) -> str:
    """Before the drain, the steps whose forward carries prompt tokens (tokens > requests + drafts: chunks of joining
    requests) apart from the decode-only ones, with the prompt tokens; and the drain's request-steps (the decoding
    left when the queue ran empty). Why: at batch 64 on the testbed (256 prompts of ~147 tokens, 64 tokens each)
    most of a job's time is in prompt steps, and a method whose full phase ends sooner (in steps) can still end it
    later in seconds and leave the drain more work (ECHO 1,522 drain request-steps against EAGLE-3@1's 1,077)."""
    full = [i for i, (r, _, _) in enumerate(sched) if r >= batch_size]
    if not full:
        return "work: no full step"
    end = full[-1] + 1
    prompt = [i for i in range(end) if sched[i][1] > sched[i][0] + sched[i][2]]
    decode = [i for i in range(end) if sched[i][1] <= sched[i][0] + sched[i][2]]
    prompt_tokens = sum(sched[i][1] - sched[i][0] - sched[i][2] for i in prompt)
    drain_requests = sum(r for r, _, _ in sched[end:])
    return (
        f"work: prompt steps {len(prompt)} ({sum(times[i] for i in prompt):.2f} s, {prompt_tokens} prompt tokens), "
        f"decode-only steps {len(decode)} ({sum(times[i] for i in decode):.2f} s) before the drain; "
        f"drain {drain_requests} request-steps"
    )


def main() -> int:
    if "--child" in sys.argv:
        return child()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="echo-auto,echo-tree")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--eagle3-depth", type=int, default=4, help="the depth of the eagle3 method")
    parser.add_argument("--echo-depth", type=int, default=4, help="the max draft depth of the echo methods")
    parser.add_argument("--k-max", default="auto", help="k_max of the echo method (echo-auto/echo-tree: auto)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--echo", action="append", default=[], help="KEY=VALUE into the echo settings (repeatable)")
    parser.add_argument("--work", type=Path, default=None, help="keep each job's files (step log, profile) here")
    parser.add_argument(
        "--cprofile", type=int, default=0, help="also print the N functions with the most own time (cProfile)"
    )
    parser.add_argument(
        "--all-steps", action="store_true", help="time the warm-up too (its profile phase drafts trees every step)"
    )
    args = parser.parse_args()
    import contextlib
    import tempfile

    from echo_vllm.bench.flights import request_flights

    runs = []
    keep = contextlib.nullcontext(str(args.work)) if args.work else tempfile.TemporaryDirectory()
    with keep as tmp:
        for r in range(args.repeats):
            for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
                methods = args.methods.split(",")
                for method in methods if r % 2 == 0 else methods[::-1]:
                    rep = run_one(method, batch_size, args, Path(tmp) / f"{method}-{batch_size}-{r}")
                    rep.update(method=method, batch=batch_size, round=r)
                    runs.append(rep)
                    print(
                        f"\n== {method} batch {batch_size} round {r}: {rep['steps']} steps, "
                        f"{rep['tok_s']:.0f} tok/s, {rep['tokens_per_step']:.2f} tok/step, trees={rep['trees']}"
                    )
                    sched = rep.get("scheduled") or []
                    if sched:
                        n = len(sched)
                        print(
                            f"  scheduled per step: {sum(r for r, _, _ in sched) / n:.2f} requests, "
                            f"{sum(t for _, t, _ in sched) / n:.1f} tokens ({sum(d for _, _, d in sched) / n:.1f} drafts); "
                            f"steps with fewer than {batch_size} requests: {sum(r < batch_size for r, _, _ in sched)} of {n}"
                        )
                        # Full decode-only steps (every slot decoding, no prompt tokens): the steady step's cost.
                        # Both lists start after the warm-up unless --all-steps timed the warm-up's steps too.
                        raw = rep.get("step_kinds_raw") or []
                        times = [t for _, _, t in raw] if len(raw) == len(sched) else []
                        full = sorted(t for (r, tok, d), t in zip(sched, times) if r == batch_size and tok == r + d)
                        if full:
                            print(
                                f"  full decode-only steps: {len(full)}, median {1e3 * full[len(full) // 2]:.2f} ms "
                                f"({batch_size / full[len(full) // 2]:.0f} requests/s)"
                            )
                        if times:
                            print("  " + phase_split(sched, times, batch_size))
                            print("  " + work_split(sched, times, batch_size))
                    if rep.get("finish_steps"):  # steps in flight per request (echo_vllm.bench.flights)
                        fl = request_flights(rep["finish_steps"], batch_size)
                        print(
                            f"  requests in flight: median {fl.median:.0f} steps, the last admitted request "
                            f"{fl.last_admitted}; slowest (request, steps): {fl.slowest}"
                        )
                    for kind, k in rep["step_kinds"].items():
                        print(f"  steps {kind:<22} n={k['n']:4d}  {k['ms']:8.3f} ms/step (engine step)")
                    for label, _, _ in TIMED:
                        ph = rep["phases"].get(label)
                        if ph:
                            print(
                                f"  {label:<28} {ph['ms']:8.3f} ms/step  {ph['calls']:6.2f} calls/step  "
                                f"{ph['ms_per_call']:8.3f} ms/call"
                            )
                    sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    from echo_vllm.vllm.offline import exit_hard

    exit_hard(main())
