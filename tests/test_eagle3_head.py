"""The EAGLE-3 head's inference path (fused q/k/v and gate/up, RoPE table, last-row logits) computes the same
function as the training path it is derived from."""

from __future__ import annotations

import copy

import torch

from echo_vllm.models.eagle3 import Eagle3Config, Eagle3Head, init_head_weights


def test_fused_inference_path_matches_training_path():
    cfg = Eagle3Config(
        hidden_size=64,
        target_hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=128,
        aux_layer_ids=(1, 2, 3),
        max_position_embeddings=256,
    )
    head = Eagle3Head(cfg)
    init_head_weights(head, seed=3)
    fast = copy.deepcopy(head).prepare_for_inference()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 7), generator=gen)
    aux = torch.randn(2, 7, 3 * 64, generator=gen)
    positions = torch.arange(100, 107).expand(2, 7)
    mask = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 7, 7)
    with torch.no_grad():
        outs = []
        for model in (head, fast):
            q, k, v, residual = model.project_kv(tokens, model.combine_hidden_states(aux), positions)
            outs.append(model.finish(q, k, v, mask, residual))
        last_logits, last_prenorm = fast.finish(q, k, v, mask, residual, last_logits_only=True)
    (ref_logits, ref_prenorm), (fast_logits, fast_prenorm) = outs
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_prenorm, ref_prenorm, rtol=1e-5, atol=1e-5)
    assert last_logits.shape == (2, 1, 128)
    torch.testing.assert_close(last_logits[:, 0], ref_logits[:, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last_prenorm, ref_prenorm, rtol=1e-5, atol=1e-5)
