"""The step-cost model of the time-aware budget: fits on synthetic timings, robustness, transport, the profile file."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from pathlib import Path

import pytest
import torch

from echo_vllm.core.acceptance import AcceptanceModel
from echo_vllm.core.budget_profile import default_profile_path, load_profile, save_profile
from echo_vllm.core.cost_model import CostModel, StepSample, StepSamples, fit_cost_model, vector_length
from echo_vllm.errors import CalibrationError


def _samples(rest_fn, draft_fn, n=300, seed=0, noise=0.05, outliers=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        batch = rng.choice([1, 4, 8, 16, 32])
        tokens = batch + rng.randint(0, 4 * batch)
        depth = rng.randint(0, 4)
        rest = rest_fn(tokens, batch) * rng.uniform(1 - noise, 1 + noise)
        if i < outliers:
            rest *= 20  # an idle gap: the engine waited for work
        out.append(StepSample(tokens, batch, depth, rest, draft_fn(batch, depth) * rng.uniform(1 - noise, 1 + noise)))
    return out


def _draft(batch, depth):
    return 0.001 + 0.00005 * batch + depth * (0.0008 + 0.00002 * batch)


def _assert_term_travels(tmp_path, model: CostModel, field: str, terms_after: int) -> None:
    """A cost-model term's transport: the TP vector and the profile file carry it, and a vector or a profile
    written before the term (the vector without its last `terms_after` floats, the file without the key) loads
    with the term at 0."""
    zero = _zero_like(getattr(model, field))
    assert CostModel.from_vector(model.to_vector()) == model
    assert getattr(CostModel.from_vector(model.to_vector()[:-terms_after]), field) == zero
    path = tmp_path / "p.budget.json"
    save_profile(path, model, AcceptanceModel(4))
    assert load_profile(path, 4)[0] == model
    raw = json.loads(path.read_text())
    del raw["cost_model"][field]
    path.write_text(json.dumps(raw))
    assert getattr(load_profile(path, 4)[0], field) == zero


def _zero_like(value: float | tuple[float, ...]) -> float | tuple[float, ...]:
    return tuple(0.0 for _ in value) if isinstance(value, tuple) else 0.0


def test_linear_cost_is_recovered():
    model = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n, _draft))
    assert model is not None and model.fit_error < 0.05
    slope = (model.step_seconds(100, 8, 2) - model.step_seconds(40, 8, 2)) / 60
    assert slope == pytest.approx(0.0003, rel=0.1)
    assert model.draft_seconds(8, 3) == pytest.approx(_draft(8, 3), rel=0.1)


def test_flat_then_linear_keeps_the_knee_and_never_falls():
    model = fit_cost_model(_samples(lambda n, b: 0.005 + 0.0004 * max(0, n - 32), _draft, noise=0.02))
    assert model is not None
    flat = [model.step_seconds(n, 8, 0) for n in (8, 16, 32)]
    assert max(flat) - min(flat) < 0.0015  # flat below the knee (within noise)
    assert model.step_seconds(128, 8, 0) - model.step_seconds(64, 8, 0) == pytest.approx(64 * 0.0004, rel=0.15)
    curve = list(model.rest_s)
    assert curve == sorted(curve)  # time never falls as the step grows


def _one_batch_profile(batch, rest_fn, n=48, seed=3, noise=0.05):
    """A start-up profile at one batch size: plain steps and steps verifying up to 4 drafts per request."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = batch + rng.choice([0, 1, 2, 3, 4]) * batch
        depth = rng.randint(0, 4)
        rest = rest_fn(tokens, batch) * rng.uniform(1 - noise, 1 + noise)
        out.append(StepSample(tokens, batch, depth, rest, _draft(batch, depth), verified=tokens - batch))
    return out


def test_a_linear_curve_profiled_at_one_batch_extrapolates_linearly_to_larger_steps():
    # A CPU-like step cost, linear in the step's tokens, profiled at batch 32 only (N = 32..160): a larger batch
    # later verifies steps of 256-640 tokens, beyond every sample. The curve must continue the measured line
    # there. (The previous smoothness prior, second differences in knot index, is zero for a curve linear in
    # log N: it extrapolated with equal increments per doubling and priced a 640-token step at 69 % of it, so
    # verifying at high load looked cheaper than it is.)
    def truth(n, b):
        return 0.01 + 0.0004 * n

    model = fit_cost_model(_one_batch_profile(32, truth))
    assert model is not None
    for tokens in (64, 160):  # inside the profile
        assert model.rest_at(tokens, 32) == pytest.approx(truth(tokens, 32), rel=0.05)
    for tokens in (256, 400, 640):  # beyond it
        assert model.rest_at(tokens, 128) == pytest.approx(truth(tokens, 128), rel=0.08)


