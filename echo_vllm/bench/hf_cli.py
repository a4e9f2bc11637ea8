"""`echo-vllm bench hf` and `bench hf-tune`: their parsers, and the tables they print. torch loads only when a
command runs (`--help` stays fast)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from echo_vllm.bench.report import format_cell, print_table
from echo_vllm.bench.vllm_cli import _csv, resolve_testbed

DEFAULT_METHODS = "ar,chain,eagle2,ddd,fixed,dense,echo"


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, e.g. 4,6,8; got {text!r}") from None


def _k_max(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto'; got {text!r}") from None


def _base_settings(args: argparse.Namespace):
    """The settings every method shares (not swept): warm-up, max_gates, min_gain, surplus_width."""
    from echo_vllm.config import parse_echo_settings

    return parse_echo_settings(
        {
            "warmup_steps": args.warmup_steps,
            "max_gates": args.max_gates,
            "min_gain": args.min_gain,
            "surplus_width": args.surplus_width,
        }
    )


def _span(row: dict[str, Any], key: str) -> str:
    return f"{format_cell(row[key])} [{row[key + '_min']:.3f}–{row[key + '_max']:.3f}]"


def _set_threads(args: argparse.Namespace) -> None:
    """--threads: torch's intra-op threads. On a CPU shared with other jobs one thread can be several times faster
    than two (the threads spin waiting for each other); the JSON records what ran."""
    if args.threads is not None:
        import torch

        if args.threads < 1:
            from echo_vllm.errors import InputError

            raise InputError(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)


def bench_hf_command(args: argparse.Namespace) -> int:
    import torch

    from echo_vllm.bench.hf import bench_hf
    from echo_vllm.bench.hf_settings import TUNED_PATH, resolve_drafter, settings_for_run

    root = resolve_testbed(args.testbed)
    kind, drafter_dir = resolve_drafter(args.drafter, root)
    _set_threads(args)
    methods = _csv(args.methods)
    overrides = {
        "max_depth": args.depth,
        "gated_depth": args.echo_depth,
        "k_max": args.k_max,
        "top_k": args.top_k,
        "delta": args.delta,
        "ddd_threshold": args.ddd_threshold,
        "ddd_max_depth": args.ddd_max_depth,
        "ddd_check_depths": args.ddd_check_depths,
    }
    tuned_path = Path(args.tuned) if args.tuned else TUNED_PATH
    from echo_vllm.hf.engine import METHODS, EngineInputError

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise EngineInputError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    settings = settings_for_run(methods, kind, overrides, tuned_path)
    print(f"[bench hf] drafter {kind} ({drafter_dir}); settings (tuned file {tuned_path}, then explicit flags):")
    for method in methods:
        print(f"  {method}: {settings[method].relevant() or '-'}")
    outcome = bench_hf(
        root,
        methods,
        _csv(args.dataset),
        args.limit,
        args.max_tokens,
        settings,
        base=_base_settings(args),
        json_path=args.json,
        rounds=args.rounds,
        tune_prompts=args.tune_prompts,
        prompt_set=args.prompt_set,
        drafter=kind,
        drafter_dir=drafter_dir,
        extra_json={"torch_threads": torch.get_num_threads()},
    )
    results = outcome["results"]
    print(f"\nB = 1, {args.rounds} interleaved rounds, median [min–max]; prompt set: {args.prompt_set}")
    table = [
        {
            "method": r["method"],
            "dataset": r["dataset"],
            "wall_s": r["wall_s"],
            "tokens_per_s": _span(r, "tokens_per_s"),
            "speedup_vs_ar": _span(r, "speedup_vs_ar"),
            "mat": r["mat"],
            "u_sel/drafted": f"{format_cell(r['u_selected_depth'])}/{format_cell(r['u_drafted_depth'])}",
            "verified_per_step": r["verified_per_step"],
            "identical_to_ar": r["identical_to_ar"],
        }
        for r in results
    ]
    print_table(table, list(table[0]) if table else [])
    for ratio in outcome["ratios"]:
        s = ratio["ratio"]
        text = "-" if s is None else f"{s['median']:.3f}x [{s['min']:.3f}–{s['max']:.3f}]"
        print(f"{ratio['dataset']}: echo vs {ratio['b']}: {text} (target ≥ {ratio['target']:.2f})")
    gates = [r for r in results if r.get("gates")]
    if gates:
        print("\ngates (calibrated in warm-up; J = saved share of rejected minus lost share of accepted drafts):")
        for r in gates:
            print(f"  {r['method']} {r['dataset']}: {r['gates']}")
    print("\nms per decoding step, by phase (speedup vs ar = MAT x ar ms/step / ms/step):")
    phases = [
        {"method": r["method"], "dataset": r["dataset"], **r["ms_per_step"], "total": sum(r["ms_per_step"].values())}
        for r in results
        if r["ms_per_step"]
    ]
    print_table(
        phases,
        ["method", "dataset", "draft", "select", "verify_forward", "accept", "update_context", "bookkeeping", "total"],
    )
    return 0 if all(r["identical_to_ar"] for r in results) else 1


def bench_hf_tune_command(args: argparse.Namespace) -> int:
    import torch

    from echo_vllm.bench import report
    from echo_vllm.bench.hf import dataset_prompts, run_configs_interleaved, shared_settings
    from echo_vllm.bench.hf_settings import TUNED_PATH, resolve_drafter, save_tuned
    from echo_vllm.bench.hf_tune import DEFAULT_TUNE_METHODS, GRID_SETS, tradeoff_rows, tune
    from echo_vllm.bench.machine import git_commit, machine_facts

    root = resolve_testbed(args.testbed)
    kind, drafter_dir = resolve_drafter(args.drafter, root)
    _set_threads(args)
    base = _base_settings(args)
    datasets = _csv(args.dataset)
    prompts = {d: dataset_prompts(root, d, args.tune_prompts, None, "tune") for d in datasets}

    def measure(configs, dataset):
        return run_configs_interleaved(
            root, configs, prompts[dataset][1], args.max_tokens, 0.0, args.rounds, base, kind, drafter_dir
        )

    started = datetime.datetime.now(datetime.timezone.utc)
    methods = _csv(args.methods) if args.methods else list(DEFAULT_TUNE_METHODS)
    outcome = tune(methods, datasets, measure, grids=GRID_SETS[args.grid])
    tradeoff = tradeoff_rows(outcome)
    provenance = {
        "date": started.isoformat(timespec="seconds"),
        "minutes": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60, 1),
        "command": " ".join(["echo-vllm", *sys.argv[1:]]),
        "git": git_commit(),
        "machine": machine_facts(torch.get_num_threads()),
        "objective": "geometric mean over datasets of the speedup vs ar (ratio of median tokens/s over rounds); "
        "identical to ar in every round required",
        "datasets": datasets,
        "tune_prompt_indices": {d: prompts[d][0] for d in datasets},
        "max_new_tokens": args.max_tokens,
        "rounds": args.rounds,
        "grid_set": args.grid,
        "base_settings": shared_settings(base),
        "failed": outcome.failed,
        "grid": outcome.points_json(),
        "tradeoff": tradeoff,
    }
    out = Path(args.out) if args.out else TUNED_PATH
    save_tuned(out, kind, outcome.best, provenance)
    print(f"\nwinners ({kind}) -> {out}:")
    for method, setting in outcome.best.items():
        score = next(p.score for p in outcome.points[method] if p.setting == setting)
        print(f"  {method}: {setting.relevant()}  (score {score:.3f})")
    print("\nscores (geomean over datasets of the median speedup vs ar; - = not identical to ar):")
    print_table(
        [{"point": p["label"], "score": p["score"]} | _per_dataset(p) for p in provenance["grid"]],
        ["point", "score", *[f"{d}" for d in datasets]],
    )
    if tradeoff:
        print("\necho: the MAT / u trade-off over delta (tuning prompts; vs the tuned eagle2 in the same run):")
        print_table(
            tradeoff,
            ["k_max", "delta", "dataset", "mat", "u_selected_depth", "u_drafted_depth", "speedup_vs_ar"]
            + (["mat_vs_eagle2", "u_vs_eagle2", "speed_vs_eagle2"] if "mat_vs_eagle2" in tradeoff[0] else []),
        )
    if args.json:
        report.write_text(args.json, json.dumps({"drafter": kind, **provenance}, indent=2, ensure_ascii=False) + "\n")
    return 0 if not outcome.failed else 1


def _per_dataset(point: dict[str, Any]) -> dict[str, str]:
    return {
        d: "-" if v["speedup_vs_ar"] is None else f"{v['speedup_vs_ar']['median']:.3f} (MAT {format_cell(v['mat'])})"
        for d, v in point["per_dataset"].items()
    }


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--testbed")
    parser.add_argument(
        "--drafter",
        default="eagle3",
        help="eagle3 (the testbed's EAGLE-3 head), draft-model (its draft LM, draft-lm/) or draft-model:PATH",
    )
    parser.add_argument("--dataset", default="humaneval,mtbench", help="comma list of humaneval, mtbench")
    parser.add_argument(
        "--tune-prompts",
        type=int,
        default=6,
        help="the first this many prompts of each dataset are the tuning set; bench hf reports on the prompts after",
    )
    parser.add_argument("--warmup-steps", type=int, default=32)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default torch's choice; 1 on a busy shared CPU)"
    )
    parser.add_argument(
        "--surplus-width",
        choices=["all", "truncated"],
        default="all",
        help="echo.surplus_width: who Priority 2 may widen (docs/configuration.md)",
    )
    parser.add_argument("--max-gates", type=int, default=3, help="echo.max_gates: the most checkpoints echo keeps")
    parser.add_argument(
        "--min-gain", type=float, default=0.02, help="echo.min_gain: the least gain in J an echo checkpoint adds"
    )


def add_parsers(bsub: argparse._SubParsersAction) -> None:
    bhf = bsub.add_parser(
        "hf",
        help="HF engine (B = 1): ar, chain, eagle2, ddd, siblings, dense, fixed, echo, each at its tuned setting",
        description="Each method runs at its tuned setting (echo_vllm/bench/hf_tuned.json, from `bench hf-tune`); "
        "a flag given here overrides it for every method it concerns.",
    )
    _common(bhf)
    bhf.add_argument("--methods", default=DEFAULT_METHODS)
    bhf.add_argument("--limit", type=int, default=10, help="prompts per dataset (after the tuning prompts)")
    bhf.add_argument(
        "--prompt-set",
        choices=["report", "tune"],
        default="report",
        help="report (default): the prompts after the tuning set; tune: the tuning prompts themselves",
    )
    bhf.add_argument("--max-tokens", type=int, default=96)
    bhf.add_argument("--rounds", type=int, default=3, help="interleaved rounds in rotating order (median, min–max)")
    bhf.add_argument("--tuned", help="tuned-settings file (default echo_vllm/bench/hf_tuned.json)")
    bhf.add_argument("--depth", type=int, default=None, help="override: max draft depth of every drafting method")
    bhf.add_argument(
        "--echo-depth",
        type=int,
        default=None,
        help="override: depth ceiling of the gated methods (echo, dense, fixed). Gates stop drafting early, so a "
        "deeper ceiling costs only where the head is confident",
    )
    bhf.add_argument("--k-max", type=_k_max, default=None, help="override: draft tokens verified per step ('auto')")
    bhf.add_argument("--top-k", type=int, default=None, help="override: children per node / frontier width")
    bhf.add_argument("--delta", type=float, default=None, help="override: echo's AUC threshold for a sweet spot")
    bhf.add_argument(
        "--ddd-threshold",
        type=float,
        default=None,
        help="override, ddd: stop deepening when log(summed path probability of the frontier) < this at a checked "
        "depth",
    )
    bhf.add_argument("--ddd-max-depth", type=int, default=None, help="override, ddd: the deepest depth drafted")
    bhf.add_argument(
        "--ddd-check-depths",
        type=_int_tuple,
        default=None,
        help="override, ddd: comma list of the depths at which the rule is checked (1..ddd max depth - 1)",
    )
    bhf.add_argument("--json", help="write results here")
    bhf.set_defaults(func=bench_hf_command)

    btune = bsub.add_parser(
        "hf-tune",
        help="sweep each HF method's setting on the tuning prompts; write the winners (bench hf's defaults)",
    )
    _common(btune)
    btune.add_argument("--methods", default=None, help="comma list (default chain,eagle2,ddd,dense,fixed,echo)")
    btune.add_argument("--max-tokens", type=int, default=64)
    btune.add_argument(
        "--grid",
        choices=["full", "quick"],
        default="full",
        help="full (default): the grids in echo_vllm/bench/hf_tune.py; quick: a few points of each (a smoke tune)",
    )
    btune.add_argument("--rounds", type=int, default=2, help="interleaved rounds per grid (median)")
    btune.add_argument("--out", help="tuned-settings file to update (default echo_vllm/bench/hf_tuned.json)")
    btune.add_argument("--json", help="also write the whole sweep (every grid point, the trade-off table) here")
    btune.set_defaults(func=bench_hf_tune_command)
