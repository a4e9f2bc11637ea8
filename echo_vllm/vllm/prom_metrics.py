"""ECHO's Prometheus series: what `/metrics` shows of the worker's EchoProposer (the channel: `prom_channel`).

`SERIES` is the one table of names, kinds, labels and meanings (docs/observability.md and the Grafana
dashboard in deploy/grafana are checked against it). `PromExporter` fills them from the proposer:

* every step, from the host lists the step already has (`counts`, the step's budget): the step counter, the
  budget used against the step's budget (K_max, or the time-aware budget's per-step choice under `k_max: "auto"`),
  the per-request verify-length histogram (K_i per request-step) and the draft-phase time (measured by
  EchoVerificationFeedbackPatch around the runner's drafting);
* every `ECHO_VLLM_METRICS_INTERVAL` seconds (default 1) of drafting, from the device accumulators (one host read,
  `EchoMetrics.totals()` and `echo_stats()`): accepted / verified / emitted tokens, gate truncations per depth,
  bound steps, calibration state, faults, and every other number `echo_stats()` has (the time-aware budget's keys
  such as `cost_fit_error`, `budget_mode` or `phase` when present; other numeric keys, and numbers one dict deep
  such as `ms_per_step.draft`, as `echo_vllm:stat{key=...}`).

Only TP rank 0 exports (every rank computes the same figures; counters would count each rank). Labels
`model_name` and `engine` are vLLM's own (served model name, data-parallel rank), so ECHO's series join vLLM's.
A fault in here never reaches serving: it is logged once with its traceback and the exporter turns itself off
(`ECHO_VLLM_FAULTS=raise`, the tests' mode, re-raises instead).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any

from echo_vllm.vllm import prom_channel
from echo_vllm.vllm.faults import MODE_ENV

logger = logging.getLogger("vllm.echo_vllm")

INTERVAL_ENV = "ECHO_VLLM_METRICS_INTERVAL"  # seconds between reads of the device figures (0: every step)
PREFIX = "echo_vllm:"
BASE_LABELS = ("model_name", "engine")
CALIBRATION_STATES = ("warming_up", "calibrated", "loaded", "ungated")
BUDGET_MODES = ("auto", "fixed")
BUDGET_PHASES = ("warmup", "profile", "auto", "fixed")  # EchoProposer.phase
# Seconds; the draft phase runs from well under a millisecond (CUDA, small batch) to ~1 s (CPU, large batch).
# Steps whose K_i lists wait for the next write at most (a long interval must not hold an unbounded list).
MAX_PENDING_STEPS = 256
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)


@dataclass(frozen=True)
class Series:
    name: str  # without PREFIX; counters are exposed with `_total`, histograms with `_bucket/_sum/_count`
    kind: str  # prom_channel.KINDS
    help: str
    labels: tuple[str, ...] = ()  # besides BASE_LABELS

    @property
    def metric(self) -> str:
        return PREFIX + self.name

    def exposed(self) -> tuple[str, ...]:
        """The sample names a scrape shows (what PromQL and dashboards reference)."""
        if self.kind == "counter":
            return (self.metric + "_total",)
        if self.kind == "histogram":
            return tuple(self.metric + s for s in ("_bucket", "_sum", "_count"))
        return (self.metric,)


_SERIES = (
    # --- per step, from the host lists --------------------------------------------------------------------
    Series("steps", "counter", "ECHO steps (engine steps the proposer ran, including budget-0 steps)"),
    Series("budget_draft_tokens", "counter", "Draft tokens ECHO chose for verification (sum_i K_i over steps)"),
    Series("budget_capacity_tokens", "counter", "Step budgets summed over steps (budget_draft_tokens / this = used)"),
    Series("step_draft_tokens", "gauge", "sum_i K_i of the last step (draft tokens it sent to verification)"),
    Series("step_budget", "gauge", "The last step's budget: min(K_max, B x D), or the time-aware budget's choice"),
    Series("k_max", "gauge", "The configured K_max (the budget ceiling); absent under k_max auto"),
    Series("max_depth", "gauge", "Draft depth D (num_speculative_tokens)"),
    Series("verify_length", "histogram", "K_i per request-step: draft tokens sent to verification per request"),
    Series(
        "proposer_seconds", "histogram", "Wall time of a step's draft phase (feedback, EAGLE-3 draft, gates, select)"
    ),
    # --- from the device accumulators, every INTERVAL_ENV seconds ------------------------------------------
    Series("request_steps", "counter", "Verified request-steps"),
    Series("verified_draft_tokens", "counter", "Draft tokens verified by the target"),
    Series("accepted_tokens", "counter", "Draft tokens accepted by the target"),
    Series("emitted_tokens", "counter", "Tokens emitted by verified request-steps (accepted + 1 bonus each)"),
    Series(
        "gate_truncations", "counter", "Request-steps truncated by a calibrated gate, by the gate's depth", ("depth",)
    ),
    Series("budget_bound_steps", "counter", "Steps that used all of K_max while the requests could have drafted more"),
    Series("budget_used", "gauge", "Mean over steps of sum_i K_i / K_max since the engine started"),
    Series("accepted_per_verified_draft", "gauge", "Accepted per verified draft token since the engine started"),
    Series("mat", "gauge", "Mean accepted tokens per verified request-step (incl. the bonus) since start"),
    Series("calibration_state", "gauge", "1 for the gates' current state, 0 for the others", ("state",)),
    Series("warmup_steps_recorded", "gauge", "Warm-up steps recorded for calibration so far"),
    Series("faults", "counter", "Steps that hit a fault inside ECHO and ran without drafts"),
    Series("disabled", "gauge", "1 once ECHO turned itself off after fault_limit consecutive faulty steps"),
    # --- the time-aware budget's figures (issue #12), exported when echo_stats() has them -------------------
    Series("mean_draft_depth", "gauge", "Mean draft depth the drafter ran per step (echo_stats key)"),
    Series("predicted_accepted_per_step", "gauge", "Accepted tokens per step the budget chooser predicted"),
    Series("realised_accepted_per_step", "gauge", "Accepted tokens per step realised"),
    Series("cost_fit_error", "gauge", "Fit error of the measured step-cost model"),
    Series("budget_mode", "gauge", "1 for the budget mode in use (auto / fixed)", ("mode",)),
    Series("budget_phase", "gauge", "1 for the budget's phase (warmup / profile / auto / fixed)", ("phase",)),
    Series("stat", "gauge", "Any other numeric figure of EchoProposer.echo_stats(), by key", ("key",)),
)
SERIES: dict[str, Series] = {s.name: s for s in _SERIES}

# echo_stats() keys exported as their own gauge when present; every other numeric key goes to `stat`.
OPTIONAL_GAUGES = ("mean_draft_depth", "predicted_accepted_per_step", "realised_accepted_per_step", "cost_fit_error")
# Keys already exported under another series (or not a single number); not repeated under `stat`.
_COVERED_KEYS = frozenset(
    {
        "steps",
        "request_steps",
        "k_max",
        "budget_used",
        "budget_bound_steps",
        "mat",
        "accepted_per_verified_draft",
        "truncations_per_depth",
        "faults",
        "disabled",
        "budget_mode",
        "phase",
        *OPTIONAL_GAUGES,
    }
)


def exposed_names() -> set[str]:
    """Every sample name the exporter can show (the dashboard test checks its queries against these)."""
    return {name for s in SERIES.values() for name in s.exposed()}


def calibration_state(proposer: Any) -> str:
    """warming_up / calibrated / loaded (from calibration_file) / ungated (warmup_steps=0, no file)."""
    if getattr(proposer, "calibration", None) is None:
        return "warming_up" if int(proposer.echo_settings.warmup_steps) > 0 else "ungated"
    return "loaded" if str(getattr(proposer, "calibration_source", "")).startswith("file") else "calibrated"


def _number(value: Any) -> float | None:
    """A finite-or-NaN float for an int/float (bools as 0/1); None for anything else."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


