"""EchoProposer: vLLM's EAGLE proposer (V1 runner) with ECHO's gates and batch-wide draft budget.

Per step:
  1. vLLM's own EAGLE-3 draft loop (`SpecDecodeBaseProposer.propose`) drafts a chain of D = max depth tokens per
     request; `_sample_draft_tokens` is overridden to also keep the log-softmax score of each drafted token.
  2. The chain is a DraftTree with top_k = 1 (spine only): path score = cumulative draft log-prob.
  3. depth_confidence -> Gates.evaluate (no gates during warm-up; calibrated gates after) -> the batch-wide K_max
     selection `echo_vllm.ops.select_budget` over all running requests. With top_k = 1 every request's selection
     is a prefix of its chain (ancestor closure), of length K_i, with sum_i K_i <= K_max. Budget left over goes
     back to the tails of truncated requests (`add_surplus_tails`, Priority 3; `surplus_tail`).
  4. The drafts are returned as a ragged `list[list[int]]` (request i: its first K_i tokens). vLLM passes a list
     through `_get_draft_token_ids_cpu` to `Scheduler.update_draft_token_ids`; the next step schedules K_i draft
     tokens for request i and the chain rejection sampler verifies them (per-request `num_draft_tokens`).
Verification results come back through `observe_verification` (EchoVerificationFeedbackPatch): during warm-up
they feed the CalibrationRecorder; after `warmup_steps` recorded steps the gates are calibrated (and saved to
`calibration_file` if it did not exist). What one step hands to the next is a `PendingVerification`.

`k_max: "auto"` (the default) replaces the fixed cap by the time-aware budget (`echo_vllm.core.time_budget`):
warm-up verifies everything, profile steps sweep draft depths and verified fractions to measure the step cost
(`CostModel`, fitted from the step times measured here, refit periodically and broadcast from TP rank 0), and from
then on every step verifies the prefix of ECHO's order that maximises expected tokens per second, with each node's
acceptance probability from `AcceptanceModel`. The draft depth is the one worth most in hindsight (`DraftController`), and
on CPU the draft loop ends as soon as no deeper node can be selected (`drafting_can_stop`, exact; on CUDA that
test would cost a host sync per depth, so only the depth plan applies there).

All decisions are functions of the batch's tensors (no randomness, no rank-local state): every TP rank drafts,
gates and selects identically.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from echo_vllm.core.auto_budget import DraftPlan, drafting_can_stop, drafts_below_confidence
from echo_vllm.core.budget import BudgetSelection, add_surplus_tails, compact_selection
from echo_vllm.core.budget_profile import default_profile_path
from echo_vllm.core.calibration import Calibration, CalibrationRecorder, calibrate
from echo_vllm.core.chain_select import chain_inputs, chain_tree, history_factor
from echo_vllm.core.cost_model import StepSample
from echo_vllm.core.gating import Gates, depth_confidence
from echo_vllm.core.metrics import EchoMetrics
from echo_vllm.core.request_history import RequestHistory
from echo_vllm.core.time_budget import TimeAwareBudget
from echo_vllm.core.tree import DraftTree
from echo_vllm.core.tree_order import SpineFirstOrder, spine_first_order, spine_hindsight, spine_sibling_tree
from echo_vllm.core.width_schedule import WidthSchedule
from echo_vllm.ops import select_budget
from echo_vllm.ops.chain import (
    chain_feedback,
    chain_select_steps,
    compiled_chain_select,
    draft_argmax_logp,
    draft_topk_logp,
)
from echo_vllm.vllm import instance_attrs, prom_metrics
from echo_vllm.vllm import spec as echo_spec
from echo_vllm.vllm.deferred_head import DeferredHeadRows, HeadRows, request_of_rows, valid_rows
from echo_vllm.vllm.faults import guard_from_env
from echo_vllm.vllm.head_kv import HeadKVWriter
from echo_vllm.vllm.prompt_head_rows import prompt_tail_plan
from echo_vllm.vllm.stats_log import format_startup_line, format_stats_line
from echo_vllm.vllm.step_log import StepLogWriter, StepRecord
from echo_vllm.vllm.tp_share import broadcast_from_rank0
from echo_vllm.vllm.tree_adversary import adversary_from_env
from echo_vllm.vllm.tree_state import TreePlan

try:  # vLLM imports: this module is only imported inside a vLLM worker (EchoDrafterPatch)
    from vllm.v1.spec_decode.eagle import EagleProposer
except ImportError:  # pragma: no cover
    EagleProposer = object

logger = logging.getLogger("vllm.echo_vllm")

# Debug: append one JSON line per step (budget evidence for tests). A "{rank}" in the path is replaced by the TP
# rank, so every rank of a tensor-parallel engine writes its own file (TP tests compare them).
STEP_LOG_ENV = "ECHO_VLLM_STEP_LOG"
LOG_INTERVAL_ENV = "ECHO_VLLM_LOG_INTERVAL"  # seconds between periodic ECHO log lines (default 10)


# Rows the head may keep waiting, per max_num_seqs (the proposer's buffers grow by this): at one row per decoding
# request per plain step, up to this many plain steps in a row; then a plain step runs the head (merging them).
# With `deferred_head_window` W (default 1) a full stash is first trimmed to each request's W newest rows, and a
# merge takes only those: the head's KV of older positions stays unwritten (drafts may get worse, output cannot).
# Dropping every kept row was tried earlier and bought nothing measurable while the plan rarely sat at plain; with
# plain steps priced by what merges really pay, the plan sits there more at batch 64 and W = 1 measured 4 % faster.
DEFERRED_HEAD_STEPS = 16
DEFERRED_HEAD_NO_MERGE_ENV = "ECHO_VLLM_DEFERRED_HEAD_NO_MERGE"  # tests: drop the kept rows instead of merging
FORCE_PLAIN_ENV = "ECHO_VLLM_FORCE_PLAIN"  # tests: N > 1 = once calibrated, only every N-th step drafts
# Diagnostics (scripts/policy_blocks.py): once the budget decides ("auto" phase), alternate policies in blocks of
# POLICY_BLOCK_STEPS_ENV steps (default 8) within one engine, e.g. "auto,static:2" (static:d = draft to depth d and
# verify every draft, i.e. EAGLE-3 at depth d; static:0 = plain decoding; cut:d = draft to depth d and let the
# time-aware budget cut ECHO's order, i.e. the selection without the depth plan). Paired in time, the blocks compare
# policies where job-to-job drift (+-15 % on the testbed) swamps separate runs. The step log names each step's policy.
POLICY_BLOCKS_ENV = "ECHO_VLLM_POLICY_BLOCKS"
POLICY_BLOCK_STEPS_ENV = "ECHO_VLLM_POLICY_BLOCK_STEPS"
# Diagnostics (A/B of the cost model's context term, scripts/variants_ab.py): "0" gives the time-aware budget no
# context (every sample and price at C = 0: the cost model without the term, as before it); the step log still
# records each step's context.
COST_CONTEXT_ENV = "ECHO_VLLM_COST_CONTEXT"


# The depth plan's own policies: "auto", and "auto-flat" - the same without the request history in the selection
# (request_history's A/B inside one engine: the history still learns in both blocks).
AUTO_POLICIES = ("auto", "auto-flat")


def parse_policy_blocks(text: str, max_depth: int) -> list[tuple[str, int | None]]:
    """ "auto,static:2,cut:3" -> [("auto", None), ("static:2", 2), ("cut:3", 3)]; one clear error for anything
    else."""
    blocks: list[tuple[str, int | None]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item in AUTO_POLICIES:
            blocks.append((item, None))
            continue
        kind, _, depth = item.partition(":")
        lowest = 0 if kind == "static" else 1
        if kind not in ("static", "cut") or not depth.isdigit() or not lowest <= int(depth) <= max_depth:
            raise ValueError(
                f"{POLICY_BLOCKS_ENV}: {item!r} is not a policy; use 'auto', 'auto-flat', 'static:D' with 0 <= D <= {max_depth}"
                f" (0: plain decoding) or 'cut:D' with 1 <= D <= {max_depth}"
            )
        blocks.append((item, int(depth)))
    return blocks


class _HeadDeferred(Exception):
    """Raised by set_inputs_first_pass on a plain step whose head pass is deferred: vLLM's propose stops there."""


class _DraftingDone(Exception):
    """Raised from `_sample_draft_tokens` to leave vLLM's draft loop early (caught in `propose`)."""


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialized (tests)
        return 0


def _model_step_ms(cost: Any, batch: int, max_depth: int, plain_head_s: float, context: float = 0.0) -> list[float]:
    """The cost model's step at `batch` (requests holding `context` cached tokens) with every draft of depth
    d = 0..D verified, in ms (the step log's "model_ms"; `cost` is the fit of that step: refits replace the model,
    never change it)."""
    return [
        round(1e3 * (cost.rest_at(batch * (1 + d), batch, context) + cost.verify_at(batch, batch * d)
                     + cost.draft_seconds(batch, d) + (plain_head_s if d == 0 else 0.0)), 2)
        for d in range(max_depth + 1)
    ]  # fmt: skip


@dataclass(frozen=True)
class PendingVerification:
    """One step's hand-off to the next: where each request's drafts came from, for their verification result.

    req_ids: the request id of each row of this step's batch (the next step's batch order may differ);
    confidence [B, D]: the depth confidences c_{i,d} the drafts were gated on (calibration samples).
    """

    req_ids: list[str]
    confidence: torch.Tensor
    predicted: bool = False  # the time-aware budget predicted this selection's accepted drafts
    drafted_depth: int = 0  # how deep the step drafted (the depth plan's hindsight)
    listed: SpineFirstOrder | None = None  # trees: the drafts as listed (spine first); None: chains
    feeds_plan: bool = True  # its hindsight goes to the depth plan (not in ECHO_VLLM_POLICY_BLOCKS' cut:d blocks)
    sweep: str = ""  # "warmup" / "profile": a step of the time-aware budget's sweeps (`observe_sweep`)
    history: bool = False  # its rows are the request history's rows (request_history: the feedback updates them)
    stopped: bool = False  # its draft loop ended at draft_stop_confidence (the hindsight's deeper levels: this one)


