"""`echo-vllm bench vllm` end to end on the testbed, tiny: 2 methods x 1 batch size x 2 rounds (~40 s)."""

from __future__ import annotations

import json

import pytest
from test_cli import run_cli
from testbed_fixture import shipped_testbed


@pytest.mark.engine
@pytest.mark.slow
def test_bench_vllm_tiny_run_writes_the_contract(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli(
        "bench",
        "vllm",
        "--testbed",
        str(shipped_testbed()),
        "--methods",
        "nospec,echo",
        "--batch-sizes",
        "2",
        "--rounds",
        "2",
        "--limit",
        "2",
        # Two waves keep the run small (the CLI's default is 4 whole batches per batch size: 8 prompts here) and
        # give it a steady window (the second wave waits for the first).
        "--waves",
        "2",
        "--max-tokens",
        "8",
        "--warmup-steps",
        "2",
        "--json",
        str(out),
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    document = json.loads(out.read_text())
    rows = {r["method"]: r for r in document["results"]}
    assert set(rows) == {"nospec", "echo"}
    for row in rows.values():
        assert row["rounds"] == 2 and len(row["tokens_per_s_rounds"]) == 2
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert row["identical_to_baseline"] is True
        # The full-engine part of the timed generate, timed through llm.enqueue and the engine's steps.
        assert row["steady_tokens_per_s"] is not None and row["steady_tokens_per_s"] > 0
    echo = rows["echo"]
    # The warm-up ran ECHO's calibration before the timed generate, and its statistics came out of the worker.
    assert echo["calibrated_before_timing"] is True and echo["echo_stats_errors"] == []
    assert echo["mean_step_sum"] is not None and echo["mean_step_sum"] <= 16
    assert 0 < echo["accepted_per_verified_draft"] <= 1 and echo["tokens_per_request_step"] > 1
    assert "oracle_ratio" in echo and (echo["oracle_ratio"] is not None or echo["oracle_reason"])
    assert rows["nospec"]["tokens_per_request_step"] == pytest.approx(1.0)
    assert document["settings"]["waves"] == 2 and document["settings"]["limit"] == 2
    # Same work for both: every request emitted max_tokens, in the timed part of every round.
    assert all(e["num_generated"] == 4 * 8 for e in document["round_log"])
    assert [e["label"] for e in document["round_log"]] == ["nospec", "echo", "echo", "nospec"]  # rotated
    assert out.with_suffix(".png").is_file() and (tmp_path / "bench_runs.jsonl").is_file()
    assert "tok/s median [min-max]" in proc.stdout and "vs best" in proc.stdout and "steady tok/s" in proc.stdout
