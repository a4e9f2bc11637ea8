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


class _RecordingWriter:
    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def write(self, input_ids, positions, aux_hidden, slots) -> None:
        self.calls.append((input_ids, positions, aux_hidden, slots))


def _proposer(writer, prompt_head_kv: bool):
    from echo_vllm.vllm.proposer import EchoProposer

    proposer = object.__new__(EchoProposer)
    proposer.echo_settings = types.SimpleNamespace(prompt_head_window=2, prompt_head_kv=prompt_head_kv)
    proposer.needs_extra_input_slots, proposer.uses_mrope = False, False
    proposer.prompt_rows_cut = proposer.prompt_rows_kv = proposer._head_cut = proposer._head_free = 0
    proposer._head_kv, proposer._head_kv_checked = writer, True
    return proposer


def _step_inputs():
    # Request 0 decodes (1 row), request 1 prefills 5 rows: rows 1-3 are left out, rows 4-5 kept.
    qsl = torch.tensor([0, 1, 6], dtype=torch.int32)
    cad = types.SimpleNamespace(
        query_start_loc_cpu=qsl, query_start_loc=qsl, slot_mapping=torch.arange(100, 106), positions=None,
        is_prefilling=torch.tensor([False, True]), batch_size=lambda: 2,
        replace=lambda **changes: types.SimpleNamespace(**changes),
    )  # fmt: skip
    return {
        "target_token_ids": torch.arange(10, 16),
        "target_positions": torch.tensor([7, 0, 1, 2, 3, 4]),
        "target_hidden_states": torch.arange(18.0).reshape(6, 3),
        "token_indices_to_sample": torch.tensor([0, 5]),
        "common_attn_metadata": cad,
    }


def test_the_proposer_writes_the_left_out_rows_kv_before_the_first_pass_and_prices_them_as_rows():
    writer = _RecordingWriter()
    proposer, kwargs = _proposer(writer, True), _step_inputs()
    proposer._cut_prompt_rows(kwargs)
    ((ids, positions, hidden, slots),) = writer.calls
    assert ids.tolist() == [12, 13, 14]  # each left-out row's next token: the head's first-pass input there
    assert positions.tolist() == [0, 1, 2] and slots.tolist() == [101, 102, 103]
    assert torch.equal(hidden, torch.arange(18.0).reshape(6, 3)[1:4])  # before the fc: the writer applies it
    assert kwargs["target_token_ids"].tolist() == [10, 14, 15]  # the first pass keeps the rest
    assert kwargs["token_indices_to_sample"].tolist() == [0, 2]
    assert proposer.prompt_rows_cut == proposer.prompt_rows_kv == proposer._head_cut == 3
    assert proposer._head_free == 0  # written rows cost the proposer: the cost sample counts them
    unwritten, kwargs = _proposer(writer, False), _step_inputs()
    unwritten._cut_prompt_rows(kwargs)
    assert len(writer.calls) == 1 and unwritten.prompt_rows_kv == 0
    assert unwritten._head_cut == unwritten._head_free == 3
