"""Process management for the soak: a free port, one `vllm serve` in its own process group, its tree's memory.

The server runs in a new session (its own process group), so Ctrl-C in the terminal reaches only the soak, which
then stops the whole group itself: `stop()` sends SIGTERM to the group, waits, then SIGKILLs it. Every started
server is also registered with `atexit`, and SIGTERM to the soak becomes SystemExit so `finally` blocks run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from echo_vllm.errors import SetupError
from echo_vllm.runtime_env import job_temp_dir

HOST = "127.0.0.1"  # the soak never talks to anything else
VLLM = str(Path(sys.executable).parent / "vllm")


class ServerError(SetupError):
    """`vllm serve` exited or did not come up: the message names the log file."""

    def __init__(self, message: str, log_path: Path) -> None:
        super().__init__(message)
        self.log_path = log_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerSpec:
    """What one `vllm serve` gets: the argv after `vllm serve`, the environment and where its log goes."""

    name: str  # "echo" or "nospec": names the log file and the messages
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path
    port: int = field(default_factory=free_port)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"


def serve_argv(
    model: str, *, port: int, max_model_len: int, max_num_seqs: int, speculative_config: Path | None
) -> tuple[str, ...]:
    """The project's CPU-testbed serve flags (as in tests/test_vllm_plugin_serve.py), bound to 127.0.0.1."""
    argv = [
        VLLM,
        "serve",
        model,
        "--host",
        HOST,
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--distributed-executor-backend",
        "uni",
    ]
    if speculative_config is not None:
        argv += ["--speculative-config", str(speculative_config)]
    return tuple(argv)


class Server:
    """One `vllm serve` process group. Use as a context manager: the group is always stopped on exit."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self._sockets = contextlib.ExitStack()  # vLLM's IPC sockets and temp files of this server (`job_temp_dir`)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    def start(self) -> Server:
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = self._sockets.enter_context(job_temp_dir(self.spec.env))  # removed in stop(), after the group
        with open(self.spec.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                list(self.spec.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        atexit.register(self.stop)
        return self

    def wait_ready(self, timeout_s: float) -> float:
        """Poll /v1/models until it answers 200; seconds it took. Raises ServerError if the server exits first."""
        import httpx  # lazy: keeps `echo-vllm --help` fast

        t0 = time.monotonic()
        while True:
            if self.proc is None or self.proc.poll() is not None:
                rc = None if self.proc is None else self.proc.returncode
                raise ServerError(
                    f"{self.spec.name} server (vllm serve) exited with {rc} before it was ready; "
                    f"log: {self.spec.log_path}",
                    self.spec.log_path,
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.spec.base_url}/v1/models", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise ServerError(
                    f"{self.spec.name} server (vllm serve) not ready after {timeout_s:.0f} s; "
                    f"log: {self.spec.log_path}",
                    self.spec.log_path,
                )
            time.sleep(1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; the exit code (None if never started)."""
        if self.proc is None:
            self._sockets.close()
            return None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The API server may be gone while an EngineCore child lingers: kill whatever is left in the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        _wait_group_gone(self.proc.pid, timeout_s=5.0)
        self._sockets.close()  # a SIGKILLed engine unlinks none of its sockets
        atexit.unregister(self.stop)
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """SIGKILL is delivered asynchronously: wait until no process of the group is left (zombies aside)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit(143) so `finally` (server stop) runs; Ctrl-C already does."""
    if threading.current_thread() is threading.main_thread():  # signal handlers only work there
        previous = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
    else:
        yield


def _raise_exit(_signum: int, _frame: object) -> None:
    raise SystemExit(143)


# ------------------------------------------------------------------------------------------------------------
# Memory of a process tree (Linux /proc)
# ------------------------------------------------------------------------------------------------------------


def _parent_map() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # Field 4 (ppid) follows the parenthesised command name, which may itself contain spaces or ')'.
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return parents


def tree_pids(root: int) -> list[int]:
    """`root` and all its descendants (API server, EngineCore, its worker, multiprocessing helpers)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parent_map().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def vm_rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass  # the process exited between listing and reading
    return 0


def tree_rss_bytes(root: int) -> dict[int, int]:
    """VmRSS per pid of the tree under `root`."""
    return {pid: vm_rss_bytes(pid) for pid in tree_pids(root)}


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"(cannot read {path}: {err.strerror})"


def format_argv(argv: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)
