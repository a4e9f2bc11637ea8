"""Replay an ECHO step log through the depth plan's hindsight: what each draft depth was worth, step by step.

    PYTHONPATH=. python scripts/hindsight_replay.py WORK/echo-auto-16-0/steps.jsonl --batch 16

Fits the cost model on every step of the log (or loads `--profile`), then feeds each verified step of `--batch`
requests (its accepted counts and the previous step's selection, chains) to `TimeAwareBudget.observe_verification`
and prints the mean level rate per depth 0..D relative to plain decoding: the numbers the plan ranks depths by,
under a model fitted on the whole run rather than the one the run had at that step. Also prints, per (previous,
this) planned depth, the measured tokens/s of full-batch steps without prefill.

Alignment: a step-log line's `draft_s` is the PREVIOUS step's proposer time (the current one is still running
when the line is written); a step's own time is its `rest_s` plus the next line's `draft_s`. Regressing a line's
`draft_s` on its own `verified_in_forward` shows a cost per verified draft that is the previous step's depth
showing through (ninth session: ~0.22 ms per draft misaligned, ~0 aligned). An experiment tool, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from echo_vllm.vllm.step_log import read_step_log


def main() -> int:
    import torch

    from echo_vllm.core.budget_profile import load_cost_model
    from echo_vllm.core.cost_model import StepSample, fit_cost_model
    from echo_vllm.core.time_budget import TimeAwareBudget

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step_log", type=Path)
    parser.add_argument("--batch", type=int, required=True, help="replay the steps of exactly this many requests")
    parser.add_argument("--max-depth", type=int, default=4)
    parser.add_argument("--profile", type=Path, default=None, help="a budget profile instead of a fit on the log")
    args = parser.parse_args()
    rows = read_step_log(args.step_log)
    rows = [r for r in rows if r.get("rank", 0) == 0]
    if args.profile is not None:
        cost = load_cost_model(args.profile)
    else:
        samples = [
            StepSample(
                r["num_tokens"], r["batch"], r.get("drafted_depth", r["draft_depth"]), r["rest_s"], nxt["draft_s"],
                0, r.get("verified_in_forward", 0), 0, r.get("context_tokens", 0),
            )
            for r, nxt in zip(rows, rows[1:])
            if r.get("phase") in ("auto", "profile")
        ]  # fmt: skip
        cost = fit_cost_model(samples)
        if cost is None:
            print("too few steps to fit a cost model", file=sys.stderr)
            return 2
    print(f"cost model: fit error {cost.fit_error:.3f} over {cost.num_samples} steps")
    print(
        f"  at batch {args.batch}: draft(d) ms",
        [round(1000 * cost.draft_seconds(args.batch, d), 1) for d in range(args.max_depth + 1)],
        "rest(B + k) ms for k = 0, B, 2B, ..:",
        [round(1000 * cost.rest_at(args.batch * (1 + j), args.batch), 1) for j in range(args.max_depth + 1)],
    )
    budget = TimeAwareBudget(args.max_depth, profile_steps=1, probe_interval=0, surplus_tail=True, profile_path=None)
    budget.cost_model = cost
    levels: list[list[float]] = []
    for prev, row in zip(rows, rows[1:]):
        if row.get("phase") != "auto" or prev.get("phase") != "auto" or row["batch"] != args.batch:
            continue
        budget.set_step_context(row.get("context_tokens", 0))  # the forward that verified: its cached tokens
        counts = [c for c in prev.get("counts", []) if c > 0]
        if not row["accepted"] or len(counts) != len(row["accepted"]):
            continue  # a plain step, or requests joined / left in between
        depth = max(counts)
        verified = torch.tensor([[j + 1 if j < c else 0 for j in range(depth)] for c in counts])
        budget.observe_verification(
            torch.tensor(row["accepted"]), verified, row["batch"], prev.get("drafted_depth", prev["draft_depth"])
        )
        levels.append(budget.controller.last_levels)
    print(f"replayed {len(levels)} verified steps of batch {args.batch}")
    for d in range(args.max_depth + 1):
        values = [lv[d] for lv in levels if len(lv) > d]
        if values:
            print(f"  depth {d}: mean level {statistics.mean(values):.3f} (relative to plain), {len(values)} steps")
    groups: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for prev, row, nxt in zip(rows, rows[1:], rows[2:]):
        if row.get("phase") != "auto" or row["batch"] != args.batch:
            continue
        if row["num_tokens"] - row["batch"] - row.get("verified_in_forward", 0) > 0:
            continue  # a prefill chunk rode along
        g = groups[(prev["draft_depth"], row["draft_depth"])]
        g[0] += row["batch"] + sum(row["accepted"])
        g[1] += row["rest_s"] + nxt["draft_s"]
        g[2] += 1
    print("measured full-batch decode steps by (previous, this) planned depth (selection-biased: the plan picks")
    print("deep in easy stretches):")
    for key, (tokens, seconds, n) in sorted(groups.items()):
        print(f"  {key}: {int(n):4d} steps, {tokens / seconds:6.0f} tok/s, {1000 * seconds / n:6.1f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
