"""One Triton kernel for the CUDA tree fix-up's suffix and merge: per (fix row, query head), the masked attention
over the request's own draft K/V, merged by log-sum-exp with the FlashAttention prefix part, written straight into
the layer's output row.

Why a kernel: the torch composition (`tree_attn_split.tree_fix_rows`: gather, mask, two einsums, softmax, merge,
index_copy) is ~25 small launches per attention layer; on an H200 it measured ~1.3 ms per layer at every batch size
(scripts/time_tree_fix_cuda.py; the GPU work is microseconds: the time is the host launching), which vLLM's
PIECEWISE CUDA graphs do not hide (attention runs eagerly between the pieces): ~40 ms per 32-layer step. This
kernel is one launch. It computes exactly what `suffix_attention` + `merge_by_lse` compute (the specification,
tested against it on CUDA and under Triton's interpreter), in float32, and casts only the final row.

Conventions as `merge_by_lse`: an empty suffix (no visible draft) has lse -inf and leaves the prefix alone; a +inf
prefix lse is read as -inf; both empty gives 0. Triton is imported only here, and this module only on CUDA (vLLM's
CUDA wheels bring Triton; the CPU test venv must not have it: see scripts/postinstall_cpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from echo_vllm.vllm import tree_state


@triton.jit
def _tree_suffix_merge_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_a_ptr,
    lse_a_ptr,
    out_ptr,
    fix_rows_ptr,
    fix_req_ptr,
    fix_bits_ptr,
    root_row_ptr,
    num_draft_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_at,
    stride_ah,
    stride_lh,
    stride_lf,
    stride_ot,
    stride_oh,
    scale,
    softcap,
    GROUP: tl.constexpr,
    HEAD_D: tl.constexpr,
    HEAD_DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    f = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(fix_rows_ptr + f).to(tl.int64)
    req = tl.load(fix_req_ptr + f).to(tl.int64)
    bits = tl.load(fix_bits_ptr + f).to(tl.int64)
    root = tl.load(root_row_ptr + req).to(tl.int64)
    drafts = tl.load(num_draft_ptr + req).to(tl.int64)
    kv_head = h // GROUP

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < HEAD_DV
    j = tl.arange(0, BLOCK_N).to(tl.int64)
    visible = (((bits >> j) & 1) == 1) & (j < drafts)  # ancestor-or-self drafts of this row's request
    key_row = root + 1 + j

    q = tl.load(q_ptr + row * stride_qt + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    k = tl.load(
        k_ptr + key_row[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
        mask=visible[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    logits = tl.sum(k * q[None, :], axis=1) * scale
    if USE_SOFTCAP:  # softcap * tanh(x / softcap), tanh(y) = 2 sigmoid(2y) - 1
        logits = softcap * (2.0 * tl.sigmoid(2.0 * logits / softcap) - 1.0)
    logits = tl.where(visible, logits, float("-inf"))
    top_b = tl.max(logits, axis=0)
    top_b_safe = tl.where(top_b == float("-inf"), 0.0, top_b)
    p = tl.where(visible, tl.exp(logits - top_b_safe), 0.0)
    total_b = tl.sum(p, axis=0)
    lse_b = tl.where(total_b > 0.0, top_b_safe + tl.log(tl.where(total_b > 0.0, total_b, 1.0)), float("-inf"))
    v = tl.load(
        v_ptr + key_row[:, None] * stride_vt + kv_head * stride_vh + dv[None, :],
        mask=visible[:, None] & dv_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    out_b = tl.sum(p[:, None] * v, axis=0) / tl.where(total_b > 0.0, total_b, 1.0)

    lse_a = tl.load(lse_a_ptr + h * stride_lh + f * stride_lf).to(tl.float32)
    lse_a = tl.where(lse_a == float("inf"), float("-inf"), lse_a)
    out_a = tl.load(out_a_ptr + f * stride_at + h * stride_ah + dv, mask=dv_ok, other=0.0).to(tl.float32)
    top = tl.maximum(lse_a, lse_b)
    empty = top == float("-inf")
    top_safe = tl.where(empty, 0.0, top)
    w_a = tl.exp(lse_a - top_safe)
    w_b = tl.exp(lse_b - top_safe)
    denom = tl.where(empty, 1.0, w_a + w_b)
    merged = (out_a * w_a + out_b * w_b) / denom
    merged = tl.where(empty, 0.0, merged)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + dv, merged.to(out_ptr.dtype.element_ty), mask=dv_ok)


def tree_suffix_merge(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    batch: tree_state.TreeBatch,
    scale: float,
    softcap: float = 0.0,
) -> None:
    """Write the tree-masked attention of the batch's fix rows into output [T, H, Dv] (rows batch.fix_rows):
    the prefix part out_a [F, H, Dv] / lse_a [H, F] (FlashAttention's, over context + root) merged with the masked
    suffix over this step's draft rows of key [T, Hkv, D] / value [T, Hkv, Dv]. query [T, H, D]. One launch; no
    host sync (every size comes from a tensor shape)."""
    num_fix = batch.fix_rows.shape[0]
    if num_fix == 0:
        return
    heads, head_d = query.shape[1], query.shape[2]
    kv_heads, head_dv = key.shape[1], value.shape[2]
    width = batch.parent_local.shape[1]
    if width > 64:
        raise ValueError(f"tree_suffix_merge: {width} drafts per request exceed the 64 a fix row's bit mask holds")
    for name, t in (("query", query), ("key", key), ("value", value), ("out_a", out_a), ("output", output)):
        if t.stride(-1) != 1:
            raise ValueError(f"tree_suffix_merge: {name} must have a unit stride in its last dimension")
    if out_a.shape != (num_fix, heads, head_dv) or lse_a.shape != (heads, num_fix):
        raise ValueError(
            f"tree_suffix_merge: prefix parts {tuple(out_a.shape)} / {tuple(lse_a.shape)} do not match "
            f"{num_fix} fix rows x {heads} heads x {head_dv}"
        )
    _tree_suffix_merge_kernel[(num_fix, heads)](
        query, key, value, out_a, lse_a, output,
        batch.fix_rows, batch.fix_req, batch.fix_bits, batch.root_row, batch.num_draft,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1), output.stride(0), output.stride(1),
        float(scale), float(softcap or 1.0),
        GROUP=heads // kv_heads, HEAD_D=head_d, HEAD_DV=head_dv,
        BLOCK_D=triton.next_power_of_2(head_d), BLOCK_DV=triton.next_power_of_2(head_dv),
        BLOCK_N=max(16, triton.next_power_of_2(max(width, 1))), USE_SOFTCAP=bool(softcap),
    )  # fmt: skip
