"""What an ECHO step log (ECHO_VLLM_STEP_LOG) says about the depth plan and the step costs (docs/benchmarks.md).

    PYTHONPATH=. python scripts/profile_tree_step.py --methods echo-auto --batch-sizes 32 --limit 128 \
        --max-tokens 64 --work DIR
    python scripts/step_log_summary.py DIR/echo-auto-32-0/steps.jsonl

Prints, for the `phase: auto` lines: how often each draft depth was planned, the median time outside the proposer
(`rest_s`) by batch and by tokens beyond the batch in the step's forward (verified drafts, and prefill chunks
where requests joined), the median proposer time by drafted depth (`draft_s` is the previous step's, so it is
paired with the previous line), the continuation rates P(accept depth j | reached j - 1) of the verified
drafts, and per drafted depth how much of the draft loop's work past depth 1 the selection verified (`deep_levels`:
vLLM's loop drafts every row at every level, ECHO verifies a share of them). Reporting only; plain Python, no torch.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from echo_vllm.vllm.step_log import read_step_log


def deep_levels(lines: list[dict]) -> dict[int, tuple[int, float, float, float]]:
    """Per drafted depth d >= 2 over the non-probe steps: (steps, rows per step, rows that verified past depth 1,
    share of the drafted row-levels past depth 1 that were verified: sum_i max(0, min(K_i, d) - 1) over B (d - 1)).
    A row-level drafted and not verified is draft work for nothing (at batch 64 on the testbed ~0.13 ms each)."""
    steps: Counter[int] = Counter()
    rows: Counter[int] = Counter()
    deep_rows: Counter[int] = Counter()
    used: Counter[int] = Counter()
    for line in lines:
        depth = line.get("drafted_depth", 0)
        if depth < 2 or line.get("probe") or line.get("probe_rows", 0):
            continue
        counts = line["counts"]
        steps[depth] += 1
        rows[depth] += len(counts)
        deep_rows[depth] += sum(1 for k in counts if k >= 2)
        used[depth] += sum(max(0, min(k, depth) - 1) for k in counts)
    return {
        d: (n, rows[d] / n, deep_rows[d] / n, used[d] / (rows[d] * (d - 1)) if rows[d] else 0.0)
        for d, n in sorted(steps.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("step_log", type=Path)
    parser.add_argument("--bucket", type=int, default=16, help="width of the extra-token buckets")
    parser.add_argument("--batch-bucket", type=int, default=1, help="width of the batch-size buckets")
    args = parser.parse_args()
    lines = read_step_log(args.step_log)
    auto = [r for r in lines if r.get("phase") == "auto"]
    print(f"{len(lines)} lines, {len(auto)} in phase auto")
    planned = Counter(r["draft_depth"] for r in auto)
    print("planned draft depth:", ", ".join(f"{d}: {n}" for d, n in sorted(planned.items())))

    rest: defaultdict[tuple[int, int], list[float]] = defaultdict(list)
    for r in auto:
        extra = r["num_tokens"] - r["batch"]
        batch = r["batch"] // args.batch_bucket * args.batch_bucket
        rest[(batch, extra // args.bucket * args.bucket)].append(1e3 * r["rest_s"])
    print("rest_s median (ms) by batch and extra tokens:")
    for (batch, extra), times in sorted(rest.items()):
        print(f"  batch {batch:4d}  extra {extra:5d}-{extra + args.bucket - 1:<5d} n={len(times):4d}  "
              f"{statistics.median(times):8.2f}")  # fmt: skip

    draft: defaultdict[int, list[float]] = defaultdict(list)
    tried: Counter[int] = Counter()
    passed: Counter[int] = Counter()
    for prev, cur in zip(auto, auto[1:]):
        if cur["step"] != prev["step"] + 1:
            continue
        draft[prev["drafted_depth"]].append(1e3 * cur["draft_s"])
        counts = [c for c in prev["counts"] if c > 0]
        accepted = cur.get("accepted") or []
        if len(accepted) != len(counts):  # requests joined or left between the two steps: not paired
            continue
        for count, acc in zip(counts, accepted):
            for j in range(1, count + 1):
                if acc >= j - 1:
                    tried[j] += 1
                    passed[j] += acc >= j
    print("proposer time median (ms) by drafted depth:")
    for depth, times in sorted(draft.items()):
        print(f"  depth {depth}  n={len(times):4d}  {statistics.median(times):8.2f}")
    rates = ", ".join(f"{j}: {passed[j] / tried[j]:.3f} (n={tried[j]})" for j in sorted(tried))
    print("continuation P(accept j | reached j - 1):", rates or "none")
    print("drafted past depth 1 and verified (non-probe steps):")
    for depth, (n, per_step, deep, share) in deep_levels(auto).items():
        print(f"  depth {depth}  n={n:4d}  rows {per_step:6.1f}  rows verified past 1 {deep:6.1f}  "
              f"row-levels used {100 * share:5.1f} %")  # fmt: skip


if __name__ == "__main__":
    main()
