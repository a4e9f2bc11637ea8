"""The CPU tree attention backend against a dense masked reference, on vLLM's real kernel, cache layout and builder.

No engine starts: one attention impl, a paged KV cache in CPU_ATTN's layout with a shuffled block table, and a
three-request step (a branching tree across a block boundary, a chain, a chunked prefill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from echo_vllm.vllm.cpu_isa import apply_emulation, load_vllm_cpu_kernels

# ECHO_VLLM_EMULATE_CPU_ISA=avx2 runs this file on the build (and page layout) an AVX2-only CPU gets.
apply_emulation()
pytest.importorskip("vllm")
pytestmark = pytest.mark.needs_vllm

import torch  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from echo_vllm.vllm import tree_attn_cpu, tree_state  # noqa: E402
from echo_vllm.vllm.tree_attn_cpu import (  # noqa: E402
    EchoTreeCPUAttentionBackend,
    EchoTreeCPUAttentionImpl,
    echo_compact,
)

load_vllm_cpu_kernels()

HEADS, KV_HEADS, HEAD = 4, 2, 64
BLOCK = 32  # CPUAttentionBackend.get_supported_kernel_block_sizes: MultipleOf(32)
NUM_BLOCKS = 9
DTYPE = torch.float32
SCALE = 1 / math.sqrt(HEAD)

# Request 0: a spine of 4, then the other nodes depth-major; ctx 26 + root + 10 drafts = 37 tokens (two blocks).
TREE_PARENTS = (-1, 0, 1, 2, -1, 0, 4, 1, 5, 6)
CHAIN_DRAFTS = 3


@dataclass
class Req:
    ctx: int  # tokens already in the cache
    new: int  # tokens of this step (root + drafts, or the prefill chunk)
    parents: tuple[int, ...] | None  # the drafts' parents (None: a prefill chunk, causal)


# Request 3: a second tree with fewer fix rows and a longer context (the fix-up pads requests to one batch).
SECOND_TREE = (-1, 0, -1, 1, 0)
REQS = [
    Req(26, 1 + len(TREE_PARENTS), TREE_PARENTS),
    Req(40, 1 + CHAIN_DRAFTS, tuple(range(-1, 2))),
    Req(3, 7, None),
    Req(70, 1 + len(SECOND_TREE), SECOND_TREE),
]


def causal_is_exact(parents: tuple[int, ...], j: int) -> bool:
    """Draft j's ancestors are exactly the drafts before it."""
    return all(parents[i] == i - 1 for i in range(j + 1))


@pytest.fixture(autouse=True)
def _no_engine_config(monkeypatch):
    # The impl asks the current vLLM config for the model dtype only (zentorch's encoder path); no engine here.
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=DTYPE))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: config)
    yield
    tree_state.clear()


@pytest.fixture(params=["compiled", "torch"])
def tree_path(request, monkeypatch):
    """Both implementations of the fix-up rows and the compaction: the C++ ops and their torch reference."""
    from echo_vllm.ops import tree as tree_ops

    if request.param == "compiled":
        if not tree_ops.compiled_tree_ops(torch.device("cpu")):
            pytest.skip("echo_vllm._C without the tree ops (rebuild it: make install)")
    else:
        monkeypatch.setenv(tree_ops.TORCH_PATH_ENV, "1")
    return request.param


