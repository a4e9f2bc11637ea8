"""scripts/acceptance_history.py: its AUC, the per-request history, and a selection gain that appears only when a
request's acceptance really depends on the request."""

from __future__ import annotations

import itertools
import random

import numpy as np
from script_module import load_script


def test_auc_is_the_calibrations_pairwise_count_with_ties():
    tool = load_script("acceptance_history")
    rng = np.random.default_rng(0)
    score = rng.integers(0, 5, 60).astype(float)  # many ties
    label = rng.random(60) < 0.4
    pairs = [(p, n) for p, n in itertools.product(score[label], score[~label])]
    want = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    assert abs(tool.auc(score, label) - want) < 1e-12
    assert np.isnan(tool.auc(score, np.zeros(60, dtype=bool)))


def test_history_is_each_requests_earlier_average():
    tool = load_script("acceptance_history")
    records = [{"req": r, "acc": a} for r, a in (("a", 4), ("b", 0), ("a", 0), ("a", 9), ("b", 2))]
    got = tool.history(records, 0.5, depth=4)
    assert np.isnan(got[0]) and np.isnan(got[1])
    assert got[2] == 4.0 and got[3] == 2.0 and got[4] == 0.0  # a: 4 -> 0.5 * 4 + 0.5 * 0; the 9 counts as 4


def _synthetic(per_request: bool, seed: int = 1) -> list[dict]:
    """16 requests x 120 steps of depth-4 chains; confidence weakly informative. per_request: each request accepts
    at its own rate (0.15 or 0.85 per depth); else every request at 0.5."""
    rng = random.Random(seed)
    rates = {f"r{i}": (0.85 if i % 2 else 0.15) if per_request else 0.5 for i in range(16)}
    records = []
    for step in range(120):
        for req, rate in rates.items():
            accepted = 0
            while accepted < 4 and rng.random() < rate:
                accepted += 1
            conf = [min(1.0, max(1e-6, 0.5 ** (d + 1) * rng.uniform(0.3, 3.0))) for d in range(4)]
            records.append({"step": step, "req": req, "conf": conf, "acc": accepted})
    return records


def test_the_history_pays_only_where_requests_differ():
    tool = load_script("acceptance_history")
    differ = tool.analyze(_synthetic(True), alpha=0.3)
    alike = tool.analyze(_synthetic(False), alpha=0.3)
    assert differ["auc"][0]["history"] > 0.8 and abs(alike["auc"][0]["history"] - 0.5) < 0.05
    gains = [row["gain"] for row in differ["selection"]]
    assert min(gains) > 0.1  # the same drafts verified, far more of them accepted
    assert all(abs(row["gain"]) < 0.05 for row in alike["selection"])
    assert all(row["verified"] == row["verified_history"] for row in differ["selection"])  # an equal budget
    text = tool.report(differ)
    assert "AUC confidence" in text and text.count("budget") == len(differ["selection"])


def test_the_online_factor_learns_from_its_own_picks_only_and_pays_where_requests_differ():
    tool = load_script("acceptance_history")
    differ = tool.online_factor(_synthetic(True), alpha=0.3, fractions=(0.25,))
    alike = tool.online_factor(_synthetic(False), alpha=0.3, fractions=(0.25,))
    assert all(row["verified"] == row["verified_factor"] for row in differ)  # an equal budget
    assert min(row["gain"] for row in differ) > 0.05
    assert all(abs(row["gain"]) < 0.05 for row in alike)
