"""`echo-vllm bench hf`: every HF-engine method on the same models and prompts, ratios measured in one run.

Also the prompt encoding the HF engine's tests share (the testbed's tokenizer.json, prompt tails).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from echo_vllm.bench import report
from echo_vllm.config import EchoSettings
from echo_vllm.core.eagle2 import DDDSettings
from echo_vllm.hf.draft_model import parse_drafter_spec
from echo_vllm.hf.engine import GATED, METHODS, EngineInputError, EngineOptions, HFEngine


def load_tokenizer(target_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(target_dir / "tokenizer.json"))


def encode_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    # Keep the end of long prompts: that is where generation continues from.
    return [enc.ids[-max_prompt_tokens:] for enc in tokenizer.encode_batch(prompts)]


def run_methods_interleaved(
    root: Path,
    methods: list[str],
    settings: EchoSettings,
    depths: dict[str, int],
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    progress=None,
    ddd: DDDSettings | None = None,
    drafter: str = "eagle3",
) -> dict[str, dict[str, Any]]:
    """Every method on every prompt, prompt by prompt (ar, m1, m2, ... on prompt 1, then prompt 2, ...).

    On a shared machine the load drifts; interleaving gives every method the same mix of quiet and busy
    moments, so the ratios of one run are fair even when its absolute numbers move. `drafter`: a --drafter spec
    (`echo_vllm.hf.draft_model.parse_drafter_spec`), the drafter every speculative method uses.
    """
    kind, drafter_dir = parse_drafter_spec(drafter, root)
    built: dict[str, HFEngine] = {}
    first_spec = None
    for m in sorted(methods, key=lambda name: name == "ar"):  # a speculative engine first: ar shares its weights
        built[m] = HFEngine(
            root / "target",
            drafter_dir if m != "ar" else None,
            EngineOptions(method=m, max_depth=depths[m], echo=settings, ddd=ddd or DDDSettings(), drafter=kind),
            share_models_with=first_spec,
        )
        first_spec = first_spec or (built[m] if m != "ar" else None)
    engines = {m: built[m] for m in methods}
    runs = {m: {"outputs": [], "seconds": 0.0, "tokens": 0} for m in methods}
    for ids in prompts:
        for method, engine in engines.items():
            result = engine.generate(ids, max_new_tokens, temperature=temperature)
            run = runs[method]
            run["outputs"].append(result.token_ids)
            run["seconds"] += result.seconds
            run["tokens"] += len(result.token_ids)
        if progress is not None:
            progress.update(1)
    for method, engine in engines.items():
        runs[method].update(
            {
                "metrics": engine.metrics.summary() if method != "ar" else {},
                "ms_per_step": engine.phases.ms_per_step(),
                "calibration": engine.calibration.to_json_dict() if engine.calibration else None,
                "gates": engine.calibration.describe() if engine.calibration else None,
                "gated_depths": engine.calibration.sweet_spots if engine.calibration else None,
                "max_depth": engine.max_depth,
                "depths": engine.depth_summary() if method != "ar" else {},
            }
        )
    return runs


def bench_hf(
    root: Path,
    methods: list[str],
    datasets: list[str],
    limit: int,
    max_new_tokens: int,
    settings: EchoSettings,
    max_depth: int,
    temperature: float = 0.0,
    json_path: str | None = None,
    gated_depth: int | None = None,
    ddd: DDDSettings | None = None,
    drafter: str = "eagle3",
) -> list[dict[str, Any]]:
    """`max_depth` is every drafting method's depth but the gated ones' (`gated_depth`, default max_depth) and
    ddd's (`ddd.max_depth`, set by the engine)."""
    from echo_vllm.bench.datasets import load_prompts

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise EngineInputError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        tqdm = None
    parse_drafter_spec(drafter, root)  # a bad --drafter fails before any model loads
    tokenizer = load_tokenizer(root / "target")
    results = []
    for dataset in datasets:
        prompts = encode_prompts(tokenizer, load_prompts(dataset, limit), max_prompt_tokens=384)
        order = ["ar", *[m for m in methods if m != "ar"]]
        depths = {m: gated_depth if (gated_depth and m in GATED) else max_depth for m in order}
        progress = tqdm(total=len(prompts), desc=f"{dataset} ({', '.join(order)})", leave=False) if tqdm else None
        runs = run_methods_interleaved(
            root, order, settings, depths, prompts, max_new_tokens, temperature, progress, ddd=ddd, drafter=drafter
        )
        if progress is not None:
            progress.close()
        ar = runs["ar"]
        ar_tps = ar["tokens"] / ar["seconds"]
        for method in methods:
            run = runs[method]
            m = run["metrics"]
            tps = run["tokens"] / run["seconds"]
            results.append(
                {
                    "method": method,
                    "drafter": drafter if method != "ar" else None,
                    "dataset": dataset,
                    "batch_size": 1,
                    "max_depth": run["max_depth"] if method != "ar" else None,
                    "mat": m.get("mat", 1.0),
                    "draft_utilization": m.get("utilization"),  # = u_selected_depth
                    "mean_depth_drafted": m.get("mean_depth"),  # (historical name) the mean deepest *selected* depth
                    # u = MAT / mean depth, labelled by which depth: the deepest selected node of each step, or the
                    # depth the step's tree was drafted to (ddd and the gated methods stop drafting early).
                    "u_selected_depth": run["depths"].get("u_selected_depth"),
                    "u_drafted_depth": run["depths"].get("u_drafted_depth"),
                    "mean_drafted_depth": run["depths"].get("mean_drafted_depth"),
                    "tokens_per_s": tps,
                    "speedup_vs_ar": tps / ar_tps,
                    "accepted_per_verified_draft": m.get("accepted_per_verified_draft"),
                    "budget_used": m.get("budget_used"),
                    "identical_to_ar": run["outputs"] == ar["outputs"],
                    "sweet_spots": (run["calibration"] or {}).get("gated"),
                    # Which depths are gated and why (Calibration.describe), e.g. "sparse: gates at depths [2, 4] ..."
                    "gated_depths": run["gated_depths"],
                    "gates": run["gates"],
                    # Where a decoding step's time goes (ar: one target forward per token).
                    "ms_per_step": run["ms_per_step"],
                }
            )
    if json_path:
        report.write_text(
            json_path,
            json.dumps(
                {
                    "settings": settings.model_dump(),
                    "max_depth": max_depth,
                    "gated_depth": gated_depth or max_depth,
                    "ddd": dataclasses.asdict(ddd or DDDSettings()),
                    "max_new_tokens": max_new_tokens,
                    "results": results,
                },
                indent=2,
            )
            + "\n",
        )
    return results
