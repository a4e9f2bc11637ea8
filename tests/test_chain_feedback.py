"""The fused chain feedback op (`echo::chain_feedback`) against its torch specification, and that specification
against the pieces the proposer composed before it (AcceptanceModel.record, EchoMetrics.record_verification and
record_realised, time_budget.level_counts)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.core.acceptance import AcceptanceModel
from echo_vllm.core.chain_feedback import chain_feedback_reference
from echo_vllm.core.metrics import EchoMetrics
from echo_vllm.core.time_budget import level_counts, level_counts_from_histograms
from echo_vllm.ops import chain as chain_ops

needs_op = pytest.mark.skipif(not chain_ops._FEEDBACK_DEFINED, reason="echo_vllm._C without chain_feedback")
MAX_DEPTH = 4
BINS = 16
NO_HISTORY = (torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.float32), 0.0)


def _case(seed: int, old_batch: int, new_batch: int, rows: int, drafted: int, int32: bool):
    gen = torch.Generator().manual_seed(seed)
    rows = min(rows, old_batch, new_batch)
    cur = torch.randperm(new_batch, generator=gen)[:rows].sort().values
    old = torch.randperm(old_batch, generator=gen)[:rows]
    verified = torch.randint(0, drafted + 1, (rows,), generator=gen)
    width = MAX_DEPTH + 1
    emitted = torch.randint(0, width + 1, (new_batch,), generator=gen)  # 0 (a finished row) .. D + 1 tokens
    tokens = torch.randint(0, 4096, (new_batch, width), generator=gen)
    sampled = torch.where(torch.arange(width).unsqueeze(0) < emitted.unsqueeze(1), tokens, torch.full_like(tokens, -1))
    # Confidences on bin edges, outside [0, 1], NaN and 0 past the drafted depth, as the proposer pads them.
    levels = torch.tensor([0.0, 1 / 16, 0.5, 0.999, 1.0, 1.5, -0.5, float("nan"), 0.3, 0.0625])
    confidence = levels[torch.randint(0, levels.numel(), (old_batch, MAX_DEPTH), generator=gen)]
    confidence[:, drafted:] = 0.0
    return sampled.to(torch.int32 if int32 else torch.int64), cur, old, verified, confidence.float()


def _tables(seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    seen = torch.randint(0, 50, (MAX_DEPTH, BINS), generator=gen).to(torch.float64)
    return seen, (seen * 0.5).floor()


@needs_op
@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    old_batch=st.integers(1, 40),
    new_batch=st.integers(1, 40),
    rows=st.integers(0, 40),
    drafted=st.integers(0, MAX_DEPTH),
    int32=st.booleans(),
    record=st.booleans(),
)
def test_op_equals_the_torch_specification(seed, old_batch, new_batch, rows, drafted, int32, record):
    case = _case(seed, old_batch, new_batch, rows, drafted, int32)
    seen_ref, hits_ref = _tables(seed)
    seen_op, hits_op = seen_ref.clone(), hits_ref.clone()
    ref = chain_feedback_reference(*case, seen_ref, hits_ref, drafted, record)
    got = torch.ops.echo.chain_feedback(*case, seen_op, hits_op, drafted, record, *NO_HISTORY)
    assert torch.equal(got[0], ref.accepted) and got[0].dtype == torch.int64
    assert torch.equal(got[1], ref.sums)
    assert torch.equal(got[2], ref.levels)
    assert torch.equal(seen_op, seen_ref) and torch.equal(hits_op, hits_ref)


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 40),
    rows=st.integers(1, 40),
    drafted=st.integers(0, MAX_DEPTH),
)
def test_specification_is_the_composition_it_replaced(seed, batch, rows, drafted):
    sampled, cur, old, verified, confidence = _case(seed, batch, batch, rows, drafted, False)
    # The proposer's former chain path, op by op.
    emitted = (sampled[cur] != -1).sum(dim=1)
    accepted = (emitted - 1).clamp(min=0)
    depths = torch.arange(MAX_DEPTH).unsqueeze(0)
    node_depths = torch.where(depths < verified.unsqueeze(1), depths + 1, torch.zeros_like(depths))
    model = AcceptanceModel(MAX_DEPTH, num_bins=BINS)
    model.record(confidence[old], depths < accepted.unsqueeze(1), depths < verified.unsqueeze(1))
    metrics = EchoMetrics(MAX_DEPTH)
    metrics.record_verification(emitted, accepted, verified, depth=verified)
    metrics.record_realised(accepted)
    expected_levels = level_counts(accepted, node_depths, drafted)

    fresh = AcceptanceModel(MAX_DEPTH, num_bins=BINS)
    out = chain_feedback_reference(sampled, cur, old, verified, confidence, fresh.seen, fresh.accepted, drafted, True)
    assert torch.equal(out.accepted, accepted)
    assert torch.equal(fresh.seen, model.seen) and torch.equal(fresh.accepted, model.accepted)
    assert level_counts_from_histograms(out.levels.tolist(), drafted) == expected_levels
    summed = EchoMetrics(MAX_DEPTH)
    summed.record_verification_sums(out.sums.tolist(), realised=True)
    assert summed.summary() == metrics.summary()


def test_op_and_wrapper_refuse_bad_inputs_with_one_line():
    sampled, cur, old, verified, confidence = _case(0, 4, 4, 4, 2, False)
    seen, hits = _tables(0)
    if chain_ops._FEEDBACK_DEFINED:
        with pytest.raises(ValueError, match=r"cur\[0\] = 9 is outside sampled's 4 rows"):
            torch.ops.echo.chain_feedback(sampled, cur + 9, old, verified, confidence, seen, hits, 2, True, *NO_HISTORY)
        with pytest.raises(ValueError, match="drafted must be in"):
            torch.ops.echo.chain_feedback(sampled, cur, old, verified, confidence, seen, hits, 5, True, *NO_HISTORY)
        with pytest.raises(TypeError, match="seen and hits must be float64"):
            torch.ops.echo.chain_feedback(
                sampled, cur, old, verified, confidence, seen.float(), hits, 2, True, *NO_HISTORY
            )
        table = torch.rand(MAX_DEPTH, BINS)
        with pytest.raises(ValueError, match=r"history must be a contiguous \[B', 2\] CPU tensor"):
            torch.ops.echo.chain_feedback(
                sampled, cur, old, verified, confidence, seen, hits, 2, True, torch.zeros(2, 2, dtype=torch.float64),
                table, 0.3,
            )  # fmt: skip
        with pytest.raises(ValueError, match="gain_table must be"):
            torch.ops.echo.chain_feedback(
                sampled, cur, old, verified, confidence, seen, hits, 2, True, torch.zeros(4, 2, dtype=torch.float64),
                table[:2], 0.3,
            )  # fmt: skip
    # The wrapper takes the reference where the op cannot serve (the A/B switch).
    out = chain_ops.chain_feedback(
        sampled, cur, old, verified, confidence, seen.clone(), hits.clone(), drafted=2, record_acceptance=False
    )
    assert out.accepted.shape == (4,)


def test_torch_path_env_forces_the_reference(monkeypatch):
    monkeypatch.setenv(chain_ops.TORCH_PATH_ENV, "1")
    called = []
    monkeypatch.setattr(chain_ops, "chain_feedback_reference", lambda *a, **k: called.append(a) or "reference")
    case = _case(1, 3, 3, 3, 2, False)
    assert chain_ops.chain_feedback(*case, *_tables(1), drafted=2, record_acceptance=True) == "reference"
    assert called


def _history_table(seed: int, old_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 2)
    history = torch.rand((old_batch + seed % 3, 2), generator=gen, dtype=torch.float64) * 3.0
    table = torch.rand((MAX_DEPTH, BINS), generator=gen)
    table[torch.rand((MAX_DEPTH, BINS), generator=gen) < 0.3] = 0.25  # repeated gains
    return history, table


@needs_op
@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    old_batch=st.integers(1, 40),
    new_batch=st.integers(1, 40),
    rows=st.integers(0, 40),
    drafted=st.integers(0, MAX_DEPTH),
    alpha=st.sampled_from([0.0, 0.1, 0.3, 1.0]),
)
def test_op_updates_the_requests_history_as_the_specification(seed, old_batch, new_batch, rows, drafted, alpha):
    """The history (accepted and expected drafts per request, updated in place at the verified rows) bit for bit;
    every other output as without one."""
    case = _case(seed, old_batch, new_batch, rows, drafted, False)
    history_ref, table = _history_table(seed, old_batch)
    history_op = history_ref.clone()
    seen_ref, hits_ref = _tables(seed)
    seen_op, hits_op = seen_ref.clone(), hits_ref.clone()
    ref = chain_feedback_reference(
        *case, seen_ref, hits_ref, drafted, True, history=history_ref, gain_table=table, alpha=alpha
    )
    got = chain_ops.chain_feedback(
        *case, seen_op, hits_op, drafted=drafted, record_acceptance=True, history=history_op, gain_table=table,
        alpha=alpha,
    )  # fmt: skip
    assert chain_ops._GATE.serves(torch.device("cpu"), chain_ops._DEFINED)  # the op, not its twin, is under test
    assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.levels, ref.levels)
    assert torch.equal(seen_op, seen_ref) and torch.equal(hits_op, hits_ref)
    assert torch.equal(history_op, history_ref)  # bit for bit


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 20), drafted=st.integers(0, MAX_DEPTH))
def test_history_moves_towards_accepted_and_the_tables_expectation(seed, batch, drafted):
    """The specification against a plain loop: each verified row's pair moves by alpha towards (accepted drafts,
    sum over its verified prefix of the table's gains with a running minimum); other rows keep theirs."""
    sampled, cur, old, verified, confidence = _case(seed, batch, batch, batch, drafted, False)
    history, table = _history_table(seed, batch)
    before = history.clone()
    seen, hits = _tables(seed)
    out = chain_feedback_reference(
        sampled, cur, old, verified, confidence, seen, hits, drafted, False, history=history, gain_table=table,
        alpha=0.25,
    )  # fmt: skip
    touched = set(old.tolist())
    for r in range(old.numel()):
        row = int(old[r])
        gains, running = [], 1.0
        for d in range(int(verified[r])):
            c = float(confidence[row, d])
            c = 0.0 if c != c else min(max(c, 0.0), 1.0)
            running = min(running, float(table[d, min(int(c * BINS), BINS - 1)]))
            gains.append(running)
        want = (
            0.75 * float(before[row, 0]) + 0.25 * float(out.accepted[r]),
            0.75 * float(before[row, 1]) + 0.25 * sum(gains),
        )
        assert history[row].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    for row in range(history.shape[0]):
        if row not in touched:
            assert torch.equal(history[row], before[row])
