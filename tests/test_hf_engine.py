"""The HF low-load engine: every method is lossless against `ar`, on the shipped testbed.

Greedy: token-for-token identity on >= 50 prompts (HumanEval + MT-Bench first turns) under several depth /
top-k / K_max settings, with gates forced closed and open so that truncate-and-widen paths run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from testbed_fixture import shipped_testbed

from echo_vllm.bench.datasets import humaneval_prompts, mtbench_prompts
from echo_vllm.bench.hf import encode_prompts, load_tokenizer
from echo_vllm.config import EchoConfigError, EchoSettings, parse_echo_settings
from echo_vllm.core import Calibration
from echo_vllm.core.eagle2 import DDDSettings
from echo_vllm.hf.engine import EngineInputError, EngineOptions, HFEngine
from echo_vllm.models.eagle3 import Eagle3Head

MAX_NEW = 24


@pytest.fixture(scope="module")
def root() -> Path:
    return shipped_testbed()


@pytest.fixture(scope="module")
def prompts(root) -> list[list[int]]:
    texts = humaneval_prompts(30) + mtbench_prompts(20)
    return encode_prompts(load_tokenizer(root / "target"), texts, max_prompt_tokens=96)


@pytest.fixture(scope="module")
def reference(root, prompts) -> list[list[int]]:
    engine = HFEngine(root / "target", None, EngineOptions(method="ar"))
    return [engine.generate(p, MAX_NEW).token_ids for p in prompts]


def forced_calibration(path: Path, mode: str, max_depth: int, tau: float, gated_depths: set[int]) -> str:
    """A calibration file whose gates close often, so that truncation and widening really run."""
    cal = Calibration(
        mode=mode,
        max_depth=max_depth,
        delta=0.6,
        auc=[0.9] * max_depth,
        tau=[tau if (d + 1) in gated_depths else None for d in range(max_depth)],
        gated=[(d + 1) in gated_depths for d in range(max_depth)],
        num_pos=[10] * max_depth,
        num_neg=[10] * max_depth,
        min_samples_per_class=1,
    )
    cal.save(path)
    return str(path)


def assert_identical(engine: HFEngine, prompts, reference, label: str) -> None:
    outputs = [engine.generate(p, MAX_NEW).token_ids for p in prompts]
    bad = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
    assert not bad, f"{label}: prompts {bad[:5]} differ from ar"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["chain", "eagle2", "ddd", "siblings", "dense", "fixed", "echo"])
def test_every_method_greedy_identical_to_ar(root, prompts, reference, method):
    assert len(prompts) >= 50
    settings = EchoSettings(k_max=16, top_k=4, warmup_steps=12, min_samples_per_class=2)
    engine = HFEngine(root / "target", root / "eagle3", EngineOptions(method=method, max_depth=6, echo=settings))
    assert_identical(engine, prompts, reference, method)
    if method in ("dense", "fixed", "echo"):
        assert engine.calibration is not None, "warm-up should have ended and calibrated"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("depth", "top_k", "k_max", "tau", "gated"),
    [
        (4, 2, 3, 0.5, {1, 3}),  # K_max binds below the depth: spine only, often truncated at depth 1
        (8, 3, 12, 0.3, {2, 5}),  # deep, truncations at 2 and 5 with width spent there
        (5, 4, 20, 0.9, {1}),  # a harsh gate at depth 1: nearly always truncate-and-widen
    ],
)
def test_echo_identical_with_forced_gates(root, prompts, reference, tmp_path, depth, top_k, k_max, tau, gated):
    cal_path = forced_calibration(tmp_path / "cal.json", "sparse", depth, tau, gated)
    settings = EchoSettings(k_max=k_max, top_k=top_k, calibration_file=cal_path)
    engine = HFEngine(root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=depth, echo=settings))
    assert_identical(engine, prompts[:25], reference[:25], f"echo depth={depth} k={top_k} K_max={k_max}")
    summary = engine.metrics.summary()
    assert sum(summary["truncations_per_depth"]) > 0, "the forced gates never closed: the test proves nothing"
    assert summary["budget_used"] <= 1.0 + 1e-9


@pytest.mark.slow
def test_echo_identical_with_paper_strict_width(root, prompts, reference, tmp_path):
    """surplus_width='truncated' (width only for gate-truncated requests) is lossless too, and uses less budget."""
    cal_path = forced_calibration(tmp_path / "cal.json", "sparse", 6, 0.05, {2})
    used = {}
    for surplus in ("truncated", "all"):
        settings = EchoSettings(k_max=16, top_k=4, calibration_file=cal_path, surplus_width=surplus)
        engine = HFEngine(root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=6, echo=settings))
        assert_identical(engine, prompts[:20], reference[:20], f"echo surplus_width={surplus}")
        summary = engine.metrics.summary()
        assert 0.0 < summary["truncation_rate"] < 1.0, "the gate must close on some steps and stay open on others"
        used[surplus] = summary["budget_used"]
    assert used["all"] > used["truncated"], used


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "top_k", "k_max", "ddd"),
    [
        ("eagle2", 3, 10, None),  # K_max binds: the pool is reranked hard
        ("eagle2", 4, 40, None),  # a wide rerank over the k + (D - 1) k^2 pool
        ("ddd", 4, 20, DDDSettings(threshold=-3.0, max_depth=8, check_depths=(2, 4, 6))),  # stops on some steps
    ],
)
def test_full_pool_methods_greedy_identical(root, prompts, reference, method, top_k, k_max, ddd):
    """eagle2 (EAGLE-2's full pool) and ddd (its early stop) are lossless; ddd really stops early on some steps."""
    settings = EchoSettings(k_max=k_max, top_k=top_k)
    options = EngineOptions(method=method, max_depth=5, echo=settings, ddd=ddd or DDDSettings())
    engine = HFEngine(root / "target", root / "eagle3", options)
    assert_identical(engine, prompts[:6], reference[:6], f"{method} k={top_k} K_max={k_max}")
    stats = engine.depth_summary()
    if method == "ddd":
        assert engine.max_depth == 8
        assert 2 <= stats["mean_drafted_depth"] < 8, "the DDD rule never (or always) stopped: the test proves nothing"
    else:
        assert stats["mean_drafted_depth"] == 5
    assert stats["u_drafted_depth"] <= stats["u_selected_depth"]


def test_k_max_zero_is_plain_decoding(root, prompts, reference):
    engine = HFEngine(
        root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=4, echo=EchoSettings(k_max=0))
    )
    assert_identical(engine, prompts[:3], reference[:3], "k_max=0")


