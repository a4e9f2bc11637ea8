"""Compiled kernels of tree steps on vLLM's CPU_ATTN cache (csrc/tree_cpu.cpp), and whether they can run.

`echo::tree_fix_attention` (the masked attention of a step's fix-up rows) and `echo::tree_kv_compact` (the
accepted path's KV moves) replace the torch paths of `echo_vllm.vllm.tree_attn_cpu`, which stay as their
reference and as the fallback: an extension built before these ops existed, or none at all, or
ECHO_VLLM_TREE_TORCH=1 (A/B measurements, tests), runs the torch path (logged once).
"""

from __future__ import annotations

import torch

from echo_vllm import ops as _ops

TORCH_PATH_ENV = "ECHO_VLLM_TREE_TORCH"
_DEFINED = _ops.ops_defined("tree_fix_attention", "tree_kv_compact")
_GATE = _ops.CpuOpsGate(TORCH_PATH_ENV, "ECHO tree steps: torch fix-up attention and KV compaction", "the tree ops")


def compiled_tree_ops(device: torch.device) -> bool:
    """Whether the compiled tree kernels serve a CPU cache now (else the torch path; the reason is logged once)."""
    return _GATE.serves(device, _DEFINED)


def tree_fix_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    kmap: torch.Tensor,
    vmap: torch.Tensor,
    block_table: torch.Tensor,
    context_len: torch.Tensor,
    fix_rows: torch.Tensor,
    fix_req: torch.Tensor,
    fix_bits: torch.Tensor,
    scale: float,
    softcap: float | None,
    output: torch.Tensor,
) -> None:
    """Overwrite output[fix_rows] ([T, H, D]) with each row's attention over its request's visible keys (the
    context and root, positions 0..ctx, and the drafts of its bits) in the paged cache [nb, Hkv, bs, 2D]."""
    torch.ops.echo.tree_fix_attention(
        query, kv_cache, kmap, vmap, block_table, context_len, fix_rows, fix_req, fix_bits,
        float(scale), float(softcap or 0.0), output,
    )  # fmt: skip


def tree_kv_compact(
    kv_cache: torch.Tensor, kmap: torch.Tensor, vmap: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """K and V of slot src[i] to slot dst[i] in every KV head (all sources read first)."""
    torch.ops.echo.tree_kv_compact(kv_cache, kmap, vmap, src_slots, dst_slots)
