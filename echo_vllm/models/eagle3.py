"""An EAGLE-3 draft head in plain torch, in the exact weight layout vLLM 0.32 loads for `"method": "eagle3"`.

Mirrors `vllm/model_executor/models/llama_eagle3.py` (one mid layer, `norm_before_residual=False`, no
`fc_norm`/`norm_before_fc`): the target's aux hidden states (residual stream after the layers named in
`eagle_aux_hidden_state_layer_ids`) are concatenated and projected by `fc`; the mid layer attends over
[input_layernorm(embed(token)), hidden_norm(hidden)] (width 2H) with the raw hidden as residual; its pre-norm
output is the hidden input of the next draft step and `lm_head(norm(.))` gives the logits. The token embedding
is the target's (vLLM shares it when the checkpoint has no `embed_tokens`).

Used by the testbed trainer and by the HF engine's drafter; vLLM uses its own implementation of the same math.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from echo_vllm.errors import InputError


class HeadFilesMissing(InputError, FileNotFoundError):
    """The head directory lacks config.json or model.safetensors (still a FileNotFoundError for callers)."""


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf_config(self) -> dict:
        """config.json in the layout vLLM 0.32 loads as `LlamaForCausalLMEagle3`."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
            "echo_vllm": {"eagle3_config": asdict(self)},
        }


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # the same math without six no-op casts
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., hd] float32 for integer positions [...]."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * rope_inv_freq(head_dim, theta, positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, theta: float, table: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Neox-style rotary embedding, as Llama; x [B, heads, T, hd], positions [B, T].

    `table` = rope_cos_sin(arange(P)) looks the angles up instead of recomputing them (the same float32 values:
    each entry is the same product position * inv_freq).
    """
    if table is None:
        cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    else:
        cos, sin = table[0][positions], table[1][positions]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        h, n_aux = config.hidden_size, len(config.aux_layer_ids)
        q_out = config.num_attention_heads * config.head_dim
        kv_out = config.num_key_value_heads * config.head_dim
        self.fc = nn.Linear(n_aux * config.target_hidden_size, h, bias=False)
        self.q_proj = nn.Linear(2 * h, q_out, bias=False)
        self.k_proj = nn.Linear(2 * h, kv_out, bias=False)
        self.v_proj = nn.Linear(2 * h, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, h, bias=False)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        # The target's token embedding, shared (not saved), as vLLM does without `embed_tokens` in the file.
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self._fused: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def prepare_for_inference(self) -> Eagle3Head:
        """Precompute what drafting reuses every step: fused q/k/v and gate/up weights and the RoPE table.

        Drafting runs the head on 1-16 rows per step, where per-op overhead, not FLOPs, is the cost; fusing cuts
        the mid layer from 7 matmuls to 4. Call again after changing weights; training never uses this path.
        """
        cfg = self.config
        self.eval()
        self._fused = {
            "qkv": torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).contiguous(),
            "gate_up": torch.cat([self.gate_proj.weight, self.up_proj.weight]).contiguous(),
        }
        positions = torch.arange(cfg.max_position_embeddings, device=self.fc.weight.device)
        self._rope_table = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        return self

    def combine_hidden_states(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[.., n_aux * H_target] -> [.., H]."""
        return self.fc(aux_hidden)

    def project_kv(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Return (q, k, v, residual) for the mid layer; shapes q [B, nh, T, hd], k/v [B, nkv, T, hd]."""
        cfg = self.config
        batch, steps = input_ids.shape
        embeds = rms_norm(self.embed_tokens(input_ids), self.input_layernorm, cfg.rms_norm_eps)
        hidden_normed = rms_norm(hidden, self.hidden_norm, cfg.rms_norm_eps)
        x = torch.cat([embeds, hidden_normed], dim=-1)
        q_out = cfg.num_attention_heads * cfg.head_dim
        kv_out = cfg.num_key_value_heads * cfg.head_dim
        if self._fused is not None:
            q, k, v = F.linear(x, self._fused["qkv"]).split([q_out, kv_out, kv_out], dim=-1)
            table = self._rope_table
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            table = None
        q = q.reshape(batch, steps, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = k.reshape(batch, steps, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = v.reshape(batch, steps, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q = apply_rope(q, positions, cfg.rope_theta, table)
        k = apply_rope(k, positions, cfg.rope_theta, table)
        return q, k, v, hidden

    def finish(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        residual: torch.Tensor,
        last_logits_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over (keys, values) with a boolean mask [B, T, S], then MLP.

        Returns (logits [B, T, V], prenorm hidden [B, T, H]: the next draft step's hidden input). With
        `last_logits_only` the logits are [B, 1, V] for the last row (all a context extension needs).
        """
        cfg = self.config
        batch, _, steps, _ = q.shape
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(1))
        attn = self.o_proj(attn.transpose(1, 2).reshape(batch, steps, -1))
        residual = attn + residual
        hidden = rms_norm(residual, self.post_attention_layernorm, cfg.rms_norm_eps)
        if self._fused is not None:
            gate, up = F.linear(hidden, self._fused["gate_up"]).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(hidden), self.up_proj(hidden)
        prenorm = self.down_proj(F.silu(gate) * up) + residual
        out = prenorm[:, -1:] if last_logits_only else prenorm
        logits = self.lm_head(rms_norm(out, self.norm, cfg.rms_norm_eps))
        return logits, prenorm

    # ---- files -------------------------------------------------------------------------------------------

    def state_for_vllm(self) -> dict[str, torch.Tensor]:
        """Weights under the names vLLM's Eagle3 loader expects (no `embed_tokens`: shared with the target)."""
        names = {
            "fc.weight": self.fc.weight,
            "midlayer.self_attn.q_proj.weight": self.q_proj.weight,
            "midlayer.self_attn.k_proj.weight": self.k_proj.weight,
            "midlayer.self_attn.v_proj.weight": self.v_proj.weight,
            "midlayer.self_attn.o_proj.weight": self.o_proj.weight,
            "midlayer.mlp.gate_proj.weight": self.gate_proj.weight,
            "midlayer.mlp.up_proj.weight": self.up_proj.weight,
            "midlayer.mlp.down_proj.weight": self.down_proj.weight,
            "midlayer.input_layernorm.weight": self.input_layernorm,
            "midlayer.hidden_norm.weight": self.hidden_norm,
            "midlayer.post_attention_layernorm.weight": self.post_attention_layernorm,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head.weight,
        }
        return {k: v.detach().contiguous() for k, v in names.items()}

    def save(self, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.to(dtype) for k, v in self.state_for_vllm().items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        hf = self.config.to_hf_config()
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
        (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")

    @classmethod
    def load(cls, head_dir: Path | str, target_embedding: torch.Tensor) -> Eagle3Head:
        """Load a head saved by `save` (safetensors + JSON only); `target_embedding` is the target's [V, H]."""
        head_dir = Path(head_dir)
        config = read_head_config(head_dir)
        weights_path = head_dir / "model.safetensors"
        if not weights_path.is_file():
            raise HeadFilesMissing(f"EAGLE-3 head: {weights_path} is missing; build the testbed or point to a head dir")
        if target_embedding.shape[0] != config.vocab_size:
            raise ValueError(
                f"EAGLE-3 head vocab_size {config.vocab_size} differs from the target's "
                f"{target_embedding.shape[0]}: the head must be trained for this target"
            )
        head = cls(config)
        state = load_file(str(weights_path))
        own = head.state_for_vllm()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"EAGLE-3 head {weights_path}: missing tensors {missing}")
        with torch.no_grad():
            for name, param in own.items():
                param.copy_(state[name].to(param.dtype))
            head.embed_tokens.weight.copy_(target_embedding)
        return head


def read_head_config(head_dir: Path | str) -> Eagle3Config:
    """The head's config.json (JSON only), with a clear error when it is missing."""
    config_path = Path(head_dir) / "config.json"
    if not config_path.is_file():
        raise HeadFilesMissing(f"EAGLE-3 head: {config_path} is missing; build the testbed or point to a head dir")
    return config_from_hf(json.loads(config_path.read_text()))


def config_from_hf(hf: dict) -> Eagle3Config:
    eagle = hf.get("eagle_config") or {}
    layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not layer_ids:
        raise ValueError("EAGLE-3 head config.json: eagle_config.eagle_aux_hidden_state_layer_ids is required")
    return Eagle3Config(
        hidden_size=hf["hidden_size"],
        target_hidden_size=hf.get("target_hidden_size", hf["hidden_size"]),
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        aux_layer_ids=tuple(layer_ids),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta", 10000.0),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
    )


def init_head_weights(head: Eagle3Head, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (
            head.fc,
            head.q_proj,
            head.k_proj,
            head.v_proj,
            head.o_proj,
            head.gate_proj,
            head.up_proj,
            head.down_proj,
            head.lm_head,
        ):
            fan_in = module.weight.shape[1]
            module.weight.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
