"""A/B of one ECHO method against itself with some `echo` settings changed, interleaved, on the CPU testbed.

    PYTHONPATH=. python scripts/ab_echo_settings.py --method echo-auto --set defer_plain_head=false \
        --batch-sizes 8,32 --rounds 3

Per batch size and round: no-spec, the method as `echo-vllm bench vllm` runs it (A) and the same job with the
`--set` overrides (B), in a rotating order; each job a fresh engine built exactly as the benchmark builds it (same
prompts, warm-up, prefix caching off). Prints median tok/s [min-max] per variant, B/A and A/no-spec, and from
`echo_stats()` the mean draft depth, verified drafts per step, ms per step and the deferred-head counters.
Greedy output is checked against no-spec in every job. An experiment tool, not the benchmark of record.
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


def main() -> int:
    from echo_vllm.bench.vllm_cli import plan_from_args
    from echo_vllm.bench.vllm_run import build_job
    from echo_vllm.vllm.offline import run_in_subprocess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="echo-auto")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE of the echo block for variant B")
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: give KEY=VALUE")
        overrides[key] = _value(value)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            ns = argparse.Namespace(
                methods=f"nospec,{args.method}", eagle3_depths=[1], depth=4, top_k=4, k_max=16, warmup_steps=16,
                profile_steps=24, surplus_tail=True, dataset="humaneval", testbed=None, limit=args.limit,
                max_tokens=args.max_tokens, batch_sizes=[batch_size], rounds=args.rounds,
            )  # fmt: skip
            plan = plan_from_args(ns)
            nospec, method = plan.variants[0], plan.variants[-1]
            runs: dict[str, list[dict[str, Any]]] = {"nospec": [], "A": [], "B": []}
            order = ["nospec", "A", "B"]
            for r in range(args.rounds):
                for name in order[r % 3 :] + order[: r % 3]:
                    work = Path(tmp) / f"{batch_size}-{r}-{name}"
                    work.mkdir(parents=True)
                    job, env = build_job(
                        plan, nospec if name == "nospec" else method, batch_size, work, profile_key=True
                    )
                    if name == "B":
                        job["speculative_config"]["echo"].update(overrides)
                    out = run_in_subprocess(job, extra_env=env, timeout=1800)
                    tok_s = out["num_generated"] / out["generate_seconds"]
                    runs[name].append({"tok_s": tok_s, "token_ids": out["token_ids"], "stats": out.get("echo_stats")})
                    print(f"[ab] batch {batch_size} round {r} {name}: {tok_s:.1f} tok/s", flush=True)
            base_tokens = runs["nospec"][0]["token_ids"]
            medians = {k: statistics.median(x["tok_s"] for x in v) for k, v in runs.items()}
            for name in ("nospec", "A", "B"):
                rows = runs[name]
                stats = [x["stats"] or {} for x in rows]

                def mean(key: str, stats=stats) -> float | None:
                    vals = [s[key] for s in stats if isinstance(s.get(key), int | float)]
                    return round(statistics.mean(vals), 3) if vals else None

                row = {
                    "batch_size": batch_size,
                    "variant": name,
                    "settings": overrides if name == "B" else {},
                    "tok_s": round(medians[name], 1),
                    "tok_s_min": round(min(x["tok_s"] for x in rows), 1),
                    "tok_s_max": round(max(x["tok_s"] for x in rows), 1),
                    "vs_nospec": round(medians[name] / medians["nospec"], 3),
                    "identical": all(x["token_ids"] == base_tokens for x in rows),
                    "mean_draft_depth": mean("mean_draft_depth"),
                    "mean_step_sum": mean("mean_step_sum"),
                    "ms_per_step": [s.get("ms_per_step") for s in stats if s.get("ms_per_step")][:1],
                    "deferred_head": [s.get("deferred_head") for s in stats][:1],
                }
                results.append(row)
                print(json.dumps(row), flush=True)
            print(f"[ab] batch {batch_size}: B/A {medians['B'] / medians['A']:.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
