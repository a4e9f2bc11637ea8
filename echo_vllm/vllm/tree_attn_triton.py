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
    num_fix_ptr,
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
    if f >= tl.load(num_fix_ptr):  # a padded grid (CUDA graphs): rows past the step's fix rows do nothing
        return
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


def _check_step(op: str, batch: tree_state.TreeBatch, **tensors: torch.Tensor) -> int:
    """The kernels' shared argument checks; returns the step's widest request (drafts per request, <= 64: a fix
    row's ancestor bits are one int64)."""
    width = batch.parent_local.shape[1]
    if width > 64:
        raise ValueError(f"{op}: {width} drafts per request exceed the 64 a fix row's bit mask holds")
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have a unit stride in its last dimension")
    return width


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
    num_fix: torch.Tensor | None = None,
) -> None:
    """Write the tree-masked attention of the batch's fix rows into output [T, H, Dv] (rows batch.fix_rows):
    the prefix part out_a [F, H, Dv] / lse_a [H, F] (FlashAttention's, over context + root) merged with the masked
    suffix over this step's draft rows of key [T, Hkv, D] / value [T, Hkv, Dv]. query [T, H, D]. One launch; no
    host sync (every size comes from a tensor shape). num_fix (a 1-element int32 device tensor, default: F) says
    how many of the F fix rows are real, so that a CUDA graph captured over padded buffers can be replayed."""
    capacity = batch.fix_rows.shape[0]
    if capacity == 0:
        return
    heads, head_d = query.shape[1], query.shape[2]
    kv_heads, head_dv = key.shape[1], value.shape[2]
    width = _check_step("tree_suffix_merge", batch, query=query, key=key, value=value, out_a=out_a, output=output)
    if out_a.shape != (capacity, heads, head_dv) or lse_a.shape != (heads, capacity):
        raise ValueError(
            f"tree_suffix_merge: prefix parts {tuple(out_a.shape)} / {tuple(lse_a.shape)} do not match "
            f"{capacity} fix rows x {heads} heads x {head_dv}"
        )
    if num_fix is None:
        num_fix = torch.full((1,), capacity, dtype=torch.int32, device=query.device)
    _tree_suffix_merge_kernel[(capacity, heads)](
        query, key, value, out_a, lse_a, output, num_fix,
        batch.fix_rows, batch.fix_req, batch.fix_bits, batch.root_row, batch.num_draft,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1), output.stride(0), output.stride(1),
        float(scale), float(softcap or 1.0),
        GROUP=heads // kv_heads, HEAD_D=head_d, HEAD_DV=head_dv,
        BLOCK_D=triton.next_power_of_2(head_d), BLOCK_DV=triton.next_power_of_2(head_dv),
        BLOCK_N=max(16, triton.next_power_of_2(max(width, 1))), USE_SOFTCAP=bool(softcap),
    )  # fmt: skip


# --- the whole fix row in one kernel (prefix over the paged cache + suffix), graph-capturable ------------------


