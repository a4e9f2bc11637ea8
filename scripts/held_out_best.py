"""ECHO against the best baseline picked on other rounds: how much of "eagle3-best" is the winner's curse? (#12)

    python scripts/held_out_best.py docs/results/bench-vllm-2026-12-05-s22a.json [--method echo-auto]
    python scripts/held_out_best.py RUN1.json RUN2.json RUN3.json   # the rounds of several runs, pooled

`echo-vllm bench vllm` reports each method's median over the rounds and the best baseline as the largest of
those medians (no-spec and EAGLE-3 at every depth). Where several baselines are near-equal and noisy (batch 64
on the testbed), the largest of their medians is biased upwards: it picks whichever got the luckier rounds.
An operator tunes on one run and serves on later ones. This replays that from the per-round figures the results
document keeps (`tokens_per_s_rounds`): for each round r, the baseline with the best median over the *other*
rounds, and ECHO's tokens/s in round r over that baseline's in round r; printed beside the benchmark's own
ratio. Several documents (runs of the same command) pool their rounds (`pool_rounds`): a round stays paired
within its run, and each pick comes from every other round of every run. Reporting only; it reads the JSON and
needs no engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BASELINES = ("nospec", "eagle3")


def _name(row: dict[str, Any]) -> str:
    return f"eagle3@{row['depth']}" if row["method"] == "eagle3" else str(row["method"])


def pool_rounds(documents: Sequence[Sequence[dict[str, Any]]], method: str) -> list[dict[str, Any]]:
    """The rows of several runs' `results` as one run's: per batch size, each method's rounds run after run, every
    method cut to the rounds all of that batch size's methods have in that run (so round k of every method is the
    same round), and only the methods every run measured there (a baseline one run lacks would be picked on the
    others' rounds alone)."""
    rows_by_key: dict[tuple[int, str], dict[str, Any]] = {}
    for batch in sorted({int(r["batch_size"]) for doc in documents for r in doc}):
        per_run = [
            {
                _name(r): r
                for r in doc
                if int(r["batch_size"]) == batch and (r["method"] in BASELINES or r["method"] == method)
            }
            for doc in documents
        ]
        common = set.intersection(*(set(run) for run in per_run)) if per_run else set()
        if method not in common:
            continue
        for run in per_run:
            rounds = min(len(run[name]["tokens_per_s_rounds"]) for name in common)
            for name in sorted(common):
                row = run[name]
                pooled = rows_by_key.setdefault((batch, name), {**row, "tokens_per_s_rounds": []})
                pooled["tokens_per_s_rounds"] = [*pooled["tokens_per_s_rounds"], *row["tokens_per_s_rounds"][:rounds]]
    return list(rows_by_key.values())


def held_out(results: Sequence[dict[str, Any]], method: str) -> list[dict[str, Any]]:
    """Per batch size: the benchmark's ratio (median over the best median) and the held-out picks and ratios."""
    out = []
    for batch in sorted({int(r["batch_size"]) for r in results}):
        rows = [r for r in results if int(r["batch_size"]) == batch]
        base = {_name(r): list(r["tokens_per_s_rounds"]) for r in rows if r["method"] in BASELINES}
        mine = [r for r in rows if r["method"] == method]
        if not base or not mine:
            continue
        ours = list(mine[0]["tokens_per_s_rounds"])
        rounds = min([len(ours), *(len(v) for v in base.values())])
        picks, ratios = [], []
        for k in range(rounds):
            if rounds < 2:
                break
            others = {name: statistics.median([v[j] for j in range(rounds) if j != k]) for name, v in base.items()}
            pick = max(others, key=lambda name: others[name])
            picks.append(pick)
            ratios.append(ours[k] / base[pick][k])
        best = max(statistics.median(v[:rounds]) for v in base.values())
        out.append({
            "batch_size": batch,
            "ratio_vs_best_median": statistics.median(ours[:rounds]) / best,
            "held_out_picks": picks,
            "held_out_ratios": ratios,
            "held_out_ratio": statistics.median(ratios) if ratios else None,
        })  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "results", type=Path, nargs="+", help="results documents of `echo-vllm bench vllm --json` (several: pooled)"
    )
    parser.add_argument("--method", default="echo-auto")
    args = parser.parse_args(argv)
    documents = [json.loads(path.read_text())["results"] for path in args.results]
    results = documents[0] if len(documents) == 1 else pool_rounds(documents, args.method)
    for row in held_out(results, args.method):
        held = "n/a" if row["held_out_ratio"] is None else f"{row['held_out_ratio']:.3f}"
        per_round = ", ".join(f"{p} {x:.3f}" for p, x in zip(row["held_out_picks"], row["held_out_ratios"]))
        print(
            f"batch {row['batch_size']:>3}: {args.method} / best median {row['ratio_vs_best_median']:.3f}; "
            f"held out {held} (per round: {per_round})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
