"""The compiled tree kernels (csrc/tree_cpu.cpp) against their torch reference and a dense masked attention.

Random paged caches in CPU_ATTN's layout (shuffled block tables, garbage in unused slots), random ragged trees
(random parents, chains and trees mixed, requests without drafts), GQA and MHA, float32 / bfloat16, soft cap:
the C++ fix-up rows must match the torch path of tree_attn_cpu (`_fix_tree_rows_torch`) and a dense reference
built from the logical K / V decoded through the page layout; the compaction must be bit-identical. Without the
extension (or with ECHO_VLLM_TREE_TORCH=1) the torch path runs and gives the same rows.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from echo_vllm.vllm.cpu_isa import apply_emulation, echo_kernel_build, load_vllm_cpu_kernels

apply_emulation()
pytest.importorskip("vllm")
pytestmark = pytest.mark.needs_vllm

import torch  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402

from echo_vllm.ops import cpu_isa_calls  # noqa: E402
from echo_vllm.ops import tree as tree_ops  # noqa: E402
from echo_vllm.vllm import tree_attn_cpu, tree_state  # noqa: E402

load_vllm_cpu_kernels()

BLOCK, HEAD = 32, 64
needs_ops = pytest.mark.skipif(
    not tree_ops.compiled_tree_ops(torch.device("cpu")), reason="echo_vllm._C without the tree ops"
)


@pytest.fixture(autouse=True)
def _no_engine_config(monkeypatch):
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: config)
    yield
    tree_state.clear()


def random_parents(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    """A spine of random length first (spine-first order), then nodes hanging off any earlier node or the root."""
    spine = int(rng.integers(0, n + 1))
    parents = list(range(-1, spine - 1))
    for j in range(spine, n):
        parents.append(int(rng.integers(-1, j)))
    return tuple(parents)


def random_step(seed: int, heads: int, kv_heads: int, dtype: torch.dtype, num_reqs: int = 5):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    ctx = rng.integers(0, 90, num_reqs)
    drafts = rng.integers(0, 17, num_reqs)
    drafts[0] = max(drafts[0], 6)  # at least one real tree
    plans, scheduled = [], []
    for i in range(num_reqs):
        n = int(drafts[i])
        parents = random_parents(rng, n) if i != 0 else (-1, 0, -1, 1, 0, 2) + tuple(range(5, 5 + n - 6))
        plans.append(tree_state.TreePlan(tuple(range(7, 7 + n)), parents) if n else None)
        scheduled.append(list(range(7, 7 + n)))
    new = 1 + drafts
    starts = np.concatenate([[0], np.cumsum(new)])
    batch = tree_state.build_tree_batch(plans, scheduled, ctx, starts[:-1].astype(np.int64), "cpu")
    assert batch is not None and batch.num_fix_rows > 0
    seq = ctx + new
    per_req = int(max(math.ceil(s / BLOCK) for s in seq)) + 1
    num_blocks = num_reqs * per_req + 3
    block_table = torch.randperm(num_blocks, generator=g)[: num_reqs * per_req].view(num_reqs, per_req).int()
    kv_cache = (torch.randn(num_blocks, kv_heads, BLOCK, 2 * HEAD, generator=g) * 3).to(dtype)
    query = torch.randn(int(starts[-1]), heads, HEAD, generator=g).to(dtype)
    meta = SimpleNamespace(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        block_table=block_table,
    )
    return batch, kv_cache, query, meta, ctx


def dense_reference(batch, kv_cache, query, meta, ctx, scale, softcap, isa) -> torch.Tensor:
    """[F, H, D] float32: each fix row over its request's logical K / V (decoded via the page layout)."""
    kmap, vmap = tree_attn_cpu.page_layout(isa, kv_cache.dtype, BLOCK, HEAD)
    pages = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1).float()
    heads, kv_heads = query.shape[1], kv_cache.shape[1]
    out = []
    for row, req, bits in zip(batch.fix_rows.tolist(), batch.fix_req.tolist(), batch.fix_bits.tolist()):
        length = int(meta.seq_lens[req])
        pos = torch.arange(length)
        blocks = meta.block_table[req].long()[pos // BLOCK]
        keys = pages[blocks.view(-1, 1), :, kmap[pos % BLOCK]].transpose(1, 2)  # [L, Hkv, D]
        values = pages[blocks.view(-1, 1), :, vmap[pos % BLOCK]].transpose(1, 2)
        visible = torch.tensor([p <= ctx[req] or (bits >> (p - ctx[req] - 1)) & 1 == 1 for p in range(length)])
        q = query[row].float().view(kv_heads, heads // kv_heads, HEAD)
        logits = torch.einsum("hgd,lhd->hgl", q, keys) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hgl,lhd->hgd", weights, values).reshape(heads, HEAD))
    return torch.stack(out)


def fix_rows_with(impl, batch, kv_cache, query, meta, isa, torch_path: bool) -> torch.Tensor:
    output = torch.full_like(query, float("nan"))
    layer = SimpleNamespace(isa=isa)
    if torch_path:
        impl._fix_tree_rows_torch(layer, batch, query, kv_cache, meta, output)
    else:
        impl._fix_tree_rows(layer, batch, query, kv_cache, meta, output)
    return output


CASES = [
    (4, 4, torch.float32, None),
    (4, 2, torch.float32, 2.0),
    (8, 2, torch.bfloat16, None),
    (2, 1, torch.float32, None),
]


@needs_ops
@pytest.mark.parametrize("isa", ["native", "baseline"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype", "softcap"), CASES, ids=[f"h{h}kv{k}-{d}-{c}" for h, k, d, c in CASES]
)
def test_compiled_fix_rows_match_the_torch_path_and_the_dense_reference(
    seed, heads, kv_heads, dtype, softcap, isa, monkeypatch
):
    build = "baseline" if isa == "baseline" else echo_kernel_build()
    if isa == "baseline":  # the build machines without AVX2 run (see the test below)
        monkeypatch.setenv("ECHO_TREE_BASELINE_ISA", "1")
    batch, kv_cache, query, meta, ctx = random_step(seed, heads, kv_heads, dtype)
    scale = 1 / math.sqrt(HEAD)
    impl = tree_attn_cpu.EchoTreeCPUAttentionImpl(
        heads, HEAD, scale, kv_heads, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
        logits_soft_cap=softcap,
    )  # fmt: skip
    isa = cpu_attn._get_attn_isa(dtype, BLOCK, HEAD, "auto")
    before = cpu_isa_calls()
    compiled = fix_rows_with(impl, batch, kv_cache, query, meta, isa, torch_path=False)
    if before is not None:  # which build ran: the outputs agree, so only the op's call counters tell
        after = cpu_isa_calls()["tree_fix_attention"]
        ran = {b: after[b] - before["tree_fix_attention"][b] for b in after}
        assert ran[build] >= 1 and sum(ran.values()) == ran[build], ran
    reference = fix_rows_with(impl, batch, kv_cache, query, meta, isa, torch_path=True)
    rows = batch.fix_rows
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.isnan(compiled[others]).all(), "the kernel wrote rows that are not fix-up rows"
    dense = dense_reference(batch, kv_cache, query, meta, ctx, scale, softcap, isa)
    # float32: both are float32 sums in different orders; bf16: each rounds its float32 result once (half an ulp
    # from the dense value, so at most one ulp, 2^-7 relative, from each other).
    rel, floor = (1e-5, 1e-5) if dtype == torch.float32 else (2.0**-7, 1e-3)
    bound = rel * dense.abs() + floor
    assert ((compiled[rows].float() - reference[rows].float()).abs() <= bound).all()
    assert ((compiled[rows].float() - dense).abs() <= bound).all()


@needs_ops
def test_compiled_op_refuses_a_block_table_too_short():
    batch, kv_cache, query, meta, _ = random_step(3, 4, 4, torch.float32)
    kmap, vmap = tree_attn_cpu.page_layout(
        cpu_attn._get_attn_isa(torch.float32, BLOCK, HEAD, "auto"), torch.float32, BLOCK, HEAD
    )
    short = meta.block_table[:, :1]
    with pytest.raises(ValueError, match="block table holds"):
        tree_ops.tree_fix_attention(
            query, kv_cache, kmap, vmap, short, batch.context_len, batch.fix_rows, batch.fix_req, batch.fix_bits,
            0.125, None, torch.empty_like(query),
        )  # fmt: skip


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_compaction_is_bit_identical_to_the_torch_path(dtype):
    g = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(6, 2, BLOCK, 2 * HEAD, generator=g).to(dtype)
    isa = cpu_attn._get_attn_isa(dtype, BLOCK, HEAD, "auto")
    kmap, vmap = tree_attn_cpu.page_layout(isa, dtype, BLOCK, HEAD)
    src = torch.tensor([5, 40, 41, 70, 100, 3])
    dst = torch.tensor([3, 5, 39, 69, 150, 2])  # chains of moves: 3 -> 2 reads 3 before 5 -> 3 writes it
    expected = kv_cache.clone()
    tree_attn_cpu.echo_compact_torch(expected, src, dst, kmap, vmap)
    tree_ops.tree_kv_compact(kv_cache, kmap, vmap, src, dst)
    assert torch.equal(kv_cache, expected)
    assert not torch.equal(expected, kv_cache.new_zeros(kv_cache.shape))


def test_without_the_extension_the_torch_path_runs(monkeypatch):
    """The fallback: an extension that predates the tree ops (or none) must still verify trees exactly."""
    batch, kv_cache, query, meta, ctx = random_step(4, 4, 2, torch.float32)
    monkeypatch.setattr(tree_ops, "_DEFINED", False)
    assert not tree_ops.compiled_tree_ops(torch.device("cpu"))

    def refuse(*args, **kwargs):
        raise AssertionError("the compiled op ran without the extension")

    monkeypatch.setattr(tree_ops, "tree_fix_attention", refuse)
    monkeypatch.setattr(tree_ops, "tree_kv_compact", refuse)
    scale = 1 / math.sqrt(HEAD)
    impl = tree_attn_cpu.EchoTreeCPUAttentionImpl(
        4, HEAD, scale, 2, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto"
    )
    isa = cpu_attn._get_attn_isa(torch.float32, BLOCK, HEAD, "auto")
    out = fix_rows_with(impl, batch, kv_cache, query, meta, isa, torch_path=False)
    dense = dense_reference(batch, kv_cache, query, meta, ctx, scale, None, isa)
    assert (out[batch.fix_rows] - dense).abs().max() < 1e-5
    before = kv_cache.clone()
    tree_attn_cpu.echo_compact(kv_cache, torch.tensor([40]), torch.tensor([3]), isa=isa)
    assert not torch.equal(before, kv_cache)


def layout_maps(kind: str, block: int, head: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(kmap, vmap) of a page [2 x block x head]: "transposed" = vLLM's x86 layout (K as [D, bs], then V as
    [bs, D]: the kernel's fast path); "shuffled" = a random permutation of the page (the generic path)."""
    if kind == "transposed":
        t, d = torch.arange(block).view(-1, 1), torch.arange(head).view(1, -1)
        return (d * block + t).contiguous(), (block * head + t * head + d).contiguous()
    perm = torch.randperm(2 * block * head, generator=torch.Generator().manual_seed(seed))
    return perm[: block * head].view(block, head).clone(), perm[block * head :].view(block, head).clone()


def dense_with_maps(batch, kv_cache, query, meta, ctx, scale, kmap, vmap) -> torch.Tensor:
    """`dense_reference` for explicit page maps and any head size."""
    block, head = kmap.shape
    pages = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1).float()
    heads, kv_heads = query.shape[1], kv_cache.shape[1]
    out = []
    for row, req, bits in zip(batch.fix_rows.tolist(), batch.fix_req.tolist(), batch.fix_bits.tolist()):
        length = int(meta.seq_lens[req])
        pos = torch.arange(length)
        blocks = meta.block_table[req].long()[pos // block]
        keys = pages[blocks.view(-1, 1), :, kmap[pos % block]].transpose(1, 2)
        values = pages[blocks.view(-1, 1), :, vmap[pos % block]].transpose(1, 2)
        visible = torch.tensor([p <= ctx[req] or (bits >> (p - ctx[req] - 1)) & 1 == 1 for p in range(length)])
        q = query[row].float().view(kv_heads, heads // kv_heads, head)
        weights = (torch.einsum("hgd,lhd->hgl", q, keys) * scale).masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hgl,lhd->hgd", weights, values).reshape(heads, head))
    return torch.stack(out)


@needs_ops
@pytest.mark.parametrize("isa", ["native", "baseline"])
@pytest.mark.parametrize("kind", ["transposed", "shuffled"])
@pytest.mark.parametrize(
    ("head", "dtype"), [(40, torch.float32), (64, torch.bfloat16), (24, torch.float32), (96, torch.float32)]
)
def test_both_kernel_paths_match_a_dense_reference_at_any_head_size(kind, head, dtype, isa, monkeypatch):
    """The fast path (vLLM's layout, found at run time) and the generic one (any other page layout) give the same
    rows as a dense masked attention; head sizes that are not a multiple of the fast path's chunks (16 floats in
    the baseline build, 32 in the AVX2 one) too. isa "baseline" forces the build that machines without AVX2 run
    (ECHO_TREE_BASELINE_ISA=1); "native" is the AVX2 build where the CPU has it."""
    if isa == "baseline":
        monkeypatch.setenv("ECHO_TREE_BASELINE_ISA", "1")
    heads, kv_heads = 4, 2
    batch, kv_cache, query, meta, ctx = random_step(7, heads, kv_heads, dtype)
    g = torch.Generator().manual_seed(11)
    kv_cache = (torch.randn(kv_cache.shape[0], kv_heads, BLOCK, 2 * head, generator=g) * 3).to(dtype)
    query = torch.randn(query.shape[0], heads, head, generator=g).to(dtype)
    kmap, vmap = layout_maps(kind, BLOCK, head)
    scale = 1 / math.sqrt(head)
    output = torch.full_like(query, float("nan"))
    tree_ops.tree_fix_attention(
        query, kv_cache, kmap, vmap, meta.block_table, batch.context_len, batch.fix_rows, batch.fix_req,
        batch.fix_bits, scale, None, output,
    )  # fmt: skip
    dense = dense_with_maps(batch, kv_cache, query, meta, ctx, scale, kmap, vmap)
    rel, floor = (1e-5, 1e-5) if dtype == torch.float32 else (2.0**-7, 1e-3)
    assert ((output[batch.fix_rows].float() - dense).abs() <= rel * dense.abs() + floor).all()
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[batch.fix_rows] = False
    assert torch.isnan(output[others]).all()
