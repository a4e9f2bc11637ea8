"""The soak, start to finish: ECHO server -> warm-up -> soak traffic -> checks -> no-spec replay -> report.

Only one server runs at a time (two would share the same few CPU cores and distort each other's batching): the
no-spec server starts after the ECHO server is stopped and replays the temperature-0 requests that completed,
at the same concurrency.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from echo_vllm.soak import checks as ck
from echo_vllm.soak.client import (
    COMPLETED,
    ERROR,
    SERVER_KEEPALIVE_S,
    RequestResult,
    TrafficRun,
    run_traffic_sync,
)
from echo_vllm.soak.config import SoakConfig
from echo_vllm.soak.procs import (
    Server,
    ServerError,
    ServerSpec,
    free_port,
    log_tail,
    serve_argv,
    sigterm_as_exit,
    tree_rss_bytes,
)
from echo_vllm.soak.prompts import build_prompts
from echo_vllm.soak.report import MIB, error_samples, summary_lines, traffic_figures, write_json
from echo_vllm.soak.traffic import RequestSpec, build_mix, hostile_counts

LOG_TAIL_LINES = 40
PLATEAU_MIN_SPAN_S = 120.0  # shorter soaks are still in the allocator's warm-up phase (docs/soak.md)


@dataclass
class EchoPhase:
    """Everything measured on the ECHO server."""

    ready_s: float
    idle: dict[str, float | None]
    warmup: TrafficRun
    soak: TrafficRun
    specs: list[RequestSpec]
    memory_before: int
    memory_after: int
    memory_peak: int
    memory_timeline: list[tuple[float, int]]
    after: dict[str, float | None]
    settle_wait_s: float
    health: tuple[int | None, int | None, str]
    stats: dict[str, Any] | None
    tracebacks: int


@dataclass
class NospecPhase:
    ready_s: float
    compared: int
    mismatches: list[ck.Mismatch]
    self_flips: list[ck.Mismatch] | None = None  # no-spec run 1 vs run 2, only when there were mismatches
    replay_wall_s: float = 0.0
    errors: list[dict[str, Any]] = field(default_factory=list)


class MemorySampler:
    """Samples the server tree's total VmRSS in a thread: the peak, and a timeline to tell a plateau from a leak."""

    def __init__(self, pid: int, interval_s: float = 2.0) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, int]] = []  # (seconds since start, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append((round(time.monotonic() - self._t0, 1), rss_total(self.pid)))

    @property
    def peak(self) -> int:
        return max((b for _, b in self.samples), default=0)

    def __enter__(self) -> MemorySampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def rss_total(pid: int) -> int:
    return sum(tree_rss_bytes(pid).values())


def server_env(cfg: SoakConfig) -> dict[str, str]:
    from echo_vllm.runtime_env import cpu_runtime_env

    env = cpu_runtime_env(os.environ, in_process=False)
    env.setdefault("ECHO_VLLM_LOG_INTERVAL", str(cfg.log_interval_s))  # the soak reads the last stats line
    # Set, not defaulted: the soak's zero-error checks rely on the server outliving the client's idle connections.
    env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(SERVER_KEEPALIVE_S)
    return env


def make_server(cfg: SoakConfig, name: str, speculative: bool) -> Server:
    port = free_port()
    argv = serve_argv(
        str(cfg.model),
        port=port,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        speculative_config=cfg.write_speculative_config() if speculative else None,
    )
    return Server(
        ServerSpec(name=name, argv=argv, env=server_env(cfg), log_path=cfg.out_dir / f"{name}_server.log", port=port)
    )


def _http() -> Any:
    import httpx

    return httpx.Client(timeout=60, trust_env=False)  # trust_env=False: never a proxy for 127.0.0.1


def _settle(http: Any, base_url: str, idle_kv: float | None, timeout_s: float) -> tuple[dict[str, float | None], float]:
    import httpx

    try:
        return ck.settle(http, base_url, idle_kv, timeout_s)
    except httpx.HTTPError:  # a dead server: the idle and health checks report it
        return {ck.RUNNING: None, ck.WAITING: None, ck.KV_USAGE: None}, 0.0


