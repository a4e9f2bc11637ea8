"""Replays `draft_stop_confidence` on an ECHO step log: how often nodes past a low-confidence frontier were accepted,
and what stopping the draft loop there would have saved.

    PYTHONPATH=. python scripts/profile_tree_step.py --methods echo-auto --batch-sizes 1 --limit 16 \
        --max-tokens 64 --work DIR
    PYTHONPATH=. python scripts/refit_step_log.py DIR/echo-auto-1-0/steps.jsonl   # the per-level draft ms
    python scripts/confidence_stop_replay.py DIR/echo-auto-1-0/steps.jsonl --level-ms 0.92 --base-ms 9.8

Reads the time-aware steps of the log's most common batch size with their logged path confidences ("confidence":
c_{i,d} per request row and drafted depth) and, from the next line, what each request accepted. Prints:

- per depth d, how many requests reached past it (accepted d + 1 drafts) by log2 bins of their c_d: the
  acceptance of the nodes a stop at depth d would not draft;
- the replay of "stop once every row's c_d < 2^t, from depth 2 on" for a range of t: steps stopped, tokens lost
  and tokens per ms relative to drafting on, pricing a step at `--base-ms` plus `--level-ms` per drafted level (the
  step barely grows with the tokens verified at batch 1; a replay at larger batches is rougher).

A log written with the stop on shows its stopped steps as drafted shorter than planned: replay one written with
`draft_stop_confidence: 0`. Reporting only (no vLLM).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path


def decode_steps(lines: list[dict]) -> list[tuple[int, list[list[float]], list[int]]]:
    """(drafted depth, confidences [B][d], accepted per row) of each time-aware, non-probe step of the most common
    batch whose next line reports what every row accepted."""
    batches = Counter(line["batch"] for line in lines if line.get("phase") == "auto")
    if not batches:
        return []
    batch = batches.most_common(1)[0][0]
    out = []
    for line, after in zip(lines, lines[1:]):
        if line.get("phase") != "auto" or line.get("probe") or line["batch"] != batch:
            continue
        confidence, accepted = line.get("confidence") or [], after.get("accepted") or []
        depth = line.get("drafted_depth", 0)
        if depth < 1 or len(confidence) != batch or len(accepted) != batch:
            continue
        out.append((depth, [row[:depth] for row in confidence], list(accepted)))
    return out


def acceptance_by_confidence(steps: list[tuple[int, list[list[float]], list[int]]]) -> dict[int, dict[int, list[int]]]:
    """depth d -> log2 bin of c_d -> [rows that drafted past d, rows that accepted d + 1 drafts]."""
    table: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for depth, confidence, accepted in steps:
        for row, taken in zip(confidence, accepted):
            for d in range(1, depth):
                cell = table[d][max(-12, math.floor(math.log2(max(row[d - 1], 1e-12))))]
                cell[0] += 1
                cell[1] += int(taken >= d + 1)
    return table


def replay(
    steps: list[tuple[int, list[list[float]], list[int]]], log2_threshold: float, base_ms: float, level_ms: float
) -> dict[str, float]:
    """Tokens and time with the stop at 2^log2_threshold against drafting every planned level."""
    threshold = 2.0**log2_threshold
    tokens = time_ms = tokens_on = time_on = 0.0
    stopped = lost = 0
    for depth, confidence, accepted in steps:
        stop = depth
        for d in range(2, depth):
            if all(row[d - 1] < threshold for row in confidence):
                stop = d
                break
        emitted = sum(1 + a for a in accepted)
        kept = sum(1 + min(a, stop) for a in accepted)
        tokens_on += emitted
        time_on += base_ms + level_ms * depth
        tokens += kept
        time_ms += base_ms + level_ms * stop
        stopped += stop < depth
        lost += emitted - kept
    ratio = (tokens / time_ms) / (tokens_on / time_on) if tokens_on and time_ms else 1.0
    return {"steps": len(steps), "stopped": stopped, "tokens_lost": lost, "ratio": round(ratio, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_log", type=Path)
    parser.add_argument("--base-ms", type=float, default=9.8, help="a step's time without its chained draft levels")
    parser.add_argument("--level-ms", type=float, default=0.92, help="one chained draft level's time")
    args = parser.parse_args(argv)
    lines = [json.loads(text) for text in args.step_log.read_text().splitlines() if text.strip()]
    steps = decode_steps(lines)
    if not steps:
        print("no time-aware steps with logged confidences (a log from before the 'confidence' field?)")
        return 1
    print(f"{len(steps)} steps; accepted past depth d by log2(c_d):")
    for d, bins in sorted(acceptance_by_confidence(steps).items()):
        cells = " ".join(f"2^{b}: {n[1]}/{n[0]}" for b, n in sorted(bins.items()))
        print(f"  after depth {d}: {cells}")
    for t in (-12, -10, -8, -7, -6, -5, -4):
        print(f"  stop below 2^{t}: {json.dumps(replay(steps, t, args.base_ms, args.level_ms))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
