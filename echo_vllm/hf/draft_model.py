"""A plain small draft language model as a core `Drafter` over a tree, for the HF engine (issue #14).

Any HF causal LM that shares the target's tokenizer drafts: it reads the tokens themselves, not the target's
hidden states. Its own KV cache holds one context entry per accepted token (token p at position p). When a tree is
grown, each expansion appends temporary entries to the same cache: a frontier node of depth d sits at position
root + d (root = the position of the last accepted token) and attends to the whole context, its ancestors'
entries and itself - an explicit 4-D mask, as the target verifies trees. The next context extension cuts the tree
entries off again (a view narrowing, no copy) before it appends the accepted tokens.

Alignment with the engine's EAGLE convention: `extend_context(aux, next_tokens, positions)` entry t "consumes
aux[t] and token t + 1", so next_tokens[t] is the token *at* position positions[t] + 1. The draft LM ignores aux and
runs next_tokens at positions + 1; the prompt's first token (position 0, never a next token) comes with `reset`.
After each extension the last context entry is the last accepted token, so `root_logprobs()` is the draft LM's
distribution for the token after it: the first draft token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

from echo_vllm.errors import InputError

DRAFTER_KINDS = ("eagle3", "draft-model")
# Where `bench hf` finds each kind's directory inside a testbed.
TESTBED_SUBDIR = {"eagle3": "eagle3", "draft-model": "draft-lm"}


class DrafterError(InputError):
    """A drafter that cannot draft for this target (another tokenizer or vocabulary), or a bad drafter spec."""


def parse_drafter_spec(text: str, root: Path | str) -> tuple[str, Path]:
    """`KIND[:PATH]` -> (kind, directory); without PATH the kind's directory inside the testbed `root`."""
    kind, sep, path = str(text).partition(":")
    if kind not in DRAFTER_KINDS or (sep and not path):
        raise DrafterError(
            f"--drafter: {text!r} is not a drafter; use eagle3, draft-model or KIND:PATH (e.g. draft-model:DIR, a "
            "directory holding an HF causal LM with the target's tokenizer)"
        )
    return kind, Path(path).expanduser() if path else Path(root) / TESTBED_SUBDIR[kind]


def _vocab_mapping(model_dir: Path) -> dict[str, int]:
    """token -> id of tokenizer.json: the BPE/WordPiece vocab plus the added (special) tokens."""
    data = json.loads((model_dir / "tokenizer.json").read_text())
    mapping = dict((data.get("model") or {}).get("vocab") or {})
    for added in data.get("added_tokens") or []:
        mapping[added["content"]] = added["id"]
    return mapping


def check_same_tokenizer(target_dir: Path | str, draft_dir: Path | str, target_vocab: int, draft_vocab: int) -> None:
    """Raise DrafterError unless the draft LM's vocabulary size and tokenizer.json vocab match the target's."""
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    if draft_vocab != target_vocab:
        raise DrafterError(
            f"draft model {draft_dir} has vocab_size {draft_vocab}, the target {target_dir} has {target_vocab}: a "
            "draft model must share the target's tokenizer and vocabulary; train one against this target "
            "(echo-vllm testbed build-draft-lm) or pass --drafter draft-model:DIR with a matching model"
        )
    for d in (target_dir, draft_dir):
        if not (d / "tokenizer.json").is_file():
            raise DrafterError(
                f"no tokenizer.json in {d}: the draft model's tokenizer must be compared with the target's; copy "
                "the tokenizer files next to both models' config.json"
            )
    if _vocab_mapping(target_dir) != _vocab_mapping(draft_dir):
        raise DrafterError(
            f"draft model {draft_dir} has another tokenizer than the target {target_dir} (their tokenizer.json "
            "vocabularies differ): a draft model must use the target's tokenizer; train one against this target "
            "(echo-vllm testbed build-draft-lm)"
        )