def test_tree_steps_extra_cost_is_recovered_and_travels():
    base = _samples(lambda n, b: 0.002 + 0.0003 * n, _draft, noise=0.02)
    rng = random.Random(3)
    trees = []
    for s in base[:150]:  # half the steps verify 1..12 nodes off the spine: + 1 ms + 0.2 ms per node
        w = rng.randint(1, 12)
        trees.append(StepSample(s.num_tokens, s.batch, s.draft_depth, s.rest_s + 0.001 + 0.0002 * w, s.draft_s, w))
    model = fit_cost_model(trees + base[150:])
    assert model is not None and model.fit_error < 0.05
    t0, t1 = model.tree_terms
    assert t0 == pytest.approx(0.001, rel=0.25) and t1 == pytest.approx(0.0002, rel=0.25)
    assert float(model.tree_seconds(torch.tensor(0.0))) == 0.0
    assert float(model.tree_seconds(torch.tensor(5.0))) == pytest.approx(t0 + 5 * t1)
    assert CostModel.from_vector(model.to_vector()) == model
    chains = fit_cost_model(base)
    assert chains is not None and chains.tree_terms == pytest.approx((0.0, 0.0), abs=1e-4)


def _tree_draft_samples(p0: float, p1: float, n=300, seed=11, noise=0.02):
    """A tree engine's steps: a third draft trees (their proposer pays p0 + p1 B d more), the rest chains, over
    batches 1-16 and depths 0-4 (a depth-0 step drafts nothing, trees or not)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        batch, depth = rng.choice([1, 4, 8, 16]), rng.randint(0, 4)
        trees = i % 3 == 0
        tokens = batch * (1 + depth)
        draft = _draft_first_pass(batch, depth) + (p0 + p1 * batch * depth if trees and depth else 0.0)
        rest = 0.002 + 0.0003 * tokens
        out.append(
            StepSample(
                tokens,
                batch,
                depth,
                rest * rng.uniform(1 - noise, 1 + noise),
                draft * rng.uniform(1 - noise, 1 + noise),
                tree_drafted=trees,
            )  # fmt: skip
        )
    return out


def test_tree_drafting_is_priced_apart_from_chain_drafting_and_travels(tmp_path):
    # The testbed at batch 8: a tree-drafting step's proposer takes ~1.5 ms more than a chain step's. Fitted with
    # its own term, chain drafting keeps its price (without it the extra spreads over every step's draft terms).
    p0, p1 = 0.0005, 0.00006
    samples = _tree_draft_samples(p0, p1)
    model = fit_cost_model(samples)
    assert model is not None and model.fit_error < 0.05
    assert model.tree_draft_terms == pytest.approx((p0, p1), rel=0.3)
    for batch in (1, 8, 16):
        for depth in range(5):
            chain = _draft_first_pass(batch, depth)
            assert model.draft_seconds(batch, depth) == pytest.approx(chain, rel=0.08)
            tree = chain + (p0 + p1 * batch * depth if depth else 0.0)
            assert model.draft_seconds(batch, depth, trees=True) == pytest.approx(tree, rel=0.08)
    assert model.tree_draft_at(8, 0) == 0.0
    blind = fit_cost_model([dataclasses.replace(s, tree_drafted=False) for s in samples])
    assert blind is not None and blind.tree_draft_terms == (0.0, 0.0)
    # Blind to the shape, a tree-drafting step is priced as a chain step (+ a share of the trees' extra, which the
    # robust fit mostly discounts as outliers): the selection then buys width as if its drafting were free.
    tree_truth = _draft_first_pass(8, 2) + p0 + p1 * 16
    assert blind.draft_seconds(8, 2, trees=True) < 0.8 * tree_truth
    chains = fit_cost_model([s for s in samples if not s.tree_drafted])
    assert chains is not None and chains.tree_draft_terms == pytest.approx((0.0, 0.0), abs=1e-6)
    # Transport: the vector and the profile file; older vectors and profiles load without the term.
    _assert_term_travels(tmp_path, model, "tree_draft_terms", terms_after=5)


def _draft_first_pass(batch, depth):
    """The testbed's shape: the first draft pass (it also feeds the last step's accepted tokens) costs ~2.5x a
    chained pass."""
    return 0.0009 + 0.00002 * batch + (0.0009 + 0.00004 * batch if depth >= 1 else 0.0) + depth * 0.0006


def test_first_pass_cost_is_recovered_and_deep_drafts_are_not_overpriced():
    model = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n, _draft_first_pass, noise=0.02))
    assert model is not None and model.fit_error < 0.05
    for batch in (1, 8, 32):
        for depth in range(5):
            assert model.draft_seconds(batch, depth) == pytest.approx(_draft_first_pass(batch, depth), rel=0.08)
    f, g = model.first_pass_terms
    assert f == pytest.approx(0.0009, rel=0.25) and g == pytest.approx(0.00004, rel=0.3)
    assert CostModel.from_vector(model.to_vector()) == model
    # The marginal depth costs a chained pass, not the first pass's share (the linear model's bias to shallow).
    assert model.draft_seconds(1, 4) - model.draft_seconds(1, 3) == pytest.approx(0.0006, rel=0.15)
    # Profiles written before the first-pass terms load as the linear model (zeros); the verify terms came after.
    old_vector = model.to_vector()[:-11]  # less first-pass (2), verify (2), h, k, tree-draft (2), loop (2), r
    assert CostModel.from_vector(old_vector).first_pass_terms == (0.0, 0.0)


def _draft_with_loop(batch, depth):
    """The s32 testbed shape: entering the chained loop (depth >= 2) costs extra on top of each chained pass (batch
    64: depths 1-4 at 12.1 / 22.5 / 28.9 / 35.5 ms)."""
    return _draft_first_pass(batch, depth) + (0.0004 + 0.00006 * batch if depth >= 2 else 0.0)


def test_the_chained_loops_entry_is_priced_apart_from_the_per_depth_slope(tmp_path):
    samples = _samples(lambda n, b: 0.002 + 0.0003 * n, _draft_with_loop, noise=0.02)
    model = fit_cost_model(samples)
    assert model is not None and model.fit_error < 0.05
    for batch in (1, 8, 32):
        for depth in range(5):
            assert model.draft_seconds(batch, depth) == pytest.approx(_draft_with_loop(batch, depth), rel=0.08)
    l0, l1 = model.loop_terms
    assert l0 == pytest.approx(0.0004, rel=0.35) and l1 == pytest.approx(0.00006, rel=0.25)
    # Depth 1 -> 2 costs the loop's entry and a pass; 3 -> 4 a pass only.
    step_12 = model.draft_seconds(32, 2) - model.draft_seconds(32, 1)
    step_34 = model.draft_seconds(32, 4) - model.draft_seconds(32, 3)
    assert step_12 == pytest.approx(0.0006 + 0.0004 + 0.00006 * 32, rel=0.1) and step_34 == pytest.approx(
        0.0006, rel=0.15
    )
    # Without the loop's terms the per-depth line prices depth 2 below its steps (the bias the terms remove).
    linear = dataclasses.replace(model, loop_terms=(0.0, 0.0))
    assert linear.draft_seconds(32, 2) < 0.95 * _draft_with_loop(32, 2)
    _assert_term_travels(tmp_path, model, "loop_terms", terms_after=3)
    # Steps that never draft past depth 1 leave the terms at 0.
    shallow = fit_cost_model([x for x in samples if x.draft_depth <= 1])
    assert shallow is not None and shallow.loop_terms == (0.0, 0.0)


def _joining_samples(r: float, n=400, seed=5, noise=0.02):
    """Decode steps (one row per request plus the verified drafts) and, one in five, steps where requests join: their
    prompt chunks add P rows to the forward, which the draft head's first pass runs too (r seconds per row)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        batch = rng.choice([4, 8, 16, 32])
        depth = rng.randint(0, 4)
        verified = rng.randint(0, 4 * batch)
        prompt = rng.randint(32, 256) if rng.random() < 0.2 else 0
        tokens = batch + verified + prompt
        draft = _draft_with_loop(batch, depth) + (r * prompt if depth >= 1 else 0.0)
        rest = 0.002 + 0.0003 * tokens
        u = rng.uniform
        out.append(StepSample(tokens, batch, depth, rest * u(1 - noise, 1 + noise), draft * u(1 - noise, 1 + noise),
                              verified=verified))  # fmt: skip
    return out


