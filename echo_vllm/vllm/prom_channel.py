"""How ECHO's Prometheus series get from the worker to the API server's `/metrics`: prometheus_client's
multiprocess files, the channel vLLM itself uses between its API server processes.

The numbers live in the worker (EchoProposer, inside the EngineCore process or a worker process); `/metrics` is
served by the API server, another process. prometheus_client's multiprocess mode is a directory of per-process
memory-mapped files (`<type>_<id>.db`) that `MultiProcessCollector` merges at scrape time. ECHO's worker writes
its series as such files (`MmapSeriesWriter`, its own file names so it never shares a file with the process's
own prometheus_client); which directory, and who reads it:

* vLLM's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set: vLLM sets it itself with `--api-server-count > 1`,
  or the user did): the worker writes into that directory and vLLM's own `/metrics` registry, a
  `MultiProcessCollector` over it, already merges ECHO's files. Nothing else is needed.
* Otherwise (one API server, the default; or an `LLM` in a Python process) the API server serves the global
  `prometheus_client.REGISTRY` and no directory exists. Then the process that builds the ECHO engine config (the
  API server / `LLM` process, before it starts the engine processes) creates a private directory, exports it
  as `ECHO_VLLM_PROMETHEUS_DIR` (the engine processes inherit it) and registers one `MultiProcessCollector`
  over it in its global registry (`prepare_front_process`). The process's own metrics keep their in-memory
  mode: prometheus_client picks that at import, so switching vLLM's variable on here would hide them.

No new port, no new process. A front process that never builds an ECHO engine config changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from typing import Any

logger = logging.getLogger("vllm.echo_vllm")

VLLM_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's / vLLM's multiprocess directory
ECHO_DIR_ENV = "ECHO_VLLM_PROMETHEUS_DIR"  # ECHO's own directory when vLLM runs without one

KINDS = ("counter", "gauge", "histogram")
# Gauges merge across processes by the most recent write: one series per label set, whichever process (e.g. a
# restarted engine) wrote last, instead of a `pid` label per process.
GAUGE_MODE = "mostrecent"

# The private directory of this front process (kept alive for the process, removed at its exit, as vLLM does
# with its own), and the directories whose collector is already registered here.
_owned_dir: tempfile.TemporaryDirectory[str] | None = None
_collected: set[str] = set()


def worker_directory(environ: Any = os.environ) -> str | None:
    """Where a worker writes: vLLM's multiprocess directory if set (vLLM collects it), else ECHO's, else None."""
    return environ.get(VLLM_DIR_ENV) or environ.get(ECHO_DIR_ENV) or None


def prepare_front_process(registry: Any = None) -> str:
    """In the process that serves `/metrics`, before the engine processes start: the directory they will write.

    With vLLM's multiprocess directory set, vLLM's registry reads it already. Otherwise create (or reuse)
    ECHO's directory, export it to child processes and register a collector over it in `registry` (default:
    prometheus_client's global registry, which vLLM's `/metrics` serves in this mode). Idempotent.
    """
    global _owned_dir
    if os.environ.get(VLLM_DIR_ENV):
        logger.info("ECHO metrics: /metrics gets the workers' ECHO series through vLLM's %s", VLLM_DIR_ENV)
        return os.environ[VLLM_DIR_ENV]
    from prometheus_client import REGISTRY, multiprocess

    path = os.environ.get(ECHO_DIR_ENV)
    if not path:
        _owned_dir = tempfile.TemporaryDirectory(prefix="echo-vllm-prometheus-")
        path = _owned_dir.name
        os.environ[ECHO_DIR_ENV] = path
    os.makedirs(path, exist_ok=True)
    if path not in _collected:
        multiprocess.MultiProcessCollector(REGISTRY if registry is None else registry, path=path)
        _collected.add(path)
        logger.info("ECHO metrics: /metrics gets the workers' ECHO series through %s=%s", ECHO_DIR_ENV, path)
    return path


def _go_float(value: float) -> str:
    from prometheus_client.utils import floatToGoString

    return str(floatToGoString(value))


class MmapSeriesWriter:
    """Writes samples into prometheus_client multiprocess files of one process (one file per kind).

    The format is prometheus_client's own (`MmapedDict`, `mmap_key`), so `MultiProcessCollector` merges the
    files like any other process's: counters and histogram buckets are summed over processes, gauges take the
    most recent value. File names carry `echo` so they never collide with the files prometheus_client writes for
    metrics of the same process (two MmapedDicts on one file would corrupt it).
    """

    def __init__(self, directory: str, pid: int | None = None):
        from prometheus_client.mmap_dict import MmapedDict

        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        os.makedirs(directory, exist_ok=True)
        names = {
            "counter": f"counter_echo{self.pid}.db",
            "histogram": f"histogram_echo{self.pid}.db",
            "gauge": f"gauge_{GAUGE_MODE}_echo{self.pid}.db",
        }
        self._files = {kind: MmapedDict(os.path.join(directory, name)) for kind, name in names.items()}
        self._keys: dict[tuple[str, str, tuple[tuple[str, str], ...]], str] = {}
        self._histogram_keys: dict[tuple[Any, ...], tuple[list[str], str]] = {}

    def _key(self, metric: str, sample: str, labels: dict[str, str], help_text: str) -> str:
        cache_key = (metric, sample, tuple(labels.items()))  # callers build labels in one order: no sort per write
        key = self._keys.get(cache_key)
        if key is None:
            # prometheus_client.mmap_dict.mmap_key's layout: [metric_name, sample_name, labels, help]
            key = self._keys[cache_key] = json.dumps([metric, sample, labels, help_text], sort_keys=True)
        return key

    def counter(self, metric: str, labels: dict[str, str], help_text: str, value: float) -> None:
        """A counter's running total (the value since this process started)."""
        self._files["counter"].write_value(self._key(metric, metric + "_total", labels, help_text), value, 0.0)

    def gauge(self, metric: str, labels: dict[str, str], help_text: str, value: float) -> None:
        self._files["gauge"].write_value(self._key(metric, metric, labels, help_text), value, time.time())

    def histogram(
        self,
        metric: str,
        labels: dict[str, str],
        help_text: str,
        bounds: tuple[float, ...],
        counts: list[float],
        total: float,
    ) -> None:
        """A histogram: counts[j] observations in bucket j (not cumulative; the collector accumulates) and the sum."""
        file = self._files["histogram"]
        cache_key = (metric, tuple(labels.items()), bounds)
        keys = self._histogram_keys.get(cache_key)
        if keys is None:  # once per histogram: a step writes a few buckets, it need not format their labels
            buckets = [self._key(metric, metric + "_bucket", {**labels, "le": _go_float(b)}, help_text) for b in bounds]
            keys = self._histogram_keys[cache_key] = (buckets, self._key(metric, metric + "_sum", labels, help_text))
        for key, count in zip(keys[0], counts):
            file.write_value(key, count, 0.0)
        file.write_value(keys[1], total, 0.0)

    def close(self) -> None:
        for file in self._files.values():
            file.close()


_writers: dict[tuple[str, int], MmapSeriesWriter] = {}


def writer_for(directory: str) -> MmapSeriesWriter:
    """One writer per directory and process (every EchoProposer of a process shares it: one file per kind)."""
    key = (directory, os.getpid())
    if key not in _writers:
        _writers[key] = MmapSeriesWriter(directory)
    return _writers[key]


def release_front_process() -> str | None:
    """Remove the private directory `prepare_front_process` created in this process (None if it created none).

    TemporaryDirectory removes it at a normal interpreter exit, but the offline job runner (`offline.py`, which
    `echo-vllm bench` and the tests start once per job) exits with os._exit, which runs no finalizer: every job
    left a directory behind (over a thousand in one machine's /tmp). Its writers' files are closed first; the
    exported variable is dropped so nothing started later writes into a directory that is gone."""
    global _owned_dir
    owned, _owned_dir = _owned_dir, None
    if owned is None:
        return None
    path = owned.name
    for key in [key for key in _writers if key[0] == path]:
        _writers.pop(key).close()
    if os.environ.get(ECHO_DIR_ENV) == path:
        del os.environ[ECHO_DIR_ENV]
    _collected.discard(path)
    owned.cleanup()
    return path
