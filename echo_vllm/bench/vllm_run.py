"""The driver of `bench vllm`: every batch size, rounds in rotating order, one fresh engine process per job.

Each job (echo_vllm.vllm.offline) builds the engine with max_num_seqs = batch size and prefix caching off, runs
the same untimed warm-up for every method (one full batch, long enough for ECHO's calibration:
`vllm_plan.warmup_tokens`), then times one generate of the prompts with ignore_eos, so every request emits
exactly max_tokens and every method does the same work. ECHO jobs also return the worker's echo_stats(), write
the per-step log, and (where this ECHO has a cost model) a budget profile into the job's own temporary
directory, from which the oracle bound is computed (echo_vllm.bench.oracle).

`runner` is `run_in_subprocess` in use and a fake in the tests.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo_vllm.bench.oracle import oracle_for_run
from echo_vllm.bench.vllm_plan import (
    CHAIN_METHODS,
    ECHO_METHODS,
    Variant,
    prompts_for_batch,
    round_orders,
    warmup_tokens,
)
from echo_vllm.bench.vllm_rows import add_eagle3_best, add_ratios, aggregate, measure, order_rows

Runner = Callable[..., dict[str, Any]]
STEP_LOG_ENV = "ECHO_VLLM_STEP_LOG"  # echo_vllm.vllm.proposer.STEP_LOG_ENV (not imported: it imports torch)
STEP_LOG_FLUSH_ENV = "ECHO_VLLM_STEP_LOG_FLUSH_S"  # echo_vllm.vllm.step_log.FLUSH_SECONDS_ENV


@dataclass(frozen=True)
class BenchPlan:
    testbed: Path
    variants: list[Variant]
    batch_sizes: list[int]
    rounds: int
    dataset: list[str]  # the prompt set, cycled by prompts_for_batch
    limit: int
    max_tokens: int
    warmup_steps: int
    waves: int = 1  # at least this many whole batches of prompts per batch size

    @property
    def warmup_max_tokens(self) -> int:
        depth = max([v.depth or 0 for v in self.variants] or [0])
        return warmup_tokens(self.max_tokens, self.warmup_steps, depth)

    def settings(self) -> dict[str, Any]:
        """What the JSON and the results line record about the run."""
        return {
            "variants": [v.label for v in self.variants],
            "batch_sizes": self.batch_sizes,
            "rounds": self.rounds,
            "limit": self.limit,
            "waves": self.waves,
            "max_tokens": self.max_tokens,
            "warmup_max_tokens": self.warmup_max_tokens,
            "warmup_prompts": "one full batch (the first batch_size prompts), ignore_eos",
            "echo_warmup_steps": self.warmup_steps,
            "temperature": 0.0,
            "ignore_eos": True,
            "enable_prefix_caching": False,
            "echo": {v.label: v.echo for v in self.variants if v.method in ECHO_METHODS},
        }


def budget_profile_supported() -> bool:
    """Whether this ECHO's settings have `budget_profile_file` (the cost model; validation refuses unknown keys)."""
    from echo_vllm.config import EchoSettings

    return "budget_profile_file" in EchoSettings.model_fields


