"""Fault containment for ECHO inside a vLLM worker: a fault in ECHO must never take the engine down.

Drafts are optional for correctness: a step whose drafts are empty is plain decoding, and the target alone
decides every token. So `EchoProposer` runs each of its stages (drafting, gates, selection, verification
feedback) under one `FaultGuard`: an exception there makes that step run without drafts, its cause is logged
once (with a traceback) and counted afterwards, and after `fault_limit` consecutive faulty steps ECHO turns
itself off for the life of the process with one loud log line (no drafting at all from then on).

`ECHO_VLLM_FAULTS=raise` (for tests and debugging) re-raises every fault after it is counted, so an ECHO bug
fails the test that meets it instead of being contained; the test suite sets it (tests/conftest.py), except in
the fault-injection tests. Unset, or `contain`, is the production behaviour.

Tensor parallelism: every rank runs the same stages on the same tensors, so a fault that follows from the inputs
(a bug) happens on every rank in the same step and every rank disables ECHO in the same step. A fault local to
one rank inside the head's forward (which has TP collectives) cannot be contained without a collective; the
stages after drafting have none.

Test-only fault injection: `ECHO_VLLM_INJECT_FAULT=<stage>[:<every>]` raises `InjectedFault` in `<stage>` on
every `<every>`-th entry (default 1: every entry), for tests that must show output stays identical to no-spec.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections import Counter
from dataclasses import dataclass, field

from echo_vllm.config import EchoConfigError

logger = logging.getLogger("vllm.echo_vllm")

INJECT_ENV = "ECHO_VLLM_INJECT_FAULT"
MODE_ENV = "ECHO_VLLM_FAULTS"
MODES = ("contain", "raise")
STAGES = ("draft", "gates", "select", "feedback")


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection (ECHO_VLLM_INJECT_FAULT)."""


@dataclass(frozen=True)
class FaultInjection:
    stage: str
    every: int = 1

    @classmethod
    def from_env(cls, value: str | None) -> FaultInjection | None:
        if not value:
            return None
        stage, _, every = value.partition(":")
        if stage not in STAGES or (every and (not every.isdigit() or int(every) < 1)):
            raise EchoConfigError(
                f"{INJECT_ENV}={value!r}: expected <stage>[:<every>] with stage one of {', '.join(STAGES)} and "
                "every an integer >= 1 (a test-only switch; unset it)"
            )
        return cls(stage, int(every) if every else 1)


@dataclass
class FaultGuard:
    """Counts and logs ECHO's faults; `disabled` turns true after `limit` consecutive faulty steps."""

    limit: int
    injection: FaultInjection | None = None
    should_raise: bool = False  # ECHO_VLLM_FAULTS=raise: count, log, then re-raise (tests)
    disabled: bool = False
    consecutive: int = 0
    total: int = 0
    by_cause: Counter[str] = field(default_factory=Counter)
    _entries: Counter[str] = field(default_factory=Counter)

    def maybe_inject(self, stage: str) -> None:
        """Test-only: raise InjectedFault on every `every`-th entry of `stage` (no-op unless configured)."""
        if self.injection is None or self.injection.stage != stage:
            return
        self._entries[stage] += 1
        if self._entries[stage] % self.injection.every == 0:
            raise InjectedFault(f"injected fault in {stage} ({INJECT_ENV})")

    def record_fault(self, stage: str, err: BaseException) -> None:
        """One faulty step: log the cause the first time it is seen, count it, disable after `limit` in a row."""
        cause = f"{stage}: {type(err).__name__}: {err}"[:300]
        first = cause not in self.by_cause
        self.by_cause[cause] += 1
        self.total += 1
        self.consecutive += 1
        if first:
            logger.warning(
                "ECHO fault in %s; this step runs without drafts (plain decoding, still exact). Further faults "
                "with this cause are counted, not logged (see 'ECHO stats'):\n%s",
                stage,
                "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip(),
            )
        if not self.disabled and self.consecutive >= self.limit:
            self.disabled = True
            logger.error(
                "ECHO DISABLED for this process after %d consecutive faulty steps (last: %s; %d faults in total: "
                "%s). The engine keeps serving without speculative decoding; restart it to re-enable ECHO.",
                self.consecutive,
                cause,
                self.total,
                dict(self.by_cause),
            )

    def record_success(self) -> None:
        self.consecutive = 0

    def summary(self) -> dict[str, object]:
        return {"faults": self.total, "disabled": self.disabled, "fault_causes": dict(self.by_cause)}


def guard_from_env(limit: int) -> FaultGuard:
    mode = os.environ.get(MODE_ENV) or "contain"
    if mode not in MODES:
        raise EchoConfigError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(MODES)} (or unset it)")
    return FaultGuard(
        limit=limit, injection=FaultInjection.from_env(os.environ.get(INJECT_ENV)), should_raise=mode == "raise"
    )
