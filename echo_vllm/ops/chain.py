"""The fused CPU ops of a chain step (csrc/chain_cpu.cpp), each with its torch twin as specification and fallback
(no extension, one built before these ops, a non-CPU device, or ECHO_VLLM_CHAIN_TORCH=1 for A/B runs; logged once):

* `chain_select`: the step's gates and budget cut; twin: `echo_vllm.core.chain_select.chain_select_reference`
  (bit for bit);
* `chain_select_logps`: `chain_inputs` and `chain_select` in one call from the per-depth log-probs (the proposer's
  path); twin: `chain_inputs` over the stacked log-probs, then `chain_select` (bit for bit);
* `draft_argmax_logp`: a draft step's argmax token and its log-prob; twin: `draft_argmax_logp_reference`
  (max + logsumexp: the same token, the log-prob to float rounding);
* `draft_topk_logp`: a tree draft step's top-k tokens and their log-probs; twin: `draft_topk_logp_reference`
  (`topk_stable` + logsumexp: the same tokens in the same order, the log-probs to float rounding);
* `chain_feedback` (csrc/feedback_cpu.cpp): a verified chain step's feedback; twin:
  `echo_vllm.core.chain_feedback.chain_feedback_reference` (exactly: counts and float64 sums of counts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from echo_vllm import ops as _ops
from echo_vllm.core.chain_feedback import ChainFeedback, chain_feedback_reference
from echo_vllm.core.chain_select import (
    HISTORY_PRIOR,
    ChainInputs,
    ChainSelection,
    chain_inputs,
    chain_select_reference,
)
from echo_vllm.core.tree import topk_stable

TORCH_PATH_ENV = "ECHO_VLLM_CHAIN_TORCH"
_NO_TABLE = torch.empty(0, dtype=torch.float32)
_NO_HISTORY = torch.empty(0, dtype=torch.float64)
# A build older than the requests' history (its chain ops lack the `history` argument) counts as none: the twins.
_DEFINED = _ops.ops_defined("chain_select", "draft_argmax_logp") and _ops.op_takes("chain_select", "history")
_TOPK_DEFINED = _ops.ops_defined("draft_topk_logp")  # newer than the chain ops: an older build has those only
_FEEDBACK_DEFINED = _ops.ops_defined("chain_feedback") and _ops.op_takes("chain_feedback", "history")
_LOGPS_DEFINED = _ops.ops_defined("chain_select_logps")  # newest: an older build has the rest only
_GATE = _ops.CpuOpsGate(
    TORCH_PATH_ENV, "ECHO chain steps: torch draft log-probs, gates and budget cut", "the chain ops"
)


def compiled_chain_select(device: torch.device) -> bool:
    """Whether the compiled ops serve `device` now (else the torch twins; the reason is logged once)."""
    return _GATE.serves(device, _DEFINED)


def chain_select(
    inputs: ChainInputs,
    gate_on: torch.Tensor,
    tau: torch.Tensor,
    gain_table: torch.Tensor | None,
    rest_seconds: torch.Tensor,
    draft_seconds: torch.Tensor,
    *,
    base_tokens: float,
    k_cap: int,
    k_min: int = 0,
    surplus_tail: bool,
    history: torch.Tensor | None = None,
    history_prior: float = HISTORY_PRIOR,
) -> ChainSelection:
    """A chain step's selection: gain_table None is the fixed rule (the first k_cap candidates of ECHO's order),
    else the time-aware cut over rest_seconds [B * d + 1] and draft_seconds [d + 1] (`choose_budget`); history
    [B', 2] float64: the requests' factors (`chain_select_reference`)."""
    if not compiled_chain_select(inputs.scores.device):
        return chain_select_reference(
            inputs, gate_on, tau, gain_table, rest_seconds, draft_seconds,
            base_tokens=base_tokens, k_cap=k_cap, k_min=k_min, surplus_tail=surplus_tail,
            history=history, history_prior=history_prior,
        )  # fmt: skip
    counts, depth_cap, truncated, predicted = torch.ops.echo.chain_select(
        inputs.scores, inputs.valid, inputs.confidence, gate_on, tau,
        _NO_TABLE if gain_table is None else gain_table, rest_seconds, draft_seconds,
        float(base_tokens), int(k_cap), int(k_min), bool(surplus_tail),
        _NO_HISTORY if history is None else history, float(history_prior),
    )  # fmt: skip
    return ChainSelection(counts, depth_cap, truncated, predicted)


def chain_select_steps(
    step_logps: Sequence[torch.Tensor],
    batch: int,
    kept: torch.Tensor | None,
    gate_on: torch.Tensor,
    tau: torch.Tensor,
    gain_table: torch.Tensor | None,
    rest_seconds: torch.Tensor,
    draft_seconds: torch.Tensor,
    *,
    base_tokens: float,
    k_cap: int,
    k_min: int = 0,
    surplus_tail: bool,
    history: torch.Tensor | None = None,
    history_prior: float = HISTORY_PRIOR,
) -> tuple[ChainInputs, ChainSelection]:
    """A chain step's inputs (`chain_inputs` of the first `batch` rows of the per-depth log-probs [B'] stacked) and
    its selection (`chain_select`): one op call where `echo::chain_select_logps` serves (float32 log-probs)."""
    device = step_logps[0].device
    if not (compiled_chain_select(device) and _LOGPS_DEFINED and all(t.dtype == torch.float32 for t in step_logps)):
        inputs = chain_inputs(torch.stack(list(step_logps), dim=1)[:batch], kept)
        selection = chain_select(
            inputs, gate_on, tau, gain_table, rest_seconds, draft_seconds,
            base_tokens=base_tokens, k_cap=k_cap, k_min=k_min, surplus_tail=surplus_tail,
            history=history, history_prior=history_prior,
        )  # fmt: skip
        return inputs, selection
    counts, depth_cap, truncated, predicted, scores, valid, confidence = torch.ops.echo.chain_select_logps(
        list(step_logps), int(batch), kept, gate_on, tau, _NO_TABLE if gain_table is None else gain_table,
        rest_seconds, draft_seconds, float(base_tokens), int(k_cap), int(k_min), bool(surplus_tail),
        _NO_HISTORY if history is None else history, float(history_prior),
    )  # fmt: skip
    return ChainInputs(scores, valid, confidence), ChainSelection(counts, depth_cap, truncated, predicted)


def draft_argmax_logp_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B] int64, logps [B] float32): the first maximum of each row and max - logsumexp (no full log-softmax)."""
    logits32 = logits.float()  # a no-op for float32 logits
    top, ids = logits32.max(dim=-1)
    return ids, top - torch.logsumexp(logits32, dim=-1)