def build_job(
    plan: BenchPlan, variant: Variant, batch_size: int, work: Path, *, profile_key: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """The offline job of one variant at one batch size, and the environment it needs (ECHO's step log)."""
    prompts = prompts_for_batch(plan.dataset, batch_size, plan.limit, plan.waves)
    spec = variant.speculative_config(plan.testbed / "eagle3")
    env: dict[str, str] = {}
    if variant.method in ECHO_METHODS:
        assert spec is not None
        if profile_key:  # per job: every round measures its own cost curve, none reuses another's
            spec["echo"]["budget_profile_file"] = str(work / "budget_profile.json")
        env[STEP_LOG_ENV] = str(work / "steps.jsonl")
        # Buffered to the end of each generate (the offline runner flushes it): no record is encoded in the timed
        # part, which no baseline pays for.
        env[STEP_LOG_FLUSH_ENV] = "0"
    job = {
        "model": str(plan.testbed / "target"),
        "prompts": prompts,
        "max_tokens": plan.max_tokens,
        "ignore_eos": True,
        "max_num_seqs": batch_size,
        "speculative_config": spec,
        "extra": {"enable_prefix_caching": False},
        "warmup_prompts": prompts[:batch_size],
        "warmup_max_tokens": plan.warmup_max_tokens,
        "echo_stats": variant.method in ECHO_METHODS,
        "steady_window": True,  # the full-engine part of the timed generate, timed on its own (vllm_rows)
    }
    return job, env


def _oracle(out: dict[str, Any], env: dict[str, str], job: dict[str, Any], fallback: Path | None) -> dict[str, Any]:
    """The run's oracle bound on its own cost curve, or on `fallback` (echo-auto's at the same batch size)."""
    stats = out.get("echo_stats") or {}
    profile = stats.get("budget_profile_file") if isinstance(stats, dict) else None
    profile = profile or (job["speculative_config"]["echo"].get("budget_profile_file"))
    if (profile is None or not Path(profile).is_file()) and fallback is not None:
        profile = str(fallback)
    bound = oracle_for_run(env.get(STEP_LOG_ENV), int(out.get("step_log_offset") or 0), profile)
    return bound.as_dict()


def finish_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """eagle3-best, the ratios, the row order: what the rows of finished batch sizes need before they are shown."""
    return order_rows(add_ratios(add_eagle3_best([r for r in rows if r["method"] != "eagle3-best"])))


def run_bench(
    plan: BenchPlan,
    runner: Runner,
    log: Callable[[str], None] = print,
    on_batch_done: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the plan; returns {"results": rows, "round_log": one entry per job, "torch_threads": ...}.

    `on_batch_done` gets the outcome so far after each batch size (a long run that dies keeps what it measured).
    """
    profile_key = budget_profile_supported()
    rows: list[dict[str, Any]] = []
    round_log: list[dict[str, Any]] = []
    torch_threads = None
    orders = round_orders(plan.variants, plan.rounds)
    for batch_size in plan.batch_sizes:
        measured: dict[str, list[dict[str, Any]]] = {v.label: [] for v in plan.variants}
        tokens: dict[str, list[list[list[int]]]] = {v.label: [] for v in plan.variants}
        errors: dict[str, list[str]] = {v.label: [] for v in plan.variants}
        # One work directory per batch size, kept until its rounds are done: the oracle bound of a fixed-K_max ECHO
        # run (which fits no cost model of its own) uses the cost curve echo-auto measured at the same batch size.
        with tempfile.TemporaryDirectory(prefix="echo-bench-") as batch_dir:
            pending: list[tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, Any], int, Variant]] = []
            for r, order in enumerate(orders):
                for variant in order:
                    work = Path(batch_dir) / f"r{r}-{variant.label}"
                    work.mkdir()
                    job, env = build_job(plan, variant, batch_size, work, profile_key=profile_key)
                    log(f"[bench vllm] batch={batch_size} round={r + 1}/{plan.rounds} {variant.label} ...")
                    try:
                        out = runner(job, extra_env=env)
                    except (RuntimeError, subprocess.SubprocessError) as err:  # a failed or timed-out job
                        errors[variant.label].append(str(err).strip().splitlines()[-1] if str(err) else repr(err))
                        round_log.append(
                            {
                                "batch_size": batch_size,
                                "round": r,
                                "label": variant.label,
                                "error": errors[variant.label][-1],
                            }
                        )
                        log(f"[bench vllm]   FAILED: {errors[variant.label][-1]}")
                        continue
                    figures = measure(variant, out, None)
                    if variant.method in CHAIN_METHODS:
                        pending.append((figures, out, env, job, r, variant))
                    elif variant.method in ECHO_METHODS:
                        figures.update({"oracle_ratio": None, "oracle_reason": "the oracle bound covers chains only"})
                    torch_threads = torch_threads or out.get("torch_threads")
                    measured[variant.label].append(figures)
                    tokens[variant.label].append(out["token_ids"])
                    round_log.append(
                        {"batch_size": batch_size, "round": r, "position": order.index(variant), "label": variant.label}
                        | {k: figures[k] for k in ("tokens_per_s", "generate_seconds", "num_generated", "engine_steps")}
                    )
                    log(f"[bench vllm]   {figures['tokens_per_s']:.1f} tok/s")
            profiles = {
                r: Path(batch_dir) / f"r{r}-{v.label}" / "budget_profile.json"
                for (_, _, _, _, r, v) in pending
                if v.method == "echo-auto"
            }
            for figures, out, env, job, r, _variant in pending:
                fallback = profiles.get(r) if profiles.get(r) and profiles[r].is_file() else None
                if fallback is None:
                    fallback = next((p for p in profiles.values() if p.is_file()), None)
                figures.update(_oracle(out, env, job, fallback))
        baseline = tokens["nospec"][0] if tokens["nospec"] else None
        for variant in plan.variants:
            same = [baseline is not None and t == baseline for t in tokens[variant.label]]
            rows.append(aggregate(variant, batch_size, measured[variant.label], same, errors[variant.label]))
        if on_batch_done is not None:
            on_batch_done({"results": finish_rows(rows), "round_log": round_log, "torch_threads": torch_threads})
    return {"results": finish_rows(rows), "round_log": round_log, "torch_threads": torch_threads}
