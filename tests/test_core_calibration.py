"""AUC / Youden statistics, the warm-up recorder, calibrate() modes and the calibration file format."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.config import EchoSettings
from echo_vllm.core.calibration import (
    MODES,
    Calibration,
    CalibrationError,
    CalibrationRecorder,
    auc,
    calibrate,
    youden_threshold,
)

SETTINGS = settings(deadline=None, max_examples=150, database=None, derandomize=True)

samples = st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=40)


def brute_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@SETTINGS
@given(samples)
def test_auc_equals_pair_count(data):
    scores = [s / 4 for s, _ in data]
    labels = [y for _, y in data]
    result = auc(torch.tensor(scores), torch.tensor(labels))
    if all(labels) or not any(labels):
        assert result != result  # NaN
    else:
        assert result == pytest.approx(brute_auc(scores, labels), abs=1e-12)


@SETTINGS
@given(samples)
def test_youden_matches_brute_force(data):
    scores = [s / 4 for s, _ in data]
    labels = [y for _, y in data]
    n_pos = sum(labels)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        with pytest.raises(ValueError, match="both classes"):
            youden_threshold(torch.tensor(scores), torch.tensor(labels))
        return
    best = None
    for tau in sorted(set(scores)):  # ascending: strict > keeps the smallest tau among equal J
        tp = sum(s >= tau for s, y in zip(scores, labels, strict=True) if y)
        fp = sum(s >= tau for s, y in zip(scores, labels, strict=True) if not y)
        j = tp * n_neg - fp * n_pos
        if best is None or j > best[0]:
            best = (j, tau)
    assert youden_threshold(torch.tensor(scores), torch.tensor(labels)) == best[1]


def test_youden_tie_goes_to_smaller_tau():
    # tau = 0.2 and tau = 0.6 both give J = 0.5; the smaller one wins.
    scores = torch.tensor([0.1, 0.2, 0.6, 0.9])
    labels = torch.tensor([False, True, False, True])
    assert youden_threshold(scores, labels) == pytest.approx(0.2)


def fill(recorder: CalibrationRecorder, per_depth, steps: int = 4, batch: int = 64, seed: int = 0):
    """per_depth[d] = 'separable' | 'random' | 'rare-neg'; records `steps` verification steps."""
    gen = torch.Generator().manual_seed(seed)
    depth = recorder.max_depth
    for _ in range(steps):
        conf = torch.rand(batch, depth, generator=gen)
        acc = torch.rand(batch, depth, generator=gen) < 0.5
        for d, kind in enumerate(per_depth):
            if kind == "separable":
                conf[:, d] = torch.where(acc[:, d], 0.6 + 0.3 * conf[:, d], 0.1 + 0.3 * conf[:, d])
            elif kind == "rare-neg":
                acc[:, d] = True
                acc[:2, d] = False if _ == 0 else True
        recorder.record(conf, acc, torch.full((batch,), depth))


def test_separable_depth_is_a_sweet_spot_with_tau_between_classes():
    rec = CalibrationRecorder(3)
    fill(rec, ["random", "separable", "random"])
    cal = calibrate(rec, "sparse", delta=0.6, min_samples_per_class=8)
    assert cal.gated == [False, True, False]
    assert cal.sweet_spots == [2]
    assert cal.auc[1] == 1.0
    assert abs(cal.auc[0] - 0.5) < 0.1 and abs(cal.auc[2] - 0.5) < 0.1
    scores, labels = rec.samples(2)
    assert float(scores[~labels].max()) < cal.tau[1] <= float(scores[labels].min())
    assert cal.tau[1] == pytest.approx(float(scores[labels].min()))
    assert cal.num_pos[1] + cal.num_neg[1] == 4 * 64


def test_dense_and_fixed_modes():
    rec = CalibrationRecorder(3)
    fill(rec, ["random", "separable", "rare-neg"])
    dense = calibrate(rec, "dense", delta=0.6, min_samples_per_class=8)
    assert dense.gated == [True, True, False]  # depth 3 has only 2 rejected samples
    assert dense.tau[2] is None and dense.tau[0] is not None and dense.tau[0] != dense.tau[1]
    fixed = calibrate(rec, "fixed", delta=0.6, min_samples_per_class=8)
    assert fixed.gated == [True, True, True]
    assert len(set(fixed.tau)) == 1
    pooled_scores, pooled_labels = rec.samples(None)
    assert fixed.tau[0] == youden_threshold(pooled_scores, pooled_labels)
    sparse = calibrate(rec, "sparse", delta=0.6, min_samples_per_class=8)
    assert sparse.gated == [False, True, False]
    strict = calibrate(rec, "sparse", delta=0.6, min_samples_per_class=10_000)
    assert strict.gated == [False, False, False] and strict.tau == [None] * 3
    fixed_strict = calibrate(rec, "fixed", delta=0.6, min_samples_per_class=10_000)
    assert fixed_strict.gated == [False] * 3


def test_recorder_only_records_verified_depths():
    rec = CalibrationRecorder(4)
    conf = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2], [0.1, 0.1, 0.1, 0.1]])
    acc = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])  # D' = 3 < D
    rec.record(conf, acc, torch.tensor([4, 2, 0]))
    pos, neg = rec.class_counts()
    assert pos == [2, 1, 0, 0] and neg == [0, 1, 1, 1]
    s, y = rec.samples(2)
    assert s.tolist() == pytest.approx([0.8, 0.4]) and y.tolist() == [True, False]
    assert rec.num_steps == 1
    with pytest.raises(ValueError, match="confidence"):
        rec.record(torch.zeros(3, 3), acc, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="verified_depth"):
        rec.record(conf, acc, torch.tensor([1, 1]))


def test_empty_recorder_calibrates_to_no_gates():
    for mode in MODES:
        cal = calibrate(CalibrationRecorder(2), mode, 0.6, 8)
        assert cal.gated == [False, False] and cal.auc == [None, None]


def test_modes_match_settings():
    assert set(MODES) == set(EchoSettings.model_fields["gate_mode"].annotation.__args__)


def test_save_load_round_trip(tmp_path):
    rec = CalibrationRecorder(3)
    fill(rec, ["random", "separable", "rare-neg"])
    cal = calibrate(rec, "sparse", 0.6, 8)
    path = tmp_path / "cal.json"
    cal.save(path)
    assert json.loads(path.read_text())["schema_version"] == 1
    loaded = Calibration.load(path, expected_max_depth=3, expected_mode="sparse")
    assert loaded == cal
    assert loaded.auc[2] is None or isinstance(loaded.auc[2], float)


def _good(tmp_path):
    cal = Calibration("sparse", 2, 0.6, [0.9, 0.5], [0.3, 0.1], [True, False], [10, 10], [10, 10], 8)
    path = tmp_path / "cal.json"
    cal.save(path)
    return path, json.loads(path.read_text())


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d.pop("schema_version"), "schema_version"),
        (lambda d: d.update(mode="weird"), "mode"),
        (lambda d: d.update(max_depth=0), "max_depth"),
        (lambda d: d.update(tau=[0.3]), "tau"),
        (lambda d: d.update(auc=[0.9, 1.5]), "auc"),
        (lambda d: d.update(gated=[1, 0]), "gated"),
        (lambda d: d.update(num_pos=[1, -1]), "num_pos"),
        (lambda d: d.update(tau=[None, 0.1]), "tau"),
        (lambda d: d.pop("num_neg"), "num_neg"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.update(delta="x"), "delta"),
    ],
)
def test_bad_file_fields(tmp_path, mutate, field):
    path, data = _good(tmp_path)
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError) as err:
        Calibration.load(path)
    msg = str(err.value)
    assert str(path) in msg and repr(field) in msg and "delete it" in msg


def test_corrupt_and_mismatched_files(tmp_path):
    path, _ = _good(tmp_path)
    assert Calibration.load(path, expected_max_depth=2, expected_mode="sparse").gated == [True, False]
    with pytest.raises(CalibrationError, match="'max_depth' is 2 .* 5 depths; delete it"):
        Calibration.load(path, expected_max_depth=5)
    with pytest.raises(CalibrationError, match="'mode' is 'sparse' but gate_mode is 'dense'"):
        Calibration.load(path, expected_mode="dense")
    path.write_text('{"schema_version": 1, "mode": ')
    with pytest.raises(CalibrationError, match="not valid JSON.*delete it"):
        Calibration.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(CalibrationError, match="JSON object"):
        Calibration.load(path)
    with pytest.raises(CalibrationError, match="cannot be read"):
        Calibration.load(tmp_path / "missing.json")
    assert issubclass(CalibrationError, ValueError)


def test_bad_calibrate_arguments():
    with pytest.raises(ValueError, match="mode"):
        calibrate(CalibrationRecorder(2), "nope", 0.6, 8)
    with pytest.raises(ValueError, match="min_samples_per_class"):
        calibrate(CalibrationRecorder(2), "sparse", 0.6, 0)
    with pytest.raises(CalibrationError, match="'tau'"):
        Calibration("sparse", 2, 0.6, [None, None], [None, None], [True, False], [0, 0], [0, 0])


def _save_repeatedly(path: str, writer: int, rounds: int) -> None:
    # Large files (long per-depth lists) make a half-written file likely to be seen if saving were not atomic.
    depth = 4000
    cal = Calibration(
        "dense",
        depth,
        0.6,
        [0.5 + writer / 100] * depth,
        [0.1 * writer] * depth,
        [True] * depth,
        [10] * depth,
        [10] * depth,
        1,
    )
    for _ in range(rounds):
        cal.save(path)


def test_concurrent_saves_never_expose_a_partial_file(tmp_path):
    """Replicas sharing a volume save the same missing file together: a reader must only ever see no file or
    one whole, valid file, and every writer's result is a valid file (the last rename wins)."""
    import multiprocessing as mp

    path = tmp_path / "cal.json"
    ctx = mp.get_context("fork")
    writers = [ctx.Process(target=_save_repeatedly, args=(str(path), w, 40)) for w in range(3)]
    for proc in writers:
        proc.start()
    loads = 0
    while any(p.is_alive() for p in writers):
        if path.exists():
            cal = Calibration.load(path)  # raises CalibrationError on a partial file
            assert cal.max_depth == 4000 and len(set(cal.auc)) == 1, "a mix of two writers' files"
            loads += 1
    for proc in writers:
        proc.join()
        assert proc.exitcode == 0
    assert Calibration.load(path).max_depth == 4000
    assert loads > 0, "the reader never saw the file: the test proved nothing"
    assert not [p for p in tmp_path.iterdir() if p.name != "cal.json"], "temporary files were left behind"