def test_joining_requests_prompt_rows_are_priced_apart_from_decode_drafting(tmp_path):
    r = 0.00002  # the s32 logs' joining steps: ~0.02-0.03 ms per prompt row
    samples = _joining_samples(r)
    model = fit_cost_model(samples)
    assert model is not None and model.fit_error < 0.05
    assert model.prompt_row_s == pytest.approx(r, rel=0.15)
    for batch in (4, 16, 32):  # decode drafting (what the budget prices) as if no request ever joined
        for depth in range(5):
            assert model.draft_seconds(batch, depth) == pytest.approx(_draft_with_loop(batch, depth), rel=0.08)
    # Without the column (every row counted as a verified one) the joining steps' drafting is priced as a decode
    # step's: their rows' cost unexplained, ~r P short.
    blind = fit_cost_model([dataclasses.replace(x, verified=x.num_tokens - x.batch) for x in samples])
    assert blind is not None and blind.prompt_row_s == 0.0
    joining = [x for x in samples if x.draft_depth >= 1 and x.prompt_rows > 0]
    short = [(x.draft_s - blind.draft_seconds(x.batch, x.draft_depth)) / x.prompt_rows for x in joining]
    priced = [
        (x.draft_s - model.draft_seconds(x.batch, x.draft_depth) - model.prompt_row_s * x.prompt_rows) / x.prompt_rows
        for x in joining
    ]
    assert statistics.median(short) > 0.7 * r and abs(statistics.median(priced)) < 0.1 * r
    # Plain steps (depth 0) run no first pass now (their rows are deferred or skipped): no prompt-row charge.
    plain_only = fit_cost_model([x for x in samples if x.draft_depth == 0])
    assert plain_only is not None and plain_only.prompt_row_s == 0.0
    # Transport: the vector and the profile file; older vectors and profiles load without the term.
    _assert_term_travels(tmp_path, model, "prompt_row_s", terms_after=1)


