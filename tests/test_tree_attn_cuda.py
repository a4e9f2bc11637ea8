"""The CUDA (FlashAttention) tree attention backend's split recompute against a dense masked reference.

CPU tests run the very composition the CUDA forward uses (`tree_fix_rows`: prefix over context + root, masked
suffix over the step's drafts, LSE merge) with `prefix_attention_reference` in place of the FA kernel, over a
synthetic FlashAttention-layout paged cache with a shuffled block table and four requests: a branching tree across
a block boundary, a chain, a request with no drafts, and a second tree. `gpu` tests run the real
EchoTreeFlashAttentionImpl.forward (vLLM's FA kernel) on CUDA.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.needs_vllm

import torch  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from echo_vllm.vllm import tree_attn_cuda, tree_state  # noqa: E402
from echo_vllm.vllm.tree_attn_cuda import (  # noqa: E402
    EchoTreeFlashAttentionBackend,
    EchoTreeFlashAttentionImpl,
    echo_compact_cuda,
    fa_kv_views,
    fix_row_groups,
    merge_by_lse,
    merge_vllm,
    prefix_attention_reference,
    suffix_attention,
    suffix_kv,
    suffix_kv_paged,
    suffix_mask,
    tree_fix_rows,
)

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


def test_module_imports_on_cpu():
    assert tree_attn_cuda.BACKEND_PATH.endswith("EchoTreeFlashAttentionBackend")
    assert EchoTreeFlashAttentionBackend.get_impl_cls() is EchoTreeFlashAttentionImpl
    assert EchoTreeFlashAttentionBackend.get_name() == "FLASH_ATTN"


def test_fix_row_groups_and_suffix_mask_hand_example():
    # req 0: two siblings at the root (draft 1 is a fix row); req 1: no drafts; req 2: root -> 0 -> {1, 2}.
    plans = [tree_state.TreePlan((7, 8), (-1, -1)), None, tree_state.TreePlan((1, 2, 3), (-1, 0, 0))]
    batch = tree_state.build_tree_batch(plans, [[7, 8], [], [1, 2, 3]], np.array([5, 7, 3]), np.array([0, 3, 4]), "cpu")
    assert batch is not None
    assert batch.fix_rows.tolist() == [2, 7] and batch.fix_req.tolist() == [0, 2]
    assert batch.fix_bits.tolist() == [0b10, 0b101]
    groups = fix_row_groups(batch)
    assert groups.cu_seqlens_q.tolist() == [0, 1, 1, 2] and groups.cu_seqlens_q.dtype == torch.int32
    assert groups.seqused_k.tolist() == [6, 8, 4] and groups.seqused_k.dtype == torch.int32
    assert groups.counts.tolist() == [1, 0, 1]
    assert suffix_mask(batch).tolist() == [[False, True, False], [True, False, True]]
    rows, real = tree_attn_cuda._suffix_rows(batch)
    assert rows.tolist() == [[1, 2, 0], [5, 6, 7]] and real.tolist() == [[True, True, False], [True] * 3]


def test_fix_row_groups_refuses_ungrouped_rows():
    step = make_step()
    shuffled = dataclasses.replace(step.batch, fix_req=step.batch.fix_req.flip(0))
    with pytest.raises(ValueError, match="grouped"):
        fix_row_groups(shuffled)


def test_merge_by_lse_equals_softmax_over_the_concatenation():
    gen = torch.Generator().manual_seed(1)
    rows, n_a, n_b = 5, 7, 4
    q = torch.randn((rows, HEADS, HEAD), generator=gen)
    k = torch.randn((rows, n_a + n_b, KV_HEADS, HEAD), generator=gen)
    v = torch.randn((rows, n_a + n_b, KV_HEADS, HEAD), generator=gen)
    mask = torch.rand((rows, n_a + n_b), generator=gen) < 0.7
    mask[:, 0] = True
    mask[1, n_a:] = False  # an empty suffix part
    full, full_lse = suffix_attention(q, k, v, mask, SCALE)
    out_a, lse_a = suffix_attention(q, k[:, :n_a], v[:, :n_a], mask[:, :n_a], SCALE)
    out_b, lse_b = suffix_attention(q, k[:, n_a:], v[:, n_a:], mask[:, n_a:], SCALE)
    assert torch.isneginf(lse_b[:, 1]).all() and (out_b[1] == 0).all()
    merged, merged_lse = merge_by_lse(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, full_lse, atol=1e-5, rtol=1e-5)
    # The plain softmax over the visible keys, GQA expanded.
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    logits = torch.einsum("fhd,fnhd->fhn", q, kk) * SCALE
    probs = torch.softmax(logits.masked_fill(~mask.unsqueeze(1), float("-inf")), -1)
    torch.testing.assert_close(merged, torch.einsum("fhn,fnhd->fhd", probs, vv), atol=1e-5, rtol=1e-5)
    # vLLM's own op (its torch fallback on CPU) agrees; both parts empty gives 0.
    torch.testing.assert_close(merge_vllm(out_a, lse_a, out_b, lse_b), merged, atol=1e-6, rtol=1e-6)
    neg = torch.full_like(lse_a, float("-inf"))
    empty, empty_lse = merge_by_lse(out_a, neg, out_b, neg)
    assert (empty == 0).all() and torch.isneginf(empty_lse).all()


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_split_recompute_equals_dense_masked_reference(softcap):
    step = make_step()
    assert step.batch.fix_req.unique().tolist() == [0, 3]  # both trees have fix rows; chain and decode none
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    got = tree_fix_rows(
        step.query, step.key, step.value, key_cache, value_cache, step.block_table, step.batch, SCALE, softcap
    )
    torch.testing.assert_close(got, dense_reference(step, softcap), atol=1e-5, rtol=1e-5)
    # The drafts read from the paged cache instead of the step's rows (KV-sharing layers) give the same.
    paged = tree_fix_rows(step.query, None, None, key_cache, value_cache, step.block_table, step.batch, SCALE, softcap)
    torch.testing.assert_close(paged, got, atol=1e-6, rtol=1e-6)


def test_a_wrong_mask_fails_the_comparison():
    step = make_step()
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    own = torch.bitwise_left_shift(
        torch.ones_like(step.batch.fix_bits), step.batch.fix_rows - step.batch.root_row[step.batch.fix_req] - 1
    )
    wrong = dataclasses.replace(step.batch, fix_bits=own)  # every fix row sees only itself among the drafts
    got = tree_fix_rows(step.query, step.key, step.value, key_cache, value_cache, step.block_table, wrong, SCALE)
    reference = dense_reference(step)
    assert not torch.allclose(got, reference, atol=1e-3)
    # ... and it is exactly what the reference computes for that (wrong) visibility: the comparison is not vacuous.
    torch.testing.assert_close(got, dense_reference(step, drop_ancestors=True), atol=1e-5, rtol=1e-5)


def test_prefix_reference_matches_dense_context_attention():
    step = make_step()
    batch = step.batch
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    groups = fix_row_groups(batch)
    q = step.query[batch.fix_rows]
    out, lse = prefix_attention_reference(
        q, key_cache, value_cache, step.block_table, groups.cu_seqlens_q, groups.seqused_k, SCALE
    )
    for f in range(batch.num_fix_rows):
        b = int(batch.fix_req[f])
        ctx = int(batch.context_len[b])
        k = step.full_k[b][: ctx + 1].repeat_interleave(2, dim=1)
        v = step.full_v[b][: ctx + 1].repeat_interleave(2, dim=1)
        logits = torch.einsum("hd,lhd->hl", q[f], k) * SCALE
        torch.testing.assert_close(out[f], torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), v), atol=1e-5, rtol=0)
        torch.testing.assert_close(lse[:, f], torch.logsumexp(logits, -1), atol=1e-5, rtol=0)
    k_rows, v_rows = suffix_kv(step.key, step.value, batch)
    k_paged, v_paged = suffix_kv_paged(key_cache, value_cache, step.block_table, batch)
    real = suffix_mask(batch)
    assert torch.equal(k_rows[real], k_paged[real]) and torch.equal(v_rows[real], v_paged[real])


def test_legacy_five_dim_layout_views_the_same_tokens():
    step = make_step()
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    legacy = torch.stack([key_cache.contiguous(), value_cache.contiguous()])  # [2, nb, bs, Hkv, D]
    k5, v5 = fa_kv_views(legacy)
    assert torch.equal(k5, key_cache) and torch.equal(v5, value_cache)


@pytest.mark.parametrize("layout", ["fa4d", "legacy5d"])
def test_echo_compact_cuda_moves_k_and_v_per_slot(layout):
    step = make_step()
    cache = step.kv_cache.clone()
    if layout == "legacy5d":
        k, v = fa_kv_views(cache, HEAD)
        cache = torch.stack([k.contiguous(), v.contiguous()])
    before_k, before_v = (t.clone() for t in fa_kv_views(cache, HEAD))
    # Overlapping moves (a source that is also a destination), across blocks, as compaction makes them.
    src = torch.tensor([5, 17, 40, 3])
    dst = torch.tensor([3, 5, 18, 60])
    echo_compact_cuda(cache, src, dst)
    after_k, after_v = fa_kv_views(cache, HEAD)
    flat = lambda t: t.reshape(-1, KV_HEADS, HEAD)  # noqa: E731  (slot = block * bs + offset)
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(flat(after_k)[d], flat(before_k)[s]) and torch.equal(flat(after_v)[d], flat(before_v)[s])
    untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(flat(after_k)[untouched], flat(before_k)[untouched])
    assert torch.equal(flat(after_v)[untouched], flat(before_v)[untouched])
    with pytest.raises(ValueError, match="sources"):
        echo_compact_cuda(cache, src, dst[:2])


def _meta(step: Step) -> SimpleNamespace:
    return SimpleNamespace(
        query_start_loc=step.query_start_loc,
        max_query_len=int((step.query_start_loc[1:] - step.query_start_loc[:-1]).max()),
        max_seq_len=int(step.seq_lens.max()),
        block_table=step.block_table,
        causal=True,
        mm_prefix_query_range_tensor=None,
        rswa_prefix_lens=None,
    )


def test_impl_fix_rows_write_only_the_fix_rows(monkeypatch):
    """The impl's glue (cache views, metadata bounds, index_copy into [T, H*D] output, vLLM's merge op) with the
    reference in place of the FA kernel."""
    step = make_step()
    impl = EchoTreeFlashAttentionImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "auto")
    seen = {}

    def prefix(q, kc, vc, table, cu, used, scale, softcap, *, max_seqlen_q, max_seqlen_k):
        seen.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, rows=table.shape[0])
        return prefix_attention_reference(q, kc, vc, table, cu, used, scale, softcap)

    monkeypatch.setattr(impl, "_prefix_fa", prefix)
    output = torch.full((step.query.shape[0], HEADS * HEAD), 7.0)
    impl._fix_tree_rows(step.batch, step.query, step.key, step.value, step.kv_cache, _meta(step), output)
    assert seen == {"max_seqlen_q": 11, "max_seqlen_k": 39, "rows": len(REQS)}
    got = output.view(-1, HEADS, HEAD)
    torch.testing.assert_close(got[step.batch.fix_rows], dense_reference(step), atol=1e-5, rtol=1e-5)
    others = torch.ones(output.shape[0], dtype=torch.bool)
    others[step.batch.fix_rows] = False
    assert (got[others] == 7.0).all()
    short = _meta(step)
    short.query_start_loc = step.query_start_loc[:2]
    with pytest.raises(RuntimeError, match="not cleared"):
        impl._fix_tree_rows(step.batch, step.query, step.key, step.value, step.kv_cache, short, output)


def test_impl_refuses_unsupported_layers():
    impl = EchoTreeFlashAttentionImpl(HEADS, HEAD, SCALE, KV_HEADS, None, 8, "auto")
    with pytest.raises(ValueError, match="sliding window"):
        impl._check_tree_supported()
    impl = EchoTreeFlashAttentionImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "auto")
    impl._check_tree_supported(SimpleNamespace(causal=True))
    for attr, value, reason in [
        ("alibi_slopes", torch.ones(HEADS), "ALiBi"),
        ("sinks", torch.zeros(HEADS), "sinks"),
        ("kv_cache_dtype", "fp8", "quantized"),
    ]:
        other = EchoTreeFlashAttentionImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "auto")
        setattr(other, attr, value)
        with pytest.raises(ValueError, match=reason):
            other._check_tree_supported()
    with pytest.raises(ValueError, match="causal"):
        impl._check_tree_supported(SimpleNamespace(causal=torch.ones(1)))


def test_register_and_unregister_override_flash_attn():
    member = AttentionBackendEnum.FLASH_ATTN
    assert not member.is_overridden()
    try:
        assert tree_attn_cuda.register_cuda_tree_backend() == tree_attn_cuda.BACKEND_PATH
        tree_attn_cuda.register_cuda_tree_backend()  # idempotent
        assert member.get_class() is EchoTreeFlashAttentionBackend
    finally:
        tree_attn_cuda.unregister_cuda_tree_backend()
    assert not member.is_overridden()
    tree_attn_cuda.unregister_cuda_tree_backend()  # a no-op now
    # Someone else's override comes back.
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(member, "some.other.Backend")
    try:
        tree_attn_cuda.register_cuda_tree_backend()
        tree_attn_cuda.unregister_cuda_tree_backend()
        assert member.get_path() == "some.other.Backend"
    finally:
        member.clear_override()


def test_required_attention_backend():
    flash = AttentionBackendEnum.FLASH_ATTN
    assert tree_attn_cuda.required_attention_backend(None) is flash
    assert tree_attn_cuda.required_attention_backend("auto") is flash
    assert tree_attn_cuda.required_attention_backend("flash_attn") is flash
    with pytest.raises(ValueError, match="FLASHINFER"):
        tree_attn_cuda.required_attention_backend(AttentionBackendEnum.FLASHINFER)


def test_non_tree_layers():
    impl = EchoTreeFlashAttentionImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "auto")
    ctx = {
        "ok": SimpleNamespace(impl=impl, kv_cache=torch.zeros(1)),
        "stock": SimpleNamespace(impl=object(), kv_cache=torch.zeros(1)),
        "no_cache": SimpleNamespace(impl=object()),
    }
    assert tree_attn_cuda.non_tree_layers(ctx) == ["stock"]
    assert tree_attn_cuda.non_tree_layers(ctx, ["ok"]) == []


class _FakeDispatcher:
    def __init__(self):
        self.calls = []

    def dispatch(self, num_tokens, uniform_decode=False, valid_modes=None, invalid_modes=None):
        from vllm.config import CUDAGraphMode

        self.calls.append((valid_modes, invalid_modes))
        allowed = set(valid_modes or CUDAGraphMode.valid_runtime_modes()) - set(invalid_modes or ())
        mode = CUDAGraphMode.FULL if CUDAGraphMode.FULL in allowed else CUDAGraphMode.PIECEWISE
        return mode, num_tokens


class _FakeRunner:
    def __init__(self):
        self.cudagraph_dispatcher = _FakeDispatcher()

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, *args, force_eager=False, **kwargs):
        from vllm.config import CUDAGraphMode

        mode, desc = self.cudagraph_dispatcher.dispatch(
            num_tokens=num_tokens, valid_modes={CUDAGraphMode.NONE} if force_eager else None, invalid_modes=None
        )
        return mode, desc, False, None, None


def test_guard_keeps_tree_steps_off_full_cudagraphs():
    from vllm.config import CUDAGraphMode

    runner = _FakeRunner()
    guarded = tree_attn_cuda.guard_batch_execution(_FakeRunner._determine_batch_execution_and_padding)
    assert guarded.__name__ == "_determine_batch_execution_and_padding"
    assert guarded(runner, 8, 2)[0] == CUDAGraphMode.FULL  # no tree batch: stock
    tree_state.publish(make_step().batch)
    try:
        assert guarded(runner, 8, 2)[0] == CUDAGraphMode.PIECEWISE
        assert runner.cudagraph_dispatcher.calls[-1] == (None, {CUDAGraphMode.FULL})
    finally:
        tree_state.clear()
    assert "dispatch" not in vars(runner.cudagraph_dispatcher)  # the instance shadow is gone
    assert guarded(runner, 8, 2)[0] == CUDAGraphMode.FULL
    # The pure rule.
    assert tree_attn_cuda.tree_step_cudagraph_modes(False, None, None) == (None, None)
    assert tree_attn_cuda.tree_step_cudagraph_modes(True, None, {CUDAGraphMode.NONE}) == (
        None,
        {CUDAGraphMode.NONE, CUDAGraphMode.FULL},
    )
    with pytest.raises(RuntimeError, match="FULL"):
        tree_attn_cuda.tree_step_cudagraph_modes(True, {CUDAGraphMode.FULL}, None)


def test_guarded_hooks_match_the_installed_vllm():
    """The wrapped runner method and the dispatcher call it makes are what guard_batch_execution assumes."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    method = GPUModelRunner._determine_batch_execution_and_padding
    params = list(inspect.signature(method).parameters)
    assert params[:5] == ["self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens"]
    source = inspect.getsource(method)
    assert "self.cudagraph_dispatcher.dispatch(" in source and "invalid_modes=" in source
    dispatch = inspect.signature(CudagraphDispatcher.dispatch).parameters
    assert {"valid_modes", "invalid_modes", "num_tokens"} <= set(dispatch)


