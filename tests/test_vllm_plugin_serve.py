"""`vllm serve <target> --speculative-config echo.json` on 127.0.0.1 with the openai client, and bad inputs.

Temperature 0: completions (streaming and not) identical to offline no-spec generation, chat streaming ==
non-streaming; temperature 0.8: completes without errors; the server's own /metrics shows ECHO's series next to
vLLM's, and they move with completions. Bad inputs: a non-zero exit, a one-line reason, and nothing served.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from testbed_fixture import shipped_testbed

from echo_vllm.runtime_env import cpu_runtime_env, job_temp_dir
from echo_vllm.vllm.offline import run_in_subprocess

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time"]
MAX_TOKENS = 24
VLLM = str(Path(sys.executable).parent / "vllm")
COMMON = [
    "--host",
    "127.0.0.1",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "8",
    "--distributed-executor-backend",
    "uni",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return cpu_runtime_env(os.environ, in_process=False)


def _echo_spec(root: Path, **echo) -> dict:
    return {
        "method": "echo",
        "model": str(root / "eagle3"),
        "num_speculative_tokens": 4,
        "echo": {"k_max": 6, "warmup_steps": 4, **echo},
    }


@contextlib.contextmanager
def _serve(cfg: Path, *extra: str):
    """`vllm serve` of the testbed with ECHO config `cfg` on a free port; yields (openai client, model, log)."""
    root = shipped_testbed()
    port = _free_port()
    log = cfg.with_name("server.log")
    env = {**_env(), "ECHO_VLLM_METRICS_INTERVAL": "0"}  # device figures every step: no waiting in the test
    # The server's IPC sockets in a short directory of its own, removed at the end: a killed vLLM leaves them.
    sockets = contextlib.ExitStack()
    env = sockets.enter_context(job_temp_dir(env))
    argv = [VLLM, "serve", str(root / "target"), "--port", str(port), "--speculative-config", str(cfg), *COMMON]
    with open(log, "w") as fh:
        proc = subprocess.Popen([*argv, *extra], stdout=fh, stderr=subprocess.STDOUT, env=env)
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    deadline = time.time() + 240
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                client.models.list()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() > deadline:
                    pytest.fail(f"vllm serve did not come up:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield client, str(root / "target"), log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        sockets.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("serve") / "echo.json"
    cfg.write_text(json.dumps(_echo_spec(shipped_testbed())))
    with _serve(cfg) as running:
        yield running


@pytest.fixture(scope="module")
def baseline_texts():
    root = shipped_testbed()
    out = run_in_subprocess(
        {"model": str(root / "target"), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "max_num_seqs": 8}
    )
    return out["texts"]


def test_completions_greedy_identical_to_no_spec(server, baseline_texts):
    client, model, _ = server
    for prompt, expected in zip(PROMPTS, baseline_texts):
        plain = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert plain.choices[0].text == expected
        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            if chunk.choices
        )
        assert streamed == expected


def test_chat_greedy_stream_equals_plain(server):
    client, model, _ = server
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens > 0
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        if chunk.choices
    )
    assert streamed == text


def test_temperature_sampling_completes(server):
    client, model, log = server
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.8, seed=1)
    assert out.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_TOKENS, temperature=0.8, stream=True
    )
    assert any(chunk.choices for chunk in chat)
    text = log.read_text()
    assert "ECHO proposer: max_depth=4 k_max=6" in text  # the worker really runs ECHO
    assert "trees=cpu:csrc" in text  # trees by default (top_k 4), fixed up by the compiled CPU ops
    assert "Traceback" not in text


def _scrape(port: int) -> dict[str, float]:
    """The server's /metrics (its one port), each sample name summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name if "le" not in sample.labels else f"{sample.name}{{le={sample.labels['le']}}}"
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def test_metrics_endpoint_shows_echo_series_that_move(server):
    """The worker's ECHO figures reach the API server's /metrics (ECHO's multiprocess channel: one API server,
    so vLLM set no PROMETHEUS_MULTIPROC_DIR) and move with completions, next to vLLM's own spec-decode series."""
    _check_echo_series_move(*server)
    assert "ECHO series through ECHO_VLLM_PROMETHEUS_DIR=" in server[2].read_text()  # the fallback channel


def test_metrics_with_two_api_servers_go_through_vllms_directory(tmp_path):
    """`--api-server-count 2`: vLLM's own multiprocess mode (it sets PROMETHEUS_MULTIPROC_DIR itself); ECHO's
    worker writes into vLLM's directory and the API servers' /metrics show the series."""
    cfg = tmp_path / "echo.json"
    cfg.write_text(json.dumps(_echo_spec(shipped_testbed())))
    with _serve(cfg, "--api-server-count", "2") as running:
        _check_echo_series_move(*running)
        assert "ECHO series through vLLM's PROMETHEUS_MULTIPROC_DIR" in running[2].read_text()


