"""Per-call time of `echo::draft_argmax_logp` beside torch's max + logsumexp and vLLM's argmax (csrc/README.md).

    PYTHONPATH=. python scripts/time_draft_logp.py [--vocab 4096] [--batch-sizes 1,8,32]

Microseconds per call on random logits; the shared CPU is noisy: run twice. Not a test, not a benchmark.
"""

from __future__ import annotations

import argparse
import time

import torch

from echo_vllm.ops.chain import compiled_chain_select, draft_argmax_logp


def _us(fn, calls: int = 2000) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch-sizes", default="1,8,32")
    args = parser.parse_args()
    print(f"compiled op: {compiled_chain_select(torch.device('cpu'))}; torch threads {torch.get_num_threads()}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        logits = torch.randn(batch, args.vocab) * 4
        op = _us(lambda x=logits: draft_argmax_logp(x))
        both = _us(lambda x=logits: (x.max(dim=-1), torch.logsumexp(x, dim=-1)))
        argmax = _us(lambda x=logits: x.argmax(dim=-1))
        print(f"batch {batch:4d}: op {op:8.1f} us   max + logsumexp {both:8.1f} us   argmax {argmax:8.1f} us")


if __name__ == "__main__":
    main()
