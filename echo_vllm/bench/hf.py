"""`echo-vllm bench hf`: every HF-engine method on the same models and prompts, ratios measured in one run.

The protocol (docs/benchmarks.md, "HF engine"): every configuration runs on every prompt, prompt by prompt, in
rounds whose order rotates (A B C, B C A, ...), after the same untimed warm-up; each figure is the median of the
rounds with its min-max, and a speedup is the ratio of medians with the min-max of the same-round ratios. Each method runs at its tuned setting
(`hf_settings`, written by `bench hf-tune` on a disjoint tuning prompt set: the first `tune_prompts` prompts of
each dataset; `bench hf` reports on the prompts after them).

Also the prompt encoding the HF engine's tests share (the testbed's tokenizer.json, prompt tails).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo_vllm.bench import report
from echo_vllm.bench.hf_settings import MethodSetting
from echo_vllm.bench.spread import Spread, spread
from echo_vllm.config import EchoSettings
from echo_vllm.hf.engine import METHOD_SPECS, METHODS, EngineInputError, HFEngine


def load_tokenizer(target_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(target_dir / "tokenizer.json"))


def encode_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    # Keep the end of long prompts: that is where generation continues from.
    return [enc.ids[-max_prompt_tokens:] for enc in tokenizer.encode_batch(prompts)]


PROMPT_SETS = ("report", "tune")


@dataclass(frozen=True)
class Config:
    """One column of an interleaved run: a label (unique in the run) and the method's setting."""

    label: str
    setting: MethodSetting


def split_prompts(total: int, tune_prompts: int, limit: int | None, prompt_set: str) -> list[int]:
    """Prompt indices of one dataset: the tuning set is the first `tune_prompts`, the reported set the `limit`
    prompts after it (all the rest when limit is None). Disjoint and deterministic: tuning never sees a reported
    prompt."""
    if prompt_set not in PROMPT_SETS:
        raise EngineInputError(f"--prompt-set: unknown {prompt_set!r}; choose from {', '.join(PROMPT_SETS)}")
    if tune_prompts < 0:
        raise EngineInputError(f"--tune-prompts must be >= 0; got {tune_prompts}")
    if limit is not None and limit < 1:
        raise EngineInputError(f"--limit must be >= 1; got {limit}")
    if prompt_set == "tune":
        indices = list(range(min(tune_prompts, total)))
        indices = indices[:limit] if limit else indices
    else:
        end = total if limit is None else min(total, tune_prompts + limit)
        indices = list(range(tune_prompts, end))
    if not indices:
        raise EngineInputError(
            f"--prompt-set {prompt_set}: no prompts (dataset has {total}, tuning set {tune_prompts}, limit {limit})"
        )
    return indices


def rotations(items: Sequence[Any], rounds: int) -> list[list[Any]]:
    """Round r runs the items rotated left by r (the protocol's A B C, B C A, C A B, ...)."""
    if rounds < 1:
        raise EngineInputError(f"--rounds must be >= 1; got {rounds}")
    n = len(items)
    return [list(items[r % n :]) + list(items[: r % n]) for r in range(rounds)]


def spread_json(s: Spread | None) -> dict[str, float] | None:
    return None if s is None else {"median": s.median, "min": s.min, "max": s.max, "n": s.n}


def build_engines(
    root: Path, configs: list[Config], base: EchoSettings, drafter: str, drafter_dir: Path
) -> dict[str, HFEngine]:
    """One engine per config, all on one copy of the weights (a speculative engine first: ar shares its weights)."""
    engines: dict[str, HFEngine] = {}
    first_spec: HFEngine | None = None
    for config in sorted(configs, key=lambda c: c.setting.method == "ar"):
        drafts = METHOD_SPECS[config.setting.method].drafts
        engines[config.label] = engine = HFEngine(
            root / "target",
            drafter_dir if drafts else None,
            config.setting.engine_options(base, drafter),
            share_models_with=first_spec,
        )
        if first_spec is None and drafts:
            first_spec = engine
    return engines


def warm_up(engine: HFEngine, prompts: list[list[int]], max_new_tokens: int, base: EchoSettings) -> None:
    """The same untimed warm-up for every engine (the first prompt, max_new_tokens), and for the gated methods
    more prompts (cycled, a bounded number) until they have calibrated and, with k_max 'auto', profiled the step
    cost, so that no timed step is a warm-up step; then the counters start from zero."""
    for i in range(4 * len(prompts)):
        if i > 0 and not engine.warming_up and not _profiling(engine):
            break
        engine.generate(prompts[i % len(prompts)], max_new_tokens)
    engine.reset_counters()


def _profiling(engine: HFEngine) -> bool:
    """k_max 'auto' still measuring its step cost (no cost model fitted yet)."""
    return engine.budget is not None and engine.budget.cost_model is None


