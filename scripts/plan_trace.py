"""What the depth plan did over a job, from ECHO's step log: the plan step by step, and where the time went.

    PYTHONPATH=. python scripts/profile_tree_step.py --methods echo-auto --batch-sizes 64 --limit 256 \\
        --max-tokens 64 --work DIR
    python scripts/plan_trace.py --last 182 DIR/echo-auto-64-0/steps.jsonl [more jobs' step logs]

--last N keeps the last N lines (the timed generate: profile_tree_step prints its step count; the log also holds
the warm-up generate). Attribution as in scripts/policy_blocks.py: line t carries the proposer time of step t - 1
(`draft_s`), the time outside the proposer of step t (`rest_s`: its forward verifying step t - 1's selection) and
what that forward accepted, so all three belong to line t - 1's decision. Prints:

- the plan as one character per step ("0"-"9" the drafted depth, "P" a probe), with the batch size every 16
  steps: a plan that swings between plain decoding and deep drafts shows at a glance;
- per decision kind (plain, d1.., probe): steps, share of the job's time, emitted tokens per step and tokens/s,
  over every step (prompt rows and the drain included: what the job paid);
- per kind, the full-batch decode steps only (no prompt rows): their median measured ms, their median verified
  drafts, and the cost model's price of a step at the drafted depth with every draft verified ("model_ms_all":
  line t - 1's "model_ms", the plan's price of that depth). A step the budget cut verified fewer drafts than that
  (compare "verified" with batch x depth) and costs less than "model_ms_all" without any mispricing: the price at
  the verified drafts is `scripts/refit_step_log.py --profile`'s (the thirty-sixth session read the difference at
  batch 32 depth 3, ~4 ms, as a mispricing; it was the cut drafts);
- per depth, the plan's optimism: the value it held for a depth (line t's "depth_values", relative to plain
  decoding) less what the step planned at t realised for it in hindsight (line t + 1's "level_rates"), averaged
  over the auto steps that drafted that depth ("chosen"), over those that drafted deeper (the depth measured there
  too: "other_measured"), over those that drafted shallower (the depth's level imputed from continuation rates:
  "other_imputed") and over probes that measured it ("probe"). Chosen running high against other_measured is the
  argmax of noisy averages picking their noise. A probe verifies every draft, so its levels price full
  verification where the plan's price the budget's cut (imputed deeper levels extend only the requests verified
  to the end): "probe" running high mixes that difference with any error of the imputation (thirty-seventh
  session, batch 16 and 32: depth 4 +0.14-0.16 of the plain rate). Plain steps and static policy blocks are left
  out;
- with --windows N: per window of N consecutive decisions, per drafted depth, the mean of (measured ms - the
  model's price at that depth with every draft verified, "model_ms" of the deciding line) over the full-batch
  decode steps, their count and the share of their drafts verified. A step the budget cut costs less than that
  price without any mispricing, so a share below 1 biases the difference low: windows running dearer than the
  model despite the cut are a cost model out of date between refits (the fortieth session's batch-8 window
  trace: depth 3-4 steps 1.6-3.7 ms dearer than the model in force).

Reporting only; plain Python, no vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

from echo_vllm.vllm.step_log import read_step_log

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_blocks import step_kind as kind_of  # the same kinds as the policy-block view


def plan_string(lines: list[dict]) -> str:
    return "".join("P" if kind_of(r) == "probe" else str(min(9, r.get("drafted_depth", 0))) for r in lines)


def attributed_steps(lines: list[dict]) -> list[dict]:
    """One entry per decision (line t - 1) with the step it paid for (line t): kind, batch, seconds, emitted
    tokens, whether the forward carried prompt rows, and the cost model's price at the drafted depth."""
    out = []
    for before, after in zip(lines, lines[1:]):
        batch = before["batch"]
        prompt_rows = after["num_tokens"] - after["batch"] - after.get("verified_in_forward", 0)
        model = before.get("model_ms")
        depth = before.get("drafted_depth", 0)
        out.append({
            "kind": kind_of(before),
            "batch": batch,
            "seconds": after["draft_s"] + after["rest_s"],
            "emitted": float(after["batch"] + sum(after.get("accepted") or [])),
            "prompt": prompt_rows > 0,
            "full_decode": prompt_rows <= 0 and after["batch"] == batch,
            "verified": after.get("verified_in_forward", 0),
            "depth": depth,
            "model_ms": model[min(depth, len(model) - 1)] if model else None,
        })  # fmt: skip
    return out


def summarise(steps: list[dict]) -> dict[str, dict]:
    total = sum(s["seconds"] for s in steps) or 1.0
    full = Counter(s["batch"] for s in steps).most_common(1)[0][0] if steps else 0
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        by_kind[s["kind"]].append(s)
    table = {}
    for kind, rows in sorted(by_kind.items()):
        seconds = sum(r["seconds"] for r in rows)
        emitted = sum(r["emitted"] for r in rows)
        decode = [r for r in rows if r["full_decode"] and r["batch"] == full]
        priced = [r["model_ms"] for r in decode if r["model_ms"] is not None]
        table[kind] = {
            "steps": len(rows),
            "time_share": round(seconds / total, 3),
            "tokens_per_step": round(emitted / len(rows), 2),
            "tokens_per_s": round(emitted / seconds, 1) if seconds > 0 else None,
            "full_decode_steps": len(decode),
            "full_decode_ms": round(1e3 * statistics.median(r["seconds"] for r in decode), 2) if decode else None,
            "verified": statistics.median(r["verified"] for r in decode) if decode else None,
            "model_ms_all": round(statistics.median(priced), 2) if priced else None,
        }
    return table


