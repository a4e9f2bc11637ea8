"""echo_vllm.vllm.head_kv: which heads get a K/V writer, and what the writer stores (vLLM's classes, fake parts).

The engine test (tests/test_vllm_prompt_head_window.py) shows the written K/V are the head's own: the head drafts
exactly what it drafts without the cut. Here: the refusals name their reason, and `write` hands the backend's KV
update the K/V part of the QKV projection of [norm(embedding of the next token), norm(fc(aux hidden))], rotated
at the rows' positions, for the rows' slots.
"""

from __future__ import annotations

import types

import torch
from vllm.model_executor.models.llama_eagle3 import LlamaDecoderLayer

from echo_vllm.vllm.head_kv import HeadKVWriter

HIDDEN, HEADS, HEAD_DIM = 8, 2, 4
Q_SIZE = KV_SIZE = HEADS * HEAD_DIM


class _Impl:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots) -> None:
        self.calls.append((layer, key.clone(), value.clone(), kv_cache, slots.clone()))


def _layer(**attention_keys) -> LlamaDecoderLayer:
    layer = LlamaDecoderLayer.__new__(LlamaDecoderLayer)
    torch.nn.Module.__init__(layer)
    layer.layer_idx = 0
    gen = torch.Generator().manual_seed(0)
    layer.input_layernorm = lambda x: 2.0 * x  # stand-ins that tell the two norms apart
    layer._residual_norm = lambda hidden_states: (hidden_states + 1.0, hidden_states)
    weight = torch.randn(Q_SIZE + 2 * KV_SIZE, 2 * HIDDEN, generator=gen)
    rotated: list[torch.Tensor] = []

    def rotary(positions, q, k):
        rotated.append(positions)
        return q, k + positions.unsqueeze(1).to(k.dtype)  # a position-dependent change, as RoPE's

    attention = types.SimpleNamespace(
        attn_backend=types.SimpleNamespace(forward_includes_kv_cache_update=False),
        kv_sharing_target_layer_name=None,
        impl=_Impl(),
        num_kv_heads=HEADS,
        head_size=HEAD_DIM,
        head_size_v=HEAD_DIM,
        kv_cache=torch.zeros(1),
    )
    for key, value in attention_keys.items():
        setattr(attention, key, value)
    layer.self_attn = types.SimpleNamespace(
        qkv_proj=lambda x: (x @ weight.T, None),
        q_size=Q_SIZE,
        kv_size=KV_SIZE,
        rotary_emb=rotary,
        attn=attention,
        weight=weight,
        rotated=rotated,
    )
    return layer


def _head(layers, aux: bool = True):
    fc = torch.randn(HIDDEN, 3 * HIDDEN, generator=torch.Generator().manual_seed(1))
    embed = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(2))
    body = types.SimpleNamespace(layers=layers, use_aux_hidden_state=aux, embed_input_ids=lambda ids: embed[ids])
    return types.SimpleNamespace(model=body, combine_hidden_states=lambda h: h @ fc.T, fc=fc, embed=embed)


def test_only_a_one_layer_llama_eagle3_head_on_a_separate_kv_update_gets_a_writer():
    assert HeadKVWriter.of(None) == (None, "the head is not a one-layer EAGLE-3 head")
    assert HeadKVWriter.of(_head([_layer(), _layer()]))[0] is None
    other = torch.nn.Linear(2, 2)
    other.layer_idx = 0
    writer, why = HeadKVWriter.of(_head([other]))
    assert writer is None and "Linear" in why
    assert "auxiliary" in HeadKVWriter.of(_head([_layer()], aux=False))[1]
    backend = types.SimpleNamespace(forward_includes_kv_cache_update=True)
    assert "inside its forward" in HeadKVWriter.of(_head([_layer(attn_backend=backend)]))[1]
    assert "shares" in HeadKVWriter.of(_head([_layer(kv_sharing_target_layer_name="x")]))[1]
    assert "no separate KV update" in HeadKVWriter.of(_head([_layer(impl=object())]))[1]
    writer, why = HeadKVWriter.of(_head([_layer()]))
    assert writer is not None and why == ""
    # vLLM's CUDA-graph wrapper around the head is looked through, as its propose does.
    wrapped = types.SimpleNamespace(unwrap=lambda: writer.head)
    assert HeadKVWriter.of(wrapped)[0] is not None


def test_write_stores_the_layers_k_and_v_of_the_rows_at_their_slots():
    layer = _layer()
    head = _head([layer])
    writer, _ = HeadKVWriter.of(head)
    assert writer is not None
    ids, positions = torch.tensor([3, 7, 9]), torch.tensor([10, 11, 12])
    aux = torch.randn(3, 3 * HIDDEN, generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([40, 41, 42])
    writer.write(ids, positions, aux, slots)
    ((attention, key, value, kv_cache, written_slots),) = layer.self_attn.attn.impl.calls
    assert attention is layer.self_attn.attn and kv_cache is attention.kv_cache
    x = torch.cat([2.0 * head.embed[ids], aux @ head.fc.T + 1.0], dim=-1)
    qkv = x @ layer.self_attn.weight.T
    k = qkv[:, Q_SIZE : Q_SIZE + KV_SIZE] + positions.unsqueeze(1)
    v = qkv[:, Q_SIZE + KV_SIZE :]
    torch.testing.assert_close(key, k.reshape(3, HEADS, HEAD_DIM))
    torch.testing.assert_close(value, v.reshape(3, HEADS, HEAD_DIM))
    assert written_slots.tolist() == [40, 41, 42]
    assert torch.equal(layer.self_attn.rotated[0], positions)
    writer.write(ids[:0], positions[:0], aux[:0], slots[:0])  # no rows: no call
    assert len(layer.self_attn.attn.impl.calls) == 1
