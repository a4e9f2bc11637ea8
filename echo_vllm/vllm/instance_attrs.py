"""The vLLM instance attributes the plugin reads, in one table, checked when the object is built.

Class-level names are in `hooks.HOOKS` (checked at `register()`); these are set in vLLM's `__init__` bodies, so
they can only be checked on a live object: the proposer's right after `EagleProposer.__init__`, the runner's
right after `GPUModelRunner.__init__` (it builds its drafter before its input batch). A missing one is a vLLM
drift and fails there with `VllmDriftError`, naming the attribute, its reader and the installed vLLM — not later
as an AttributeError (or a silently skipped feature) in the middle of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class VllmDriftError(RuntimeError):
    """The installed vLLM lacks an attribute the plugin reads (a vLLM change since the pinned release)."""


@dataclass(frozen=True)
class InstanceAttr:
    owner: str  # the vLLM class whose instances carry it
    path: str  # dotted attribute path on the instance
    reader: str  # who reads it, for the error message and the docs table
    why: str


PROPOSER = "EagleProposer"
RUNNER = "GPUModelRunner"

INSTANCE_ATTRS: tuple[InstanceAttr, ...] = (
    InstanceAttr(
        PROPOSER,
        "num_speculative_tokens",
        "EchoProposer.__init__",
        "the chain depth D when the payload has no max_depth",
    ),
    InstanceAttr(
        PROPOSER,
        "use_heterogeneous_vocab",
        "EchoProposer._sample_draft_tokens",
        "whether draft ids need mapping to target ids",
    ),
    InstanceAttr(
        PROPOSER,
        "vocab_mapping",
        "EchoProposer._sample_draft_tokens",
        "draft/target vocabulary mapping (None unless heterogeneous)",
    ),
    *(
        InstanceAttr(PROPOSER, name, "EchoProposer._init_deferred_head", why)
        for name, why in (
            ("max_batch_size", "max_num_seqs: sizes the kept head rows"),
            ("needs_extra_input_slots", "parallel drafting has no plain first pass to defer"),
            ("uses_mrope", "M-RoPE positions are not kept (deferral off)"),
            ("supports_mm_inputs", "multimodal embeddings are not kept (deferral off)"),
            ("input_ids", "first-pass input ids (grown by the kept rows' capacity)"),
            ("positions", "first-pass positions (grown likewise)"),
            ("hidden_states", "first-pass hidden states (grown likewise)"),
            ("_slot_mapping_buffer", "the head's KV slots of the first pass (grown likewise)"),
        )
    ),
    InstanceAttr(RUNNER, "drafter", "EchoDrafterPatch", "the proposer the runner built (must be EchoProposer)"),
    InstanceAttr(
        RUNNER,
        "input_batch.req_ids",
        "EchoVerificationFeedbackPatch, EchoProposer._select",
        "request ids in batch order (verification results come back by request)",
    ),
    InstanceAttr(RUNNER, "input_batch.num_reqs", "EchoProposer._no_drafts", "one empty draft list per request"),
    InstanceAttr(
        RUNNER,
        "discard_request_mask.gpu",
        "EchoProposer._chain_tree",
        "requests whose drafts vLLM drops (partial prefills) get no budget",
    ),
    InstanceAttr(
        RUNNER,
        "positions",
        "EchoTreeInputsPatch, EchoTreeKVCompactionPatch",
        "tree positions (context + depth) for the target forward, linear ones back for the drafter",
    ),
    InstanceAttr(RUNNER, "query_start_loc.np", "EchoTreeInputsPatch", "each request's first row in the step"),
    InstanceAttr(
        RUNNER,
        "input_batch.num_computed_tokens_cpu",
        "EchoTreeInputsPatch",
        "each request's context length (the root's position)",
    ),
    InstanceAttr(
        RUNNER, "input_batch.block_table", "EchoTreeKVCompactionPatch", "the step's slot mapping per KV cache group"
    ),
    InstanceAttr(
        RUNNER,
        "compilation_config.static_forward_context",
        "EchoTreeKVCompactionPatch",
        "every attention layer's KV cache (the accepted path's KV is moved in each)",
    ),
    InstanceAttr(RUNNER, "rejection_sampler", "EchoDrafterPatch", "replaced by EchoTreeRejectionSampler in tree mode"),
    InstanceAttr(RUNNER, "sampler", "EchoDrafterPatch", "the tree sampler wraps the runner's own sampler"),
)
# Not checked at construction: EagleProposer.model (EchoProposer._sample_draft_tokens) is assigned by
# load_model() after the runner is built, and vLLM's own draft loop reads it first.


def _lookup(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _vllm_version() -> str:
    from echo_vllm.vllm.hooks import installed_vllm_version  # lazy: hooks imports this module

    return installed_vllm_version() or "not installed"


def require(obj: Any, owner: str) -> None:
    """Raise VllmDriftError if `obj` (an instance of vLLM's `owner`) lacks an attribute of the table."""
    for attr in INSTANCE_ATTRS:
        if attr.owner != owner:
            continue
        try:
            _lookup(obj, attr.path)
        except AttributeError:
            from echo_vllm.vllm.hooks import FIX, supported_versions_text

            raise VllmDriftError(
                f"echo-vllm: vLLM {_vllm_version()} {owner} ({type(obj).__name__}) has no attribute "
                f"'{attr.path}', read by {attr.reader} ({attr.why}); echo-vllm supports vLLM "
                f"{supported_versions_text()}; fix: {FIX}"
            ) from None


def table_markdown() -> str:
    rows = ["| instance attribute | read by | why |", "|---|---|---|"]
    for a in INSTANCE_ATTRS:
        rows.append(f"| `{a.owner}.{a.path}` | {a.reader} | {a.why} |")
    return "\n".join(rows)
