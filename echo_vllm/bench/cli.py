"""`echo-vllm bench hf|vllm|ops|verify-cost` and `echo-vllm demo`: ratios measured in one run, on the same models
and prompts. Each command imports its benchmark (torch, vLLM) only when it runs, so `--help` stays fast."""

from __future__ import annotations

import argparse

from echo_vllm.bench import vllm_cli
from echo_vllm.bench.report import print_table
from echo_vllm.bench.vllm_cli import _csv, resolve_testbed


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, e.g. 4,6,8; got {text!r}") from None


def bench_hf_command(args: argparse.Namespace) -> int:
    from echo_vllm.bench.hf import bench_hf
    from echo_vllm.config import parse_echo_settings
    from echo_vllm.core.eagle2 import DDDSettings

    root = resolve_testbed(args.testbed)
    settings = parse_echo_settings(
        {
            "k_max": args.k_max,
            "top_k": args.top_k,
            "warmup_steps": args.warmup_steps,
            "delta": args.delta,
            "max_gates": args.max_gates,
            "min_gain": args.min_gain,
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
        ddd=DDDSettings(threshold=args.ddd_threshold, max_depth=args.ddd_max_depth, check_depths=args.ddd_check_depths),
        drafter=args.drafter,
    )
    print_table(
        results,
        [
            "method",
            "dataset",
            "mat",
            "u_selected_depth",
            "u_drafted_depth",
            "tokens_per_s",
            "speedup_vs_ar",
            "accepted_per_verified_draft",
            "identical_to_ar",
        ],
    )
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


def _verify_cost_command(args: argparse.Namespace) -> int:
    from echo_vllm.bench.verify_cost import run_cli  # lazy: torch/transformers only when this runs

    return run_cli(args)


def _ops_command(args: argparse.Namespace) -> int:
    from echo_vllm.bench.ops import run_cli  # lazy: torch and the compiled op only when this runs

    return run_cli(args)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print ratios measured in one run")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    vllm_cli.add_parsers(bsub, sub)  # `bench vllm` and `demo`

    bhf = bsub.add_parser("hf", help="HF engine (B = 1): ar, chain, eagle2, ddd, siblings, dense, fixed, echo")
    bhf.add_argument("--methods", default="ar,chain,eagle2,dense,fixed,echo")
    bhf.add_argument("--testbed")
    bhf.add_argument(
        "--drafter",
        default="eagle3",
        help="eagle3 (the testbed's EAGLE-3 head), draft-model (its distilled draft LM, draft-lm/) or KIND:PATH",
    )
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
    bhf.add_argument("--max-gates", type=int, default=3, help="echo.max_gates: the most checkpoints echo keeps")
    bhf.add_argument(
        "--min-gain", type=float, default=0.02, help="echo.min_gain: the least gain in J an echo checkpoint adds"
    )
    bhf.add_argument(
        "--ddd-threshold",
        type=float,
        default=-4.0,
        help="ddd: stop deepening when log(summed path probability of the frontier) < this at a checked depth",
    )
    bhf.add_argument("--ddd-max-depth", type=int, default=10, help="ddd: the deepest depth drafted")
    bhf.add_argument(
        "--ddd-check-depths",
        type=_int_tuple,
        default=(4, 6, 8),
        help="ddd: comma list of the depths at which the rule is checked (1..ddd max depth - 1)",
    )
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
