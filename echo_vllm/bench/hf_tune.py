"""`echo-vllm bench hf-tune`: each method's setting from a sweep on the tuning prompts (issue #14).

Every method gets the setting a careful operator would pick (the protocol's "tuned baselines"), chosen on a prompt
set disjoint from the one `bench hf` reports on: the first `tune_prompts` prompts of each dataset. Per method one
interleaved run per dataset of [ar, every grid point, the reference configs] in rotating rounds; a point's score is
the geometric mean over the datasets of its median speedup vs ar; only points whose output was identical to ar in
every round qualify. The winners go to echo_vllm/bench/hf_tuned.json (`hf_settings.save_tuned`), which `bench hf`
reads as its defaults, with the score of every grid point as provenance.

The grids sit around this machine's verification knee (docs/tuning.md: T = 8 on the testbed target, slack 0.5, so
K_max 6..16) and are small enough for the whole tune to take about ten minutes per drafter on the 2-core CPU box.
`measure` is injectable: the choice logic is tested without timing anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from echo_vllm.bench.hf import Config, spread_json
from echo_vllm.bench.hf_settings import MethodSetting, default_setting
from echo_vllm.errors import ConfigError
from echo_vllm.hf.engine import METHODS

# Tune order: ddd's grid starts from eagle2's winner (its pool, deepened), so eagle2 comes first.
TUNE_ORDER = ("chain", "eagle2", "siblings", "ddd", "dense", "fixed", "echo")
DEFAULT_TUNE_METHODS = ("chain", "eagle2", "ddd", "dense", "fixed", "echo")

# Measure: the configs (ar included) on one dataset's tuning prompts -> {label: run} with at least
# "speedup_vs_ar" (a Spread) and "identical_to_ar"; `hf.run_configs_interleaved` in use.
Measure = Callable[[list[Config], str], dict[str, dict[str, Any]]]
Grid = Callable[[dict[str, MethodSetting]], list[MethodSetting]]


class TuneError(ConfigError):
    """A tune that cannot run as asked (an unknown method, an empty grid)."""


def _chain(best: dict[str, MethodSetting]) -> list[MethodSetting]:
    return [MethodSetting("chain", max_depth=d) for d in (3, 4, 5, 6, 7)]


def _eagle2(best: dict[str, MethodSetting], method: str = "eagle2") -> list[MethodSetting]:
    # Total tokens around the knee (8) x top_k x depth; depth >= K_max adds nothing (the selection reaches depth
    # K_max at most), so the depths stay below the smaller budgets.
    return [
        MethodSetting(method, max_depth=d, k_max=k, top_k=t) for k in (6, 8, 12, 16) for t in (2, 4) for d in (5, 7)
    ]


def _siblings(best: dict[str, MethodSetting]) -> list[MethodSetting]:
    return [MethodSetting("siblings", max_depth=d, k_max=k, top_k=4) for k in (6, 8, 12) for d in (5, 7)]


def _ddd(best: dict[str, MethodSetting]) -> list[MethodSetting]:
    # eagle2's tuned pool (total tokens, top_k), deepened to 10 unless the frontier's summed path probability
    # falls below the threshold at a checked depth.
    pool = best.get("eagle2") or default_setting("eagle2")
    return [
        MethodSetting("ddd", k_max=pool.k_max, top_k=pool.top_k, ddd_threshold=h, ddd_max_depth=10)
        for h in (-2.0, -3.0, -4.0, -5.0, -6.0)
    ]


def _gated(method: str) -> Grid:
    def grid(best: dict[str, MethodSetting]) -> list[MethodSetting]:
        budgets: tuple[int | str, ...] = ("auto", 8, 12, 16) if method == "echo" else ("auto", 8, 12)
        deltas = (0.6, 0.7, 0.8) if method == "echo" else (0.6,)  # dense and fixed ignore delta
        return [MethodSetting(method, max_depth=6, k_max=k, delta=x) for k in budgets for x in deltas]

    return grid


GRIDS: dict[str, Grid] = {
    "chain": _chain,
    "eagle2": _eagle2,
    "siblings": _siblings,
    "ddd": _ddd,
    "dense": _gated("dense"),
    "fixed": _gated("fixed"),
    "echo": _gated("echo"),
}


def _quick(method: str, keep: Callable[[MethodSetting], bool]) -> Grid:
    return lambda best: [s for s in GRIDS[method](best) if keep(s)]


# A subset of each grid (corners and the middle) for a smoke tune on a busy machine: `--grid quick`.
QUICK_GRIDS: dict[str, Grid] = {
    "chain": _quick("chain", lambda s: s.max_depth in (4, 6)),
    "eagle2": _quick("eagle2", lambda s: s.k_max in (8, 12) and s.max_depth == 5),
    "siblings": _quick("siblings", lambda s: s.k_max in (8, 12) and s.max_depth == 5),
    "ddd": _quick("ddd", lambda s: s.ddd_threshold in (-3.0, -5.0)),
    "dense": _quick("dense", lambda s: s.k_max in ("auto", 12)),
    "fixed": _quick("fixed", lambda s: s.k_max in ("auto", 12)),
    "echo": _quick("echo", lambda s: s.k_max in ("auto", 12) and s.delta in (0.6, 0.8)),
}
GRID_SETS = {"full": GRIDS, "quick": QUICK_GRIDS}

# Configs run beside a method's grid for reference (same run): the trade-off table's "vs eagle2" columns.
REFERENCES = {"echo": ("eagle2",), "dense": ("eagle2",), "fixed": ("eagle2",), "ddd": ("eagle2",)}


@dataclass
class GridPoint:
    setting: MethodSetting
    runs: dict[str, dict[str, Any]]  # dataset -> the point's run
    refs: dict[str, dict[str, dict[str, Any]]]  # dataset -> reference label -> run

    @property
    def lossless(self) -> bool:
        return all(run["identical_to_ar"] for run in self.runs.values())

    @property
    def score(self) -> float | None:
        """Geometric mean over the datasets of the median speedup vs ar; None unless lossless everywhere."""
        if not self.lossless or not self.runs:
            return None
        speedups = [run["speedup_vs_ar"].median for run in self.runs.values()]
        return math.exp(sum(math.log(s) for s in speedups) / len(speedups))

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.setting.label(),
            "method": self.setting.method,
            "setting": self.setting.relevant(),
            "score": self.score,
            "identical_to_ar": self.lossless,
            "per_dataset": {
                d: {
                    "speedup_vs_ar": spread_json(run["speedup_vs_ar"]),
                    "mat": (run.get("metrics") or {}).get("mat"),
                    "u_selected_depth": (run.get("depths") or {}).get("u_selected_depth"),
                    "u_drafted_depth": (run.get("depths") or {}).get("u_drafted_depth"),
                    "verified_per_step": run.get("verified_per_step"),
                }
                for d, run in self.runs.items()
            },
        }


@dataclass
class TuneOutcome:
    best: dict[str, MethodSetting]
    points: dict[str, list[GridPoint]]  # method -> its grid, in grid order
    failed: dict[str, str]  # method -> why it has no winner

    def points_json(self) -> list[dict[str, Any]]:
        return [p.to_json() for method in self.points for p in self.points[method]]


def choose(points: list[GridPoint]) -> GridPoint | None:
    """The best-scoring lossless point; ties go to the earlier grid point (the grids list cheaper ones first)."""
    best: GridPoint | None = None
    for point in points:
        score = point.score
        if score is not None and (best is None or score > best.score):  # type: ignore[operator]
            best = point
    return best


def tune(
    methods: list[str],
    datasets: list[str],
    measure: Measure,
    grids: dict[str, Grid] | None = None,
    log: Callable[[str], None] = print,
) -> TuneOutcome:
    """Sweep each method's grid (in TUNE_ORDER) and keep its winner."""
    grids = grids or GRIDS
    bad = [m for m in methods if m not in METHODS or m == "ar" or m not in grids]
    if bad:
        raise TuneError(f"--methods: cannot tune {bad}; choose from {', '.join(m for m in TUNE_ORDER if m in grids)}")
    best: dict[str, MethodSetting] = {}
    points: dict[str, list[GridPoint]] = {}
    failed: dict[str, str] = {}
    for method in sorted(methods, key=TUNE_ORDER.index):
        grid = grids[method](best)
        if not grid:
            raise TuneError(f"{method}: empty grid")
        configs = [Config("ar", MethodSetting("ar"))] + [Config(s.label(), s) for s in grid]
        refs = [r for r in REFERENCES.get(method, ()) if r in best and r != method]
        configs += [Config(f"ref:{r}", best[r]) for r in refs]
        found = [GridPoint(s, {}, {}) for s in grid]
        for dataset in datasets:
            log(
                f"[bench hf-tune] {method} on {dataset}: {len(grid)} grid points + ar{''.join(', ref ' + r for r in refs)}"
            )
            runs = measure(configs, dataset)
            for point in found:
                point.runs[dataset] = runs[point.setting.label()]
                point.refs[dataset] = {r: runs[f"ref:{r}"] for r in refs}
        points[method] = found
        winner = choose(found)
        if winner is None:
            failed[method] = "no grid point was identical to ar on every round (a lossless bug: see the outputs)"
            log(f"[bench hf-tune] {method}: NO lossless point; not saved")
            continue
        best[method] = winner.setting
        log(f"[bench hf-tune] {method}: best {winner.setting.label()} (score {winner.score:.3f})")
    return TuneOutcome(best, points, failed)


