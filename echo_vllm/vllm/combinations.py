"""Which vLLM options ECHO runs with: one table of rules, evaluated by `spec` and `EchoEngineConfigPatch`.

ECHO is exact only on the path it was built for: vLLM's V1 model runner, EAGLE-3 drafting a chain, the standard
rejection sampler, synchronous scheduling. An option that leaves that path is refused with one line naming it and
why (it would make the output lossy, or be silently ignored or broken); one that only weakens ECHO is logged.
A rule's option is either a key of the speculative config (`source="speculative config"`; ECHO's spec passes
every key but `echo` through to vLLM) or an `EngineArgs` field (`source="engine"`). Keys a vLLM release lacks are
still refused here: vLLM would name them as unknown, not say why ECHO cannot use them.

No vLLM import: the manifest checks (`spec_problems(check_files=False)`) share the speculative-config rules, and
docs/configuration.md's matrix is rendered from `RULES` (`python -m echo_vllm.vllm.combinations --markdown`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Severity = Literal["refuse", "warn"]
Source = Literal["speculative config", "engine"]
SPEC: Source = "speculative config"
ENGINE: Source = "engine"

# (value of the option, the whole ECHO spec, EngineArgs or None) -> whether the rule fires
Predicate = Callable[[Any, Mapping[str, Any], Any], bool]


@dataclass(frozen=True)
class Rule:
    option: str  # a speculative-config key, or an EngineArgs field
    source: Source
    supported: str  # what works, for the matrix
    when: str  # the combination the rule fires on, for the matrix
    hits: Predicate
    severity: Severity
    reason: str  # why, and what to do instead
    needs_engine: bool = False  # a speculative-config rule that compares with an EngineArgs field

    def value(self, spec: Mapping[str, Any], engine: Any) -> Any:
        if self.source == ENGINE:
            return getattr(engine, self.option, None)
        return spec.get(self.option)

    def message(self, value: Any) -> str:
        name = self.option if self.source == SPEC else f"{self.option} (--{self.option.replace('_', '-')})"
        verb = "is not supported" if self.severity == "refuse" else "weakens ECHO"
        return f"{name}={value!r} {verb} with method 'echo': {self.reason}"


def _is_set(value: Any, spec: Mapping[str, Any], engine: Any) -> bool:
    # False / None are vLLM's defaults for every flag ruled on here: only a value that turns the feature on counts.
    return value is not None and value is not False


def _other_than(*allowed: Any) -> Predicate:
    return lambda value, spec, engine: value is not None and value not in allowed


def _above_one(value: Any, spec: Mapping[str, Any], engine: Any) -> bool:
    return isinstance(value, int) and value > 1


def _differs_from_target_tp(value: Any, spec: Mapping[str, Any], engine: Any) -> bool:
    return value is not None and value != getattr(engine, "tensor_parallel_size", 1)


def _any_key_with_prefix(prefix: str) -> Predicate:
    return lambda value, spec, engine: any(k.startswith(prefix) for k in spec)


_NGRAM = "configures the n-gram proposer, and ECHO drafts with its EAGLE-3 head; remove it"

RULES: tuple[Rule, ...] = (
    Rule(
        "rejection_sample_method",
        SPEC,
        "'standard' (the default)",
        "any other ('synthetic', 'block', 'fly')",
        _other_than("standard"),
        "refuse",
        "'synthetic' accepts drafts at preset rates and 'fly' (vLLM 0.33) defers verification, so both change the "
        "output; 'block' exists only in the V2 model runner, which ECHO does not run (V1 would use 'standard' "
        "without saying so); ECHO is exact only with 'standard'",
    ),
    Rule(
        "enable_adaptive_verification",
        SPEC,
        "false (the default)",
        "true",
        _is_set,
        "refuse",
        "it is a second per-step draft budget, in the V2 model runner only, while ECHO runs V1 and sets the "
        "budget itself (echo.k_max)",
    ),
    Rule(
        "parallel_drafting",
        SPEC,
        "false (the default)",
        "true",
        _is_set,
        "refuse",
        "parallel drafting proposes every position in one pass from mask tokens; ECHO's per-depth confidences "
        "come from the sequential EAGLE-3 chain",
    ),
    Rule(
        "draft_lm_head_quantization",
        SPEC,
        "unset",
        "any value (vLLM 0.33)",
        _is_set,
        "refuse",
        "vLLM implements a quantized draft LM head in the V2 model runner only, and ECHO runs V1; quantize the "
        "head's weights instead ('quantization')",
    ),
    Rule(
        "speculative_token_tree",
        SPEC,
        "unset",
        "any value",
        _is_set,
        "refuse",
        "vLLM's static token tree is not ECHO's: ECHO grows per-request trees itself (echo.top_k > 1) and verifies "
        "them with its own tree backend and sampler",
    ),
    Rule(
        "draft_tensor_parallel_size",
        SPEC,
        "unset, or equal to tensor_parallel_size",
        "different from tensor_parallel_size",
        _differs_from_target_tp,
        "refuse",
        "the V1 EAGLE proposer runs the head under the target's tensor parallelism and ignores this value; omit it",
        needs_engine=True,
    ),
    Rule("prompt_lookup_max", SPEC, "unset", "any value", _is_set, "refuse", _NGRAM),
    Rule("prompt_lookup_min", SPEC, "unset", "any value", _is_set, "refuse", _NGRAM),
    Rule(
        "suffix_decoding_*",
        SPEC,
        "unset",
        "any suffix_decoding_ key",
        _any_key_with_prefix("suffix_decoding_"),
        "refuse",
        "configures suffix decoding, and ECHO drafts with its EAGLE-3 head; remove it",
    ),
    Rule(
        "num_speculative_tokens_per_batch_size",
        SPEC,
        "unset",
        "a schedule",
        _is_set,
        "warn",
        "vLLM then drafts fewer than num_speculative_tokens tokens at some batch sizes, and those steps neither "
        "calibrate ECHO nor use its gates (ECHO's budget already shrinks drafts with load: echo.k_max)",
    ),
    Rule(
        "draft_sample_method",
        SPEC,
        "'greedy' (the default)",
        "'probabilistic'",
        _other_than("greedy"),
        "warn",
        "ignored: ECHO drafts the argmax and verifies without draft probabilities, which is exact for deterministic "
        "drafts",
    ),
    Rule(
        "async_scheduling",
        ENGINE,
        "unset or false (ECHO sets false)",
        "true (--async-scheduling)",
        _is_set,
        "refuse",
        "ECHO drafts a different number of tokens per request, which vLLM schedules only without async "
        "scheduling; remove --async-scheduling",
    ),
    Rule(
        "pipeline_parallel_size",
        ENGINE,
        "1",
        "> 1",
        _above_one,
        "refuse",
        "vLLM's V1 model runner builds the EAGLE-3 head on the last stage only, and earlier stages never send it "
        "their auxiliary hidden states; use tensor parallelism instead",
    ),
)

# Checked in vLLM's code and fine with ECHO's chains; rows of the matrix, no rule.
SUPPORTED: tuple[tuple[str, Source, str], ...] = (
    ("`quantization`", SPEC, "a quantized head: vLLM loads it and checks the method for the platform"),
    ("`disable_padded_drafter_batch`", SPEC, "either value: the proposer reads padded and unpadded results"),
    ("`tensor_parallel_size`", ENGINE, "any: every rank computes the same gates from the same logits"),
    (
        "structured outputs, penalties, bad words",
        ENGINE,
        "the scheduler trims each request's drafts to its grammar, and penalties are applied per draft token "
        "(`num_draft_tokens`), whatever each request's draft length",
    ),
    ("`min_p`, `logit_bias` (per request)", ENGINE, "refused per request by vLLM itself with any speculative decoding"),
)


def _fired(spec: Mapping[str, Any], engine: Any, sources: tuple[Source, ...]) -> list[tuple[Rule, Any]]:
    fired = []
    for rule in RULES:
        if rule.source not in sources or (rule.needs_engine and engine is None):
            continue
        value = rule.value(spec, engine)
        if rule.hits(value, spec, engine):
            fired.append((rule, value))
    return fired


def spec_problems(spec: Mapping[str, Any]) -> list[str]:
    """The refusals of the speculative-config rules that need no EngineArgs (for spec.spec_problems)."""
    return [r.message(v) for r, v in _fired(spec, None, (SPEC,)) if r.severity == "refuse"]


def engine_findings(spec: Mapping[str, Any], engine: Any) -> tuple[list[str], list[str]]:
    """(refusals, warnings) of every rule against the ECHO spec and EngineArgs; the spec-only refusals are
    included too, so this is the whole check on its own."""
    fired = _fired(spec, engine, (SPEC, ENGINE))
    refusals = [r.message(v) for r, v in fired if r.severity == "refuse"]
    warnings = [r.message(v) for r, v in fired if r.severity == "warn"]
    return refusals, warnings


# ---------------------------------------------------------------------------------------------------------------
# The matrix in docs/configuration.md
# ---------------------------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def matrix_markdown() -> str:
    lines = [
        "| option | where | supported | refused / warned | why |",
        "|---|---|---|---|---|",
    ]
    for rule in RULES:
        verdict = f"**{'refused' if rule.severity == 'refuse' else 'warned'}**: {rule.when}"
        cells = (f"`{rule.option}`", rule.source, rule.supported, verdict, rule.reason)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    for option, source, note in SUPPORTED:
        cells = (option, source, "yes", "—", note)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echo_vllm.vllm.combinations")
    parser.add_argument("--markdown", action="store_true", help="print the matrix for docs/configuration.md")
    args = parser.parse_args(argv)
    if args.markdown:
        print(matrix_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
