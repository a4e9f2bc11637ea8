"""The HuggingFace low-load engine (the paper's B = 1 setup), every method on the same core code.

Methods, all verified by the same tree verifier over the same target forward:
  ar      plain autoregressive decoding (the reference output);
  chain   a fixed chain of K = max_depth draft tokens (top_k = 1);
  eagle2  EAGLE-2 as its official code drafts (`topK_genrate`, SafeAILab/EAGLE eagle/model/cnets.py): a pure
          top-k frontier, every expanded child (k * k per depth) in the pool, the pool reranked to a fixed total of
          K_max tokens by path score (no gates; `core.eagle2`);
  ddd     Dynamic Depth Decoding (arXiv 2409.00142): eagle2's pool, deepened to `ddd.max_depth` unless the log of
          the frontier's summed path probabilities falls below `ddd.threshold` at one of `ddd.check_depths`;
  siblings the spine and its sibling leaves (only the spine is expanded: a chain's head forwards), reranked
          like eagle2 (issue #13, Stage 0: what width costs without tree drafting);
  dense   ECHO's budget with a gate at every calibrated depth (ablation);
  fixed   ECHO's budget with one tau at every depth (ablation);
  echo    sparse gates at the calibrated sweet spots + the elastic budget.
The gated methods record (confidence, accepted) during `warmup_steps` verification steps without gates, then
calibrate once (or load `calibration_file`) and gate from then on. With `k_max: "auto"` they choose each step's
budget and draft depth with the vLLM plugin's time-aware budget (`echo_vllm.core.time_budget`): the same profile,
cost model, acceptance model and chooser, timed here (B = 1).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from echo_vllm.config import EchoSettings
from echo_vllm.core import (
    BudgetSelection,
    Calibration,
    CalibrationRecorder,
    DraftTree,
    EchoMetrics,
    Gates,
    calibrate,
    depth_confidence,
    grow_spine_siblings,
    grow_tree,
    verifier_inputs,
    verify_greedy,
    verify_sampling,
)
from echo_vllm.core.auto_budget import DraftPlan
from echo_vllm.core.budget_profile import default_profile_path
from echo_vllm.core.cost_model import StepSample
from echo_vllm.core.eagle2 import DDDSettings, grow_eagle2
from echo_vllm.core.time_budget import TimeAwareBudget
from echo_vllm.errors import InputError
from echo_vllm.hf.draft_model import DRAFTER_KINDS, DraftModelTreeDrafter, load_draft_model
from echo_vllm.hf.drafter import Eagle3TreeDrafter
from echo_vllm.hf.target import HFTarget
from echo_vllm.models.eagle3 import Eagle3Head, read_head_config
from echo_vllm.ops import select_budget, select_eagle2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MethodSpec:
    """What distinguishes one method; the engine reads these fields instead of comparing method names."""

    name: str
    drafts: bool  # uses the drafter (all but ar)
    gate_mode: str | None = None  # calibrated gates of this mode (warm-up, then gates), else never any gate
    chain: bool = False  # top_k 1 and K = max_depth: a fixed chain
    rerank: bool = False  # EAGLE-2: every node competes on path score (select_eagle2), no spine priority
    siblings: bool = False  # the tree is the spine plus sibling leaves (grow_spine_siblings), not a full tree
    pool: bool = False  # EAGLE-2's full pool (core.eagle2.grow_eagle2): all k * k children per depth, top-k frontier
    ddd: bool = False  # DDD's early stop on the pool (EngineOptions.ddd); its depth limit is ddd.max_depth


METHOD_SPECS = {
    spec.name: spec
    for spec in (
        MethodSpec("ar", drafts=False),
        MethodSpec("chain", drafts=True, chain=True),
        MethodSpec("eagle2", drafts=True, rerank=True, pool=True),
        MethodSpec("ddd", drafts=True, rerank=True, pool=True, ddd=True),
        MethodSpec("siblings", drafts=True, rerank=True, siblings=True),
        MethodSpec("dense", drafts=True, gate_mode="dense"),
        MethodSpec("fixed", drafts=True, gate_mode="fixed"),
        MethodSpec("echo", drafts=True, gate_mode="sparse"),
    )
}
METHODS = tuple(METHOD_SPECS)
GATED = {name: spec.gate_mode for name, spec in METHOD_SPECS.items() if spec.gate_mode}


class EngineInputError(InputError):
    """Bad engine options or generation arguments (a method name, a depth, an empty prompt)."""


@dataclass
class GenerationResult:
    token_ids: list[int]
    seconds: float
    steps: int


class PhaseClock:
    """Wall seconds per phase of the decoding steps (B = 1 on the host: perf_counter needs no device sync)."""

    PHASES = ("draft", "select", "verify_forward", "accept", "update_context", "bookkeeping")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now

    def ms_per_step(self) -> dict[str, float]:
        return {k: 1e3 * v / self.steps for k, v in self.seconds.items()} if self.steps else {}


@dataclass
class EngineOptions:
    """`max_depth`: the draft depth of every drafting method but ddd, whose limit is `ddd.max_depth`.
    `drafter`: the drafter family, "eagle3" (an EAGLE-3 head over the target's aux hidden states) or
    "draft-model" (a small HF causal LM with the target's tokenizer, `echo_vllm.hf.draft_model`)."""

    method: str = "echo"
    drafter: str = "eagle3"
    max_depth: int = 6
    echo: EchoSettings = field(default_factory=EchoSettings)
    ddd: DDDSettings = field(default_factory=DDDSettings)

    def validate(self) -> None:
        if self.method not in METHODS:
            raise EngineInputError(f"method: unknown {self.method!r}; choose from {', '.join(METHODS)}")
        if self.drafter not in DRAFTER_KINDS:
            raise EngineInputError(f"drafter: unknown {self.drafter!r}; choose from {', '.join(DRAFTER_KINDS)}")
        if not isinstance(self.max_depth, int) or self.max_depth < 1:
            raise EngineInputError(f"max_depth must be an integer >= 1; got {self.max_depth!r}")
        if METHOD_SPECS[self.method].ddd:
            if not isinstance(self.ddd, DDDSettings):
                raise EngineInputError(f"ddd must be a DDDSettings (echo_vllm.core.eagle2); got {self.ddd!r}")
            problems = self.ddd.problems()
            if problems:
                raise EngineInputError(problems[0])


class HFEngine:
    """One method on the HF target. Decoding runs under torch.inference_mode (no autograd bookkeeping at all,
    a few percent on this CPU for every method alike)."""

    def __init__(
        self,
        target_dir: str | Path,
        head_dir: str | Path | None,
        options: EngineOptions,
        dtype: torch.dtype = torch.float32,
        share_models_with: HFEngine | None = None,
    ):
        """`head_dir`: the drafter's directory, of the kind `options.drafter` names (an EAGLE-3 head, or a draft
        LM); unused by ar. `share_models_with`: reuse that engine's target and drafter weights (the benchmark runs
        several methods prompt by prompt; one copy of the weights keeps them warm in the CPU caches for all).
        Engines that share must not generate concurrently: the target's KV cache is shared too, and every prompt
        starts by resetting it; each engine keeps its own drafting state over shared drafter weights."""
        options.validate()
        self.options = options
        self.method = options.method
        self.spec = spec = METHOD_SPECS[options.method]
        kind = options.drafter
        # The aux layers the drafter reads; None = the drafter needs none (ar, a draft LM).
        aux_ids: tuple[int, ...] | None = None
        if spec.drafts:
            if head_dir is None:
                raise EngineInputError(f"method {self.method!r} needs a drafter directory ({kind})")
            if kind == "eagle3":
                aux_ids = read_head_config(head_dir).aux_layer_ids
        shared = share_models_with
        if shared is not None and (aux_ids is None or shared.target.aux_layer_ids == aux_ids):
            # Without a head the aux states go unused: the shared target's capture hooks cost a few microseconds.
            self.target = shared.target
        else:
            self.target = HFTarget(target_dir, aux_ids or (), dtype=dtype)
        self.drafter_kind = kind if spec.drafts else None
        self.drafter_dir = Path(head_dir) if spec.drafts and head_dir is not None else None
        if spec.drafts:
            self.drafter = self._make_drafter(target_dir, shared, dtype)
        settings = options.echo
        self.top_k = 1 if spec.chain else settings.top_k
        self.max_depth = options.ddd.max_depth if spec.ddd else options.max_depth
        self.budget: TimeAwareBudget | None = None
        if spec.chain or not spec.drafts:
            self.k_max = self.max_depth if spec.chain else 0
        elif settings.k_max != "auto":
            self.k_max = int(settings.k_max)
        elif spec.gate_mode is None:
            raise EngineInputError(
                f"method {self.method!r}: k_max 'auto' is ECHO's time-aware budget; give {self.method} its fixed "
                "total of draft tokens per step as an integer k_max"
            )
        else:
            self.k_max = self.max_depth  # the warm-up budget (the spine to depth D: every depth is calibrated)
            path = settings.budget_profile_file or default_profile_path(settings.calibration_file)
            self.budget = TimeAwareBudget(
                self.max_depth,
                profile_steps=settings.profile_steps,
                probe_interval=settings.probe_interval,
                plain_hindsight=settings.plain_hindsight,
                probe_load_scale=settings.probe_load_scale,
                probe_next=settings.probe_depth == "next",
                switch_margin=settings.depth_switch_margin,
                catch_up=settings.plan_catch_up,
                stale_slot_steps=settings.stale_slot_steps,
                continuation_memory=settings.continuation_memory,
                plain_head_rows=settings.plain_head_rows,
                surplus_tail=False,  # drafting stops at a closed gate here: there are no tails to add
                profile_path=Path(path).expanduser() if path else None,
            )
        self._plan = DraftPlan(self.max_depth, self.k_max, False)
        self._step_context = 0  # tokens cached in the target before this step (the cost model's context term)
        self.eos_id = self.target.model.config.eos_token_id
        self.metrics = EchoMetrics(self.max_depth)
        self.drafted_depth_sum = 0  # the depth each verified step's tree was drafted to (u over drafted depth)
        self.drafted_steps = 0
        self.phases = PhaseClock()
        self.calibration: Calibration | None = None
        self.recorder: CalibrationRecorder | None = None
        if spec.gate_mode is not None:
            self.recorder = CalibrationRecorder(self.max_depth)
            path = settings.calibration_file
            if path and Path(path).is_file():
                self.calibration = Calibration.load(
                    path, expected_max_depth=self.max_depth, expected_mode=spec.gate_mode
                )
                logger.info("ECHO calibration (%s): loaded %s; %s", self.method, path, self.calibration.describe())

    def reset_counters(self) -> None:
        """Forget the metrics and phase times so far (a benchmark's untimed warm-up); calibration, the budget's
        cost model and the weights stay."""
        self.metrics = EchoMetrics(self.max_depth)
        self.drafted_depth_sum = 0
        self.drafted_steps = 0
        self.phases = PhaseClock()

    def _make_drafter(
        self, target_dir, shared: HFEngine | None, dtype: torch.dtype
    ) -> Eagle3TreeDrafter | DraftModelTreeDrafter:
        """This engine's drafter, over the shared engine's weights when they are the same drafter's."""
        assert self.drafter_dir is not None
        same = (
            shared is not None
            and shared.drafter_kind == self.drafter_kind
            and shared.drafter_dir == self.drafter_dir
            and shared.target is self.target
        )
        prev = shared.drafter if same and shared is not None else None
        if self.drafter_kind == "draft-model":
            if isinstance(prev, DraftModelTreeDrafter):
                model = prev.model
            else:
                model = load_draft_model(self.drafter_dir, target_dir, self.target.vocab_size, dtype=dtype)
            return DraftModelTreeDrafter(model)
        if isinstance(prev, Eagle3TreeDrafter):
            head = prev.head
        else:
            head = Eagle3Head.load(self.drafter_dir, self.target.embedding.detach().to(torch.float32)).to(dtype)
        return Eagle3TreeDrafter(head)

    # ---- one verification step -----------------------------------------------------------------------------

    @property
    def warming_up(self) -> bool:
        return self.recorder is not None and self.calibration is None and self.options.echo.warmup_steps > 0

    def _budget(self, tree: DraftTree) -> tuple[BudgetSelection, Gates, torch.Tensor | None]:
        """(selection, gates, predicted accepted drafts or None)."""
        batch = tree.tokens.shape[0]
        if self.spec.rerank:
            return select_eagle2(tree, self.k_max), Gates.open(batch, self.max_depth), None
        # Gated methods before calibration, and chain, run with every gate open (calibration is None).
        gates = Gates.evaluate(depth_confidence(tree), self.calibration, self.options.echo.surplus_width)
        if self.budget is not None:
            selection, predicted = self.budget.select(
                tree, gates, batch, self._plan, self.warming_up, depth=self.max_depth, chain=self.top_k == 1
            )
            if selection is not None:
                return selection, gates, predicted
            return select_budget(tree, gates, self._plan.k_cap), gates, None
        return select_budget(tree, gates, self.k_max), gates, None

    def _maybe_calibrate(self) -> None:
        settings = self.options.echo
        if self.recorder is None or self.calibration is not None:
            return
        if self.recorder.num_steps < settings.warmup_steps:
            return
        self.calibration = calibrate(
            self.recorder,
            self.spec.gate_mode,
            settings.delta,
            settings.min_samples_per_class,
            max_gates=settings.max_gates,
            min_gain=settings.min_gain,
        )
        if settings.calibration_file:
            self.calibration.save(settings.calibration_file)
        logger.info(
            "ECHO calibration (%s): calibrated after %d steps; %s",
            self.method,
            self.recorder.num_steps,
            self.calibration.describe(),
        )

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> GenerationResult:
        if not prompt_ids:
            raise EngineInputError("prompt: empty prompt; give at least one token")
        if max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
        generator = torch.Generator().manual_seed(seed)
        started = time.perf_counter()
        out = [self.prefill(prompt_ids, temperature, generator)]
        steps = 0
        while len(out) < max_new_tokens and out[-1] != self.eos_id:
            steps += 1
            out.extend(self.step(out[-1], temperature, generator))
        out = out[:max_new_tokens]
        if self.eos_id in out:
            out = out[: out.index(self.eos_id) + 1]
        return GenerationResult(token_ids=out, seconds=time.perf_counter() - started, steps=steps)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], temperature: float, generator: torch.Generator) -> int:
        """Run the prompt through the target (and the head's context); return the first sampled token."""
        self.target.reset()
        prompt = torch.tensor([prompt_ids], dtype=torch.long)
        positions = torch.arange(prompt.shape[1]).unsqueeze(0)
        logits, aux = self.target.forward(prompt, positions, None)
        pending = self._pick(logits[:, -1], temperature, generator)
        if self.spec.drafts:
            self.drafter.reset(prompt)
            # Head context: base t consumes (target hidden at t, token t + 1).
            next_tokens = torch.cat([prompt[:, 1:], torch.tensor([[pending]])], dim=1)
            self.drafter.extend_context(aux, next_tokens, positions)
        return pending

    @torch.inference_mode()
    def step(self, pending: int, temperature: float, generator: torch.Generator) -> list[int]:
        """One decoding step after `pending` (the last emitted token): the tokens it emits (>= 1)."""
        if not self.spec.drafts or self.k_max == 0:
            return self._ar_step(pending, temperature, generator)
        if self.budget is not None:
            self._step_context = int(self.target.cache_len)  # the cost model's context term: tokens cached
            self.budget.set_step_context(self._step_context)
            self._plan = self.budget.plan(1, self.top_k, self.warming_up, warmup_cap=self.k_max)
            if self._plan.depth == 0:  # the budget chose plain decoding: the head's context still follows
                started = time.perf_counter()
                emitted = self._ar_step(pending, temperature, generator)
                self.budget.observe_selection(0)
                self.budget.observe_plain(1)  # the plan's hindsight still moves (no-op before the cost model)
                self.metrics.record_plan(0)
                self._add_sample(1, 0, started, self._ar_split)
                return emitted
        return self._spec_step(pending, temperature, generator)

    def _add_sample(self, num_tokens: int, depth: int, started: float, split: tuple[float, float]) -> None:
        """A timed step for the cost model: split = (seconds in the target's part, seconds in the drafter's)."""
        assert self.budget is not None
        rest_s, draft_s = split
        # Every row past the one request's own is a verified draft (no prompt rows: prefill is not sampled).
        sample = StepSample(num_tokens, 1, depth, rest_s, draft_s, verified=num_tokens - 1, context=self._step_context)
        self.budget.add_sample(sample, self.warming_up)

    def _pick(self, logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
        if temperature <= 0:
            return int(logits[0].argmax())
        probs = torch.softmax(logits[0] / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def _ar_step(self, pending: int, temperature: float, generator: torch.Generator) -> list[int]:
        clock = time.perf_counter()
        pos = self.target.cache_len
        logits, aux = self.target.forward(torch.tensor([[pending]]), torch.tensor([[pos]]), None)
        token = self._pick(logits[:, -1], temperature, generator)
        verified = time.perf_counter()
        target_s = verified - clock
        clock = self.phases.add("verify_forward", clock)
        if self.spec.drafts:  # no drafts this step: keep the head's context in step for when speculation resumes
            self.drafter.extend_context(aux, torch.tensor([[token]]), torch.tensor([[pos]]))
            self.phases.add("update_context", clock)
        self._ar_split = (target_s, time.perf_counter() - verified)
        self.phases.steps += 1
        return [token]

    def _stop_drafting(self, depth: int, scores: torch.Tensor) -> bool:
        """B = 1 early exit: nothing deeper than `depth` can be selected (budget reached, or the gate closed)."""
        if depth >= (self._plan.depth if self.budget is not None else self.k_max):
            return True
        if self.calibration is None:
            return False
        gated, tau = self.calibration.gate_tensors("cpu")
        return bool(gated[depth - 1]) and bool(scores[0].max().exp() < tau[depth - 1])

    def _stop_pool(self, depth: int, frontier_scores: torch.Tensor) -> bool:
        """eagle2/ddd: stop deepening the pool after `depth`. At depth >= K_max nothing deeper can be selected (an
        ancestor-closed selection of K_max nodes reaches depth K_max at most): exact, the selection is unchanged.
        ddd: its rule (core.eagle2.DDDSettings.should_stop)."""
        if depth >= self.k_max:
            return True
        return self.spec.ddd and self.options.ddd.should_stop(depth, frontier_scores)

    def depth_summary(self) -> dict[str, float]:
        """u (MAT / mean depth) two ways, labelled: over the deepest *selected* depth of each step (EchoMetrics'
        `utilization`) and over the depth the step's tree was *drafted* to (stopped early or not)."""
        summary = self.metrics.summary()
        mat, selected = summary.get("mat", math.nan), summary.get("mean_depth", math.nan)
        drafted = self.drafted_depth_sum / self.drafted_steps if self.drafted_steps else math.nan

        def ratio(depth: float) -> float:
            return mat / depth if depth and not math.isnan(depth) else math.nan

        return {
            "mean_selected_depth": selected,
            "mean_drafted_depth": drafted,
            "u_selected_depth": ratio(selected),
            "u_drafted_depth": ratio(drafted),
        }

    def _drafted_depth(self, tree: DraftTree) -> int:
        """The deepest depth that has a valid node (drafting may have stopped early)."""
        valid_depths = torch.where(tree.valid[0], tree.depth[0], torch.zeros_like(tree.depth[0]))
        return int(valid_depths.max()) if valid_depths.numel() else 0

    def _observe_auto(
        self,
        tree: DraftTree,
        sel: BudgetSelection,
        result,
        verified_depth: torch.Tensor,
        predicted: torch.Tensor | None,
    ) -> None:
        """The verification outcome for the time-aware budget: acceptance samples and the plan's record."""
        assert self.budget is not None
        d = self.max_depth
        accepted = torch.zeros((1, d), dtype=torch.bool)
        mask = result.accepted_depth_mask.to(torch.bool)
        accepted[:, : mask.shape[1]] = mask
        recorded = torch.arange(1, d + 1).unsqueeze(0) <= verified_depth.unsqueeze(1)
        self.budget.acceptance.record(depth_confidence(tree), accepted, recorded)
        phase = self.budget.phase(self.warming_up)
        if phase == "auto":
            self.budget.observe_verification(result.accepted_len, sel.order_depth, 1, self._drafted_depth(tree))
        else:  # warm-up / profile: continuation rates, and the warm-up's levels as the plan's first values
            self.budget.observe_sweep(
                result.accepted_len, sel.order_depth, 1, self._drafted_depth(tree), full=phase == "warmup"
            )
        self.budget.observe_selection(int(sel.counts[0]))
        self.metrics.record_plan(self._plan.depth, predicted)
        if predicted is not None:
            self.metrics.record_realised(result.accepted_len)

    def _spec_step(self, pending: int, temperature: float, generator: torch.Generator) -> list[int]:
        clock = started = time.perf_counter()
        if self.spec.pool:
            tree = grow_eagle2(self.drafter, 1, self.max_depth, self.top_k, stop_after=self._stop_pool).tree
        elif self.spec.siblings:
            tree = grow_spine_siblings(self.drafter, 1, self.max_depth, self.top_k)
        else:
            tree = grow_tree(self.drafter, 1, self.max_depth, self.top_k, stop_after=self._stop_drafting)
        clock = self.phases.add("draft", clock)
        sel, gates, predicted = self._budget(tree)
        clock = selected = self.phases.add("select", clock)
        count = int(sel.counts[0])
        base = self.target.cache_len
        inputs = verifier_inputs(tree, sel, torch.tensor([pending]))
        rows = count + 1  # B = 1: only the real rows go through the target
        tokens = inputs.tokens[:, :rows]
        positions = base + inputs.positions[0, :rows].long()
        mask = inputs.mask[0, :rows, :rows]
        logits, aux = self.target.forward(tokens, positions.unsqueeze(0), mask.unsqueeze(0))
        clock = self.phases.add("verify_forward", clock)
        # Rows past count + 1 are padding the verifiers never read; only the real rows are reduced.
        width = sel.order.shape[1] + 1
        if temperature <= 0:
            argmax = torch.zeros(1, width, dtype=torch.long)
            argmax[0, : count + 1] = logits[0].argmax(-1)
            result = verify_greedy(tree.tokens, sel, argmax, max_depth=self.max_depth)
        else:
            probs = torch.zeros(1, width, logits.shape[-1])
            probs[0, : count + 1] = torch.softmax(logits[0] / temperature, dim=-1)
            result = verify_sampling(tree.tokens, sel, probs, generator=generator, max_depth=self.max_depth)
        accepted = int(result.accepted_len[0])
        accepted_local = result.accepted_local[0, :accepted].long()
        emitted = result.accepted_tokens[0, : accepted + 1].tolist()
        clock = checked = self.phases.add("accept", clock)
        # Keep the target cache along the root + accepted path only.
        keep_rows = torch.cat([torch.zeros(1, dtype=torch.long), accepted_local + 1])
        self.target.keep_path(base, keep_rows)
        new_aux = aux[:, keep_rows] if aux is not None else None  # a draft LM's target captures no aux states
        self.drafter.extend_context(new_aux, torch.tensor([emitted]), (base + torch.arange(accepted + 1)).unsqueeze(0))
        clock = self.phases.add("update_context", clock)
        cap = self._plan.k_cap if self.budget is not None else self.k_max
        self.metrics.update(sel, result, cap, depth_cap=gates.depth_cap, truncated=gates.truncated)
        self.drafted_depth_sum += self._drafted_depth(tree)
        self.drafted_steps += 1
        verified_depth = sel.order_depth.amax(dim=1)
        if self.budget is not None:
            self._observe_auto(tree, sel, result, verified_depth, predicted)
            draft_s = (selected - started) + (clock - checked)  # growing the tree, choosing, the head's context
            self._add_sample(count + 1, self._drafted_depth(tree), started, (checked - selected, draft_s))
        if self.recorder is not None and self.calibration is None:
            self.recorder.record(depth_confidence(tree), result.accepted_depth_mask, verified_depth)
            self._maybe_calibrate()
        self.phases.add("bookkeeping", clock)
        self.phases.steps += 1
        return emitted
