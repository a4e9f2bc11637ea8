"""A HuggingFace causal-LM target with tree verification and a KV cache kept only along accepted paths.

Tree attention is a 4-D boolean mask (query attends to the whole cache plus its own ancestors) with depth-based
position ids; transformers passes a ready 4-D mask through unchanged. The EAGLE-3 aux hidden states (residual
stream after chosen layers, the same definition as vLLM's) are captured with forward hooks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache


class HFTarget:
    def __init__(self, model_dir: str | Path, aux_layer_ids: tuple[int, ...] = (), dtype=torch.float32):
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        self.model.eval()
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.vocab_size = self.model.config.vocab_size
        num_layers = self.model.config.num_hidden_layers
        bad = [k for k in self.aux_layer_ids if not 0 <= k < num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range for a target with {num_layers} layers")
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        self._install_hooks()
        self.cache = DynamicCache()

    @property
    def embedding(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def _install_hooks(self) -> None:
        inner = self.model.model
        for k in self.aux_layer_ids:
            module = inner.embed_tokens if k == 0 else inner.layers[k - 1]

            def hook(_m, _i, out, k=k):
                self._captured[k] = out[0] if isinstance(out, tuple) else out

            self._hooks.append(module.register_forward_hook(hook))

    def reset(self) -> None:
        self.cache = DynamicCache()

    @property
    def cache_len(self) -> int:
        return self.cache.get_seq_length()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tree_mask: torch.Tensor | None):
        """input_ids/position_ids [B, T]; tree_mask [B, T, T] bool among the new tokens (None = causal).

        Returns (logits [B, T, V] float32, aux [B, T, n_aux * H] or None). New tokens enter the cache.
        """
        batch, steps = input_ids.shape
        past = self.cache_len
        if tree_mask is None:
            tree_mask = torch.ones(steps, steps, dtype=torch.bool).tril().expand(batch, steps, steps)
        full = torch.cat([torch.ones(batch, steps, past, dtype=torch.bool), tree_mask], dim=2)
        self._captured.clear()
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=full.unsqueeze(1),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        aux = None
        if self.aux_layer_ids:
            aux = torch.cat([self._captured[k] for k in self.aux_layer_ids], dim=-1)
        return out.logits.float(), aux

    def keep_path(self, base: int, rows: torch.Tensor) -> None:
        """Keep the cache prefix [0, base) plus the new rows base + rows (1-D, ascending, rows[0] = 0).

        Moves the accepted rows down in place and narrows to a view: O(accepted) per step, where re-indexing the
        whole cache would copy all of it (the context) once more per step.
        """
        n = rows.numel()
        src = base + rows
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[:, :, base : base + n] = t[:, :, src]  # the right side is gathered into a copy first
                setattr(layer, name, t[:, :, : base + n])