def draft_argmax_logp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain draft step from the head's logits [B, V]: the argmax token and its draft log-prob (one pass)."""
    if not compiled_chain_select(logits.device):
        return draft_argmax_logp_reference(logits)
    ids, logps = torch.ops.echo.draft_argmax_logp(logits)
    return ids, logps


def draft_topk_logp_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, k] int64, logps [B, k] float32): each row's k largest logits (value descending, equal values lower
    index first: `topk_stable`) and x - logsumexp, clamped to <= 0."""
    logits32 = logits.float()  # a no-op for float32 logits
    lse = torch.logsumexp(logits32, dim=-1)
    values, ids = topk_stable(logits32, k)
    return ids, (values - lse.unsqueeze(1)).clamp(max=0.0)


def draft_topk_logp(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree draft step from the head's logits [B, V]: the top-k tokens and their draft log-probs (one pass)."""
    if not _GATE.serves(logits.device, _DEFINED and _TOPK_DEFINED):
        return draft_topk_logp_reference(logits, k)
    ids, logps = torch.ops.echo.draft_topk_logp(logits, int(k))
    return ids, logps


def chain_feedback(
    sampled: torch.Tensor,
    cur: torch.Tensor,
    old: torch.Tensor,
    verified: torch.Tensor,
    confidence: torch.Tensor,
    seen: torch.Tensor,
    hits: torch.Tensor,
    *,
    drafted: int,
    record_acceptance: bool,
    history: torch.Tensor | None = None,
    gain_table: torch.Tensor | None = None,
    alpha: float = 0.0,
) -> ChainFeedback:
    """A verified chain step's feedback (see `chain_feedback_reference`): one op call on CPU. history (with
    gain_table): the requests' running averages, updated in place."""
    if not (_GATE.serves(confidence.device, _DEFINED) and _FEEDBACK_DEFINED):
        return chain_feedback_reference(
            sampled, cur, old, verified, confidence, seen, hits, drafted, record_acceptance,
            history=history, gain_table=gain_table, alpha=alpha,
        )  # fmt: skip
    with_history = history is not None and history.numel() > 0
    accepted, sums, levels = torch.ops.echo.chain_feedback(
        sampled, cur, old, verified, confidence, seen, hits, int(drafted), bool(record_acceptance),
        history if with_history else _NO_HISTORY, gain_table if with_history else _NO_TABLE, float(alpha),
    )  # fmt: skip
    return ChainFeedback(accepted, sums, levels)
