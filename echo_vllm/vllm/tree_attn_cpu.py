"""Tree verification on vLLM's CPU attention backend: the stock kernel, then a masked recompute of the fix-up rows.

vLLM's C++ CPU kernel (`ops.cpu_attention_with_kv_cache`) knows only `causal` and `dynamic_causal`; it takes no
mask and returns no log-sum-exp, so a tree mask cannot be merged into it. It is exact, though, for every row whose
ancestors are exactly the rows before it (prefills, roots, chains, and a tree's spine in spine-first order). So
`EchoTreeCPUAttentionImpl.forward` lets it run over the whole batch and then overwrites only the rows the step's
`TreeBatch` lists as fix-up rows, with a float32 masked attention over the request's paged KV. That is slow but
exact, which is what the CPU path is for (tests and the testbed).

On CPU, `CpuPlatform.get_attn_backend_cls` always answers `CPU_ATTN`, so the backend goes in by overriding that
enum member's class path (`register_cpu_tree_backend`). The subclasses keep the parent's name, builder and
metadata, so every non-tree step behaves exactly as stock.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionLayer, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    _get_attn_isa,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from echo_vllm.ops import tree as tree_ops
from echo_vllm.vllm import tree_state
from echo_vllm.vllm.backend_override import BackendOverride

BACKEND_PATH = f"{__name__}.EchoTreeCPUAttentionBackend"
_DIGIT = 16  # probe codes stay small integers, exact in fp16 and bf16


def _kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value cache arguments of vLLM's CPU cache ops, formed exactly as CPUAttentionBackendImpl does.
    Only the ops know what lies inside them: each (block, head) page of bs * 2D elements is laid out per ISA."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    paired = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1)
    key_cache, value_cache = paired.chunk(2, dim=2)
    return key_cache, value_cache


@functools.cache
def page_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kmap, vmap) [block_size, head_size] int64: the offset of K[t, d] and V[t, d] inside one (block, head) page.

    Found by letting the kernel's own `cpu_attn_reshape_and_cache` write coded tokens into a scratch page: the
    layout is the ISA's business (the vec and vec16 kernels store K transposed, [D, bs], then V as [bs, D]; the
    AMX, NEON and other builds may pack otherwise), so any fixed reading rule would be silently wrong somewhere."""
    from vllm import _custom_ops as ops

    if not dtype.is_floating_point:
        raise ValueError(f"page_layout: a {dtype} KV cache is quantized; tree mode does not read those")
    tok = torch.arange(block_size).view(-1, 1, 1).expand(block_size, 1, head_size)
    dim = torch.arange(head_size).view(1, 1, -1).expand(block_size, 1, head_size)
    slots = torch.arange(block_size)

    def write(k_code: torch.Tensor, v_code: torch.Tensor) -> torch.Tensor:
        page = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = _kv_views(page)
        ops.cpu_attn_reshape_and_cache(
            k_code.to(dtype), v_code.to(dtype), key_cache, value_cache, slots, isa,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip
        return page.view(-1).float().round().long()

    def decode(index: torch.Tensor) -> torch.Tensor:
        value, scale, rest = torch.zeros(2 * block_size * head_size, dtype=torch.long), 1, index.max().item() + 1
        while rest > 0:  # one base-16 digit per pass (codes 1..16; 0 marks offsets the op never wrote)
            code = (index // scale) % _DIGIT + 1
            value += (write(code, code) - 1) * scale
            scale, rest = scale * _DIGIT, rest // _DIGIT
        return value

    kind = write(torch.ones(tok.shape), torch.full(tok.shape, 2.0))  # 1: a K element, 2: a V element
    at_tok, at_dim = decode(tok), decode(dim)
    maps = []
    for code in (1, 2):
        offsets = (kind == code).nonzero().flatten()
        table = torch.full((block_size, head_size), -1, dtype=torch.long)
        table[at_tok[offsets], at_dim[offsets]] = offsets
        if offsets.numel() != block_size * head_size or (table < 0).any():
            raise RuntimeError(f"page_layout: the {isa} kernel's cache page is not a permutation of K and V")
        maps.append(table)
    return maps[0], maps[1]


def _layout_for(kv_cache: torch.Tensor, isa: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, block_size, paired = kv_cache.shape
    head_size = paired // 2
    if isa is None:
        # The builder's choice for this layer (CPUAttentionMetadataBuilder: model dtype = cache dtype unless fp8).
        isa = _get_attn_isa(kv_cache.dtype, block_size, head_size, "auto")
    return page_layout(isa, kv_cache.dtype, block_size, head_size)


def echo_compact(
    kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, isa: str | None = None
) -> None:
    """Copy the K and V of slot src[i] to slot dst[i] for every KV head (slot = block * block_size + offset, the
    slot_mapping convention) in a CPU_ATTN layer cache [nb, Hkv, bs, 2D]. All sources are read before any
    destination is written, so overlapping moves are exact whatever their order. isa: the layer's kernel ISA
    (`layer.isa`); None derives it as vLLM's builder does."""
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"echo_compact: {tuple(src_slots.shape)} sources but {tuple(dst_slots.shape)} destinations")
    if src_slots.numel() == 0:
        return
    kmap, vmap = _layout_for(kv_cache, isa)
    if tree_ops.compiled_tree_ops(kv_cache.device):
        tree_ops.tree_kv_compact(kv_cache, kmap, vmap, src_slots, dst_slots)
        return
    echo_compact_torch(kv_cache, src_slots, dst_slots, kmap, vmap)


def echo_compact_torch(
    kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, kmap: torch.Tensor, vmap: torch.Tensor
) -> None:
    """The torch path of `echo_compact` (the compiled op's reference and fallback)."""
    block_size = kv_cache.shape[2]
    pages = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)
    src = src_slots.to(device=kv_cache.device, dtype=torch.long)
    dst = dst_slots.to(device=kv_cache.device, dtype=torch.long)
    src_block, src_off = src // block_size, src % block_size
    dst_block, dst_off = (dst // block_size).view(-1, 1), dst % block_size
    # Advanced indexing copies, so both gathers are complete before the scatters.
    keys = pages[src_block.view(-1, 1), :, kmap[src_off]]
    values = pages[src_block.view(-1, 1), :, vmap[src_off]]
    pages[dst_block, :, kmap[dst_off]] = keys
    pages[dst_block, :, vmap[dst_off]] = values


class EchoTreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """CPU attention that honours the step's tree mask on the rows the causal kernel gets wrong."""

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = tree_state.current()
        tree = batch is not None and attn_metadata is not None and batch.num_fix_rows > 0
        if tree:
            # Before the kernel runs: a refused layer must fail with its reason, not with whatever the kernel does.
            self._check_tree_supported()
        output = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        if tree and kv_cache.numel() > 0:  # a cacheless call (profiling) has nothing to recompute from
            assert batch is not None and attn_metadata is not None
            self._fix_tree_rows(layer, batch, query, kv_cache, attn_metadata, output)
        return output

    def _check_tree_supported(self) -> None:
        """Refuse, loudly, the layers the masked recompute below does not model."""
        reasons = []
        if self.attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {self.attn_type!r} (only decoder self-attention verifies trees)")
        if self.alibi_slopes is not None:
            reasons.append("ALiBi slopes")
        if self.sliding_window != -1:
            reasons.append(f"a sliding window ({self.sliding_window})")
        if self.sinks is not None:
            reasons.append("attention sinks")
        if self.is_fp8_kv_cache:
            reasons.append(f"a quantized KV cache ({self.kv_cache_dtype})")
        if reasons:
            raise ValueError(
                "ECHO tree verification on CPU_ATTN does not support a layer with "
                + ", ".join(reasons)
                + "; run this model with chain drafts (echo top_k = 1)"
            )

    def echo_compact(
        self, kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, isa: str | None = None
    ) -> None:
        """`echo_compact` on this layer's cache (the accepted path's KV moves after tree sampling)."""
        echo_compact(kv_cache, src_slots, dst_slots, isa)

    def _fix_tree_rows(
        self,
        layer: AttentionLayer,
        batch: tree_state.TreeBatch,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: CPUAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        num_reqs = meta.query_start_loc.shape[0] - 1
        if batch.num_reqs > num_reqs:
            raise RuntimeError(
                f"tree batch of {batch.num_reqs} requests meets attention metadata of {num_reqs}: "
                "the tree batch was not cleared after its target forward"
            )
        if tree_ops.compiled_tree_ops(kv_cache.device):
            # One C++ call per layer: visibility from the rows' bits, keys read through the page layout, no plan.
            _check_fix_lengths(batch, meta)
            kmap, vmap = _layout_for(kv_cache, getattr(layer, "isa", None))
            heads = self.num_heads
            tree_ops.tree_fix_attention(
                query.reshape(query.shape[0], heads, -1), kv_cache, kmap, vmap, meta.block_table, batch.context_len,
                batch.fix_rows, batch.fix_req, batch.fix_bits, self.scale, self.logits_soft_cap,
                output.view(output.shape[0], heads, -1),
            )  # fmt: skip
            return
        self._fix_tree_rows_torch(layer, batch, query, kv_cache, meta, output)

    def _fix_tree_rows_torch(
        self,
        layer: AttentionLayer,
        batch: tree_state.TreeBatch,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: CPUAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """The torch path: the compiled kernel's reference, and its fallback."""
        plan = _fix_plan(batch, meta, kv_cache, getattr(layer, "isa", None))
        heads, kv_heads, group = self.num_heads, self.num_kv_heads, self.num_queries_per_kv
        pages = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)
        out = output.view(output.shape[0], heads, -1)  # callers pass [T, H, Dv] or [T, H * Dv]
        q_all = query.reshape(query.shape[0], heads, -1)
        groups, width, longest = plan.mask.shape
        # Advanced indices around a slice put their dims first: [R * L, D, Hkv] -> [R, L, Hkv, D].
        keys = pages[plan.blocks, :, plan.k_offsets].transpose(1, 2).float().reshape(groups, longest, kv_heads, -1)
        values = pages[plan.blocks, :, plan.v_offsets].transpose(1, 2).float().reshape(groups, longest, kv_heads, -1)
        q = q_all[plan.rows].float().view(-1, kv_heads, group, q_all.shape[-1])
        if plan.dense:  # every group has `width` rows in order: a reshape instead of a scatter
            q_pad = q.view(groups, width, kv_heads, group, -1)
        else:
            q_pad = q.new_zeros((groups, width, kv_heads, group, q.shape[-1]))
            q_pad[plan.group_of, plan.slot] = q
        logits = torch.einsum("rchgd,rlhd->rchgl", q_pad, keys) * self.scale
        if self.logits_soft_cap:
            logits = self.logits_soft_cap * torch.tanh(logits / self.logits_soft_cap)
        logits = logits.masked_fill(plan.hidden, float("-inf"))
        attn = torch.einsum("rchgl,rlhd->rchgd", torch.softmax(logits, dim=-1), values)
        attn = attn.reshape(groups * width, heads, -1) if plan.dense else attn[plan.group_of, plan.slot]
        out[plan.rows] = attn.reshape(-1, heads, attn.shape[-1]).to(out.dtype)


@dataclass(frozen=True)
class _FixPlan:
    """One step's fix-up indices, shared by every layer with the same cache geometry: all fix rows of all requests
    as one padded batch [R requests, C rows, L keys], so a layer costs a handful of tensor ops whatever the batch."""

    rows: torch.Tensor  # [F] flat query rows
    blocks: torch.Tensor  # [R * L, 1] physical block of each key
    k_offsets: torch.Tensor  # [R * L, D] element offsets of its K inside the (block, head) page
    v_offsets: torch.Tensor  # [R * L, D]
    mask: torch.Tensor  # [R, C, L] visible keys per padded row
    hidden: torch.Tensor  # [R, C, 1, 1, L] ~mask, broadcast over heads
    group_of: torch.Tensor  # [F] request group of each fix row
    slot: torch.Tensor  # [F] its place within the group
    dense: bool  # every group has C rows (no padding)


def _fix_plan(
    batch: tree_state.TreeBatch, meta: CPUAttentionMetadata, kv_cache: torch.Tensor, isa: str | None
) -> _FixPlan:
    kmap, vmap = _layout_for(kv_cache, isa)
    block_size = kv_cache.shape[2]
    key = (block_size, kmap.data_ptr(), vmap.data_ptr(), meta.block_table.data_ptr())
    plan = batch.layer_plans.get(key)
    if plan is None:
        plan = batch.layer_plans[key] = _build_fix_plan(batch, meta, block_size, kmap, vmap)
    return plan


def _fix_lengths(batch: tree_state.TreeBatch, meta: CPUAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(requests with fix rows, their fix-row counts); raises if a tree request's KV length is not the scheduled
    sequence length (the tree batch and the attention metadata would be of different steps)."""
    # Host-side bookkeeping: on CPU these tensors already live in host memory.
    fix_req = batch.fix_req.cpu()
    context, num_draft, seq_lens = batch.context_len.cpu(), batch.num_draft.cpu(), meta.seq_lens.cpu()
    reqs, counts = torch.unique_consecutive(fix_req, return_counts=True)
    kv_len = context[reqs] + 1 + num_draft[reqs]
    bad = torch.nonzero(kv_len != seq_lens[reqs]).flatten()
    if bad.numel():
        req = int(reqs[bad[0]])
        raise RuntimeError(
            f"tree request row {req}: context {int(context[req])} + root + {int(num_draft[req])} drafts != "
            f"the scheduled sequence length {int(seq_lens[req])}"
        )
    return reqs, counts


def _check_fix_lengths(batch: tree_state.TreeBatch, meta: CPUAttentionMetadata) -> None:
    """`_fix_lengths`' check once per step and metadata (every layer of a KV cache group shares them)."""
    key = ("lengths checked", meta.seq_lens.data_ptr())
    if key not in batch.layer_plans:
        _fix_lengths(batch, meta)
        batch.layer_plans[key] = True


def _build_fix_plan(
    batch: tree_state.TreeBatch, meta: CPUAttentionMetadata, block_size: int, kmap: torch.Tensor, vmap: torch.Tensor
) -> _FixPlan:
    fix_rows, fix_req, fix_bits = batch.fix_rows.cpu(), batch.fix_req.cpu(), batch.fix_bits.cpu()
    context, num_draft = batch.context_len.cpu(), batch.num_draft.cpu()
    reqs, counts = _fix_lengths(batch, meta)
    num_groups, num_fix = int(reqs.numel()), int(fix_rows.numel())
    kv_len = context[reqs] + 1 + num_draft[reqs]
    longest = int(kv_len.max())
    pos = torch.arange(longest)
    in_seq = pos.unsqueeze(0) < kv_len.unsqueeze(1)  # [R, L]
    safe = torch.where(in_seq, pos.unsqueeze(0), torch.zeros_like(pos).unsqueeze(0))
    blocks = torch.gather(meta.block_table.cpu()[reqs].long(), 1, safe // block_size).reshape(-1, 1)
    offsets = (safe % block_size).reshape(-1)

    group_of = torch.repeat_interleave(torch.arange(num_groups), counts)
    first = torch.cumsum(counts, 0) - counts
    slot = torch.arange(num_fix) - first[group_of]
    width = int(counts.max())
    # Visible: the context and the root (logical 0..ctx), and the drafts whose bit the row carries.
    ctx = context[fix_req].unsqueeze(1)
    draft = (pos.unsqueeze(0) - ctx - 1).clamp(min=0)
    visible = (pos.unsqueeze(0) <= ctx) | (((fix_bits.unsqueeze(1) >> draft) & 1) == 1)
    visible &= in_seq[group_of]
    mask = torch.zeros((num_groups, width, longest), dtype=torch.bool)
    mask[group_of, slot] = visible
    mask[:, :, 0] |= ~mask.any(dim=2)  # padding rows: one visible key keeps their softmax finite
    return _FixPlan(
        rows=fix_rows,
        blocks=blocks,
        k_offsets=kmap[offsets],
        v_offsets=vmap[offsets],
        mask=mask,
        hidden=~mask.view(num_groups, width, 1, 1, longest),
        group_of=group_of,
        slot=slot,
        dense=bool((counts == width).all()),
    )


class EchoTreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with tree fix-up rows; name, builder, metadata and cache layout are the parent's."""

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return EchoTreeCPUAttentionImpl


_OVERRIDE = BackendOverride(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


def register_cpu_tree_backend() -> str:
    """Make CPU_ATTN resolve to EchoTreeCPUAttentionBackend; idempotent. Returns the class path."""
    return _OVERRIDE.register()


def unregister_cpu_tree_backend() -> None:
    """Undo register_cpu_tree_backend (CPU_ATTN resolves to what it did before)."""
    _OVERRIDE.unregister()
