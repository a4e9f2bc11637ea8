"""Policies compared in blocks within one engine (ECHO_VLLM_POLICY_BLOCKS): tokens per second of each, paired.

    ECHO_VLLM_POLICY_BLOCKS=auto,static:2 PYTHONPATH=. python scripts/profile_tree_step.py --methods echo-auto \\
        --batch-sizes 16 --limit 64 --max-tokens 64 --work DIR
    python scripts/policy_blocks.py DIR/echo-auto-16-0/steps.jsonl

Job-to-job drift on the testbed (+-15 %) is larger than the differences between budget policies, so separate jobs
cannot rank them; blocks of a few steps alternating in one engine can. A step-log line t carries the time of the
proposer of step t - 1 (`draft_s`), the time outside the proposer of step t (`rest_s`, its target forward verifying
step t - 1's selection) and what that forward accepted: all three belong to step t - 1's policy. Counted are the
decode steps at the run's most common batch size (no prompt tokens in the forward). Prints per policy: steps,
emitted tokens per step, ms per step, tokens/s, and each block's tokens/s over that of the nearest preceding block
of the first policy (median, min-max): the paired view. Reporting only; plain Python.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from echo_vllm.vllm.step_log import read_step_log


def step_kind(line: dict) -> str:
    """What a step did: "probe" (full or partial), "plain" (drafted nothing) or "d<depth drafted>"."""
    if line.get("probe") or line.get("probe_rows", 0):
        return "probe"
    depth = line.get("drafted_depth", line.get("draft_depth", 0))
    return "plain" if depth == 0 else f"d{depth}"


def decode_steps(lines: list[dict], with_prompts: bool = False) -> list[tuple[str, int, float, float, str]]:
    """(policy, block, emitted tokens, seconds, step kind) per full-batch decode step, attributed to the previous
    line."""
    auto = [r for r in lines if r.get("phase") == "auto"]
    if not auto:
        return []
    full = Counter(r["batch"] for r in auto).most_common(1)[0][0]
    out = []
    block, last_policy = 0, None
    for prev, line in zip(lines, lines[1:]):
        policy = prev.get("policy")
        if prev.get("phase") != "auto" or policy is None:
            continue
        if policy != last_policy:
            block, last_policy = block + 1, policy
        if line["batch"] != full or prev["batch"] != full or line["rest_s"] is None or line["draft_s"] is None:
            continue
        if not with_prompts and line["num_tokens"] != line["batch"] + line["verified_in_forward"]:
            continue  # prompt tokens in this forward
        emitted = line["batch"] + sum(line["accepted"] or [])
        out.append((policy, block, float(emitted), float(line["rest_s"]) + float(line["draft_s"]), step_kind(prev)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("step_logs", type=Path, nargs="+")
    parser.add_argument(
        "--kinds", action="store_true", help="also split each policy's steps by kind: plain, d<depth>, probe"
    )
    parser.add_argument(
        "--with-prompts",
        action="store_true",
        help="also count full-batch steps whose forward carried prompt tokens (under continuous admission at large "
        "batch most steps do; each such step counted as emitting batch + accepted tokens)",
    )
    args = parser.parse_args()
    rows = []
    kinds: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    for path in args.step_logs:
        lines = read_step_log(path)
        for p, b, e, s, kind in decode_steps(lines, args.with_prompts):
            rows.append((p, f"{path}:{b}", e, s))
            acc = kinds[p][kind]
            acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + e, acc[2] + s
    by_policy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    by_block: dict[str, tuple[str, list[tuple[float, float]]]] = {}
    order: list[str] = []
    for policy, block, emitted, seconds in rows:
        if policy not in order:
            order.append(policy)
        by_policy[policy].append((emitted, seconds))
        by_block.setdefault(block, (policy, []))[1].append((emitted, seconds))
    for policy in order:
        v = by_policy[policy]
        tokens, seconds = sum(e for e, _ in v), sum(s for _, s in v)
        print(
            f"{policy:<10} steps {len(v):4d}  tokens/step {tokens / len(v):6.2f}  ms/step {1e3 * seconds / len(v):6.2f}"
            f"  tok/s {tokens / seconds:7.1f}"
        )
        if args.kinds:  # where the policy's time went: e.g. auto's probes at batch 64 (seventeenth session)
            for kind, (steps, emitted, secs) in sorted(kinds[policy].items()):
                print(
                    f"  {kind:<8} steps {int(steps):4d}  share of time {secs / seconds:5.1%}  tok/s {emitted / secs:7.1f}"
                )
    if len(order) < 2:
        return
    # Paired: each block of a later policy against the nearest preceding block of the first policy.
    blocks = list(by_block.items())
    for policy in order[1:]:
        ratios = []
        ref = None
        for _, (p, v) in blocks:
            rate = sum(e for e, _ in v) / max(sum(s for _, s in v), 1e-12)
            if p == order[0]:
                ref = rate
            elif p == policy and ref is not None:
                ratios.append(rate / ref)
        if ratios:
            print(
                f"{policy} / {order[0]} per block pair: median {statistics.median(ratios):.3f} "
                f"[{min(ratios):.3f}..{max(ratios):.3f}] over {len(ratios)} pairs"
            )


if __name__ == "__main__":
    main()
