"""Interleaved comparison of arbitrary engine variants on the CPU testbed: total and steady-window tokens/s.

    PYTHONPATH=. python scripts/variants_ab.py --batch-sizes 16 --rounds 3 \
        nospec eagle3@2 echo-auto@4 echo-auto@2 'echo-auto@4:probe_interval=0'

A variant is METHOD@DEPTH[:KEY=VALUE,...] (METHOD one of nospec, eagle3, echo, echo-auto, echo-tree; the
KEY=VALUE pairs go into the `echo` block, except env.NAME=VALUE, which sets an environment variable of that
variant's engine process). Per batch size and round every variant runs in a fresh engine built
exactly as `echo-vllm bench vllm` builds it (same prompts, waves, warm-up, prefix caching off), in a rotating
order. Prints, per variant, the median tok/s of the whole timed generate and of its steady window (the steps
while requests waited for a slot) with min-max, the ratio of each to no-spec, the paired ratio per round to the
best of no-spec and the eagle3 variants in that round (and its median), and from `echo_stats()` the mean
draft depth, drafts verified per step and ms per step. Greedy output is checked against no-spec in every job.
An experiment tool (what is worth changing), not the benchmark of record. An A/B of one setting (what
scripts/ab_echo_settings.py did): `nospec echo-auto@4 echo-auto@4:defer_plain_head=false`.

--step-trace times every engine step too (`offline.generate_with_steady_window`'s trace) and prints each
variant's median decode step at full batch ("full_step_ms", steps without prompt tokens), the tokens per such
step and their tokens/s ("full_tokens_per_step", "full_decode_tok_s": speed without prefill or drain); with an ECHO auto variant in the run, each static variant
(nospec, eagle3@d: B x d drafts verified every step) also gets the step time ECHO's fitted cost model predicts
for it ("model_step_ms", from the first ECHO auto job's `echo_stats()["cost_model"]`): where the two part with
the depth, the depth plan's hindsight misprices depth. The trace reads vLLM's counters after every step, which
adds to every variant's total time alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_variant(text: str) -> tuple[str, str, int | None, dict[str, Any]]:
    """(label, method, depth, echo overrides) of METHOD@DEPTH[:KEY=VALUE,...]."""
    head, _, tail = text.partition(":")
    method, _, depth = head.partition("@")
    overrides = {}
    for item in filter(None, tail.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"variant {text!r}: give KEY=VALUE after ':'")
        overrides[key] = _value(value)
    return text, method, int(depth) if depth else None, overrides


def _median_or_none(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 2) if kept else None


def _full_decode_steps(trace: dict[str, list[float]] | None, batch_size: int) -> list[tuple[float, float]]:
    """(seconds, generated tokens) of the decode steps (no prompt tokens) that ran a full batch. Prompt tokens are
    left out because a speculative run admits requests one by one as they finish (many of its steps carry a
    prefill) where a lockstep no-spec run admits a whole wave in one step."""
    if not trace:
        return []
    rows = zip(trace["seconds"], trace["batch"], trace["prompt"], trace["generated"])
    return [(s, g) for s, b, p, g in rows if b >= batch_size and p == 0]


def _full_step_ms(trace: dict[str, list[float]] | None, batch_size: int) -> float | None:
    """Median ms of the full-batch decode steps (None without a trace or such steps)."""
    steps = _full_decode_steps(trace, batch_size)
    return round(1000.0 * statistics.median(s for s, _ in steps), 2) if steps else None


def _full_decode(trace: dict[str, list[float]] | None, batch_size: int) -> tuple[float, float] | None:
    """(tokens per step, tokens per second) over the full-batch decode steps."""
    steps = _full_decode_steps(trace, batch_size)
    if not steps:
        return None
    seconds, tokens = sum(s for s, _ in steps), sum(g for _, g in steps)
    return tokens / len(steps), tokens / seconds


def _model_step_ms(runs: dict[str, list[dict[str, Any]]], variant: Any, batch_size: int) -> float | None:
    """ECHO's fitted cost model's step time for a static variant at full batch: B x d drafts verified, drafted to d."""
    from echo_vllm.core.cost_model import CostModel

    if variant.method not in ("nospec", "eagle3"):
        return None
    vector = next(
        (x["stats"]["cost_model"] for rows in runs.values() for x in rows if x["stats"].get("cost_model")), None
    )
    if vector is None:
        return None
    # At no context: the fit's context term (seconds per cached token) is left out, so with one the price is the
    # step less what reading the KV cache costs (a lower bound; ECHO's step log carries each step's context).
    model = CostModel.from_vector(vector)
    d = variant.depth if variant.method == "eagle3" else 0
    drafts = batch_size * d
    return round(1000.0 * model.step_seconds(batch_size + drafts, batch_size, d, verified=drafts), 2)


def main() -> int:
    from echo_vllm.bench.vllm_cli import plan_from_args
    from echo_vllm.bench.vllm_plan import Variant, expand_variants
    from echo_vllm.bench.vllm_run import build_job
    from echo_vllm.vllm.offline import run_in_subprocess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--batch-sizes", default="16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--step-trace", action="store_true", help="time each engine step (full-batch medians)")
    args = parser.parse_args()
    specs = [parse_variant(v) for v in args.variants]
    if specs[0][1] != "nospec":
        specs.insert(0, ("nospec", "nospec", None, {}))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            ns = argparse.Namespace(
                methods="nospec,echo-auto", eagle3_depths=[1], depth=4, top_k=4, k_max=16, warmup_steps=16,
                profile_steps=30, surplus_tail=True, dataset="humaneval", testbed=None, limit=args.limit,
                waves=args.waves, max_tokens=args.max_tokens, batch_sizes=[batch_size], rounds=args.rounds,
            )  # fmt: skip
            plan = plan_from_args(ns)
            echo_base = plan.variants[-1].echo
            variants: dict[str, Variant] = {}
            envs: dict[str, dict[str, str]] = {}
            for label, method, depth, overrides in specs:
                if method == "nospec":
                    variants[label] = Variant("nospec")
                    envs[label] = {k[4:]: str(v) for k, v in overrides.items() if k.startswith("env.")}
                    continue
                (base,) = [
                    v
                    for v in expand_variants([method], [depth or 1], depth or 4, {**echo_base, "k_max": 16})
                    if v.method == method
                ]
                echo = {k: v for k, v in overrides.items() if not k.startswith("env.")}
                variants[label] = Variant(base.method, base.depth, {**base.echo, **echo})
                envs[label] = {k[4:]: str(v) for k, v in overrides.items() if k.startswith("env.")}
            labels = list(variants)
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in labels}
            for r in range(args.rounds):
                for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                    work = Path(tmp) / f"{batch_size}-{r}-{len(runs[label])}-{labels.index(label)}"
                    work.mkdir(parents=True)
                    job, env = build_job(plan, variants[label], batch_size, work, profile_key=True)
                    job["step_trace"] = args.step_trace
                    out = run_in_subprocess(job, extra_env={**env, **envs.get(label, {})}, timeout=1800)
                    steady = out.get("steady") or {}
                    row = {
                        "tok_s": out["num_generated"] / out["generate_seconds"],
                        "steady": steady["tokens"] / steady["seconds"] if steady.get("seconds") else None,
                        "token_ids": out["token_ids"],
                        "stats": out.get("echo_stats") or {},
                        "full_step_ms": _full_step_ms(out.get("step_trace"), batch_size),
                        "full_decode": _full_decode(out.get("step_trace"), batch_size),
                        "job_process": out.get("job_process"),  # "forked" with env.ECHO_VLLM_JOB_FORKSERVER=1
                    }
                    runs[label].append(row)
                    print(
                        f"[ab] batch {batch_size} round {r} {label}: {row['tok_s']:.1f} tok/s, steady {row['steady']}"
                        f" ({row['job_process']})",
                        flush=True,
                    )
            base_tokens = runs["nospec"][0]["token_ids"]
            base = statistics.median(x["tok_s"] for x in runs["nospec"])
            base_steady = statistics.median(x["steady"] or 0.0 for x in runs["nospec"])
            # Paired per round: each variant over the best of no-spec and the eagle3 variants in that same round
            # (the machine's speed drifts between rounds; a ratio within a round cancels most of it).
            baselines = [k for k in labels if k == "nospec" or k.startswith("eagle3")]
            best_in_round = [max(runs[k][r]["tok_s"] for k in baselines) for r in range(args.rounds)]
            for label in labels:
                rows = runs[label]
                stats = rows[0]["stats"]

                def mean(key: str, rows=rows) -> float | None:
                    vals = [x["stats"][key] for x in rows if isinstance(x["stats"].get(key), int | float)]
                    return round(statistics.mean(vals), 3) if vals else None

                tok = statistics.median(x["tok_s"] for x in rows)
                steady_vals = [x["steady"] for x in rows if x["steady"]]
                steady = statistics.median(steady_vals) if steady_vals else None
                row = {
                    "batch_size": batch_size,
                    "variant": label,
                    "tok_s": round(tok, 1),
                    "tok_s_range": [round(min(x["tok_s"] for x in rows), 1), round(max(x["tok_s"] for x in rows), 1)],
                    "vs_nospec": round(tok / base, 3),
                    "steady": round(steady, 1) if steady else None,
                    "steady_range": [round(min(steady_vals), 1), round(max(steady_vals), 1)] if steady_vals else None,
                    "steady_vs_nospec": round(steady / base_steady, 3) if steady and base_steady else None,
                    "tok_s_rounds": [round(x["tok_s"], 1) for x in rows],
                    "job_processes": sorted({str(x["job_process"]) for x in rows}),
                    "vs_best_in_round": [round(x["tok_s"] / b, 3) for x, b in zip(rows, best_in_round)],
                    "vs_best_in_round_median": round(
                        statistics.median(x["tok_s"] / b for x, b in zip(rows, best_in_round)), 3
                    ),
                    "identical": all(x["token_ids"] == base_tokens for x in rows),
                    "mean_draft_depth": mean("mean_draft_depth"),
                    "mean_step_sum": mean("mean_step_sum"),
                    "ms_per_step": stats.get("ms_per_step"),
                    "full_step_ms": _median_or_none([x["full_step_ms"] for x in rows]),
                    # Full-batch decode steps only: tokens per step and tokens per second (median over rounds).
                    "full_tokens_per_step": _median_or_none([x["full_decode"][0] for x in rows if x["full_decode"]]),
                    "full_decode_tok_s": _median_or_none([x["full_decode"][1] for x in rows if x["full_decode"]]),
                    "model_step_ms": _model_step_ms(runs, variants[label], batch_size),
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