def run_echo_phase(cfg: SoakConfig) -> EchoPhase:
    server = make_server(cfg, "echo", speculative=True)
    with server, _http() as http:
        ready_s = server.wait_ready(cfg.ready_timeout_s)
        base, model = server.spec.base_url, str(cfg.model)
        idle = ck.engine_gauges(ck.read_metrics(http, base))  # before any traffic: the idle KV usage
        prompts = build_prompts(http, base, model, max_model_len=cfg.max_model_len, seed=cfg.seed)
        log(f"echo server ready in {ready_s:.0f} s on {base}; warm-up burst of {cfg.warmup_requests} requests")
        warm_specs = build_mix(
            cfg.warmup_requests,
            model,
            prompts,
            seed=cfg.seed + 1_000_003,
            max_model_len=cfg.max_model_len,
            allow_hostile=False,
            per_request_seed=cfg.per_request_seed,
        )
        warmup = run_traffic_sync(
            base, warm_specs, concurrency=cfg.concurrency, request_timeout_s=cfg.request_timeout_s
        )
        _settle(http, base, idle[ck.KV_USAGE], cfg.settle_s)
        before = rss_total(server.pid)
        specs = build_mix(
            cfg.requests,
            model,
            prompts,
            seed=cfg.seed,
            max_model_len=cfg.max_model_len,
            per_request_seed=cfg.per_request_seed,
        )
        log(
            f"soak: {cfg.requests} requests ({hostile_counts(specs)} hostile) at concurrency {cfg.concurrency}, "
            f"at most {cfg.duration_s:.0f} s"
        )
        with MemorySampler(server.pid) as sampler:
            soak = run_traffic_sync(
                base,
                specs,
                concurrency=cfg.concurrency,
                duration_s=cfg.duration_s,
                request_timeout_s=cfg.request_timeout_s,
            )
        after, waited = _settle(http, base, idle[ck.KV_USAGE], cfg.settle_s)
        after_rss = rss_total(server.pid)
        health = ck.probe_health(http, base, model)
        # Read the log before stopping: vLLM's own shutdown may log a traceback (EngineDeadError) after SIGTERM.
        stats, tracebacks = ck.last_echo_stats(server.spec.log_path), ck.count_tracebacks(server.spec.log_path)
    return EchoPhase(
        ready_s=ready_s,
        idle=idle,
        warmup=warmup,
        soak=soak,
        specs=specs,
        memory_before=before,
        memory_after=after_rss,
        memory_peak=max(sampler.peak, after_rss),
        memory_timeline=sampler.samples,
        after=after,
        settle_wait_s=waited,
        health=health,
        stats=stats,
        tracebacks=tracebacks,
    )


def replay_specs(echo: EchoPhase) -> list[RequestSpec]:
    """The temperature-0 requests that completed on the ECHO server (disconnects and hostile ones excluded)."""
    done = {r.index for r in echo.soak.results if r.outcome == COMPLETED}
    return [s for s in echo.specs if s.comparable and s.index in done]


def run_nospec_phase(cfg: SoakConfig, echo: EchoPhase) -> NospecPhase:
    specs = replay_specs(echo)
    echo_results = {r.index: r for r in echo.soak.results}
    server = make_server(cfg, "nospec", speculative=False)
    with server:
        ready_s = server.wait_ready(cfg.ready_timeout_s)
        log(f"no-spec server ready in {ready_s:.0f} s; replaying {len(specs)} temperature-0 requests")
        first = run_traffic_sync(
            server.spec.base_url, specs, concurrency=cfg.concurrency, request_timeout_s=cfg.request_timeout_s
        )
        ref = _by_index(first.results)
        mismatches = ck.compare_greedy(echo_results, ref)
        phase = NospecPhase(
            ready_s=ready_s,
            compared=len(specs),
            mismatches=mismatches,
            replay_wall_s=first.wall_s,
            errors=error_samples(first.results),
        )
        if mismatches:
            # Is it batch-dependent rounding? Then the no-spec server disagrees with itself the same way.
            log(f"{len(mismatches)} greedy mismatches: replaying once more on the no-spec server")
            second = run_traffic_sync(
                server.spec.base_url, specs, concurrency=cfg.concurrency, request_timeout_s=cfg.request_timeout_s
            )
            phase.self_flips = ck.compare_greedy(ref, _by_index(second.results))
    return phase


def _by_index(results: list[RequestResult]) -> dict[int, RequestResult]:
    return {r.index: r for r in results}


def _error_line(result: RequestResult) -> str:
    return f"{result.label}: {result.error}" + (f": {result.detail}" if result.detail else "")