def make_impl(**kw) -> EchoTreeCPUAttentionImpl:
    args = dict(alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    args.update(kw)
    return EchoTreeCPUAttentionImpl(HEADS, HEAD, SCALE, KV_HEADS, **args)


def make_builder(dtype: torch.dtype = DTYPE) -> cpu_attn.CPUAttentionMetadataBuilder:
    """The real builder with the attributes its __init__ derives from a model config (none here): build() runs
    as in the engine."""
    builder = object.__new__(cpu_attn.CPUAttentionMetadataBuilder)
    builder.num_kv_heads, builder.num_heads, builder.head_dim = KV_HEADS, HEADS, HEAD
    builder.dtype, builder.window_size, builder.block_size = dtype, -1, BLOCK
    builder.kv_cache_dtype = "auto"
    builder.isa = cpu_attn._get_attn_isa(dtype, BLOCK, HEAD, "auto")
    builder.is_cross_attention = builder.is_encoder_only_attention = False
    return builder


def ancestors_or_self(parents: tuple[int, ...], j: int) -> set[int]:
    seen = set()
    while j >= 0:
        seen.add(j)
        j = parents[j]
    return seen


@dataclass
class Step:
    impl: EchoTreeCPUAttentionImpl
    layer: SimpleNamespace
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    meta: cpu_attn.CPUAttentionMetadata
    reference: torch.Tensor  # [T, H, D] dense masked float32 attention
    tree_rows: list[int]  # request 0's draft rows that are not on the spine


def make_step(softcap: float | None = None, seed: int = 0, dtype: torch.dtype = DTYPE) -> Step:
    g = torch.Generator().manual_seed(seed)
    impl = make_impl(logits_soft_cap=softcap)
    builder = make_builder(dtype)
    layer = SimpleNamespace(isa=builder.isa, _k_scale_float=1.0, _v_scale_float=1.0)
    # The exact logical shape vLLM gives a CPU_ATTN layer: [blocks, Hkv, block, D + Dv] (LBHNC). Garbage in it, so
    # a read of a slot nobody wrote shows up.
    kv_cache = (torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD, generator=g) * 50).to(dtype)

    perm = torch.randperm(NUM_BLOCKS, generator=g)
    per_req = max(math.ceil((r.ctx + r.new) / BLOCK) for r in REQS)
    block_table = torch.zeros(len(REQS), per_req, dtype=torch.int32)
    used = 0
    for i, r in enumerate(REQS):
        n = math.ceil((r.ctx + r.new) / BLOCK)
        block_table[i, :n] = perm[used : used + n].int()
        used += n

    def slots(i: int, positions: range) -> torch.Tensor:
        pos = torch.tensor(list(positions), dtype=torch.long)
        return block_table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK

    # Earlier steps' KV, written the way vLLM writes it.
    full_k, full_v = [], []
    for i, r in enumerate(REQS):
        # Rounded to the cache dtype first, so the float32 reference sees exactly what the cache holds.
        k = torch.randn(r.ctx + r.new, KV_HEADS, HEAD, generator=g).to(dtype).float()
        v = torch.randn(r.ctx + r.new, KV_HEADS, HEAD, generator=g).to(dtype).float()
        full_k.append(k)
        full_v.append(v)
        if r.ctx:
            impl.do_kv_cache_update(layer, k[: r.ctx].to(dtype), v[: r.ctx].to(dtype), kv_cache, slots(i, range(r.ctx)))

    key = torch.cat([k[r.ctx :] for k, r in zip(full_k, REQS)]).to(dtype)
    value = torch.cat([v[r.ctx :] for v, r in zip(full_v, REQS)]).to(dtype)
    slot_mapping = torch.cat([slots(i, range(r.ctx, r.ctx + r.new)) for i, r in enumerate(REQS)])
    num_tokens = key.shape[0]
    query = torch.randn(num_tokens, HEADS, HEAD, generator=g).to(dtype)
    # The step's KV goes in before forward, as Attention.forward does (unified_kv_cache_update first).
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    starts = np.cumsum([0] + [r.new for r in REQS])
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    seq_lens = torch.tensor([r.ctx + r.new for r in REQS], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        num_reqs=len(REQS),
        num_actual_tokens=num_tokens,
        max_query_len=max(r.new for r in REQS),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
    )
    meta = builder.build(common_prefix_len=0, common_attn_metadata=common)

    # Dense reference over each request's whole logical sequence with the explicit mask.
    reference = torch.empty(num_tokens, HEADS, HEAD)
    tree_rows = []
    for i, r in enumerate(REQS):
        length = r.ctx + r.new
        mask = torch.zeros(r.new, length, dtype=torch.bool)
        for q in range(r.new):
            if r.parents is None or q == 0:
                mask[q, : r.ctx + q + 1] = True  # causal (prefill rows, the root)
            else:
                j = q - 1
                mask[q, : r.ctx + 1] = True  # context + root
                for a in ancestors_or_self(r.parents, j):
                    mask[q, r.ctx + 1 + a] = True
                if not causal_is_exact(r.parents, j):
                    tree_rows.append(int(starts[i]) + q)
        q = query[starts[i] : starts[i + 1]].float().view(r.new, KV_HEADS, HEADS // KV_HEADS, HEAD)
        logits = torch.einsum("qhgd,lhd->qhgl", q, full_k[i]) * SCALE
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~mask.view(r.new, 1, 1, length), float("-inf"))
        out = torch.einsum("qhgl,lhd->qhgd", logits.softmax(-1), full_v[i])
        reference[starts[i] : starts[i + 1]] = out.reshape(r.new, HEADS, HEAD)
    return Step(impl, layer, query, key, value, kv_cache, meta, reference, tree_rows)