class EchoProposer(EagleProposer):
    num_speculative_tokens: int  # vLLM's; `_draft` sets it per step and restores it
    _policy = "auto"  # this step's policy (ECHO_VLLM_POLICY_BLOCKS; "auto" without blocks)
    _cost_context = True  # the budget's cost model sees each step's context (ECHO_VLLM_COST_CONTEXT=0: not)
    _context_batch: int | None = None  # the batch the feedback took this step's context for (propose reuses it)
    _policy_blocks: tuple[tuple[str, int | None], ...] = ()
    _probe_rows: torch.Tensor | None = None
    history: RequestHistory | None = None  # request_history's per-request averages (None: off)
    _history_now = False  # this step's rows are the history's (aligned in `_before_drafting`)
    _stop_logp: float | None = None  # draft_stop_confidence in logs (None: off)
    _stop_path: torch.Tensor | None = None  # [B] each row's cumulative draft log-prob so far (with the stop on)
    _step_kept: tuple[int, torch.Tensor | None] | None = None  # this propose call's (batch, kept rows), once read
    _confidence_stop = False  # this step's draft loop may end at draft_stop_confidence (`_draft`)
    confidence_stops = 0  # steps whose draft loop draft_stop_confidence ended early (echo_stats)
    _confidence_stopped = False  # this step's draft loop ended at draft_stop_confidence
    _logged_confidence: list[list[float]] | None = None  # the step log's c_{i,d} of this step (None: not logged)

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        instance_attrs.require(self, instance_attrs.PROPOSER)  # vLLM drift fails at construction, not mid-step
        payload = echo_spec.echo_payload(vllm_config)
        if payload is None:
            raise ValueError("EchoProposer needs additional_config['echo'] (set by the echo-vllm plugin)")
        self.echo_settings = echo_spec.settings_from_payload(payload)
        max_depth: Any = payload.get("max_depth", self.num_speculative_tokens)
        self.max_depth = int(max_depth)
        self.auto = self.echo_settings.k_max == "auto"
        self.k_max: int | None = None if self.auto else int(self.echo_settings.k_max)
        # Trees (top_k > 1): the spine plus, at every depth, the top_k - 1 runner-up children of the spine node,
        # verified in the same target forward (tree_state, tree_attn_cpu, tree_sampler); top_k = 1: chains.
        self.top_k = int(self.echo_settings.top_k)
        self.tree_mode = bool(payload.get("tree", False)) and self.top_k > 1
        # vLLM's config carries the tree capacity D * top_k (its per-request buffers and stats are sized by it);
        # the draft loop runs D steps.
        self.num_speculative_tokens = self.max_depth
        self.tree_plans: dict[str, TreePlan] = {}  # this step's trees, checked against the next step's schedule
        self.tree_head_rows: torch.Tensor | None = None  # set by the KV compaction: head inputs in path order
        self.forward_fix_rows = 0  # tree rows (nodes off the spine) of this step's target forward, for the cost
        self.batch_has_structured_output = False  # this step's scheduled batch (EchoTreeInputsPatch sets it)
        self.tree_accepted: torch.Tensor | None = None  # the tree sampler's accepted positions, for the feedback
        # Which steps draft siblings (the rest draft chains).
        self._width_schedule = WidthSchedule(interval=self.echo_settings.probe_interval)
        self._tree_step = False  # this step drafts trees (tree mode and the batch's sampling allows it)
        self._tree_fallback_logged = False
        self.tree_chain_fallbacks = 0  # steps that verified or drafted chains because of the batch's settings
        self.tree_plan_mismatches = 0  # requests whose scheduled drafts were not their plan's (verified as chains)
        self._mismatch_logged = False
        self._echo_topk: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._adversary = adversary_from_env() if self.tree_mode else None
        self.tree_leaf_accepts = 0  # accepted nodes that had to be moved (non-spine paths), for logs and tests
        self._last_leaf_accepts = 0
        self._runner = runner
        self.faults = guard_from_env(self.echo_settings.fault_limit)
        self._stage = "draft"  # the stage running now, named in fault reports
        # A step is faulty if its feedback or its drafting faulted: a fault that hits only the feedback every
        # step must still count towards fault_limit, so a good propose does not reset the run after it.
        self._feedback_faulted = False
        self._echo_logps: list[torch.Tensor] = []
        self.recorder = CalibrationRecorder(self.max_depth)
        self.calibration: Calibration | None = None
        self.calibration_source = "warmup"
        cal_file = self.echo_settings.calibration_file
        if cal_file and Path(cal_file).expanduser().exists():
            self.calibration = Calibration.load(
                Path(cal_file).expanduser(),
                expected_max_depth=self.max_depth,
                expected_mode=self.echo_settings.gate_mode,
            )
            self.calibration_source = f"file {cal_file}"
        elif self.echo_settings.warmup_steps == 0:
            self.calibration_source = "none (warmup_steps=0: no gates)"
        self.warmup_recorded = 0
        self.tp_rank = _tp_rank()
        self.is_writer = self.tp_rank == 0
        # Depths 1..D (its device is where the proposer runs: the early-exit test is for CPU only).
        d = self.max_depth
        self._depth = torch.arange(1, d + 1, dtype=torch.int32, device=device)
        self._no_seconds = torch.empty(0, dtype=torch.float64, device=device)  # chain_select's fixed rule
        # What this step's drafts were drafted from, read back when their verification result arrives.
        self._pending: PendingVerification | None = None
        # The same statistics as the HF engine's (device accumulators; read back at log time only).
        self.stats = EchoMetrics(d)
        self._init_budget(device)
        self.deferred_head = self._init_deferred_head(vllm_config)
        self._defer_head_now = False  # set by _draft on a plain step, read by set_inputs_first_pass
        self._verified_in_forward = 0  # draft tokens the step's target forward verified (set by the feedback)
        self._merged_rows = 0  # deferred head rows merged into this step's first pass (its cost sample)
        self.prompt_rows_cut = 0  # prompt rows the head's first pass left out (`prompt_head_window`), in total
        self._head_cut = 0  # ... in this step's first pass (the step log)
        self._head_free = 0  # ... of them, rows whose K/V were not written either: free (the cost sample)
        self.prompt_rows_kv = 0  # ... of those, rows whose head K/V were written (`prompt_head_kv`), in total
        self._head_kv: HeadKVWriter | None = None  # resolved at the first cut (`_head_kv_checked`)
        self._head_kv_checked = False
        self._head_keys: dict[str, int] = {}  # request id -> key of its kept head rows (cleared at each merge)
        self._no_merge = os.environ.get(DEFERRED_HEAD_NO_MERGE_ENV) == "1"
        self._force_plain = int(os.environ.get(FORCE_PLAIN_ENV) or 0)
        self._cost_context = os.environ.get(COST_CONTEXT_ENV, "1") != "0"
        self._force_clock = 0
        self._policy_blocks = tuple(parse_policy_blocks(os.environ.get(POLICY_BLOCKS_ENV) or "", self.max_depth))
        self._policy_block_steps = max(1, int(os.environ.get(POLICY_BLOCK_STEPS_ENV) or 8))
        self._policy_clock = 0
        self._probe_rows: torch.Tensor | None = None  # this step's partially probed rows (probe_requests)
        self._probes_done = 0
        self._step_log = (os.environ.get(STEP_LOG_ENV) or "").replace("{rank}", str(self.tp_rank)) or None
        self._step_log_writer: StepLogWriter | None = None
        self._scratch_table: tuple[torch.Tensor, torch.Tensor] | None = None  # `_no_acceptance_table`
        # request_history: per request of the drafting batch, its accepted vs expected drafts (chains, CPU, auto).
        if self.echo_settings.request_history > 0.0 and self.auto and not self.tree_mode:
            self.history = RequestHistory(self.echo_settings.request_history, capacity=self._max_rows(vllm_config))
        self._log_interval = float(os.environ.get(LOG_INTERVAL_ENV, "10"))
        self._last_log = time.monotonic()
        self.prom = prom_metrics.exporter_for(self, vllm_config)  # ECHO's /metrics series (a no-op off rank 0)
        logger.info("%s", self._startup_line(device))

    @staticmethod
    def _max_rows(vllm_config: Any) -> int:
        scheduler = getattr(vllm_config, "scheduler_config", None)
        return int(getattr(scheduler, "max_num_seqs", 8) or 8)

    def _init_budget(self, device: Any) -> None:
        """The time-aware budget (k_max 'auto') and the step timing both modes report."""
        s = self.echo_settings
        profile_path = (
            Path(s.budget_profile_file).expanduser()
            if s.budget_profile_file
            else default_profile_path(s.calibration_file)
        )
        self.budget: TimeAwareBudget | None = None
        if self.auto:
            self.budget = TimeAwareBudget(
                self.max_depth,
                profile_steps=s.profile_steps,
                probe_interval=s.probe_interval,
                plain_hindsight=s.plain_hindsight,
                probe_load_scale=s.probe_load_scale,
                probe_next=s.probe_depth == "next",
                switch_margin=s.depth_switch_margin,
                catch_up=s.plan_catch_up,
                stale_slot_steps=s.stale_slot_steps,
                continuation_memory=s.continuation_memory,
                plain_head_rows=s.plain_head_rows,
                surplus_tail=s.surplus_tail,
                profile_path=profile_path,
                device=device,
                is_writer=self.is_writer,
                share=broadcast_from_rank0,
            )
        self._budget_logged = False
        self._step_start: float | None = None
        self._last_end: float | None = None
        self._early_cap: int | None = None  # candidate cap of the early-exit test in this step's draft loop
        stop = self.echo_settings.draft_stop_confidence
        self._stop_logp = math.log(stop) if stop > 0 else None
        self._draft_target = 0
        self._step_tokens = 0
        self._step_context = 0
        self._context_batch = None
        self._echo_ids: list[torch.Tensor] = []
        self._last_accepted: list[int] = []  # step log only
        self._last_times = (0.0, 0.0)  # (rest_s, draft_s) of the last timed step, step log only
        self._plan = DraftPlan(self.max_depth, 0, False)
        self._phase_seconds = {"draft": 0.0, "select": 0.0, "rest": 0.0}
        self._timed_steps = 0
        self._rest_timed_steps = 0

    def _init_deferred_head(self, vllm_config: Any) -> DeferredHeadRows | None:
        """The kept head rows of plain steps (`defer_plain_head`), where vLLM's first pass is the plain one: no
        extra input slots (parallel drafting), no M-RoPE, no multimodal embeddings, no data parallelism (its
        ranks coordinate every drafter forward). The head's input buffers grow by the capacity, so that a merged
        first pass (the step's rows plus the kept ones) always fits."""
        if not self.echo_settings.defer_plain_head:
            return None
        if (
            self.needs_extra_input_slots
            or self.uses_mrope
            or self.supports_mm_inputs
            or vllm_config.parallel_config.data_parallel_size > 1
        ):
            logger.info(
                "ECHO: the draft head runs on plain steps too (defer_plain_head needs a plain EAGLE first pass)"
            )
            return None
        capacity = max(64, DEFERRED_HEAD_STEPS * int(self.max_batch_size))
        for name in ("input_ids", "positions", "hidden_states", "_slot_mapping_buffer"):
            buffer = getattr(self, name)
            grown = buffer.new_zeros((buffer.shape[0] + capacity, *buffer.shape[1:]))
            grown[: buffer.shape[0]] = buffer
            setattr(self, name, grown)
        return DeferredHeadRows(capacity, window=self.echo_settings.deferred_head_window)

    @property
    def warming_up(self) -> bool:
        return self.calibration is None and self.echo_settings.warmup_steps > 0

    @property
    def phase(self) -> str:
        """warmup (calibrating the gates), profile (measuring step cost), auto (time-aware) or fixed (integer k_max)."""
        if self.budget is None:
            return "warmup" if self.warming_up else "fixed"
        return self.budget.phase(self.warming_up)

    def _startup_line(self, device: Any) -> str:
        from echo_vllm.ops import active_implementation
        from echo_vllm.vllm.hooks import installed_vllm_version

        kind = torch.device(device).type
        return format_startup_line(
            vllm_version=installed_vllm_version(),
            runner=type(self._runner).__name__ if self._runner is not None else "none",
            max_depth=self.max_depth,
            settings=self.echo_settings,
            calibration=self.calibration_source,
            budget_op=f"{kind}:{active_implementation().get(kind, 'reference')}",
            tree_fixup=self._tree_fixup_name(torch.device(device)),
        )

    def _tree_fixup_name(self, device: torch.device) -> str:
        """Which code recomputes the tree rows' attention on this device (the start-up line's `trees=`)."""
        if not self.tree_mode:
            return "chains"
        if device.type == "cuda":
            from echo_vllm.vllm.tree_attn_cuda import fused_suffix_merge_for

            return "cuda:triton" if fused_suffix_merge_for(device) is not None else "cuda:torch"
        from echo_vllm.ops.tree import compiled_tree_ops

        return f"{device.type}:{'csrc' if compiled_tree_ops(device) else 'torch'}"

    # ---------------------------------------------------------------------------------------------------------
    # Drafting
    # ---------------------------------------------------------------------------------------------------------

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        """The argmax draft token plus its draft log-prob (path scores need it, not just the argmax).

        Always argmax, even with draft_sample_method='probabilistic': ECHO's drafts are deterministic (top-k), and
        the rejection sampler then verifies them with no draft probabilities (accept x with probability p(x),
        resample from p without x), which is exact for deterministic drafts. log p(argmax) = max logit -
        logsumexp: no full-vocabulary log-softmax is materialised.
        """
        logits = self.model.compute_logits(hidden_states)
        if self.use_heterogeneous_vocab:
            logits = self.vocab_mapping.constrain_draft_logits(logits)
        if self._tree_step:
            # The spine continues with slot 0 (argmax, lowest id among ties: the chain's token); slots 1..k-1 are
            # the sibling leaves of this depth (one pass on CPU: echo::draft_topk_logp).
            top_ids, top_logps = draft_topk_logp(logits, self.top_k)
            if self.use_heterogeneous_vocab:
                top_ids = self.vocab_mapping.map_draft_to_target_ids(top_ids)
            self._echo_topk.append((top_ids, top_logps))
            self._echo_logps.append(top_logps[:, 0])
            draft_ids = top_ids[:, 0]
        else:  # one pass over the logits on CPU (echo::draft_argmax_logp), max + logsumexp elsewhere
            draft_ids, logps = draft_argmax_logp(logits)
            self._echo_logps.append(logps)
            if self._confidence_stop:  # one add per level, summed in the order the old sum over the list used
                self._stop_path = logps if self._stop_path is None else self._stop_path + logps
        if self.use_heterogeneous_vocab and not self._tree_step:
            draft_ids = self.vocab_mapping.map_draft_to_target_ids(draft_ids)
        self._echo_ids.append(draft_ids)
        drafted = len(self._echo_ids)
        if self._confidence_stop and 2 <= drafted < self._draft_target and self._below_stop_confidence():
            self.confidence_stops += 1
            self._confidence_stopped = True
            raise _DraftingDone
        # The test can only pass once B x drafted >= k_cap (it needs k_cap candidates ahead of every frontier), so
        # below that it is skipped: its dozen small ops per depth cost more than they save at small batches.
        if (
            self._early_cap is not None
            and drafted < self._draft_target
            and draft_ids.shape[0] * drafted >= self._early_cap
            and self._can_stop()
        ):
            raise _DraftingDone
        return draft_ids, None

    def _confidence_stop_applies(self, depth: int, on_cpu: bool) -> bool:
        """Whether this step's draft loop may end at draft_stop_confidence: CPU chains (the test reads the
        log-probs on the host; on CUDA that read would be a sync inside the loop), drafting 3 or more deep (the test
        runs from depth 2 on), a time-aware step that is no probe (a probe, partial ones too, measures every depth
        it drafts; warm-up and profile steps draft what their sweeps need; ECHO_VLLM_POLICY_BLOCKS' blocks hold
        their depth)."""
        return (
            self._stop_logp is not None
            and on_cpu
            and depth > 2
            and not self._tree_step
            and not self._plan.probe
            and self._probe_rows is None
            and self._policy in AUTO_POLICIES
            and self.phase == "auto"
        )

    def _below_stop_confidence(self) -> bool:
        """Every kept row's chain so far has a path confidence below draft_stop_confidence (CPU tensors: the host
        read is not a device sync)."""
        assert self._stop_logp is not None and self._stop_path is not None
        path = self._stop_path  # each row's cumulative log-prob through the deepest drafted level
        batch = min(path.shape[0], self._runner.input_batch.num_reqs) if self._runner is not None else path.shape[0]
        kept = self._step_kept_rows(batch)
        if kept is None and batch > 0:
            # Every row kept (most steps): two ops, not four. A NaN row makes the max NaN, which compares False, so
            # it keeps the loop going, as in `drafts_below_confidence`.
            rows = path if batch == path.shape[0] else path[:batch]
            return bool(rows.max() < self._stop_logp)
        return drafts_below_confidence(path[:batch], kept, self._stop_logp)

    def _can_stop(self) -> bool:
        """The exact early-exit test on the depths drafted so far (CPU tensors: the .item() is not a device sync)."""
        assert self._early_cap is not None
        logps = torch.stack(self._echo_logps, dim=1)
        batch = min(logps.shape[0], self._runner.input_batch.num_reqs) if self._runner is not None else logps.shape[0]
        scores = torch.cumsum(logps[:batch], dim=1)
        valid = torch.isfinite(scores)
        kept = self._step_kept_rows(batch)
        if kept is not None:
            valid &= kept.unsqueeze(1)
        confidence = torch.exp(torch.where(valid, scores, torch.full_like(scores, float("-inf"))))
        gates = self._gates(confidence)
        history = self._history_rows()
        if history is not None and self.history is not None:
            # The selection's order: f x confidence (non-increasing along a chain, as the scores are).
            scores = confidence * history_factor(history, batch, self.history.prior).unsqueeze(1)
        return bool(drafting_can_stop(scores, valid, gates, self._early_cap, self.echo_settings.surplus_tail).item())

    def _set_step_context(self, batch: int | None = None) -> None:
        """This step's KV context (`_context_tokens`) for the step log and the time-aware budget's context term
        (a sum over B host ints). The feedback takes it first and propose reuses it: both run in the same step on the
        same input batch (EchoVerificationFeedbackPatch calls the feedback right before vLLM's propose); propose
        takes it itself only when the feedback did not (a fault or a test driving propose alone)."""
        if self.budget is None and not self._step_log:
            return
        if batch is None:
            batch = self._runner.input_batch.num_reqs if self._runner is not None else 0
        if self._context_batch == batch:
            self._context_batch = None  # taken by this step's feedback: one numpy sum per step, not two
            return
        self._step_context = self._context_tokens(batch)
        if self.budget is not None:
            self.budget.set_step_context(self._step_context if self._cost_context else 0)

    def _context_tokens(self, batch: int) -> int:
        """Tokens already in the KV cache of this step's requests (host numpy: no sync); 0 without a runner."""
        if self._runner is None or batch <= 0:
            return 0
        return int(self._runner.input_batch.num_computed_tokens_cpu[:batch].sum())

    def _step_kept_rows(self, batch: int) -> torch.Tensor | None:
        """`_kept_rows_unless_all`, read once per propose call (the draft stop asks at every level, the selection
        once more; vLLM sets the mask before the step's forward and leaves it until the next step)."""
        if self._step_kept is None or self._step_kept[0] != batch:
            self._step_kept = (batch, self._kept_rows_unless_all(batch))
        return self._step_kept[1]

    def _kept_rows_unless_all(self, batch: int) -> torch.Tensor | None:
        """`_kept_rows`, or None when vLLM keeps every row's drafts: most steps, known from the mask's host copy
        (vLLM fills `.np` and copies it to the device each step) without the two tensor ops of the mask."""
        buffer = self._runner.discard_request_mask if self._runner is not None else None
        host = getattr(buffer, "np", None)
        if host is not None and host.shape[0] >= batch and not np.count_nonzero(host[:batch]):  # not .any(): 3x dearer
            return None
        return self._kept_rows(batch)

    def _kept_rows(self, batch: int) -> torch.Tensor:
        """[B] bool: rows whose drafts vLLM keeps (partial prefills' drafts are dropped)."""
        discard = self._runner.discard_request_mask.gpu if self._runner is not None else None
        if discard is not None and discard.shape[0] >= batch:
            return ~discard[:batch].to(torch.bool)
        return torch.ones(batch, dtype=torch.bool, device=self._depth.device)

    def _gates(self, confidence: torch.Tensor) -> Gates:
        """The gates on the depths drafted so far; gates of depths not drafted stay open (+inf confidence)."""
        batch, depth = confidence.shape
        pad = torch.full((batch, self.max_depth - depth), float("inf"), device=confidence.device)
        return Gates.evaluate(torch.cat([confidence, pad], dim=1), self.calibration, self.echo_settings.surplus_width)

    def propose(self, num_speculative_tokens, *args, **kwargs):
        """vLLM's EAGLE-3 chain, then ECHO's gates and budget; any fault in here means no drafts this step."""
        start = self._step_start if self._step_start is not None else time.perf_counter()
        self._step_start = None
        if self.faults.disabled:
            self._pending = None
            self.tree_plans, self.tree_head_rows = {}, None
            return self._no_drafts()
        self._stage = "draft"
        try:
            # First: the head rows belong to this step's inputs only, whatever happens below.
            self._use_tree_head_rows(kwargs)
            self.faults.maybe_inject("draft")
            batch = self._runner.input_batch.num_reqs if self._runner is not None else 0
            self._tree_step = (
                self.tree_mode
                and self._trees_allowed(kwargs.get("sampling_metadata"))
                and self._trees_worth_drafting(batch)
            )
            target = kwargs.get("target_token_ids")  # tokens of this step's target forward (the runner's keyword)
            self._step_tokens = int(target.shape[0]) if isinstance(target, torch.Tensor) else batch
            self._set_step_context(batch)
            if self._last_end is not None:
                self._last_times = (start - self._last_end, self._last_times[1])
            self._before_drafting(batch)
            self._merged_rows = 0
            self._head_cut = self._head_free = 0
            drafts = self._draft(num_speculative_tokens, args, kwargs)
            drafted = time.perf_counter()
            if not isinstance(drafts, torch.Tensor) or drafts.dim() != 2:
                return drafts
            ragged = self._select(drafts)
            self._after_step(start, drafted, batch, drafts.shape[1])
        except Exception as err:
            self._pending = None
            self.tree_plans = {}
            self.faults.record_fault(self._stage, err)
            if self.faults.should_raise:
                raise
            return self._no_drafts()
        finally:
            self._early_cap = None
            self._confidence_stop = False
            self._step_kept = None  # the mask is read anew in the next step
            self._last_leaf_accepts = 0  # set by the next tree step's compaction
        if not self._feedback_faulted:
            self.faults.record_success()
        return ragged

    def _draft(self, num_speculative_tokens: int, args: tuple, kwargs: dict) -> Any:
        """vLLM's draft loop at this step's planned depth, left early when `_can_stop` says nothing deeper counts."""
        plan = self._plan
        depth = min(int(num_speculative_tokens), plan.depth)
        self._echo_logps, self._echo_ids, self._echo_topk = [], [], []
        self._stop_path, self._step_kept = None, None
        self._draft_target = depth
        on_cpu = self._depth.device.type == "cpu"
        # The early-exit test is exact for chains only (a tree's deeper siblings rank after every spine node).
        self._early_cap = plan.k_cap if (on_cpu and depth > 1 and not self._tree_step) else None
        self._confidence_stop = self._confidence_stop_applies(depth, on_cpu)
        self._confidence_stopped = False
        self._defer_head_now = depth == 0 and self.deferred_head is not None
        if self._defer_head_now and self._defer_newest_rows(kwargs):
            self._defer_head_now = False
            self.num_speculative_tokens = self.max_depth
            self._last_draft_probs = None  # as vLLM's propose starts: no draft of this step has probabilities
            batch = kwargs["common_attn_metadata"].batch_size()
            return torch.empty((batch, 0), dtype=torch.int64, device=self._depth.device)
        self._cut_prompt_rows(kwargs)
        try:
            return super().propose(depth, *args, **kwargs)
        except _DraftingDone:
            return torch.stack(self._echo_ids, dim=1)
        except _HeadDeferred:
            batch = kwargs["common_attn_metadata"].batch_size()
            return torch.empty((batch, 0), dtype=torch.int64, device=self._depth.device)
        finally:
            self._defer_head_now = False
            # vLLM's propose keeps the depth it was given; its dummy runs read it later: restore the configured one.
            self.num_speculative_tokens = self.max_depth

    def set_inputs_first_pass(
        self,
        target_token_ids,
        next_token_ids,
        target_positions,
        target_hidden_states,
        token_indices_to_sample,
        cad,
        num_rejected_tokens_gpu,
    ):
        """vLLM's first-pass inputs, then (defer_plain_head) either kept for later on a plain step (the head does
        not run: `_HeadDeferred`) or merged with the rows kept from earlier plain steps."""
        num_tokens, indices, cad = super().set_inputs_first_pass(
            target_token_ids,
            next_token_ids,
            target_positions,
            target_hidden_states,
            token_indices_to_sample,
            cad,
            num_rejected_tokens_gpu,
        )
        kept = self.deferred_head
        if kept is None:
            return num_tokens, indices, cad
        defer, self._defer_head_now = self._defer_head_now, False
        if defer:
            rows = self._first_pass_rows(num_tokens, indices, cad, valid_only=True)
            if not kept.can_take(rows.num_rows):
                kept.trim()  # with deferred_head_window: the rows a merge would drop anyway make room
            if kept.can_take(rows.num_rows):
                kept.append(rows)
                raise _HeadDeferred
        if kept.num_rows == 0:
            return num_tokens, indices, cad
        if self._no_merge:
            kept.clear()
            self._head_keys.clear()
            return num_tokens, indices, cad
        merged = kept.take_merge(
            self._first_pass_rows(num_tokens, indices, cad, valid_only=False),
            cad.query_start_loc,
            self._request_keys(cad.batch_size()),
        )
        self._head_keys.clear()
        rows, total = merged.rows, merged.rows.num_rows
        self._merged_rows = merged.num_merged  # this step's cost sample: the backlog its first pass carried
        if self.budget is not None:
            self.budget.record_head_merge(merged.num_merged, merged.num_deferred)
        self.input_ids[:total] = rows.input_ids
        self.positions[:total] = rows.positions
        self.hidden_states[:total] = rows.hidden
        qsl = merged.query_start_loc.to(device=cad.query_start_loc.device)
        cad = cad.replace(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.to("cpu"),
            num_actual_tokens=total,
            max_query_len=merged.max_query_len,
            slot_mapping=rows.slots,
            positions=None if cad.positions is None else rows.positions.to(cad.positions.dtype),
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return total, merged.current_to_merged[indices.long()].to(indices.dtype), cad

    def _defer_newest_rows(self, kwargs: dict) -> bool:
        """deferred_head_window 1, a plain step: keep each request's newest head row (the only one a merge would
        take) straight from the target's outputs, instead of vLLM's first-pass layout of every row - the fc over
        all rows' auxiliary hidden states (prompt chunks included) and the buffer copies - that the window then
        drops. The row is the one vLLM would lay out last: input id = the next token, the last valid position, its
        hidden state and KV slot. False: the general path (another window, a vocabulary mapping, missing inputs)."""
        kept = self.deferred_head
        if kept is None or kept.window != 1 or getattr(self, "method", None) != "eagle3":
            return False
        if getattr(self, "use_heterogeneous_vocab", False):
            return False
        cad = kwargs.get("common_attn_metadata")
        hidden = kwargs.get("target_hidden_states")
        positions = kwargs.get("target_positions")
        next_ids = kwargs.get("next_token_ids")
        if cad is None or not isinstance(hidden, torch.Tensor) or not isinstance(next_ids, torch.Tensor):
            return False
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            return False
        batch = cad.batch_size()
        if not kept.can_take(batch):
            kept.trim()
            if not kept.can_take(batch):
                return False
        last = kwargs.get("token_indices_to_sample")
        if last is None:
            last = cad.query_start_loc[1:] - 1
        last = last[:batch].to(torch.long)
        rows = HeadRows(
            next_ids[:batch].clone(),
            positions[last],
            self.model.combine_hidden_states(hidden[last]),
            cad.slot_mapping[last],
            self._request_keys(batch),
        )
        kept.append(rows, covers=int(positions.shape[0]))
        return True

    def _cut_prompt_rows(self, kwargs: dict) -> None:
        """`prompt_head_window` W: the first pass runs only each prefilling request's W newest rows
        (`prompt_tail_plan`); the target's rows, their sample indices and the attention metadata are cut alike,
        before vLLM's fc over the auxiliary hidden states. Left alone where the first pass is not the plain EAGLE
        one (extra input slots, M-RoPE, multimodal embeddings) or no request is known to be prefilling."""
        window = self.echo_settings.prompt_head_window
        cad = kwargs.get("common_attn_metadata")
        if window <= 0 or cad is None:
            return
        prefilling = self._prefilling(cad)
        if prefilling is None:
            return
        if self.needs_extra_input_slots or self.uses_mrope or kwargs.get("mm_embed_inputs") is not None:
            return
        tokens, positions, hidden = (
            kwargs.get(k) for k in ("target_token_ids", "target_positions", "target_hidden_states")
        )
        if not isinstance(tokens, torch.Tensor) or not isinstance(hidden, torch.Tensor):
            return
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            return
        plan = prompt_tail_plan(cad.query_start_loc_cpu, prefilling, window, int(tokens.shape[0]))
        if plan is None:
            return
        keep = plan.keep.to(tokens.device, non_blocking=True)
        kwargs["target_token_ids"] = tokens[keep]
        kwargs["target_positions"] = positions[keep]
        kwargs["target_hidden_states"] = hidden[keep]
        sample = kwargs.get("token_indices_to_sample")
        if sample is not None:  # one index per request, each inside its request's kept tail (its last valid row)
            batch = cad.batch_size()
            shift = plan.shift.to(sample.device, non_blocking=True).to(sample.dtype)
            kwargs["token_indices_to_sample"] = torch.cat([sample[:batch] - shift, sample[batch:]])
        qsl = plan.query_start_loc
        kwargs["common_attn_metadata"] = cad.replace(
            query_start_loc=qsl.to(cad.query_start_loc.device, non_blocking=True),
            query_start_loc_cpu=qsl,
            num_actual_tokens=int(plan.keep.shape[0]),
            max_query_len=plan.max_query_len,
            slot_mapping=cad.slot_mapping[keep],
            positions=None if cad.positions is None else cad.positions[keep],
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        self.prompt_rows_cut += plan.num_cut
        self._head_cut = self._head_free = plan.num_cut
        writer = self._head_kv_writer() if self.echo_settings.prompt_head_kv else None
        if writer is not None:
            # Before the first pass: its kept rows attend over these positions. A cut row's next row is in its
            # own request (`PromptTailPlan.cut`), so its first-pass input token is the target's next one.
            cut = plan.cut.to(tokens.device, non_blocking=True)
            writer.write(tokens[cut + 1], positions[cut], hidden[cut], cad.slot_mapping[cut])
            self.prompt_rows_kv += plan.num_cut
            # Written rows still cost the proposer per row (on the testbed's head about what the full pass did):
            # the cost sample counts them as prompt rows, whose price the fit learns.
            self._head_free = 0

    def _head_kv_writer(self) -> HeadKVWriter | None:
        """The head's K/V writer (`head_kv`), looked up once; a head or backend without one is said once."""
        if not self._head_kv_checked:
            self._head_kv_checked = True
            self._head_kv, why = HeadKVWriter.of(getattr(self, "model", None))
            if self._head_kv is None:
                logger.warning(
                    "ECHO prompt_head_kv: %s; the prompt rows prompt_head_window leaves out keep no head KV "
                    "(drafts may get worse, output cannot change)",
                    why,
                )
        return self._head_kv

    def _prefilling(self, cad: Any) -> torch.Tensor | None:
        """[B] bool on the host: the step's requests whose rows are prompt tokens. The metadata's `is_prefilling`
        where the runner sets it (vLLM's GPU runner), else the same test on the input batch's host counts (the
        CPU runner's metadata has none): tokens computed before this step < prompt tokens."""
        flags = getattr(cad, "is_prefilling", None)
        if isinstance(flags, torch.Tensor):
            return flags.cpu()
        batch = getattr(self._runner, "input_batch", None)
        computed = getattr(batch, "num_computed_tokens_cpu_tensor", None)
        prompt = getattr(batch, "num_prompt_tokens_cpu_tensor", None)
        if not isinstance(computed, torch.Tensor) or not isinstance(prompt, torch.Tensor):
            return None
        num = cad.batch_size()
        return computed[:num] < prompt[:num]

    def _first_pass_rows(self, num_tokens: int, indices: torch.Tensor, cad: Any, valid_only: bool) -> HeadRows:
        """This step's head rows from the buffers set_inputs_first_pass just wrote (valid_only: without the rows
        of rejected drafts after each request's last valid one; they are copies then)."""
        qsl = cad.query_start_loc
        keys = self._request_keys(cad.batch_size())[request_of_rows(qsl, num_tokens)]
        rows = HeadRows(
            self.input_ids[:num_tokens],
            self.positions[:num_tokens],
            self.hidden_states[:num_tokens],
            cad.slot_mapping[:num_tokens],
            keys,
        )
        if not valid_only:
            return rows
        last = qsl[1:] - 1
        if indices.shape == last.shape and torch.equal(indices.to(last.dtype), last):  # no rejected rows: copy all
            return rows.copy()
        return rows.select(torch.nonzero(valid_rows(qsl, indices, num_tokens)).squeeze(1))

    def _request_keys(self, batch: int) -> torch.Tensor:
        """[B] int64: a stable key per request of the batch while it has kept head rows (padding rows: -1 - i)."""
        req_ids = list(self._runner.input_batch.req_ids[:batch]) if self._runner is not None else []
        keys = self._head_keys
        values = [keys.setdefault(rid, len(keys)) for rid in req_ids]
        values += [-1 - i for i in range(len(values), batch)]
        return torch.tensor(values, dtype=torch.int64, device=self._depth.device)

    def _use_tree_head_rows(self, kwargs: dict) -> None:
        """After a tree step, feed the EAGLE head its inputs in accepted-path order (root, path, the rest), so its
        first pass writes its KV where the target's now is (compacted) and reads the path's hidden states."""
        rows, self.tree_head_rows = self.tree_head_rows, None
        if rows is None:
            return
        for key in ("target_token_ids", "target_hidden_states"):
            value = kwargs.get(key)
            if not isinstance(value, torch.Tensor) or value.shape[0] != rows.shape[0]:
                raise RuntimeError(
                    f"ECHO tree step: {key} has {getattr(value, 'shape', None)} rows, the compaction planned "
                    f"{rows.shape[0]}"
                )
            kwargs[key] = value[rows]

    def _trees_allowed(self, sampling_metadata: Any) -> bool:
        """Whether this step's batch can be verified as trees; otherwise chains (logged once)."""
        from echo_vllm.vllm.tree_sampler import tree_ineligible_reason

        reason = tree_ineligible_reason(sampling_metadata) if sampling_metadata is not None else None
        if reason is None and self.batch_has_structured_output:
            reason = "structured output (the grammar masks logits by chain position)"
        if reason is not None:
            self.note_chain_fallback(reason)
        return reason is None

    def _trees_worth_drafting(self, batch: int) -> bool:
        """Whether to draft this step's siblings (`WidthSchedule`: after `WIDTH_PATIENCE` budget-decided tree steps
        in a row bought none, only probes and the step after each)."""
        probe_due = self.budget.probe_due(batch, self.warming_up) if self.budget is not None else None
        profile_index = self.budget.profile_done if self.budget is not None else None
        return self._width_schedule.drafts_trees(self.phase, probe_due, profile_index)

    def note_plan_mismatch(self, count: int) -> None:
        """`count` requests' scheduled drafts were not their plans' (vLLM replaced them): verified as chains."""
        self.tree_plan_mismatches += count
        if not self._mismatch_logged:
            self._mismatch_logged = True
            logger.info(
                "ECHO: a step's scheduled drafts were not the drafted trees (vLLM replaced them, e.g. near "
                "max_model_len); those requests verify as chains (exact); further cases are counted"
            )

    def note_chain_fallback(self, reason: str) -> None:
        """A step verified (or drafted) as chains because the batch has `reason`; logged once, counted."""
        self.tree_chain_fallbacks += 1
        if not self._tree_fallback_logged:
            self._tree_fallback_logged = True
            logger.info("ECHO: chains instead of trees in steps whose batch has %s (trees cannot honour it)", reason)

    def _before_drafting(self, batch: int) -> None:
        """This step's draft plan (for 'auto' also the refit points: the same step on every TP rank)."""
        ceiling = batch * self.max_depth
        self._policy = self._block_policy() if self.phase == "auto" else "auto"
        block_depth = dict(self._policy_blocks).get(self._policy)
        if block_depth is not None:  # a diagnostic block: the depth plan and its probe clock sit it out
            self._plan = DraftPlan(block_depth, batch * block_depth, False)
        elif self.budget is not None:
            # Warm-up verifies the spines (what the gates calibrate on); later phases may add every sibling.
            nodes_per_depth = self.top_k if self._tree_step else 1
            self._plan = self.budget.plan(batch, nodes_per_depth, self.warming_up, warmup_cap=ceiling)
            cost = self.budget.cost_model
            if cost is not None and not self._budget_logged:
                self._budget_logged = True
                logger.info(
                    "ECHO budget: time-aware (k_max auto); cost model %s, fit error %.3f over %d samples",
                    self.budget.source,
                    cost.fit_error,
                    cost.num_samples,
                )
        else:
            nodes = ceiling * (self.top_k if self._tree_step else 1)
            self._plan = DraftPlan(self.max_depth, min(int(self.k_max or 0), nodes), False)
        if self.tree_mode:
            self._width_schedule.after_plan(self._plan.probe and self._tree_step)
        self._probe_rows = None
        if self._plan.probe and not self._tree_step:
            self._probe_rows = self._partial_probe_rows(batch)
            if self._probe_rows is not None:  # the budget chooses for every row; the probed ones get full chains
                self._plan = self._plan._replace(probe=False)
        if self._force_plain > 1 and not self.warming_up:
            self._force_clock += 1
            if self._force_clock % self._force_plain:
                self._plan = DraftPlan(0, 0, False)
        # The history is read by the CPU chain ops only (CUDA runs the torch twins without it): aligned only there,
        # before drafting, so that the early-exit test orders nodes as the selection will.
        self._history_now = (
            self.history is not None
            and self._runner is not None
            and not self._tree_step
            and self._plan.depth > 0
            and self._depth.device.type == "cpu"
        )
        if self._history_now and self.history is not None and self._runner is not None:
            self.history.align(self._runner.input_batch.req_ids[:batch])

    def _partial_probe_rows(self, batch: int) -> torch.Tensor | None:
        """probe_requests S < B: [B] bool, the S rows whose full chains this probe verifies (the next slice of the
        batch each probe: row indices only, the same on every TP rank); None: a probe of every row."""
        size = self.echo_settings.probe_requests
        if size <= 0 or size >= batch:
            return None
        start = (self._probes_done * size) % batch
        self._probes_done += 1
        rows = (start + torch.arange(size, device=self._depth.device)) % batch
        mask = torch.zeros(batch, dtype=torch.bool, device=self._depth.device)
        mask[rows] = True
        return mask

    @property
    def _budget_cuts(self) -> bool:
        """This step's selection is the time-aware budget's cut ("auto", or a cut:d block of fixed depth)."""
        return self._policy in AUTO_POLICIES or self._policy.startswith("cut:")

    def _block_policy(self) -> str:
        """ECHO_VLLM_POLICY_BLOCKS: this step's policy ("auto" without blocks)."""
        if not self._policy_blocks:
            return "auto"
        index = (self._policy_clock // self._policy_block_steps) % len(self._policy_blocks)
        self._policy_clock += 1
        return self._policy_blocks[index][0]

    def _after_step(self, start: float, drafted: float, batch: int, depth: int) -> None:
        """Step timing: rest = since the last step's proposer ended, draft = this proposer call; a cost sample."""
        end = time.perf_counter()
        num_tokens = self._step_tokens
        draft_s = end - start
        self._phase_seconds["draft"] += drafted - start
        self._phase_seconds["select"] += end - drafted
        self._timed_steps += 1
        if self._last_end is not None and batch > 0:
            rest_s = start - self._last_end
            self._last_times = (rest_s, draft_s)
            self._phase_seconds["rest"] += rest_s
            self._rest_timed_steps += 1
            if self.budget is not None:
                sample = StepSample(
                    num_tokens, batch, depth, rest_s, draft_s, self.forward_fix_rows, self._verified_in_forward,
                    self._merged_rows, self._step_context if self._cost_context else 0, self._tree_step,
                    self._head_free,
                )  # fmt: skip
                self.budget.add_sample(sample, self.warming_up)
        self._last_end = end

    def _no_drafts(self) -> list[list[int]]:
        """Empty draft lists for every request of the batch: the scheduler then schedules plain decoding."""
        return [[] for _ in range(self._runner.input_batch.num_reqs)] if self._runner is not None else []

    def _select(self, drafts: torch.Tensor) -> list[list[int]]:
        """Gates and the batch-wide budget over the drafted chains -> each request's first K_i tokens."""
        batch, depth = drafts.shape
        self.tree_plans = {}
        if depth == 0 or batch == 0:
            self._pending = None
            self.stats.record_plan(0)
            if self.budget is not None and self._policy in AUTO_POLICIES:  # static blocks stay off the plan's clock
                self.budget.observe_selection(0)
                self._observe_plain_step(batch)  # nothing to verify: its hindsight needs no feedback
            if self._step_log and batch:  # plain steps belong to the record too (the oracle bound counts them)
                self._write_step_log([0] * batch, batch, [[] for _ in range(batch)])
            if batch:  # a budget-0 step on /metrics too (K_i = 0 for every request)
                self.prom.on_step(self, [0] * batch, 0)
            return [[] for _ in range(batch)]
        self._stage = "gates"
        self.faults.maybe_inject("gates")
        cap = self._plan.k_cap
        tree: DraftTree | None = None
        selection: BudgetSelection | None = None
        if not self._tree_step and self.phase != "profile" and compiled_chain_select(drafts.device):
            counts_t, confidence, depth_cap, truncated, predicted = self._fused_chain_selection(batch, depth)
        else:
            if self._tree_step:
                tree = self._sibling_tree(batch, depth)
            else:
                tree = self._chain_tree(drafts, torch.stack(self._echo_logps[-depth:], dim=1)[:batch])  # [B, depth]
            confidence = depth_confidence(tree)
            gates = self._gates(confidence)
            self._stage = "select"
            self.faults.maybe_inject("select")
            selection, predicted = (
                self.budget.select(
                    tree, gates, batch, self._plan, self.warming_up, depth=depth, chain=not self._tree_step
                )
                if self.budget is not None and self._budget_cuts
                else (None, None)
            )
            if selection is None:
                selection = self._capped_selection(tree, gates, cap)
            counts_t, depth_cap, truncated = selection.counts, gates.depth_cap, gates.truncated
        if self._probe_rows is not None and not self._tree_step:  # a partial probe: its rows verify every draft
            counts_t = torch.where(self._probe_rows[:batch], torch.full_like(counts_t, depth), counts_t)

        req_ids = list(self._runner.input_batch.req_ids[:batch]) if self._runner is not None else []
        listed = None
        if self._tree_step:
            assert selection is not None and tree is not None
            counts, ragged, listed = self._emit_trees(selection, tree, req_ids)
        else:
            # The one host sync of the step: the ragged drafts must reach the scheduler as Python lists.
            counts = counts_t.tolist()
            tokens = drafts.tolist()
            ragged = [row[:c] for row, c in zip(tokens, counts)]
        if self._step_log:  # the debug log's depth confidences (a host copy: only with the log on)
            self._logged_confidence = confidence.tolist()
        # [B, D] for the feedback: zero confidence past the drafted depth (one op; none when drafted to D).
        padded = (
            confidence if depth == self.max_depth else torch.nn.functional.pad(confidence, (0, self.max_depth - depth))
        )
        self._pending = PendingVerification(
            req_ids,
            padded,
            predicted is not None,
            depth,
            listed,
            feeds_plan=self._policy in AUTO_POLICIES,
            sweep=self._sweep_phase(),
            history=self._history_now,
            stopped=self._confidence_stopped,
        )
        step_sum = sum(counts)
        if self.k_max is not None and step_sum > self.k_max:  # select_budget guarantees this; never silent
            raise AssertionError(f"ECHO budget violated: sum of drafts {step_sum} > k_max {self.k_max}")
        # Chains: `counts` is counts_t on the host, so its sum is the step's; tree steps list nodes their own way.
        host_sum = None if self._tree_step else step_sum
        self.stats.record_selection(counts_t, cap, depth_cap, truncated, host_step_sum=host_sum)  # no sync
        self.stats.record_plan(depth, predicted)
        if self.budget is not None and self._policy in AUTO_POLICIES:  # static blocks stay off the plan's clock
            self.budget.observe_selection(step_sum)
        self._account(counts, batch, ragged)
        return ragged

    def _fused_chain_selection(
        self, batch: int, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A chain step's inputs, gates and budget in one op call (`echo::chain_select_logps` over the per-depth
        log-probs; the same selection as the torch path of `_select`, tested bit for bit): (counts, confidence,
        depth_cap, truncated, predicted or None)."""
        step_logps = self._echo_logps[-depth:]
        device = step_logps[0].device
        kept = self._step_kept_rows(batch)
        gate_on, tau = self._gate_tensors(device)
        self._stage = "select"
        self.faults.maybe_inject("select")
        plan, budget, tail = self._plan, self.budget, self.echo_settings.surplus_tail
        if budget is not None and budget.phase(self.warming_up) == "auto" and self._budget_cuts:
            rest, draft = budget.curves(batch, batch * depth, depth, plan.depth, device)
            k_min = plan.k_cap if plan.probe else 0  # a probe verifies all it drafted: every depth is measured
            inputs, result = chain_select_steps(
                step_logps, batch, kept, gate_on, tau, budget.acceptance.table, rest, draft,
                base_tokens=float(batch), k_cap=plan.k_cap, k_min=k_min, surplus_tail=tail,
                history=self._history_rows(),
            )  # fmt: skip
            return result.counts, inputs.confidence, result.depth_cap, result.truncated, result.predicted
        # An integer k_max, or the warm-up of "auto" (its cap): the first k_cap candidates.
        none = self._no_seconds
        inputs, result = chain_select_steps(
            step_logps, batch, kept, gate_on, tau, None, none, none,
            base_tokens=float(batch), k_cap=plan.k_cap, surplus_tail=tail,
        )  # fmt: skip
        return result.counts, inputs.confidence, result.depth_cap, result.truncated, None

    def _history_rows(self) -> torch.Tensor | None:
        """The request history's rows for this step's selection and early exit (None: no history this step)."""
        if self.history is None or not self._history_now or self._policy == "auto-flat":
            return None
        return self.history.rows

    def _gate_tensors(self, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_on [D], tau [D]) of the calibration; no calibration (warm-up): no gate anywhere."""
        if self.calibration is not None:
            return self.calibration.gate_tensors(device)
        d = self.max_depth
        return torch.zeros(d, dtype=torch.bool, device=device), torch.full((d,), float("inf"), device=device)

    def _sibling_tree(self, batch: int, depth: int) -> DraftTree:
        """The spine and its sibling leaves from the per-depth top-k kept while drafting (depth-major layout)."""
        ids = torch.stack([t for t, _ in self._echo_topk[-depth:]], dim=1)[:batch]  # [B, depth, k]
        logps = torch.stack([lp for _, lp in self._echo_topk[-depth:]], dim=1)[:batch]
        logps = torch.nan_to_num(logps, nan=float("-inf"))
        return spine_sibling_tree(ids, logps, self._kept_rows(batch))

    def _emit_trees(
        self, selection: BudgetSelection, tree: DraftTree, req_ids: list[str]
    ) -> tuple[list[int], list[list[int]], SpineFirstOrder]:
        """The selection in spine-first order: (counts, ragged drafts, the listing); each request's topology is
        kept in `tree_plans` for the next step (the scheduler sees only tokens)."""
        order = spine_first_order(selection, tree)
        width = order.tokens.shape[1]
        # The one host sync of the step: counts, nodes off the spine, tokens and parents in one copy.
        off_spine = (order.counts - order.spine_len).sum().reshape(1, 1).expand(order.counts.shape[0], 1)
        packed = torch.cat([order.counts.unsqueeze(1), off_spine, order.tokens, order.parent_local], dim=1).tolist()
        counts = [row[0] for row in packed]
        ragged = [row[2 : 2 + c] for row, c in zip(packed, counts)]
        if self._adversary is not None:  # tests only: random trees around the head's chains
            ragged, parents, node_depth = self._adversarial_trees(tree, counts)
            counts = [len(r) for r in ragged]
            blank = torch.full(node_depth.shape, float("-inf"), device=node_depth.device)
            order = order._replace(depth=node_depth, scores=blank, spine_len=torch.zeros_like(order.spine_len))
        elif not packed or packed[0][1] == 0:
            # Every request got its spine prefix only: a chain step, which vLLM's own path verifies (no plans).
            self._width_schedule.observe(False, self._plan.probe)
            return counts, ragged, order
        else:
            parents = [row[2 + width : 2 + width + c] for row, c in zip(packed, counts)]
            self._width_schedule.observe(True, self._plan.probe)
        self.tree_plans = {
            rid: TreePlan(tuple(ragged[i]), tuple(parents[i])) for i, rid in enumerate(req_ids) if counts[i]
        }
        return counts, ragged, order

    def _adversarial_trees(
        self, tree: DraftTree, counts: list[int]
    ) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
        """Each request's selected count of nodes as a random tree around its drafted chain (`tree_adversary`)."""
        from echo_vllm.vllm.tree_adversary import adversarial_tree

        assert self._adversary is not None
        chains = tree.tokens[:, :: self.top_k].tolist()
        vocab = int(self.vllm_config.model_config.get_vocab_size())
        ragged, parents = [], []
        for chain, count in zip(chains, counts):
            tokens, parent = adversarial_tree(chain, count, vocab, self._adversary)
            ragged.append(tokens)
            parents.append(parent)
        width = max([len(r) for r in ragged] + [1])
        depth = torch.zeros((len(ragged), width), dtype=torch.int64)
        for i, parent in enumerate(parents):
            for j, p in enumerate(parent):
                depth[i, j] = 1 if p < 0 else int(depth[i, p]) + 1
        return ragged, parents, depth.to(tree.tokens.device)

    def _capped_selection(self, tree: DraftTree, gates: Gates, cap: int) -> BudgetSelection:
        """ECHO's fixed rule: the first `cap` candidates (integer k_max, and the warm-up of 'auto')."""
        batch, depth = tree.scores.shape
        if self.echo_settings.surplus_tail and batch * depth <= cap:
            # The budget cannot bind: every valid draft is verified (Priority 3 would add every tail back), so
            # skip the selection work. Chains: valid is a prefix per request (-inf stays -inf along the cumsum).
            return compact_selection(tree.valid, tree.depth, tree.parent)
        selection = select_budget(tree, gates, cap)
        if self.echo_settings.surplus_tail:
            # Below the budget a truncated tail is free to verify and can only add accepted tokens; above it, the
            # tails are what is cut.
            selection = add_surplus_tails(selection, tree, gates, cap)
        return selection

    def _chain_tree(self, drafts: torch.Tensor, logps: torch.Tensor) -> DraftTree:
        """The chains as a DraftTree (the torch path; `chain_inputs` is also what the fused op reads)."""
        inputs = chain_inputs(logps, self._kept_rows_unless_all(drafts.shape[0]))
        return chain_tree(inputs.scores, inputs.valid)._replace(tokens=drafts.to(torch.int64))

    # ---------------------------------------------------------------------------------------------------------
    # Verification feedback (EchoVerificationFeedbackPatch), calibration, metrics
    # ---------------------------------------------------------------------------------------------------------

    def observe_verification(self, req_ids: list[str], sampled_token_ids: Any, spec_decode_metadata: Any) -> None:
        """Last step's verification result -> counters and (during warm-up) calibration samples; faults contained."""
        self._step_start = time.perf_counter()  # the proposer's part of the step starts here
        self._feedback_faulted = False
        self._last_accepted = []
        self._verified_in_forward = 0
        if self.faults.disabled:
            return
        try:
            self.faults.maybe_inject("feedback")
            self._context_batch = None
            self._set_step_context()  # the hindsight prices the forward that just verified, at its context
            self._context_batch = self._runner.input_batch.num_reqs if self._runner is not None else None
            self._observe(req_ids, sampled_token_ids, spec_decode_metadata)
        except Exception as err:
            self._pending = None
            self._feedback_faulted = True
            self.faults.record_fault("feedback", err)
            if self.faults.should_raise:
                raise

    def _observe(self, req_ids: list[str], sampled_token_ids: Any, spec_decode_metadata: Any) -> None:
        num_draft = [] if spec_decode_metadata is None else list(spec_decode_metadata.num_draft_tokens)
        self._verified_in_forward = sum(num_draft)  # this step's cost sample: did its forward verify drafts
        pending, self._pending = self._pending, None
        if pending is None:
            return
        confidence = pending.confidence
        device = confidence.device
        rows = self._verified_rows(pending.req_ids, req_ids, num_draft, device)
        if rows is None:
            if pending.predicted:
                # A predicted step that verified nothing (the budget chose plain decoding) realised 0 accepted
                # drafts: counted, so that predicted and realised per step average over the same steps.
                self.stats.record_realised(torch.zeros(0, dtype=torch.long))
                if pending.feeds_plan:
                    self._observe_plain_step(len(pending.req_ids))
            return
        cur, old, verified = rows
        if (
            pending.listed is None
            and self.calibration is not None
            and isinstance(sampled_token_ids, torch.Tensor)
            and sampled_token_ids.dtype in (torch.int32, torch.int64)
            and pending.confidence.dtype == torch.float32
            and device.type == "cpu"
            and sampled_token_ids.device.type == "cpu"
        ):
            self.tree_accepted = None  # as below: a tree step's acceptance is consumed by the step that made it
            return self._observe_chain(pending, sampled_token_ids, cur, old, verified)
        if isinstance(sampled_token_ids, torch.Tensor):
            emitted = (sampled_token_ids[cur] != -1).sum(dim=1)
        else:
            emitted = torch.tensor([len(sampled_token_ids[r[0]]) for r in rows], dtype=torch.long, device=device)
        accepted = (emitted - 1).clamp(min=0)
        d = self.max_depth
        depths = torch.arange(d, device=device).unsqueeze(0)
        tree_accepted, self.tree_accepted = self.tree_accepted, None
        if pending.listed is not None:  # trees: the scheduled prefix of each request's spine-first list
            listed = pending.listed.depth[old]
            columns = torch.arange(listed.shape[1], device=device).unsqueeze(0)
            node_depths = torch.where(columns < verified.unsqueeze(1), listed, torch.zeros_like(listed))
            verified_depth = node_depths.amax(dim=1) if listed.shape[1] else torch.zeros_like(verified)
        else:  # chains: K_i nodes at depths 1..K_i
            node_depths = torch.where(depths < verified.unsqueeze(1), depths + 1, torch.zeros_like(depths))
            verified_depth = verified
        self.stats.record_verification(emitted, accepted, verified, depth=verified_depth)
        if pending.predicted:
            self.stats.record_realised(accepted)
        if self._step_log:
            self._last_accepted = accepted.tolist()  # debug log only: a host sync
        mask = depths < accepted.unsqueeze(1)
        if self.budget is not None:
            plan_accepted, plan_depths = accepted, node_depths
            if pending.listed is not None and tree_accepted is not None:
                spine_ok = self._record_tree_acceptance(
                    pending.listed, confidence[old], old, cur, verified, tree_accepted
                )
                # The depth plan values depth, not width (the budget buys width step by step where it pays): a
                # tree step counts in hindsight as its spines would have as chains - the spine nodes verified and
                # accepted. Valued with every verified sibling, a probe of B x D x top_k nodes priced each depth
                # at full width and put the plan to plain decoding at batch 4 (163 of 290 steps).
                plan_accepted, plan_depths = spine_hindsight(node_depths, pending.listed.spine_len[old], spine_ok)
            else:
                self.budget.acceptance.record(confidence[old], mask, depths < verified_depth.unsqueeze(1))
            if pending.predicted and pending.feeds_plan:
                # Hindsight only from steps the time-aware budget cut: warm-up and profile steps verify what their
                # sweep says, which caps deeper levels by the sweep's cut, not by acceptance (the plan started
                # plain at batch 1 after a profile whose fractions verified little).
                self.budget.observe_verification(
                    plan_accepted, plan_depths, len(pending.req_ids), pending.drafted_depth, stopped=pending.stopped
                )
            elif pending.sweep:  # continuation rates from every sweep step; the warm-up's levels seed the plan
                self.budget.observe_sweep(
                    plan_accepted,
                    plan_depths,
                    len(pending.req_ids),
                    pending.drafted_depth,
                    full=pending.sweep == "warmup",
                )
        if self.calibration is None and self.echo_settings.warmup_steps > 0:
            self.recorder.record(confidence[old], mask, verified_depth)
            self.warmup_recorded += 1
            if self.warmup_recorded >= self.echo_settings.warmup_steps:
                self._finish_warmup()

    def _observe_chain(
        self,
        pending: PendingVerification,
        sampled: torch.Tensor,
        cur: torch.Tensor,
        old: torch.Tensor,
        verified: torch.Tensor,
    ) -> None:
        """A calibrated chain step's feedback on CPU in one op (`echo::chain_feedback`): the same accepted drafts,
        statistics, acceptance counts and depth-plan hindsight as the op-by-op path of `_observe`."""
        budget = self.budget
        drafted = min(pending.drafted_depth, self.max_depth)
        acceptance = budget.acceptance if budget is not None else None
        table = (acceptance.seen, acceptance.accepted) if acceptance is not None else self._no_acceptance_table()
        # The request history learns from the steps whose selection used it (its rows are this step's order).
        history_rows, gain_table, alpha = None, None, 0.0
        if pending.history and self.history is not None and acceptance is not None:
            history_rows, gain_table, alpha = self.history.rows, acceptance.table, self.history.alpha
        feedback = chain_feedback(
            sampled, cur, old, verified, pending.confidence, *table,
            drafted=drafted, record_acceptance=acceptance is not None,
            history=history_rows, gain_table=gain_table, alpha=alpha,
        )  # fmt: skip
        self.stats.record_verification_sums(feedback.sums.tolist(), realised=pending.predicted)
        if self._step_log:
            self._last_accepted = feedback.accepted.tolist()
        if budget is None:
            return
        levels = feedback.levels.tolist()
        if pending.predicted and pending.feeds_plan:
            budget.observe_verification_levels(
                levels, len(pending.req_ids), pending.drafted_depth, stopped=pending.stopped
            )
        elif pending.sweep:
            budget.observe_sweep_levels(
                levels, len(pending.req_ids), pending.drafted_depth, full=pending.sweep == "warmup",
                requests=int(cur.numel()),
            )  # fmt: skip

    def _no_acceptance_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch counts for `chain_feedback` without a time-aware budget (an integer k_max: no acceptance model)."""
        if self._scratch_table is None:
            shape = (self.max_depth, 1)
            self._scratch_table = (torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))
        return self._scratch_table

    def _sweep_phase(self) -> str:
        """This step's sweep ("warmup" or "profile": the time-aware budget's, not the plan's selection), else ""."""
        if self.budget is None:
            return ""
        phase = self.phase
        return phase if phase in ("warmup", "profile") else ""

    def _observe_plain_step(self, batch: int) -> None:
        """A step that verifies nothing, into the depth plan's hindsight (`TimeAwareBudget.observe_plain`); only in
        the auto phase, as for verified steps (warm-up and profile steps follow their own sweeps)."""
        if batch > 0 and self.budget is not None and self.budget.phase(self.warming_up) == "auto":
            self.budget.observe_plain(batch)

    @staticmethod
    def _verified_rows(
        drafted_ids: list[str], req_ids: list[str], num_draft: list[int], device: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows of this step's batch that verified drafts, their rows in the drafting step's batch, drafts verified
        per row), or None when no drafted request verified anything. The batch order usually did not change
        between the two steps (a list comparison, in C); only when it did, the ids are matched one by one."""
        if not num_draft:
            return None
        shared = min(len(drafted_ids), len(req_ids))
        if req_ids[:shared] == drafted_ids[:shared] and 0 not in num_draft[:shared]:
            # Same order and every shared row verified drafts (most steps): rows 0..n-1, two ops instead of five.
            if shared == 0:
                return None
            cur = torch.arange(shared, device=device)
            return cur, cur, torch.tensor(num_draft[:shared], dtype=torch.long, device=device)
        counts = torch.tensor(num_draft, dtype=torch.long, device=device)
        if req_ids[:shared] == drafted_ids[:shared]:
            # Same order (requests may have joined at the end or left from it): row i is row i.
            cur = torch.nonzero(counts[:shared] > 0).reshape(-1)
            old = cur
        else:
            index_of = {rid: i for i, rid in enumerate(drafted_ids)}
            pairs = [(i, index_of[rid]) for i, rid in enumerate(req_ids) if num_draft[i] > 0 and rid in index_of]
            if not pairs:
                return None
            cur = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
            old = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        if cur.numel() == 0:
            return None
        return cur, old, counts[cur]

    def _record_tree_acceptance(
        self,
        listed: SpineFirstOrder,
        confidence: torch.Tensor,
        old: torch.Tensor,
        cur: torch.Tensor,
        verified: torch.Tensor,
        tree_accepted: Any,
    ) -> torch.Tensor:
        """A verified tree step, node by node: the spine node of depth d was accepted iff the accepted path's
        depth-d node sits at its place (position d - 1, spine first); every verified node off the spine goes to the
        width model with its own path confidence and whether the path went through it. Returns spine_ok [R, D]:
        whether each request's spine node of depth d + 1 was on the accepted path."""
        assert self.budget is not None
        accepted_local = tree_accepted[cur].to(listed.depth.device)  # [R, Dmax] draft position per depth, -1 past it
        width = listed.depth.shape[1]
        positions = torch.arange(width, device=listed.depth.device)
        on_path = (accepted_local.unsqueeze(2) == positions.view(1, 1, -1)).any(dim=1)  # [R, N]
        in_list = positions.unsqueeze(0) < verified.unsqueeze(1)
        spine_len = listed.spine_len[old]
        d = self.max_depth
        depths = torch.arange(d, device=listed.depth.device).unsqueeze(0)
        spine_cols = depths.clamp(max=max(width - 1, 0)).expand(on_path.shape[0], d)
        spine_ok = torch.gather(on_path, 1, spine_cols) & (depths < spine_len.unsqueeze(1))
        spine_verified = depths < torch.minimum(spine_len, verified).unsqueeze(1)
        # confidence [R, D]: the depth confidences, i.e. the spine nodes' own (the spine is each depth's best path).
        self.budget.acceptance.record(confidence, spine_ok, spine_verified)
        off_spine = in_list & (positions.unsqueeze(0) >= spine_len.unsqueeze(1))
        self.budget.width_acceptance.record_nodes(
            listed.depth[old][off_spine], torch.exp(listed.scores[old][off_spine]), on_path[off_spine]
        )
        return spine_ok

    def _finish_warmup(self) -> None:
        s = self.echo_settings
        self.calibration = calibrate(
            self.recorder, s.gate_mode, s.delta, s.min_samples_per_class, s.max_gates, s.min_gain
        )
        self.calibration_source = f"calibrated after {self.warmup_recorded} steps"
        if s.calibration_file and self.is_writer:
            path = Path(s.calibration_file).expanduser()
            if not path.exists():
                try:
                    self.calibration.save(path)
                    self.calibration_source += f", saved to {path}"
                except OSError as err:  # e.g. a read-only volume: the gates still apply in this process
                    self.calibration_source += f", NOT saved to {path} ({err.strerror or err})"
                    logger.warning(
                        "ECHO calibration: cannot write %s (%s); set calibration_file to a writable "
                        "path to skip warm-up on the next start",
                        path,
                        err,
                    )
        logger.info("ECHO calibration: %s; %s", self.calibration_source, self.calibration.describe())

    def _account(self, counts: list[int], batch: int, ragged: list[list[int]]) -> None:
        """The debug step log and the periodic stats line (host work on the host lists of this step)."""
        if self._step_log:
            self._write_step_log(counts, batch, ragged)
        self.prom.on_step(self, counts, self._plan.k_cap)
        now = time.monotonic()
        if now - self._last_log >= self._log_interval:
            self._last_log = now
            logger.info("%s", format_stats_line(self.echo_stats()))

    def _write_step_log(self, counts: list[int], batch: int, ragged: list[list[int]]) -> None:
        """One JSON line per step (ECHO_VLLM_STEP_LOG): budget evidence for tests, the oracle bound's input. Raw
        values only here; `StepLogWriter` encodes them at its next flush (`echo_vllm.vllm.step_log`)."""
        assert self._step_log is not None
        fields: dict[str, Any] = {
            "step": self.stats.steps,
            "rank": self.tp_rank,
            "k_max": self.k_max if self.k_max is not None else "auto",
            "phase": self.phase,
            "k_cap": self._plan.k_cap,
            "sum": sum(counts),
            "batch": batch,
            "counts": counts,
            "calibrated": self.calibration is not None,
            "draft_depth": self._plan.depth,  # planned
            "probe": self._plan.probe,  # a probe step: every draft verified
            "drafted_depth": len(self._echo_ids),  # drafted (the early exit may stop sooner)
            "num_tokens": self._step_tokens,  # tokens in this step's target forward
            "context_tokens": self._step_context,  # tokens already cached for this step's requests
            "verified_in_forward": self._verified_in_forward,  # drafts verified in this step's forward
            "accepted": self._last_accepted,  # accepted drafts per verified request, of this step's forward
            "tree_step": self._tree_step,  # this step drafted trees
            "moved": self._last_leaf_accepts,  # accepted nodes off the spine in this step's forward (KV moved)
            "rest_s": self._last_times[0],  # this step's time outside the proposer
            "draft_s": self._last_times[1],  # the previous step's proposer time (this one is still running)
            "policy": self._policy,  # "auto", or ECHO_VLLM_POLICY_BLOCKS' static:d of this step
            "probe_rows": 0 if self._probe_rows is None else int(self._probe_rows.sum()),  # a partial probe's rows
            "tree_rows": self.forward_fix_rows,  # verified nodes off the spine in this step's forward (cost sample)
            "merged_rows": self._merged_rows,  # deferred head rows this step's first pass carried (cost sample)
            "head_cut": self._head_cut,  # prompt rows its first pass left out (prompt_head_window)
            "head_kv": self._head_cut - self._head_free,  # ... of them, rows whose K/V were written (still cost)
            # c_{i,d} per request row and drafted depth (path confidences; [] on a step that drafted nothing):
            # what draft_stop_confidence reads, for scripts/confidence_stop_replay.py
            "confidence": self._logged_confidence or [],
        }
        self._logged_confidence = None
        rounded: dict[str, Sequence[float | None]] = {}
        model_ms = None
        if self.budget is not None:  # the depth plan's view: each depth's value, and what the last verified step added
            controller = self.budget.controller
            rounded = {
                "depth_values": controller.value,
                "level_rates": controller.last_levels,
                # P(accept depth j | reached j - 1), j = 1..D: what this step's plan imputes undrafted depths from
                "continuation_rates": self.budget.continuation_rates(batch),
            }
            cost = self.budget.cost_model
            if cost is not None and batch > 0:  # the current fit's step at this batch, every draft of depth d verified
                model_ms = functools.partial(
                    _model_step_ms, cost, batch, self.max_depth, self.budget.plain_head_seconds(batch),
                    self._step_context,
                )  # fmt: skip
        if self._step_log_writer is None:
            self._step_log_writer = StepLogWriter(self._step_log)  # lives as long as the proposer
        self._step_log_writer.append(StepRecord(fields, tuple(map(tuple, ragged)), rounded, model_ms))

    def flush_step_log(self) -> int:
        """Write the buffered step-log records now (the offline runner's rpc); returns how many."""
        return self._step_log_writer.flush() if self._step_log_writer is not None else 0

    def echo_stats(self) -> dict[str, Any]:
        """The statistics as a dict (one host sync): EchoMetrics' figures, calibration and faults."""
        ms = {
            k: 1000.0 * v / max(1, self._rest_timed_steps if k == "rest" else self._timed_steps)
            for k, v in self._phase_seconds.items()
        }
        return {
            **self.stats.summary(),
            "k_max": self.k_max if self.k_max is not None else "auto",
            "budget_mode": "fixed",
            "phase": self.phase,
            "cost_fit_error": None,
            "cost_model": None,
            "budget_source": "none",
            "budget_profile_file": None,
            **(self.budget.summary(self.warming_up) if self.budget is not None else {}),
            "ms_per_step": ms,
            "trees": self.tree_mode,
            "tree_moved": self.tree_leaf_accepts,  # accepted nodes off the spine (their KV moved)
            "tree_chain_fallbacks": self.tree_chain_fallbacks,
            "confidence_stops": self.confidence_stops,  # steps whose draft loop draft_stop_confidence ended early
            "tree_plan_mismatches": self.tree_plan_mismatches,
            "deferred_head": self.deferred_head.summary() if self.deferred_head is not None else None,
            "prompt_rows_cut": self.prompt_rows_cut,  # prompt rows the head's first pass left out (prompt_head_window)
            "prompt_rows_kv": self.prompt_rows_kv,  # ... of them, rows whose head K/V were written (prompt_head_kv)
            "request_history": self.history.summary() if self.history is not None else None,
            "calibration": self.calibration_source,
            "sweet_spots": self.calibration.sweet_spots if self.calibration is not None else [],
            **self.faults.summary(),
        }

    def reset_echo_stats(self) -> None:
        """Start the statistics afresh (benchmarks: after their untimed warm-up); decisions keep their state."""
        self.stats.reset()
        self._phase_seconds = dict.fromkeys(self._phase_seconds, 0.0)
        self._timed_steps = self._rest_timed_steps = 0
        if self.deferred_head is not None:
            self.deferred_head.reset_counters()
        self.prompt_rows_cut = self.prompt_rows_kv = 0
        self.confidence_stops = 0

    def format_stats(self) -> str:
        return format_stats_line(self.echo_stats())
