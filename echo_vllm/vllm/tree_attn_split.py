"""The tree fix rows' attention as a split recompute in plain torch (no vLLM import): index and mask logic,
the masked suffix, a torch reference of the FlashAttention prefix, the log-sum-exp merge and KV compaction.

`tree_attn_cuda.EchoTreeFlashAttentionImpl` runs `tree_fix_rows` with vLLM's FlashAttention kernel as the prefix
part and vLLM's `merge_attn_states` as the merge; this module holds everything else, so that it imports, is
tested on CPU and runs on a CUDA device without vLLM (scripts/device_trees.py times it on a GPU). The method is
described in tree_attn_cuda's docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from echo_vllm.vllm import tree_state

# (q, key_cache, value_cache, block_table, cu_seqlens_q, seqused_k, scale, softcap) -> (out [F, H, Dv], lse [H, F])
PrefixFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (out_a, lse_a, out_b, lse_b) -> merged out [F, H, Dv]
MergeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --- cache layout ---------------------------------------------------------------------------------------------


def fa_kv_views(kv_cache: torch.Tensor, head_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache), each [num_blocks, block_size, Hkv, D], views of a FlashAttention layer cache:
    the 0.32 layout [num_blocks, Hkv, block_size, 2D] (as FlashAttentionImpl.forward splits it) or the older
    [2, num_blocks, block_size, Hkv, D]. Token `slot` sits at [slot // block_size, slot % block_size]."""
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        return kv_cache[0], kv_cache[1]
    if kv_cache.dim() != 4:
        raise ValueError(f"fa_kv_views: a FlashAttention layer cache is 4-D, got shape {tuple(kv_cache.shape)}")
    if head_size is None:
        head_size = kv_cache.shape[-1] // 2
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def echo_compact_cuda(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy the K and V of slot src[i] to slot dst[i], every KV head (slot = block * block_size + offset, the
    slot_mapping convention), in a FlashAttention layer cache (either layout of `fa_kv_views`). All sources are
    gathered before any destination is written, so overlapping moves are exact whatever their order."""
    if src_slots.shape != dst_slots.shape:
        raise ValueError(
            f"echo_compact_cuda: {tuple(src_slots.shape)} sources but {tuple(dst_slots.shape)} destinations"
        )
    if src_slots.numel() == 0:
        return
    src = src_slots.to(device=kv_cache.device, dtype=torch.long).flatten()
    dst = dst_slots.to(device=kv_cache.device, dtype=torch.long).flatten()
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:  # [2, nb, bs, Hkv, D]: K and V in one gather
        block_size = kv_cache.shape[2]
        moved = kv_cache[:, src // block_size, src % block_size]  # [2, n, Hkv, D] (a copy)
        kv_cache[:, dst // block_size, dst % block_size] = moved
        return
    if kv_cache.dim() != 4:
        raise ValueError(f"echo_compact_cuda: unexpected cache shape {tuple(kv_cache.shape)}")
    block_size = kv_cache.shape[2]  # [nb, Hkv, bs, 2D]: a token's K and V are its [Hkv, 2D] slice
    moved = kv_cache[src // block_size, :, src % block_size]  # [n, Hkv, 2D] (a copy)
    kv_cache[dst // block_size, :, dst % block_size] = moved


# --- the fix rows' index and mask logic (pure torch, no host sync) --------------------------------------------


@dataclass(frozen=True)
class FixRowGroups:
    """The fix rows as FlashAttention varlen "sequences", one per request row of the batch (B = batch.num_reqs;
    requests without fix rows are empty query sequences). The fix rows must be grouped by request in ascending
    order, as `tree_state.build_tree_batch` makes them.

    cu_seqlens_q [B+1] int32: fix rows of request b = q rows cu[b]..cu[b+1]; seqused_k [B] int32 = context_len + 1
    (the keys every tree row sees: context and root); counts [B] int64 = fix rows per request."""

    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    counts: torch.Tensor


def fix_row_groups(batch: tree_state.TreeBatch) -> FixRowGroups:
    """`FixRowGroups` of the batch (no host sync: sizes come from tensor shapes)."""
    fix_req = batch.fix_req.long()
    counts = torch.zeros(batch.num_reqs, dtype=torch.long, device=fix_req.device)
    counts.index_add_(0, fix_req, torch.ones_like(fix_req))
    cu = torch.zeros(batch.num_reqs + 1, dtype=torch.int32, device=fix_req.device)
    cu[1:] = torch.cumsum(counts, 0).to(torch.int32)
    if fix_req.device.type == "cpu" and fix_req.numel() > 1 and bool((fix_req[1:] < fix_req[:-1]).any()):
        raise ValueError("fix_row_groups: the fix rows are not grouped by request in ascending order")
    return FixRowGroups(cu, (batch.context_len.long() + 1).to(torch.int32), counts)


def suffix_mask(batch: tree_state.TreeBatch) -> torch.Tensor:
    """[F, Nmax] bool: fix row f sees draft j of its request (ancestor or self: bit j of fix_bits[f]), for the
    drafts the request has this step (Nmax = the batch's widest request)."""
    width = batch.parent_local.shape[1]
    j = torch.arange(width, device=batch.fix_bits.device)
    bits = (batch.fix_bits.long().unsqueeze(1) >> j) & 1
    real = j.unsqueeze(0) < batch.num_draft.long()[batch.fix_req.long()].unsqueeze(1)
    return (bits == 1) & real


def _suffix_rows(batch: tree_state.TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """([F, Nmax] flat step rows of each fix row's request's drafts, [F, Nmax] bool: the draft exists). Missing
    drafts point at the request's root row, a real row of the step (never padding, never another request)."""
    width = batch.parent_local.shape[1]
    req = batch.fix_req.long()
    j = torch.arange(width, device=req.device).unsqueeze(0)
    real = j < batch.num_draft.long()[req].unsqueeze(1)
    root = batch.root_row.long()[req].unsqueeze(1)
    return torch.where(real, root + 1 + j, root.expand(-1, width)), real


def suffix_kv(key: torch.Tensor, value: torch.Tensor, batch: tree_state.TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft K and V each fix row may attend to in this step's own (post-RoPE) key / value rows:
    [F, Nmax, Hkv, D] and [F, Nmax, Hkv, Dv] (draft j of the row's request at row root_row + 1 + j)."""
    rows, _ = _suffix_rows(batch)
    return key[rows], value[rows]


def suffix_kv_paged(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, batch: tree_state.TreeBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """`suffix_kv` from the paged cache (the step's K/V are written before attention): draft j of request b at
    logical position context_len[b] + 1 + j. For layers that get no key/value (KV sharing)."""
    width = batch.parent_local.shape[1]
    req = batch.fix_req.long()
    j = torch.arange(width, device=req.device).unsqueeze(0)
    real = j < batch.num_draft.long()[req].unsqueeze(1)
    ctx = batch.context_len.long()[req].unsqueeze(1)
    pos = torch.where(real, ctx + 1 + j, ctx.expand(-1, width))
    block_size = key_cache.shape[1]
    blocks = torch.gather(block_table.long()[req], 1, pos // block_size)
    return key_cache[blocks, pos % block_size], value_cache[blocks, pos % block_size]


def _softcapped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(logits / softcap) if softcap else logits


def suffix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked float32 attention of q [F, H, D] over its own keys k [F, N, Hkv, D] / v [F, N, Hkv, Dv] (GQA:
    query head h reads KV head h // (H / Hkv)), mask [F, N]. Returns (out [F, H, Dv], lse [H, F]), both float32,
    lse over the (softcapped) scaled logits as FlashAttention defines it; a row with no visible key gets out 0 and
    lse -inf (merge_attn_states then takes the other part alone)."""
    num_rows, heads, _ = q.shape
    kv_heads = k.shape[2]
    qg = q.float().view(num_rows, kv_heads, heads // kv_heads, -1)
    logits = _softcapped(torch.einsum("fkgd,fnkd->fkgn", qg, k.float()) * scale, softcap)
    visible = mask.view(num_rows, 1, 1, -1)
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [F, Hkv, G]
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    values = v.float().masked_fill(~mask.view(num_rows, -1, 1, 1), 0.0)  # padding rows never leak NaN
    out = torch.einsum("fkgn,fnkd->fkgd", probs, values).reshape(num_rows, heads, -1)
    return out, lse.reshape(num_rows, heads).transpose(0, 1).contiguous()


def prefix_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `flash_attn_varlen_func(q, key_cache, value_cache, cu_seqlens_q=..., seqused_k=...,
    block_table=..., causal=False, return_softmax_lse=True)` on a paged cache: query rows cu[b]..cu[b+1] attend to
    all seqused_k[b] first tokens of sequence b (block_table[b]). key/value_cache [nb, block_size, Hkv, D].
    Returns (out [F, H, Dv] float32, lse [H, F] float32)."""
    num_rows = q.shape[0]
    seq_of = torch.searchsorted(cu_seqlens_q.long(), torch.arange(num_rows, device=q.device), right=True) - 1
    lengths = seqused_k.long()[seq_of]  # [F]
    longest = int(lengths.max()) if num_rows else 0
    pos = torch.arange(longest, device=q.device).unsqueeze(0)
    in_seq = pos < lengths.unsqueeze(1)  # [F, L]
    safe = torch.where(in_seq, pos, torch.zeros_like(pos))
    block_size = key_cache.shape[1]
    blocks = torch.gather(block_table.long()[seq_of], 1, safe // block_size)
    keys, values = key_cache[blocks, safe % block_size], value_cache[blocks, safe % block_size]  # [F, L, Hkv, D]
    return suffix_attention(q, keys, values, in_seq, scale, softcap)


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the parts' outputs [T, H, Dv] and LSEs [H, T],
    exactly as vLLM's `merge_attn_states` (+inf LSE read as -inf; both empty: out 0, lse -inf). Float32 results."""
    inf = float("inf")
    lse_a = torch.where(torch.isposinf(lse_a), torch.full_like(lse_a, -inf), lse_a).float()
    lse_b = torch.where(torch.isposinf(lse_b), torch.full_like(lse_b, -inf), lse_b).float()
    top = torch.maximum(lse_a, lse_b)
    empty = top == -inf
    top_safe = torch.where(empty, torch.zeros_like(top), top)
    wa, wb = torch.exp(lse_a - top_safe), torch.exp(lse_b - top_safe)
    total = wa + wb
    denom = torch.where(empty, torch.ones_like(total), total)
    sa = (wa / denom).transpose(0, 1).unsqueeze(-1)
    sb = (wb / denom).transpose(0, 1).unsqueeze(-1)
    out = out_a.float() * sa + out_b.float() * sb
    out = out.masked_fill(empty.transpose(0, 1).unsqueeze(-1), 0.0)
    lse = torch.where(empty, torch.full_like(top, -inf), torch.log(denom) + top_safe)
    return out, lse


def _merge_reference(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    return merge_by_lse(out_a, lse_a, out_b, lse_b)[0]


def tree_fix_rows(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    batch: tree_state.TreeBatch,
    scale: float,
    softcap: float = 0.0,
    prefix_fn: PrefixFn = prefix_attention_reference,
    merge_fn: MergeFn = _merge_reference,
) -> torch.Tensor:
    """The tree-masked attention of the batch's fix rows, [F, H, Dv] (prefix_fn's dtype after merge_fn):
    prefix (context + root, via prefix_fn: the FA kernel on CUDA, `prefix_attention_reference` in tests) merged
    with the masked suffix over the request's drafts. query [T, H, D]; key / value [T, Hkv, D] this step's rows
    (None: read the drafts from the paged cache); key/value_cache [nb, block_size, Hkv, D]; block_table [>= B, *]
    the request rows' block tables."""
    heads = query.shape[1]
    groups = fix_row_groups(batch)
    q = query[batch.fix_rows.long()].reshape(-1, heads, query.shape[-1])
    table = block_table[: batch.num_reqs]
    out_a, lse_a = prefix_fn(q, key_cache, value_cache, table, groups.cu_seqlens_q, groups.seqused_k, scale, softcap)
    if key is not None and value is not None:
        k, v = suffix_kv(key, value, batch)
    else:
        k, v = suffix_kv_paged(key_cache, value_cache, table, batch)
    out_b, lse_b = suffix_attention(q, k, v, suffix_mask(batch), scale, softcap)
    return merge_fn(out_a, lse_a, out_b, lse_b)