def run_configs_interleaved(
    root: Path,
    configs: list[Config],
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    rounds: int = 3,
    base: EchoSettings | None = None,
    drafter: str = "eagle3",
    drafter_dir: Path | None = None,
    progress=None,
) -> dict[str, dict[str, Any]]:
    """Every config on every prompt, prompt by prompt, `rounds` times in rotating order; one config must be ar.

    On a shared machine the load drifts; interleaving gives every config the same mix of quiet and busy moments,
    and rotating the order stops one config from always running right after another. Per config: tokens/s and
    speedup vs ar (ratio to ar in the same round) as median [min-max] over rounds, wall seconds per round, MAT,
    u, verified draft tokens per step, ms per step by phase, and identical_to_ar (every round's output).
    """
    base = base or EchoSettings()
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise EngineInputError(f"configs: labels must be unique; got {labels}")
    ar = [c.label for c in configs if c.setting.method == "ar"]
    if not ar:
        raise EngineInputError("configs: include an ar config (the reference output and speed)")
    engines = build_engines(root, configs, base, drafter, drafter_dir or root / "eagle3")
    for label in labels:
        warm_up(engines[label], prompts, max_new_tokens, base)
    seconds = {label: [0.0] * rounds for label in labels}
    tokens = {label: [0] * rounds for label in labels}
    outputs: dict[str, list[list[list[int]]]] = {label: [[] for _ in range(rounds)] for label in labels}
    for r, order in enumerate(rotations(labels, rounds)):
        for ids in prompts:
            for label in order:
                result = engines[label].generate(ids, max_new_tokens, temperature=temperature)
                outputs[label][r].append(result.token_ids)
                seconds[label][r] += result.seconds
                tokens[label][r] += len(result.token_ids)
            if progress is not None:
                progress.update(1)
    ref = ar[0]
    ar_tps = [t / s for t, s in zip(tokens[ref], seconds[ref], strict=True)]
    runs: dict[str, dict[str, Any]] = {}
    for config in configs:
        label, engine = config.label, engines[config.label]
        tps = [t / s for t, s in zip(tokens[label], seconds[label], strict=True)]
        drafts = METHOD_SPECS[config.setting.method].drafts
        totals = engine.metrics.totals() if drafts else {}
        steps = engine.phases.steps
        runs[label] = {
            "label": label,
            "setting": config.setting,
            "round_tokens_per_s": tps,
            "tokens_per_s": spread(tps),
            "speedup_vs_ar": ratio_spread(tps, ar_tps),
            "wall_s": spread(seconds[label]),
            "tokens": tokens[label],
            "identical_to_ar": all(outputs[label][r] == outputs[ref][r] for r in range(rounds)),
            "metrics": engine.metrics.summary() if drafts else {},
            "depths": engine.depth_summary() if drafts else {},
            "verified_per_step": totals.get("verified", 0.0) / steps if drafts and steps else (0.0 if steps else None),
            "ms_per_step": engine.phases.ms_per_step(),
            "calibration": engine.calibration.to_json_dict() if engine.calibration else None,
            "gates": engine.calibration.describe() if engine.calibration else None,
            "gated_depths": engine.calibration.sweet_spots if engine.calibration else None,
            "max_depth": engine.max_depth,
        }
    return runs


def ratio_spread(a: list[float], b: list[float]) -> Spread:
    """The protocol's ratio: median(a) / median(b) (the ratio of medians), with the min-max of the per-round
    ratios a_r / b_r. With 2 rounds the ratio of medians lies between the round ratios; with more it can fall
    just outside when one round was disturbed."""
    rounds = spread(x / y for x, y in zip(a, b, strict=True))
    ma, mb = spread(a), spread(b)
    assert rounds is not None and ma is not None and mb is not None
    return Spread(ma.median / mb.median, rounds.min, rounds.max, rounds.n)


def round_ratio(runs: dict[str, dict[str, Any]], a: str, b: str) -> Spread | None:
    """Tokens/s of `a` over `b`: the ratio of medians [min-max of the same-round ratios]."""
    return ratio_spread(runs[a]["round_tokens_per_s"], runs[b]["round_tokens_per_s"])