def publish_tree() -> tree_state.TreeBatch:
    plans = [tree_state.TreePlan(tuple(range(100, 100 + r.new - 1)), r.parents) if r.parents else None for r in REQS]
    scheduled = [list(p.tokens) if p else [] for p in plans]
    starts = np.cumsum([0] + [r.new for r in REQS])[:-1]
    batch = tree_state.build_tree_batch(
        plans, scheduled, np.array([r.ctx for r in REQS]), starts.astype(np.int64), "cpu"
    )
    assert batch is not None
    tree_state.publish(batch)
    return batch


def run(step: Step) -> torch.Tensor:
    output = torch.full_like(step.query, float("nan"))
    step.impl.forward(step.layer, step.query, step.key, step.value, step.kv_cache, step.meta, output)
    return output


@pytest.mark.parametrize(("softcap", "dtype"), [(None, torch.float32), (2.0, torch.float32), (None, torch.bfloat16)])
def test_every_row_matches_the_dense_tree_reference(softcap, dtype, tree_path):
    step = make_step(softcap, dtype=dtype)
    batch = publish_tree()
    assert sorted(batch.fix_rows.tolist()) == step.tree_rows  # the non-spine nodes, and only them
    output = run(step)
    assert output.dtype == dtype
    # Relative to each row's magnitude (at least 1). float32: the C++ kernel may differ in the last bits. bf16:
    # ours is float32 rounded once (half an ulp, < 2^-8 relative); the kernel's own bf16 arithmetic on the other
    # rows gets a looser bound.
    magnitude = step.reference.abs().amax(dim=(1, 2)).clamp(min=1)
    err = (output.float() - step.reference).abs().amax(dim=(1, 2)) / magnitude
    fix_tol, kernel_tol = (1e-4, 1e-4) if dtype == torch.float32 else (4e-3, 3e-2)
    others = [r for r in range(err.shape[0]) if r not in step.tree_rows]
    assert err[step.tree_rows].max() < fix_tol, f"fix-up row errors {err[step.tree_rows].tolist()}"
    assert err[others].max() < kernel_tol, f"kernel row errors {err[others].tolist()}"


def test_without_the_tree_batch_the_leaf_rows_are_wrong():
    step = make_step()
    tree_state.clear()
    err = (run(step) - step.reference).abs().amax(dim=(1, 2))
    others = [r for r in range(err.shape[0]) if r not in step.tree_rows]
    assert err[others].max() < 1e-4  # the kernel is exact for prefills, chains and the spine
    assert (err[step.tree_rows] > 1e-2).all(), f"fix-up row errors {err[step.tree_rows].tolist()}"


def test_output_may_come_flat(tree_path):
    step = make_step(seed=1)
    publish_tree()
    flat = torch.zeros(step.query.shape[0], HEADS * HEAD)
    step.impl._fix_tree_rows(step.layer, tree_state.current(), step.query, step.kv_cache, step.meta, flat)
    rows = step.tree_rows
    assert (flat[rows].view(len(rows), HEADS, HEAD) - step.reference[rows]).abs().max() < 1e-4