def test_sampling_runs_and_respects_length(root, prompts):
    engine = HFEngine(
        root / "target",
        root / "eagle3",
        EngineOptions(method="echo", max_depth=5, echo=EchoSettings(k_max=12, warmup_steps=4)),
    )
    for i, p in enumerate(prompts[:4]):
        out = engine.generate(p, MAX_NEW, temperature=0.8, seed=i).token_ids
        assert 1 <= len(out) <= MAX_NEW


def test_calibration_file_written_after_warmup(root, prompts, tmp_path):
    path = tmp_path / "cal.json"
    settings = EchoSettings(k_max=16, warmup_steps=6, min_samples_per_class=1, calibration_file=str(path))
    engine = HFEngine(root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=5, echo=settings))
    for p in prompts[:3]:
        engine.generate(p, MAX_NEW)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 2 and data["max_depth"] == 5 and data["mode"] == "sparse"
    again = HFEngine(root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=5, echo=settings))
    assert again.calibration == engine.calibration


# ---- bad input ---------------------------------------------------------------------------------------------


def test_empty_prompt_is_clear_error(root):
    engine = HFEngine(root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=3))
    with pytest.raises(EngineInputError, match="empty prompt"):
        engine.generate([], 4)


def test_unknown_method_and_bad_depth(root):
    with pytest.raises(EngineInputError, match="method"):
        HFEngine(root / "target", root / "eagle3", EngineOptions(method="medusa"))
    with pytest.raises(EngineInputError, match="max_depth"):
        HFEngine(root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=0))


