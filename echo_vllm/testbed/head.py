"""Training an EAGLE-3 head against the frozen target, with EAGLE-3's training-time test (unrolled steps).

Step 1 at base position t consumes (target aux hidden at t, token t+1) and predicts token t+2; step j >= 2
consumes the head's own pre-norm output of step j-1 and token t+j, at position t+j-1, attending to step-1 keys
at positions <= t and to its own earlier steps of the same base: exactly what it sees while drafting in vLLM.
The loss is cross-entropy against the target's full next-token distribution (so sampling acceptance is
trained too); top-1 agreement with the target's argmax is reported per step.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from echo_vllm.models.eagle3 import Eagle3Head
from echo_vllm.testbed.target import aux_hidden_states, batches, lr_at


def ttt_mask(num_bases: int, step: int, device=None) -> torch.Tensor:
    """[M, step * M] bool: which keys a step-`step` query of base t may attend to."""
    t = torch.arange(num_bases, device=device)
    causal = t.unsqueeze(1) >= t.unsqueeze(0)  # step-1 keys, positions <= t
    diag = torch.eye(num_bases, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * (step - 1), dim=1)


def unrolled_forward(head: Eagle3Head, tokens: torch.Tensor, aux: torch.Tensor, num_steps: int):
    """Draft logits per unrolled step: list of [B, M, V] with M = T - num_steps bases."""
    batch, seq = tokens.shape
    num_bases = seq - num_steps
    base_pos = torch.arange(num_bases).expand(batch, num_bases)
    hidden = head.combine_hidden_states(aux[:, :num_bases])
    keys, values, outputs = [], [], []
    for step in range(1, num_steps + 1):
        q, k, v, residual = head.project_kv(tokens[:, step : step + num_bases], hidden, base_pos + step - 1)
        keys.append(k)
        values.append(v)
        mask = ttt_mask(num_bases, step).expand(batch, num_bases, step * num_bases)
        logits, hidden = head.finish(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask, residual)
        outputs.append(logits)
    return outputs


def head_loss(head, target, tokens, layer_ids, num_steps, bf16_autocast: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        with torch.no_grad():
            target_logits, aux = aux_hidden_states(target, tokens, layer_ids)
        outputs = unrolled_forward(head, tokens, aux, num_steps)
    num_bases = tokens.shape[1] - num_steps
    losses, agree = [], []
    for step, logits in enumerate(outputs, start=1):
        # Draft step j at base t predicts token t+j+1, whose target distribution is the target's row t+j.
        labels = target_logits[:, step : step + num_bases]
        probs = labels.float().softmax(-1)
        losses.append(-(probs * F.log_softmax(logits.float(), -1)).sum(-1).mean() * (0.8 ** (step - 1)))
        agree.append((logits.argmax(-1) == labels.argmax(-1)).float().mean())
    return torch.stack(losses).sum(), torch.stack(agree)


def train_head(
    head: Eagle3Head,
    target: LlamaForCausalLM,
    train_ids: torch.Tensor,
    *,
    steps: int,
    seq_len: int,
    batch_size: int,
    lr: float,
    num_unrolled: int,
    seed: int,
    log=print,
    bf16_autocast: bool = False,
) -> dict:
    gen = torch.Generator().manual_seed(seed + 1)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = batches(train_ids, seq_len, batch_size, gen)
    started = time.time()
    layer_ids = head.config.aux_layer_ids
    head.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        tokens = next(data)[:, :-1]
        loss, agree = head_loss(head, target, tokens, layer_ids, num_unrolled, bf16_autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            agree_text = " ".join(f"{a:.2f}" for a in agree.tolist())
            log(
                f"  head step {step + 1}/{steps} loss {loss.item():.3f} top1/step [{agree_text}] "
                f"({time.time() - started:.0f}s)"
            )
    head.eval()
    return {"head_train_seconds": time.time() - started}


@torch.no_grad()
def heldout_agreement(head, target, ids: torch.Tensor, seq_len: int, num_steps: int, max_windows: int = 16):
    n = min(max_windows, ids.numel() // seq_len)
    if n == 0:
        return []
    tokens = ids[: n * seq_len].view(n, seq_len)
    _, agree = head_loss(head, target, tokens, head.config.aux_layer_ids, num_steps)
    return [round(a, 4) for a in agree.tolist()]
