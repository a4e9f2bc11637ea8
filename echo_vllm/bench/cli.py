"""`echo-vllm bench hf|hf-tune|vllm|ops|verify-cost` and `echo-vllm demo`: ratios measured in one run, on the
same models and prompts. Each command imports its benchmark (torch, vLLM) only when it runs, so `--help` stays fast."""

from __future__ import annotations

import argparse

from echo_vllm.bench import hf_cli, vllm_cli


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

    hf_cli.add_parsers(bsub)  # `bench hf` and `bench hf-tune`

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
