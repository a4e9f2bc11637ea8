"""echo_vllm.vllm.offline's helpers (the worker-side ECHO call, the step-log offset, the job's own temp
directory) and one real job that must leave no file behind."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from echo_vllm.runtime_env import RPC_DIR_ENV, TEMP_DIR_ENV, job_temp_dir
from echo_vllm.vllm import offline


class _Stats:
    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


def _worker(drafter):
    return SimpleNamespace(model_runner=SimpleNamespace(drafter=drafter))


def test_echo_drafter_call_reads_and_resets_the_proposer():
    stats = _Stats()
    drafter = SimpleNamespace(echo_stats=lambda: {"steps": 3}, stats=stats)
    assert offline._echo_drafter_call(_worker(drafter), "stats") == {"steps": 3}
    assert offline._echo_drafter_call(_worker(drafter), "reset") == "stats.reset" and stats.resets == 1
    # A proposer with more accumulators than EchoMetrics resets them all itself.
    calls = []
    full = SimpleNamespace(echo_stats=dict, stats=stats, reset_echo_stats=lambda: calls.append(1))
    assert offline._echo_drafter_call(_worker(full), "reset") == "reset_echo_stats" and calls == [1]
    assert stats.resets == 1
    # Not an ECHO drafter (plain EAGLE-3, no spec): nothing to report.
    assert offline._echo_drafter_call(_worker(SimpleNamespace()), "stats") is None
    assert offline._echo_drafter_call(SimpleNamespace(), "stats") is None
    with pytest.raises(ValueError, match="action"):
        offline._echo_drafter_call(_worker(drafter), "bogus")


def test_echo_drafter_call_flushes_the_step_log():
    flushed = []
    drafter = SimpleNamespace(echo_stats=dict, flush_step_log=lambda: flushed.append(1) or 7)
    assert offline._echo_drafter_call(_worker(drafter), "flush_step_log") == 7 and flushed == [1]
    # An ECHO drafter without a step log writer (older proposer): nothing to flush, no error.
    assert offline._echo_drafter_call(_worker(SimpleNamespace(echo_stats=dict)), "flush_step_log") is None


def test_echo_rpc_failure_is_a_reported_error():
    class Llm:
        def collective_rpc(self, fn, args=()):
            raise RuntimeError("not allowed")

    assert offline._echo_rpc(Llm(), "stats") == {"error": "collective_rpc failed: RuntimeError: not allowed"}


def test_step_log_size_is_where_the_timed_records_start(tmp_path, monkeypatch):
    log = tmp_path / "steps-{rank}.jsonl"
    monkeypatch.setenv("ECHO_VLLM_STEP_LOG", str(log))
    assert offline._step_log_size() == 0
    (tmp_path / "steps-0.jsonl").write_text('{"step": 1}\n')
    assert offline._step_log_size() == len('{"step": 1}\n')
    monkeypatch.delenv("ECHO_VLLM_STEP_LOG")
    assert offline._step_log_size() == 0


def test_job_temp_dir_is_the_jobs_and_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the caller's own temp directory
    with job_temp_dir({"A": "1", TEMP_DIR_ENV: "/elsewhere"}) as env:
        path = Path(env[RPC_DIR_ENV])
        assert path.is_dir() and path.parent == tmp_path and env["A"] == "1"
        # Sockets and temp files (vLLM's FileStore rendezvous file) share it: the child's tempfile follows TMPDIR.
        assert env[TEMP_DIR_ENV] == str(path)
        (path / "socket-a-job-left").write_text("")  # what an os._exit leaves behind
        (path / "vllm_dist_0123").write_text("")
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_job_temp_dir_keeps_a_base_path_the_caller_set(tmp_path):
    given = {RPC_DIR_ENV: str(tmp_path)}
    with job_temp_dir(given) as env:
        assert env[RPC_DIR_ENV] == str(tmp_path)
        path = Path(env[TEMP_DIR_ENV])  # temp files still go with the job
        assert path.is_dir() and path != tmp_path
    assert tmp_path.is_dir() and not path.exists()


def test_each_job_gets_its_own_socket_dir(monkeypatch):
    """_run_child hands the child a socket directory that exists while it runs and is gone after."""
    seen: list[tuple[str, bool]] = []

    class FakePopen:
        def __init__(self, cmd, env, **kwargs):
            path = env[RPC_DIR_ENV]
            seen.append((path, Path(path).is_dir()))
            self.returncode = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def communicate(self, stdin=None, timeout=None):
            return "", ""

    monkeypatch.setattr(offline.subprocess, "Popen", FakePopen)
    offline._run_child("{}", {"PATH": "/usr/bin"}, 5, own_group=False)
    offline._run_child("{}", {"PATH": "/usr/bin"}, 5, own_group=False)
    (first, existed_first), (second, existed_second) = seen
    assert existed_first and existed_second and first != second
    assert not Path(first).exists() and not Path(second).exists()


@pytest.mark.engine
def test_an_engine_job_leaves_nothing_in_the_temp_dir(tmp_path, monkeypatch):
    """A real vLLM job (engine start, generate, os._exit) leaves nothing behind: vLLM's executor makes a
    torch.distributed FileStore file in the temp directory at every start and removes it only at a clean
    shutdown, which os._exit skips (one `vllm_dist_<uuid>` per job before the job had a TMPDIR of its own)."""
    from testbed_fixture import shipped_testbed

    monkeypatch.setenv(TEMP_DIR_ENV, str(tmp_path))  # the child's default temp directory without job_temp_dir
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where job_temp_dir makes the job's own
    root = shipped_testbed()
    result = offline.run_in_subprocess({"model": str(root / "target"), "prompts": ["def add(a, b):"], "max_tokens": 4})
    assert result["texts"] and list(tmp_path.iterdir()) == []


# ---- the fork server (job_forkserver): which jobs may fork, and a forked job runs as a fresh one --------------

_BASE_ENV = {"PATH": "/usr/bin", "LD_PRELOAD": "/lib/libiomp5.so", "OMP_NUM_THREADS": "1",
             "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ECHO_VLLM_FAULTS": "raise"}  # fmt: skip


@pytest.mark.parametrize(
    ("job", "env_change", "eligible"),
    [
        ({}, {}, True),
        ({}, {"ECHO_VLLM_STEP_LOG": "/tmp/s.jsonl", "ECHO_VLLM_FAULTS": "contain"}, True),  # read after start-up
        ({}, {"TMPDIR": "/tmp/job", "VLLM_RPC_BASE_PATH": "/tmp/job"}, True),  # the job's own directories
        ({"extra": {"tensor_parallel_size": 2}}, {}, False),  # workers of their own
        ({"extra": {"pipeline_parallel_size": 2}}, {}, False),
        ({"executor": "ray"}, {}, False),
        ({"extra": {"distributed_executor_backend": "mp"}}, {}, False),
        ({}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, False),  # an engine-core process
        ({}, {"ECHO_VLLM_EMULATE_CPU_ISA": "avx2"}, False),  # must act before vLLM's first import
        ({}, {"ATEN_CPU_CAPABILITY": "avx2"}, False),
        ({}, {"LD_PRELOAD": None}, False),  # library load (None: the variable unset)
        ({}, {"OMP_NUM_THREADS": "2"}, False),
        ({}, {"VLLM_CPU_KVCACHE_SPACE": "2"}, False),  # anything else: a fresh interpreter, to be safe
    ],
)
def test_fork_eligible_only_when_a_fork_runs_as_a_fresh_interpreter(job, env_change, eligible):
    from echo_vllm.vllm.job_forkserver import fork_eligible

    env = {key: value for key, value in {**_BASE_ENV, **env_change}.items() if value is not None}
    assert fork_eligible({"model": "m", **job}, env, _BASE_ENV) is eligible


def test_fork_server_is_opt_in():
    from echo_vllm.vllm.job_forkserver import FORKSERVER_ENV, wanted

    assert not wanted({}) and not wanted({FORKSERVER_ENV: "0"}) and wanted({FORKSERVER_ENV: "1"})


def test_the_jobs_own_environment_opts_in_to_the_fork_server(monkeypatch):
    """`run_in_subprocess(job, extra_env=...)` decides from the job's environment, so one caller (a paired
    fidelity run) can fork some jobs and start others fresh."""
    from echo_vllm.vllm import job_forkserver, offline
    from echo_vllm.vllm.job_forkserver import FORKSERVER_ENV

    forked: list[str] = []

    def fake_run_forked(job_json, env, base_env, timeout):
        forked.append(env[FORKSERVER_ENV])
        return 0, "", ""

    monkeypatch.setattr(job_forkserver, "run_forked", fake_run_forked)
    monkeypatch.setattr(job_forkserver, "fork_eligible", lambda job, env, server_env: True)
    job = {"model": "m"}
    monkeypatch.setenv(FORKSERVER_ENV, "0")
    assert offline._run_forked(job, {FORKSERVER_ENV: "1"}, 10.0) is not None
    monkeypatch.setenv(FORKSERVER_ENV, "1")
    assert offline._run_forked(job, {FORKSERVER_ENV: "0"}, 10.0) is None
    assert offline._run_forked(job, {}, 10.0) is None  # the job's environment is the whole of it
    assert forked == ["1"]


@pytest.mark.engine
def test_a_forked_job_runs_as_a_fresh_one(tmp_path, monkeypatch):
    """The same ECHO job (fixed K_max: no timing in any decision) fresh and forked: the same tokens, the same
    selection at every step, the plugin's log lines and statistics in both."""
    from engine_jobs import run_echo, target_job

    from echo_vllm.bench.datasets import humaneval_prompts
    from echo_vllm.vllm.job_forkserver import FORKSERVER_ENV

    job = target_job(humaneval_prompts(8), max_tokens=24, max_num_seqs=4)
    echo = {"k_max": 8, "warmup_steps": 6, "min_samples_per_class": 2}
    monkeypatch.setenv(FORKSERVER_ENV, "0")
    fresh, fresh_steps = run_echo(job, echo, tmp_path / "fresh.jsonl")
    monkeypatch.setenv(FORKSERVER_ENV, "1")
    forked, forked_steps = run_echo(job, echo, tmp_path / "forked.jsonl")
    assert (fresh["job_process"], forked["job_process"]) == ("fresh", "forked")
    assert forked["token_ids"] == fresh["token_ids"]
    assert forked["spec"] == fresh["spec"] and fresh["spec"]["num_drafts"] > 0
    assert [s["selection_hash"] for s in forked_steps] == [s["selection_hash"] for s in fresh_steps]
    assert forked_steps and forked["echo_stats"]["calibration"] == fresh["echo_stats"]["calibration"]
    assert any("ECHO" in line for line in forked["echo_log"]) and len(forked["echo_log"]) == len(fresh["echo_log"])
