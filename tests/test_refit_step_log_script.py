"""scripts/refit_step_log.py: the cost samples rebuilt from a step log, the offline refit and its residual views."""

from __future__ import annotations

import dataclasses
import random

from script_module import load_script

ROW_S = 2e-5  # the synthetic first pass's seconds per forward row (what the residual view must find)


def _draft_s(batch: int, depth: int, rows: int) -> float:
    """The synthetic proposer: the cost model's own shape, plus a per-row first-pass term it lacks."""
    first = 0.3e-3 if depth >= 1 else 0.0
    loop = 0.4e-3 if depth >= 2 else 0.0
    return 0.5e-3 + 0.02e-3 * batch + first + loop + depth * (0.8e-3 + 0.03e-3 * batch) + ROW_S * rows * (depth >= 1)


def _log(steps: int = 480) -> list[dict]:
    rng = random.Random(7)
    lines: list[dict] = []
    previous = None
    for step in range(1, steps + 1):
        batch = (4, 8, 16)[(step // 40) % 3]
        verified = batch * previous["drafted_depth"] if previous and previous["batch"] == batch else 0
        prompt_rows = rng.randrange(40, 200) if rng.random() < 0.2 else 0
        num_tokens = batch + verified + prompt_rows
        depth = rng.randrange(4)
        line = {
            "step": step, "rank": 0, "batch": batch, "drafted_depth": depth, "num_tokens": num_tokens,
            "verified_in_forward": verified, "context_tokens": 0, "tree_step": False,
            "rest_s": 1e-3 * (2.0 + 0.05 * num_tokens) if step > 1 else 0.0,
            "draft_s": _draft_s(previous["batch"], previous["drafted_depth"], previous["num_tokens"]) if previous else 0.0,
        }  # fmt: skip
        lines.append(line)
        previous = line
    return lines


def test_each_sample_pairs_a_forward_with_the_next_lines_proposer_time():
    refit = load_script("refit_step_log")
    lines = _log(12)
    for j in range(6, 12):  # a new generate starts at line 6: lines 5 and 6 are not one step apart
        lines[j]["step"] = j - 5
    samples = refit.samples_from_log(lines)
    kept = [i for i in range(1, 11) if i != 5]  # line 0 has no outside time yet; line 5's successor is another run
    assert len(samples) == len(kept)
    for sample, i in zip(samples, kept):
        assert sample.num_tokens == lines[i]["num_tokens"] and sample.draft_depth == lines[i]["drafted_depth"]
        assert sample.rest_s == lines[i]["rest_s"] and sample.draft_s == lines[i + 1]["draft_s"]


def test_prompt_rows_left_out_count_as_free_only_without_their_kv():
    refit = load_script("refit_step_log")
    lines = _log(3)
    lines[1].update(num_tokens=lines[1]["batch"] + lines[1]["verified_in_forward"] + 50, head_cut=30, head_kv=20)
    (sample,) = refit.samples_from_log(lines)
    assert sample.head_free == 10 and sample.prompt_rows == 40  # the 20 written rows still cost the proposer
    del lines[1]["head_kv"]  # a log from before prompt_head_kv: every left-out row was free
    assert refit.samples_from_log(lines)[0].prompt_rows == 20


def test_the_refit_prices_decode_and_joining_steps_and_an_older_profile_shows_the_row_cost():
    refit = load_script("refit_step_log")
    samples = refit.samples_from_log(_log())
    model = refit.fit_cost_model(samples)
    assert model is not None
    table = refit.depth_table(samples, {"refit": model}, 16)
    assert set(table) == {0, 1, 2, 3}
    for depth, row in table.items():  # decode steps carry few rows: the model's shape prices them closely
        assert abs(row["refit_draft_ms"] - row["draft_ms"]) < 0.15 * row["draft_ms"] + 0.05, (depth, row)
        assert abs(row["refit_rest_ms"] - row["rest_ms"]) < 0.1 * row["rest_ms"], (depth, row)
    assert abs(model.prompt_row_s - ROW_S) < 0.15 * ROW_S  # the refit has the row term: nothing left per row
    residual = refit.first_pass_residual(samples, model)
    assert residual["joining_steps"] > 50 and residual["decode_steps"] > 200
    assert abs(residual["ms_per_prompt_row"]) < 0.1 * 1e3 * ROW_S
    # A profile from before the term (its fit saw every row as verified) leaves the rows' cost in the residual.
    old = refit.fit_cost_model([dataclasses.replace(s, verified=s.num_tokens - s.batch) for s in samples])
    residual = refit.first_pass_residual(samples, old)
    assert abs(residual["ms_per_prompt_row"] - 1e3 * ROW_S) < 0.25 * 1e3 * ROW_S
    assert abs(residual["decode_median_residual_ms"]) < 0.1 * residual["joining_median_residual_ms"]


def test_a_proposer_without_a_row_cost_shows_no_row_residual():
    refit = load_script("refit_step_log")
    lines = _log()
    for before, line in zip(lines, lines[1:]):  # prompt rows stay in the forwards; the proposer ignores them
        line["draft_s"] = _draft_s(before["batch"], before["drafted_depth"], 0)
    samples = refit.samples_from_log(lines)
    residual = refit.first_pass_residual(samples, refit.fit_cost_model(samples))
    assert residual["joining_steps"] > 50
    assert abs(residual["ms_per_prompt_row"]) < 0.2 * 1e3 * ROW_S
