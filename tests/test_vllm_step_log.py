"""echo_vllm.vllm.step_log: the buffered step log writes exactly what the per-step writer wrote, when asked."""

from __future__ import annotations

import hashlib
import json

from echo_vllm.bench import vllm_run
from echo_vllm.vllm import step_log
from echo_vllm.vllm.step_log import StepLogWriter, StepRecord, encode


def _record(step: int, ragged: list[list[int]], model_ms=None) -> StepRecord:
    fields = {"step": step, "batch": len(ragged), "counts": [len(r) for r in ragged], "rest_s": 0.0125}
    return StepRecord(fields, tuple(map(tuple, ragged)), {"depth_values": [1.0, 1.234567, None]}, model_ms)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_encode_keeps_the_selection_hash_and_rounds_the_plan_values():
    ragged = [[5, 6, 7], [], [9]]
    line = json.loads(encode(_record(3, ragged, model_ms=lambda: [1.5, 2.25])))
    # The hash the per-step writer computed (TP tests compare it across ranks): sha1 of the lists' JSON.
    assert line["selection_hash"] == hashlib.sha1(json.dumps(ragged).encode()).hexdigest()[:16]
    assert line["depth_values"] == [1.0, 1.2346, None]
    assert line["model_ms"] == [1.5, 2.25]
    assert line["step"] == 3 and line["counts"] == [3, 0, 1] and line["rest_s"] == 0.0125
    assert "model_ms" not in json.loads(encode(_record(4, ragged)))


def test_records_wait_for_a_flush_and_keep_their_order(tmp_path):
    path = tmp_path / "steps.jsonl"
    writer = StepLogWriter(str(path), flush_seconds=0.0)
    for step in range(5):
        writer.append(_record(step, [[step]]))
    assert not path.exists()  # nothing encoded or written during the steps
    assert writer.flush() == 5
    assert [r["step"] for r in _lines(path)] == [0, 1, 2, 3, 4]
    writer.append(_record(5, [[1]]))
    assert step_log.flush_all() >= 1  # the offline runner's rpc and interpreter exit go through here
    assert [r["step"] for r in _lines(path)] == [0, 1, 2, 3, 4, 5]
    assert writer.flush() == 0


def test_a_full_buffer_and_elapsed_time_flush_on_their_own(tmp_path):
    full = tmp_path / "full.jsonl"
    writer = StepLogWriter(str(full), flush_seconds=0.0, max_buffered=3)
    for step in range(7):
        writer.append(_record(step, [[step]]))
    assert [r["step"] for r in _lines(full)] == [0, 1, 2, 3, 4, 5]  # two full buffers; step 6 waits
    timed = tmp_path / "timed.jsonl"
    writer = StepLogWriter(str(timed), flush_seconds=1e-9)
    writer.append(_record(0, [[1]]))
    assert [r["step"] for r in _lines(timed)] == [0]


def test_the_flush_interval_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(step_log.FLUSH_SECONDS_ENV, "0")
    assert StepLogWriter(str(tmp_path / "a.jsonl")).flush_seconds == 0.0
    monkeypatch.delenv(step_log.FLUSH_SECONDS_ENV)
    assert StepLogWriter(str(tmp_path / "b.jsonl")).flush_seconds == step_log.DEFAULT_FLUSH_SECONDS
    # The benchmark names the variable without importing torch-side modules: the two names must agree.
    assert vllm_run.STEP_LOG_FLUSH_ENV == step_log.FLUSH_SECONDS_ENV


def test_a_record_is_a_snapshot_of_the_selection(tmp_path):
    path = tmp_path / "steps.jsonl"
    writer = StepLogWriter(str(path), flush_seconds=0.0)
    ragged = [[1, 2], [3]]
    expected = hashlib.sha1(json.dumps(ragged).encode()).hexdigest()[:16]
    writer.append(StepRecord({"step": 0}, tuple(map(tuple, ragged)), {}, None))
    ragged[0].clear()  # what the scheduler may do with its lists after the step
    writer.flush()
    assert _lines(path)[0]["selection_hash"] == expected


def test_read_step_log_reads_what_the_writer_wrote(tmp_path):
    path = tmp_path / "steps.jsonl"
    writer = StepLogWriter(str(path), flush_seconds=0.0)
    for step in range(4):
        writer.append(_record(step, [[step, step + 1]]))
    writer.flush()
    with path.open("a") as handle:
        handle.write("\n")  # a blank line (a flush cut short) is no step
    lines = step_log.read_step_log(path)
    assert [r["step"] for r in lines] == [0, 1, 2, 3] and lines[2]["counts"] == [2]
    assert [r["step"] for r in step_log.read_step_log(str(path), last=2)] == [2, 3]  # a path as text, the newest 2
    assert step_log.read_step_log(path, last=0) == lines
