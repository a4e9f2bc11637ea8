"""Tree verification on vLLM's CUDA FlashAttention backend: the stock kernel, then an exact recompute of the fix rows.

`EchoTreeFlashAttentionImpl.forward` lets vLLM's FlashAttention run over the whole batch (exact for prefills,
roots, chains and a tree's spine in spine-first order) and then overwrites only the rows the step's `TreeBatch`
lists as fix-up rows. Their attention splits, exactly, into two parts over disjoint key sets, merged by log-sum-exp
(the cascade-attention pattern; no new kernel):

(a) prefix: the fix rows' queries over their request's context and root (logical positions 0..context_len, all
    visible: non-causal), read from the paged cache by `flash_attn_varlen_func(causal=False,
    return_softmax_lse=True)` with one "sequence" per request of the batch (`fix_row_groups`: cu_seqlens_q over
    the fix rows grouped by request, seqused_k = context_len + 1, the request's block-table row);
(b) suffix: the same queries over the request's own draft K/V of this step (the post-RoPE `key` / `value` rows
    root_row + 1 + j that forward receives, or the paged cache when a KV-sharing layer gets none), under the
    ancestor-or-self bit mask (`suffix_mask`), in torch: at most 63 keys per row (`suffix_attention`);
(c) `merge_attn_states` (vLLM's op; `merge_by_lse` is its torch reference), written into the fix rows of output.

The index and mask logic are pure torch functions, so the CPU tests run the same composition (`tree_fix_rows`)
with `prefix_attention_reference` in place of the FA kernel. Nothing here is computed on the host per layer: no
device-to-host sync (max_seqlen_q/k come from the attention metadata's host ints, which bound the fix rows').

KV cache layout. The vLLM 0.32 FlashAttention layer cache is the logical 4-D view [num_blocks, Hkv, block_size,
2 * D] (K in the first D channels, V in the last D; any stride order, see kv_cache_interface.create_kv_cache_views),
which `FlashAttentionImpl` reads as `kv_cache.transpose(1, 2).split(D, -1)` = two [num_blocks, block_size, Hkv, D]
views. Older vLLMs used [2, num_blocks, block_size, Hkv, D]; `fa_kv_views` and `echo_compact_cuda` accept both.

Selection (`register_cuda_tree_backend`). `CudaPlatform.get_attn_backend_cls` resolves every candidate through
`AttentionBackendEnum.get_class()`, which honours `register_backend` overrides, so overriding FLASH_ATTN's class
path is enough and is the least invasive way in: the subclass keeps the name "FLASH_ATTN" (so
`Attention.backend = AttentionBackendEnum[get_name()]` and every name check stay as stock), its builder, metadata,
cache layout and CUDA-graph support; non-tree steps are stock. CUSTOM would also work but needs
`attention_config.backend = CUSTOM` and leaves FLASH_ATTN's class (looked up by name) pointing at the stock one.
The engine config, in tree mode on CUDA, must pin `attention_config.backend = FLASH_ATTN` (`required_attention_backend`; and refuse a
`backend_per_kind` entry naming another backend):
auto-selection picks FLASHINFER on SM100 (or TRITON_FLASH_ATTN for mm-prefix on SM90), which would verify trees
with a causal mask, silently wrong. Register before the runner builds its layers (EchoDrafterPatch, before the
original `GPUModelRunner.__init__`); the selector's cache is cleared here.

CUDA graphs. A FULL graph captured without the tree mask replays vLLM's kernel only, never the fix-up, so tree steps
must not replay one (FA3's builder advertises `AttentionCGSupport.ALWAYS`, so FULL graphs exist for mixed batches
too, and forcing "non-uniform" is not enough). `guard_batch_execution` wraps
`GPUModelRunner._determine_batch_execution_and_padding`: on a tree step it adds FULL to the dispatcher's
`invalid_modes`, so the step runs PIECEWISE (attention runs eagerly between the pieces) or eagerly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides, is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from echo_vllm.vllm import tree_state
from echo_vllm.vllm.backend_override import BackendOverride

BACKEND_PATH = f"{__name__}.EchoTreeFlashAttentionBackend"

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


def merge_vllm(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """`merge_by_lse` through vLLM's `merge_attn_states` (its CUDA kernel on CUDA, its torch fallback on CPU):
    the suffix part is cast to the prefix part's dtype, as the kernel takes both in one dtype and one head stride."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    out_a = out_a.contiguous()
    out_b = out_b.to(out_a.dtype).contiguous()
    merged = torch.empty_like(out_a)
    merge_attn_states(merged, out_a, lse_a.float().contiguous(), out_b, lse_b.float().contiguous())
    return merged


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


# --- the backend ----------------------------------------------------------------------------------------------


