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
import logging
import os
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
from echo_vllm.vllm.tree_attn_split import (  # the split recompute's torch parts (no vLLM); re-exported for callers
    FixRowGroups,
    MergeFn,
    PrefixFn,
    echo_compact_cuda,
    fa_kv_views,
    fix_row_groups,
    merge_by_lse,
    prefix_attention_reference,
    suffix_attention,
    suffix_kv,
    suffix_kv_paged,
    suffix_mask,
    tree_fix_rows,
)

BACKEND_PATH = f"{__name__}.EchoTreeFlashAttentionBackend"
logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_PATH",
    "EchoTreeFlashAttentionBackend",
    "EchoTreeFlashAttentionImpl",
    "FixRowGroups",
    "MergeFn",
    "PrefixFn",
    "echo_compact_cuda",
    "fa_kv_views",
    "fix_row_groups",
    "guard_batch_execution",
    "merge_by_lse",
    "merge_vllm",
    "no_full_cudagraphs",
    "non_tree_layers",
    "prefix_attention_reference",
    "register_cuda_tree_backend",
    "required_attention_backend",
    "suffix_attention",
    "suffix_kv",
    "suffix_kv_paged",
    "suffix_mask",
    "tree_fix_rows",
    "tree_step_cudagraph_modes",
    "unregister_cuda_tree_backend",
]


def merge_vllm(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """`merge_by_lse` through vLLM's `merge_attn_states` (its CUDA kernel on CUDA, its torch fallback on CPU):
    the suffix part is cast to the prefix part's dtype, as the kernel takes both in one dtype and one head stride."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    out_a = out_a.contiguous()
    out_b = out_b.to(out_a.dtype).contiguous()
    merged = torch.empty_like(out_a)
    merge_attn_states(merged, out_a, lse_a.float().contiguous(), out_b, lse_b.float().contiguous())
    return merged


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
        out = output.view(output.shape[0], self.num_heads, -1)  # callers pass [T, H, Dv] or [T, H * Dv]
        softcap = float(self.logits_soft_cap or 0.0)
        fused = fused_suffix_merge_for(query.device) if key is not None and value is not None else None
        if fused is not None and key is not None and value is not None:
            # Three launches per layer: the fix rows' queries, FA's prefix pass, the Triton suffix + merge + write.
            groups = _step_fix_row_groups(batch)
            q = query[groups.rows]
            out_a, lse_a = prefix(
                q, key_cache, value_cache, meta.block_table[: batch.num_reqs], groups.cu_seqlens_q,
                groups.seqused_k, self.scale, softcap,
            )  # fmt: skip
            fused(out, query, key, value, out_a, lse_a, batch, self.scale, softcap)
            return
        rows = tree_fix_rows(
            query, key, value, key_cache, value_cache, meta.block_table, batch, self.scale,
            softcap, prefix_fn=prefix, merge_fn=merge_vllm,
        )  # fmt: skip
        out.index_copy_(0, batch.fix_rows.to(out.device).long(), rows.to(out.dtype))


@dataclass(frozen=True)
class StepFixRows:
    """`FixRowGroups` plus the fix rows as an int64 index: per step, shared by every layer (TreeBatch.layer_plans)."""

    rows: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor


def _step_fix_row_groups(batch: tree_state.TreeBatch) -> StepFixRows:
    plan = batch.layer_plans.get("fa_fix_rows")
    if plan is None:
        groups = fix_row_groups(batch)
        plan = batch.layer_plans["fa_fix_rows"] = StepFixRows(
            batch.fix_rows.long(), groups.cu_seqlens_q, groups.seqused_k
        )
    return plan


def fused_suffix_merge_for(device: torch.device) -> Callable[..., None] | None:
    """The one-launch suffix + merge for a layer on `device` (CUDA only; None: run the torch composition)."""
    return _fused_suffix_merge() if device.type == "cuda" else None


@functools.cache
def _fused_suffix_merge() -> Callable[..., None] | None:
    """The Triton suffix + merge kernel (`tree_attn_triton.tree_suffix_merge`), or None where Triton is missing
    (then the torch composition runs: exact too, ~25 launches per layer). ECHO_VLLM_TREE_TORCH=1 forces torch."""
    if os.environ.get("ECHO_VLLM_TREE_TORCH") == "1":
        logger.info("ECHO tree fix-up on CUDA: the torch composition (ECHO_VLLM_TREE_TORCH=1)")
        return None
    try:
        from echo_vllm.vllm.tree_attn_triton import tree_suffix_merge
    except ImportError as exc:
        logger.warning("ECHO tree fix-up on CUDA: Triton unavailable (%s); using the torch composition", exc)
        return None
    return tree_suffix_merge


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
