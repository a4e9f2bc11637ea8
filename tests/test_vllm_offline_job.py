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
