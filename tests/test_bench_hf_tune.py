"""bench hf's tuned settings, prompt split, interleaved rounds and the tuner's choice (issue #14). No timing
assertions: the tuner's choice is tested on injected scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testbed_fixture import shipped_testbed

from echo_vllm.bench.hf import Config, bench_hf, rotations, split_prompts
from echo_vllm.bench.hf_settings import (
    DrafterError,
    MethodSetting,
    TunedSettingsError,
    apply_overrides,
    load_tuned,
    resolve_drafter,
    save_tuned,
    settings_for_run,
)
from echo_vllm.bench.hf_tune import GRIDS, choose, tradeoff_rows, tune
from echo_vllm.bench.spread import Spread
from echo_vllm.config import EchoSettings
from echo_vllm.errors import ConfigError, InputError

DRAFT_LM = Path(__file__).parent / "assets" / "testbed" / "draft-lm"


# ---- the prompt split -------------------------------------------------------------------------------------------


def test_prompt_split_is_disjoint_and_deterministic():
    tune_set = split_prompts(80, 6, None, "tune")
    report = split_prompts(80, 6, 10, "report")
    assert tune_set == list(range(6)) and report == list(range(6, 16))
    assert not set(tune_set) & set(report)
    assert split_prompts(80, 6, 10, "report") == report  # the same every call
    assert split_prompts(80, 6, None, "report") == list(range(6, 80))
    assert split_prompts(10, 6, 100, "report") == list(range(6, 10))  # clipped to the dataset


@pytest.mark.parametrize(
    ("args", "field"),
    [((6, 6, 1, "report"), "--prompt-set"), ((10, 6, 0, "report"), "--limit"), ((10, 6, 1, "x"), "--prompt-set")],
)
def test_prompt_split_bad_input_names_the_flag(args, field):
    with pytest.raises(InputError, match=field):
        split_prompts(*args)


def test_rounds_rotate_the_order():
    assert rotations(["ar", "a", "b"], 4) == [["ar", "a", "b"], ["a", "b", "ar"], ["b", "ar", "a"], ["ar", "a", "b"]]
    with pytest.raises(InputError, match="--rounds"):
        rotations(["ar"], 0)


# ---- the tuned file ---------------------------------------------------------------------------------------------


def test_tuned_settings_round_trip(tmp_path):
    path = tmp_path / "tuned.json"
    winners = {
        "eagle2": MethodSetting("eagle2", max_depth=5, k_max=8, top_k=2),
        "ddd": MethodSetting("ddd", k_max=8, top_k=2, ddd_threshold=-3.0, ddd_max_depth=10, ddd_check_depths=(4, 6)),
        "echo": MethodSetting("echo", k_max="auto", delta=0.7),
        "chain": MethodSetting("chain", max_depth=4),
    }
    save_tuned(path, "eagle3", winners, {"date": "today", "grid": []})
    save_tuned(path, "draft-model", {"chain": MethodSetting("chain", max_depth=3)}, {})
    loaded = load_tuned(path)
    assert loaded["eagle3"] == winners  # the other drafter's block did not replace this one
    assert loaded["draft-model"] == {"chain": MethodSetting("chain", max_depth=3)}
    assert json.loads(path.read_text())["drafters"]["eagle3"]["provenance"]["date"] == "today"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "not valid JSON"),
        ('{"version": 1, "drafters": {"eagle3": {"methods": {"medusa": {}}}}}', "medusa"),
        ('{"version": 1, "drafters": {"eagle3": {"methods": {"eagle2": {"k_maxx": 8}}}}}', "k_maxx"),
        ('{"version": 1, "drafters": {"eagle3": {"methods": {"eagle2": {"k_max": "auto"}}}}}', "eagle2"),
        ('{"version": 1, "drafters": {"eagle3": {"methods": {"ddd": {"ddd_threshold": 2}}}}}', "ddd.threshold"),
        ('{"version": 1, "drafters": {"medusa-head": {"methods": {}}}}', "medusa-head"),
        ('{"version": 7, "drafters": {}}', "version"),
    ],
)
def test_corrupt_or_unknown_tuned_file_is_one_clear_error(tmp_path, text, needle):
    path = tmp_path / "tuned.json"
    path.write_text(text)
    with pytest.raises(TunedSettingsError, match=needle) as info:
        load_tuned(path)
    assert "\n" not in str(info.value)


def test_the_committed_tuned_file_loads():
    tuned = load_tuned()
    assert "eagle3" in tuned  # bench hf's defaults for the eagle3 drafter come from the sweep


def test_missing_methods_fall_back_to_defaults_with_a_note_and_flags_override(tmp_path):
    path = tmp_path / "tuned.json"
    save_tuned(path, "eagle3", {"eagle2": MethodSetting("eagle2", max_depth=5, k_max=8, top_k=2)}, {})
    notes: list[str] = []
    got = settings_for_run(["ar", "eagle2", "echo"], "eagle3", {}, path, note=notes.append)
    assert got["eagle2"].k_max == 8 and got["echo"] == MethodSetting("echo")
    assert len(notes) == 1 and "echo" in notes[0] and "eagle2" not in notes[0]
    got = settings_for_run(
        ["eagle2", "echo", "chain"], "eagle3", {"k_max": 12, "gated_depth": 9}, path, note=notes.append
    )
    assert got["eagle2"].k_max == 12 and got["eagle2"].max_depth == 5  # --echo-depth is the gated methods' only
    assert got["echo"].k_max == 12 and got["echo"].max_depth == 9
    assert got["chain"].relevant() == {"max_depth": 6}  # chain has no k_max to override


def test_overrides_reject_unknown_fields():
    with pytest.raises(ConfigError, match="unknown"):
        apply_overrides(MethodSetting("echo"), {"depthh": 3})


def test_setting_validation_names_the_field():
    with pytest.raises(ConfigError, match="k_max"):
        MethodSetting("echo", k_max=-1).engine_options(EchoSettings())


# ---- the drafter ------------------------------------------------------------------------------------------------


def test_resolve_drafter(tmp_path):
    assert resolve_drafter("eagle3", tmp_path) == ("eagle3", tmp_path / "eagle3")
    assert resolve_drafter("draft-model", tmp_path) == ("draft-model", tmp_path / "draft-lm")
    assert resolve_drafter(f"draft-model:{tmp_path}/x", tmp_path) == ("draft-model", tmp_path / "x")
    for bad in ("medusa", "draft-model:", "EAGLE3", "eagle-3:/x"):
        with pytest.raises(DrafterError, match="--drafter"):
            resolve_drafter(bad, tmp_path)


# ---- the tuner's choice (injected scores, no timing) -----------------------------------------------------------


def _fake_measure(speedups: dict[str, float], lossy: frozenset[str] = frozenset()):
    calls: list[tuple[list[str], str]] = []

    def measure(configs, dataset):
        calls.append(([c.label for c in configs], dataset))
        out = {}
        for c in configs:
            s = 1.0 if c.setting.method == "ar" else speedups[c.setting.label()] * (1.1 if dataset == "mtbench" else 1)
            out[c.label] = {
                "speedup_vs_ar": Spread(s, s * 0.9, s * 1.1, 2),
                "identical_to_ar": c.setting.label() not in lossy,
                "metrics": {"mat": 2.0 * s},
                "depths": {"u_selected_depth": 0.5},
            }
        return out

    return measure, calls


def test_tuner_picks_the_better_point_on_a_two_point_grid():
    a, b = MethodSetting("eagle2", k_max=8, top_k=2), MethodSetting("eagle2", k_max=12, top_k=4)
    measure, calls = _fake_measure({a.label(): 1.10, b.label(): 1.25})
    outcome = tune(
        ["eagle2"], ["humaneval", "mtbench"], measure, grids={"eagle2": lambda best: [a, b]}, log=lambda _: None
    )
    assert outcome.best == {"eagle2": b}
    assert [d for _, d in calls] == ["humaneval", "mtbench"] and calls[0][0][0] == "ar"
    score = next(p.score for p in outcome.points["eagle2"] if p.setting == b)
    assert score == pytest.approx((1.25 * 1.25 * 1.1) ** 0.5)  # geometric mean of the two datasets

    measure, _ = _fake_measure({a.label(): 1.10, b.label(): 1.25}, lossy=frozenset({b.label()}))
    outcome = tune(["eagle2"], ["humaneval"], measure, grids={"eagle2": lambda best: [a, b]}, log=lambda _: None)
    assert outcome.best == {"eagle2": a}  # the faster point was not lossless: never chosen


def test_tuner_with_no_lossless_point_saves_nothing_for_that_method():
    a = MethodSetting("chain", max_depth=3)
    measure, _ = _fake_measure({a.label(): 2.0}, lossy=frozenset({a.label()}))
    outcome = tune(["chain"], ["humaneval"], measure, grids={"chain": lambda best: [a]}, log=lambda _: None)
    assert outcome.best == {} and "chain" in outcome.failed
    assert choose(outcome.points["chain"]) is None


def test_ddd_grid_starts_from_the_tuned_eagle2_pool_and_echo_sees_it_beside_it():
    e2 = [MethodSetting("eagle2", k_max=8, top_k=2), MethodSetting("eagle2", k_max=12, top_k=4)]
    grids = {"eagle2": lambda best: e2, "ddd": GRIDS["ddd"], "echo": lambda best: [MethodSetting("echo", delta=0.7)]}
    speed = {e2[0].label(): 1.3, e2[1].label(): 1.1}
    speed |= {s.label(): 1.0 for s in GRIDS["ddd"]({"eagle2": e2[0]})}
    speed[MethodSetting("echo", delta=0.7).label()] = 1.4
    measure, calls = _fake_measure(speed)
    outcome = tune(["echo", "ddd", "eagle2"], ["humaneval"], measure, grids=grids, log=lambda _: None)
    assert all(s.setting.k_max == 8 and s.setting.top_k == 2 for s in outcome.points["ddd"])
    assert "ref:eagle2" in calls[-1][0]  # echo's grid ran beside the tuned eagle2
    rows = tradeoff_rows(outcome)
    assert rows[0]["delta"] == 0.7 and rows[0]["speed_vs_eagle2"] == pytest.approx(1.4 / 1.3)


def test_tuner_rejects_methods_it_cannot_tune():
    with pytest.raises(ConfigError, match="ar"):
        tune(["ar"], ["humaneval"], lambda c, d: {}, log=lambda _: None)


# ---- bench hf end to end on the committed testbed ---------------------------------------------------------------


CONTRACT = {
    "method",
    "dataset",
    "drafter",
    "setting",
    "prompt_set",
    "prompt_indices",
    "speedup_vs_ar",
    "speedup_vs_ar_min",
    "speedup_vs_ar_max",
    "tokens_per_s",
    "wall_s",
    "mat",
    "u_selected_depth",
    "u_drafted_depth",
    "verified_per_step",
    "ms_per_step",
    "identical_to_ar",
}


def _tiny_bench(tmp_path, methods, drafter="eagle3", drafter_dir=None):
    settings = {
        "ar": MethodSetting("ar"),
        "eagle2": MethodSetting("eagle2", max_depth=4, k_max=6, top_k=2),
        "chain": MethodSetting("chain", max_depth=3),
        "echo": MethodSetting("echo", max_depth=4, k_max=6, top_k=2),
        "ddd": MethodSetting("ddd", k_max=6, top_k=2, ddd_max_depth=5, ddd_check_depths=(2,)),
    }
    out = tmp_path / "bench.json"
    outcome = bench_hf(
        shipped_testbed(),
        methods,
        ["humaneval"],
        limit=1,
        max_new_tokens=8,
        settings={m: settings[m] for m in methods},
        base=EchoSettings(warmup_steps=2),
        json_path=str(out),
        rounds=2,
        tune_prompts=6,
        drafter=drafter,
        drafter_dir=drafter_dir,
        log=lambda _: None,
    )
    return outcome, json.loads(out.read_text())


def test_bench_hf_rows_carry_the_contract_and_are_lossless(tmp_path):
    outcome, data = _tiny_bench(tmp_path, ["ar", "chain", "eagle2", "ddd", "echo"])
    rows = data["results"]
    assert [r["method"] for r in rows] == ["ar", "chain", "eagle2", "ddd", "echo"]
    for row in rows:
        assert CONTRACT <= row.keys()
        assert row["identical_to_ar"] is True
        assert row["drafter"] == "eagle3" and row["rounds"] == 2
        assert row["prompt_set"] == "report" and row["prompt_indices"] == [6]  # never a tuning prompt
        assert row["speedup_vs_ar_min"] <= row["speedup_vs_ar"] <= row["speedup_vs_ar_max"]
    assert rows[2]["setting"] == {"k_max": 6, "top_k": 2, "max_depth": 4}
    assert {(r["b"], r["dataset"]) for r in data["ratios"]} == {("eagle2", "humaneval"), ("ddd", "humaneval")}
    assert data["prompt_indices"] == {"humaneval": [6]}


def test_bench_hf_with_the_draft_model_is_lossless(tmp_path):
    _, data = _tiny_bench(tmp_path, ["ar", "chain", "eagle2"], drafter="draft-model", drafter_dir=DRAFT_LM)
    assert all(r["identical_to_ar"] and r["drafter"] == "draft-model" for r in data["results"])


def test_warm_up_leaves_calibration_and_zeroes_the_counters():
    from echo_vllm.bench.hf import build_engines, warm_up

    root = shipped_testbed()
    base = EchoSettings(warmup_steps=2, min_samples_per_class=1)
    engine = build_engines(
        root, [Config("echo", MethodSetting("echo", max_depth=3, k_max=4))], base, "eagle3", root / "eagle3"
    )["echo"]
    warm_up(engine, [list(range(5, 60)), list(range(60, 90))], 12, base)
    assert engine.calibration is not None  # the gated method calibrated before anything is timed
    assert engine.phases.steps == 0 and engine.metrics.totals()["verified"] == 0.0
