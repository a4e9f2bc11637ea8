"""A small draft LM distilled against the testbed's target (issue #14: the second drafter family).

The draft LM is a `LlamaForCausalLM` with the target's tokenizer and vocabulary and a few layers. It starts from
the target: the (tied) embedding, the final norm and evenly spaced decoder layers are copied (layer dropping, as
DistilBERT initialises its student), so training starts from a model that already reads the target's embedding
space. The loss is KL(target || draft) on the target's full next-token distribution at every position (what both
greedy and sampling acceptance depend on), plus optional cross-entropy on the corpus tokens.

`build_draft_lm` builds it into an existing testbed from the target there, leaving the target untouched (the
committed target takes an hour to retrain); `build_testbed` calls the same training for a fresh testbed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from echo_vllm.testbed.target import batches, lr_at

DRAFT_DIR = "draft-lm"


@dataclass(frozen=True)
class DraftSpec:
    num_layers: int = 2
    steps: int = 300
    batch_size: int = 8
    lr: float = 3e-3
    ce_weight: float = 0.0  # 0: pure distillation (the target's distribution is what acceptance is measured on)


def make_draft(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A `num_layers` Llama with the target's config otherwise, initialised from the target's weights."""
    tcfg = target.config
    config = LlamaConfig(**{**tcfg.to_dict(), "num_hidden_layers": num_layers})
    config.architectures = ["LlamaForCausalLM"]
    draft = LlamaForCausalLM(config).to(torch.float32)
    total = tcfg.num_hidden_layers
    picks = [round(i * (total - 1) / max(1, num_layers - 1)) for i in range(num_layers)] if num_layers > 1 else [0]
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
        for mine, theirs in zip(draft.model.layers, picks):
            mine.load_state_dict(target.model.layers[theirs].state_dict())
        if not config.tie_word_embeddings:
            draft.lm_head.weight.copy_(target.lm_head.weight)
    return draft


def distill_loss(draft, target, tokens: torch.Tensor, ce_weight: float, bf16_autocast: bool):
    """(loss, top-1 agreement with the target) on windows `tokens` [B, T + 1]."""
    inputs = tokens[:, :-1]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        with torch.no_grad():
            target_logits = target(input_ids=inputs).logits
        logits = draft(input_ids=inputs).logits
    target_logp = F.log_softmax(target_logits.float(), -1)
    logp = F.log_softmax(logits.float(), -1)
    kl = (target_logp.exp() * (target_logp - logp)).sum(-1).mean()
    loss = kl
    if ce_weight:
        loss = loss + ce_weight * F.cross_entropy(logp.flatten(0, 1), tokens[:, 1:].flatten())
    agree = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return loss, agree