def tradeoff_rows(outcome: TuneOutcome, method: str = "echo") -> list[dict[str, Any]]:
    """The MAT / u trade-off over delta from the sweep: one row per (K_max, delta, dataset), with the same run's
    tuned eagle2 for reference where it ran beside the grid."""
    rows = []
    for point in outcome.points.get(method, []):
        for dataset, run in point.runs.items():
            mat = (run.get("metrics") or {}).get("mat")
            u = (run.get("depths") or {}).get("u_selected_depth")
            row: dict[str, Any] = {
                "k_max": point.setting.k_max,
                "delta": point.setting.delta,
                "dataset": dataset,
                "mat": mat,
                "u_selected_depth": u,
                "u_drafted_depth": (run.get("depths") or {}).get("u_drafted_depth"),
                "speedup_vs_ar": run["speedup_vs_ar"].median,
                "gates": run.get("gates"),
            }
            ref = point.refs.get(dataset, {}).get("eagle2")
            if ref is not None:
                ref_mat = (ref.get("metrics") or {}).get("mat")
                ref_u = (ref.get("depths") or {}).get("u_selected_depth")
                row["mat_vs_eagle2"] = mat / ref_mat if mat and ref_mat else None
                row["u_vs_eagle2"] = u / ref_u if u and ref_u else None
                row["speed_vs_eagle2"] = run["speedup_vs_ar"].median / ref["speedup_vs_ar"].median
            rows.append(row)
    # Integer budgets ascending, then "auto".
    return sorted(
        rows, key=lambda r: (r["k_max"] == "auto", r["k_max"] if r["k_max"] != "auto" else 0, r["delta"], r["dataset"])
    )
