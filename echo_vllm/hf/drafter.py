"""The EAGLE-3 head as a core `Drafter` over a tree, for the HF engine.

Context entries (one per target position t, consuming the target's aux hidden at t and token t+1) live in the
head's own KV cache, as in vLLM. Tree nodes get temporary entries when they are expanded: a depth-d node is
consumed at position root + d with the pre-norm output of its parent as hidden input, attending to the whole
context, its ancestors' entries and itself (the same visibility the head was trained with).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from echo_vllm.models.eagle3 import Eagle3Head


class Eagle3TreeDrafter:
    def __init__(self, head: Eagle3Head):
        self.head = head.prepare_for_inference()
        self.vocab_size = head.config.vocab_size
        self.reset()

    def reset(self, prompt: torch.Tensor | None = None) -> None:
        """A new prompt (unused: the head's context arrives whole with the first `extend_context`)."""
        self.ctx_k: torch.Tensor | None = None
        self.ctx_v: torch.Tensor | None = None
        self.root_position = -1
        self.root_logits: torch.Tensor | None = None
        self.root_prenorm: torch.Tensor | None = None
        self._begin_tree()

    def _begin_tree(self) -> None:
        self.tree_k: torch.Tensor | None = None
        self.tree_v: torch.Tensor | None = None
        self.last_prenorm: torch.Tensor | None = None
        self.last_anc: torch.Tensor | None = None

    @torch.no_grad()
    def extend_context(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Add context entries: aux [B, T, n_aux*H] at `positions` [B, T], consuming `next_tokens` [B, T]."""
        head = self.head
        batch, steps = next_tokens.shape
        hidden = head.combine_hidden_states(aux.to(head.fc.weight.dtype))
        q, k, v, residual = head.project_kv(next_tokens, hidden, positions)
        past = 0 if self.ctx_k is None else self.ctx_k.shape[2]
        keys = k if self.ctx_k is None else torch.cat([self.ctx_k, k], dim=2)
        values = v if self.ctx_v is None else torch.cat([self.ctx_v, v], dim=2)
        causal = torch.ones(steps, steps, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(steps, past, dtype=torch.bool), causal], dim=1).expand(batch, steps, past + steps)
        logits, prenorm = head.finish(q, keys, values, mask, residual, last_logits_only=True)
        self.ctx_k, self.ctx_v = keys, values
        self.root_logits = logits[:, -1].float()
        self.root_prenorm = prenorm[:, -1]
        self.root_position = int(positions[0, -1])
        self._begin_tree()

    def root_logprobs(self) -> torch.Tensor:
        return F.log_softmax(self.root_logits, dim=-1)

    @torch.no_grad()
    def expand(self, frontier_tokens: torch.Tensor, frontier_parent_slots: torch.Tensor, depth: int) -> torch.Tensor:
        """Children log-probs [B, k, V] of the frontier (at depth - 1); `depth` is the children's depth."""
        head = self.head
        batch, width = frontier_tokens.shape
        frontier_depth = depth - 1
        if frontier_depth == 1:
            hidden = self.root_prenorm.unsqueeze(1).expand(batch, width, -1)
            anc = torch.zeros(batch, width, 0, dtype=torch.bool)
        else:
            slots = frontier_parent_slots.long()
            hidden = torch.gather(self.last_prenorm, 1, slots.unsqueeze(-1).expand(-1, -1, self.last_prenorm.shape[-1]))
            anc = torch.gather(self.last_anc, 1, slots.unsqueeze(-1).expand(-1, -1, self.last_anc.shape[-1]))
        positions = torch.full((batch, width), self.root_position + frontier_depth, dtype=torch.long)
        q, k, v, residual = head.project_kv(frontier_tokens, hidden, positions)
        tree_k = k if self.tree_k is None else torch.cat([self.tree_k, k], dim=2)
        tree_v = v if self.tree_v is None else torch.cat([self.tree_v, v], dim=2)
        own = torch.eye(width, dtype=torch.bool).expand(batch, width, width)
        tree_mask = torch.cat([anc, own], dim=2)
        ctx_len = self.ctx_k.shape[2]
        mask = torch.cat([torch.ones(batch, width, ctx_len, dtype=torch.bool), tree_mask], dim=2)
        logits, prenorm = head.finish(
            q, torch.cat([self.ctx_k, tree_k], dim=2), torch.cat([self.ctx_v, tree_v], dim=2), mask, residual
        )
        self.tree_k, self.tree_v = tree_k, tree_v
        self.last_prenorm = prenorm
        self.last_anc = tree_mask
        return F.log_softmax(logits.float(), dim=-1)