class EchoTreeFlashAttentionImpl(FlashAttentionImpl):
    """FlashAttentionImpl whose forward, on a tree step, recomputes the fix rows with the tree mask."""

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = tree_state.current()
        tree = batch is not None and attn_metadata is not None and batch.num_fix_rows > 0
        if tree:
            # Before the kernel runs: a refused layer must fail with its reason, not with whatever the kernel does.
            self._check_tree_supported(attn_metadata)
        output = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        if tree and kv_cache.numel() > 0:  # a cacheless call (profiling) has nothing to recompute from
            assert batch is not None
            self._fix_tree_rows(batch, query, key, value, kv_cache, attn_metadata, output)
        return output

    def _check_tree_supported(self, attn_metadata: Any = None) -> None:
        """Refuse, loudly, the layers and batches the split recompute does not model."""
        reasons = []
        if self.attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {self.attn_type!r} (only decoder self-attention verifies trees)")
        if self.alibi_slopes is not None:
            reasons.append("ALiBi slopes")
        if tuple(self.sliding_window) != (-1, -1):
            reasons.append(f"a sliding window ({self.sliding_window})")
        if self.sinks is not None:
            reasons.append("attention sinks")
        if is_quantized_kv_cache(self.kv_cache_dtype):
            reasons.append(f"a quantized KV cache ({self.kv_cache_dtype})")
        if self.dcp_world_size > 1:
            reasons.append(f"decode context parallelism ({self.dcp_world_size})")
        if attn_metadata is not None:
            if getattr(attn_metadata, "causal", True) is not True:
                reasons.append("non-causal or per-sequence causal attention metadata")
            if getattr(attn_metadata, "mm_prefix_query_range_tensor", None) is not None:
                reasons.append("multimodal prefix (bidirectional) ranges")
            if getattr(attn_metadata, "rswa_prefix_lens", None) is not None:
                reasons.append("R-SWA")
        if reasons:
            raise ValueError(
                "ECHO tree verification on FLASH_ATTN does not support a layer with "
                + ", ".join(reasons)
                + "; run this model with chain drafts (echo top_k = 1)"
            )

    def echo_compact(
        self, kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, isa: str | None = None
    ) -> None:
        """`echo_compact_cuda` on this layer's cache (isa: ignored, for the CPU backend's call signature)."""
        echo_compact_cuda(kv_cache, src_slots, dst_slots)

    def _prefix_fa(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seqused_k: torch.Tensor,
        scale: float,
        softcap: float,
        *,
        max_seqlen_q: int,
        max_seqlen_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm.utils.math_utils import cdiv
        from vllm.v1.attention.backends.fa_utils import FA4_HD256_PAGE_SIZE, flash_attn_varlen_func

        num_splits = 0
        if self.fa4_hd256:  # as FlashAttentionImpl.forward: page-aligned lengths, exact-width tables, no SplitKV
            num_pages = cdiv(max_seqlen_k, FA4_HD256_PAGE_SIZE)
            max_seqlen_k = num_pages * FA4_HD256_PAGE_SIZE
            block_table = block_table[:, :num_pages]
            num_splits = 1
        out, lse = flash_attn_varlen_func(
            q=q,
            k=key_cache,
            v=value_cache,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            seqused_k=seqused_k,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=scale,
            causal=False,
            softcap=softcap,
            block_table=block_table,
            return_softmax_lse=True,
            fa_version=self.vllm_flash_attn_version,
            num_splits=num_splits,
        )
        return out, lse

    def _fix_tree_rows(
        self,
        batch: tree_state.TreeBatch,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: Any,
        output: torch.Tensor,
    ) -> None:
        num_reqs = meta.query_start_loc.shape[0] - 1
        if batch.num_reqs > num_reqs:
            raise RuntimeError(
                f"tree batch of {batch.num_reqs} requests meets attention metadata of {num_reqs}: "
                "the tree batch was not cleared after its target forward"
            )
        key_cache, value_cache = fa_kv_views(kv_cache, self.head_size)
        key_cache = canonicalize_singleton_dim_strides(key_cache)  # FA3/4's TMA, as the base forward does
        value_cache = canonicalize_singleton_dim_strides(value_cache)
        if self.kv_sharing_target_layer_name is not None:
            key = value = None  # this layer's K/V live in the target layer's cache only
        # Host-side bounds, no sync: a request's fix rows are at most its query length, its prefix at most seq_len.
        prefix = functools.partial(self._prefix_fa, max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len)
        rows = tree_fix_rows(
            query, key, value, key_cache, value_cache, meta.block_table, batch, self.scale,
            float(self.logits_soft_cap or 0.0), prefix_fn=prefix, merge_fn=merge_vllm,
        )  # fmt: skip
        out = output.view(output.shape[0], self.num_heads, -1)  # callers pass [T, H, Dv] or [T, H * Dv]
        out.index_copy_(0, batch.fix_rows.to(out.device).long(), rows.to(out.dtype))


class EchoTreeFlashAttentionBackend(FlashAttentionBackend):
    """FLASH_ATTN with tree fix-up rows; name, builder, metadata, cache layout and CUDA-graph support are the
    parent's."""

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return EchoTreeFlashAttentionImpl


# --- selection ------------------------------------------------------------------------------------------------

_OVERRIDE = BackendOverride(AttentionBackendEnum.FLASH_ATTN, BACKEND_PATH)


def register_cuda_tree_backend() -> str:
    """Make FLASH_ATTN resolve to EchoTreeFlashAttentionBackend; idempotent. Returns the class path. The engine must
    also select FLASH_ATTN (`required_attention_backend`)."""
    return _OVERRIDE.register()


def unregister_cuda_tree_backend() -> None:
    """Undo register_cuda_tree_backend (FLASH_ATTN resolves to what it did before)."""
    _OVERRIDE.unregister()


def required_attention_backend(selected: AttentionBackendEnum | str | None) -> AttentionBackendEnum:
    """The `attention_config.backend` a CUDA tree-mode engine must run with, given the user's choice (None: auto):
    FLASH_ATTN; any other explicit choice raises (its kernel would verify trees with a causal mask)."""
    if isinstance(selected, str):
        selected = None if selected.lower() == "auto" else AttentionBackendEnum[selected.upper()]
    if selected not in (None, AttentionBackendEnum.FLASH_ATTN):
        raise ValueError(
            f"ECHO tree verification on CUDA needs the FLASH_ATTN attention backend, not {selected.name}; "
            "drop the attention backend setting or run with chain drafts (echo top_k = 1)"
        )
    return AttentionBackendEnum.FLASH_ATTN


# --- CUDA graphs ----------------------------------------------------------------------------------------------


def tree_step_cudagraph_modes(tree_step: bool, valid_modes: Any = None, invalid_modes: Any = None) -> tuple[Any, Any]:
    """The (valid_modes, invalid_modes) to pass `CudagraphDispatcher.dispatch` on a step: unchanged off tree steps;
    on tree steps FULL is invalid (a FULL graph replays no fix-up), so the dispatcher picks PIECEWISE or NONE."""
    from vllm.config import CUDAGraphMode

    if not tree_step:
        return valid_modes, invalid_modes
    invalid = set(invalid_modes or ()) | {CUDAGraphMode.FULL}
    if valid_modes is not None and not set(valid_modes) - invalid:
        # Only when data-parallel peers agreed on FULL: they take the minimum mode, and ours is never FULL here.
        raise RuntimeError(f"a tree step was offered only the CUDA graph modes {set(valid_modes)}; FULL is unsafe")
    return valid_modes, invalid


@contextlib.contextmanager
def no_full_cudagraphs(dispatcher: Any) -> Iterator[None]:
    """Within the block, `dispatcher.dispatch` (an instance attribute shadowing the method) never returns FULL."""
    had_own = "dispatch" in vars(dispatcher)
    saved = vars(dispatcher).get("dispatch")
    bound = dispatcher.dispatch

    def dispatch(*args: Any, valid_modes: Any = None, invalid_modes: Any = None, **kwargs: Any) -> Any:
        valid, invalid = tree_step_cudagraph_modes(True, valid_modes, invalid_modes)
        return bound(*args, valid_modes=valid, invalid_modes=invalid, **kwargs)

    dispatcher.dispatch = dispatch
    try:
        yield
    finally:
        if had_own:
            dispatcher.dispatch = saved
        else:
            del dispatcher.dispatch


def guard_batch_execution(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `GPUModelRunner._determine_batch_execution_and_padding(self, num_tokens, num_reqs,
    num_scheduled_tokens_np, max_num_scheduled_tokens, use_cascade_attn=False, allow_microbatching=True,
    force_eager=False, force_uniform_decode=None, force_has_lora=None, force_num_active_loras=None,
    num_encoder_reqs=0)`: while a TreeBatch is published (execute_model calls it right after `_prepare_inputs`, where
    the tree batch is built) the runner's dispatcher may not pick FULL. Off tree steps (capture, dummy runs, chains)
    it is the original call."""

    @functools.wraps(original)
    def _determine_batch_execution_and_padding(self: Any, *args: Any, **kwargs: Any) -> Any:
        if tree_state.current() is None:
            return original(self, *args, **kwargs)
        from vllm.config import CUDAGraphMode

        with no_full_cudagraphs(self.cudagraph_dispatcher):
            result = original(self, *args, **kwargs)
        if result[0] == CUDAGraphMode.FULL:
            raise RuntimeError("a tree step was dispatched to a FULL CUDA graph, which replays no tree mask")
        return result

    return _determine_batch_execution_and_padding


def non_tree_layers(static_forward_context: dict[str, Any], names: Any = None) -> list[str]:
    """The attention layers (of `names`, default all in the runner's forward context) with a KV cache whose impl
    would not run the tree fix-up on CUDA; empty: all do. For the engine to check once after load_model, over the
    target model's layers (the EAGLE head never sees a tree batch), so a backend chosen elsewhere fails loudly
    instead of verifying trees with a causal mask."""
    bad = []
    for name in static_forward_context if names is None else names:
        layer = static_forward_context.get(name)
        impl = getattr(layer, "impl", None)
        if impl is None or getattr(layer, "kv_cache", None) is None:
            continue
        if getattr(layer, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
            continue
        if not isinstance(impl, EchoTreeFlashAttentionImpl):
            bad.append(name)
    return bad