@pytest.mark.parametrize(
    ("ddd", "field"),
    [
        (DDDSettings(threshold=0.5), "ddd.threshold"),
        (DDDSettings(max_depth=0), "ddd.max_depth"),
        (DDDSettings(max_depth=4, check_depths=(4,)), "ddd.check_depths"),
    ],
)
def test_bad_ddd_settings_name_the_field(root, ddd, field):
    with pytest.raises(EngineInputError, match=field.replace(".", r"\.")) as err:
        HFEngine(root / "target", root / "eagle3", EngineOptions(method="ddd", echo=EchoSettings(k_max=16), ddd=ddd))
    assert "\n" not in str(err.value)


def test_missing_head_is_clear_error(root, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFEngine(root / "target", tmp_path / "no-head", EngineOptions(method="echo"))


def test_head_vocab_mismatch_is_clear_error(root):
    with pytest.raises(ValueError, match="vocab_size .* differs"):
        Eagle3Head.load(root / "eagle3", torch.zeros(100, 256))


def test_corrupt_calibration_file_is_clear_error(root, tmp_path):
    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cal.json"):
        HFEngine(
            root / "target",
            root / "eagle3",
            EngineOptions(method="echo", max_depth=4, echo=EchoSettings(calibration_file=str(bad))),
        )


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"k_max": -1}, "echo.k_max"),
        ({"top_k": 0}, "echo.top_k"),
        ({"delta": 1.5}, "echo.delta"),
        ({"gate_mode": "always"}, "echo.gate_mode"),
        ({"kmax": 3}, "echo.kmax"),
        ({"k_max": True}, "echo.k_max"),
        ({"surplus_width": "some"}, "echo.surplus_width"),
        ({"k_max": "fast"}, "echo.k_max"),
        ({"k_max": "AUTO"}, "echo.k_max"),
        ({"profile_steps": 1}, "echo.profile_steps"),
        ({"probe_interval": -1}, "echo.probe_interval"),
        ({"probe_depth": "deep"}, "echo.probe_depth"),
        ({"depth_switch_margin": -0.5}, "echo.depth_switch_margin"),
        ({"plain_head_rows": "prompt"}, "echo.plain_head_rows"),
        ({"deferred_head_window": -2}, "echo.deferred_head_window"),
        ({"deferred_head_window": "last"}, "echo.deferred_head_window"),
        ({"depth_switch_margin": float("nan")}, "echo.depth_switch_margin"),
    ],
)
def test_bad_config_values_name_the_field(raw, field):
    with pytest.raises(EchoConfigError, match=field.replace(".", r"\.")) as err:
        parse_echo_settings(raw)
    assert "\n" not in str(err.value)


def test_k_max_auto_is_the_default_and_an_integer_stays_a_cap():
    assert parse_echo_settings({}).k_max == "auto"
    assert parse_echo_settings({"k_max": "auto"}).k_max == "auto"
    assert parse_echo_settings({"k_max": 12.0}).k_max == 12
    with pytest.raises(EchoConfigError, match="k_max must be 'auto' or an integer >= 0; got 'fast'"):
        parse_echo_settings({"k_max": "fast"})


@pytest.mark.parametrize("method", ["eagle2", "ddd"])
def test_eagle2_needs_an_integer_budget(root, method):
    with pytest.raises(EngineInputError, match=f"{method}.*integer k_max"):
        HFEngine(root / "target", root / "eagle3", EngineOptions(method=method, echo=EchoSettings()))


