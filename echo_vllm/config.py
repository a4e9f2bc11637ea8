"""ECHO settings: one pydantic model shared by the core, the HF engine, the vLLM plugin and deploy checks.

No vLLM import here: the deploy tests validate ConfigMaps with it on machines without vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from echo_vllm.errors import ConfigError

GateMode = Literal["sparse", "auc", "dense", "fixed"]
SurplusWidth = Literal["all", "truncated"]


# The name the config's users import; the class is the error vocabulary's ConfigError.
EchoConfigError = ConfigError


class EchoSettings(BaseModel):
    """The `"echo": {...}` block of echo.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    k_max: int | Literal["auto"] = Field(
        default="auto",
        description="Draft tokens verified per step, summed over the batch. 'auto': chosen every step to maximise "
        "expected tokens per second from the measured step cost and the calibrated acceptance (0 = plain decoding "
        "for that step). An integer: a fixed cap, ECHO's K_max (0 disables speculation).",
    )
    top_k: int = Field(default=4, ge=1, le=16, description="Children expanded per node and nodes kept per depth.")
    delta: float = Field(default=0.6, ge=0.5, le=1.0, description="AUC above which a depth is a sweet spot.")
    warmup_steps: int = Field(default=32, ge=0, description="Verification steps recorded before gates apply.")
    gate_mode: GateMode = Field(
        default="sparse",
        description="sparse (ECHO: the sweet spots that add to the gates shallower than them, at most max_gates), "
        "auc (every sweet spot, the paper's rule read literally), dense (every depth), fixed (one tau).",
    )
    max_gates: int = Field(
        default=3,
        description="gate_mode sparse: at most this many checkpoints (integer >= 1; gate_mode dense for a gate at "
        "every depth).",
    )
    min_gain: float = Field(
        default=0.02,
        description="gate_mode sparse: a sweet spot becomes a checkpoint only if adding its gate raises the gate "
        "set's J (saved share of rejected draft tokens minus lost share of accepted ones, on the warm-up "
        "samples) by at least this (0..1).",
    )
    calibration_file: str | None = Field(
        default=None,
        description="JSON calibration to load; if the file does not exist it is written after warm-up.",
    )
    surplus_width: SurplusWidth = Field(
        default="all",
        description="Who may be widened (Priority 2) once no request can deepen: 'all' = gate-truncated requests "
        "and requests whose spine reached the depth ceiling; 'truncated' = only gate-truncated ones (the paper's "
        "wording; leaves budget unused at low load when no gate closes).",
    )
    surplus_tail: bool = Field(
        default=True,
        description="Priority 3: budget left after depth and width goes back to truncated requests' drafted tails "
        "(their spine past the closed gate), best path scores first. Matters where drafting runs past the gate "
        "anyway (the vLLM plugin); false cuts at every closed gate, the paper's literal rule.",
    )
    draft_stop_confidence: float = Field(
        default=0.015625,
        ge=0.0,
        lt=1.0,
        description="k_max 'auto', chains on CPU: the draft loop stops once every request's chain so far has a "
        "path confidence (the product of its draft probabilities) below this, from depth 2 on; no deeper node "
        "could then score higher, and on the testbed nodes past such a frontier were accepted 0-17 % of the time "
        "while a draft level costs ~7 % of a batch-1 step. Probes, warm-up and profile steps draft their full "
        "depth. 0 = off (every step drafts its planned depth). Outputs are unchanged either way (lossless).",
    )
    min_samples_per_class: int = Field(
        default=8, ge=1, description="A depth needs this many accepted and rejected samples to be calibrated."
    )
    budget_profile_file: str | None = Field(
        default=None,
        description="k_max 'auto': JSON with the measured step-cost model and acceptance counts; loaded if it "
        "exists (no profile steps), else written after the start-up profile. Default: <calibration_file stem>"
        ".budget.json next to calibration_file (none without one).",
    )
    profile_steps: int = Field(
        default=30,
        ge=4,
        description="k_max 'auto': steps after warm-up that verify swept budgets to measure the step cost (each "
        "depth held for 3 steps; 30 = every depth twice).",
    )
    probe_interval: int = Field(
        default=16,
        ge=0,
        description="k_max 'auto': every this many steps draft at full depth and verify every draft, so that "
        "acceptance statistics and every depth's worth stay measured when the budget has shrunk (0 = never).",
    )
    probe_load_scale: int = Field(
        default=4,
        ge=0,
        description="k_max 'auto': when > 0, probes come every probe_interval x ceil(B / probe_load_scale) steps "
        "at batch B, so that the request-steps probed per step stay the same at every load (a probe verifies B x "
        "depth drafts, a cost that grows with B where verification is linear in tokens); 0 = every probe_interval "
        "steps at any load. The default 4 keeps batch 1-4 at probe_interval (there a probe is what lifts a plan "
        "out of a hard stretch) and spaces probes out from batch 5 up (docs/benchmarks.md, thirty-eighth session). "
        "A plan at plain decoding probes every probe_interval steps at any load (its only way back to drafting).",
    )
    probe_depth: Literal["full", "next"] = Field(
        default="next",
        description="k_max 'auto': how deep a probe drafts (and verifies every draft): 'full' = the max depth; "
        "'next' = one deeper than the depth plan's current best (a step that costs about what a step at that "
        "depth costs, where a full-depth probe at batch 64 verifies 4 x 64 drafts); depths further down are "
        "valued from the measured continuation rates, and a plan that moves deeper is then probed deeper (the "
        "default: measured ahead of 'full' at batch 16 and 64 on the testbed, docs/benchmarks.md).",
    )
    probe_requests: int = Field(
        default=0,
        ge=0,
        description="k_max 'auto', vLLM chains: when > 0 and the batch is larger, a probe verifies the full drafted "
        "chain of only this many requests (a different slice of the batch each probe) and the budget's choice for "
        "the rest; 0 = every request's full chain (a probe then verifies B x depth drafts, a cost that grows with "
        "B where verification is linear in tokens).",
    )
    depth_switch_margin: float = Field(
        default=0.0,
        ge=0.0,
        le=10.0,
        description="k_max 'auto': the depth plan leaves its current draft depth only for a depth whose lead over "
        "it, averaged over recent steps, exceeds this many standard errors of the per-step difference; 0 = always "
        "the depth worth most on average (neighbouring depths worth nearly the same then swap with the noise).",
    )
    request_history: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="k_max 'auto', vLLM chains: when > 0, the weight of a verified step in each request's running "
        "averages of its accepted drafts and of the drafts the acceptance table expected of it; their ratio scales "
        "the request's acceptance estimates and its place in ECHO's order (gates unchanged), so that requests "
        "accepted more often than their confidences say are verified first. 0 = off.",
    )
    plain_head_rows: Literal["batch", "measured"] = Field(
        default="measured",
        description="k_max 'auto' with defer_plain_head: what the depth plan charges a plain step for the head "
        "work it defers: 'batch' = one row per request; 'measured' = the head rows per request that recent steps "
        "carried (next-token rows plus the prompt rows of joining requests), which a plain step defers in full.",
    )
    plain_hindsight: bool = Field(
        default=False,
        description="k_max 'auto': a step that verifies nothing still updates the depth plan, every depth valued "
        "from the measured continuation rates (as deeper-than-drafted depths are); false (the default: no gain "
        "measured, docs/benchmarks.md) leaves plain steps out, so that only probes move a plan at plain decoding.",
    )
    plan_catch_up: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="k_max 'auto': the most one measured step of a small batch (one that weighs less than a full "
        "step in the depth plan's average: batch 1-4) weighs after a stretch of steps that measured nothing (plain "
        "decoding: only probes measure): as if the average had aged on every step of the stretch, up to this; 0 = "
        "one step's weight whatever came before (a plan at plain then needed two probes, ~32 steps, to leave a bad "
        "stretch's values). Larger batches always weigh one step (there it cost 2-5 % at batch 16).",
    )
    stale_slot_steps: int = Field(
        default=64,
        ge=0,
        description="k_max 'auto': the depth plan keeps its values per load (batch-size slot); a slot that measured "
        "nothing in this many steps, entered from a neighbouring slot that did, starts from that slot's values "
        "(e.g. the batch shrinking as a queue drains into loads last seen long ago); 0 = every slot keeps its own "
        "values however old.",
    )
    continuation_memory: Literal["tries", "steps", "slots"] = Field(
        default="steps",
        description="k_max 'auto': how the depth plan's continuation rates P(accept depth j | reached j - 1) forget: "
        "'tries' = per try of that depth (a depth the plan does not draft keeps its old rate until probes replace "
        "it); 'steps' = per verified request-step, every depth alike (a rarely tried depth leans on the pooled rate "
        "of recent steps); 'slots' = 'steps' kept per load slot as well (the batch-size slots of the depth plan), "
        "each shrunk towards the global rates, so that a drain's few hardest requests do not set the rates a full "
        "batch's plan values its undrafted depths from.",
    )
    defer_plain_head: bool = Field(
        default=True,
        description="vLLM: on a step that drafts nothing (k_max 'auto' chose plain decoding), skip the draft "
        "head's pass over the step's tokens and run it for them in the next step that drafts (same inputs, same "
        "KV; output exact either way). false runs the head every step, as vLLM does.",
    )
    deferred_head_window: int = Field(
        default=1,
        ge=0,
        description="vLLM, defer_plain_head: the next drafting step runs the head only for each request's this "
        "many newest deferred rows; older ones are dropped, leaving the head's KV unwritten there (drafts may get "
        "worse, output cannot change), so a plain stretch at high load does not pay the head for every position "
        "and joining prompt it saw. 0 = run the head for every deferred row (the drafts of a head that ran every "
        "step). Default 1: measured 4 % faster at batch 64 on the testbed (5 of 6 paired rounds), the same at "
        "batch 4 and 16, acceptance unchanged (docs/benchmarks.md).",
    )
    prompt_head_window: int = Field(
        default=0,
        ge=0,
        description="vLLM: the draft head's first pass runs over only each joining request's this many newest "
        "prompt rows (its chunk of a prefill), so a step that admits requests does not pay the head's attention "
        "and MLP for whole prompts; the older rows still get the head's K/V (prompt_head_kv, default on: the same "
        "drafts as without the cut) or, with prompt_head_kv false or a head without a K/V writer, none (drafts may "
        "get worse; output cannot change either way). 0 = every prompt row (vLLM's behaviour; the default: on the "
        "testbed's tiny head 4 with K/V measured no gain, 0.97-0.99x at batch 16, 32 and 64, without K/V ~4 % faster "
        "at 16-64 and ~5 % slower at 8; docs/benchmarks.md, thirty-fourth and thirty-fifth sessions).",
    )
    prompt_head_kv: bool = Field(
        default=True,
        description="vLLM, with prompt_head_window > 0: still write the draft head's K/V for the prompt rows its "
        "first pass leaves out (the fc, norms, K/V projection and rotary embedding of those rows; not their "
        "attention, output projection or MLP), so the head drafts exactly what it drafts without the cut. For "
        "vLLM's one-layer Llama EAGLE-3 head on a backend that writes KV apart from its forward; elsewhere a "
        "warning says why not and the rows stay unwritten. false: leave them unwritten (cheaper; drafts may get "
        "worse).",
    )
    fault_limit: int = Field(
        default=8,
        ge=1,
        description="vLLM: after this many consecutive steps with a fault inside ECHO (each runs "
        "without drafts), ECHO turns itself off for the process; the engine keeps serving.",
    )

    @field_validator("max_gates", mode="before")
    @classmethod
    def _check_max_gates(cls, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"max_gates must be an integer >= 1 (the most checkpoints gate_mode 'sparse' keeps; gate_mode "
                f"'dense' gates every depth); got {value!r}"
            )
        return value

    @field_validator("min_gain", mode="before")
    @classmethod
    def _check_min_gain(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(
                f"min_gain must be a number in [0, 1] (the least gain in J a sparse checkpoint must add; "
                f"default 0.02); got {value!r}"
            )
        return float(value)

    @field_validator("k_max", mode="before")
    @classmethod
    def _check_k_max(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("k_max must be an integer >= 0; got a boolean")
        if value == "auto":
            return value
        if isinstance(value, str):
            raise ValueError(f"k_max must be 'auto' or an integer >= 0; got {value!r}")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, (int, str)):
            raise ValueError(f"k_max must be an integer >= 0; got {value!r}")
        if isinstance(value, int) and value < 0:
            raise ValueError(f"k_max must be >= 0 (0 disables speculation); got {value}")
        return value


def format_validation_error(err: ValidationError, prefix: str = "echo") -> str:
    """One line per problem: `echo.k_max: k_max must be >= 0 ...`."""
    lines = []
    for problem in err.errors():
        where = ".".join(str(p) for p in (prefix, *problem["loc"]) if p != "")
        msg = problem["msg"]
        if problem["type"] == "extra_forbidden":
            allowed = ", ".join(EchoSettings.model_fields)
            msg = f"unknown key; allowed keys are: {allowed}"
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def parse_echo_settings(raw: dict[str, Any] | None) -> EchoSettings:
    """Validate the `echo` block, raising EchoConfigError with field names."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise EchoConfigError(f"echo: must be a JSON object, got {type(raw).__name__}")
    try:
        return EchoSettings(**raw)
    except ValidationError as err:
        raise EchoConfigError(format_validation_error(err)) from None


def load_json_or_path(value: str) -> dict[str, Any]:
    """Accept a JSON object string or a path to a JSON file (what `--speculative-config` gets)."""
    text = value.strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise EchoConfigError(f"speculative config: {value!r} is neither a JSON object nor an existing file")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise EchoConfigError(f"speculative config: invalid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, dict):
        raise EchoConfigError("speculative config: must be a JSON object")
    return data
