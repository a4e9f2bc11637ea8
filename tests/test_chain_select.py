"""The fused chain-step op (`echo::chain_select`) against its torch specification, and that specification against
the pieces the proposer composed before it (gates, `select_budget` + `add_surplus_tails`, `TimeAwareBudget.select`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.core.acceptance import AcceptanceModel
from echo_vllm.core.auto_budget import DraftPlan, drafting_can_stop
from echo_vllm.core.budget import add_surplus_tails
from echo_vllm.core.chain_select import (
    HISTORY_PRIOR,
    ChainInputs,
    chain_gates,
    chain_inputs,
    chain_select_reference,
    chain_tree,
    history_factor,
)
from echo_vllm.core.cost_model import CostModel
from echo_vllm.core.gating import Gates, depth_confidence
from echo_vllm.core.time_budget import TimeAwareBudget
from echo_vllm.ops import chain as chain_ops
from echo_vllm.ops import cpu_isa_calls, ops_defined, select_budget
from echo_vllm.vllm.cpu_isa import echo_kernel_build

needs_op = pytest.mark.skipif(not chain_ops._DEFINED, reason="echo_vllm._C without chain_select (make install)")
NO_SECONDS = torch.empty(0, dtype=torch.float64)


class _Cal:
    """A calibration stand-in for Gates.evaluate."""

    def __init__(self, gate_on: torch.Tensor, tau: torch.Tensor) -> None:
        self.max_depth = gate_on.numel()
        self._gate_on, self._tau = gate_on, tau

    def gate_tensors(self, device):
        return self._gate_on.to(device), self._tau.to(device)


def _random_case(seed: int, batch: int, depth: int, max_depth: int):
    gen = torch.Generator().manual_seed(seed)
    # Log-probs from a small set, so that equal path scores across requests (ties) are common; some -inf / NaN.
    levels = torch.log(torch.tensor([1.0, 0.9, 0.5, 0.25, 0.1, 0.01]))
    logps = levels[torch.randint(0, levels.numel(), (batch, depth), generator=gen)]
    holes = torch.rand((batch, depth), generator=gen)
    logps = torch.where(holes < 0.05, torch.full_like(logps, float("-inf")), logps)
    logps = torch.where(holes > 0.97, torch.full_like(logps, float("nan")), logps)
    kept = torch.rand(batch, generator=gen) > 0.1
    gate_on = torch.rand(max_depth, generator=gen) < 0.5
    tau = torch.rand(max_depth, generator=gen) * 0.8
    table = torch.rand((max_depth, 16), generator=gen)
    table[torch.rand((max_depth, 16), generator=gen) < 0.2] = 0.5  # repeated gains: ties in the rate table
    num = batch * depth
    slope = 0.001 if seed % 2 else 0.0001  # dear and cheap verification: cuts at every length
    rest = 0.004 + torch.cumsum(torch.rand(num + 1, generator=gen, dtype=torch.float64) * slope, dim=0)
    draft = torch.full((depth + 1,), float(torch.rand(1, generator=gen)) * 0.003, dtype=torch.float64)
    return logps, kept, gate_on, tau, table, rest, draft


def _random_history(seed: int, rows: int, depth: int) -> torch.Tensor:
    """[rows, 2] float64 running averages (accepted, expected): zeros (new requests), equal pairs (factor 1) and
    factors from ~0.3 to ~3, on a grid so that equal keys across requests occur."""
    gen = torch.Generator().manual_seed(seed + 7)
    history = torch.randint(0, 2 * depth + 1, (rows, 2), generator=gen).to(torch.float64) / 2.0
    history[torch.rand(rows, generator=gen) < 0.2] = 0.0
    return history


@needs_op
@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    batch=st.integers(1, 40),
    depth=st.integers(1, 6),
    extra_depth=st.integers(0, 2),
    k_cap=st.integers(0, 120),
    k_min=st.integers(0, 60),  # above the eligible count too (a probe over dropped rows)
    surplus_tail=st.booleans(),
    fixed=st.booleans(),
    with_history=st.booleans(),
)
def test_op_equals_the_torch_specification(
    seed, batch, depth, extra_depth, k_cap, k_min, surplus_tail, fixed, with_history
):
    logps, kept, gate_on, tau, table, rest, draft = _random_case(seed, batch, depth, depth + extra_depth)
    inputs = chain_inputs(logps, kept)
    args = (inputs, gate_on, tau, None if fixed else table, rest, draft)
    kw = {"base_tokens": float(batch), "k_cap": k_cap, "k_min": 0 if fixed else k_min, "surplus_tail": surplus_tail}
    if with_history:  # more rows than the batch: the op reads the first B
        kw |= {"history": _random_history(seed, batch + seed % 3, depth), "history_prior": 0.5 + seed % 4}
    want = chain_select_reference(*args, **kw)
    got = chain_ops.chain_select(*args, **kw)
    assert torch.equal(got.counts, want.counts)
    assert torch.equal(got.depth_cap, want.depth_cap) and torch.equal(got.truncated, want.truncated)
    assert got.predicted.dtype == torch.float64 and float(got.predicted) == float(want.predicted)  # bit for bit


needs_logps_op = pytest.mark.skipif(
    not chain_ops._LOGPS_DEFINED, reason="echo_vllm._C without chain_select_logps (make install)"
)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal dtype and bits (NaN where NaN: the scores hold NaN drafts)."""
    assert a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_logps_op
