"""The shipped testbed is a real testbed: the target learned Python, the head agrees with it, files load."""

from __future__ import annotations

import json

from testbed_fixture import shipped_testbed


def test_manifest_records_quality():
    manifest = json.loads((shipped_testbed() / "testbed.json").read_text())
    assert manifest["preset"]["name"] == "full"
    assert manifest["vocab_size"] >= 4000
    # A uniform model over 4096 tokens has loss ln(4096) = 8.3; a trained one is far below.
    assert manifest["target"]["heldout_loss"] < 4.5
    assert manifest["eagle3"]["heldout_top1_agreement_per_step"][0] > 0.4


def test_head_layout_is_what_vllm_loads():
    root = shipped_testbed()
    config = json.loads((root / "eagle3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == config["vocab_size"]
    target_config = json.loads((root / "target" / "config.json").read_text())
    assert config["target_hidden_size"] == target_config["hidden_size"]
    layer_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert all(0 <= k < target_config["num_hidden_layers"] for k in layer_ids)
    from safetensors import safe_open

    with safe_open(str(root / "eagle3" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and "lm_head.weight" in keys
    assert "embed_tokens.weight" not in keys  # shared with the target, as vLLM does