class _Histogram:
    """Host-side bucket counts of one histogram (written to the file whole; buckets are few)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.total = 0.0

    def observe_many(self, values: Counter[int] | Counter[float]) -> None:
        for value, n in values.items():
            self.counts[self._bucket(value)] += n
            self.total += float(value) * n

    def _bucket(self, value: float) -> int:
        for j, bound in enumerate(self.bounds):
            if value <= bound:
                return j
        return len(self.bounds) - 1


class NullExporter:
    """What a proposer holds when it does not export (not TP rank 0, no channel, or after a fault)."""

    enabled = False

    def on_step(self, proposer: Any, counts: list[int], budget: int | None = None) -> None:
        return None

    def observe_proposer_time(self, seconds: float) -> None:
        return None


class PromExporter:
    """The series of one EchoProposer, written through a `prom_channel.MmapSeriesWriter`."""

    enabled = True

    def __init__(self, writer: Any, labels: dict[str, str], max_depth: int, interval: float):
        self.writer = writer
        self.labels = labels
        self.max_depth = max_depth
        self.interval = interval
        self.steps = 0
        self.draft_tokens = 0
        self.capacity_tokens = 0
        # K_i is an integer in [0, D]: one bucket per value (+Inf never fills).
        self.verify_length = _Histogram((*(float(d) for d in range(max_depth + 1)), math.inf))
        self._pending_counts: list[list[int]] = []  # steps' K_i lists not yet in verify_length (`_fold_counts`)
        self.proposer_time = _Histogram(TIME_BUCKETS)
        self._last_read = -math.inf
        self._last_time_write = -math.inf
        self._failed = False

    # -- the guard -------------------------------------------------------------------------------------------

    def _guarded(self, what: str, fn: Any, *args: Any) -> None:
        if self._failed:
            return
        try:
            fn(*args)
        except Exception as err:
            self._failed = True
            logger.warning(
                "ECHO metrics: %s failed; the ECHO series on /metrics stop here, serving is not affected:\n%s",
                what,
                "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip(),
            )
            if os.environ.get(MODE_ENV) == "raise":
                raise

    # -- entry points (the proposer's _account, the feedback patch) -------------------------------------------

    def on_step(self, proposer: Any, counts: list[int], budget: int | None = None) -> None:
        """One step: K_i per request (`counts`) under the step's `budget` (default: the proposer's K_max), counted
        on the host every step; the series (host and device figures) written on the first step and then every
        `interval` seconds (default 1 s, far below a scrape interval): writing them every step cost 0.07 ms, 1 %
        of a small CPU step."""
        self._guarded("a step's update", self._on_step, proposer, counts, budget)

    def observe_proposer_time(self, seconds: float) -> None:
        self._guarded("the draft-phase timing", self._observe_time, seconds)

    def publish_static(self, proposer: Any) -> None:
        """At construction: what is known before the first step (depth, K_max, calibration state)."""
        self._guarded("the start-up values", self._publish_static, proposer)

    # -- the work --------------------------------------------------------------------------------------------

    def _g(self, name: str, value: float, **labels: str) -> None:
        s = SERIES[name]
        self.writer.gauge(s.metric, {**self.labels, **labels} if labels else self.labels, s.help, value)

    def _c(self, name: str, value: float, **labels: str) -> None:
        s = SERIES[name]
        self.writer.counter(s.metric, {**self.labels, **labels} if labels else self.labels, s.help, value)

    def _h(self, name: str, hist: _Histogram) -> None:
        s = SERIES[name]
        self.writer.histogram(s.metric, self.labels, s.help, hist.bounds, hist.counts, hist.total)

    def _publish_static(self, proposer: Any) -> None:
        self._g("max_depth", float(self.max_depth))
        k_max = _number(getattr(proposer, "k_max", None))  # None under k_max "auto"
        if k_max is not None:
            self._g("k_max", k_max)
        self._publish_calibration(proposer)

    def _observe_time(self, seconds: float) -> None:
        self.proposer_time.observe_many(Counter({seconds: 1}))
        now = time.monotonic()
        if now - self._last_time_write >= self.interval:  # as the step series: counted always, written per interval
            self._last_time_write = now
            self._h("proposer_seconds", self.proposer_time)

    def _on_step(self, proposer: Any, counts: list[int], budget: int | None) -> None:
        step_sum = sum(counts)
        if budget is None:
            budget = int(proposer.k_max)
        self.steps += 1
        self.draft_tokens += step_sum
        self.capacity_tokens += budget
        self._pending_counts.append(counts)
        now = time.monotonic()
        if now - self._last_read < self.interval:
            if len(self._pending_counts) >= MAX_PENDING_STEPS:
                self._fold_counts()
            return  # host counts accumulate; the series are written every `interval` (a write costs ~0.07 ms)
        self._last_read = now
        self._fold_counts()
        self._c("steps", self.steps)
        self._c("budget_draft_tokens", self.draft_tokens)
        self._c("budget_capacity_tokens", self.capacity_tokens)
        self._g("step_draft_tokens", float(step_sum))
        self._g("step_budget", float(budget))
        self._h("verify_length", self.verify_length)
        self._publish_device(proposer)

    def _fold_counts(self) -> None:
        """The pending steps' K_i into the histogram, counted together: a Counter per step cost ~0.03 ms at batch 1
        and ~0.08 ms at batch 64 in the engine (the proposer's `counts` lists are new every step, so kept as they
        are)."""
        if self._pending_counts:
            self.verify_length.observe_many(Counter(itertools.chain.from_iterable(self._pending_counts)))
            self._pending_counts = []

    def _publish_calibration(self, proposer: Any) -> None:
        state = calibration_state(proposer)
        for s in CALIBRATION_STATES:
            self._g("calibration_state", 1.0 if s == state else 0.0, state=s)
        self._g("warmup_steps_recorded", float(getattr(proposer, "warmup_recorded", 0)))

    def _publish_device(self, proposer: Any) -> None:
        totals = proposer.stats.totals()  # one host read of the device accumulators
        self._c("request_steps", totals["request_steps"])
        self._c("verified_draft_tokens", totals["verified"])
        self._c("accepted_tokens", totals["accepted"])
        self._c("emitted_tokens", totals["emitted"])
        self._c("budget_bound_steps", totals["bound_steps"])
        for depth, n in enumerate(totals["truncations_per_depth"], start=1):
            self._c("gate_truncations", float(n), depth=str(depth))
        self._publish_calibration(proposer)
        self._publish_stats(proposer.echo_stats())

    def _publish_stats(self, stats: dict[str, Any]) -> None:
        """echo_stats(): the cumulative ratios, faults, and whatever the time-aware budget adds (if present)."""
        for key in ("budget_used", "accepted_per_verified_draft", "mat", *OPTIONAL_GAUGES):
            value = _number(stats.get(key))
            if value is not None:
                self._g(key, value)
        self._c("faults", float(stats.get("faults", 0)))
        self._g("disabled", 1.0 if stats.get("disabled") else 0.0)
        for series, key, known in (
            ("budget_mode", "budget_mode", BUDGET_MODES),
            ("budget_phase", "phase", BUDGET_PHASES),
        ):
            current = stats.get(key)
            if isinstance(current, str):
                label = SERIES[series].labels[0]
                for state in sorted({*known, current}):
                    self._g(series, 1.0 if state == current else 0.0, **{label: state})
        for key, raw in stats.items():
            if key in _COVERED_KEYS:
                continue
            # numbers, and numbers one dict deep (e.g. ms_per_step: {"draft": ..., "select": ...})
            items = raw.items() if isinstance(raw, dict) else [(None, raw)]
            for sub, item in items:
                value = _number(item)
                if value is not None:
                    self._g("stat", value, key=key if sub is None else f"{key}.{sub}")


def _labels(vllm_config: Any) -> dict[str, str]:
    model = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None)
    if isinstance(model, list | tuple):
        model = model[0] if model else None
    engine = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0)
    return {"model_name": str(model or "unknown"), "engine": str(engine or 0)}


def exporter_for(proposer: Any, vllm_config: Any) -> PromExporter | NullExporter:
    """The proposer's exporter: a real one on TP rank 0 when a channel directory exists, else a no-op."""
    try:
        directory = prom_channel.worker_directory()
        if directory is None or not getattr(proposer, "is_writer", True):
            return NullExporter()
        interval = float(os.environ.get(INTERVAL_ENV, "1"))
        exporter = PromExporter(prom_channel.writer_for(directory), _labels(vllm_config), proposer.max_depth, interval)
    except Exception as err:
        logger.warning("ECHO metrics: not exported (%s: %s); serving is not affected", type(err).__name__, err)
        if os.environ.get(MODE_ENV) == "raise":
            raise
        return NullExporter()
    exporter.publish_static(proposer)
    return exporter