def load_draft_model(draft_dir: Path | str, target_dir: Path | str, target_vocab: int, dtype=torch.float32):
    """The draft LM (eval mode), checked against the target's tokenizer and vocabulary."""
    draft_dir = Path(draft_dir)
    if not (draft_dir / "config.json").is_file():
        raise DrafterError(
            f"no draft model at {draft_dir} (no config.json): build one with `echo-vllm testbed build-draft-lm` or "
            "pass --drafter draft-model:DIR"
        )
    model = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=dtype)
    model.eval()
    check_same_tokenizer(target_dir, draft_dir, target_vocab, model.config.vocab_size)
    return model


class DraftModelTreeDrafter:
    """One engine's drafting state over a (possibly shared) draft LM: engines never generate concurrently, and
    every prompt starts with `reset`, so sharing the weights between engines is safe."""

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.reset()

    def reset(self, prompt: torch.Tensor | None = None) -> None:
        """A new prompt [B, T]: only its first token is kept here (the rest arrive as next tokens)."""
        self.cache = DynamicCache()
        self.ctx_len = 0
        self.first_tokens = None if prompt is None else prompt[:, :1]
        self.root_position = -1
        self.root_logits: torch.Tensor | None = None
        self.last_anc: torch.Tensor | None = None

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor:
        """Append `tokens` [B, T] at `positions`; new_mask [B, T, past + T] bool. Returns logits [B, T, V]."""
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=new_mask.unsqueeze(1),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        return out.logits

    def _drop_tree(self) -> None:
        if self.cache.get_seq_length() > self.ctx_len:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, : self.ctx_len]
                layer.values = layer.values[:, :, : self.ctx_len]
        self.last_anc = None

    @torch.no_grad()
    def extend_context(self, aux, next_tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Accepted tokens: next_tokens [B, T] sit at positions + 1 (the engine's EAGLE alignment); aux is unused."""
        self._drop_tree()
        tokens, pos = next_tokens, positions + 1
        if self.ctx_len == 0:
            if self.first_tokens is None or int(positions[0, 0]) != 0:
                raise RuntimeError("DraftModelTreeDrafter: reset(prompt) must precede the first extend_context")
            tokens = torch.cat([self.first_tokens, tokens], dim=1)
            pos = torch.cat([torch.zeros_like(pos[:, :1]), pos], dim=1)
        batch, steps = tokens.shape
        causal = torch.ones(steps, steps, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(steps, self.ctx_len, dtype=torch.bool), causal], dim=1)
        logits = self._forward(tokens, pos, mask.expand(batch, steps, self.ctx_len + steps))
        self.ctx_len += steps
        self.root_logits = logits[:, -1].float()
        self.root_position = int(pos[0, -1])

    def root_logprobs(self) -> torch.Tensor:
        assert self.root_logits is not None, "extend_context must run before drafting"
        return F.log_softmax(self.root_logits, dim=-1)

    @torch.no_grad()
    def expand(self, frontier_tokens: torch.Tensor, frontier_parent_slots: torch.Tensor, depth: int) -> torch.Tensor:
        """Children log-probs [B, k, V] of the frontier (at depth - 1); `depth` is the children's depth."""
        batch, width = frontier_tokens.shape
        frontier_depth = depth - 1
        if frontier_depth == 1:  # a new tree over the same context: earlier trees' entries go
            self._drop_tree()
            anc = torch.zeros(batch, width, 0, dtype=torch.bool)
        else:
            assert self.last_anc is not None, "expand: depths must come in order 2, 3, ..."
            slots = frontier_parent_slots.long().unsqueeze(-1).expand(-1, -1, self.last_anc.shape[-1])
            anc = torch.gather(self.last_anc, 1, slots)
        own = torch.eye(width, dtype=torch.bool).expand(batch, width, width)
        tree_mask = torch.cat([anc, own], dim=2)  # over this tree's entries, the new ones last
        mask = torch.cat([torch.ones(batch, width, self.ctx_len, dtype=torch.bool), tree_mask], dim=2)
        positions = torch.full((batch, width), self.root_position + frontier_depth, dtype=torch.long)
        logits = self._forward(frontier_tokens, positions, mask)
        self.last_anc = tree_mask
        return F.log_softmax(logits.float(), dim=-1)