def train_draft(
    draft: LlamaForCausalLM,
    target: LlamaForCausalLM,
    train_ids: torch.Tensor,
    spec: DraftSpec,
    *,
    seq_len: int,
    seed: int,
    log=print,
    bf16_autocast: bool = False,
) -> dict:
    gen = torch.Generator().manual_seed(seed + 2)
    opt = torch.optim.AdamW(draft.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = batches(train_ids, seq_len, spec.batch_size, gen)
    target.eval()
    draft.train()
    started = time.time()
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.steps, spec.lr, warmup=max(1, spec.steps // 20))
        loss, agree = distill_loss(draft, target, next(data), spec.ce_weight, bf16_autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == spec.steps - 1:
            log(
                f"  draft-lm step {step + 1}/{spec.steps} loss {loss.item():.3f} top1 {agree.item():.3f} "
                f"({time.time() - started:.0f}s)"
            )
    draft.eval()
    return {"train_seconds": round(time.time() - started, 1), "train_tokens": spec.steps * seq_len * spec.batch_size}


@torch.no_grad()
def heldout_agreement(draft, target, ids: torch.Tensor, seq_len: int, max_windows: int = 32) -> float:
    """Top-1 agreement of the draft LM with the target's argmax over held-out windows (teacher-forced)."""
    n = min(max_windows, (ids.numel() - 1) // (seq_len + 1))
    if n == 0:
        return float("nan")
    windows = ids[: n * (seq_len + 1)].view(n, seq_len + 1)
    agree = [distill_loss(draft, target, windows[i : i + 8], 0.0, False)[1] for i in range(0, n, 8)]
    sizes = [min(8, n - i) for i in range(0, n, 8)]
    return round(float(sum(a * s for a, s in zip(agree, sizes)) / n), 4)


def save_draft(draft: LlamaForCausalLM, tokenizer_src: Path, out_dir: Path) -> None:
    """bf16 safetensors + config + the target's tokenizer files (byte-identical: the engine compares them)."""
    draft.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    draft.to(torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_src / name).is_file():
            shutil.copyfile(tokenizer_src / name, out_dir / name)


def distill(
    target: LlamaForCausalLM,
    train_ids: torch.Tensor,
    heldout_ids: torch.Tensor,
    spec: DraftSpec,
    *,
    seq_len: int,
    seed: int,
    log=print,
    bf16_autocast: bool = False,
) -> tuple[LlamaForCausalLM, dict]:
    """Make, train and evaluate a draft LM; (model, the manifest's "draft_lm" entry)."""
    torch.manual_seed(seed + 2)
    draft = make_draft(target, spec.num_layers)
    stats = train_draft(
        draft,
        target,
        train_ids,
        spec,
        seq_len=seq_len,
        seed=seed,
        log=log,
        bf16_autocast=bf16_autocast,
    )
    agreement = heldout_agreement(draft, target, heldout_ids, seq_len)
    log(f"  draft-lm held-out top-1 agreement with the target: {agreement}")
    params = sum(p.numel() for p in draft.parameters())
    entry = {**asdict(spec), **stats, "parameters": params, "heldout_top1_agreement": agreement}
    return draft, entry


def build_draft_lm(root: Path, spec: DraftSpec, stdlib: str | None = None, log=print) -> dict:
    """Train a draft LM into an existing testbed `root` against its target; updates testbed.json's "draft_lm".

    The corpus is re-read and re-encoded with the testbed's own tokenizer exactly as `build_testbed` did (same
    character cap, same held-out split), so the draft LM sees the data the target was trained on."""
    from tokenizers import Tokenizer

    from echo_vllm.testbed import corpus
    from echo_vllm.testbed import tokenizer as tok_mod
    from echo_vllm.testbed.build import cpu_has_native_bf16, load_manifest
    from echo_vllm.testbed.paths import TestbedError, stdlib_dir

    manifest = load_manifest(root)
    preset = manifest["preset"]
    target_dir = root / "target"
    if not (target_dir / "tokenizer.json").is_file():
        raise TestbedError(f"no target/tokenizer.json under {root}: rebuild the testbed with `echo-vllm testbed build`")
    seed = int(manifest.get("seed", 0))
    use_bf16 = bool(preset.get("bf16_autocast")) and cpu_has_native_bf16()
    src = stdlib_dir(stdlib)
    train_texts, heldout_texts = corpus.read_texts(src, preset["corpus_chars"])
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    train_ids = torch.tensor(tok_mod.encode_corpus(tok, train_texts), dtype=torch.long)
    heldout_ids = torch.tensor(tok_mod.encode_corpus(tok, heldout_texts), dtype=torch.long)
    log(f"draft-lm: {train_ids.numel():,} train / {heldout_ids.numel():,} held-out tokens from {src}")
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    draft, entry = distill(
        target,
        train_ids,
        heldout_ids,
        spec,
        seq_len=preset["seq_len"],
        seed=seed,
        log=log,
        bf16_autocast=use_bf16,
    )
    staging = Path(tempfile.mkdtemp(prefix=".draft-lm-", dir=root))
    try:
        save_draft(draft, target_dir, staging / DRAFT_DIR)
        dest = root / DRAFT_DIR
        if dest.exists():
            shutil.rmtree(dest)
        (staging / DRAFT_DIR).rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    manifest["draft_lm"] = entry
    (root / "testbed.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"draft-lm written to {root / DRAFT_DIR}")
    return entry