@triton.jit
def _tree_fix_rows_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    block_table_ptr,
    out_ptr,
    num_fix_ptr,
    fix_rows_ptr,
    fix_req_ptr,
    fix_bits_ptr,
    root_row_ptr,
    num_draft_ptr,
    context_len_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bt,
    stride_ot,
    stride_oh,
    block_size,
    scale,
    softcap,
    GROUP: tl.constexpr,
    HEAD_D: tl.constexpr,
    HEAD_DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    f = tl.program_id(0)
    if f >= tl.load(num_fix_ptr):  # a padded grid (CUDA graphs): rows past the step's fix rows do nothing
        return
    h = tl.program_id(1)
    row = tl.load(fix_rows_ptr + f).to(tl.int64)
    req = tl.load(fix_req_ptr + f).to(tl.int64)
    bits = tl.load(fix_bits_ptr + f).to(tl.int64)
    root = tl.load(root_row_ptr + req).to(tl.int64)
    drafts = tl.load(num_draft_ptr + req).to(tl.int64)
    seen = tl.load(context_len_ptr + req).to(tl.int64) + 1  # context + root: every tree row sees them
    kv_head = h // GROUP

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < HEAD_DV
    q = tl.load(q_ptr + row * stride_qt + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)

    # Online softmax over the prefix, BLOCK_K cache positions at a time (flash-decoding style, one query row).
    top = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for start in range(0, seen, BLOCK_K):
        pos = start + tl.arange(0, BLOCK_K).to(tl.int64)
        live = pos < seen
        block = tl.load(block_table_ptr + req * stride_bt + pos // block_size, mask=live, other=0).to(tl.int64)
        slot = pos % block_size
        k = tl.load(
            kc_ptr + block[:, None] * stride_kcb + slot[:, None] * stride_kcs + kv_head * stride_kch + d[None, :],
            mask=live[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        logits = tl.sum(k * q[None, :], axis=1) * scale
        if USE_SOFTCAP:
            logits = softcap * (2.0 * tl.sigmoid(2.0 * logits / softcap) - 1.0)
        logits = tl.where(live, logits, float("-inf"))
        new_top = tl.maximum(top, tl.max(logits, axis=0))  # finite: position 0 is always live in the first block
        rescale = tl.exp(top - new_top)
        p = tl.where(live, tl.exp(logits - new_top), 0.0)
        v = tl.load(
            vc_ptr + block[:, None] * stride_vcb + slot[:, None] * stride_vcs + kv_head * stride_vch + dv[None, :],
            mask=live[:, None] & dv_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        total = total * rescale + tl.sum(p, axis=0)
        top = new_top

    # The suffix: this row's ancestor-or-self drafts among the step's own K/V rows, one more softmax block.
    j = tl.arange(0, BLOCK_N).to(tl.int64)
    visible = (((bits >> j) & 1) == 1) & (j < drafts)
    key_row = root + 1 + j
    k = tl.load(
        k_ptr + key_row[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
        mask=visible[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    logits = tl.sum(k * q[None, :], axis=1) * scale
    if USE_SOFTCAP:
        logits = softcap * (2.0 * tl.sigmoid(2.0 * logits / softcap) - 1.0)
    logits = tl.where(visible, logits, float("-inf"))
    new_top = tl.maximum(top, tl.max(logits, axis=0))
    rescale = tl.exp(top - new_top)
    p = tl.where(visible, tl.exp(logits - new_top), 0.0)
    v = tl.load(
        v_ptr + key_row[:, None] * stride_vt + kv_head * stride_vh + dv[None, :],
        mask=visible[:, None] & dv_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
    total = total * rescale + tl.sum(p, axis=0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + dv, (acc / total).to(out_ptr.dtype.element_ty), mask=dv_ok)


def tree_fix_rows_fused(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    batch: tree_state.TreeBatch,
    scale: float,
    softcap: float = 0.0,
    num_fix: torch.Tensor | None = None,
    block_k: int = 64,
) -> None:
    """Write the tree-masked attention of the batch's fix rows into output [T, H, Dv], whole, in one launch: each
    fix row over its request's context + root read from the paged cache (key/value_cache [nb, block_size, Hkv, D],
    `fa_kv_views`; block_table [>= B, *]) and over its ancestor-or-self drafts among this step's key / value rows
    [T, Hkv, D]. query [T, H, D].

    The grid is (len(batch.fix_rows), H); num_fix (a 1-element int32 device tensor, default: all of them) says how
    many rows are real, so that a CUDA graph can be captured over padded fix-row buffers and replayed for any step
    that fits. No host sync."""
    capacity = batch.fix_rows.shape[0]
    if capacity == 0:
        return
    heads, head_d = query.shape[1], query.shape[2]
    kv_heads, head_dv = key.shape[1], value.shape[2]
    width = _check_step(
        "tree_fix_rows_fused", batch, query=query, key=key, value=value, output=output,
        key_cache=key_cache, value_cache=value_cache,
    )  # fmt: skip
    if num_fix is None:
        num_fix = torch.full((1,), capacity, dtype=torch.int32, device=query.device)
    _tree_fix_rows_kernel[(capacity, heads)](
        query, key, value, key_cache, value_cache, block_table, output,
        num_fix, batch.fix_rows, batch.fix_req, batch.fix_bits, batch.root_row, batch.num_draft, batch.context_len,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), output.stride(0), output.stride(1),
        key_cache.shape[1], float(scale), float(softcap or 1.0),
        GROUP=heads // kv_heads, HEAD_D=head_d, HEAD_DV=head_dv,
        BLOCK_D=triton.next_power_of_2(head_d), BLOCK_DV=triton.next_power_of_2(head_dv),
        BLOCK_N=max(16, triton.next_power_of_2(max(width, 1))), BLOCK_K=block_k, USE_SOFTCAP=bool(softcap),
    )  # fmt: skip
