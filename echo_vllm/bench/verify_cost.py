"""Verification-cost knee: where one target forward over T new tokens stops being (almost) free.

ECHO caps the draft tokens verified per step over the whole batch at K_max, "set near the hardware saturation
threshold (the compute-bound limit)". This module measures that threshold on the machine it runs on:

* `measure_verify_cost(model, token_counts, repeats, context)` prefills a fixed-length KV context of `context`
  random tokens once, then for each T times one forward of T new tokens appended to that context (causal among
  the new tokens, the KV cache cut back to `context` after each forward), and reports the median wall time in
  ms per forward and per token. The first two forwards of each T are warm-ups and are not timed. On CUDA every timed
  forward is bracketed by `torch.cuda.synchronize()`.
* `find_knee(costs, slack)` = the largest T such that the forward time of every measured T' <= T is still
  <= (1 + slack) x the T = 1 time. With the default slack 0.5 the knee is the largest batch of tokens that costs
  at most 1.5 single-token forwards: up to there verification is memory- or overhead-bound (extra tokens are
  nearly free); past it the forward time grows with T (compute-bound), so every extra verified draft token
  costs real time. The prefix rule ("still") keeps a noisy dip at a larger T from moving the knee past a T that
  was already too slow.

Models: the testbed target (`--testbed DIR`), any local causal LM (`--model DIR`, e.g. the served target, if
it fits on one device), both safetensors via transformers, or a random-weight model of a named
shape (`--model-shape llama-8b-slice`: Llama-3.1-8B's hidden size, heads, KV heads, intermediate size and
vocabulary, but only a few decoder layers, so it fits and runs on a CPU; on a GPU it gives model-shaped
per-layer costs). For a slice the LM head (final norm + vocabulary projection) is also timed alone, and
`est_full_ms` = head + (forward - head) x full_layers / layers estimates the full model's forward; the knee of
that estimate is reported beside the measured one. Nothing is downloaded; nothing but safetensors/JSON is read.

One sequence is measured. In vLLM a step over B running requests verifies B + sum_i K_i tokens in one forward
(each request's ordinary next token plus its drafts; K_max counts only the drafts), so at batch size B,
K_max ~= knee - B. Attention over B separate contexts is not part of this measurement (docs/tuning.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from echo_vllm.bench import report
from echo_vllm.errors import InputError

DEFAULT_SLACK = 0.5
DEFAULT_CONTEXT = 256
DEFAULT_MAX_TOKENS = 512
DEFAULT_REPEATS = 5

# Shapes of real targets with few layers (random weights). `full_layers` is the real model's layer count.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b-slice": {
        "config": {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            # Llama-3.1-8B has an untied LM head; tying it here halves the memory of the slice and changes
            # neither the FLOPs nor the bytes read per forward (the embedding lookup reads only T rows).
            "tie_word_embeddings": True,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        },
        "layers": 2,
        "full_layers": 32,
        "description": "Llama-3.1-8B shape (hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336, vocab 128256)",
    },
}


class KneeInputError(InputError):
    """Bad arguments to the knee tool (printed as one line by the CLI)."""


def powers_of_two(max_tokens: int) -> list[int]:
    """[1, 2, 4, ..., the largest power of two <= max_tokens]."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise KneeInputError(f"max_tokens must be an integer >= 1; got {max_tokens!r}")
    out, t = [], 1
    while t <= max_tokens:
        out.append(t)
        t *= 2
    return out