def test_prompt_rows_the_head_left_out_are_not_prompt_rows_of_the_sample():
    # 64 decode rows, 16 verified drafts, 2 tree rows and 300 prompt rows, of which the head ran 8 (window 4, two
    # joining requests): the drafting term prices the 8.
    whole = StepSample(382, 64, 2, 0.05, 0.01, width=2, verified=16)
    assert whole.prompt_rows == 300
    assert dataclasses.replace(whole, head_free=292).prompt_rows == 8


def _deferring_samples(h: float, n=400, seed=3, noise=0.02):
    """A run with defer_plain_head: a plain step (depth 0) skips the head's first pass over its B rows, and the
    next drafting step's first pass carries them (merged = the rows of the plain steps since the last drafting
    step), at h seconds per row."""
    rng = random.Random(seed)
    out, backlog = [], 0
    for _ in range(n):
        batch = rng.choice([4, 8, 16, 32])
        depth = 0 if rng.random() < 0.4 else rng.randint(1, 4)
        tokens = batch + (0 if depth == 0 else rng.randint(0, depth * batch))
        merged = 0
        if depth == 0:
            backlog += batch
        else:
            merged, backlog = backlog, 0
        draft = _draft_first_pass(batch, depth) + h * merged
        rest = 0.002 + 0.0003 * tokens
        u = rng.uniform
        out.append(StepSample(tokens, batch, depth, rest * u(1 - noise, 1 + noise), draft * u(1 - noise, 1 + noise),
                              merged=merged))  # fmt: skip
    return out


def test_deferred_head_rows_are_priced_per_row_and_charged_to_plain_steps():
    """The backlog a plain step defers is fitted as its own term (h per merged row), so that the first-pass terms
    keep their value and a plain step is priced with the h B its rows cost later; without the column the backlog
    inflated the first-pass terms (every drafting step looked dearer, plain decoding free of head work)."""
    h = 0.00008  # the first pass's per-row cost: 2x g of _draft_first_pass
    model = fit_cost_model(_deferring_samples(h))
    assert model is not None and model.fit_error < 0.05
    assert model.deferred_row_s == pytest.approx(h, rel=0.15)
    f, g = model.first_pass_terms
    assert f == pytest.approx(0.0009, rel=0.3) and g == pytest.approx(0.00004, rel=0.3)
    assert model.plain_head_seconds(16) == pytest.approx(16 * h, rel=0.15)
    assert CostModel.from_vector(model.to_vector()) == model
    # Without deferral (no merged rows) the term stays 0: plain steps owe nothing.
    plain_model = fit_cost_model([dataclasses.replace(x, merged=0, draft_s=_draft_first_pass(x.batch, x.draft_depth))
                                  for x in _deferring_samples(h)])  # fmt: skip
    assert plain_model is not None and plain_model.deferred_row_s == pytest.approx(0.0, abs=1e-6)


