"""The soak's checks: each takes measured figures and returns a `Check` (name, passed, one-line detail).

Also the probes they need: vLLM's Prometheus /metrics, the settle wait after traffic, the health probe, the
greedy comparison against the no-spec server, and the `ECHO stats:` line of the server log.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo_vllm.soak.client import CLIENT_CANCELLED, COMPLETED, ERROR, HOSTILE_4XX, RequestResult

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"  # vLLM 0.32's name (a fraction 0..1 despite the suffix)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


# ------------------------------------------------------------------------------------------------------------
# Probes
# ------------------------------------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets} (one engine: one label set)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            try:
                out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(3))
            except ValueError:
                continue
    return out


def read_metrics(http: Any, base_url: str) -> dict[str, float]:
    resp = http.get(f"{base_url}/metrics")
    resp.raise_for_status()
    return parse_metrics(resp.text)


def engine_gauges(metrics: dict[str, float]) -> dict[str, float | None]:
    return {name: metrics.get(name) for name in (RUNNING, WAITING, KV_USAGE)}


def settle(http: Any, base_url: str, idle_kv: float | None, timeout_s: float) -> tuple[dict[str, float | None], float]:
    """Poll /metrics until nothing runs or waits and KV usage is back to `idle_kv`; (last gauges, seconds waited).

    Aborts of disconnected streams and the last detokenizations reach the scheduler a moment after the last
    response, so an immediate read can show a request still running.
    """
    t0 = time.monotonic()
    while True:
        gauges = engine_gauges(read_metrics(http, base_url))
        if is_idle(gauges, idle_kv) or time.monotonic() - t0 > timeout_s:
            return gauges, time.monotonic() - t0
        time.sleep(0.5)


def is_idle(gauges: dict[str, float | None], idle_kv: float | None) -> bool:
    kv = gauges.get(KV_USAGE)
    kv_ok = kv is not None and idle_kv is not None and abs(kv - idle_kv) < 1e-6
    return gauges.get(RUNNING) == 0 and gauges.get(WAITING) == 0 and kv_ok


def probe_health(http: Any, base_url: str, model: str) -> tuple[int | None, int | None, str]:
    """(/health status, status of a small completion, its text); None for a status that never came."""
    import httpx

    health = completion = None
    text = ""
    try:
        health = http.get(f"{base_url}/health").status_code
        resp = http.post(
            f"{base_url}/v1/completions",
            json={"model": model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0},
        )
        completion = resp.status_code
        if completion == 200:
            text = resp.json()["choices"][0]["text"]
    except httpx.HTTPError as err:
        text = f"{type(err).__name__}: {err}"
    return health, completion, text


_STATS = re.compile(r"ECHO stats: (.*)$")
_INT = re.compile(r"^-?\d+$")
_FLOAT = re.compile(r"^-?\d+\.\d+$|^nan$")


def last_echo_stats(log_path: Path) -> dict[str, Any] | None:
    """The last `ECHO stats:` line of the server log as a dict (cumulative figures since engine start)."""
    line = None
    for raw in log_path.read_text(errors="replace").splitlines():
        match = _STATS.search(raw)
        if match:
            line = match.group(1)
    if line is None:
        return None
    stats: dict[str, Any] = {"line": line}
    for key, value in re.findall(r"([A-Za-z_/]+)=(\[[^\]]*\]|\S+)", line):
        stats[key] = int(value) if _INT.match(value) else float(value) if _FLOAT.match(value) else value
    calibration = re.search(r"calibration=(.*) sweet_spots=", line)  # the value may contain spaces
    if calibration:
        stats["calibration"] = calibration.group(1)
    paren = re.search(r"\(mean sum ([\d.]+) / k_max (\d+|auto), max sum (\d+), bound steps (\d+)\)", line)
    if paren:
        stats.update(
            mean_step_sum=float(paren.group(1)),
            k_max=int(paren.group(2)) if paren.group(2).isdigit() else paren.group(2),
            max_step_sum=int(paren.group(3)),
            budget_bound_steps=int(paren.group(4)),
        )
    return stats


def count_tracebacks(log_path: Path) -> int:
    return log_path.read_text(errors="replace").count("Traceback (most recent call last)")


# ------------------------------------------------------------------------------------------------------------
# Greedy comparison
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    index: int
    label: str
    field: str  # "text", "token_ids" or "outcome"
    first_diff: int  # first differing position (characters or tokens)
    echo: str
    nospec: str


def compare_greedy(echo: dict[int, RequestResult], nospec: dict[int, RequestResult]) -> list[Mismatch]:
    """Every replayed request must have the same outcome, text and token ids on both servers."""
    out = []
    for index, ref in sorted(nospec.items()):
        got = echo[index]
        if ref.outcome != COMPLETED:
            out.append(Mismatch(index, got.label, "outcome", 0, got.outcome, f"{ref.outcome} {ref.error or ''}"))
        elif got.token_ids != ref.token_ids:
            a, b = got.token_ids[0], ref.token_ids[0]
            out.append(Mismatch(index, got.label, "token_ids", _first_diff(a, b), str(a[:40]), str(b[:40])))
        elif got.texts != ref.texts:
            a, b = got.texts[0], ref.texts[0]
            out.append(Mismatch(index, got.label, "text", _first_diff(a, b), a[:120], b[:120]))
    return out


def _first_diff(a: Any, b: Any) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# ------------------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------------------


def check_health(health: int | None, completion: int | None, text: str) -> Check:
    ok = health == 200 and completion == 200 and bool(text)
    return Check("server healthy after soak", ok, f"/health {health}, completion {completion} ({text[:40]!r})")


def check_accounting(results: list[RequestResult]) -> Check:
    counts = Counter(r.outcome for r in results)
    accounted = counts[COMPLETED] + counts[CLIENT_CANCELLED] + counts[HOSTILE_4XX]
    detail = (
        f"sent {len(results)} = completed {counts[COMPLETED]} + client-cancelled {counts[CLIENT_CANCELLED]} "
        f"+ hostile-4xx {counts[HOSTILE_4XX]} (+ errors {counts[ERROR]})"
    )
    return Check("no request lost or failed", accounted == len(results) and counts[ERROR] == 0, detail)


def check_hostile(results: list[RequestResult]) -> Check:
    hostile = [r for r in results if r.label.startswith("hostile:")]
    bad = [r for r in hostile if r.outcome != HOSTILE_4XX]
    detail = f"{len(hostile) - len(bad)} of {len(hostile)} got a 4xx with an error message"
    if bad:
        detail += "; " + ", ".join(f"#{r.index} {r.label}: {r.error}" for r in bad[:3])
    return Check("hostile requests get 4xx", not bad and bool(hostile), detail)


def check_idle(gauges: dict[str, float | None], idle_kv: float | None, waited_s: float) -> Check:
    detail = (
        f"running {gauges.get(RUNNING)}, waiting {gauges.get(WAITING)}, KV usage {gauges.get(KV_USAGE)} "
        f"(idle {idle_kv}) after {waited_s:.1f} s settle"
    )
    return Check("engine idle after soak", is_idle(gauges, idle_kv), detail)


def check_memory(before: int, after: int, bound: int) -> Check:
    growth = after - before
    mib = 1 << 20
    detail = (
        f"{before / mib:.0f} -> {after / mib:.0f} MiB (growth {growth / mib:+.0f} MiB, bound {bound / mib:.0f} MiB)"
    )
    return Check("server memory growth bounded", growth < bound, detail)


def second_half_growth(timeline: list[tuple[float, int]]) -> int | None:
    """RSS growth over the second half of the soak: near 0 once it plateaus, about half the total for a leak."""
    if len(timeline) < 4:
        return None
    return timeline[-1][1] - timeline[len(timeline) // 2][1]


def check_plateau(timeline: list[tuple[float, int]], bound: int, min_span_s: float) -> Check:
    """A leak grows with the requests served; the allocator warm-up of a fresh server levels off."""
    name = "server memory levels off (2nd half)"
    growth = second_half_growth(timeline)
    span = timeline[-1][0] if timeline else 0.0
    if growth is None or span < min_span_s:
        return Check(name, True, f"not checked: {span:.0f} s of samples, needs {min_span_s:.0f} s")
    detail = (
        f"growth over the last {span - timeline[len(timeline) // 2][0]:.0f} s {growth / (1 << 20):+.0f} MiB "
        f"(bound {bound / (1 << 20):.0f} MiB)"
    )
    return Check(name, growth < bound, detail)


def check_greedy(compared: int, mismatches: list[Mismatch], nospec_flips: list[Mismatch] | None) -> Check:
    detail = f"{compared - len(mismatches)} of {compared} temperature-0 requests equal the no-spec server"
    if mismatches:
        m = mismatches[0]
        detail += f"; first: #{m.index} {m.label} {m.field} differs at {m.first_diff}"
        if nospec_flips is not None:
            detail += f"; no-spec vs itself: {len(nospec_flips)} differ"
    return Check("greedy == no-spec, token for token", compared > 0 and not mismatches, detail)


def check_echo_stats(stats: dict[str, Any] | None, k_max: int) -> Check:
    if stats is None:
        return Check("ECHO active, budget held", False, "no `ECHO stats:` line in the server log")
    max_sum = stats.get("max_step_sum")
    ok = isinstance(max_sum, int) and max_sum <= k_max and stats.get("k_max") == k_max
    detail = (
        f"max step sum {max_sum} <= k_max {stats.get('k_max')}, bound steps {stats.get('budget_bound_steps')}, "
        f"steps {stats.get('steps')}"
    )
    return Check("ECHO active, budget held", ok, detail)