@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    batch=st.integers(0, 40),
    extra_rows=st.integers(0, 3),
    depth=st.integers(1, 6),
    extra_depth=st.integers(0, 2),
    k_cap=st.integers(0, 120),
    k_min=st.integers(0, 60),
    surplus_tail=st.booleans(),
    fixed=st.booleans(),
    all_kept=st.booleans(),
    with_history=st.booleans(),
)
def test_the_one_call_from_log_probs_equals_the_inputs_then_the_selection(
    seed, batch, extra_rows, depth, extra_depth, k_cap, k_min, surplus_tail, fixed, all_kept, with_history
):
    """`chain_select_steps` (the op from the per-depth log-probs: its own cumsum in double, torch's exp) against
    `chain_inputs` over the stacked first `batch` rows, then the torch specification: every output, bit for bit.
    Rows past `batch` (vLLM's padded rows) are ignored; kept None means every row."""
    assert chain_ops.compiled_chain_select(torch.device("cpu"))  # the op, not its torch twin, is under test
    logps, kept, gate_on, tau, table, _, _ = _random_case(seed, batch + extra_rows, depth, depth + extra_depth)
    rest, draft = _random_case(seed, max(batch, 1), depth, depth + extra_depth)[5:]
    if batch == 0:
        rest = rest[:1]
    kept = None if all_kept else kept[:batch]
    steps = [logps[:, j].contiguous() for j in range(depth)]
    kw = {"base_tokens": float(batch), "k_cap": k_cap, "k_min": 0 if fixed else k_min, "surplus_tail": surplus_tail}
    if with_history:
        kw["history"] = _random_history(seed, batch + extra_rows, depth)
    gains = None if fixed else table
    got_inputs, got = chain_ops.chain_select_steps(steps, batch, kept, gate_on, tau, gains, rest, draft, **kw)
    want_inputs = chain_inputs(logps[:batch], kept)
    want = chain_select_reference(want_inputs, gate_on, tau, gains, rest, draft, **kw)
    for a, b in zip(got_inputs, want_inputs):
        _same(a, b)
    for a, b in zip(got, want):
        _same(a, b)


