"""The `ECHO stats:` log line of the vLLM plugin, formatted from `EchoProposer.echo_stats()`.

Reporting only: the figures come from `echo_vllm.core.metrics.EchoMetrics` (the same statistics as the HF
engine's JSON). The soak parses this line (`echo_vllm.soak.checks.last_echo_stats`): its `key=value` field names
are that parser's contract, tested together in tests/test_soak_parts.py.
"""

from __future__ import annotations

from typing import Any

STATS_PREFIX = "ECHO stats:"

_LINE = (
    STATS_PREFIX + " steps={steps} budget_used={budget_used:.3f} (mean sum {mean_step_sum:.2f} / k_max {k_max}, "
    "max sum {max_step_sum}, bound steps {budget_bound_steps}) MAT={mat:.3f} utilization={utilization:.3f} "
    "accepted/verified={accepted_per_verified_draft:.3f} truncations_per_depth={truncations_per_depth} "
    "calibration={calibration} sweet_spots={sweet_spots} faults={faults} disabled={disabled} "
    "budget={budget_mode} phase={phase} draft_depth={mean_draft_depth:.2f} "
    "accepted/step predicted={predicted_accepted_per_step:.2f} realised={realised_accepted_per_step:.2f} "
    "cost_fit_error={fit_error}"
)


def format_stats_line(stats: dict[str, Any]) -> str:
    """One line: budget use, MAT, utilization, acceptance, truncations, calibration state and faults."""
    fit = stats.get("cost_fit_error")
    return _LINE.format(**{"fit_error": "none" if fit is None else f"{fit:.3f}", **stats})


STARTUP_PREFIX = "ECHO proposer:"


def format_startup_line(
    *,
    vllm_version: str | None,
    runner: str,
    max_depth: int,
    settings: Any,
    calibration: str,
    budget_op: str,
    tree_fixup: str = "chains",
) -> str:
    """The one start-up line of a worker: what runs (vLLM release and runner), how ECHO is set, where its gates
    come from, which implementation of the budget op serves this device (csrc C++/CUDA or the reference), and
    which tree fix-up verifies trees ("chains": no trees; cpu:csrc / cpu:torch; cuda:triton / cuda:torch)."""
    return (
        f"{STARTUP_PREFIX} max_depth={max_depth} k_max={settings.k_max} gate_mode={settings.gate_mode} "
        f"delta={settings.delta} warmup_steps={settings.warmup_steps} surplus_tail={settings.surplus_tail} "
        f"fault_limit={settings.fault_limit} request_history={getattr(settings, 'request_history', 0.0)} "
        f"calibration={calibration} budget_op={budget_op} trees={tree_fixup} vllm={vllm_version or 'unknown'} "
        f"runner={runner}"
    )