def _verifying_samples(n=400, seed=5, noise=0.03):
    """Plain steps (N = B, nothing verified) and steps verifying K >= 1 drafts, which pay a jump of
    3 ms + 0.1 ms per request over the curve (the testbed's shape: multi-token queries, the rejection sampler)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        batch = rng.choice([4, 8, 16, 32])
        verified = 0 if i % 2 else rng.randint(1, 4 * batch)
        tokens = batch + verified
        rest = 0.004 + 0.0002 * tokens + (0.003 + 0.0001 * batch if verified else 0.0)
        depth = rng.randint(0, 4)
        sample = StepSample(
            tokens, batch, depth, rest * rng.uniform(1 - noise, 1 + noise), _draft(batch, depth), verified=verified
        )
        out.append(sample)
    return out


def test_the_jump_of_verifying_at_all_is_recovered_and_small_budgets_are_not_underpriced():
    model = fit_cost_model(_verifying_samples())
    assert model is not None and model.fit_error < 0.05
    v0, v1 = model.verify_terms
    assert v0 == pytest.approx(0.003, rel=0.25) and v1 == pytest.approx(0.0001, rel=0.3)
    for batch in (8, 32):
        plain = model.step_seconds(batch, batch, 0)
        one = model.step_seconds(batch + 1, batch, 0, verified=1)
        assert plain - model.draft_seconds(batch, 0) == pytest.approx(0.004 + 0.0002 * batch, rel=0.08)
        assert one - plain == pytest.approx(0.003 + 0.0001 * batch + 0.0002, rel=0.15)  # the jump, not 1/B of it
    assert model.verify_at(8, 0) == 0.0
    assert CostModel.from_vector(model.to_vector()) == model
    # Without the verify terms the curve spreads the jump over N = B..2B: one draft looks almost free.
    flat = dataclasses.replace(model, verify_terms=(0.0, 0.0))
    assert flat.step_seconds(9, 8, 0, verified=1) - flat.step_seconds(8, 8, 0) < 0.001
    # Vectors and profiles written before the verify terms load with zeros.
    assert CostModel.from_vector(model.to_vector()[:-9]).verify_terms == (
        0.0,
        0.0,
    )  # less verify, h, k, tree-draft, loop, r


def _tree_engine_profile(seed: int) -> list[StepSample]:
    """A tree engine's start-up profile at batch 4 (the cycle of `profile_step`, each depth held 3 steps, 30 steps,
    the `WidthSchedule` rule for which steps draft trees): a verifying step pays a 0.3 ms jump, a step with tree
    rows 3 ms + 0.1 ms per row more (listing, fix-up, compaction)."""
    from echo_vllm.core.time_budget import profile_step
    from echo_vllm.core.width_schedule import WidthSchedule

    rng = random.Random(seed)
    schedule = WidthSchedule()
    out = []
    for index in range(30):
        depth, fraction = profile_step(index, 4)
        trees = schedule.drafts_trees("profile", False, index)
        verified = round(4 * depth * fraction) if depth else 0
        width = round(3 * verified * fraction) if trees and verified else 0  # siblings: 3 per spine node at most
        tokens = 4 + verified + width
        rest = 0.008 + 0.0002 * tokens + (0.0003 if verified else 0.0) + (0.003 + 0.0001 * width if width else 0.0)
        sample = StepSample(tokens, 4, depth, rest * rng.uniform(0.97, 1.03), _draft(4, depth), width, verified + width)
        out.append(sample)
    return out


def test_a_profile_of_chain_and_tree_steps_prices_chain_steps_as_measured():
    """With trees on every verifying profile step, "verifies something" and "has tree rows" are nearly one column
    and the tree steps' fixed cost can land in the jump of verifying at all, which every chain step then pays (the
    tree engine on the testbed: a batch-4 chain step priced 13 % above its measured time, and the plan decoded
    plain). With the profile's chain blocks a chain step and a tree step are each priced as measured. (This clean
    synthetic profile does not make the trees-only fit fail - its few fraction-cut steps without siblings
    separate the columns; the recorded run's noise and context term did.)"""

    def chain_step(model, verified):
        return model.rest_at(4 + verified, 4) + model.verify_at(4, verified)

    def truth(verified):
        return 0.008 + 0.0002 * (4 + verified) + 0.0003

    for seed in range(3):
        mixed = fit_cost_model(_tree_engine_profile(seed))
        assert mixed is not None
        for verified in (4, 8, 12, 16):
            assert chain_step(mixed, verified) == pytest.approx(truth(verified), rel=0.05), (seed, verified)
        tree = chain_step(mixed, 16 + 12) + mixed.tree_at(12)
        assert tree == pytest.approx(truth(28) + 0.003 + 0.0012, rel=0.05)


