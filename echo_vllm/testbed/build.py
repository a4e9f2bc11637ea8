"""`echo-vllm testbed build`: tokenizer + tiny Llama target + EAGLE-3 head + draft LM, deterministic from seeds.

Output layout (safetensors + JSON + tokenizer files only):
  OUT/target/   LlamaForCausalLM, loadable by transformers and vLLM
  OUT/eagle3/   EAGLE-3 head in the layout vLLM 0.32 loads for "method": "eagle3"
  OUT/draft-lm/ a few-layer LlamaForCausalLM distilled against the target, with its tokenizer (testbed.draft_lm)
  OUT/testbed.json  what was built, with held-out loss and head agreement
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from echo_vllm.models.eagle3 import Eagle3Config, Eagle3Head, init_head_weights
from echo_vllm.testbed import corpus
from echo_vllm.testbed import draft_lm as draft_train
from echo_vllm.testbed import head as head_train
from echo_vllm.testbed import target as target_train
from echo_vllm.testbed import tokenizer as tok_mod
from echo_vllm.testbed.paths import TestbedError, ensure_writable, stdlib_dir

TESTBED_FORMAT = 1


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    corpus_chars: int | None
    target_steps: int
    head_steps: int
    seq_len: int = 128
    batch_size: int = 16
    target_lr: float = 3e-3
    head_lr: float = 2e-3
    num_unrolled: int = 3
    aux_layer_ids: tuple[int, ...] = (1, 2, 3)
    # The distilled draft LM (echo_vllm.testbed.draft_lm): decoder layers, training steps and batch size.
    draft_layers: int = 2
    draft_steps: int = 300
    draft_batch_size: int = 8
    # bf16 autocast for the matmuls (fp32 master weights and losses): ~2x faster training on CPUs with
    # AVX512-BF16/AMX; off where the CPU lacks native bf16 (it would be slower, not wrong).
    bf16_autocast: bool = False


PRESETS = {
    # 12 layers, so that one EAGLE-3 head step (one layer + lm_head) costs a small fraction of a target forward,
    # as with real targets (32-80 layers); with 4 layers drafting cost about as much as verifying.
    "full": Preset(
        "full",
        vocab_size=4096,
        hidden_size=256,
        num_layers=12,
        corpus_chars=20_000_000,
        target_steps=3000,
        head_steps=1500,
        target_lr=2e-3,
        aux_layer_ids=(2, 6, 9),
        bf16_autocast=True,
    ),
    "quick": Preset(
        "quick",
        vocab_size=1024,
        hidden_size=128,
        num_layers=4,
        corpus_chars=400_000,
        target_steps=60,
        head_steps=40,
        draft_layers=1,
        draft_steps=20,
        seq_len=64,
        batch_size=8,
    ),
}


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def build_testbed(out: Path, preset: Preset, seed: int = 0, stdlib: str | None = None, log=print) -> dict:
    src = stdlib_dir(stdlib)
    ensure_writable(out)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    use_bf16 = preset.bf16_autocast and cpu_has_native_bf16()
    started = time.time()
    log(f"testbed[{preset.name}]: corpus from {src}")
    train_texts, heldout_texts = corpus.read_texts(src, preset.corpus_chars)
    if not train_texts or not heldout_texts:
        raise TestbedError(f"too little Python source under {src} to build a testbed")

    # Build into a temporary sibling and move into place at the end: a failed build leaves nothing half-made.
    staging = Path(tempfile.mkdtemp(prefix=".testbed-", dir=out))
    try:
        tok = tok_mod.train_tokenizer(train_texts, preset.vocab_size)
        vocab = tok.get_vocab_size()
        train_ids = torch.tensor(tok_mod.encode_corpus(tok, train_texts), dtype=torch.long)
        heldout_ids = torch.tensor(tok_mod.encode_corpus(tok, heldout_texts), dtype=torch.long)
        log(f"  tokenizer: vocab {vocab}, {train_ids.numel():,} train / {heldout_ids.numel():,} held-out tokens")

        spec = target_train.TargetSpec(
            vocab_size=vocab,
            hidden_size=preset.hidden_size,
            num_layers=preset.num_layers,
            num_heads=preset.hidden_size // 64,
            intermediate_size=int(preset.hidden_size * 2.75),
        )
        ids = {
            name: tok.token_to_id(t) for name, t in (("bos", tok_mod.BOS), ("eos", tok_mod.EOS), ("pad", tok_mod.PAD))
        }
        target = target_train.make_target(spec, ids["bos"], ids["eos"], ids["pad"], seed)
        target_stats = target_train.train_target(
            target,
            train_ids,
            steps=preset.target_steps,
            seq_len=preset.seq_len,
            batch_size=preset.batch_size,
            lr=preset.target_lr,
            seed=seed,
            log=log,
            bf16_autocast=use_bf16,
        )
        target_stats["heldout_loss"] = target_train.heldout_loss(target, heldout_ids, preset.seq_len)
        log(f"  target held-out loss {target_stats['heldout_loss']:.3f}")
        for p in target.parameters():
            p.requires_grad_(False)

        head_cfg = Eagle3Config(
            hidden_size=spec.hidden_size,
            target_hidden_size=spec.hidden_size,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_heads,
            intermediate_size=spec.intermediate_size,
            vocab_size=vocab,
            aux_layer_ids=preset.aux_layer_ids,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=spec.max_position_embeddings,
        )
        head = Eagle3Head(head_cfg)
        init_head_weights(head, seed)
        with torch.no_grad():
            head.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        head_stats = head_train.train_head(
            head,
            target,
            train_ids,
            steps=preset.head_steps,
            seq_len=preset.seq_len,
            batch_size=preset.batch_size,
            lr=preset.head_lr,
            num_unrolled=preset.num_unrolled,
            seed=seed,
            log=log,
            bf16_autocast=use_bf16,
        )
        agreement = head_train.heldout_agreement(head, target, heldout_ids, preset.seq_len, preset.num_unrolled)
        log(f"  head held-out top-1 agreement per draft step: {agreement}")

        draft, draft_entry = draft_train.distill(
            target,
            train_ids,
            heldout_ids,
            draft_spec(preset),
            seq_len=preset.seq_len,
            seed=seed,
            log=log,
            bf16_autocast=use_bf16,
        )

        target_dir, head_dir = staging / "target", staging / "eagle3"
        # bf16 on disk halves the size; every engine upcasts exactly to float32.
        target.to(torch.bfloat16).save_pretrained(target_dir, safe_serialization=True)
        tok_mod.save_tokenizer(tok, target_dir, spec.max_position_embeddings)
        head.save(head_dir, dtype=torch.bfloat16)
        tok_mod.save_tokenizer(tok, head_dir, spec.max_position_embeddings)
        draft_train.save_draft(draft, target_dir, staging / draft_train.DRAFT_DIR)

        manifest = {
            "format": TESTBED_FORMAT,
            "preset": asdict(preset),
            "seed": seed,
            "torch_threads": threads,
            "bf16_autocast": use_bf16,
            "vocab_size": vocab,
            "train_tokens_available": int(train_ids.numel()),
            "heldout_tokens": int(heldout_ids.numel()),
            "target": {**asdict(spec), **target_stats},
            "eagle3": {
                **head_stats,
                "heldout_top1_agreement_per_step": agreement,
                "aux_layer_ids": list(preset.aux_layer_ids),
            },
            "draft_lm": draft_entry,
            "build_seconds": round(time.time() - started, 1),
        }
        (staging / "testbed.json").write_text(json.dumps(manifest, indent=2) + "\n")
        for name in ("target", "eagle3", draft_train.DRAFT_DIR, "testbed.json"):
            dest = out / name
            if dest.is_dir():
                shutil.rmtree(dest)
            elif dest.exists():
                dest.unlink()
            (staging / name).rename(dest)
        (out / ".prebuilt").unlink(missing_ok=True)  # a build of one's own is never replaced by `testbed ensure`
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"testbed[{preset.name}] written to {out} in {manifest['build_seconds']:.0f}s")
    return manifest


def draft_spec(preset: Preset) -> draft_train.DraftSpec:
    return draft_train.DraftSpec(
        num_layers=preset.draft_layers, steps=preset.draft_steps, batch_size=preset.draft_batch_size
    )


def load_manifest(root: Path) -> dict:
    path = root / "testbed.json"
    if not path.is_file():
        raise TestbedError(f"no testbed at {root}: run `echo-vllm testbed build --out {root}` (or `make testbed`)")
    return json.loads(path.read_text())