@needs_logps_op
def test_the_one_call_falls_back_to_torch_and_checks_its_inputs(monkeypatch):
    logps, kept, gate_on, tau, table, rest, draft = _random_case(3, 6, 3, 4)
    steps = [logps[:, j].contiguous() for j in range(3)]
    kw = {"base_tokens": 6.0, "k_cap": 9, "surplus_tail": True}
    fused = chain_ops.chain_select_steps(steps, 6, kept, gate_on, tau, table, rest, draft, **kw)
    with pytest.raises(ValueError, match="must hold >= batch"):
        chain_ops.chain_select_steps(steps, 7, None, gate_on, tau, table, rest, draft, **kw)
    with pytest.raises(ValueError, match="kept must be"):
        chain_ops.chain_select_steps(steps, 6, kept[:5], gate_on, tau, table, rest, draft, **kw)
    monkeypatch.setenv(chain_ops.TORCH_PATH_ENV, "1")  # the torch twin: the same outputs
    twin = chain_ops.chain_select_steps(steps, 6, kept, gate_on, tau, table, rest, draft, **kw)
    for a, b in zip([*fused[0], *fused[1]], [*twin[0], *twin[1]]):
        _same(a, b)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    batch=st.integers(1, 12),
    depth=st.integers(1, 5),
    k_cap=st.integers(0, 40),
    surplus_tail=st.booleans(),
)
def test_the_fixed_rule_is_select_budget_plus_surplus_tails(seed, batch, depth, k_cap, surplus_tail):
    """What the proposer ran for an integer k_max: the gates on depth_confidence, select_budget, Priority 3."""
    logps, kept, gate_on, tau, *_ = _random_case(seed, batch, depth, depth)
    inputs = chain_inputs(logps, kept)
    tree = chain_tree(inputs.scores, inputs.valid)
    gates = Gates.evaluate(depth_confidence(tree), _Cal(gate_on, tau))
    selection = select_budget(tree, gates, k_cap)
    if surplus_tail:
        selection = add_surplus_tails(selection, tree, gates, k_cap)
    ours = chain_select_reference(
        inputs, gate_on, tau, None, NO_SECONDS, NO_SECONDS, base_tokens=float(batch), k_cap=k_cap, k_min=0,
        surplus_tail=surplus_tail,
    )  # fmt: skip
    assert torch.equal(ours.counts, selection.counts)
    assert torch.equal(ours.depth_cap, gates.depth_cap) and torch.equal(ours.truncated, gates.truncated)


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    batch=st.integers(1, 12),
    depth=st.integers(1, 4),
    probe=st.booleans(),
    surplus_tail=st.booleans(),
)
def test_the_time_aware_cut_is_time_aware_budget_select(seed, batch, depth, probe, surplus_tail):
    """What the proposer ran for k_max auto: TimeAwareBudget.select on the chain tree, with its own curves."""
    max_depth = 4
    logps, kept, gate_on, tau, *_ = _random_case(seed, batch, depth, max_depth)
    budget = TimeAwareBudget(max_depth, profile_steps=0, probe_interval=0, surplus_tail=surplus_tail, profile_path=None)
    budget.cost_model = CostModel(
        (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0), (0.004, 0.0042, 0.0045, 0.005, 0.006, 0.009, 0.015), 1e-5,
        (0.0005, 1e-5, 0.0004, 2e-5), 0.0, 10, (0.0, 0.0), (0.0008, 1e-5),
    )  # fmt: skip
    acceptance = AcceptanceModel(max_depth)
    gen = torch.Generator().manual_seed(seed)
    conf = torch.rand((64, max_depth), generator=gen)
    acceptance.record(conf, torch.rand((64, max_depth), generator=gen) < conf, torch.ones((64, max_depth), dtype=bool))
    acceptance.refresh()
    budget.acceptance = acceptance
    plan = DraftPlan(depth, 3 * batch, probe)
    inputs = chain_inputs(logps, kept)
    tree = chain_tree(inputs.scores, inputs.valid)
    cal = _Cal(gate_on, tau)
    padded = torch.cat([depth_confidence(tree), torch.full((batch, max_depth - depth), float("inf"))], dim=1)
    gates = Gates.evaluate(padded, cal)
    selection, predicted = budget.select(tree, gates, batch, plan, False, depth=depth, chain=True)
    rest, draft = budget.curves(batch, batch * depth, depth, plan.depth, "cpu")
    ours = chain_select_reference(
        inputs, gate_on, tau, acceptance.table, rest, draft, base_tokens=float(batch), k_cap=plan.k_cap,
        k_min=plan.k_cap if probe else 0, surplus_tail=surplus_tail,
    )  # fmt: skip
    assert selection is not None and predicted is not None
    assert torch.equal(ours.counts, selection.counts)
    assert float(ours.predicted) == float(predicted)
    assert torch.equal(chain_gates(inputs.confidence, gate_on, tau).depth_cap, gates.depth_cap)


