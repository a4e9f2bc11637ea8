"""Timing helpers of the device scripts (scripts/time_tree_fix_cuda.py, scripts/time_verify_cost_cuda.py): CUDA-event
medians of eager calls, of CUDA-graph replays (GPU time without the host's launches), and host wall time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def host_ms(fn: Callable[[], object], repeats: int = 50) -> float:
    """Median wall ms of fn, synchronised (on a machine without CUDA: plain wall time)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def cuda_ms(fn: Callable[[], object], repeats: int = 100, warmup: int = 10) -> float:
    """Median CUDA-event ms of fn after `warmup` calls (without CUDA: `host_ms`, a smoke run of a script)."""
    if not torch.cuda.is_available():
        return host_ms(fn, repeats=3)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], replays: int = 50) -> float:
    """Median CUDA-graph replay ms of fn: its GPU work without the host's launch overhead (warmed on a side
    stream, captured once, replayed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay, repeats=replays, warmup=3)