@pytest.mark.parametrize("batch", [1, 4])
def test_one_batch_size_a_flat_curve_and_a_small_jump_price_a_verifying_step_as_measured(batch):
    """One batch size (a low-load server): plain steps have N = B, verifying steps N > B, so the verify jump and
    the knots above B explain the same steps; the fit must still price both kinds of step as measured. (Clean
    synthetic data like this did not make the old clamped fit fail; the recorded run below does.)"""
    rng = random.Random(11 + batch)
    samples = []
    for i in range(400):
        verified = 0 if i % 3 == 0 else rng.randint(1, 4 * batch)
        rest = 0.0085 + 0.00002 * (batch + verified) + (0.0004 if verified else 0.0)  # the testbed: ~flat, small jump
        depth = 0 if verified == 0 else 4
        samples.append(
            StepSample(
                batch + verified, batch, depth, rest * rng.uniform(0.85, 1.15), _draft(batch, depth), verified=verified
            )
        )
    model = fit_cost_model(samples)
    assert model is not None
    for verified in (1, 2 * batch, 4 * batch):
        priced = model.rest_at(batch + verified, batch) + model.verify_at(batch, verified)
        truth = 0.0085 + 0.00002 * (batch + verified) + 0.0004
        assert priced == pytest.approx(truth, rel=0.06), verified
    assert model.rest_at(batch, batch) == pytest.approx(0.0085 + 0.00002 * batch, rel=0.06)
    assert all(b >= a for a, b in zip(model.rest_s, model.rest_s[1:]))


def test_a_recorded_batch_1_run_prices_verifying_steps_as_they_were_measured():
    """The recorded run that showed the bug (tests/assets/cost_samples_testbed_batch1.json): its unconstrained fit
    had knots 8.3 / 6.2 / 4.1 ms and a 4.9 ms verify jump, clamped to a flat 8.3 ms curve + 4.9 ms, so a step
    verifying 4 drafts was priced ~13 ms where it measured ~9 ms."""
    doc = json.loads((Path(__file__).parent / "assets" / "cost_samples_testbed_batch1.json").read_text())
    samples = [StepSample(int(n), int(b), int(d), r, ds, verified=int(v)) for n, b, d, r, ds, v in doc["samples"]]
    model = fit_cost_model(samples)
    assert model is not None
    for tokens in (1, 5):
        measured = statistics.median(s.rest_s for s in samples if s.num_tokens == tokens)
        priced = model.rest_at(tokens, 1) + model.verify_at(1, tokens - 1)
        assert priced == pytest.approx(measured, rel=0.12), tokens


def test_idle_gaps_do_not_move_the_fit():
    clean = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n, _draft))
    dirty = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n, _draft, outliers=15))
    assert clean is not None and dirty is not None
    for tokens in (8, 40, 120):
        assert dirty.step_seconds(tokens, 8, 2) == pytest.approx(clean.step_seconds(tokens, 8, 2), rel=0.1)


def test_too_few_samples_and_bad_samples():
    assert fit_cost_model([StepSample(4, 1, 1, 0.01, 0.001)] * 3) is None
    samples = StepSamples(recent=2)
    samples.add(StepSample(4, 1, 1, float("nan"), 0.001))
    samples.add(StepSample(0, 1, 1, 0.01, 0.001))
    assert len(samples) == 0
    for _ in range(3):
        samples.add(StepSample(4, 1, 1, 0.01, 0.001))
    samples.add(StepSample(4, 1, 1, 0.01, 0.001), profile=True)
    assert len(samples.recent) == 2 and len(samples.profile) == 1  # the ring keeps the recent ones only


def test_vector_round_trip_and_validation():
    model = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n, _draft))
    assert model is not None
    vector = model.to_vector()
    assert len(vector) == vector_length(len(model.knots))
    assert CostModel.from_vector(vector + [0.0] * 7) == model  # padding past the end is ignored
    with pytest.raises(ValueError, match="non-decreasing|>= 0|increasing"):
        CostModel((1.0, 1.0), (0.1, 0.2), 0.0, (0.0, 0.0, 0.0, 0.0), 0.0, 1)
    with pytest.raises(ValueError, match=">= 0"):
        CostModel((1.0, 2.0), (0.1, -0.2), 0.0, (0.0, 0.0, 0.0, 0.0), 0.0, 1)