def _check_echo_series_move(client, model: str, log: Path) -> None:
    port = client.base_url.port
    before = _scrape(port)
    assert before["echo_vllm:max_depth"] == 4 and before["echo_vllm:k_max"] == 6
    for prompt in PROMPTS:
        client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    after = _scrape(port)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("echo_vllm:steps_total") > 0
    assert moved("echo_vllm:verify_length_count") >= moved("echo_vllm:steps_total")  # >= 1 request per step
    # the step budget is min(K_max, B x D): at most 6 here
    assert 0 < moved("echo_vllm:budget_capacity_tokens_total") <= 6 * moved("echo_vllm:steps_total")
    assert 0 < after["echo_vllm:step_budget"] <= 6
    assert 0 < moved("echo_vllm:budget_draft_tokens_total") <= moved("echo_vllm:budget_capacity_tokens_total")
    assert moved("echo_vllm:verify_length_sum") == moved("echo_vllm:budget_draft_tokens_total")
    assert after["echo_vllm:verify_length_bucket{le=+Inf}"] == after["echo_vllm:verify_length_count"]
    assert moved("echo_vllm:proposer_seconds_count") > 0
    assert moved("echo_vllm:request_steps_total") > 0 and moved("echo_vllm:verified_draft_tokens_total") > 0
    assert 0 <= after["echo_vllm:accepted_tokens_total"] <= after["echo_vllm:verified_draft_tokens_total"]
    assert after["echo_vllm:budget_used"] > 0 and after["echo_vllm:disabled"] == 0
    assert after["echo_vllm:calibration_state"] == 1  # exactly one state is on (warm-up is 4 steps here)
    assert "echo_vllm:gate_truncations_total" in after
    # the time-aware budget's figures (fixed k_max here: mode "fixed", phase warmup or fixed)
    assert after["echo_vllm:budget_mode"] == 1 and after["echo_vllm:budget_phase"] == 1
    assert "echo_vllm:mean_draft_depth" in after and "echo_vllm:stat" in after
    # vLLM's own speculative-decoding series on the same endpoint count the drafts ECHO selected
    assert moved("vllm:spec_decode_num_draft_tokens_total") > 0
    assert "vllm:spec_decode_num_accepted_tokens_total" in after


# ------------------------------------------------------------------------------------------------------------
# Bad inputs: non-zero exit, one-line reason, nothing served
# ------------------------------------------------------------------------------------------------------------


def _bad_head(tmp_path: Path, root: Path) -> Path:
    head = tmp_path / "bad_head"
    head.mkdir()
    for f in (root / "eagle3").iterdir():
        if f.suffix == ".json":
            shutil.copy(f, head / f.name)
    cfg = json.loads((head / "config.json").read_text())
    cfg["vocab_size"] = cfg["draft_vocab_size"] = int(cfg["vocab_size"]) * 2
    (head / "config.json").write_text(json.dumps(cfg))
    return head


def _bad_cases(tmp_path: Path, root: Path) -> dict[str, tuple[dict, str]]:
    corrupt = tmp_path / "corrupt_cal.json"
    corrupt.write_text('{"schema_version": 1, "mode": "sparse"')
    spec = _echo_spec(root)
    return {
        "unknown-key": ({**spec, "echo": {"k_max": 6, "bogus": 1}}, "echo.bogus: unknown key"),
        "negative-kmax": ({**spec, "echo": {"k_max": -3}}, "k_max must be >= 0"),
        "depth-0": ({**spec, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        "missing-head": ({**spec, "model": str(tmp_path / "no_such_head")}, "EAGLE-3 head"),
        "vocab-mismatch": ({**spec, "model": str(_bad_head(tmp_path, root))}, "vocab_size"),
        "corrupt-calibration": ({**spec, "echo": {"k_max": 6, "calibration_file": str(corrupt)}}, "calibration"),
        # One refused combination (combinations.RULES; tests/test_vllm_guard_rails.py has them all): lossy.
        "lossy-rejection": (
            {**spec, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0},
            "rejection_sample_method='synthetic' is not supported",
        ),
    }


def _run_bad(argv: list[str], port: int, tmp_path: Path):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=_env(), cwd=tmp_path)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Uvicorn running" not in out and "Starting vLLM server" not in out
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "something is listening"
    return [line for line in out.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "case",
    [
        "unknown-key",
        "negative-kmax",
        "depth-0",
        "missing-head",
        "vocab-mismatch",
        "corrupt-calibration",
        "lossy-rejection",
    ],
)
def test_bad_input_exits_with_one_line(tmp_path, case):
    root = shipped_testbed()
    spec, reason = _bad_cases(tmp_path, root)[case]
    cfg = tmp_path / "echo.json"
    cfg.write_text(json.dumps(spec))
    port = _free_port()
    lines = _run_bad(
        [VLLM, "serve", str(root / "target"), "--port", str(port), "--speculative-config", str(cfg), *COMMON],
        port,
        tmp_path,
    )
    assert reason in lines[-1], lines[-5:]


def test_wrong_vllm_version_exits_with_fix(tmp_path):
    root = shipped_testbed()
    cfg = tmp_path / "echo.json"
    cfg.write_text(json.dumps(_echo_spec(root)))
    port = _free_port()
    script = (
        "import sys\n"
        "import echo_vllm.vllm.hooks as hooks\n"
        "hooks.installed_vllm_version = lambda: '0.31.0'\n"
        "from vllm.entrypoints.cli.main import main\n"
        f"sys.argv = ['vllm', 'serve', {str(root / 'target')!r}, '--port', '{port}', '--speculative-config', "
        f"{str(cfg)!r}] + {COMMON!r}\n"
        "main()\n"
    )
    lines = _run_bad([sys.executable, "-c", script], port, tmp_path)
    last = lines[-1]
    assert "0.31.0" in last and "0.32.0" in last and "pip install" in last and "create_engine_config" in last