def pricing_windows(steps: list[dict], size: int) -> list[dict]:
    """Per window of `size` consecutive decisions: its first decision's index and, per kind "d<depth>",
    [mean measured-minus-priced ms, steps, share of the drafts verified] over the window's full-batch decode steps of
    the job's most common batch that carry a price. Probes and plain steps are left out (a probe's decision is not
    the plan's; a plain step has no drafts to price)."""
    full = Counter(s["batch"] for s in steps).most_common(1)[0][0] if steps else 0
    out = []
    for start in range(0, len(steps), size):
        errors: dict[str, list[float]] = defaultdict(list)
        shares: dict[str, list[float]] = defaultdict(list)
        for s in steps[start : start + size]:
            priced = s["model_ms"] is not None and s["depth"] > 0 and s["kind"] == f"d{s['depth']}"
            if priced and s["full_decode"] and s["batch"] == full:
                errors[s["kind"]].append(1e3 * s["seconds"] - s["model_ms"])
                shares[s["kind"]].append(s["verified"] / (s["batch"] * s["depth"]))
        out.append(
            {"start": start}
            | {
                k: [round(statistics.mean(v), 2), len(v), round(statistics.mean(shares[k]), 2)]
                for k, v in sorted(errors.items())
            }
        )
    return out


def optimism(*runs: list[dict]) -> dict[int, dict]:
    """Per depth d >= 1: the mean and count of (value held - value realised) over the auto steps that drafted d
    ("chosen"), deeper ("other_measured"), shallower ("other_imputed"), and over probes drafting at least d ("probe"),
    pooled over the runs (each one job's lines: no pair crosses from one job into the next).
    Line t's values planned step t; line t + 1's level rates are step t's verified selection in hindsight (the same
    scale: relative to plain decoding)."""
    groups = ("chosen", "other_measured", "other_imputed", "probe")
    sums: dict[int, dict[str, list[float]]] = defaultdict(lambda: {g: [] for g in groups})
    pairs = [pair for lines in runs for pair in zip(lines, lines[1:])]
    for before, after in pairs:
        values, realised = before.get("depth_values"), after.get("level_rates")
        depth, kind = before.get("drafted_depth", 0), kind_of(before)
        if kind == "plain" or before.get("policy", "auto") != "auto":
            continue
        if not values or not realised or len(values) != len(realised) or None in values:
            continue
        for d in range(1, len(values)):
            if kind == "probe":
                group = "probe" if d <= depth else None
            else:
                group = "chosen" if d == depth else "other_measured" if d < depth else "other_imputed"
            if group is not None:
                sums[d][group].append(values[d] - realised[d])
    return {
        d: {g: (round(statistics.mean(rows[g]), 4) if rows[g] else None) for g in groups}
        | {f"{g}_steps": len(rows[g]) for g in groups}
        for d, rows in sorted(sums.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_logs", type=Path, nargs="+", help="one job's step log each")
    parser.add_argument("--last", type=int, default=0, help="keep the last N lines (0: every auto-phase line)")
    parser.add_argument("--windows", type=int, default=0, help="measured - priced ms per window of N decisions")
    args = parser.parse_args()
    runs = []
    for path in args.step_logs:
        lines = read_step_log(path)
        lines = lines[-args.last :] if args.last > 0 else [r for r in lines if r.get("phase") == "auto"]
        runs.append(lines)
        print(path)
        plan = plan_string(lines)
        for start in range(0, len(plan), 64):
            batches = " ".join(f"{r['batch']:>3}" for r in lines[start : start + 64 : 16])
            print(f"{start:>5} {plan[start : start + 64]:<64}  batch every 16: {batches}")
        steps = attributed_steps(lines)
        print(f"{len(steps)} steps, {sum(s['seconds'] for s in steps):.2f} s, "
              f"{sum(s['emitted'] for s in steps) / max(1e-9, sum(s['seconds'] for s in steps)):.1f} tok/s")  # fmt: skip
        for kind, row in summarise(steps).items():
            print(f"  {kind:<6} {json.dumps(row)}")
        if args.windows > 0:
            print(
                f"  measured - priced ms per {args.windows} decisions ([mean, steps, verified share] per drafted depth):"
            )
            for window in pricing_windows(steps, args.windows):
                print(f"    {json.dumps(window)}")
    pooled = f", pooled over {len(runs)} jobs" if len(runs) > 1 else ""
    print(f"optimism (value held - realised; chosen, drafted deeper, drafted shallower, probes{pooled}):")
    for depth, row in optimism(*runs).items():
        print(f"  d{depth} {json.dumps(row)}")


if __name__ == "__main__":
    main()