@needs_op
def test_op_refuses_bad_inputs_with_one_line():
    logps, kept, gate_on, tau, table, rest, draft = _random_case(0, 3, 4, 4)
    inputs = chain_inputs(logps, kept)
    kw = {"base_tokens": 3.0, "k_cap": 8, "surplus_tail": True}
    with pytest.raises(TypeError, match="scores must be Float"):
        chain_ops.chain_select(inputs._replace(scores=inputs.scores.double()), gate_on, tau, table, rest, draft, **kw)
    with pytest.raises(ValueError, match=r"rest must be \[B \* d \+ 1\]"):
        chain_ops.chain_select(inputs, gate_on, tau, table, rest[:-1], draft, **kw)
    with pytest.raises(ValueError, match="gate_on and tau must be"):
        chain_ops.chain_select(inputs, gate_on[:2], tau[:2], table, rest, draft, **kw)


def test_torch_path_env_forces_the_reference(monkeypatch):
    monkeypatch.setenv(chain_ops.TORCH_PATH_ENV, "1")
    assert not chain_ops.compiled_chain_select(torch.device("cpu"))
    logps, kept, gate_on, tau, table, rest, draft = _random_case(1, 5, 3, 4)
    got = chain_ops.chain_select(
        chain_inputs(logps, kept), gate_on, tau, table, rest, draft, base_tokens=5.0, k_cap=9, surplus_tail=True
    )
    assert got.counts.dtype == torch.int32 and int(got.counts.sum()) <= 9


def _use_isa(isa: str, monkeypatch) -> None:
    """isa "baseline": the draft ops' build that CPUs without AVX2 run (ECHO_DRAFT_BASELINE_ISA=1); "native":
    the AVX2 + FMA build of float32 rows where the CPU has it."""
    if isa == "baseline":
        monkeypatch.setenv("ECHO_DRAFT_BASELINE_ISA", "1")
    else:
        monkeypatch.delenv("ECHO_DRAFT_BASELINE_ISA", raising=False)


