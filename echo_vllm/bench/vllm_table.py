"""The printed table of `bench vllm`: every figure of a row, formatted; '-' where it is not known (never 0)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from echo_vllm.bench.report import format_table

COLUMNS = (
    ("method", "method"),
    ("batch", "batch"),
    ("tok/s median [min-max]", "tps"),
    ("vs nospec", "vs_nospec"),
    ("vs best", "vs_best"),
    ("steady tok/s (vs best)", "steady"),
    ("tok/req-step", "trs"),
    ("req/step", "rps"),
    ("acc/verified", "apv"),
    ("budget/step", "budget"),
    ("draft depth", "depth"),
    ("ms/step", "ms_total"),
    ("draft/select/rest ms", "ms_phases"),
    ("oracle", "oracle"),
    ("identical", "identical"),
)


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _tps(row: dict[str, Any]) -> str:
    if row.get("tokens_per_s") is None:
        return "failed"
    return f"{row['tokens_per_s']:.1f} [{row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f}]"


def _steady(row: dict[str, Any]) -> str:
    if row.get("steady_tokens_per_s") is None:
        return "-"
    return f"{row['steady_tokens_per_s']:.1f} ({_num(row.get('steady_ratio_vs_best_baseline'))})"


def _method(row: dict[str, Any]) -> str:
    if row["method"] == "eagle3-best":
        return f"eagle3-best (@{row['depth']})"
    if row["method"] == "echo":
        return f"echo (K_max {row.get('k_max')})"
    return row["label"]


def _identical(row: dict[str, Any]) -> str:
    if row.get("errors"):
        return f"no ({len(row['errors'])} round(s) failed)"
    return "yes" if row["identical_to_baseline"] else "NO"


def _oracle(row: dict[str, Any]) -> str:
    if row["method"] not in ("echo", "echo-auto", "echo-tree"):
        return ""
    if row.get("oracle_ratio") is None:
        return "-"
    return f"{row['oracle_ratio']:.2f} [{row['oracle_ratio_min']:.2f}-{row['oracle_ratio_max']:.2f}]"


def table_cells(row: dict[str, Any]) -> dict[str, str]:
    ms = row.get("ms_per_step") or {}
    phases = [ms.get(p) for p in ("draft", "select", "rest")]
    return {
        "method": _method(row),
        "batch": str(row["batch_size"]),
        "tps": _tps(row),
        "vs_nospec": _num(row.get("ratio_vs_nospec")),
        "vs_best": _num(row.get("ratio_vs_best_baseline")),
        "steady": _steady(row),
        "trs": _num(row.get("tokens_per_request_step")),
        "rps": _num(row.get("requests_per_step"), 1),
        "apv": _num(row.get("accepted_per_verified_draft")),
        "budget": _num(row.get("mean_step_budget"), 1),
        "depth": _num(row.get("mean_draft_depth"), 2),
        "ms_total": _num(ms.get("total")),
        "ms_phases": "/".join(_num(p) for p in phases) if any(p is not None for p in phases) else "-",
        "oracle": _oracle(row),
        "identical": _identical(row),
    }


def format_results(rows: Sequence[dict[str, Any]]) -> str:
    keys = [key for _, key in COLUMNS]
    return format_table([table_cells(r) for r in rows], keys, headers=[h for h, _ in COLUMNS])


def footnotes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the table cannot show in a cell: uncalibrated ECHO runs, why an oracle is missing, failed rounds."""
    notes = []
    for row in rows:
        where = f"{row['label']} batch {row['batch_size']}"
        if row.get("calibrated_before_timing") is False:
            notes.append(f"{where}: ECHO was NOT calibrated before the timed generate (warm-up too short)")
        if row["method"] in ("echo", "echo-auto", "echo-tree") and row.get("oracle_ratio") is None:
            notes.append(f"{where}: no oracle bound: {row.get('oracle_reason') or 'unknown'}")
        if row.get("num_preemptions"):
            notes.append(f"{where}: {row['num_preemptions']:.0f} preemption(s): the KV cache did not hold the batch")
        for err in row.get("echo_stats_errors") or []:
            notes.append(f"{where}: ECHO statistics missing: {err}")
        for err in row.get("errors") or []:
            notes.append(f"{where}: a round failed: {err}")
    return list(dict.fromkeys(notes))


def ratio_summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per ECHO method: its ratio to no-spec and to the best baseline at each batch size."""
    lines = []
    for method in ("echo", "echo-auto", "echo-tree"):
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        cells = [
            f"batch {r['batch_size']}: {_num(r.get('ratio_vs_nospec'))}x no-spec, "
            f"{_num(r.get('ratio_vs_best_baseline'))}x best ({r.get('best_baseline') or '-'})"
            + (
                f" (steady: {_num(r.get('steady_ratio_vs_nospec'))}x no-spec, "
                f"{_num(r.get('steady_ratio_vs_best_baseline'))}x best)"
                if r.get("steady_tokens_per_s") is not None
                else ""
            )
            for r in mine
        ]
        lines.append(f"{method}: " + "; ".join(cells))
    return lines