def _curve(costs: Mapping[int, float] | Iterable[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    if isinstance(costs, Mapping):
        pairs = [(int(t), float(ms)) for t, ms in costs.items()]
    else:
        pairs = [(int(row["tokens"]), float(row[key])) for row in costs]
    pairs.sort()
    if not pairs:
        raise KneeInputError("find_knee: no measurements")
    if len({t for t, _ in pairs}) != len(pairs):
        raise KneeInputError("find_knee: a token count appears twice")
    if pairs[0][0] != 1:
        raise KneeInputError(f"find_knee: needs the T=1 measurement (the smallest T given is {pairs[0][0]})")
    if any(not ms > 0 for _, ms in pairs):  # also rejects NaN
        raise KneeInputError("find_knee: forward times must be positive numbers")
    return pairs


def find_knee(
    costs: Mapping[int, float] | Iterable[Mapping[str, Any]],
    slack: float = DEFAULT_SLACK,
    key: str = "median_ms",
) -> int:
    """Largest T whose forward time, and that of every smaller measured T, is <= (1 + slack) x time(T=1).

    `costs` is {T: ms} or rows with "tokens" and `key` (the output of `measure_verify_cost`). slack >= 0.
    """
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not slack >= 0:
        raise KneeInputError(f"slack must be a number >= 0; got {slack!r}")
    pairs = _curve(costs, key)
    limit = (1.0 + float(slack)) * pairs[0][1]
    knee = 1
    for tokens, ms in pairs:
        if ms > limit:
            break
        knee = tokens
    return knee


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        from echo_vllm.device import cuda_available

        return torch.device("cuda" if cuda_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on CUDA (what serving uses), float32 on CPU (as every engine here runs the testbed)."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in names:
        raise KneeInputError(f"dtype: choose from auto, {', '.join(names)}; got {dtype!r}")
    return names[dtype]


def load_target(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A local causal LM (config.json + safetensors only)."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise KneeInputError(f"{model_dir} has no config.json: give a model directory (the testbed's target/)")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, use_safetensors=True)
    return model.to(device).eval()


def build_model_shape(
    name: str, dtype: torch.dtype, device: torch.device, layers: int | None = None, seed: int = 0
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(random-weight LlamaForCausalLM of the named shape with `layers` decoder layers, its MODEL_SHAPES entry)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in MODEL_SHAPES:
        raise KneeInputError(f"--model-shape: unknown {name!r}; choose from {', '.join(MODEL_SHAPES)}")
    shape = MODEL_SHAPES[name]
    layers = shape["layers"] if layers is None else layers
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise KneeInputError(f"--layers must be an integer >= 1; got {layers!r}")
    config = LlamaConfig(**shape["config"], num_hidden_layers=layers)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval(), {**shape, "layers": layers}


# ----------------------------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _cut_cache(cache: Any, length: int) -> None:
    """Cut every layer of a transformers DynamicCache back to its first `length` positions."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


@torch.inference_mode()
def measure_verify_cost(
    model: torch.nn.Module,
    token_counts: Sequence[int],
    repeats: int = DEFAULT_REPEATS,
    context: int = DEFAULT_CONTEXT,
    *,
    warmup: int = 2,
    seed: int = 0,
    time_head: bool = False,
) -> list[dict[str, Any]]:
    """Time one forward of T new tokens after a fixed `context`-token KV cache, for each T in `token_counts`.

    Returns one row per T (ascending): tokens, median_ms (per forward), ms_per_token (= median_ms / T), min_ms,
    repeats; with `time_head` also head_ms (median time of final norm + LM head alone on T hidden states).
    """
    from transformers import DynamicCache

    counts = sorted({int(t) for t in token_counts})
    if not counts or counts[0] < 1 or any(isinstance(t, bool) for t in token_counts):
        raise KneeInputError(f"token_counts must be integers >= 1; got {list(token_counts)!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise KneeInputError(f"repeats must be an integer >= 1; got {repeats!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise KneeInputError(f"context must be an integer >= 0; got {context!r}")
    config = model.config
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and context + counts[-1] > max_pos:
        raise KneeInputError(
            f"context {context} + {counts[-1]} new tokens exceeds the model's max_position_embeddings {max_pos}; "
            "lower --context or --max-tokens"
        )
    device = _model_device(model)
    vocab = int(config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=config)
    if context > 0:
        prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    rows: list[dict[str, Any]] = []
    for tokens in counts:
        ids = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)
        positions = torch.arange(context, context + tokens, device=device).unsqueeze(0)
        # The HF engine's verification mask (echo_vllm.hf.target): the whole cache plus causal among the new
        # tokens, as an explicit 4-D boolean mask for every T, so T = 1 takes the same attention path as T > 1.
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        mask = torch.cat([torch.ones(tokens, context, dtype=torch.bool, device=device), causal], dim=1)
        mask = mask.view(1, 1, tokens, context + tokens)
        times = []
        for i in range(warmup + repeats):
            _sync(device)
            start = time.perf_counter()
            out = model(
                input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True
            )
            _ = out.logits  # every position's logits, as verification needs
            _sync(device)
            elapsed = (time.perf_counter() - start) * 1e3
            _cut_cache(cache, context)
            del out
            if i >= warmup:
                times.append(elapsed)
        median = statistics.median(times)
        row = {
            "tokens": tokens,
            "median_ms": median,
            "ms_per_token": median / tokens,
            "min_ms": min(times),
            "repeats": repeats,
        }
        if time_head:
            row["head_ms"] = _time_head(model, tokens, repeats, warmup, device)
        rows.append(row)
    return rows


def _time_head(model: torch.nn.Module, tokens: int, repeats: int, warmup: int, device: torch.device) -> float:
    hidden = torch.randn(1, tokens, model.config.hidden_size, dtype=next(model.parameters()).dtype, device=device)
    norm = model.model.norm
    head = model.get_output_embeddings()
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        head(norm(hidden))
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def add_full_model_estimate(rows: list[dict[str, Any]], layers: int, full_layers: int) -> None:
    """est_full_ms = head_ms + (median_ms - head_ms) * full_layers / layers (rows need head_ms)."""
    for row in rows:
        body = max(row["median_ms"] - row["head_ms"], 0.0)
        row["est_full_ms"] = row["head_ms"] + body * full_layers / layers
        row["est_full_ms_per_token"] = row["est_full_ms"] / row["tokens"]


# ----------------------------------------------------------------------------------------------------------------
# CLI (`echo-vllm bench verify-cost`, registered in echo_vllm.bench.cli)
# ----------------------------------------------------------------------------------------------------------------


def format_table(rows: list[dict[str, Any]]) -> str:
    """The printed table: T, ms per forward, ms per token, ratio to T = 1 (and the slice's head/estimate)."""
    base = rows[0]["median_ms"]
    columns = [
        ("T", "tokens", "{:d}"),
        ("ms/forward", "median_ms", "{:.3f}"),
        ("ms/token", "ms_per_token", "{:.4f}"),
        ("x T=1", None, "{:.2f}"),
    ]
    if rows and "est_full_ms" in rows[0]:
        columns += [("head ms", "head_ms", "{:.3f}"), ("est. full ms", "est_full_ms", "{:.3f}")]
    cells = [
        {h: fmt.format(row["median_ms"] / base if key is None else row[key]) for h, key, fmt in columns} for row in rows
    ]
    return report.format_table(cells, [h for h, _, _ in columns], align=">")


def run_cli(args: argparse.Namespace) -> int:
    from echo_vllm.testbed.paths import TestbedError, testbed_dir

    if args.repeats < 1:
        raise KneeInputError(f"--repeats must be >= 1; got {args.repeats}")
    if not args.slack >= 0:
        raise KneeInputError(f"--slack must be >= 0; got {args.slack}")
    if args.layers is not None and not args.model_shape:
        raise KneeInputError("--layers applies to --model-shape only (the testbed target has its own layers)")
    if args.threads is not None:
        if args.threads < 1:
            raise KneeInputError(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    counts = powers_of_two(args.max_tokens)
    shape = None
    if args.model_shape:
        model, shape = build_model_shape(args.model_shape, dtype, device, layers=args.layers)
        source = f"{args.model_shape} ({shape['layers']} of {shape['full_layers']} layers, random weights)"
    elif getattr(args, "model", None):
        model = load_target(args.model, dtype, device)
        source = f"model {args.model}"
    else:
        root = testbed_dir(args.testbed)
        target = root / "target"
        if not (target / "config.json").is_file():
            raise TestbedError(
                f"testbed target missing at {target}: run `make testbed` or `echo-vllm testbed ensure --out {root}`"
            )
        model = load_target(target, dtype, device)
        source = f"testbed target {target}"
    rows = measure_verify_cost(model, counts, repeats=args.repeats, context=args.context, time_head=shape is not None)
    knee = find_knee(rows, args.slack)
    result: dict[str, Any] = {
        "source": source,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "context": args.context,
        "repeats": args.repeats,
        "slack": args.slack,
        "rows": rows,
        "knee": knee,
    }
    if shape is not None:
        add_full_model_estimate(rows, shape["layers"], shape["full_layers"])
        result["layers"] = shape["layers"]
        result["full_layers"] = shape["full_layers"]
        result["knee_full_estimate"] = find_knee(rows, args.slack, key="est_full_ms")
    print(
        f"verification cost: {source}; device {result['device']}, {result['dtype']}, context {args.context}, "
        f"median of {args.repeats}"
    )
    print(format_table(rows))
    print(f"knee (largest T with ms/forward <= {1 + args.slack:g} x T=1): T = {knee}")
    if shape is not None:
        print(
            f"knee of the full-model estimate ({shape['full_layers']} layers; head + body x "
            f"{shape['full_layers']}/{shape['layers']}): T = {result['knee_full_estimate']}"
        )
    print(
        "K_max counts draft tokens over the whole batch: at batch size B a step verifies B + sum K_i tokens, "
        "so K_max ~= knee - B (docs/tuning.md)"
    )
    if args.json:
        report.write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0
