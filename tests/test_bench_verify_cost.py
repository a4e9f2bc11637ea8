"""The verification-cost knee tool (echo_vllm/bench/verify_cost.py, `echo-vllm bench verify-cost`).

`find_knee` on synthetic cost curves, the Llama-3.1-8B slice's shape (on the meta device: no weights), and a tiny
real measurement on the shipped testbed target.
"""

from __future__ import annotations

import json

import pytest
import torch
from testbed_fixture import shipped_testbed

from echo_vllm.bench.verify_cost import (
    DEFAULT_SLACK,
    KneeInputError,
    build_model_shape,
    find_knee,
    load_target,
    measure_verify_cost,
    powers_of_two,
)
from echo_vllm.cli import main as cli_main

TS = powers_of_two(512)


def test_default_slack_is_one_and_a_half_single_token_forwards():
    assert DEFAULT_SLACK == 0.5
    assert TS == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert powers_of_two(3) == [1, 2]
    with pytest.raises(KneeInputError):
        powers_of_two(0)


def test_flat_then_linear_knee_is_the_last_flat_point():
    # Memory-bound at 10 ms up to T = 32, then compute-bound: time doubles with T.
    costs = {t: 10.0 + 0.01 * t if t <= 32 else 10.0 * t / 32 for t in TS}
    assert find_knee(costs) == 32  # 64 costs 20 ms > 1.5 x 10.01
    assert find_knee(costs, slack=1.5) == 64  # 20 <= 2.5 x 10.01, 40 is not
    assert find_knee(costs, slack=0.0) == 1  # 10.02 > 10.01


def test_always_flat_gives_the_largest_t():
    assert find_knee({t: 5.0 for t in TS}) == 512
    assert find_knee({t: 5.0 for t in TS}, slack=0.0) == 512


def test_immediately_linear_gives_one():
    assert find_knee({t: 2.0 * t for t in TS}) == 1
    assert find_knee({t: 2.0 * t for t in TS}, slack=3.0) == 4


def test_prefix_rule_ignores_a_later_dip_and_rows_are_accepted():
    rows = [{"tokens": t, "median_ms": ms} for t, ms in [(1, 1.0), (2, 1.1), (4, 1.9), (8, 1.2), (16, 5.0)]]
    assert find_knee(rows) == 2  # T = 8 is under 1.5 ms again, but T = 4 was already over
    assert find_knee(reversed(rows)) == 2  # order does not matter
    assert find_knee([{"tokens": 1, "x": 1.0}, {"tokens": 2, "x": 1.4}], key="x") == 2


@pytest.mark.parametrize(
    "costs, slack, match",
    [
        ({}, 0.5, "no measurements"),
        ({2: 1.0, 4: 1.0}, 0.5, "T=1"),
        ({1: 1.0, 2: 0.0}, 0.5, "positive"),
        ({1: 1.0, 2: float("nan")}, 0.5, "positive"),
        ({1: 1.0}, -0.1, "slack"),
    ],
)
def test_find_knee_rejects_bad_input(costs, slack, match):
    with pytest.raises(KneeInputError, match=match):
        find_knee(costs, slack)


def test_llama_8b_slice_has_the_8b_layer_shape():
    # Built on the meta device: shapes only, nothing allocated.
    model, shape = build_model_shape("llama-8b-slice", torch.float32, torch.device("meta"), layers=1)
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        4096,
        14336,
        32,
        8,
    )
    assert (cfg.vocab_size, cfg.num_hidden_layers, shape["full_layers"]) == (128256, 1, 32)
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert per_layer == 218_112_000  # Llama-3.1-8B: 32 such layers + 2 x 525M embedding/head = 8.03B
    with pytest.raises(KneeInputError, match="unknown"):
        build_model_shape("llama-9b", torch.float32, torch.device("meta"))


def test_real_measurement_on_the_testbed_target():
    target = shipped_testbed() / "target"
    model = load_target(target, torch.float32, torch.device("cpu"))
    rows = measure_verify_cost(model, [4, 1], repeats=2, context=16, warmup=1)
    assert [r["tokens"] for r in rows] == [1, 4]
    for r in rows:
        assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"]
        assert r["ms_per_token"] == pytest.approx(r["median_ms"] / r["tokens"])
        assert r["repeats"] == 2
    assert find_knee(rows) in (1, 4)
    with pytest.raises(KneeInputError, match="max_position_embeddings"):
        measure_verify_cost(model, [1], repeats=1, context=model.config.max_position_embeddings)
    with pytest.raises(KneeInputError, match="repeats"):
        measure_verify_cost(model, [1], repeats=0)


def test_cli_verify_cost_writes_the_table_and_json(tmp_path, capsys):
    root = shipped_testbed()
    out = tmp_path / "cost.json"
    rc = cli_main(
        [
            "bench",
            "verify-cost",
            "--testbed",
            str(root),
            "--context",
            "8",
            "--max-tokens",
            "4",
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "ms/forward" in text and "knee" in text
    data = json.loads(out.read_text())
    assert [r["tokens"] for r in data["rows"]] == [1, 2, 4]
    assert data["knee"] in (1, 2, 4) and data["slack"] == 0.5 and data["context"] == 8
    assert (
        cli_main(
            [
                "bench",
                "verify-cost",
                "--model",
                str(root / "target"),
                "--context",
                "4",
                "--max-tokens",
                "2",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    assert "model " in capsys.readouterr().out
    assert cli_main(["bench", "verify-cost", "--testbed", str(tmp_path), "--max-tokens", "2"]) == 2
    assert cli_main(["bench", "verify-cost", "--testbed", str(root), "--layers", "2"]) == 2
