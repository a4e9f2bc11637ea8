"""Replays `draft_stop_confidence` on an ECHO step log: how often nodes past a low-confidence frontier were accepted,
and what stopping the draft loop there would have saved.

    PYTHONPATH=. python scripts/profile_tree_step.py --methods echo-auto --batch-sizes 1 --limit 16 \
        --max-tokens 64 --work DIR
    PYTHONPATH=. python scripts/refit_step_log.py DIR/echo-auto-1-0/steps.jsonl   # the per-level draft ms
    python scripts/confidence_stop_replay.py DIR/echo-auto-1-0/steps.jsonl --level-ms 0.92 --base-ms 9.8

First, what lost chains cost (any step log; no confidences needed): of the time-aware, non-probe steps of the log's
most common batch size, how many verified every draft they drafted ("sum" = batch x drafted depth: at batch 1 the
budget verifies all it drafts, so the draft loop is what a hopeless chain costs), and per drafted depth how many
steps accepted nothing and how many all of it, the draft levels drafted after every row's first rejected node, and
what a stop at that node (an oracle: it knows the verdict) would save at `--level-ms` per level.

Then it reads the time-aware steps of the log's most common batch size with their logged path confidences ("confidence":
c_{i,d} per request row and drafted depth) and, from the next line, what each request accepted. Prints:

- per depth d, how many requests reached past it (accepted d + 1 drafts) by log2 bins of their c_d: the
  acceptance of the nodes a stop at depth d would not draft;
- the replay of "stop once every row's c_d < 2^t, from depth 2 on" (`draft_stop_confidence`'s rule) and of "once
  the rows' c_d summed are below 2^t" for a range of t: steps stopped, tokens lost and tokens per ms relative to
  drafting on, pricing a step at `--base-ms` plus `--level-ms` per drafted level plus `--token-ms` per verified
  draft (the step barely grows with the tokens verified at batch 1; at larger batches give --token-ms, from
  `scripts/refit_step_log.py`; every draft is taken as verified, so a log whose budget cut drafts replays rougher).

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


def lost_chain_costs(lines: list[dict], base_ms: float, level_ms: float) -> dict:
    """Verified-all steps and, per drafted depth, the levels drafted past every row's first rejection (see the
    module doc), over the time-aware, non-probe steps of the most common batch whose next line reports every row.
    A row the budget cut (K_i below the drafted depth) counts as rejected at its cut: its deeper drafts were not
    verified either, so on logs whose steps did not all verify everything ("verified_all" below "steps") the levels
    counted are those past every row's last verified accepted draft."""
    batches = Counter(line["batch"] for line in lines if line.get("phase") == "auto")
    if not batches:
        return {"steps": 0}
    batch = batches.most_common(1)[0][0]
    steps = verified_all = 0
    time_ms = wasted_ms = 0.0
    by_depth: dict[int, dict[str, float]] = defaultdict(lambda: {"steps": 0, "none": 0, "all": 0, "after": 0})
    for line, after in zip(lines, lines[1:]):
        depth, accepted = line.get("drafted_depth", 0), after.get("accepted") or []
        if line.get("phase") != "auto" or line.get("probe") or line.get("probe_rows", 0) or line["batch"] != batch:
            continue
        if depth < 1 or len(accepted) != batch:
            continue
        reach = max(accepted)  # the shared loop is lost once every row is: past the deepest row's first rejection
        past = max(0, depth - reach - 1)
        steps += 1
        verified_all += line.get("sum") == batch * depth
        cell = by_depth[depth]
        cell["steps"] += 1
        cell["none"] += reach == 0
        cell["all"] += min(accepted) >= depth
        cell["after"] += past
        time_ms += base_ms + level_ms * depth
        wasted_ms += level_ms * past
    table = {d: {**c, "after": round(c["after"] / c["steps"], 2)} for d, c in sorted(by_depth.items())}
    return {
        "batch": batch,
        "steps": steps,
        "verified_all": verified_all,
        "levels_after_first_rejection": table,
        "oracle_stop_saves": round(wasted_ms / time_ms, 4) if time_ms else 0.0,
    }


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
    steps: list[tuple[int, list[list[float]], list[int]]],
    log2_threshold: float,
    base_ms: float,
    level_ms: float,
    token_ms: float = 0.0,
    rule: str = "every",
) -> dict[str, float]:
    """Tokens and time with the stop at 2^log2_threshold against drafting every planned level. rule "every" (what
    `draft_stop_confidence` does): stop once every row's c_d is below the threshold; "sum": once the rows' c_d
    summed are (a batch-wide bound on the next level's accepted mass). A step is priced at base_ms, plus level_ms
    per drafted level, plus token_ms per verified draft (every draft taken as verified)."""
    threshold = 2.0**log2_threshold
    tokens = time_ms = tokens_on = time_on = 0.0
    stopped = lost = 0
    for depth, confidence, accepted in steps:
        stop = depth
        for d in range(2, depth):
            column = [row[d - 1] for row in confidence]
            if (sum(column) < threshold) if rule == "sum" else all(c < threshold for c in column):
                stop = d
                break
        emitted = sum(1 + a for a in accepted)
        kept = sum(1 + min(a, stop) for a in accepted)
        tokens_on += emitted
        time_on += base_ms + (level_ms + token_ms * len(accepted)) * depth
        tokens += kept
        time_ms += base_ms + (level_ms + token_ms * len(accepted)) * stop
        stopped += stop < depth
        lost += emitted - kept
    ratio = (tokens / time_ms) / (tokens_on / time_on) if tokens_on and time_ms else 1.0
    return {"steps": len(steps), "stopped": stopped, "tokens_lost": lost, "ratio": round(ratio, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_log", type=Path)
    parser.add_argument("--base-ms", type=float, default=9.8, help="a step's time without its chained draft levels")
    parser.add_argument("--level-ms", type=float, default=0.92, help="one chained draft level's time")
    parser.add_argument("--token-ms", type=float, default=0.0, help="one verified draft's time (batch > 1)")
    args = parser.parse_args(argv)
    lines = [json.loads(text) for text in args.step_log.read_text().splitlines() if text.strip()]
    print(f"what lost chains cost: {json.dumps(lost_chain_costs(lines, args.base_ms, args.level_ms))}")
    steps = decode_steps(lines)
    if not steps:
        print("no time-aware steps with logged confidences (a log from before the 'confidence' field?)")
        return 1
    print(f"{len(steps)} steps; accepted past depth d by log2(c_d):")
    for d, bins in sorted(acceptance_by_confidence(steps).items()):
        cells = " ".join(f"2^{b}: {n[1]}/{n[0]}" for b, n in sorted(bins.items()))
        print(f"  after depth {d}: {cells}")
    for rule in ("every", "sum"):
        for t in (-12, -10, -8, -7, -6, -5, -4, -3, -2):
            result = replay(steps, t, args.base_ms, args.level_ms, args.token_ms, rule)
            print(f"  stop once {rule} c_d < 2^{t}: {json.dumps(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
