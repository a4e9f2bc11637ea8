"""AUC / Youden statistics, the warm-up recorder, calibrate() modes, the sparse checkpoint rule and the file format.

`fill` draws each depth's acceptance independently (not a prefix): good for the per-depth statistics and the `auc`
mode; the sparse rule is tested on `chains`, whose rows are request-steps with an accepted prefix as in serving."""

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
    cal = calibrate(rec, "auc", delta=0.6, min_samples_per_class=8)
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
    sparse = calibrate(rec, "auc", delta=0.6, min_samples_per_class=8)
    assert sparse.gated == [False, True, False]
    # Independent labels: truncating after depth 2 removes depth-3 tokens as often accepted as not, so the gate
    # at the only sweet spot adds nothing to J and the sparse rule leaves it out.
    assert calibrate(rec, "sparse", delta=0.6, min_samples_per_class=8).gated == [False, False, False]
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
    assert json.loads(path.read_text())["schema_version"] == 2
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
        (lambda d: d.update(schema_version=3), "schema_version"),
        (lambda d: d.update(gain=[0.1]), "gain"),
        (lambda d: d.update(gain=[0.1, 2.0]), "gain"),
        (lambda d: d.update(max_gates=0), "max_gates"),
        (lambda d: d.update(min_gain=-0.5), "min_gain"),
        (lambda d: d.update(score="x"), "score"),
        (lambda d: d.update(schema_version=1, mode="auc"), "mode"),
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


# ---- the sparse checkpoint rule -----------------------------------------------------------------------------


def chains(depth: int, types, rows: int = 600, noise: float = 0.3, seed: int = 0, rare_random: float = 0.0):
    """A recorder of `rows` request-steps, each of a type (accepted length L, confidence level, informative depths):
    types = [(L, level, informative or None = every depth)], drawn uniformly. acc[n, d] = depth d + 1 <= L (a
    prefix); c[n, d] = level * 0.8^d * exp(noise * N(0, 1)) at informative depths, else uniform noise. A share
    `rare_random` of rows has L = 0 and random confidences (gives the shallow depths rejected samples)."""
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(len(types), (rows,), generator=gen)
    conf = torch.rand(rows, depth, generator=gen) * 0.5
    length = torch.zeros(rows, dtype=torch.long)
    jitter = torch.exp(noise * torch.randn(rows, depth, generator=gen))
    decay = 0.8 ** torch.arange(depth, dtype=torch.float32)
    for t, (accepted_len, level, informative) in enumerate(types):
        mine = kind == t
        length[mine] = accepted_len
        cols = range(depth) if informative is None else [d - 1 for d in informative]
        for d in cols:
            conf[mine, d] = (level * decay[d] * jitter[mine, d]).clamp(max=1.0)
    odd = torch.rand(rows, generator=gen) < rare_random
    length[odd] = 0
    acc = torch.arange(1, depth + 1).unsqueeze(0) <= length.unsqueeze(1)
    rec = CalibrationRecorder(depth)
    for start in range(0, rows, 64):  # steps of a batch of 64 requests
        block = slice(start, start + 64)
        rec.record(conf[block], acc[block], torch.full((conf[block].shape[0],), depth))
    return rec


# Three kinds of step: fail at once (L = 0), stop half way (L = 3), accept all six. Every depth's confidence
# ranks its own acceptance well (AUC > 0.6 everywhere), but two gates carry all the information: depth 1 cuts the
# failing steps right away, depth 4 cuts the half-way ones after their rejected depth 4. Gates at depths 2 and 3
# see the same split as depth 1 (later, so they save less); depth 5 the same as depth 4; depth 6 cuts nothing.
THREE_KINDS = [(0, 0.1, None), (3, 0.5, None), (6, 0.95, None)]


