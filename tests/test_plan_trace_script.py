"""scripts/plan_trace.py: each step's time and tokens go to the decision that caused them (the previous line)."""

from __future__ import annotations

from script_module import load_script


def _line(depth, num_tokens, verified, accepted, rest, draft, probe=False, model=None):
    return {
        "phase": "auto", "batch": 2, "drafted_depth": depth, "probe": probe, "num_tokens": num_tokens,
        "verified_in_forward": verified, "accepted": accepted, "rest_s": rest, "draft_s": draft,
        "model_ms": model,
    }  # fmt: skip


def test_steps_are_attributed_to_the_previous_decision():
    trace = load_script("plan_trace")
    lines = [
        _line(0, 2, 0, [], 0.010, 0.001, model=[9.0, 12.0, 15.0]),  # plain decision
        _line(2, 2, 0, [], 0.011, 0.002, model=[9.0, 12.0, 15.0]),  # plain step paid: 0.011 + 0.002; d2 decision
        _line(1, 6, 4, [2, 1], 0.020, 0.005, probe=True, model=[9.0, 12.0, 15.0]),  # d2 paid; a probe decision
        _line(0, 40, 2, [1, 0], 0.050, 0.003),  # the probe's step, with 34 prompt rows
    ]
    assert trace.plan_string(lines) == "02P0"
    steps = trace.attributed_steps(lines)
    assert [s["kind"] for s in steps] == ["plain", "d2", "probe"]
    assert [round(s["seconds"], 3) for s in steps] == [0.013, 0.025, 0.053]
    assert [s["emitted"] for s in steps] == [2.0, 5.0, 3.0]
    assert [s["full_decode"] for s in steps] == [True, True, False]
    table = trace.summarise(steps)
    assert table["d2"]["full_decode_ms"] == 25.0 and table["d2"]["model_ms_all"] == 15.0  # priced at the drafted depth
    assert table["d2"]["verified"] == 4  # what that step verified (of batch x depth = 4: none cut)
    assert table["probe"]["full_decode_steps"] == 0 and table["probe"]["tokens_per_step"] == 3.0
    assert abs(sum(row["time_share"] for row in table.values()) - 1.0) < 0.01


def test_optimism_compares_a_chosen_depths_value_with_what_it_realised():
    trace = load_script("plan_trace")

    def line(depth, values, realised, probe=False):
        return {"phase": "auto", "policy": "auto", "batch": 2, "drafted_depth": depth, "probe": probe,
                "depth_values": values, "level_rates": realised}  # fmt: skip

    lines = [
        line(2, [1.0, 1.1, 1.3, 1.2], []),  # chose depth 2 (its value ran high)
        line(1, [1.0, 1.2, 1.1, 1.0], [1.0, 1.1, 1.1, 1.0]),  # depth 2 realised 1.1; chose depth 1
        line(3, [1.0, 1.0, 1.0, 1.4], [1.0, 1.0, 0.9, 0.8], probe=True),  # depth 1 realised 1.0; a probe to depth 3
        line(0, [1.0, 1.0, 1.0, 1.0], [1.0, 0.5, 0.5, 0.5]),  # the probe realised 0.5 at depths 1-3; plain: left out
        line(1, [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]),
    ]
    table = trace.optimism(lines)
    assert table[2]["chosen"] == 0.2 and table[2]["chosen_steps"] == 1  # 1.3 held, 1.1 realised
    assert table[1]["chosen"] == 0.2 and table[1]["other_measured"] == 0.0  # depth 1 was measured by the depth-2 step
    # a depth-1 step held 1.1 for depth 2, which its level imputed at 0.9; depth 3 was imputed on both such steps
    assert table[2]["other_imputed"] == 0.2 and table[3]["other_imputed_steps"] == 2
    assert table[3]["probe"] == 0.9 and table[1]["probe"] == 0.5 and table[3]["chosen"] is None


def test_optimism_pools_jobs_without_pairing_across_them():
    trace = load_script("plan_trace")

    def line(depth, values, realised):
        return {"phase": "auto", "policy": "auto", "batch": 2, "drafted_depth": depth, "probe": False,
                "depth_values": values, "level_rates": realised}  # fmt: skip

    first = [line(1, [1.0, 1.5], []), line(1, [1.0, 1.5], [1.0, 1.0])]  # held 1.5, realised 1.0
    second = [line(1, [1.0, 1.1], [1.0, 9.0]), line(1, [1.0, 1.1], [1.0, 1.0])]  # its first line's rates are no one's
    pooled = trace.optimism(first, second)[1]
    assert pooled["chosen_steps"] == 2 and pooled["chosen"] == 0.3  # (0.5 + 0.1) / 2, no pair across the jobs
    assert trace.optimism(first + second)[1]["chosen_steps"] == 3  # concatenated, a bogus pair would enter


def test_pricing_windows_compare_each_step_with_the_price_of_its_drafted_depth():
    trace = load_script("plan_trace")
    model = [9.0, 12.0, 15.0]
    lines = [
        _line(2, 2, 0, [], 0.010, 0.001, model=model),  # d2 decision, priced 15 ms
        _line(2, 6, 4, [1, 1], 0.015, 0.002, model=model),  # paid 17 ms for all 4 drafts; d2 again
        _line(1, 5, 3, [0, 1], 0.012, 0.001, model=model),  # paid 13 ms for 3 of 4 (a cut); d1 decision, 12 ms
        _line(0, 4, 2, [0, 0], 0.012, 0.001, model=model),  # paid 13 ms for both drafts; plain decision
        _line(2, 2, 0, [], 0.009, 0.001, model=model),  # the plain step: no price to compare
        _line(0, 40, 4, [2, 2], 0.030, 0.001, model=model),  # the d2 step carried prompt rows: not a decode step
    ]
    steps = trace.attributed_steps(lines)
    windows = trace.pricing_windows(steps, 2)
    assert [w["start"] for w in windows] == [0, 2, 4]
    assert windows[0] == {"start": 0, "d2": [0.0, 2, 0.88]}  # (17 - 15 + 13 - 15) / 2; shares 1 and 0.75
    assert windows[1] == {"start": 2, "d1": [1.0, 1, 1.0]}  # 13 - 12; the plain step left out
    assert windows[2] == {"start": 4}  # prompt rows in the forward: left out
