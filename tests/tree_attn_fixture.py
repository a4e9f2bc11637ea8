"""A synthetic tree step over a FlashAttention-layout paged cache, and its dense masked reference (shared by the
tree attention tests: tests/test_tree_attn_split.py, tests/test_tree_attn_cuda.py).

Four requests over a shuffled block table: a branching tree across a block boundary, a chain, a request with no
drafts, and a second tree. `dense_reference` computes each fix row's attention over exactly the keys its
ancestors make visible, from the parents (not from the batch's bit masks), one row at a time.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from echo_vllm.vllm import tree_state
from echo_vllm.vllm.tree_attn_split import fa_kv_views

HEADS, KV_HEADS, HEAD = 4, 2, 64  # head size 64: one FA3/FA2 supports everywhere
BLOCK = 16
NUM_BLOCKS = 14
SCALE = 1 / math.sqrt(HEAD)

TREE_PARENTS = (-1, 0, 1, 2, -1, 0, 4, 1, 5, 6)  # spine of 4, then the rest depth-major; crosses a block boundary
SECOND_TREE = (-1, 0, -1, 1, 0)
# (context tokens, draft parents): a tree, a chain, no drafts, another tree
REQS = [(10, TREE_PARENTS), (20, (-1, 0, 1)), (5, ()), (33, SECOND_TREE)]


@dataclasses.dataclass
class Step:
    batch: tree_state.TreeBatch
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D] (the step's rows)
    value: torch.Tensor
    kv_cache: torch.Tensor  # [nb, Hkv, bs, 2D]
    block_table: torch.Tensor  # [B, max_blocks] int32
    full_k: list[torch.Tensor]  # per request [L, Hkv, D]: every logical position
    full_v: list[torch.Tensor]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


def make_step(dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Step:
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(REQS)
    new = [1 + len(p) for _, p in REQS]
    seq = [ctx + n for (ctx, _), n in zip(REQS, new)]
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
    max_blocks = max(-(-s // BLOCK) for s in seq)
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    table = torch.zeros((num_reqs, max_blocks), dtype=torch.int32)
    used = 0
    for b, s in enumerate(seq):
        n = -(-s // BLOCK)
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    kv_cache = torch.randn((NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD), generator=gen).to(dtype)
    key_cache, value_cache = fa_kv_views(kv_cache, HEAD)
    total = int(qsl[-1])
    query = torch.randn((total, HEADS, HEAD), generator=gen).to(dtype)
    key = torch.empty((total, KV_HEADS, HEAD), dtype=dtype)
    value = torch.empty((total, KV_HEADS, HEAD), dtype=dtype)
    full_k, full_v = [], []
    for b, s in enumerate(seq):
        pos = torch.arange(s)
        blocks, offs = table[b].long()[pos // BLOCK], pos % BLOCK
        k, v = key_cache[blocks, offs].clone(), value_cache[blocks, offs].clone()  # the cache is the truth
        full_k.append(k.float())
        full_v.append(v.float())
        ctx = REQS[b][0]
        key[qsl[b] : qsl[b + 1]] = k[ctx:]  # the step's own rows: root and drafts
        value[qsl[b] : qsl[b + 1]] = v[ctx:]
    plans = [tree_state.TreePlan(tuple(range(100, 100 + len(p))), p).validate() if p else None for _, p in REQS]
    scheduled = [list(range(100, 100 + len(p))) for _, p in REQS]
    ctx = np.array([c for c, _ in REQS], dtype=np.int64)
    batch = tree_state.build_tree_batch(plans, scheduled, ctx, qsl[:-1], device)
    assert batch is not None
    return Step(
        batch=batch,
        query=query.to(device),
        key=key.to(device),
        value=value.to(device),
        kv_cache=kv_cache.to(device),
        block_table=table.to(device),
        full_k=full_k,
        full_v=full_v,
        query_start_loc=torch.from_numpy(qsl).to(torch.int32).to(device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
    )


def visible_positions(batch: tree_state.TreeBatch, f: int) -> list[int]:
    """The logical KV positions fix row f sees under the tree mask, from the parents (not from fix_bits)."""
    b = int(batch.fix_req[f])
    ctx = int(batch.context_len[b])
    j = int(batch.fix_rows[f]) - int(batch.root_row[b]) - 1
    parents = REQS[b][1]
    seen = []
    while j >= 0:
        seen.append(ctx + 1 + j)
        j = parents[j]
    return list(range(ctx + 1)) + sorted(seen)


def dense_reference(step: Step, softcap: float = 0.0, drop_ancestors: bool = False) -> torch.Tensor:
    """[F, H, D] float32: each fix row's attention over exactly its visible keys, dense, one row at a time."""
    batch, rows = step.batch, []
    for f in range(batch.num_fix_rows):
        b = int(batch.fix_req[f])
        pos = visible_positions(batch, f)
        if drop_ancestors:
            ctx = int(batch.context_len[b])
            pos = [p for p in pos if p <= ctx] + [int(batch.fix_rows[f]) - int(batch.root_row[b]) + ctx]
        k = step.full_k[b][pos].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, H, D]
        v = step.full_v[b][pos].repeat_interleave(HEADS // KV_HEADS, dim=1)
        q = step.query[int(batch.fix_rows[f])].float().cpu()  # [H, D]
        logits = torch.einsum("hd,lhd->hl", q, k) * SCALE
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        rows.append(torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), v))
    return torch.stack(rows)
