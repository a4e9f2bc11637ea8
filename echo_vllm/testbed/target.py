"""The tiny Llama target: built with transformers, trained on CPU on the stdlib corpus."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class TargetSpec:
    vocab_size: int
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 704
    max_position_embeddings: int = 2048


def make_target(spec: TargetSpec, bos_id: int, eos_id: int, pad_id: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def batches(ids: torch.Tensor, seq_len: int, batch_size: int, generator: torch.Generator):
    """Endless random windows of seq_len + 1 tokens."""
    high = ids.numel() - seq_len - 1
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        yield torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, ids: torch.Tensor, seq_len: int, max_windows: int = 32) -> float:
    model.eval()
    n = min(max_windows, (ids.numel() - 1) // seq_len)
    if n == 0:
        return float("nan")
    windows = ids[: n * seq_len + 1]
    inputs = torch.stack([windows[i * seq_len : (i + 1) * seq_len] for i in range(n)])
    labels = torch.stack([windows[i * seq_len + 1 : (i + 1) * seq_len + 1] for i in range(n)])
    losses = []
    for chunk in range(0, n, 8):
        logits = model(input_ids=inputs[chunk : chunk + 8]).logits
        losses.append(
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels[chunk : chunk + 8].flatten(), reduction="sum"
            )
        )
    return float(torch.stack(losses).sum() / labels.numel())


def train_target(
    model: LlamaForCausalLM,
    train_ids: torch.Tensor,
    *,
    steps: int,
    seq_len: int,
    batch_size: int,
    lr: float,
    seed: int,
    log=print,
    bf16_autocast: bool = False,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    model.train()
    started = time.time()
    data = batches(train_ids, seq_len, batch_size, gen)
    loss_value = float("nan")
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        batch = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = 0.9 * loss_value + 0.1 * loss.item() if step else loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(f"  target step {step + 1}/{steps} loss {loss_value:.3f} ({time.time() - started:.0f}s)")
    model.eval()
    return {
        "train_loss": loss_value,
        "train_seconds": time.time() - started,
        "train_tokens": steps * seq_len * batch_size,
    }


def aux_hidden_states(model: LlamaForCausalLM, input_ids: torch.Tensor, layer_ids: tuple[int, ...]):
    """(logits [B, T, V], aux [B, T, len(layer_ids) * H]): residual stream after k layers, k = 0 is embeddings.

    Same definition as vLLM's `_maybe_add_hidden_state` (hidden + residual after layer k)."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    if 0 in layer_ids:
        hooks.append(model.model.embed_tokens.register_forward_hook(lambda _m, _i, out: captured.__setitem__(0, out)))
    for k in layer_ids:
        if k == 0:
            continue
        layer = model.model.layers[k - 1]

        def hook(_m, _i, out, k=k):
            captured[k] = out[0] if isinstance(out, tuple) else out

        hooks.append(layer.register_forward_hook(hook))
    try:
        logits = model(input_ids=input_ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, torch.cat([captured[k] for k in layer_ids], dim=-1)
