"""The time-aware budget's cost model refitted offline from an ECHO step log, and priced against the log's steps.

    PYTHONPATH=. python scripts/profile_tree_step.py --methods echo-auto --batch-sizes 64 --limit 256 \\
        --max-tokens 64 --work DIR
    PYTHONPATH=. python scripts/refit_step_log.py DIR/echo-auto-64-0/steps.jsonl [--profile DIR/.../budget_profile.json]

Each line pair (t, t + 1) of one rank becomes the cost sample the proposer adds at step t (`StepSample`): line t's
forward (`num_tokens`, `batch`, `verified_in_forward`, `context_tokens`, `rest_s`) and line t + 1's `draft_s`,
which is step t's proposer time (the log writes a step's line while its proposer still runs). The samples are fitted
with `fit_cost_model`, the same fit the budget runs online, and the script prints:

- the fit: its median relative error and its terms (first pass, chained-loop entry, per depth);
- per drafted depth at the log's most common batch, decode steps only (no prompt rows in the forward): the
  measured median proposer and outside-proposer milliseconds beside the refit's prices (and `--profile`'s);
- the proposer-time residual (measured - priced) of decode steps and of steps whose forward carried prompt rows,
  with the latter's median milliseconds per prompt row left after the model's `prompt_row_s`: a clearly positive
  value says the model underprices the steps where requests join (their prompt rows run through the draft head's
  first pass) — a profile from before the term (`--profile`), or a per-row cost the fit has not caught up with.

Reporting only (no vLLM); older logs without `merged_rows` / `tree_rows` count them as 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from echo_vllm.core.budget_profile import load_cost_model
from echo_vllm.core.cost_model import CostModel, StepSample, fit_cost_model
from echo_vllm.vllm.step_log import read_step_log


def samples_from_log(lines: list[dict]) -> list[StepSample]:
    """The proposer's cost samples, rebuilt: line t's forward with line t + 1's proposer time (same rank, next step)."""
    samples = []
    for line, after in zip(lines, lines[1:]):
        if after.get("step") != line.get("step", -2) + 1 or after.get("rank", 0) != line.get("rank", 0):
            continue  # a new generate's log, or another rank's line between
        if line["batch"] <= 0 or line["rest_s"] <= 0 or after["draft_s"] < 0:
            continue  # the first step of a run has no outside time yet (StepSamples.add drops these too)
        sample = StepSample(
            line["num_tokens"], line["batch"], line.get("drafted_depth", 0), line["rest_s"], after["draft_s"],
            line.get("tree_rows", 0), line.get("verified_in_forward", 0), line.get("merged_rows", 0),
            line.get("context_tokens", 0), bool(line.get("tree_step", False)),
            line.get("head_cut", 0) - line.get("head_kv", 0),  # the free rows: written ones still cost per row
        )  # fmt: skip
        samples.append(sample)
    return samples


def draft_price(model: CostModel, s: StepSample) -> float:
    joining = model.prompt_row_s * s.prompt_rows if s.draft_depth >= 1 else 0.0
    return model.draft_seconds(s.batch, s.draft_depth, s.tree_drafted) + model.deferred_row_s * s.merged + joining


def rest_price(model: CostModel, s: StepSample) -> float:
    return (
        model.rest_at(s.num_tokens, s.batch, s.context) + model.verify_at(s.batch, s.verified) + model.tree_at(s.width)
    )


def is_decode(s: StepSample) -> bool:
    """The forward held decode rows only: one per request plus the verified drafts (no prompt chunk)."""
    return s.prompt_rows == 0


def depth_table(samples: list[StepSample], models: dict[str, CostModel], batch: int) -> dict[int, dict]:
    """Per drafted depth at `batch`, decode steps: measured medians (ms) and each model's median prices."""
    by_depth: defaultdict[int, list[StepSample]] = defaultdict(list)
    for s in samples:
        if s.batch == batch and is_decode(s):
            by_depth[s.draft_depth].append(s)
    table = {}
    for depth, rows in sorted(by_depth.items()):
        entry: dict[str, float | int] = {
            "steps": len(rows),
            "draft_ms": round(1e3 * statistics.median(s.draft_s for s in rows), 2),
            "rest_ms": round(1e3 * statistics.median(s.rest_s for s in rows), 2),
        }
        for name, model in models.items():
            entry[f"{name}_draft_ms"] = round(1e3 * statistics.median(draft_price(model, s) for s in rows), 2)
            entry[f"{name}_rest_ms"] = round(1e3 * statistics.median(rest_price(model, s) for s in rows), 2)
        table[depth] = entry
    return table


def first_pass_residual(samples: list[StepSample], model: CostModel) -> dict[str, float | int]:
    """The proposer-time residual (measured - priced, ms) of drafting steps, split: decode steps, and steps whose
    forward carried prompt rows, with the latter's median residual per prompt row (what `prompt_row_s` left)."""
    drafting = [s for s in samples if s.draft_depth >= 1]
    resid = {id(s): 1e3 * (s.draft_s - draft_price(model, s)) for s in drafting}
    decode = [resid[id(s)] for s in drafting if s.prompt_rows == 0]
    joining = [s for s in drafting if s.prompt_rows > 0]
    out: dict[str, float | int] = {"decode_steps": len(decode), "joining_steps": len(joining)}
    if decode:
        out["decode_median_residual_ms"] = round(statistics.median(decode), 3)
    if joining:
        out["joining_median_residual_ms"] = round(statistics.median(resid[id(s)] for s in joining), 3)
        out["ms_per_prompt_row"] = round(statistics.median(resid[id(s)] / s.prompt_rows for s in joining), 5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_log", type=Path)
    parser.add_argument("--last", type=int, default=0, help="keep the last N lines (0: all)")
    parser.add_argument("--profile", type=Path, help="a budget_profile.json to price the same steps with")
    args = parser.parse_args()
    samples = samples_from_log(read_step_log(args.step_log, args.last))
    model = fit_cost_model(samples)
    if model is None:
        raise SystemExit(f"{args.step_log}: fewer than 4 cost samples; nothing to fit")
    models = {"refit": model}
    if args.profile is not None:
        models["profile"] = load_cost_model(args.profile)
    batch = Counter(s.batch for s in samples).most_common(1)[0][0]
    print(f"{len(samples)} samples; refit error {model.fit_error:.3f}; most common batch {batch}")
    print(f"  draft ms at batch {batch} by depth: "
          + " ".join(f"{1e3 * model.draft_seconds(batch, d):.2f}" for d in range(5))
          + f"  (first pass {1e3 * (model.first_pass_terms[0] + model.first_pass_terms[1] * batch):.2f},"
          f" loop entry {1e3 * (model.loop_terms[0] + model.loop_terms[1] * batch):.2f},"
          f" per depth {1e3 * (model.draft_terms[2] + model.draft_terms[3] * batch):.2f})")  # fmt: skip
    for depth, row in depth_table(samples, models, batch).items():
        print(f"  depth {depth}: {json.dumps(row)}")
    print(f"  proposer residual: {json.dumps(first_pass_residual(samples, model))}")


if __name__ == "__main__":
    main()