def result_row(run: dict[str, Any], dataset: str, drafter: str, prompt_set: str, indices: list[int]) -> dict[str, Any]:
    """The JSON row of one config on one dataset (the contract: method, dataset, drafter, setting,
    speedup_vs_ar, identical_to_ar, ...)."""
    setting: MethodSetting = run["setting"]
    m = run["metrics"]
    tps, speedup, wall = run["tokens_per_s"], run["speedup_vs_ar"], run["wall_s"]
    return {
        "method": setting.method,
        "label": run["label"],
        "dataset": dataset,
        "drafter": drafter,
        "setting": setting.relevant(),
        "prompt_set": prompt_set,
        "prompt_indices": indices,
        "batch_size": 1,
        "rounds": tps.n,
        "max_depth": run["max_depth"] if setting.method != "ar" else None,
        "wall_s": wall.median,
        "wall_s_min": wall.min,
        "wall_s_max": wall.max,
        "tokens_per_s": tps.median,
        "tokens_per_s_min": tps.min,
        "tokens_per_s_max": tps.max,
        "speedup_vs_ar": speedup.median,
        "speedup_vs_ar_min": speedup.min,
        "speedup_vs_ar_max": speedup.max,
        "round_tokens_per_s": run["round_tokens_per_s"],
        "mat": m.get("mat", 1.0),
        "draft_utilization": m.get("utilization"),  # = u_selected_depth
        "mean_depth_drafted": m.get("mean_depth"),  # (historical name) the mean deepest *selected* depth
        # u = MAT / mean depth, labelled by which depth: the deepest selected node of each step, or the depth the
        # step's tree was drafted to (ddd and the gated methods stop drafting early).
        "u_selected_depth": run["depths"].get("u_selected_depth"),
        "u_drafted_depth": run["depths"].get("u_drafted_depth"),
        "mean_drafted_depth": run["depths"].get("mean_drafted_depth"),
        "verified_per_step": run["verified_per_step"],  # draft tokens verified per decoding step
        "accepted_per_verified_draft": m.get("accepted_per_verified_draft"),
        "budget_used": m.get("budget_used"),
        "identical_to_ar": run["identical_to_ar"],
        "sweet_spots": (run["calibration"] or {}).get("gated"),
        # Which depths are gated and why (Calibration.describe), e.g. "sparse: gates at depths [2, 4] ..."
        "gated_depths": run["gated_depths"],
        "gates": run["gates"],
        # Where a decoding step's time goes (ar: one target forward per token).
        "ms_per_step": run["ms_per_step"],
    }


def dataset_prompts(
    root: Path, dataset: str, tune_prompts: int, limit: int | None, prompt_set: str
) -> tuple[list[int], list[list[int]]]:
    """(indices, encoded prompts) of one dataset's tuning or reported set (last 384 prompt tokens)."""
    from echo_vllm.bench.datasets import load_prompts

    texts = load_prompts(dataset, None)
    indices = split_prompts(len(texts), tune_prompts, limit, prompt_set)
    tokenizer = load_tokenizer(root / "target")
    return indices, encode_prompts(tokenizer, [texts[i] for i in indices], max_prompt_tokens=384)


def shared_settings(base: EchoSettings) -> dict[str, Any]:
    """The EchoSettings every method of a run shares (k_max, top_k and delta are per method: `setting`)."""
    return {k: v for k, v in base.model_dump().items() if k not in ("k_max", "top_k", "delta")}


RATIO_TARGET = 1.05  # issue #14: ECHO's speed >= 1.05 x the best-tuned eagle2 and tuned ddd
RATIO_BASELINES = ("eagle2", "ddd")


def bench_hf(
    root: Path,
    methods: list[str],
    datasets: list[str],
    limit: int,
    max_new_tokens: int,
    settings: dict[str, MethodSetting],
    base: EchoSettings | None = None,
    temperature: float = 0.0,
    json_path: str | None = None,
    rounds: int = 3,
    tune_prompts: int = 6,
    prompt_set: str = "report",
    drafter: str = "eagle3",
    drafter_dir: Path | None = None,
    extra_json: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every method at its setting (`settings[method]`), ar first, on each dataset's reported prompts (or the
    tuning prompts when asked); returns {"results": rows, "ratios": echo vs eagle2 / ddd per dataset}."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise EngineInputError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        tqdm = None
    base = base or EchoSettings()
    order = ["ar", *[m for m in methods if m != "ar"]]
    configs = [Config(m, settings.get(m) or MethodSetting(method=m)) for m in order]
    results: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    prompt_info: dict[str, list[int]] = {}
    for dataset in datasets:
        indices, prompts = dataset_prompts(root, dataset, tune_prompts, limit, prompt_set)
        prompt_info[dataset] = indices
        log(f"[bench hf] {dataset}: {prompt_set} prompts {indices[0]}..{indices[-1]} ({len(indices)}), {rounds} rounds")
        progress = (
            tqdm(total=len(prompts) * rounds, desc=f"{dataset} ({', '.join(order)})", leave=False) if tqdm else None
        )
        runs = run_configs_interleaved(
            root, configs, prompts, max_new_tokens, temperature, rounds, base, drafter, drafter_dir, progress
        )
        if progress is not None:
            progress.close()
        for method in methods:
            results.append(result_row(runs[method], dataset, drafter, prompt_set, indices))
        if "echo" in runs:
            for other in RATIO_BASELINES:
                if other in runs:
                    r = round_ratio(runs, "echo", other)
                    ratios.append(
                        {"dataset": dataset, "drafter": drafter, "a": "echo", "b": other, "ratio": spread_json(r)}
                        | {"target": RATIO_TARGET, "met": r is not None and r.median >= RATIO_TARGET}
                    )
    outcome = {"results": results, "ratios": ratios}
    if json_path:
        payload = {
            "drafter": drafter,
            "prompt_set": prompt_set,
            "tune_prompts": tune_prompts,
            "prompt_indices": prompt_info,
            "rounds": rounds,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "base_settings": shared_settings(base),
            "settings": {m: s.relevant() for m, s in settings.items() if m in order},
            **(extra_json or {}),
            **outcome,
        }
        report.write_text(json_path, json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    return outcome