def test_profile_file_round_trip_and_default_path(tmp_path):
    model = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n, _draft))
    assert model is not None
    acceptance = AcceptanceModel(4)
    acceptance.record(
        torch.tensor([[0.9, 0.5, 0.2, 0.1]]),
        torch.tensor([[True, True, False, False]]),
        torch.ones(1, 4, dtype=torch.bool),
    )
    path = tmp_path / "p.json"
    save_profile(path, model, acceptance)
    cost, acc = load_profile(path, 4)
    assert cost == model
    assert torch.equal(acc.seen, acceptance.seen) and torch.equal(acc.accepted, acceptance.accepted)
    # A profile written before the first-pass terms existed: the linear draft model (zeros).
    raw = json.loads(path.read_text())
    del raw["cost_model"]["first_pass_terms"]
    del raw["cost_model"]["verify_terms"]
    path.write_text(json.dumps(raw))
    assert load_profile(path, 4)[0].first_pass_terms == (0.0, 0.0)
    assert load_profile(path, 4)[0].verify_terms == (0.0, 0.0)
    assert default_profile_path(str(tmp_path / "cal.json")) == tmp_path / "cal.budget.json"
    assert default_profile_path(None) is None


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda text: text[:-20], "not valid JSON"),
        (lambda text: json.dumps({**json.loads(text), "max_depth": 6}), "field 'max_depth' is 6"),
        (lambda text: json.dumps({**json.loads(text), "kind": "calibration"}), "field 'kind'"),
        (lambda text: text.replace('"per_request_s": ', '"per_request_s": -1e9 + '), "not valid JSON"),
        (
            lambda text: json.dumps(
                {**json.loads(text), "cost_model": {**json.loads(text)["cost_model"], "knots": [1.0]}}
            ),
            "field 'cost_model.knots'",
        ),
    ],
)
def test_corrupt_profile_is_one_clear_line(tmp_path, mutate, needle):
    model = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n, _draft))
    assert model is not None
    path = tmp_path / "p.json"
    save_profile(path, model, AcceptanceModel(4))
    path.write_text(mutate(path.read_text()))
    with pytest.raises(CalibrationError) as err:
        load_profile(path, 4)
    message = str(err.value)
    assert needle in message and str(path) in message and "delete it" in message and "\n" not in message


def test_host_evaluation_matches_the_tensor_curve():
    model = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n + 0.0001 * b, _draft, noise=0.02))
    assert model is not None
    model = dataclasses.replace(model, tree_terms=(0.001, 0.0002))
    for tokens in (0.5, 1, 3, 7, 64, 100, 5000, 10**6):  # below the first knot, inside, beyond the last
        for batch in (1, 8):
            want = float(model.rest_seconds(torch.tensor([float(tokens)]), batch)[0])
            assert model.rest_at(tokens, batch) == pytest.approx(want, rel=1e-12, abs=1e-15)
    for width in (0, 1, 9):
        assert model.tree_at(width) == pytest.approx(float(model.tree_seconds(torch.tensor(float(width)))))


