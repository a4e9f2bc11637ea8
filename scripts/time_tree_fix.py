"""Per-call time of `echo::tree_fix_attention` on the testbed's attention shapes (csrc/README.md).

    PYTHONPATH=. python scripts/time_tree_fix.py [--requests 1,4,8] [--context 150] [--dtype float32]
    ECHO_TREE_BASELINE_ISA=1 PYTHONPATH=. python scripts/time_tree_fix.py    # the build CPUs without AVX2 run

Each request: a 16-node spine-and-siblings tree (depth 4, top_k 4: 12 fix rows) over `--context` tokens of a
paged cache in vLLM's CPU page layout (4 heads of 64, blocks of 128). Microseconds per call = one layer; the
shared CPU is noisy: run twice. Not a test, not a benchmark.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from echo_vllm.ops import tree as tree_ops
from echo_vllm.vllm import tree_state
from echo_vllm.vllm.tree_attn_cpu import page_layout

HEADS, HEAD, BLOCK = 4, 64, 128
# Spine 0 -> 1 -> 2 -> 3, then three siblings per depth hanging off the spine node above (spine-first order).
PARENTS = (-1, 0, 1, 2, -1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2)
ISA = {torch.float32: "vec", torch.bfloat16: "vec16"}


def time_call(num_reqs: int, context: int, dtype: torch.dtype, calls: int) -> tuple[int, float]:
    kmap, vmap = page_layout(ISA[dtype], dtype, BLOCK, HEAD)
    plans = [tree_state.TreePlan(tuple(range(7, 7 + len(PARENTS))), PARENTS) for _ in range(num_reqs)]
    scheduled = [list(p.tokens) for p in plans]
    new = len(PARENTS) + 1
    starts = np.arange(num_reqs + 1) * new
    batch = tree_state.build_tree_batch(plans, scheduled, np.full(num_reqs, context), starts[:-1], "cpu")
    assert batch is not None
    per_req = math.ceil((context + new) / BLOCK) + 1
    num_blocks = num_reqs * per_req + 2
    g = torch.Generator().manual_seed(0)
    block_table = torch.randperm(num_blocks, generator=g)[: num_reqs * per_req].view(num_reqs, per_req).int()
    kv_cache = torch.randn(num_blocks, HEADS, BLOCK, 2 * HEAD, generator=g).to(dtype)
    query = torch.randn(int(starts[-1]), HEADS, HEAD, generator=g).to(dtype)
    output = torch.zeros_like(query)

    def call() -> None:
        tree_ops.tree_fix_attention(
            query, kv_cache, kmap, vmap, block_table, batch.context_len, batch.fix_rows, batch.fix_req,
            batch.fix_bits, 1 / math.sqrt(HEAD), None, output,
        )  # fmt: skip

    for _ in range(50):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return batch.num_fix_rows, 1e6 * (time.perf_counter() - start) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,4,8")
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    if not tree_ops.compiled_tree_ops(torch.device("cpu")):
        raise SystemExit("the compiled tree ops are not available (make install)")
    dtype = getattr(torch, args.dtype)
    for num_reqs in [int(r) for r in args.requests.split(",")]:
        rows, us = time_call(num_reqs, args.context, dtype, args.calls)
        print(f"{args.dtype} requests {num_reqs}: {rows} fix rows over {args.context + 17} keys  {us:8.1f} us/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
