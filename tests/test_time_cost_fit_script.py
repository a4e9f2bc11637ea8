"""scripts/time_cost_fit.py: its synthetic samples carry the planted slope, and the fit it times recovers it."""

from __future__ import annotations

import sys

from script_module import load_script


def test_the_timed_fit_recovers_the_planted_per_token_slope() -> None:
    script = load_script("time_cost_fit")
    samples = script.synthetic_samples(300)
    assert len(samples) == 300
    assert {s.batch for s in samples} == {1, 2, 3, 4} and {s.draft_depth for s in samples} == {0, 1, 2, 3, 4}
    assert all(s.verified == s.batch * s.draft_depth for s in samples)
    ms, model = script.time_fit(samples, calls=1)
    assert ms > 0
    slope = script.token_slope(model)
    assert abs(slope - script.REST_TOKEN_S) < 0.05 * script.REST_TOKEN_S
    # The same seed gives the same samples (the figures quoted in docs/benchmarks.md are reproducible).
    assert script.synthetic_samples(20) == script.synthetic_samples(20)
    assert script.synthetic_samples(20, seed=1) != script.synthetic_samples(20)


def test_the_script_prints_one_line_per_size(capsys, monkeypatch) -> None:
    script = load_script("time_cost_fit")
    monkeypatch.setattr(sys, "argv", ["time_cost_fit.py", "--sizes", "40,80", "--calls", "1"])
    script.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("torch threads")
    assert [line.split()[0] for line in lines[1:]] == ["40", "80"]
    assert all("ms per fit" in line and "fitted slope" in line for line in lines[1:])