@pytest.mark.slow
def test_echo_auto_greedy_identical_and_profiles(root, prompts, reference, tmp_path):
    """k_max 'auto' in the HF engine: warm-up, profile, then the chooser; identical to ar; the profile is saved
    next to the calibration and a second engine loads it (no profile steps)."""
    cal = tmp_path / "cal.json"
    settings = EchoSettings(warmup_steps=8, min_samples_per_class=1, profile_steps=6, calibration_file=str(cal))
    engine = HFEngine(root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=5, echo=settings))
    assert engine.budget is not None
    sweeps: list[bool] = []  # warm-up and profile steps reach the plan's seed (full: warm-up)
    observe_sweep = engine.budget.observe_sweep
    engine.budget.observe_sweep = lambda *a, full: (sweeps.append(full), observe_sweep(*a, full=full))[1]
    assert_identical(engine, prompts[:12], reference[:12], "echo auto")
    assert engine.budget.phase(engine.warming_up) == "auto"
    # Every warm-up step; the profile steps that drafted (its depth cycle has plain steps).
    assert sweeps.count(True) == settings.warmup_steps and 0 < sweeps.count(False) < settings.profile_steps
    assert (tmp_path / "cal.budget.json").is_file()
    summary = engine.metrics.summary()
    assert summary["mean_draft_depth"] > 0 and summary["predicted_accepted_per_step"] >= 0
    again = HFEngine(root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=5, echo=settings))
    assert again.budget is not None and again.budget.source.startswith("file ")
    assert again.budget.phase(again.warming_up) == "auto"  # calibration and cost model loaded: no warm-up
    assert_identical(again, prompts[:4], reference[:4], "echo auto, loaded profile")


# ---- sampling: the engine's first speculative token is distributed exactly as the target's ------------------


def chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square; cells with expected count < 5 pooled into one. Survival via gammaincc."""
    n = observed.sum()
    expected = expected_p.double() * n
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle2", "echo"])
def test_sampling_first_spec_token_matches_target(root, prompts, tmp_path, method):
    import copy

    temperature, draws = 1.0, 2500
    settings = EchoSettings(
        k_max=10, top_k=4, calibration_file=forced_calibration(tmp_path / "cal.json", "sparse", 4, 0.5, {1, 2})
    )
    engine = HFEngine(root / "target", root / "eagle3", EngineOptions(method=method, max_depth=4, echo=settings))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        pending = engine.prefill(prompts[0], 0.0, gen)
        # The target's exact next-token distribution after the prompt + pending token.
        ids = torch.tensor([prompts[0] + [pending]])
        target_p = torch.softmax(engine.target.model(input_ids=ids).logits[0, -1].float() / temperature, -1)
    target_state = copy.deepcopy(engine.target.cache)
    drafter_state = {k: copy.deepcopy(v) for k, v in vars(engine.drafter).items() if k != "head"}
    counts = torch.zeros_like(target_p, dtype=torch.long)
    for i in range(draws):
        engine.target.cache = copy.deepcopy(target_state)
        for k, v in drafter_state.items():
            setattr(engine.drafter, k, v)
        first = engine.step(pending, temperature, torch.Generator().manual_seed(1000 + i))[0]
        counts[first] += 1
    assert chi2_pvalue(counts, target_p) > 1e-3


def test_engines_sharing_weights_stay_identical(root, prompts, reference):
    """The benchmark's engines share one copy of the weights (and run prompt by prompt): still lossless."""
    settings = EchoSettings(k_max=12, top_k=3, warmup_steps=4, min_samples_per_class=1)
    echo = HFEngine(root / "target", root / "eagle3", EngineOptions(method="echo", max_depth=4, echo=settings))
    eagle2 = HFEngine(
        root / "target",
        root / "eagle3",
        EngineOptions(method="eagle2", max_depth=4, echo=settings),
        share_models_with=echo,
    )
    ar = HFEngine(root / "target", None, EngineOptions(method="ar"), share_models_with=echo)
    assert eagle2.target is echo.target and ar.target is echo.target and eagle2.drafter.head is echo.drafter.head
    for i in range(6):
        for engine in (echo, ar, eagle2):
            assert engine.generate(prompts[i], MAX_NEW).token_ids == reference[i]