@needs_op
@pytest.mark.parametrize("isa", ["native", "baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_draft_argmax_logp_is_the_first_maximum_and_its_log_softmax(dtype, isa, monkeypatch):
    _use_isa(isa, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn((37, 4096), generator=gen) * 4).to(dtype)
    logits[3] = torch.randint(0, 3, (4096,), generator=gen).to(dtype)  # many ties for the maximum
    logits[5, 17] = 60.0  # one dominant logit: log-prob ~0, never above it
    ids, logps = chain_ops.draft_argmax_logp(logits)
    want_ids, want_logps = chain_ops.draft_argmax_logp_reference(logits)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int64
    assert int(ids[3]) == int(torch.nonzero(logits[3] == logits[3].max())[0])  # the lowest id among ties
    assert torch.allclose(logps, want_logps, atol=2e-6, rtol=1e-5) and logps.dtype == torch.float32
    assert bool((logps <= 0).all()) and float(logps[5]) == pytest.approx(0.0, abs=1e-6)


@needs_op
@pytest.mark.parametrize("isa", ["native", "baseline"])
@pytest.mark.parametrize("vocab", [8, 4096])
def test_draft_argmax_logp_nan_and_dead_rows_follow_torch(vocab, isa, monkeypatch):
    """Rows the vector build hands to the baseline's special cases: a NaN (in a full lane and in the tail), a row of
    -inf, an infinite maximum; and a normal row beside them."""
    _use_isa(isa, monkeypatch)
    logits = torch.zeros((5, vocab))
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    logits[2, 2] = float("inf")
    logits[3, vocab - 1] = float("nan")
    logits[4, 3] = 1.0
    ids, logps = chain_ops.draft_argmax_logp(logits)
    want_ids, want_logps = chain_ops.draft_argmax_logp_reference(logits)
    assert int(ids[0]) == int(want_ids[0]) == 5 and int(ids[2]) == int(want_ids[2]) == 2
    assert int(ids[3]) == int(want_ids[3]) == vocab - 1 and int(ids[4]) == int(want_ids[4]) == 3
    assert bool(torch.isnan(logps[:4]).all()) and bool(torch.isnan(want_logps[:4]).all())  # no usable log-prob
    assert float(logps[4]) == pytest.approx(float(want_logps[4]), abs=2e-6)


@needs_op
@pytest.mark.parametrize("isa", ["native", "baseline"])
@pytest.mark.parametrize("vocab", [1, 7, 9, 513, 4099])
def test_draft_argmax_logp_polynomial_exp_over_ragged_vocabularies_and_wide_logits(vocab, isa, monkeypatch):
    """The op's exp is a polynomial over lanes of 8 in chunks of 512 (it vectorises at the baseline ISA; AVX2
    intrinsics for float32 where the CPU has them): tails that fill no lane or chunk, logits far below the maximum
    (exp underflow: x - max < -87), a -inf logit, and the maximum in the last element must all give torch's token
    and its log-prob."""
    _use_isa(isa, monkeypatch)
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn((6, vocab), generator=gen) * 40  # spreads of hundreds: most terms underflow
    logits[1] = torch.randn(vocab, generator=gen) * 0.01  # nearly flat: log-prob ~ -log V
    logits[2, -1] = 500.0  # the maximum in the tail
    if vocab > 1:
        logits[3, 0] = float("-inf")
    ids, logps = chain_ops.draft_argmax_logp(logits)
    want_ids, _ = chain_ops.draft_argmax_logp_reference(logits)
    # The float32 reference loses ~|max| x 1e-7 to cancellation at these magnitudes: compare with float64.
    exact = (logits.double().max(dim=-1).values - torch.logsumexp(logits.double(), dim=-1)).float()
    assert torch.equal(ids, want_ids)
    assert torch.allclose(logps, exact, atol=2e-6, rtol=1e-5), (logps - exact).abs().max()
    assert bool((logps <= 0).all())


@needs_op
@pytest.mark.parametrize("seed", range(4))
def test_draft_argmax_logp_builds_agree(seed, monkeypatch):
    """The AVX2 build (float32 rows, where the CPU has AVX2) and the baseline build give the same tokens and
    log-probs within float rounding (the vector exp rounds its polynomial with FMA), ties and maxima in every lane
    position included; on a CPU without AVX2 both runs take the baseline build."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((33, 4096 + seed), generator=gen) * (2.0 + 6 * seed)
    for r in range(8):  # the maximum at lane r of a vector and twice (the first one wins)
        logits[r, 8 * (r + 1) + r] = 100.0
        logits[r, 8 * (r + 3) + r] = 100.0
    logits[9] = torch.randint(0, 2, (logits.shape[1],), generator=gen).float()
    logits[10, -1] = 90.0  # in the scalar tail
    monkeypatch.setenv("ECHO_DRAFT_BASELINE_ISA", "1")
    base_ids, base_logps = chain_ops.draft_argmax_logp(logits)
    base_top, base_top_logps = chain_ops.draft_topk_logp(logits, 4) if chain_ops._TOPK_DEFINED else (None, None)
    monkeypatch.delenv("ECHO_DRAFT_BASELINE_ISA")
    ids, logps = chain_ops.draft_argmax_logp(logits)
    assert torch.equal(ids, base_ids)
    assert ids[:8].tolist() == [8 * (r + 1) + r for r in range(8)] and int(ids[10]) == logits.shape[1] - 1
    torch.testing.assert_close(logps, base_logps, atol=1e-6, rtol=1e-6)
    if base_top is not None:
        top, top_logps = chain_ops.draft_topk_logp(logits, 4)
        assert torch.equal(top, base_top)
        torch.testing.assert_close(top_logps, base_top_logps, atol=1e-6, rtol=1e-6)


@needs_op
@pytest.mark.skipif(not ops_defined("cpu_isa_calls"), reason="echo_vllm._C without cpu_isa_calls (make install)")
def test_the_draft_ops_run_the_avx2_build_where_the_cpu_has_it(monkeypatch):
    """The builds agree on their outputs (above), so only the op's call counters show which ran: float32 rows take
    the AVX2 build on a CPU with AVX2 and FMA (a dispatch that always fell back would fail here), the baseline
    with ECHO_DRAFT_BASELINE_ISA=1 or without AVX2, and bfloat16 rows the baseline."""
    logits = torch.randn((4, 4096), generator=torch.Generator().manual_seed(0))
    expected = echo_kernel_build()

    def ran(rows: torch.Tensor) -> dict[str, int]:
        before = cpu_isa_calls()["draft_logp"]
        chain_ops.draft_argmax_logp(rows)
        after = cpu_isa_calls()["draft_logp"]
        return {build: after[build] - before[build] for build in after}

    monkeypatch.delenv("ECHO_DRAFT_BASELINE_ISA", raising=False)
    native = ran(logits)
    assert native[expected] >= 1 and native["avx2" if expected == "baseline" else "baseline"] == 0
    half = ran(logits.to(torch.bfloat16))
    assert half["baseline"] >= 1 and half["avx2"] == 0
    monkeypatch.setenv("ECHO_DRAFT_BASELINE_ISA", "1")
    forced = ran(logits)
    assert forced["baseline"] >= 1 and forced["avx2"] == 0


needs_topk_op = pytest.mark.skipif(
    not (chain_ops._DEFINED and chain_ops._TOPK_DEFINED),
    reason="echo_vllm._C without draft_topk_logp",
)


@needs_topk_op
@pytest.mark.parametrize("isa", ["native", "baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_draft_topk_logp_gives_topk_stable_tokens_in_order_and_their_log_softmax(dtype, k, isa, monkeypatch):
    """The tree step's op against its torch twin: the same k tokens in the same order (value descending, equal
    values lower index first, also at the k-th place), so slot 0 is the chain op's argmax; log-probs <= 0."""
    _use_isa(isa, monkeypatch)
    gen = torch.Generator().manual_seed(k)
    logits = (torch.randn((37, 4096), generator=gen) * 4).to(dtype)
    logits[3] = torch.randint(0, 3, (4096,), generator=gen).to(dtype)  # ties everywhere, at the k-th place too
    logits[4] = 0.0
    logits[4, :20] = 9.0  # more equal maxima than k
    logits[5, 17] = 60.0  # one dominant logit: log-prob ~0, never above it
    ids, logps = chain_ops.draft_topk_logp(logits, k)
    want_ids, want_logps = chain_ops.draft_topk_logp_reference(logits, k)
    assert ids.shape == (37, k) and ids.dtype == torch.int64 and logps.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    assert torch.equal(ids[:, 0], chain_ops.draft_argmax_logp(logits)[0])
    assert torch.equal(ids[4], torch.arange(k))  # ties: the lowest ids, ascending
    assert torch.allclose(logps, want_logps, atol=2e-6, rtol=1e-5)
    assert bool((logps <= 0).all()) and bool((logps[:, :-1] >= logps[:, 1:]).all())


@needs_topk_op
@pytest.mark.parametrize("isa", ["native", "baseline"])
def test_draft_topk_logp_nan_and_dead_rows_give_no_log_prob_and_bad_k_one_line(isa, monkeypatch):
    _use_isa(isa, monkeypatch)
    logits = torch.zeros((4, 8))
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    logits[2, 2] = float("inf")
    logits[3] = torch.arange(8.0)
    ids, logps = chain_ops.draft_topk_logp(logits, 3)
    _, want_logps = chain_ops.draft_topk_logp_reference(logits[1:], 3)
    # No usable (finite) log-prob in those rows, as torch (which gives NaN or -inf there; the op NaN throughout).
    assert bool(torch.isnan(logps[:3]).all()) and not bool(torch.isfinite(want_logps[:2]).any())
    assert 5 not in ids[0].tolist() and int(ids[2, 0]) == 2  # NaN never chosen; +inf first
    assert ids[3].tolist() == [7, 6, 5] and bool(torch.isfinite(logps[3]).all())
    for bad in (0, 9):
        with pytest.raises(ValueError, match="top_k"):
            chain_ops.draft_topk_logp(logits, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("fixed", [True, False])
def test_cuda_selection_equals_the_cpu_specification(fixed):
    """On CUDA the chain step runs the torch twins: the same selection as on the CPU from the same inputs (the
    inputs are computed once, on CUDA, and copied, so that device exp/cumsum rounding is not what is compared)."""
    for seed in range(24):
        logps, kept, gate_on, tau, table, rest, draft = _random_case(seed, 37, 4, 5)
        inputs = chain_inputs(logps.cuda(), kept.cuda())
        kw = {
            "base_tokens": 37.0,
            "k_cap": 3 + seed * 5,
            "k_min": 0 if fixed else seed % 7,
            "surplus_tail": bool(seed % 2),
        }
        dev = (gate_on.cuda(), tau.cuda(), None if fixed else table.cuda(), rest.cuda(), draft.cuda())
        got = chain_ops.chain_select(inputs, *dev, **kw)
        host = ChainInputs(*(t.cpu() for t in inputs))
        want = chain_select_reference(host, gate_on, tau, None if fixed else table, rest, draft, **kw)
        assert got.counts.device.type == "cuda"
        assert torch.equal(got.counts.cpu(), want.counts), seed
        assert torch.equal(got.depth_cap.cpu(), want.depth_cap) and torch.equal(got.truncated.cpu(), want.truncated)
        assert float(got.predicted) == pytest.approx(float(want.predicted), rel=1e-9, abs=1e-12)


@pytest.mark.gpu
def test_cuda_draft_steps_match_and_never_sync():
    """The draft loop's per-step ops on CUDA (argmax / top-k and their log-probs over a Llama-3 vocabulary) equal
    the CPU twins and never wait for the device (torch's sync debug mode raises on a host sync)."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn((64, 128256), generator=gen) * 4
    logits[3, 100:104] = logits[3].max() + 1  # a four-way tie at the top: the tie rule must hold on CUDA too
    cuda_logits = logits.cuda()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, logps = chain_ops.draft_argmax_logp(cuda_logits)
        top_ids, top_logps = chain_ops.draft_topk_logp(cuda_logits, 4)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    want_ids, want_logps = chain_ops.draft_argmax_logp_reference(logits)
    want_top, want_top_logps = chain_ops.draft_topk_logp_reference(logits, 4)
    assert torch.equal(ids.cpu(), want_ids) and torch.equal(top_ids.cpu(), want_top)
    assert top_ids[3].tolist() == [100, 101, 102, 103]
    torch.testing.assert_close(logps.cpu(), want_logps, atol=1e-4, rtol=0)
    torch.testing.assert_close(top_logps.cpu(), want_top_logps, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", range(5))
def test_no_kept_mask_means_every_row_is_kept(seed):
    """The proposer passes kept=None when vLLM drops no row's drafts (most steps): the inputs of a mask of ones."""
    logps, kept, *_ = _random_case(seed, 7, 4, 4)
    got, want = chain_inputs(logps, None), chain_inputs(logps, torch.ones_like(kept))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # the scores hold NaN drafts


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    batch=st.integers(1, 24),
    depth=st.integers(2, 5),
    k_cap=st.integers(0, 60),
    surplus_tail=st.booleans(),
    fixed=st.booleans(),
)
def test_early_exit_on_history_keys_selects_what_full_drafting_selects(seed, batch, depth, k_cap, surplus_tail, fixed):
    """The proposer's early exit with a request history tests `drafting_can_stop` on the keys the selection orders
    by (f x confidence, non-increasing along a chain): stopping where it says gives the full chains' selection."""
    logps, kept, gate_on, tau, table, rest, draft = _random_case(seed, batch, depth, depth)
    history = _random_history(seed, batch, depth)
    kw = {"base_tokens": float(batch), "k_cap": k_cap, "k_min": 0, "surplus_tail": surplus_tail, "history": history}
    gains = None if fixed else table
    want = chain_select_reference(chain_inputs(logps, kept), gate_on, tau, gains, rest, draft, **kw)
    factor = history_factor(history, batch, HISTORY_PRIOR).unsqueeze(1)
    for d in range(1, depth):
        inputs = chain_inputs(logps[:, :d], kept)
        gates = chain_gates(inputs.confidence, gate_on, tau)
        if bool(drafting_can_stop(inputs.confidence * factor, inputs.valid, gates, k_cap, surplus_tail)):
            got = chain_select_reference(inputs, gate_on, tau, gains, rest[: batch * d + 1], draft[: d + 1], **kw)
            assert torch.equal(got.counts, want.counts), (d, got.counts, want.counts)
            break


def test_a_request_history_reorders_and_scales_the_gains():
    """Two requests with equal drafts: the one accepted more often than expected is verified first, and its gains
    (hence the expected accepted drafts of the cut) scale by its factor, capped at 1."""
    logps = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    inputs = chain_inputs(logps, None)
    gate_on, tau = torch.zeros(2, dtype=torch.bool), torch.zeros(2)
    history = torch.tensor([[0.0, 1.0], [3.0, 1.0]], dtype=torch.float64)  # factors 2/3 and 5/3 (prior 2)
    fixed = chain_select_reference(
        inputs, gate_on, tau, None, NO_SECONDS, NO_SECONDS, base_tokens=2.0, k_cap=2, k_min=0, surplus_tail=True,
        history=history,
    )  # fmt: skip
    assert fixed.counts.tolist() == [0, 2]  # without the history: [1, 1] (equal scores, lower index first)
    plain = chain_select_reference(
        inputs, gate_on, tau, None, NO_SECONDS, NO_SECONDS, base_tokens=2.0, k_cap=2, k_min=0, surplus_tail=True
    )
    assert plain.counts.tolist() == [1, 1]
    table = torch.full((2, 16), 0.4)
    flat = torch.full((5,), 1.0, dtype=torch.float64)  # verification is free: everything worth anything is taken
    auto = chain_select_reference(
        inputs, gate_on, tau, table, flat, torch.zeros(3, dtype=torch.float64), base_tokens=2.0, k_cap=4, k_min=0,
        surplus_tail=True, history=history,
    )  # fmt: skip
    want = 2 * float(torch.tensor(0.4) * torch.tensor(2 / 3, dtype=torch.float64).float()) + 2 * float(
        torch.clamp(torch.tensor(0.4) * torch.tensor(5 / 3, dtype=torch.float64).float(), max=1.0)
    )
    assert auto.counts.tolist() == [2, 2] and float(auto.predicted) == pytest.approx(want, rel=1e-6)
