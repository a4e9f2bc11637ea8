"""Per-layer cost of the CUDA tree fix-up's torch parts on Llama-3.1-8B attention shapes (run on a GPU machine).

    PYTHONPATH=. python scripts/time_tree_fix_cuda.py [--requests 1,8,32,128] [--context 1024] [--json out.json]

What the CUDA tree path adds to a verification step, per attention layer, besides vLLM's own FlashAttention call
over the step (echo_vllm/vllm/tree_attn_cuda.py): the fix rows' masked suffix (`suffix_kv`, `suffix_mask`,
`suffix_attention`), the grouping (`fix_row_groups`) and the LSE merge (here `merge_by_lse` in torch; vLLM's
`merge_attn_states` kernel in the engine), plus one prefix pass over context + root (vLLM's FA varlen kernel in
the engine; not installed on the device image, so this script times `prefix_attention_reference`, a torch
gather, as an upper stand-in) and, once per step, KV compaction (`echo_compact_cuda`). The engine's fused path
(`tree_attn_triton.tree_suffix_merge`: suffix + merge + write in one Triton launch) is timed beside the torch
composition, whose GPU time alone is also measured by replaying it from a CUDA graph. For scale it also times
dense SDPA attention of all the step's rows over their contexts (what the stock kernel does for the step).

Each request: a 16-node spine-and-siblings tree (depth 4, top_k 4: 12 fix rows) over `--context` tokens of a
paged FlashAttention-layout cache (32 query heads, 8 KV heads of 128, blocks of 16, bfloat16). Times are CUDA-event
medians of eager calls (vLLM's PIECEWISE CUDA graphs run attention eagerly). Host time of `build_tree_batch` (once
per step) is timed with perf_counter. Not a test, not a benchmark of ECHO: a cost breakdown.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch
import torch.nn.functional as F
from cuda_timing import cuda_ms, graph_ms, host_ms  # scripts/ is on sys.path when run as a script

from echo_vllm.vllm import tree_state
from echo_vllm.vllm.tree_attn_split import (
    echo_compact_cuda,
    fa_kv_views,
    fix_row_groups,
    merge_by_lse,
    prefix_attention_reference,
    tree_fix_rows,
)

HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
PARENTS = (-1, 0, 1, 2, -1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2)  # spine of 4, then 3 siblings per depth


def measure(num_reqs: int, context: int, dev: torch.device) -> dict[str, float]:
    gen = torch.Generator(device=dev).manual_seed(num_reqs)
    new = len(PARENTS) + 1
    plans = [tree_state.TreePlan(tuple(range(7, 7 + len(PARENTS))), PARENTS) for _ in range(num_reqs)]
    scheduled = [list(p.tokens) for p in plans]
    starts = np.arange(num_reqs + 1) * new
    ctx = np.full(num_reqs, context)

    def build() -> tree_state.TreeBatch:
        batch = tree_state.build_tree_batch(plans, scheduled, ctx, starts[:-1], dev)
        assert batch is not None
        return batch

    batch = build()
    per_req = math.ceil((context + new) / BLOCK)
    num_blocks = num_reqs * per_req + 8
    block_table = torch.randperm(num_blocks, device=dev, generator=gen)[: num_reqs * per_req]
    block_table = block_table.view(num_reqs, per_req).to(torch.int32)
    kv_cache = torch.randn((num_blocks, KV_HEADS, BLOCK, 2 * HEAD), device=dev, generator=gen, dtype=torch.bfloat16)
    key_cache, value_cache = fa_kv_views(kv_cache, HEAD)
    rows = int(starts[-1])
    query = torch.randn((rows, HEADS, HEAD), device=dev, generator=gen, dtype=torch.bfloat16)
    key = torch.randn((rows, KV_HEADS, HEAD), device=dev, generator=gen, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    scale = 1 / math.sqrt(HEAD)
    groups = fix_row_groups(batch)
    q_fix = query[batch.fix_rows.long()]
    prefix = prefix_attention_reference(
        q_fix, key_cache, value_cache, block_table, groups.cu_seqlens_q, groups.seqused_k, scale
    )
    prefix_bf16 = (prefix[0].to(torch.bfloat16), prefix[1])  # FA returns the query dtype and a float32 LSE

    def fix_torch() -> torch.Tensor:  # the per-layer torch work of the engine's path, prefix kernel excluded
        return tree_fix_rows(
            query, key, value, key_cache, value_cache, block_table, batch, scale,
            prefix_fn=lambda *args: prefix_bf16, merge_fn=lambda *p: merge_by_lse(*p)[0],
        )  # fmt: skip

    try:
        from echo_vllm.vllm.tree_attn_triton import tree_fix_rows_fused, tree_suffix_merge
    except ImportError:
        tree_fix_rows_fused = tree_suffix_merge = None
    whole_out = torch.zeros_like(query)

    def fix_whole() -> None:  # the whole fix rows (prefix from the paged cache + suffix) in one Triton launch
        assert tree_fix_rows_fused is not None
        tree_fix_rows_fused(whole_out, query, key, value, key_cache, value_cache, block_table, batch, scale)

    fused_out = torch.zeros_like(query)
    fix_index = batch.fix_rows.long()

    def fix_fused() -> None:  # the engine's fused path, prefix kernel excluded: gather q, one Triton launch
        q_rows = query[fix_index]  # FA reads these; here only the gather's launch is timed
        del q_rows
        assert tree_suffix_merge is not None
        tree_suffix_merge(fused_out, query, key, value, prefix_bf16[0], prefix_bf16[1], batch, scale)

    def fix_reference_prefix() -> torch.Tensor:  # the whole split recompute with the torch prefix stand-in
        return tree_fix_rows(query, key, value, key_cache, value_cache, block_table, batch, scale)

    # The stock kernel's share, for scale: every row of the step over its request's context (SDPA flash, GQA).
    q_dense = torch.randn((num_reqs, HEADS, new, HEAD), device=dev, generator=gen, dtype=torch.bfloat16)
    k_dense = torch.randn((num_reqs, KV_HEADS, context + new, HEAD), device=dev, generator=gen, dtype=torch.bfloat16)
    v_dense = torch.randn_like(k_dense)

    def stock_attention() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale, enable_gqa=True)

    # Compaction: the accepted path's KV moved to the slots after the root (depth 4: up to 4 moves per request).
    src = (block_table[:, :1].long() * BLOCK + torch.arange(4, 8, device=dev)).flatten()
    dst = (block_table[:, :1].long() * BLOCK + torch.arange(0, 4, device=dev)).flatten()

    def compact() -> None:
        echo_compact_cuda(kv_cache, src, dst)

    row: dict[str, float] = {}
    if tree_suffix_merge is not None:
        row["fix_fused_ms"] = cuda_ms(fix_fused)
        spec = fix_torch()
        fix_fused()
        row["fused_max_abs_diff"] = float((fused_out[fix_index].float() - spec.to(torch.bfloat16).float()).abs().max())
        row["whole_ms"] = cuda_ms(fix_whole)
        full = fix_reference_prefix()
        fix_whole()
        row["whole_max_abs_diff"] = float((whole_out[fix_index].float() - full.to(torch.bfloat16).float()).abs().max())
        if dev.type == "cuda":
            for name, fn in (("fix_fused_graph_ms", fix_fused), ("whole_graph_ms", fix_whole)):
                try:
                    row[name] = graph_ms(fn)
                except RuntimeError as exc:
                    print(f"graph capture of {name} failed at {num_reqs} requests: {exc}")
    if dev.type == "cuda":  # the torch composition's GPU time alone (its eager time is the host launching it)
        try:
            row["fix_torch_graph_ms"] = graph_ms(fix_torch)
        except RuntimeError as exc:  # a capture failure must not lose the rest of the table
            print(f"graph capture of the torch fix-up failed at {num_reqs} requests: {exc}")
    return {
        **row,
        "requests": num_reqs,
        "fix_rows": batch.num_fix_rows,
        "step_rows": rows,
        "fix_torch_ms": cuda_ms(fix_torch),
        "fix_with_reference_prefix_ms": cuda_ms(fix_reference_prefix, repeats=30),
        "stock_attention_ms": cuda_ms(stock_attention),
        "compact_ms": cuda_ms(compact),
        "build_tree_batch_host_ms": host_ms(build),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,8,32,128")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--json")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run of the script)")
    args = parser.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("time_tree_fix_cuda: needs a CUDA device (or --device cpu for a smoke run)")
    rows = [measure(int(n), args.context, dev) for n in args.requests.split(",")]
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, context {args.context}, bfloat16")
    nan = float("nan")
    print("Suffix + merge (the prefix part excluded): torch composition vs one Triton launch; eager and CUDA graph")
    print("| requests | fix rows | torch eager ms | torch graph ms | Triton eager ms | Triton graph ms | max diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['requests']} | {r['fix_rows']} | {r['fix_torch_ms']:.3f} | {r.get('fix_torch_graph_ms', nan):.3f} "
            f"| {r.get('fix_fused_ms', nan):.3f} | {r.get('fix_fused_graph_ms', nan):.4f} "
            f"| {r.get('fused_max_abs_diff', nan):.1e} |"
        )
    print("Whole fix rows (prefix over the paged cache + suffix): one Triton launch vs the torch reference; context")
    print(
        "| requests | whole eager ms | whole graph ms | max diff | torch ref ms | stock attention ms | compaction ms | build host ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['requests']} | {r.get('whole_ms', nan):.3f} | {r.get('whole_graph_ms', nan):.4f} "
            f"| {r.get('whole_max_abs_diff', nan):.1e} | {r['fix_with_reference_prefix_ms']:.3f} "
            f"| {r['stock_attention_ms']:.3f} | {r['compact_ms']:.3f} | {r['build_tree_batch_host_ms']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "context": args.context, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
