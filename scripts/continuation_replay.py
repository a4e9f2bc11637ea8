"""The depth plan's continuation rates over a job, replayed from ECHO's step log under both `continuation_memory`s.

    PYTHONPATH=. python scripts/profile_tree_step.py --methods echo-auto --batch-sizes 16 --limit 64 \\
        --max-tokens 64 --work DIR
    PYTHONPATH=. python scripts/continuation_replay.py --every 12 DIR/echo-auto-16-0/steps.jsonl

Line t's selection (`counts`: K_i drafts per request, `drafted_depth`) was verified by the forward whose result
line t + 1 carries (`accepted`, one entry per verified request), so each pair of lines is one verified step: its
continuation events are counted with the engine's own code (`level_counts`, `TimeAwareBudget._count_continuation`)
and the rates P(accept j | accepted j - 1) printed every --every steps (step number, batch, drafted depth, then
depth 1..D per memory). The log holds the warm-up generate before the timed one: the rates the timed part starts
from are what the warm-up left. Reporting only; no vLLM.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from echo_vllm.core.time_budget import TimeAwareBudget, level_counts
from echo_vllm.vllm.step_log import read_step_log

MEMORIES = ("tries", "steps")


def verified_steps(lines: list[dict]) -> list[tuple[dict, list[int], list[int]]]:
    """(line, K_i of the verified requests, their accepted drafts) for every line whose selection was verified:
    drafted at depth >= 1 and the next line lists one accepted count per request that got drafts."""
    steps = []
    for line, result in zip(lines, lines[1:]):
        counts = [int(c) for c in line.get("counts", []) if int(c) > 0]
        accepted = [int(a) for a in result.get("accepted", [])]
        if int(line.get("drafted_depth", 0)) >= 1 and counts and len(counts) == len(accepted):
            steps.append((line, counts, accepted))
    return steps


def replay(lines: list[dict], max_depth: int, every: int = 1) -> list[dict]:
    """Rows {step, batch, depth, <memory>: rates[D]} after every `every`-th verified step."""
    budgets = {
        memory: TimeAwareBudget(
            max_depth, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None,
            continuation_memory=memory,
        )
        for memory in MEMORIES
    }  # fmt: skip
    rows = []
    for index, (line, counts, accepted) in enumerate(verified_steps(lines)):
        drafted = min(int(line["drafted_depth"]), max_depth)
        depths = torch.zeros((len(counts), drafted), dtype=torch.long)
        for i, k in enumerate(counts):
            depths[i, : min(k, drafted)] = torch.arange(1, min(k, drafted) + 1)
        _, _, tried, passed, _, _ = level_counts(torch.tensor(accepted), depths, drafted)
        for budget in budgets.values():
            budget._count_continuation(tried, passed)
        if index % every == 0:
            row = {"step": line.get("step"), "batch": line.get("batch"), "depth": drafted}
            row.update({memory: budget._continuation_rates() for memory, budget in budgets.items()})
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step_log", type=Path)
    parser.add_argument("--max-depth", type=int, default=4)
    parser.add_argument("--every", type=int, default=1, help="print every Nth verified step")
    args = parser.parse_args()
    lines = read_step_log(args.step_log)
    print("step batch depth  " + "  ".join(f"{m}: d1..d{args.max_depth}" for m in MEMORIES))
    for row in replay(lines, args.max_depth, args.every):
        rates = "  ".join(" ".join(f"{r:.2f}" for r in row[m]) for m in MEMORIES)
        print(f"{row['step']!s:>4} {row['batch']!s:>5} {row['depth']:>5}  {rates}")


if __name__ == "__main__":
    main()