def test_every_depth_a_sweet_spot_but_two_checkpoints_carry_the_information():
    rec = chains(6, THREE_KINDS)
    auc_rule = calibrate(rec, "auc", 0.6, 8)
    assert all(a > 0.6 for a in auc_rule.auc) and auc_rule.sweet_spots == [1, 2, 3, 4, 5, 6]
    sparse = calibrate(rec, "sparse", 0.6, 8)
    assert sparse.sweet_spots == [1, 4]
    assert sparse.max_gates == 3 and sparse.min_gain == 0.02
    assert all(sparse.gain[d - 1] >= 0.02 for d in (1, 4))
    assert all(sparse.gain[d - 1] < 0.02 for d in (2, 3, 5, 6))
    assert sparse.gain[5] == 0.0  # a gate at the last depth truncates nothing
    # The four other gates together add less than one min_gain to J (noise: a step depth 4 misjudges).
    assert sparse.score > 0.7 and auc_rule.score - sparse.score < 0.02
    assert calibrate(rec, "dense", 0.6, 8).sweet_spots == [1, 2, 3, 4, 5, 6]
    line = sparse.describe()
    assert line.startswith("sparse: gates at depths [1, 4] (AUC ") and "depths 2, 3, 5, 6 add" in line, line
    assert "< min_gain 0.02" in line


def test_max_gates_caps_the_checkpoints_and_says_so():
    rec = chains(6, THREE_KINDS)
    one = calibrate(rec, "sparse", 0.6, 8, max_gates=1)
    assert one.sweet_spots == [1]
    assert one.gain[3] >= 0.02  # depth 4 would still add
    assert "depths 4, 5 add 0.198, 0.089 (max_gates 1 reached)" in one.describe(), one.describe()
    # min_gain above every gain: no checkpoint at all (gates on a warm-up that cannot earn their keep)
    assert calibrate(rec, "sparse", 0.6, 8, min_gain=0.99).sweet_spots == []


def test_picks_the_only_informative_depth():
    # Steps either stop after depth 2 or accept all five; only depth 3's confidence sees which (AUC ~1); depths 4
    # and 5 see it weakly (AUC ~0.7, still sweet spots); a few L = 0 steps with random confidences give depths 1
    # and 2 rejected samples without signal (AUC ~0.5: not sweet spots).
    weak = 0.55  # depths 4, 5: the easy level only a little above the hard one
    rec = chains(5, [(2, 0.15, [3]), (5, 0.9, [3])], rows=1200, rare_random=0.05, seed=3)
    conf, acc, recorded = rec.rows()
    gen = torch.Generator().manual_seed(4)
    easy = acc[:, 2]
    for d in (3, 4):
        conf[:, d] = torch.rand(conf.shape[0], generator=gen) * 0.5 + weak * easy * torch.rand(
            conf.shape[0], generator=gen
        )
    rec._chunks = [(conf, acc, recorded)]
    auc_rule = calibrate(rec, "auc", 0.6, 8)
    assert auc_rule.auc[2] > 0.95 and 0.6 < auc_rule.auc[3] < 0.9 and 0.6 < auc_rule.auc[4] < 0.9
    assert auc_rule.auc[0] < 0.6 and auc_rule.auc[1] < 0.6
    assert auc_rule.sweet_spots == [3, 4, 5]
    sparse = calibrate(rec, "sparse", 0.6, 8)
    assert sparse.sweet_spots == [3]
    assert sparse.gain[0] is None and sparse.gain[1] is None  # not sweet spots: not considered
    assert sparse.gain[3] < 0.02 and sparse.gain[4] == 0.0
    assert "depths 1, 2 have AUC 0.46, 0.42 <= delta 0.6; depths 4, 5 add -0.042, 0.000 < min_gain 0.02" in (
        sparse.describe()
    )


def test_sparse_rule_is_deterministic_and_order_free():
    rec = chains(6, THREE_KINDS, seed=7)
    first = calibrate(rec, "sparse", 0.6, 8)
    assert calibrate(rec, "sparse", 0.6, 8) == first
    conf, acc, recorded = rec.rows()
    perm = torch.randperm(conf.shape[0], generator=torch.Generator().manual_seed(1))
    shuffled = CalibrationRecorder(6)
    for block in torch.split(perm, 100):  # other step sizes, other order
        shuffled.record(conf[block], acc[block], torch.full((block.numel(),), 6))
    assert calibrate(shuffled, "sparse", 0.6, 8) == first