@pytest.mark.parametrize("via", ["module", "impl"])
def test_echo_compact_moves_k_and_v_per_slot(via, tree_path):
    """Compacting a cache gives, bit for bit, the cache the kernel's own writer makes with each destination
    holding its source's K and V: no knowledge of the ISA's page layout in the check."""
    g = torch.Generator().manual_seed(3)
    impl = make_impl()
    layer = SimpleNamespace(
        isa=cpu_attn._get_attn_isa(DTYPE, BLOCK, HEAD, "auto"), _k_scale_float=1.0, _v_scale_float=1.0
    )
    num_blocks = 4
    slots = torch.randperm(num_blocks * BLOCK, generator=g)
    keys = torch.randn(slots.numel(), KV_HEADS, HEAD, generator=g)
    values = torch.randn(slots.numel(), KV_HEADS, HEAD, generator=g)
    kv_cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD)
    impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)

    src = torch.tensor([5, 40, 41, 70])
    dst = torch.tensor([3, 5, 39, 69])  # slot 5 is a source and a destination; 39/40 straddle a block
    row_of = torch.empty_like(slots)
    row_of[slots] = torch.arange(slots.numel())
    moved_k, moved_v = keys.clone(), values.clone()
    moved_k[row_of[dst]] = keys[row_of[src]]
    moved_v[row_of[dst]] = values[row_of[src]]
    expected = torch.zeros_like(kv_cache)
    impl.do_kv_cache_update(layer, moved_k, moved_v, expected, slots)

    if via == "module":
        echo_compact(kv_cache, src, dst, isa=layer.isa)
    else:
        impl.echo_compact(kv_cache, src, dst)
    assert torch.equal(kv_cache, expected)


def test_page_layout_is_a_permutation_of_k_then_v():
    isa = cpu_attn._get_attn_isa(DTYPE, BLOCK, HEAD, "auto")
    kmap, vmap = tree_attn_cpu.page_layout(isa, DTYPE, BLOCK, HEAD)
    every = torch.cat([kmap.flatten(), vmap.flatten()]).sort().values
    assert torch.equal(every, torch.arange(2 * BLOCK * HEAD))
    assert kmap.max() < BLOCK * HEAD <= vmap.min()  # K in the page's first half, V in the second


def test_register_and_restore_the_backend():
    from vllm.v1.attention.selector import _cached_get_attn_backend

    stock = AttentionBackendEnum.CPU_ATTN.get_class()
    assert stock is cpu_attn.CPUAttentionBackend
    try:
        path = tree_attn_cpu.register_cpu_tree_backend()
        assert tree_attn_cpu.register_cpu_tree_backend() == path  # idempotent
        assert AttentionBackendEnum.CPU_ATTN.get_class() is EchoTreeCPUAttentionBackend
        assert _cached_get_attn_backend.cache_info().currsize == 0
        assert EchoTreeCPUAttentionBackend.get_name() == "CPU_ATTN"
        assert EchoTreeCPUAttentionBackend.get_impl_cls() is EchoTreeCPUAttentionImpl
        assert issubclass(EchoTreeCPUAttentionBackend, cpu_attn.CPUAttentionBackend)
    finally:
        tree_attn_cpu.unregister_cpu_tree_backend()
    assert AttentionBackendEnum.CPU_ATTN.get_class() is cpu_attn.CPUAttentionBackend
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        (dict(sliding_window=8), "sliding window"),
        (dict(alibi_slopes=[0.5] * HEADS), "ALiBi"),
        (dict(kv_cache_dtype="fp8"), "quantized KV cache"),
        (dict(attn_type="encoder_only"), "attention type"),
        (dict(sinks=torch.zeros(HEADS)), "sinks"),
    ],
)
def test_a_tree_batch_refuses_unsupported_layers(kw, reason):
    step = make_step()
    impl = make_impl(**kw)
    publish_tree()
    output = torch.zeros_like(step.query)
    with pytest.raises(ValueError, match=reason):
        impl.forward(step.layer, step.query, step.key, step.value, step.kv_cache, step.meta, output)


def test_restoring_keeps_an_earlier_override():
    from vllm.v1.attention.backends.registry import register_backend

    member = AttentionBackendEnum.CPU_ATTN
    foreign = "somewhere.else.TheirCPUBackend"
    register_backend(member, foreign)
    try:
        tree_attn_cpu.register_cpu_tree_backend()
        assert member.get_path() == tree_attn_cpu.BACKEND_PATH
        tree_attn_cpu.unregister_cpu_tree_backend()
        assert member.get_path() == foreign
        tree_attn_cpu.unregister_cpu_tree_backend()  # not ours any more: a no-op
        assert member.get_path() == foreign
    finally:
        member.clear_override()
