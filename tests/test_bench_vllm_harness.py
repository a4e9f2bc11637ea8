"""`bench vllm` without an engine: plan, rotation, medians, eagle3-best, ratios, table, JSON contract, plot, CLI.

The engine is replaced by a fake runner whose outputs are synthetic but shaped like echo_vllm.vllm.offline's, so
every figure the harness derives is checked against numbers computed by hand here.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from echo_vllm.bench import vllm_cli
from echo_vllm.bench.spread import spread
from echo_vllm.bench.vllm_plan import (
    BenchPlanError,
    Variant,
    expand_variants,
    prompts_for_batch,
    round_orders,
    warmup_tokens,
)
from echo_vllm.bench.vllm_rows import add_eagle3_best, add_ratios, measure, request_steps
from echo_vllm.bench.vllm_run import BenchPlan, build_job, run_bench
from echo_vllm.bench.vllm_table import footnotes, format_results, ratio_summary
from echo_vllm.cli import build_parser

ECHO = {"k_max": 8, "top_k": 1, "warmup_steps": 4, "surplus_tail": True}
TOKENS = [[1, 2, 3], [4, 5, 6]]


# --------------------------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------------------------


def test_rounds_rotate_the_order():
    a, b, c = Variant("nospec"), Variant("eagle3", 1), Variant("echo", 4)
    orders = round_orders([a, b, c], 4)
    assert orders == [[a, b, c], [b, c, a], [c, a, b], [a, b, c]]
    # Every variant takes every position once in any 3 consecutive rounds.
    for variant in (a, b, c):
        assert sorted(order.index(variant) for order in orders[:3]) == [0, 1, 2]
    with pytest.raises(BenchPlanError, match="rounds"):
        round_orders([a], 0)


def test_variants_expand_eagle3_depths_and_echo_auto():
    variants = expand_variants(["eagle3", "echo", "echo-auto"], [1, 2, 2, 4], 4, ECHO)
    assert [v.label for v in variants] == ["nospec", "eagle3@1", "eagle3@2", "eagle3@4", "echo", "echo-auto"]
    head = Path("/head")
    auto = variants[-1].speculative_config(head)
    assert auto["echo"]["k_max"] == "auto" and auto["method"] == "echo" and auto["num_speculative_tokens"] == 4
    assert variants[-2].speculative_config(head)["echo"]["k_max"] == 8
    assert variants[2].speculative_config(head) == {"method": "eagle3", "model": "/head", "num_speculative_tokens": 2}
    assert variants[0].speculative_config(head) is None
    with pytest.raises(BenchPlanError, match="medusa"):
        expand_variants(["nospec", "medusa"], [1], 4, ECHO)
    with pytest.raises(BenchPlanError, match="eagle3-depths"):
        expand_variants(["eagle3"], [0, 2], 4, ECHO)


def test_echo_tree_is_the_auto_budget_with_trees_and_the_others_verify_chains():
    variants = expand_variants(["echo", "echo-auto", "echo-tree"], [], 4, {**ECHO, "top_k": 3}, tree_top_k=3)
    blocks = {v.label: v.speculative_config(Path("/head"))["echo"] for v in variants[1:]}
    assert blocks["echo"]["top_k"] == 1 and blocks["echo-auto"]["top_k"] == 1
    assert blocks["echo-tree"] == {**ECHO, "k_max": "auto", "top_k": 3}
    with pytest.raises(BenchPlanError, match="top-k"):
        expand_variants(["echo-tree"], [], 4, ECHO, tree_top_k=1)


def test_prompts_fill_whole_batches_cycling_the_dataset():
    data = ["a", "b", "c"]
    assert prompts_for_batch(data, 4, 2) == ["a", "b", "c", "a"]  # at least one full batch
    assert prompts_for_batch(data, 4, 5) == ["a", "b", "c", "a", "b", "c", "a", "b"]  # rounded up to 2 batches
    assert prompts_for_batch(data, 1, 2) == ["a", "b"]
    # At least `waves` whole batches: one or two batches are mostly ramp-up and drain (speculation pays them).
    assert prompts_for_batch(data, 4, 2, waves=3) == ["a", "b", "c"] * 4
    assert prompts_for_batch(data, 1, 5, waves=3) == ["a", "b", "c", "a", "b"]  # the limit is more already
    with pytest.raises(BenchPlanError, match="--waves"):
        prompts_for_batch(data, 4, 2, waves=0)


def test_warmup_is_long_enough_for_echo_calibration():
    # A request of T tokens takes at least T / (1 + D) steps; the warm-up must hold warmup_steps of them.
    tokens = warmup_tokens(max_tokens=8, warmup_steps=16, max_depth=4)
    assert tokens // (1 + 4) >= 16
    assert warmup_tokens(max_tokens=500, warmup_steps=16, max_depth=4) == 500


def _plan(tmp_path: Path, variants: list[Variant], batch_sizes=(2,), rounds=3) -> BenchPlan:
    return BenchPlan(
        testbed=tmp_path,
        variants=variants,
        batch_sizes=list(batch_sizes),
        rounds=rounds,
        dataset=["p0", "p1", "p2"],
        limit=2,
        max_tokens=3,
        warmup_steps=4,
    )


def test_job_has_prefix_caching_off_full_batch_warmup_and_echo_stats(tmp_path):
    plan = _plan(tmp_path, expand_variants(["eagle3", "echo-auto"], [2], 4, ECHO))
    nospec, eagle, auto = plan.variants
    job, env = build_job(plan, eagle, 4, tmp_path / "w", profile_key=False)
    assert job["extra"]["enable_prefix_caching"] is False
    assert job["max_num_seqs"] == 4 and len(job["prompts"]) == 4
    assert job["warmup_prompts"] == job["prompts"][:4] and job["warmup_max_tokens"] == plan.warmup_max_tokens
    assert job["ignore_eos"] is True and job["echo_stats"] is False and env == {}
    assert job["steady_window"] is True  # every method's timed generate also times its full-engine window
    job_auto, env_auto = build_job(plan, auto, 4, tmp_path / "w", profile_key=True)
    assert job_auto["speculative_config"]["echo"]["k_max"] == "auto"
    assert job_auto["speculative_config"]["echo"]["budget_profile_file"] == str(tmp_path / "w" / "budget_profile.json")
    # The step log, buffered to the end of each generate (no record encoded in the timed part).
    assert env_auto == {"ECHO_VLLM_STEP_LOG": str(tmp_path / "w" / "steps.jsonl"), "ECHO_VLLM_STEP_LOG_FLUSH_S": "0"}
    assert job_auto["echo_stats"] is True
    # Same warm-up for every method of the run.
    job_nospec, _ = build_job(plan, nospec, 4, tmp_path / "w", profile_key=False)
    assert (job_nospec["warmup_prompts"], job_nospec["warmup_max_tokens"]) == (
        job["warmup_prompts"],
        job["warmup_max_tokens"],
    )


# --------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------


def test_spread_is_median_min_max_and_skips_missing():
    s = spread([3.0, None, 1.0, 2.0, float("nan"), 10.0])
    assert (s.median, s.min, s.max, s.n) == (2.5, 1.0, 10.0, 4)
    assert spread([None]) is None


def _out(tps_seconds: float, tokens=TOKENS, drafts=0.0, draft_tokens=0.0, accepted=0.0, steps=4.0, echo=None):
    emitted = sum(len(t) for t in tokens)
    return {
        "token_ids": tokens,
        "num_generated": emitted,
        "generate_seconds": tps_seconds,
        "engine_steps": steps,
        "spec": {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted},
        "echo_stats": echo,
        "warmup": {"echo_stats": {"calibration": "calibrated after 4 steps"}} if echo else {},
        "step_log_offset": 0,
        "torch_threads": 1,
    }


def test_request_steps_count_requests_without_drafts():
    # nospec: one token per request-step.
    assert request_steps(_out(1.0)) == 6
    # 2 prompts (prefill emits 1 each), 2 verified request-steps with 2 accepted each: 2 + 2*3 = 8 tokens.
    out = _out(1.0, tokens=[[0] * 4, [0] * 4], drafts=2, draft_tokens=4, accepted=4)
    assert request_steps(out) == 4
    # A request that got no drafts still counts: 8 tokens, 2 accepted, 1 drafted request-step -> 6 steps.
    out = _out(1.0, tokens=[[0] * 4, [0] * 4], drafts=1, draft_tokens=2, accepted=2)
    assert request_steps(out) == 6
    # A last step cut at max_tokens (3 accepted counted, 1 emitted): the drafted steps are the lower bound.
    out = _out(1.0, tokens=[[0] * 2, [0] * 2], drafts=2, draft_tokens=4, accepted=3)
    assert request_steps(out) == 4
    # vLLM's own count (first-token and inter-token observations) wins over both bounds when the job has it.
    out = _out(1.0, tokens=[[0] * 4, [0] * 4], drafts=1, draft_tokens=2, accepted=2)
    assert request_steps({**out, "request_steps": 7.0}) == 7
    assert request_steps({**out, "request_steps": 0.0}) == 6  # no statistics: the bounds


def test_measure_eagle3_and_echo_rows():
    eagle = measure(Variant("eagle3", 3), _out(0.5, drafts=2, draft_tokens=6, accepted=3, steps=4))
    assert eagle["tokens_per_s"] == 12.0
    assert eagle["accepted_per_verified_draft"] == 0.5
    assert eagle["mean_step_budget"] == 1.5 and eagle["mean_draft_depth"] == 3.0
    assert eagle["ms_per_step"] == {"total": 125.0}
    # 6 tokens over 4 engine steps; vLLM counted 5 request-steps: 1.2 tokens each, 1.25 requests per step.
    counted = measure(Variant("eagle3", 3), {**_out(0.5, drafts=2, draft_tokens=6, accepted=3), "request_steps": 5.0})
    assert counted["tokens_per_request_step"] == 1.2 and counted["requests_per_step"] == 1.25
    preempted = measure(Variant("nospec"), {**_out(1.0), "scheduler": {"num_preemptions": 2}})
    assert preempted["num_preemptions"] == 2
    stats = {"calibration": "calibrated after 4 steps", "mean_draft_depth": 1.5, "ms_per_step": {"draft": 1.0}}
    echo = measure(Variant("echo", 4, ECHO), _out(1.0, echo=stats), {"oracle_ratio": 0.9, "oracle_reason": None})
    assert echo["mean_draft_depth"] == 1.5 and echo["ms_per_step"]["draft"] == 1.0
    assert echo["ms_per_step"]["select"] is None and echo["echo"]["budget_mode"] is None
    assert echo["calibrated_before_timing"] is True and echo["oracle_ratio"] == 0.9
    missing = measure(Variant("echo", 4, ECHO), _out(1.0, echo={"error": "collective_rpc failed: x"}))
    assert missing["echo_stats_error"] == "collective_rpc failed: x" and missing["mean_draft_depth"] is None


def _row(method, batch, tps, depth=None):
    return {"method": method, "label": method, "batch_size": batch, "tokens_per_s": tps, "depth": depth}


def test_eagle3_best_and_ratios():
    rows = [
        _row("nospec", 1, 100.0),
        _row("eagle3", 1, 150.0, 1),
        _row("eagle3", 1, 180.0, 2),
        _row("echo", 1, 171.0),
        _row("nospec", 8, 400.0),
        _row("eagle3", 8, 380.0, 1),
        _row("echo", 8, 420.0),
    ]
    out = add_ratios(add_eagle3_best(rows))
    best = {r["batch_size"]: r for r in out if r["method"] == "eagle3-best"}
    assert best[1]["depth"] == 2 and best[1]["tokens_per_s"] == 180.0 and best[1]["best_of_depths"] == [1, 2]
    assert best[8]["depth"] == 1
    echo1 = next(r for r in out if r["method"] == "echo" and r["batch_size"] == 1)
    echo8 = next(r for r in out if r["method"] == "echo" and r["batch_size"] == 8)
    assert echo1["ratio_vs_nospec"] == pytest.approx(1.71)
    assert echo1["ratio_vs_best_baseline"] == pytest.approx(171 / 180) and echo1["best_baseline"] == "eagle3@2"
    # At batch 8 no-spec beats every EAGLE-3 depth: the best baseline is no-spec.
    assert echo8["ratio_vs_best_baseline"] == pytest.approx(420 / 400) and echo8["best_baseline"] == "nospec"


def test_steady_window_figures_ratios_and_cells():
    def row(method, batch, tps, steady, depth=None):
        full = {"tokens_per_s_min": tps, "tokens_per_s_max": tps, "identical_to_baseline": True}
        return {**_row(method, batch, tps, depth), **full, "steady_tokens_per_s": steady}

    rows = [
        row("nospec", 16, 450.0, 460.0),
        row("eagle3", 16, 496.0, 600.0, 1),
        row("eagle3", 16, 480.0, 620.0, 2),  # slower in total, faster while the engine is full
        row("echo", 16, 459.0, 651.0),
        row("nospec", 1, 100.0, None),  # one batch of prompts: no window
        row("echo", 1, 120.0, None),
    ]
    out = add_ratios(add_eagle3_best(rows))
    echo16 = next(r for r in out if r["method"] == "echo" and r["batch_size"] == 16)
    assert echo16["ratio_vs_best_baseline"] == pytest.approx(459 / 496)  # the total: eagle3-best is @1
    assert echo16["steady_ratio_vs_nospec"] == pytest.approx(651 / 460)
    assert echo16["steady_ratio_vs_best_baseline"] == pytest.approx(651 / 620)  # the best steady depth, @2
    echo1 = next(r for r in out if r["method"] == "echo" and r["batch_size"] == 1)
    assert echo1["steady_ratio_vs_nospec"] is None and echo1["steady_ratio_vs_best_baseline"] is None
    table = format_results(out)
    assert "steady tok/s (vs best)" in table and "651.0 (1.05)" in table
    summary = ratio_summary([r for r in out if r["method"] == "echo"])
    assert summary == [
        "echo: batch 16: 1.02x no-spec, 0.93x best (eagle3@1) (steady: 1.42x no-spec, 1.05x best); "
        "batch 1: 1.20x no-spec, 1.20x best (nospec)"
    ]
    # measure(): a job's steady window -> tokens per second; none -> null.
    variant = Variant("nospec")
    assert measure(variant, {**_out(10.0), "steady": {"seconds": 4.0, "tokens": 2000.0, "steps": 40.0}})[
        "steady_tokens_per_s"
    ] == pytest.approx(500.0)
    assert measure(variant, {**_out(10.0), "steady": None})["steady_tokens_per_s"] is None


class FakeLLM:
    """`LLM` as generate_with_steady_window drives it: requests of given lengths, at most `batch` running; every
    step each running request emits one token and takes one second of a fake clock."""

    def __init__(self, lengths: list[int], batch: int):
        self.lengths, self.batch, self.clock = lengths, batch, 0.0
        self.waiting: list[str] = []
        self.running: dict[str, int] = {}
        self.generated = 0
        self.llm_engine = self

    def enqueue(self, prompts, params, use_tqdm=True):
        self.waiting = [str(i) for i in range(len(prompts))]

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self):
        return len(self.waiting) + len(self.running)

    def step(self):
        while self.waiting and len(self.running) < self.batch:
            self.running[self.waiting.pop(0)] = 0
        self.clock += 1.0
        finished = []
        for rid in list(self.running):
            self.running[rid] += 1
            self.generated += 1
            if self.running[rid] == self.lengths[int(rid)]:
                del self.running[rid]
                finished.append(SimpleNamespace(request_id=rid, finished=True))
        return finished

    def get_metrics(self):
        return [
            SimpleNamespace(name="vllm:generation_tokens", value=float(self.generated)),
            SimpleNamespace(name="vllm:prompt_tokens", value=3.0 * (len(self.lengths) - len(self.waiting))),
        ]


def test_steady_window_is_the_part_where_requests_wait_for_a_slot():
    from echo_vllm.vllm.offline import generate_with_steady_window

    # Lockstep, 3 waves of 2 requests x 3 tokens: the window opens after step 1 (4 wait) and closes after step 6
    # (the last wave running, none waiting): 5 steps, 10 tokens, at 2 tokens per second (the full batch).
    llm = FakeLLM([3] * 6, batch=2)
    outputs, steady = generate_with_steady_window(llm, ["p"] * 6, None, 2, clock=lambda: llm.clock)
    assert [o.request_id for o in outputs] == [str(i) for i in range(6)]  # request order, as llm.generate
    assert steady == {"seconds": 5.0, "tokens": 10.0, "steps": 5.0}
    # One long request in the last wave (as speculation finishes requests unevenly): 16 tokens in 10 steps in
    # total, the last 4 at batch 1 (the drain); the window ends when nothing waits (after step 4): 6 tokens in 3 s.
    llm = FakeLLM([2, 2, 2, 2, 2, 6], batch=2)
    finished_at: dict[str, int] = {}
    outputs, steady = generate_with_steady_window(
        llm, ["p"] * 6, None, 2, clock=lambda: llm.clock, finished_at=finished_at
    )
    assert len(outputs) == 6 and llm.clock == 10.0 and llm.generated == 16
    assert steady == {"seconds": 3.0, "tokens": 6.0, "steps": 3.0}  # 2 tokens/s full, against 1.6 over the run
    # The step each request finished in; the last one ran steps 5-10 in the slot request 3 freed in step 4.
    assert finished_at == {"0": 2, "1": 2, "2": 4, "3": 4, "4": 6, "5": 10}
    from echo_vllm.bench.flights import request_flights

    flights = request_flights([finished_at[o.request_id] for o in outputs], 2)
    assert flights.steps == [2, 2, 2, 2, 2, 6] and flights.last_admitted == 6  # each request's own length
    # One batch of prompts: no request ever waits, no window.
    llm = FakeLLM([3, 3], batch=2)
    assert generate_with_steady_window(llm, ["p"] * 2, None, 2, clock=lambda: llm.clock)[1] is None


# --------------------------------------------------------------------------------------------------------------
# The whole harness on a fake engine
# --------------------------------------------------------------------------------------------------------------


class FakeEngine:
    """Seconds per job by (label, round); tokens by label (a wrong-token variant must show as not identical)."""

    def __init__(self, seconds: dict[str, list[float]], wrong: tuple[str, ...] = ()):
        self.seconds, self.wrong, self.calls = seconds, wrong, []

    def __call__(self, job, extra_env=None):
        spec = job["speculative_config"]
        label = (
            "nospec"
            if spec is None
            else spec["method"]
            if spec["method"] != "eagle3"
            else f"eagle3@{spec['num_speculative_tokens']}"
        )
        if spec and spec["method"] == "echo" and spec["echo"]["k_max"] == "auto":
            label = "echo-auto"
        n = sum(1 for c in self.calls if c[0] == label)
        self.calls.append((label, job["max_num_seqs"], extra_env))
        tokens = [[9, 9, 9]] * len(job["prompts"]) if label in self.wrong else [[1, 2, 3]] * len(job["prompts"])
        drafts = 0 if spec is None else len(job["prompts"])
        stats = {"calibration": "calibrated after 4 steps", "mean_draft_depth": 2.0} if job["echo_stats"] else None
        return _out(
            self.seconds[label][n % len(self.seconds[label])],
            tokens=tokens,
            drafts=drafts,
            draft_tokens=2 * drafts,
            accepted=drafts,
            echo=stats,
        )


def test_run_bench_rounds_medians_identity_and_contract(tmp_path):
    variants = expand_variants(["nospec", "eagle3", "echo"], [1, 2], 4, ECHO)
    seconds = {
        "nospec": [1.0, 2.0, 1.5],
        "eagle3@1": [1.0, 0.9, 1.1],
        "eagle3@2": [0.5, 0.6, 0.4],
        "echo": [1.0, 1.0, 0.8],
    }
    engine = FakeEngine(seconds, wrong=("eagle3@1",))
    outcome = run_bench(_plan(tmp_path, variants, rounds=3), engine, log=lambda _: None)
    # Rotation: round 2 starts with eagle3@1, round 3 with eagle3@2.
    firsts = [engine.calls[i * 4][0] for i in range(3)]
    assert firsts == ["nospec", "eagle3@1", "eagle3@2"]
    rows = {r["label"]: r for r in outcome["results"]}
    emitted = 2 * 3  # 2 prompts (limit 2, batch 2) x 3 tokens
    assert rows["nospec"]["tokens_per_s"] == pytest.approx(emitted / 1.5)
    assert rows["nospec"]["tokens_per_s_min"] == pytest.approx(emitted / 2.0)
    assert rows["nospec"]["tokens_per_s_max"] == pytest.approx(emitted / 1.0)
    assert rows["eagle3-best"]["depth"] == 2 and rows["eagle3-best"]["tokens_per_s"] == pytest.approx(emitted / 0.5)
    assert rows["eagle3@1"]["identical_to_baseline"] is False
    assert rows["eagle3@2"]["identical_to_baseline"] is True and rows["echo"]["identical_to_baseline"] is True
    assert rows["echo"]["ratio_vs_nospec"] == pytest.approx(1.5 / 1.0)
    assert rows["echo"]["ratio_vs_best_baseline"] == pytest.approx(0.5 / 1.0)
    # No cost model in this build: the oracle is null with a reason, never a made-up number.
    assert rows["echo"]["oracle_ratio"] is None and rows["echo"]["oracle_reason"]
    assert rows["echo"]["calibrated_before_timing"] is True
    for row in outcome["results"]:
        assert set(vllm_cli.CONTRACT_KEYS) <= row.keys(), set(vllm_cli.CONTRACT_KEYS) - row.keys()
    assert {"oracle_ratio"} <= rows["echo"].keys()
    # ECHO jobs get a step log of their own; no other job does.
    assert all(("ECHO_VLLM_STEP_LOG" in env) == (label == "echo") for label, _, env in engine.calls)
    table = format_results(outcome["results"])
    assert "eagle3-best (@2)" in table and "NO" in table and "[" in table
    assert any("no oracle bound" in note for note in footnotes(outcome["results"]))


def test_a_failed_round_is_reported_not_hidden(tmp_path):
    import subprocess

    variants = expand_variants(["nospec", "echo"], [1], 4, ECHO)

    def engine(job, extra_env=None):
        if job["speculative_config"] is not None:
            raise RuntimeError("vLLM job failed (rc=1):\nValueError: boom")
        if job["max_num_seqs"] == 3:
            raise subprocess.TimeoutExpired("python", 900)
        return _out(1.0)

    partial = []
    outcome = run_bench(
        _plan(tmp_path, variants, batch_sizes=(2, 3), rounds=2),
        engine,
        log=lambda _: None,
        on_batch_done=partial.append,
    )
    # After each batch size the outcome so far is handed out (a run that dies later keeps it).
    assert [sorted({r["batch_size"] for r in p["results"]}) for p in partial] == [[2], [2, 3]]
    timed_out = next(r for r in outcome["results"] if r["batch_size"] == 3 and r["method"] == "nospec")
    assert timed_out["tokens_per_s"] is None and "timed out" in timed_out["errors"][0]

    rows = {
        r["label"]: r for r in run_bench(_plan(tmp_path, variants, rounds=2), engine, log=lambda _: None)["results"]
    }
    assert rows["echo"]["tokens_per_s"] is None and rows["echo"]["identical_to_baseline"] is False
    assert rows["echo"]["errors"] == ["ValueError: boom", "ValueError: boom"]
    assert rows["echo"]["oracle_ratio"] is None and "budget_mode" in rows["echo"]
    assert "failed" in format_results(list(rows.values()))


# --------------------------------------------------------------------------------------------------------------
# CLI: flags, outputs
# --------------------------------------------------------------------------------------------------------------


def test_contract_flags_parse():
    args = build_parser().parse_args(
        ["bench", "vllm", "--methods", "nospec,eagle3,echo,echo-auto", "--eagle3-depths", "1,2,3,4", "--rounds", "5"]
    )
    assert args.eagle3_depths == [1, 2, 3, 4] and args.rounds == 5
    default = build_parser().parse_args(["bench", "vllm"])
    assert default.batch_sizes == [1, 4, 8, 16, 32, 64] and default.rounds >= 3
    assert default.methods == "nospec,eagle3,echo,echo-auto,echo-tree" and default.eagle3_depths == [1, 2, 3, 4]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "vllm", "--eagle3-depths", "1,x"])
    assert default.waves == 4
    bad = build_parser().parse_args(["bench", "vllm", "--waves", "0"])
    with pytest.raises(BenchPlanError, match="--waves must be >= 1"):
        vllm_cli.plan_from_args(bad, dataset=["p"])


def test_demo_wires_echo_auto_beside_nospec_and_eagle3(tmp_path):
    from testbed_fixture import shipped_testbed

    args = build_parser().parse_args(["demo", "--testbed", str(shipped_testbed())])
    assert args.func is vllm_cli.demo
    plan = vllm_cli.plan_from_args(args, dataset=["p"])
    labels = [v.label for v in plan.variants]
    assert labels[0] == "nospec" and "echo-auto" in labels and sum(v.method == "eagle3" for v in plan.variants) >= 2
    auto = next(v for v in plan.variants if v.method == "echo-auto")
    assert auto.speculative_config(plan.testbed / "eagle3")["echo"]["k_max"] == "auto"
    assert "echo" in labels  # the fixed K_max beside it: the demo shows ECHO at its best honest setting
    assert plan.rounds >= 3 and plan.batch_sizes == [1, 8]
    assert plan.waves >= 4  # batch 8 is not one drain-dominated batch
    header = "\n".join(vllm_cli.header_lines(plan, "demo"))
    assert "rounds" in header and "prefix caching off" in header and '"k_max": "auto"' in header


def test_outputs_json_plot_and_results_line(tmp_path, monkeypatch):
    from testbed_fixture import shipped_testbed

    import echo_vllm.bench.vllm_run as vllm_run
    import echo_vllm.vllm.offline as offline

    seconds = {"nospec": [1.0, 1.2, 1.1], "eagle3@1": [0.8, 0.9, 0.7], "echo": [0.9, 0.9, 0.9]}
    monkeypatch.setattr(offline, "run_in_subprocess", FakeEngine(seconds))
    monkeypatch.setattr(vllm_run, "budget_profile_supported", lambda: False)
    out = tmp_path / "b.json"
    args = build_parser().parse_args(
        [
            "bench",
            "vllm",
            "--testbed",
            str(shipped_testbed()),
            "--methods",
            "nospec,eagle3,echo",
            "--eagle3-depths",
            "1",
            "--batch-sizes",
            "2",
            "--limit",
            "2",
            "--max-tokens",
            "3",
            "--json",
            str(out),
            "--label",
            "who=test",
        ]
    )
    monkeypatch.setattr(
        vllm_cli,
        "plan_from_args",
        lambda a: _plan(shipped_testbed(), expand_variants(["eagle3", "echo"], [1], 4, ECHO)),
    )
    assert vllm_cli.bench_vllm(args) == 0
    document = json.loads(out.read_text())
    assert {"results", "machine", "git", "settings", "round_log", "labels"} <= document.keys()
    assert document["complete"] is True
    assert document["machine"]["cpu_model"] and "isa_flags" in document["machine"]
    assert document["settings"]["enable_prefix_caching"] is False and document["settings"]["rounds"] == 3
    labels = {r["label"] for r in document["results"]}
    assert labels == {"nospec", "eagle3@1", "eagle3-best", "echo"}
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    lines = (tmp_path / "bench_runs.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["labels"] == {"who": "test"}
    assert json.loads(lines[0])["git"]["commit"]
    # A second run appends, never overwrites.
    assert vllm_cli.bench_vllm(args) == 0
    assert len((tmp_path / "bench_runs.jsonl").read_text().splitlines()) == 2


def test_echo_auto_is_refused_in_one_line_while_the_validator_refuses_auto(tmp_path):
    """Until k_max 'auto' is valid, `--methods echo-auto` stops before any engine starts, naming the method."""
    from echo_vllm.config import EchoConfigError, parse_echo_settings

    plan = _plan(tmp_path, expand_variants(["echo-auto"], [1], 4, ECHO))
    try:
        parse_echo_settings({"k_max": "auto"})
    except EchoConfigError:
        with pytest.raises(EchoConfigError, match="echo-auto"):
            vllm_cli.validate_plan(plan)
    else:
        vllm_cli.validate_plan(plan)  # auto has landed: the plan validates


def test_plot_from_fake_rows(tmp_path):
    from echo_vllm.bench.plot import plot_throughput

    rows = add_eagle3_best(
        [{**_row("nospec", b, 100.0 * b), "tokens_per_s_min": 90.0 * b, "tokens_per_s_max": 110.0 * b} for b in (1, 8)]
        + [{**_row("eagle3", b, 120.0 * b, 2), "label": "eagle3@2"} for b in (1, 8)]
    )
    path = plot_throughput(rows, tmp_path / "p.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(Exception, match="--plot"):
        plot_throughput(rows, tmp_path / "missing" / "p.png")


def test_footnotes_say_what_the_cells_cannot():
    rows = [
        {**_row("echo", 8, 10.0), "calibrated_before_timing": False, "oracle_ratio": None, "oracle_reason": "why"},
        {**_row("nospec", 8, 10.0), "num_preemptions": 3},
    ]
    notes = footnotes(rows)
    assert any("NOT calibrated" in n for n in notes) and any("no oracle bound: why" in n for n in notes)
    assert any("3 preemption(s)" in n for n in notes)
    assert footnotes([{**_row("nospec", 8, 10.0), "num_preemptions": 0}]) == []


def test_json_safe_turns_nan_into_null():
    value = {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2}}
    assert vllm_cli.json_safe(value) == {"a": None, "b": [1.0, None], "c": {"d": 2}}
    json.dumps(vllm_cli.json_safe(value), allow_nan=False)


def test_unwritable_outputs_are_refused_before_the_run(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for flags in (["--json", str(blocker / "b.json")], ["--plot", str(blocker / "sub" / "p.png")]):
        args = build_parser().parse_args(["bench", "vllm", *flags])
        with pytest.raises(Exception, match=flags[0]):
            vllm_cli._output_paths(args)
    ok = build_parser().parse_args(["bench", "vllm", "--json", str(tmp_path / "new" / "b.json")])
    assert vllm_cli._output_paths(ok)[1] == tmp_path / "new" / "b.png"


def test_step_trace_records_each_steps_seconds_and_batch():
    from echo_vllm.vllm.offline import generate_with_steady_window

    # 2 waves of 2 requests x 2 tokens, then one request of 3 alone at the end: batches 2, 2, 2, 2, 1 ... as run.
    llm = FakeLLM([2, 2, 2, 2, 3], batch=2)
    trace: dict[str, list[float]] = {"seconds": [], "batch": [], "prompt": [], "generated": []}
    generate_with_steady_window(llm, ["p"] * 5, None, 2, clock=lambda: llm.clock, trace=trace)
    assert trace["seconds"] == [1.0] * 7  # every step took one fake second
    assert trace["batch"] == [2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    assert trace["generated"] == [2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    assert trace["prompt"] == [6.0, 0.0, 6.0, 0.0, 3.0, 0.0, 0.0]  # 3 tokens per admitted prompt (the fake's)