# --- on a GPU -------------------------------------------------------------------------------------------------


def _cuda_layer():
    one = torch.ones((), dtype=torch.float32, device="cuda")
    return SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)


@pytest.mark.gpu
def test_cuda_forward_matches_dense_reference():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    step = make_step(dtype=torch.bfloat16, device="cuda")
    impl = EchoTreeFlashAttentionImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "auto")
    qsl = step.query_start_loc
    total = step.query.shape[0]
    pos = torch.cat([torch.arange(c, c + 1 + len(p)) for c, p in REQS]).cuda()
    req_of = torch.repeat_interleave(torch.arange(len(REQS)), torch.tensor([1 + len(p) for _, p in REQS])).cuda()
    slots = step.block_table.long()[req_of, pos // BLOCK] * BLOCK + pos % BLOCK
    meta = FlashAttentionMetadata(
        num_actual_tokens=total,
        max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        query_start_loc=qsl,
        max_seq_len=int(step.seq_lens.max()),
        seq_lens=step.seq_lens,
        block_table=step.block_table,
        slot_mapping=slots,
    )
    output = torch.empty((total, HEADS, HEAD), dtype=torch.bfloat16, device="cuda")
    tree_state.publish(step.batch)
    try:
        impl.forward(_cuda_layer(), step.query, step.key, step.value, step.kv_cache, meta, output)
    finally:
        tree_state.clear()
    torch.cuda.synchronize()
    got = output[step.batch.fix_rows].float().cpu()
    torch.testing.assert_close(got, dense_reference(step), atol=2e-2, rtol=2e-2)
    # The stock kernel's causal rows (the roots) stay as FA computed them: compare one root per request.
    for b, (ctx, _) in enumerate(REQS):
        row = int(qsl[b])
        k = step.full_k[b][: ctx + 1].repeat_interleave(2, dim=1)
        v = step.full_v[b][: ctx + 1].repeat_interleave(2, dim=1)
        logits = torch.einsum("hd,lhd->hl", step.query[row].float().cpu(), k) * SCALE
        want = torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), v)
        torch.testing.assert_close(output[row].float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_cuda_split_parts_match_reference_on_gpu():
    """The FA prefix part alone (kernel vs reference), so a mismatch says which part is off."""
    step = make_step(dtype=torch.bfloat16, device="cuda")
    impl = EchoTreeFlashAttentionImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "auto")
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    groups = fix_row_groups(step.batch)
    q = step.query[step.batch.fix_rows]
    args = (q, key_cache, value_cache, step.block_table, groups.cu_seqlens_q, groups.seqused_k, SCALE, 0.0)
    out, lse = impl._prefix_fa(*args, max_seqlen_q=11, max_seqlen_k=int(step.seq_lens.max()))
    ref_out, ref_lse = prefix_attention_reference(*args)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.float(), ref_lse, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_echo_compact_cuda_on_cuda():
    cache = torch.randn((NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD), device="cuda", dtype=torch.bfloat16)
    before = cache.clone()
    src = torch.tensor([5, 17, 40], device="cuda")
    dst = torch.tensor([3, 5, 18], device="cuda")
    echo_compact_cuda(cache, src, dst)
    flat = lambda t: t.transpose(1, 2).reshape(-1, KV_HEADS, 2 * HEAD)  # noqa: E731
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(flat(cache)[d], flat(before)[s])
