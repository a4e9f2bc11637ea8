"""The soak's figures and its printed summary: counts by outcome and kind, latency percentiles, memory, checks."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from echo_vllm.soak.checks import Check
from echo_vllm.soak.client import CLIENT_CANCELLED, COMPLETED, ERROR, HOSTILE_4XX, RequestResult

MIB = 1 << 20


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def traffic_figures(results: list[RequestResult], not_sent: int, wall_s: float) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in results)
    completed = [r for r in results if r.outcome == COMPLETED]
    latencies = [r.latency_s for r in completed]
    return {
        "sent": len(results),
        "not_sent_deadline": not_sent,
        "completed": outcomes[COMPLETED],
        "client_aborts": outcomes[CLIENT_CANCELLED],
        "hostile_4xx": outcomes[HOSTILE_4XX],
        "errors": outcomes[ERROR],
        "hostile_4xx_by_kind": dict(Counter(r.label.split(":", 1)[1] for r in results if r.outcome == HOSTILE_4XX)),
        "hostile_status_by_kind": _hostile_statuses(results),
        "errors_by_kind": dict(Counter(r.error or "?" for r in results if r.outcome == ERROR)),
        "connection_retries": sum(r.retries for r in results),
        "connection_retried": [f"{r.label}: {d}" for r in results for d in r.retried][:5],
        "completed_by_label": dict(sorted(Counter(r.label for r in completed).items())),
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "latency_max_s": max(latencies, default=None),
        "completion_tokens": sum(len(ids) for r in completed for ids in r.token_ids),
        "wall_s": wall_s,
    }


def _hostile_statuses(results: list[RequestResult]) -> dict[str, list[int | None]]:
    out: dict[str, set[int | None]] = {}
    for r in results:
        if r.label.startswith("hostile:"):
            out.setdefault(r.label.split(":", 1)[1], set()).add(r.status)
    return {k: sorted(v, key=lambda s: s or 0) for k, v in sorted(out.items())}


def error_samples(results: list[RequestResult], limit: int = 20) -> list[dict[str, Any]]:
    return [
        {"index": r.index, "label": r.label, "status": r.status, "error": r.error, "detail": r.detail}
        for r in results
        if r.outcome == ERROR
    ][:limit]


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:+.0f}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    return "-" if value is None else str(value)


def summary_lines(figures: dict[str, Any], checks: list[Check]) -> list[str]:
    """A two-part table: the figures, then every check with PASS/FAIL and its detail."""
    traffic = figures["traffic"]
    memory = figures["memory"]
    rows = [
        ("requests sent", traffic["sent"]),
        ("not sent (deadline)", traffic["not_sent_deadline"]),
        ("completed", traffic["completed"]),
        ("client aborts", traffic["client_aborts"]),
        ("hostile 4xx", traffic["hostile_4xx"]),
        ("hostile 4xx by kind", traffic["hostile_4xx_by_kind"]),
        ("errors", traffic["errors"]),
        ("errors by kind", traffic["errors_by_kind"]),
        ("connection retries", traffic["connection_retries"]),
        ("latency p50 / p99 (s)", f"{_fmt(traffic['latency_p50_s'])} / {_fmt(traffic['latency_p99_s'])}"),
        ("completion tokens", traffic["completion_tokens"]),
        ("soak traffic wall (s)", traffic["wall_s"]),
        ("memory before / after (MiB)", f"{memory['before_bytes'] / MIB:.0f} / {memory['after_bytes'] / MIB:.0f}"),
        ("memory growth / peak (MiB)", f"{memory['growth_bytes'] / MIB:+.0f} / {memory['peak_bytes'] / MIB:.0f}"),
        ("memory growth 2nd half (MiB)", _mib(memory.get("growth_second_half_bytes"))),
        ("greedy compared / mismatches", f"{figures['greedy']['compared']} / {figures['greedy']['mismatches']}"),
    ]
    stats = figures.get("echo_stats")
    if stats:
        rows.append(("ECHO stats", stats["line"]))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {_fmt(v)}" for k, v in rows]
    lines.append("")
    cwidth = max(len(c.name) for c in checks)
    lines += [f"{'PASS' if c.passed else 'FAIL'}  {c.name.ljust(cwidth)}  {c.detail}" for c in checks]
    return lines


def write_json(
    path: Path, config: dict[str, Any], figures: dict[str, Any], checks: list[Check], extra: dict[str, Any]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "passed": all(c.passed for c in checks),
        "config": config,
        "figures": figures,
        "checks": [asdict(c) for c in checks],
        **extra,
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
