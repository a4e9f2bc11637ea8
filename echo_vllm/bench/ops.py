"""Benchmark of echo::select_budget against the torch reference: `echo-vllm bench ops --json FILE`.

For every device available (cpu; cuda when a device is visible) and every shape B x N (B in 1, 8, 64, 256;
N in 64, 512), one run measures the reference and the op on the same inputs (warm-up, then the median of
repeats) and checks that they agree. Inputs follow the depth-major tree layout (top-k 8, N / 8 depths), with
path log-prob scores, 95% valid nodes, per-request depth caps, half the requests truncated and
k_max = B * N / 4 (so the cut falls inside a class). CUDA timings use events around each call (host
dispatch included); `op_graph_us` is the op's out= variant replayed in a CUDA graph (the kernel alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from echo_vllm.bench import report
from echo_vllm.core.budget import select_budget_reference
from echo_vllm.core.tree import depth_major_layout

BATCHES = (1, 8, 64, 256)
NODES = (64, 512)
TOP_K = 8


def make_inputs(batch: int, num_nodes: int, device: str, seed: int = 0):
    """(scores, depth, parent, valid, spine, depth_cap, truncated, k_max) for one shape."""
    gen = torch.Generator().manual_seed(seed)
    top_k = min(TOP_K, num_nodes)
    max_depth = num_nodes // top_k
    depth, spine = depth_major_layout(batch, max_depth, top_k)
    node = torch.arange(num_nodes)
    slot = node % top_k
    # Spine nodes hang off the previous spine node, the others off a random node of the previous depth.
    prev_slot = torch.where(
        slot == 0, torch.zeros_like(slot), torch.randint(0, top_k, (batch, num_nodes), generator=gen)
    )
    parent = torch.where(node >= top_k, node - top_k - slot + prev_slot, torch.full_like(node, -1)).to(torch.int32)
    step = torch.log(torch.rand(batch, num_nodes, generator=gen).clamp_min(1e-6))
    scores = torch.zeros(batch, num_nodes)
    for d in range(max_depth):  # path log-prob: parent's score + this step's log-prob
        cols = slice(d * top_k, (d + 1) * top_k)
        base = 0.0 if d == 0 else torch.gather(scores, 1, parent[:, cols].long())
        scores[:, cols] = base + step[:, cols]
    valid = torch.rand(batch, num_nodes, generator=gen) < 0.95
    depth_cap = torch.randint(max(1, max_depth // 2), max_depth + 1, (batch,), generator=gen, dtype=torch.int32)
    truncated = torch.rand(batch, generator=gen) < 0.5
    k_max = max(1, batch * num_nodes // 4)
    tensors = [t.to(device) for t in (scores, depth, parent, valid, spine, depth_cap, truncated)]
    return (*tensors, k_max)


def _time_cpu(fn: Callable[[], object], warmup: int, repeats: int, min_seconds: float) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    start = time.perf_counter()
    while len(samples) < repeats or (time.perf_counter() - start < min_seconds and len(samples) < 10 * repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _time_cuda(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def _time_cuda_graph(args, warmup: int, repeats: int) -> float | None:
    scores = args[0]
    outs = (
        torch.empty(scores.shape, dtype=torch.bool, device=scores.device),
        torch.empty(scores.shape[:1], dtype=torch.int32, device=scores.device),
        *(torch.empty(scores.shape, dtype=torch.int32, device=scores.device) for _ in range(3)),
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.echo.select_budget_out(*args, *outs)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.echo.select_budget_out(*args, *outs)
    return _time_cuda(graph.replay, warmup, repeats)


def _same(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b, strict=True))


def run(devices: list[str], batches=BATCHES, nodes=NODES, warmup: int = 3, repeats: int = 20, min_seconds: float = 0.2):
    from echo_vllm.ops import op_available

    results = []
    for device in devices:
        if not op_available(device):
            print(f"[bench] echo::select_budget is not available on {device}; skipped", file=sys.stderr)
            continue
        for num_nodes in nodes:
            for batch in batches:
                args = make_inputs(batch, num_nodes, device)
                ref = lambda args=args: select_budget_reference(*args)  # noqa: E731
                op = lambda args=args: torch.ops.echo.select_budget(*args)  # noqa: E731
                row = {"device": device, "B": batch, "N": num_nodes, "k_max": args[-1]}
                if device == "cuda":
                    row["reference_us"] = _time_cuda(ref, warmup, repeats)
                    row["op_us"] = _time_cuda(op, warmup, repeats)
                    row["op_graph_us"] = _time_cuda_graph(args, warmup, repeats)
                else:
                    row["reference_us"] = _time_cpu(ref, warmup, repeats, min_seconds)
                    row["op_us"] = _time_cpu(op, warmup, repeats, min_seconds)
                row["ratio"] = row["reference_us"] / row["op_us"]
                row["match"] = _same(ref(), op())
                results.append(row)
                print(_format_row(row), flush=True)
    return results


# Printed row by row while measuring: fixed widths, right-aligned, one space apart.
COLUMNS = ("device", "B", "N", "reference_us", "op_us", "graph_us", "ratio", "check")
WIDTHS = (6, 5, 5, 14, 10, 10, 9, 8)


def _format_row(row: dict) -> str:
    graph = f"{row['op_graph_us']:.1f}" if row.get("op_graph_us") is not None else "-"
    cells = (
        row["device"],
        str(row["B"]),
        str(row["N"]),
        f"{row['reference_us']:.1f}",
        f"{row['op_us']:.1f}",
        graph,
        f"{row['ratio']:.1f}x",
        "ok" if row["match"] else "MISMATCH",
    )
    return report.format_row(cells, WIDTHS, align=">", sep=" ")


def run_cli(args: argparse.Namespace) -> int:
    """`echo-vllm bench ops` (arguments in echo_vllm.bench.cli)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from echo_vllm.device import cuda_available

    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if cuda_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(report.format_row(COLUMNS, WIDTHS, align=">", sep=" "))
    results = run(
        devices,
        batches=[int(b) for b in args.batches.split(",")],
        nodes=[int(n) for n in args.nodes.split(",")],
        repeats=args.repeats,
    )
    if args.json:
        doc = {"results": results, "torch": torch.__version__, "threads": torch.get_num_threads()}
        report.write_text(args.json, json.dumps(doc, indent=1))
    return 0 if all(r["match"] for r in results) else 1