def _context_samples(k: float, n=400, seed=7, noise=0.03):
    """Batch-64 decode steps at depths 0-3 whose requests' cached context wanders over 4k-20k tokens (requests
    grow, finish and are replaced): rest = a curve in N + k x context."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        depth = rng.randint(0, 3)
        tokens = 64 * (1 + depth)
        context = rng.randint(4000, 20000)
        rest = (0.030 + 0.0002 * tokens + (0.01 if depth else 0.0) + k * context) * rng.uniform(1 - noise, 1 + noise)
        sample = StepSample(tokens, 64, depth, rest, _draft(64, depth), verified=tokens - 64, context=context)
        out.append(sample)
    return out


def test_the_context_term_is_recovered_and_prices_steps_at_their_own_context():
    # Samples from long contexts must not price a step at a short one: the term carries the difference.
    k = 2.7e-6  # the testbed's CPU at batch 64: ~2.7 ms per 1,000 cached tokens
    model = fit_cost_model(_context_samples(k))
    assert model is not None and model.context_s == pytest.approx(k, rel=0.1)
    for depth in range(4):
        tokens = 64 * (1 + depth)
        truth = 0.030 + 0.0002 * tokens + (0.01 if depth else 0.0) + k * 6000
        measured_shape = model.rest_at(tokens, 64, 6000) + model.verify_at(64, tokens - 64)
        assert measured_shape == pytest.approx(truth, rel=0.05)
    # Without the term the same samples price a short-context step at the samples' mean context: far too high.
    blind = fit_cost_model([dataclasses.replace(s, context=0) for s in _context_samples(k)])
    assert blind is not None and blind.context_s == 0.0
    assert blind.rest_at(128, 64) + blind.verify_at(64, 64) > 1.15 * (
        model.rest_at(128, 64, 6000) + model.verify_at(64, 64)
    )


def test_samples_without_a_context_fit_no_context_term():
    model = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n, _draft))
    assert model is not None and model.context_s == 0.0
    assert model.rest_at(40, 8, 10_000) == model.rest_at(40, 8)


def test_a_context_model_travels_and_older_vectors_and_profiles_load_without_it(tmp_path):
    model = fit_cost_model(_context_samples(2.7e-6))
    assert model is not None
    _assert_term_travels(tmp_path, model, "context_s", terms_after=6)


def test_model_change_is_the_median_relative_move_of_steady_step_prices():
    from echo_vllm.core.cost_model import model_change

    model = fit_cost_model(_samples(lambda n, b: 0.002 + 0.0003 * n, _draft))
    assert model is not None
    assert model_change(model, model, 4) == 0.0
    slower = dataclasses.replace(
        model,
        rest_s=tuple(1.1 * v for v in model.rest_s),
        per_request_s=1.1 * model.per_request_s,
        draft_terms=tuple(1.1 * v for v in model.draft_terms),  # type: ignore[arg-type]
        first_pass_terms=tuple(1.1 * v for v in model.first_pass_terms),  # type: ignore[arg-type]
        verify_terms=tuple(1.1 * v for v in model.verify_terms),  # type: ignore[arg-type]
        loop_terms=tuple(1.1 * v for v in model.loop_terms),  # type: ignore[arg-type]
    )
    assert model_change(model, slower, 4) == pytest.approx(0.1 / 1.1, rel=1e-9)  # every price 10 % up


def test_refits_space_out_while_the_fit_is_stable_and_close_up_when_it_moves():
    """The time-aware budget refits REFIT_INTERVAL steps apart, doubling the gap (up to MAX_REFIT_INTERVAL) after
    each refit that found the same curve, back to REFIT_INTERVAL after one that moved it."""
    from echo_vllm.core.time_budget import MAX_REFIT_INTERVAL, REFIT_INTERVAL, TimeAwareBudget

    budget = TimeAwareBudget(4, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    samples = _samples(lambda n, b: 0.002 + 0.0003 * n, _draft, n=400, noise=0.0)
    for sample in samples:
        budget.samples.add(sample)
    budget.cost_model = fit_cost_model(samples)
    refits = []
    original = budget.refit

    def counting_refit(*, first):
        refits.append(budget.steps_seen)
        original(first=first)

    budget.refit = counting_refit  # type: ignore[method-assign]
    steps = REFIT_INTERVAL * (1 + 2 + 4 + 8 + 8)
    for _ in range(steps):
        budget.plan(8, 1, False, warmup_cap=32)
    gaps = [b - a for a, b in zip([0, *refits], refits)]
    assert gaps[:5] == [64, 128, 256, 512, 512] and MAX_REFIT_INTERVAL == 512
    # The step cost doubles: the next refit moves the curve, and the gap is REFIT_INTERVAL again.
    for sample in _samples(lambda n, b: 0.004 + 0.0006 * n, _draft, n=512, noise=0.0, seed=1):
        budget.samples.add(sample)
    until = refits[-1] + budget.refit_interval
    while budget.steps_seen < until:
        budget.plan(8, 1, False, warmup_cap=32)
    assert budget.refit_interval == REFIT_INTERVAL and budget.summary(False)["refit_interval"] == REFIT_INTERVAL
    # The acceptance table is refreshed every REFIT_INTERVAL steps between refits too.
    refreshed = []
    budget.acceptance.refresh = lambda: refreshed.append(budget.steps_seen)  # type: ignore[method-assign]
    start = budget.steps_seen
    for _ in range(3 * REFIT_INTERVAL):
        budget.plan(8, 1, False, warmup_cap=32)
    assert [s for s in refreshed if s > start] == [s for s in range(start + 1, budget.steps_seen + 1) if s % 64 == 0]
