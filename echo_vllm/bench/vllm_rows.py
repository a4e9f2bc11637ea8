"""From the jobs of `bench vllm` to its result rows: per-round figures, medians over rounds, `eagle3-best`, ratios.

Pure functions over the JSON the offline jobs return (echo_vllm.vllm.offline), so they are tested with
synthetic job outputs. Definitions (the columns of docs/benchmarks.md):

  tokens_per_s                 emitted tokens / seconds of the timed generate; the row has the median over
                               rounds and the min and max
  tokens_per_request_step      emitted tokens / request-steps over all running requests, a request that got no
                               drafts counting as one step with one token. request-steps: counted by vLLM, one
                               per request-step that emitted (its time-to-first-token and inter-token-latency
                               observations; `request_steps` of the job), exact for every method. Jobs without
                               them: max(E - A, P + D), E emitted, A accepted drafts, P prompts, D request-steps
                               with drafts, both lower bounds: E - A short by drafts accepted past max_tokens,
                               P + D by the request-steps without drafts (ECHO's K_i = 0, 23-43 % of ECHO auto's
                               request-steps at batch 4-64 on the testbed; there E - A was the larger and
                               within 2 %)
  requests_per_step            request-steps / engine steps: how full the steps ran. tokens/s = requests_per_step
                               x tokens_per_request_step / ms per step, so the three columns split a gap. A
                               method whose requests progress unevenly (ECHO's budget gives confident requests
                               depth first) drains its last requests over more, emptier steps
  accepted_per_verified_draft  accepted / verified draft tokens (vLLM's counters)
  mean_step_budget             verified draft tokens per engine step (vLLM's counters, every method alike)
  mean_draft_depth             tokens drafted per request per step: EAGLE-3's depth, 0 for no-spec, ECHO's own
                               figure (`mean_draft_depth` of echo_stats) or null where it reports none
  ms_per_step                  "total": generate time / engine steps; ECHO rows add its phases
                               ("draft", "select", "rest") where echo_stats has them
  ratio_vs_nospec              median tokens/s over no-spec's median at the same batch size
  ratio_vs_best_baseline       ... over max(no-spec, eagle3-best), the tuned baseline
  steady_tokens_per_s          tokens / seconds of the steady window of the timed generate (the steps while
                               requests waited for a slot: the engine full, as a server under sustained load;
                               `offline.generate_with_steady_window`); median over rounds, min and max; null when
                               no request waited (one batch of prompts)
  steady_ratio_vs_nospec       steady medians: over no-spec's
  steady_ratio_vs_best_baseline  ... over the best steady median of no-spec and every EAGLE-3 depth
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from echo_vllm.bench.spread import median_or_none, spread
from echo_vllm.bench.vllm_plan import ECHO_METHODS, Variant

# echo_stats keys a row carries (medians over rounds for numbers); those not reported by this ECHO are null.
ECHO_KEYS = (
    "budget_mode",
    "mean_draft_depth",
    "predicted_accepted_per_step",
    "realised_accepted_per_step",
    "cost_fit_error",
    "mean_step_sum",
    "mat",
    "budget_used",
    "truncation_rate",
    "tree_moved",
)
ECHO_PHASES = ("draft", "select", "rest")


def _clean(value: Any) -> Any:
    """NaN (ECHO's "no data") as null: strict JSON readers refuse NaN."""
    return None if isinstance(value, float) and math.isnan(value) else value


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def request_steps(out: Mapping[str, Any]) -> float:
    """See the module docstring: vLLM's count when the job has it, else the larger of two lower bounds."""
    counted = float(out.get("request_steps") or 0)
    if counted > 0:
        return counted
    spec = out["spec"]
    emitted = float(out["num_generated"])
    return max(emitted - float(spec["num_accepted_tokens"]), len(out["token_ids"]) + float(spec["num_drafts"]))


def calibrated(echo_stats: Mapping[str, Any] | None) -> bool | None:
    """Whether ECHO's gates were in place: its calibration source is "warmup" until the warm-up completes."""
    if not isinstance(echo_stats, Mapping) or "calibration" not in echo_stats:
        return None
    return echo_stats["calibration"] != "warmup"


def measure(variant: Variant, out: Mapping[str, Any], oracle: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One round's figures of one variant from its job's output."""
    spec = out["spec"]
    emitted = float(out["num_generated"])
    steps = float(out.get("engine_steps") or 0)
    draft_tokens = float(spec["num_draft_tokens"])
    raw = out.get("echo_stats")
    failed = isinstance(raw, Mapping) and "error" in raw  # the rpc into the worker failed (offline._echo_rpc)
    stats = raw if isinstance(raw, Mapping) and not failed else None
    ms = {"total": 1000.0 * out["generate_seconds"] / steps if steps else None}
    phases = (stats or {}).get("ms_per_step")
    if isinstance(phases, Mapping):
        ms.update({p: _clean(phases.get(p)) for p in ECHO_PHASES})
    if variant.method == "eagle3":
        depth: float | None = float(variant.depth or 0)  # vLLM's EAGLE loop drafts all D tokens for every request
    elif variant.method == "nospec":
        depth = 0.0
    else:
        depth = _clean((stats or {}).get("mean_draft_depth"))
    warmup = out.get("warmup") or {}
    steady = out.get("steady") or {}
    figures = {
        "tokens_per_s": emitted / out["generate_seconds"] if out["generate_seconds"] > 0 else None,
        "steady_tokens_per_s": steady["tokens"] / steady["seconds"] if steady.get("seconds") else None,
        "generate_seconds": out["generate_seconds"],
        "num_generated": emitted,
        "tokens_per_request_step": emitted / request_steps(out) if emitted else None,
        "requests_per_step": request_steps(out) / steps if steps and emitted else None,
        "accepted_per_verified_draft": float(spec["num_accepted_tokens"]) / draft_tokens if draft_tokens else None,
        "mean_step_budget": draft_tokens / steps if steps else None,
        "mean_draft_depth": depth,
        "ms_per_step": ms,
        "engine_steps": steps,
        # A preempted request is recomputed: the batch was not what the row says, so the table flags it.
        "num_preemptions": float((out.get("scheduler") or {}).get("num_preemptions") or 0),
    }
    if variant.method in ECHO_METHODS:
        figures["echo"] = {k: _clean((stats or {}).get(k)) for k in ECHO_KEYS}
        figures["echo_stats_error"] = (
            raw["error"] if failed else ("the engine returned no ECHO statistics" if stats is None else None)
        )
        figures["calibrated_before_timing"] = calibrated(warmup.get("echo_stats"))
        figures.update(dict(oracle or {"oracle_ratio": None, "oracle_reason": "not computed"}))
    return figures


def _median_dict(dicts: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """Key by key: the median of the numbers, else the last non-null value (e.g. budget_mode)."""
    dicts = [d for d in dicts if d]
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    merged: dict[str, Any] = {}
    for key in keys:
        values = [d.get(key) for d in dicts if d.get(key) is not None]
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[key] = median_or_none(values)
        else:
            merged[key] = values[-1] if values else None
    return merged


def aggregate(
    variant: Variant, batch_size: int, rounds: list[dict[str, Any]], identical: list[bool], errors: list[str]
) -> dict[str, Any]:
    """One result row from the rounds of one variant at one batch size (ratios are added by `add_ratios`)."""
    tps = spread(r.get("tokens_per_s") for r in rounds)
    row: dict[str, Any] = {
        "method": variant.method,
        "label": variant.label,
        "batch_size": batch_size,
        "depth": variant.depth if variant.method == "eagle3" else None,
        "max_depth": variant.depth,
        "tokens_per_s": tps.median if tps else None,
        "tokens_per_s_min": tps.min if tps else None,
        "tokens_per_s_max": tps.max if tps else None,
        "tokens_per_s_rounds": [r.get("tokens_per_s") for r in rounds],
        **_steady(rounds),
        "rounds": len(rounds),
        # Greedy tokens identical to no-spec's in every round; a failed round proves nothing, so it is False.
        "identical_to_baseline": bool(identical) and all(identical) and not errors,
        "errors": errors,
    }
    for key in (
        "tokens_per_request_step",
        "requests_per_step",
        "accepted_per_verified_draft",
        "mean_step_budget",
        "mean_draft_depth",
    ):
        row[key] = median_or_none(r.get(key) for r in rounds)
    row["ms_per_step"] = _median_dict(r.get("ms_per_step") for r in rounds)
    row["num_preemptions"] = sum(r.get("num_preemptions") or 0 for r in rounds)
    if variant.method in ECHO_METHODS:
        row["k_max"] = variant.echo.get("k_max")
        row.update({key: None for key in ECHO_KEYS})  # present even when no round succeeded
        row.update(_median_dict(r.get("echo") for r in rounds))
        oracle = spread(r.get("oracle_ratio") for r in rounds)
        row["oracle_ratio"] = oracle.median if oracle else None
        row["oracle_ratio_min"] = oracle.min if oracle else None
        row["oracle_ratio_max"] = oracle.max if oracle else None
        reasons = [r.get("oracle_reason") for r in rounds if r.get("oracle_ratio") is None and r.get("oracle_reason")]
        row["oracle_reason"] = reasons[-1] if reasons and oracle is None else None
        cal = [r.get("calibrated_before_timing") for r in rounds]
        row["calibrated_before_timing"] = None if any(c is None for c in cal) or not cal else all(cal)
        row["echo_stats_errors"] = [r["echo_stats_error"] for r in rounds if r.get("echo_stats_error")]
    return row


def _steady(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    tps = spread(r.get("steady_tokens_per_s") for r in rounds)
    return {
        "steady_tokens_per_s": tps.median if tps else None,
        "steady_tokens_per_s_min": tps.min if tps else None,
        "steady_tokens_per_s_max": tps.max if tps else None,
    }


def add_eagle3_best(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch size, a synthetic `eagle3-best` row: the EAGLE-3 depth with the best median tokens/s."""
    out = list(rows)
    for batch in dict.fromkeys(r["batch_size"] for r in rows):
        eagle = [r for r in rows if r["batch_size"] == batch and r["method"] == "eagle3" and r["tokens_per_s"]]
        if not eagle:
            continue
        best = max(eagle, key=lambda r: r["tokens_per_s"])
        out.append(
            {
                **best,
                "method": "eagle3-best",
                "label": "eagle3-best",
                "best_of_depths": [r["depth"] for r in eagle],
            }
        )
    return out


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ratio_vs_nospec and ratio_vs_best_baseline (best = max(no-spec, eagle3-best)), ratios of medians; the same
    for the steady window (its best baseline is the best steady median of no-spec and every EAGLE-3 depth)."""
    for batch in dict.fromkeys(r["batch_size"] for r in rows):
        at = [r for r in rows if r["batch_size"] == batch]
        nospec = next((r["tokens_per_s"] for r in at if r["method"] == "nospec"), None)
        best_eagle = next((r["tokens_per_s"] for r in at if r["method"] == "eagle3-best"), None)
        baselines = [v for v in (nospec, best_eagle) if v]
        best = max(baselines) if baselines else None
        steady_nospec = next((r.get("steady_tokens_per_s") for r in at if r["method"] == "nospec"), None)
        steady_baselines = [
            r.get("steady_tokens_per_s")
            for r in at
            if r["method"] in ("nospec", "eagle3") and r.get("steady_tokens_per_s")
        ]
        steady_best = max(steady_baselines) if steady_baselines else None
        for row in at:
            row["ratio_vs_nospec"] = _ratio(row["tokens_per_s"], nospec)
            row["ratio_vs_best_baseline"] = _ratio(row["tokens_per_s"], best)
            row["steady_ratio_vs_nospec"] = _ratio(row.get("steady_tokens_per_s"), steady_nospec)
            row["steady_ratio_vs_best_baseline"] = _ratio(row.get("steady_tokens_per_s"), steady_best)
            row["best_baseline"] = (
                None if best is None else ("nospec" if best == nospec else f"eagle3@{_best_depth(at)}")
            )
    return rows


def _best_depth(rows: list[dict[str, Any]]) -> int | None:
    return next((r["depth"] for r in rows if r["method"] == "eagle3-best"), None)


def order_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By batch size, then nospec, eagle3 by depth, eagle3-best, echo, echo-auto."""
    rank = {"nospec": 0, "eagle3": 1, "eagle3-best": 2, "echo": 3, "echo-auto": 4}
    return sorted(rows, key=lambda r: (r["batch_size"], rank.get(r["method"], 9), r.get("depth") or 0))
