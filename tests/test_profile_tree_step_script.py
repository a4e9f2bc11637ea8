"""scripts/profile_tree_step.py: the summary's phase and work splits of a job's steps (pure parts)."""

from __future__ import annotations

from script_module import load_script


def _job() -> tuple[list[tuple[int, int, int]], list[float]]:
    # (requests, tokens in the forward, drafts verified) per step, and each step's seconds
    sched = [
        (2, 300, 0),  # ramp: prompts of two requests
        (4, 400, 2),  # full, with prompt tokens: 400 - 4 - 2 = 394
        (4, 12, 8),  # full, decode only
        (4, 60, 6),  # full, prompt tokens: 50
        (4, 10, 6),  # full, decode only
        (3, 9, 6),  # drain
        (1, 3, 2),  # drain
    ]
    times = [0.5, 0.4, 0.05, 0.1, 0.05, 0.04, 0.02]
    return sched, times


def test_the_phase_split_puts_the_ramp_the_full_phase_and_the_drain_apart() -> None:
    script = load_script("profile_tree_step")
    sched, times = _job()
    assert (
        script.phase_split(sched, times, 4) == "phases: ramp 1 steps 0.50 s, full 4 steps 0.60 s, drain 2 steps 0.06 s"
    )


def test_the_work_split_counts_prompt_steps_decode_steps_and_the_drains_request_steps() -> None:
    script = load_script("profile_tree_step")
    sched, times = _job()
    line = script.work_split(sched, times, 4)
    # Before the drain, the ramp step and two full steps carry prompt tokens: 298 + 394 + 50.
    assert line == (
        "work: prompt steps 3 (1.00 s, 742 prompt tokens), decode-only steps 2 (0.10 s) before the drain; "
        "drain 4 request-steps"
    )
    assert script.work_split(sched[:1], times[:1], 4) == "work: no full step"