def build_checks(cfg: SoakConfig, echo: EchoPhase, nospec: NospecPhase) -> list[ck.Check]:
    warm_errors = [r for r in echo.warmup.results if r.outcome == ERROR]
    warm_retried = [r for r in echo.warmup.results if r.retries]
    checks = [
        ck.Check(
            "warm-up burst without errors",
            not warm_errors,
            f"{len(warm_errors)} errors in {len(echo.warmup.results)} requests"
            + (f" (first: {_error_line(warm_errors[0])})" if warm_errors else "")
            + (
                f"; {len(warm_retried)} retried a connection error (first: {warm_retried[0].retried[0]})"
                if warm_retried
                else ""
            ),
        ),
        ck.check_health(*echo.health),
        ck.check_accounting(echo.soak.results),
        ck.check_hostile(echo.soak.results),
        ck.check_idle(echo.after, echo.idle[ck.KV_USAGE], echo.settle_wait_s),
        ck.check_memory(echo.memory_before, echo.memory_after, cfg.memory_bound_mib * MIB),
        ck.check_plateau(echo.memory_timeline, cfg.plateau_bound_mib * MIB, PLATEAU_MIN_SPAN_S),
        ck.check_echo_stats(echo.stats, cfg.k_max),
        ck.Check("server log has no traceback", echo.tracebacks == 0, f"{echo.tracebacks} tracebacks"),
    ]
    checks.append(ck.check_greedy(nospec.compared, nospec.mismatches, nospec.self_flips))
    return checks


def figures_of(cfg: SoakConfig, echo: EchoPhase, nospec: NospecPhase) -> dict[str, Any]:
    return {
        "traffic": traffic_figures(echo.soak.results, echo.soak.not_sent, echo.soak.wall_s),
        "warmup": traffic_figures(echo.warmup.results, echo.warmup.not_sent, echo.warmup.wall_s),
        "memory": {
            "before_bytes": echo.memory_before,
            "after_bytes": echo.memory_after,
            "growth_bytes": echo.memory_after - echo.memory_before,
            "peak_bytes": echo.memory_peak,
            "bound_bytes": cfg.memory_bound_mib * MIB,
            "growth_second_half_bytes": ck.second_half_growth(echo.memory_timeline),
            "second_half_bound_bytes": cfg.plateau_bound_mib * MIB,
            "timeline_s_bytes": echo.memory_timeline,
        },
        "metrics_idle_before": echo.idle,
        "metrics_after": echo.after,
        "settle_wait_s": echo.settle_wait_s,
        "server_ready_s": {"echo": echo.ready_s, "nospec": nospec.ready_s},
        "greedy": {
            "compared": nospec.compared,
            "mismatches": len(nospec.mismatches),
            "nospec_self_flips": None if nospec.self_flips is None else len(nospec.self_flips),
            "replay_wall_s": nospec.replay_wall_s,
        },
        "echo_stats": echo.stats,
        "server_tracebacks": echo.tracebacks,
    }


def log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


def run_soak(cfg: SoakConfig) -> int:
    """The whole soak; 0 if every check passed, 1 otherwise. Servers are stopped on any exit (incl. Ctrl-C)."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    echo_log = cfg.out_dir / "echo_server.log"
    with sigterm_as_exit():
        try:
            echo = run_echo_phase(cfg)
            nospec = run_nospec_phase(cfg, echo)
        except ServerError as err:
            print(log_tail(err.log_path, LOG_TAIL_LINES), file=sys.stderr)
            raise
    checks = build_checks(cfg, echo, nospec)
    figures = figures_of(cfg, echo, nospec)
    print("\n".join(summary_lines(figures, checks)))
    extra = {
        "errors": error_samples(echo.soak.results),
        "mismatches": [vars(m) for m in nospec.mismatches],
        "nospec_self_flips": [vars(m) for m in nospec.self_flips or []],
        "nospec_replay_errors": nospec.errors,
        "logs": {"echo": str(echo_log), "nospec": str(cfg.out_dir / "nospec_server.log")},
    }
    if cfg.json_path is not None:
        write_json(cfg.json_path, cfg.as_dict(), figures, checks, extra)
    passed = all(c.passed for c in checks)
    if not passed:
        print(f"\nsoak FAILED; echo server log: {echo_log} (last {LOG_TAIL_LINES} lines):", file=sys.stderr)
        print(log_tail(echo_log, LOG_TAIL_LINES), file=sys.stderr)
    return 0 if passed else 1
