"""ECHO's Prometheus series without an engine: the multiprocess files the worker writes are what
`MultiProcessCollector` (vLLM's own /metrics registry, or ECHO's collector in the front process) reads back; the
exporter fills them from a proposer's host lists and device accumulators; its faults never escape in production;
the series table, docs/observability.md and the Grafana dashboard cannot drift apart.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from echo_vllm.core.metrics import EchoMetrics
from echo_vllm.vllm import prom_channel, prom_metrics
from echo_vllm.vllm.faults import MODE_ENV

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "echo-vllm-dashboard.json"
DOCS = ROOT / "docs" / "observability.md"
LABELS = {"model_name": "m", "engine": "0"}


def _scrape(directory: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample a /metrics scrape of `directory` shows: {(sample name, sorted labels): value}."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({**LABELS, **labels}.items())))]


class FakeProposer:
    """What the exporter reads of an EchoProposer: settings, calibration, device stats, echo_stats()."""

    def __init__(self, max_depth=4, k_max=6, warmup_steps=2, extra_stats=None):
        self.max_depth = max_depth
        self.k_max = k_max
        self.is_writer = True
        self.echo_settings = types.SimpleNamespace(warmup_steps=warmup_steps)
        self.calibration = None
        self.calibration_source = "warmup"
        self.warmup_recorded = 0
        self.stats = EchoMetrics(max_depth)
        self.extra_stats = extra_stats or {}
        self.drop: set[str] = set()  # echo_stats() keys to leave out (a proposer without the time-aware budget)

    def step(self, counts, accepted, truncated_at=None):
        """One selection (K_i = counts) and the verification of the previous one (accepted per request)."""
        c = torch.tensor(counts)
        cap = torch.full_like(c, self.max_depth)
        truncated = torch.zeros_like(c, dtype=torch.bool)
        if truncated_at is not None:
            row, depth = truncated_at
            cap[row], truncated[row] = depth, True
        self.stats.record_selection(c, self.k_max, cap, truncated)
        a = torch.tensor(accepted)
        self.stats.record_verification(a + 1, a, c, c)
        return counts

    def echo_stats(self):
        stats = {**self.stats.summary(), "k_max": self.k_max, "calibration": self.calibration_source, "faults": 0,
                 "disabled": False, "fault_causes": {}, **self.extra_stats}  # fmt: skip
        return {k: v for k, v in stats.items() if k not in self.drop}


@pytest.fixture()
def channel(tmp_path, monkeypatch):
    """A worker environment with ECHO's channel directory (vLLM's variable unset)."""
    monkeypatch.delenv(prom_channel.VLLM_DIR_ENV, raising=False)
    monkeypatch.setenv(prom_channel.ECHO_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(prom_metrics.INTERVAL_ENV, "0")
    monkeypatch.setattr(prom_channel, "_writers", {})
    return tmp_path


def _config(name="m", dp_rank=0):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(served_model_name=name),
        parallel_config=types.SimpleNamespace(data_parallel_rank=dp_rank),
    )


def test_writer_files_read_back_by_multiprocess_collector(tmp_path):
    writer = prom_channel.MmapSeriesWriter(str(tmp_path), pid=1)
    other = prom_channel.MmapSeriesWriter(str(tmp_path), pid=2)  # a second process (e.g. another DP engine)
    for w, n in ((writer, 3.0), (other, 4.0)):
        w.counter("echo_vllm:x", LABELS, "help", n)
        w.histogram("echo_vllm:h", LABELS, "help", (0.0, 1.0, math.inf), [1.0, n, 0.0], n)
    writer.gauge("echo_vllm:g", LABELS, "help", 5.0)
    other.gauge("echo_vllm:g", LABELS, "help", 7.0)  # written last: the most recent value wins
    samples = _scrape(tmp_path)
    assert _value(samples, "echo_vllm:x_total") == 7.0  # counters add over processes
    assert _value(samples, "echo_vllm:g") == 7.0
    assert _value(samples, "echo_vllm:h_bucket", le="0.0") == 2.0
    assert _value(samples, "echo_vllm:h_bucket", le="1.0") == 9.0  # cumulative, as Prometheus expects
    assert _value(samples, "echo_vllm:h_count") == 9.0 and _value(samples, "echo_vllm:h_sum") == 7.0
    assert {p.name for p in tmp_path.iterdir()} == {
        "counter_echo1.db", "counter_echo2.db", "histogram_echo1.db", "histogram_echo2.db",
        "gauge_mostrecent_echo1.db", "gauge_mostrecent_echo2.db",
    }  # fmt: skip


def test_exporter_series_move_with_the_steps(channel):
    proposer = FakeProposer()
    exporter = prom_metrics.exporter_for(proposer, _config())
    assert isinstance(exporter, prom_metrics.PromExporter)
    before = _scrape(channel)
    assert _value(before, "echo_vllm:max_depth") == 4 and _value(before, "echo_vllm:k_max") == 6
    assert _value(before, "echo_vllm:calibration_state", state="warming_up") == 1
    assert _value(before, "echo_vllm:calibration_state", state="calibrated") == 0
    assert ("echo_vllm:steps_total", tuple(sorted(LABELS.items()))) not in before

    exporter.on_step(proposer, proposer.step([4, 2, 0], [3, 1, 0]))
    exporter.on_step(proposer, proposer.step([1, 1, 4], [0, 1, 2], truncated_at=(0, 1)), 6)
    exporter.observe_proposer_time(0.003)
    samples = _scrape(channel)
    assert _value(samples, "echo_vllm:steps_total") == 2
    assert _value(samples, "echo_vllm:budget_draft_tokens_total") == 12
    assert _value(samples, "echo_vllm:budget_capacity_tokens_total") == 12
    assert _value(samples, "echo_vllm:step_draft_tokens") == 6 and _value(samples, "echo_vllm:step_budget") == 6
    # K_i per request-step: 6 observations, values 4, 2, 0, 1, 1, 4
    assert _value(samples, "echo_vllm:verify_length_count") == 6
    assert _value(samples, "echo_vllm:verify_length_sum") == 12
    assert _value(samples, "echo_vllm:verify_length_bucket", le="0.0") == 1
    assert _value(samples, "echo_vllm:verify_length_bucket", le="1.0") == 3
    assert _value(samples, "echo_vllm:verify_length_bucket", le="3.0") == 4
    assert _value(samples, "echo_vllm:verify_length_bucket", le="4.0") == 6
    assert _value(samples, "echo_vllm:proposer_seconds_count") == 1
    assert _value(samples, "echo_vllm:proposer_seconds_bucket", le="0.0025") == 0
    assert _value(samples, "echo_vllm:proposer_seconds_bucket", le="0.005") == 1
    # device figures (interval 0: read every step)
    assert _value(samples, "echo_vllm:request_steps_total") == 6
    assert _value(samples, "echo_vllm:verified_draft_tokens_total") == 12
    assert _value(samples, "echo_vllm:accepted_tokens_total") == 7
    assert _value(samples, "echo_vllm:emitted_tokens_total") == 13
    assert _value(samples, "echo_vllm:gate_truncations_total", depth="1") == 1
    assert _value(samples, "echo_vllm:gate_truncations_total", depth="2") == 0
    assert _value(samples, "echo_vllm:accepted_per_verified_draft") == pytest.approx(7 / 12)
    assert _value(samples, "echo_vllm:budget_used") == pytest.approx(1.0)
    assert _value(samples, "echo_vllm:stat", key="truncation_rate") == pytest.approx(1 / 6)
    assert _value(samples, "echo_vllm:faults_total") == 0 and _value(samples, "echo_vllm:disabled") == 0

    proposer.calibration, proposer.calibration_source = object(), "calibrated after 2 steps"
    exporter.on_step(proposer, proposer.step([2, 2, 2], [2, 2, 2]))
    samples = _scrape(channel)
    assert _value(samples, "echo_vllm:calibration_state", state="calibrated") == 1
    assert _value(samples, "echo_vllm:calibration_state", state="warming_up") == 0
    assert _value(samples, "echo_vllm:steps_total") == 3


def test_device_figures_wait_for_the_interval(channel, monkeypatch):
    monkeypatch.setenv(prom_metrics.INTERVAL_ENV, "60")
    clock = [100.0]
    monkeypatch.setattr(prom_metrics.time, "monotonic", lambda: clock[0])
    proposer = FakeProposer()
    exporter = prom_metrics.exporter_for(proposer, _config())
    calls = []
    real_totals = proposer.stats.totals
    proposer.stats.totals = lambda: calls.append(1) or real_totals()
    exporter.on_step(proposer, proposer.step([1, 1], [1, 0]))  # the first step reads
    exporter.on_step(proposer, proposer.step([1, 1], [1, 1]))
    samples = _scrape(channel)
    assert len(calls) == 1
    assert _value(samples, "echo_vllm:steps_total") == 1  # host figures too: as of the first step
    assert _value(samples, "echo_vllm:accepted_tokens_total") == 1  # device figures: as of the first step
    clock[0] += 61
    exporter.on_step(proposer, proposer.step([1, 1], [0, 0]))
    samples = _scrape(channel)
    assert len(calls) == 2 and _value(samples, "echo_vllm:accepted_tokens_total") == 3
    assert _value(samples, "echo_vllm:steps_total") == 3  # the steps in between were counted, not lost
    assert _value(samples, "echo_vllm:verify_length_count") == 6


def test_step_counts_between_writes_are_kept_bounded_and_all_counted(channel, monkeypatch):
    """K_i lists wait for the next write (counted together), at most MAX_PENDING_STEPS of them: none is lost."""
    monkeypatch.setenv(prom_metrics.INTERVAL_ENV, "60")
    clock = [100.0]
    monkeypatch.setattr(prom_metrics.time, "monotonic", lambda: clock[0])
    proposer = FakeProposer()
    exporter = prom_metrics.exporter_for(proposer, _config())
    steps = prom_metrics.MAX_PENDING_STEPS + 44
    for i in range(steps):
        exporter.on_step(proposer, [i % 5, 1], 8)
        assert len(exporter._pending_counts) < prom_metrics.MAX_PENDING_STEPS
    clock[0] += 61
    exporter.on_step(proposer, [0, 0], 8)
    samples = _scrape(channel)
    assert _value(samples, "echo_vllm:verify_length_count") == 2 * (steps + 1)
    assert _value(samples, "echo_vllm:verify_length_sum") == sum(i % 5 + 1 for i in range(steps))
    assert _value(samples, "echo_vllm:verify_length_bucket", le="0.0") == sum(i % 5 == 0 for i in range(steps)) + 2


def test_time_aware_budget_keys_are_exported_only_when_present(channel):
    plain = FakeProposer()
    plain.drop = {*prom_metrics.OPTIONAL_GAUGES, "budget_mode"}
    exporter = prom_metrics.exporter_for(plain, _config())
    exporter.on_step(plain, plain.step([1], [1]))
    names = {name for name, _ in _scrape(channel)}
    for key in (*prom_metrics.OPTIONAL_GAUGES, "budget_mode"):
        assert prom_metrics.PREFIX + key not in names

    extra = {
        "mean_draft_depth": 2.5,
        "predicted_accepted_per_step": 3.0,
        "realised_accepted_per_step": 2.75,
        "cost_fit_error": 0.04,
        "budget_mode": "auto",
        "step_budget": 5,  # a key no table knows: exported under `stat`
    }
    auto = FakeProposer(extra_stats=extra)
    exporter = prom_metrics.exporter_for(auto, _config(name="auto-model"))
    exporter.on_step(auto, auto.step([1], [1]))
    samples = _scrape(channel)
    labels = {"model_name": "auto-model"}
    for key in prom_metrics.OPTIONAL_GAUGES:
        assert _value(samples, prom_metrics.PREFIX + key, **labels) == extra[key]
    assert _value(samples, "echo_vllm:budget_mode", mode="auto", **labels) == 1
    assert _value(samples, "echo_vllm:budget_mode", mode="fixed", **labels) == 0
    assert _value(samples, "echo_vllm:stat", key="step_budget", **labels) == 5


def test_time_aware_budget_steps(channel):
    """k_max "auto": no configured K_max, a budget chosen per step (0: plain decoding), phase and per-phase ms."""
    extra = {"k_max": "auto", "budget_mode": "auto", "phase": "profile", "ms_per_step": {"draft": 2.5, "rest": 9.0}}
    auto = FakeProposer(k_max=None, extra_stats=extra)
    exporter = prom_metrics.exporter_for(auto, _config())
    auto.k_max = 5  # only FakeProposer.step's record_selection needs an integer
    exporter.on_step(auto, auto.step([2, 1], [1, 1]), 3)
    exporter.on_step(auto, [0, 0, 0], 0)  # a budget-0 step
    samples = _scrape(channel)
    assert ("echo_vllm:k_max", tuple(sorted(LABELS.items()))) not in samples
    assert _value(samples, "echo_vllm:steps_total") == 2
    assert _value(samples, "echo_vllm:budget_capacity_tokens_total") == 3
    assert _value(samples, "echo_vllm:step_budget") == 0 and _value(samples, "echo_vllm:step_draft_tokens") == 0
    assert _value(samples, "echo_vllm:verify_length_count") == 5
    assert _value(samples, "echo_vllm:verify_length_bucket", le="0.0") == 3
    assert _value(samples, "echo_vllm:budget_phase", phase="profile") == 1
    assert _value(samples, "echo_vllm:budget_phase", phase="auto") == 0
    assert _value(samples, "echo_vllm:stat", key="ms_per_step.draft") == 2.5
    assert _value(samples, "echo_vllm:stat", key="ms_per_step.rest") == 9.0


@pytest.mark.parametrize(
    ("calibration", "source", "warmup", "state"),
    [
        (None, "warmup", 4, "warming_up"),
        (None, "none (warmup_steps=0: no gates)", 0, "ungated"),
        (object(), "calibrated after 4 steps, saved to /x", 4, "calibrated"),
        (object(), "file /x/cal.json", 4, "loaded"),
    ],
)
def test_calibration_state(calibration, source, warmup, state):
    proposer = FakeProposer(warmup_steps=warmup)
    proposer.calibration, proposer.calibration_source = calibration, source
    assert prom_metrics.calibration_state(proposer) == state


def test_no_channel_or_not_rank_zero_exports_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(prom_channel.VLLM_DIR_ENV, raising=False)
    monkeypatch.delenv(prom_channel.ECHO_DIR_ENV, raising=False)
    assert isinstance(prom_metrics.exporter_for(FakeProposer(), _config()), prom_metrics.NullExporter)
    monkeypatch.setenv(prom_channel.ECHO_DIR_ENV, str(tmp_path))
    rank1 = FakeProposer()
    rank1.is_writer = False  # TP rank 1: the same figures as rank 0, counted once
    assert isinstance(prom_metrics.exporter_for(rank1, _config()), prom_metrics.NullExporter)
    assert list(tmp_path.iterdir()) == []


def test_vllm_multiprocess_directory_wins(tmp_path, monkeypatch):
    vllm_dir, echo_dir = tmp_path / "vllm", tmp_path / "echo"
    vllm_dir.mkdir()
    monkeypatch.setenv(prom_channel.VLLM_DIR_ENV, str(vllm_dir))
    monkeypatch.setenv(prom_channel.ECHO_DIR_ENV, str(echo_dir))
    assert prom_channel.worker_directory() == str(vllm_dir)
    registry = CollectorRegistry()
    assert prom_channel.prepare_front_process(registry) == str(vllm_dir)
    assert not list(registry._collector_to_names), "vLLM's own registry already reads its directory"


@pytest.fixture()
def fresh_front(monkeypatch):
    """This process as a front process that has prepared nothing yet; afterwards the variable ECHO exports is
    exactly as before and the directory the test made is gone.

    Why not monkeypatch.delenv alone: it records nothing when the variable is absent, so the directory exported by
    `prepare_front_process` stayed in os.environ for the rest of the session after its TemporaryDirectory was
    collected, and every later engine job recreated it (os.makedirs) and left it in /tmp."""
    monkeypatch.delenv(prom_channel.VLLM_DIR_ENV, raising=False)
    saved = os.environ.pop(prom_channel.ECHO_DIR_ENV, None)
    monkeypatch.setattr(prom_channel, "_collected", set())
    monkeypatch.setattr(prom_channel, "_owned_dir", None)
    monkeypatch.setattr(prom_channel, "_writers", {})
    yield
    prom_channel.release_front_process()
    os.environ.pop(prom_channel.ECHO_DIR_ENV, None)
    if saved is not None:
        os.environ[prom_channel.ECHO_DIR_ENV] = saved


def test_front_process_creates_and_collects_its_directory(fresh_front):
    registry = CollectorRegistry()
    path = prom_channel.prepare_front_process(registry)
    assert Path(path).is_dir() and prom_channel.worker_directory() == path  # children inherit os.environ
    assert prom_channel.prepare_front_process(registry) == path  # idempotent: one collector
    assert len(registry._collector_to_names) == 1
    prom_channel.writer_for(path).gauge("echo_vllm:k_max", LABELS, "help", 6.0)  # what a worker writes
    assert "echo_vllm:k_max" in generate_latest(registry).decode()


def test_release_removes_the_owned_directory(fresh_front):
    path = prom_channel.prepare_front_process(CollectorRegistry())
    prom_channel.writer_for(path).gauge("echo_vllm:k_max", LABELS, "help", 6.0)
    assert prom_channel.release_front_process() == path
    assert not Path(path).exists() and prom_channel.ECHO_DIR_ENV not in os.environ
    assert prom_channel._writers == {}  # its files were closed before the directory went
    assert prom_channel.release_front_process() is None  # nothing owned any more


def test_release_leaves_a_directory_it_did_not_create(tmp_path, monkeypatch):
    monkeypatch.delenv(prom_channel.VLLM_DIR_ENV, raising=False)
    monkeypatch.setenv(prom_channel.ECHO_DIR_ENV, str(tmp_path / "given"))
    monkeypatch.setattr(prom_channel, "_collected", set())
    monkeypatch.setattr(prom_channel, "_owned_dir", None)
    monkeypatch.setattr(prom_channel, "_writers", {})
    path = prom_channel.prepare_front_process(CollectorRegistry())
    assert prom_channel.release_front_process() is None
    assert Path(path).is_dir()  # the user's (or a parent process's) directory is theirs to remove


def test_hard_exit_of_a_job_leaves_no_metrics_directory(tmp_path):
    """The offline job runner ends with os._exit (no finalizers): its private directory must still go."""
    env = {k: v for k, v in os.environ.items() if k not in (prom_channel.VLLM_DIR_ENV, prom_channel.ECHO_DIR_ENV)}
    env["TMPDIR"] = str(tmp_path)
    code = (
        "from prometheus_client import CollectorRegistry\n"
        "from echo_vllm.vllm import offline, prom_channel\n"
        "path = prom_channel.prepare_front_process(CollectorRegistry())\n"
        "prom_channel.writer_for(path).gauge('echo_vllm:k_max', {'model_name': 'm'}, 'help', 1.0)\n"
        "print(path, flush=True)\n"
        "offline.exit_hard(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    created = Path(proc.stdout.split()[-1])
    assert created.parent == tmp_path  # the directory was made where this test looks
    assert list(tmp_path.iterdir()) == []


@pytest.mark.needs_vllm
def test_vllm_registry_in_multiprocess_mode_shows_echo_series(channel, monkeypatch):
    """`--api-server-count > 1` (or a user's PROMETHEUS_MULTIPROC_DIR): vLLM's /metrics registry itself."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    monkeypatch.setenv(prom_channel.VLLM_DIR_ENV, str(channel))
    proposer = FakeProposer()
    exporter = prom_metrics.exporter_for(proposer, _config())
    exporter.on_step(proposer, proposer.step([2, 1], [1, 1]))
    text = generate_latest(get_prometheus_registry()).decode()
    assert 'echo_vllm:verify_length_count{engine="0",model_name="m"} 2.0' in text


def test_exporter_faults_never_reach_serving(channel, monkeypatch, caplog):
    monkeypatch.setenv(MODE_ENV, "contain")
    proposer = FakeProposer()
    exporter = prom_metrics.exporter_for(proposer, _config())

    def broken():
        raise RuntimeError("device read failed")

    proposer.stats.totals = broken
    with caplog.at_level(logging.WARNING, logger="vllm.echo_vllm"):
        exporter.on_step(proposer, proposer.step([1], [1]))
        exporter.on_step(proposer, proposer.step([1], [1]))
        exporter.observe_proposer_time(0.1)
    logged = [r for r in caplog.records if "ECHO metrics" in r.getMessage()]
    assert len(logged) == 1 and "device read failed" in logged[0].getMessage()
    assert _value(_scrape(channel), "echo_vllm:steps_total") == 1  # stopped after the fault

    monkeypatch.setenv(MODE_ENV, "raise")  # the tests' mode: an exporter bug fails the test
    strict = prom_metrics.exporter_for(proposer, _config())
    with pytest.raises(RuntimeError, match="device read failed"):
        strict.on_step(proposer, proposer.step([1], [1]))


# ------------------------------------------------------------------------------------------------------------
# The table, the docs and the dashboard agree
# ------------------------------------------------------------------------------------------------------------


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    return exprs


def test_dashboard_references_only_exported_echo_series():
    exported = prom_metrics.exposed_names()
    exprs = _dashboard_exprs()
    used = {name for expr in exprs for name in re.findall(r"echo_vllm:[A-Za-z0-9_]+", expr)}
    assert used, "no ECHO panels"
    assert used <= exported, f"the dashboard queries series the exporter never writes: {sorted(used - exported)}"
    # ECHO's panels next to vLLM's own speculative-decoding ones
    vllm_used = {name for expr in exprs for name in re.findall(r"vllm:spec_decode_[A-Za-z0-9_]+", expr)}
    assert {"vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"} <= vllm_used
    # every series the table has a panel (the dashboard shows all of ECHO)
    shown = {name.removesuffix(suffix) for name in used for suffix in ("_total", "_bucket", "_sum", "_count")}
    shown |= used
    assert {s.metric for s in prom_metrics.SERIES.values()} <= shown


def test_dashboard_check_fails_on_a_drifted_name(tmp_path, monkeypatch):
    board = json.loads(DASHBOARD.read_text())
    board["panels"][-1]["targets"][0]["expr"] = "rate(echo_vllm:no_such_series_total[1m])"
    broken = tmp_path / "board.json"
    broken.write_text(json.dumps(board))
    monkeypatch.setitem(globals(), "DASHBOARD", broken)
    with pytest.raises(AssertionError, match="no_such_series"):
        test_dashboard_references_only_exported_echo_series()


def test_every_series_is_documented():
    text = DOCS.read_text()
    missing = [s.metric for s in prom_metrics.SERIES.values() if f"`{s.metric}" not in text]
    assert not missing, f"docs/observability.md does not describe {missing}"
