"""The draft head's K/V for rows its first pass leaves out (one job: write them, nothing else).

Why: vLLM's EAGLE proposer runs the head's whole first pass (fc, the decoder layer's attention and MLP) over every
prompt row of a joining request, although only the request's last row is sampled: the other rows are there to
write the head's KV for their positions. `prompt_head_window` W cuts those rows to each prompt's W newest; without
their KV the head then drafts from a context with holes (drafts may get worse; output cannot change). For the
Llama EAGLE-3 head (vLLM's `llama_eagle3`, one decoder layer) a row's K/V need only the fc over the target's
auxiliary hidden states, the token's embedding, the layer's two input norms, the K/V part of its QKV projection
and the rotary embedding: not its attention over the context, its output projection, its MLP or its final norm.
`HeadKVWriter.write` computes exactly that for the left-out rows and stores it through the attention backend's
own KV update (`impl.do_kv_cache_update`, the op vLLM's forward calls for the same rows), so the kept rows attend
over the same context as without the cut.

Only where the head is that one-layer Llama EAGLE-3 layer and its backend writes KV apart from its forward
(`forward_includes_kv_cache_update` False: vLLM 0.32's CPU, FlashAttention, Triton and FlashInfer backends);
elsewhere `HeadKVWriter.of` says why not and the rows stay unwritten, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class HeadKVWriter:
    """What writing a row's K/V needs: the head (fc, embedding), its decoder layer, and that layer's attention."""

    head: Any  # vLLM's Eagle3LlamaForCausalLM
    layer: Any  # its only decoder layer (llama_eagle3.LlamaDecoderLayer, layer_idx 0)
    attention: Any  # layer.self_attn.attn: vLLM's Attention with its KV cache and backend impl

    @classmethod
    def of(cls, head: Any) -> tuple[HeadKVWriter | None, str]:
        """A writer for `head`, or None and the reason it cannot have one."""
        unwrap = getattr(head, "unwrap", None)  # vLLM's CUDA-graph wrapper around the head (as its propose does)
        head = unwrap() if callable(unwrap) else head
        try:
            from vllm.model_executor.models.llama_eagle3 import LlamaDecoderLayer
        except ImportError as err:  # a vLLM without the Llama EAGLE-3 head
            return None, f"no llama_eagle3 in this vLLM ({err})"
        body = getattr(head, "model", None)
        layers = getattr(body, "layers", None)
        if not hasattr(head, "combine_hidden_states") or layers is None or len(layers) != 1:
            return None, "the head is not a one-layer EAGLE-3 head"
        layer = layers[0]
        # The exact class: a subclass or another head's layer may compute its first pass differently.
        if type(layer) is not LlamaDecoderLayer or getattr(layer, "layer_idx", None) != 0:
            return None, f"the head's layer is {type(layer).__name__}, not llama_eagle3's LlamaDecoderLayer"
        if not getattr(body, "use_aux_hidden_state", False):
            return None, "the head does not take the target's auxiliary hidden states"
        attention = getattr(getattr(layer, "self_attn", None), "attn", None)
        backend = getattr(attention, "attn_backend", None)
        if backend is None or getattr(backend, "forward_includes_kv_cache_update", True):
            return None, "the attention backend writes KV inside its forward only"
        if getattr(attention, "kv_sharing_target_layer_name", None) is not None:
            return None, "the head's layer shares another layer's KV cache"
        if not hasattr(getattr(attention, "impl", None), "do_kv_cache_update"):
            return None, "the attention backend has no separate KV update"
        return cls(head, layer, attention), ""

    def write(
        self, input_ids: torch.Tensor, positions: torch.Tensor, aux_hidden: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store the head's K/V for rows at `positions` (slot `slots`), whose first-pass inputs are the next token
        `input_ids` and the target's auxiliary hidden states `aux_hidden` (before the fc), as the head's forward
        would for these rows (llama_eagle3.LlamaDecoderLayer.forward with layer_idx 0, up to its attention)."""
        if input_ids.numel() == 0:
            return
        layer, attention = self.layer, self.attention
        hidden = self.head.combine_hidden_states(aux_hidden)
        embeds = layer.input_layernorm(self.head.model.embed_input_ids(input_ids))
        hidden, _ = layer._residual_norm(hidden_states=hidden)
        qkv, _ = layer.self_attn.qkv_proj(torch.cat([embeds, hidden], dim=-1))
        q, k, v = qkv.split([layer.self_attn.q_size, layer.self_attn.kv_size, layer.self_attn.kv_size], dim=-1)
        _, k = layer.self_attn.rotary_emb(positions, q, k)
        key = k.reshape(-1, attention.num_kv_heads, attention.head_size)
        value = v.reshape(-1, attention.num_kv_heads, attention.head_size_v)
        attention.impl.do_kv_cache_update(attention, key, value, attention.kv_cache, slots)