def test_gate_set_j_counts_truncated_tokens():
    from echo_vllm.core.calibration import gate_set_j

    # Two rows, D = 3: row 0 accepts depths 1, 2; row 1 accepts nothing. N_acc = 2, N_rej = 4.
    conf = torch.tensor([[0.9, 0.8, 0.1], [0.2, 0.1, 0.05]])
    acc = torch.tensor([[True, True, False], [False, False, False]])
    rec = torch.ones(2, 3, dtype=torch.bool)
    assert gate_set_j(conf, acc, rec, [False] * 3, [None] * 3) == 0.0
    # a gate at depth 1 with tau 0.5 closes for row 1 only: drops its depths 2, 3 (rejected) -> J = 2/4
    assert gate_set_j(conf, acc, rec, [True, False, False], [0.5, None, None]) == pytest.approx(0.5)
    # a gate at depth 1 with tau 0.95 closes for both: also drops row 0's accepted depth 2 -> 3/4 - 1/2
    assert gate_set_j(conf, acc, rec, [True, False, False], [0.95, None, None]) == pytest.approx(0.25)
    # unrecorded depths count for nothing: row 1 verified only depth 1
    rec[1, 1:] = False
    assert gate_set_j(conf, acc, rec, [True, False, False], [0.5, None, None]) == 0.0


def test_sparse_round_trip_and_schema_1_file(tmp_path):
    rec = chains(6, THREE_KINDS)
    cal = calibrate(rec, "sparse", 0.6, 8)
    path = tmp_path / "cal.json"
    cal.save(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 2 and data["max_gates"] == 3 and len(data["gain"]) == 6
    assert Calibration.load(path, expected_max_depth=6, expected_mode="sparse") == cal
    # A file written before the sparse rule (schema 1, the AUC rule's gates): loads with its gates as saved.
    for key in ("max_gates", "min_gain", "gain", "score"):
        data.pop(key)
    data.update(schema_version=1, gated=[True] * 6)
    path.write_text(json.dumps(data))
    old = Calibration.load(path, expected_max_depth=6, expected_mode="sparse")
    assert old.sweet_spots == [1, 2, 3, 4, 5, 6] and old.gain is None and old.score is None
    assert "schema-1 file" in old.describe() and "delete it to recalibrate" in old.describe()
    old.save(path)  # saving it again writes schema 2, still with its gates
    assert Calibration.load(path) == old
    auc_cal = calibrate(rec, "auc", 0.6, 8)
    auc_cal.save(path)
    assert Calibration.load(path, expected_mode="auc") == auc_cal and auc_cal.gain is None


def test_sparse_settings_validation():
    from echo_vllm.config import EchoConfigError, parse_echo_settings

    settings = parse_echo_settings({})
    assert settings.max_gates == 3 and settings.min_gain == 0.02 and settings.gate_mode == "sparse"
    assert parse_echo_settings({"max_gates": 2, "min_gain": 0, "gate_mode": "auc"}).min_gain == 0.0
    for raw, pattern in [
        ({"max_gates": 0}, r"^echo\.max_gates: .*max_gates must be an integer >= 1 .*gate_mode 'dense'.*got 0$"),
        ({"max_gates": True}, r"^echo\.max_gates: .*got True$"),
        ({"max_gates": "2"}, r"^echo\.max_gates: .*got '2'$"),
        ({"min_gain": 1.5}, r"^echo\.min_gain: .*min_gain must be a number in \[0, 1\].*got 1\.5$"),
        ({"min_gain": -0.1}, r"^echo\.min_gain: "),
        ({"min_gain": False}, r"^echo\.min_gain: "),
        ({"gate_mode": "sparser"}, r"^echo\.gate_mode: .*'sparse', 'auc', 'dense' or 'fixed'"),
    ]:
        with pytest.raises(EchoConfigError, match=pattern):
            parse_echo_settings(raw)
    rec = CalibrationRecorder(2)
    with pytest.raises(ValueError, match="max_gates must be an integer >= 1; got 0"):
        calibrate(rec, "sparse", 0.6, 8, max_gates=0)
    with pytest.raises(ValueError, match=r"min_gain must be a number in \[0, 1\]; got 2"):
        calibrate(rec, "sparse", 0.6, 8, min_gain=2)
