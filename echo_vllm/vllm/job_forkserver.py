"""Offline vLLM jobs forked from a process that has already imported vLLM (opt-in: ECHO_VLLM_JOB_FORKSERVER=1).

A job in a fresh interpreter (`offline.run_in_subprocess`) spends ~7 of its ~10 s on this 2-core machine importing
torch and vLLM before the engine starts, and the test suite runs dozens of such jobs. With this opt-in, a job runs in a
process forked from a multiprocessing fork server that imported vLLM once (`PRELOAD`): the engine, the plugin
load and everything the job does still happen in a process of the job's own, started from the same pristine
server every time (no state passes from one job to the next), only the imports are shared.

Only jobs for which that is the same as a fresh process use it (`fork_eligible`): in-process engines (TP = PP = 1,
the uni executor: nothing spawns workers from the forked child) whose environment differs from the server's only
in variables read after start-up (ECHO's own ECHO_VLLM_* switches, the job's temp and socket directories). A
variable that acts at import or library load (LD_PRELOAD, OMP_*, ATEN_CPU_CAPABILITY, ECHO_VLLM_EMULATE_CPU_ISA)
that differs sends the job to a fresh interpreter. The opt-in is read from the job's environment (the caller's,
plus `run_in_subprocess`'s extra_env), so one caller can fork some jobs and not others. Benchmarks never use it:
in paired rounds at batch 16 forked jobs ran 0.92-1.01 of fresh ones (docs/benchmarks.md, thirty-seventh
session), so their jobs stay fresh processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORKSERVER_ENV = "ECHO_VLLM_JOB_FORKSERVER"
# Imported once in the server (after which it only forks): vLLM's offline entry point pulls in torch and vLLM's
# config, engine and model-loader modules; the plugin is not loaded (vLLM loads it when an engine is built).
PRELOAD = ("echo_vllm.vllm.offline", "vllm.entrypoints.llm")
# Read after start-up by vLLM and ECHO: these may differ per job.
_PER_JOB_PREFIXES = ("ECHO_VLLM_",)
# (pytest names the running test in PYTEST_CURRENT_TEST: it changes with every test and nothing in a job reads it)
_PER_JOB_KEYS = frozenset({"TMPDIR", "VLLM_RPC_BASE_PATH", "PYTEST_CURRENT_TEST"})
_IMPORT_TIME_KEYS = frozenset({"ECHO_VLLM_EMULATE_CPU_ISA"})  # applied before vLLM's first import

_lock = threading.Lock()
_server: tuple[multiprocessing.context.ForkServerContext, dict[str, str]] | None = None


def wanted(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(FORKSERVER_ENV, "0") == "1"


def _per_job(key: str) -> bool:
    return key not in _IMPORT_TIME_KEYS and (key in _PER_JOB_KEYS or key.startswith(_PER_JOB_PREFIXES))


def fork_eligible(job: Mapping[str, Any], env: Mapping[str, str], server_env: Mapping[str, str]) -> bool:
    """True when forking `job` (with environment `env`) from a server started with `server_env` runs it as a fresh
    interpreter would: an in-process engine, and no difference outside the per-job variables."""
    extra = job.get("extra", {})
    if int(extra.get("tensor_parallel_size", 1)) * int(extra.get("pipeline_parallel_size", 1)) != 1:
        return False
    if job.get("executor", "uni") != "uni" or "distributed_executor_backend" in extra:
        return False
    if env.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return False
    keys = set(env) | set(server_env)
    return all(_per_job(key) or env.get(key) == server_env.get(key) for key in keys)


def _context(base_env: Mapping[str, str]) -> tuple[multiprocessing.context.ForkServerContext, dict[str, str]]:
    """The fork server, started on first use with `base_env` (the environment a default in-process job gets) as
    its own: variables that act at import or library load (LD_PRELOAD: Intel OpenMP) are fixed when it starts."""
    global _server
    with _lock:
        if _server is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
            env = {key: value for key, value in base_env.items() if key not in _PER_JOB_KEYS}
            saved, saved_tempdir = dict(os.environ), tempfile.tempdir
            try:  # the server process inherits this process's environment at the moment it is spawned
                os.environ.clear()
                os.environ.update(env)
                # multiprocessing keeps its socket directory (made now) for the life of this process: in the system
                # temp directory, not in a caller's (a test's) temporary one that goes before this process does.
                tempfile.tempdir = None
                from multiprocessing import forkserver, util

                util.get_temp_dir()
                forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
                tempfile.tempdir = saved_tempdir
            _server = (ctx, env)
        return _server


def server_env() -> dict[str, str] | None:
    """The running server's environment (None before the first forked job)."""
    return None if _server is None else dict(_server[1])


def _child(job_json: str, env: dict[str, str], out_path: str, err_path: str) -> None:
    """The forked job: the job's environment and output files, then offline's main (which exits hard)."""
    for fd, path in ((1, out_path), (2, err_path)):
        with open(path, "w") as handle:
            os.dup2(handle.fileno(), fd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # re-read TMPDIR: the job's own directory
    from echo_vllm.vllm import offline

    offline.exit_hard(offline.main(job_json))


def run_forked(job_json: str, env: dict[str, str], base_env: Mapping[str, str], timeout: float) -> tuple[int, str, str]:
    """Run one job (its JSON, its full environment) forked from the server; (exit code, stdout, stderr). On timeout
    the job is killed and subprocess.TimeoutExpired raised, as for a fresh interpreter."""
    ctx, _ = _context(base_env)
    with tempfile.TemporaryDirectory(prefix="echo-vllm-fork-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = ctx.Process(target=_child, args=(job_json, env, str(out), str(err)), daemon=False)
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["forked vLLM job"], timeout)
        read = lambda path: path.read_text(errors="replace") if path.is_file() else ""  # noqa: E731
        return int(proc.exitcode if proc.exitcode is not None else -1), read(out), read(err)
