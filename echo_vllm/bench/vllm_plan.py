"""What `bench vllm` runs: the method variants, their round order, the prompts and the warm-up of each job.

No vLLM or torch import here: the plan is plain data, so its tests run without an engine.

A *variant* is one engine configuration: `nospec`, `eagle3` at one depth (every depth of --eagle3-depths is a
variant of its own, the tuned baseline is picked from them afterwards), `echo` (a fixed integer K_max) or
`echo-auto` (`"k_max": "auto"`), both verifying chains (top_k 1), or `echo-tree` (`"k_max": "auto"` with draft
trees: the spine and its top_k - 1 sibling leaves per depth, top_k from --top-k). Rounds run every variant once, in an order rotated by one per round
(A B C, B C A, C A B, ...), so slow drift of a shared machine hits every method alike
(../shared/notes/benchmark-protocol.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo_vllm.errors import ConfigError

METHODS = ("nospec", "eagle3", "echo", "echo-auto", "echo-tree")
ECHO_METHODS = ("echo", "echo-auto", "echo-tree")
CHAIN_METHODS = ("echo", "echo-auto")  # the oracle bound is defined for chains


class BenchPlanError(ConfigError):
    """A bad --methods / --eagle3-depths / --rounds / --batch-sizes value: one line, no traceback."""


@dataclass(frozen=True)
class Variant:
    """One engine configuration. `depth`: EAGLE-3's num_speculative_tokens, ECHO's max draft depth."""

    method: str
    depth: int | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # the `echo` block (echo methods only)

    @property
    def label(self) -> str:
        return f"eagle3@{self.depth}" if self.method == "eagle3" else self.method

    def speculative_config(self, head: Path) -> dict[str, Any] | None:
        if self.method == "nospec":
            return None
        if self.method == "eagle3":
            return {"method": "eagle3", "model": str(head), "num_speculative_tokens": self.depth}
        # The echo-vllm plugin turns this into an eagle3 run with ECHO's per-step budget.
        return {"method": "echo", "model": str(head), "num_speculative_tokens": self.depth, "echo": dict(self.echo)}


def parse_methods(methods: list[str]) -> list[str]:
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise BenchPlanError(f"--methods: unknown or empty {unknown or methods!r}; choose from {', '.join(METHODS)}")
    return list(dict.fromkeys(methods))  # order kept, duplicates dropped


def expand_variants(
    methods: list[str], eagle3_depths: list[int], echo_depth: int, echo: dict[str, Any], tree_top_k: int = 4
) -> list[Variant]:
    """The variants to run. nospec always runs: it is the baseline of every ratio and of the identity check.
    `echo` is the shared echo block; echo and echo-auto verify chains, echo-tree trees of `tree_top_k`."""
    methods = parse_methods(methods)
    if "eagle3" in methods and (not eagle3_depths or min(eagle3_depths) < 1):
        raise BenchPlanError(f"--eagle3-depths: give depths >= 1; got {eagle3_depths!r}")
    if any(m in ECHO_METHODS for m in methods) and echo_depth < 1:
        raise BenchPlanError(f"--depth (ECHO's max draft depth) must be >= 1; got {echo_depth}")
    variants = [Variant("nospec")]
    for method in methods:
        if method == "eagle3":
            variants += [Variant("eagle3", d) for d in dict.fromkeys(eagle3_depths)]
        elif method == "echo":
            variants.append(Variant("echo", echo_depth, {**echo, "top_k": 1}))
        elif method == "echo-auto":
            variants.append(Variant("echo-auto", echo_depth, {**echo, "k_max": "auto", "top_k": 1}))
        elif method == "echo-tree":
            if tree_top_k < 2:
                raise BenchPlanError(f"--top-k: echo-tree needs top_k >= 2 (1 is echo-auto); got {tree_top_k}")
            variants.append(Variant("echo-tree", echo_depth, {**echo, "k_max": "auto", "top_k": tree_top_k}))
    return variants


def round_orders(variants: list[Variant], rounds: int) -> list[list[Variant]]:
    """Round r runs the variants rotated left by r: A B C, B C A, C A B, A B C, ..."""
    if rounds < 1:
        raise BenchPlanError(f"--rounds must be >= 1; got {rounds}")
    n = len(variants)
    return [variants[r % n :] + variants[: r % n] for r in range(rounds)]


def prompts_for_batch(dataset: list[str], batch_size: int, limit: int, waves: int = 1) -> list[str]:
    """At least `limit` prompts and at least `waves` whole batches, rounded up to whole batches, so the batch stays
    full to the last wave (with ignore_eos every request runs to max_tokens). The dataset is cycled when it has too
    few. Why waves: with one or two batches most steps are ramp-up and drain, which no-spec (lockstep) never pays
    and every speculative method does (testbed, batch 8: EAGLE-3@3 0.80x no-spec with 2 waves, 1.25x with 8)."""
    if batch_size < 1:
        raise BenchPlanError(f"--batch-sizes: every size must be >= 1; got {batch_size}")
    if waves < 1:
        raise BenchPlanError(f"--waves must be >= 1; got {waves}")
    if not dataset:
        raise BenchPlanError("the dataset has no prompts")
    count = batch_size * max(1, math.ceil(limit / batch_size), waves)
    return [dataset[i % len(dataset)] for i in range(count)]


def warmup_tokens(max_tokens: int, warmup_steps: int, max_depth: int) -> int:
    """Tokens per request of the untimed warm-up generate: enough engine steps for ECHO's calibration.

    A step emits at most 1 + max_depth tokens per request, so a request of T tokens takes at least
    T / (1 + max_depth) steps; +2 covers the prefill step and the step whose result arrives last. Every method of
    a batch size gets this same warm-up, whether it calibrates or not.
    """
    return max(max_tokens, (warmup_steps + 2) * (1 + max_depth))
