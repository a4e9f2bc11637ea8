"""The CUDA (FlashAttention) tree attention backend: its vLLM side (impl, registration, CUDA-graph guard, vLLM's
merge op). The split recompute's torch parts are tested without vLLM in tests/test_tree_attn_split.py, over the
synthetic step of tests/tree_attn_fixture.py. `gpu` tests run the real EchoTreeFlashAttentionImpl.forward (vLLM's
FA kernel) on CUDA against the dense masked reference.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.needs_vllm

import torch  # noqa: E402
from tree_attn_fixture import (  # noqa: E402
    BLOCK,
    HEAD,
    HEADS,
    KV_HEADS,
    REQS,
    SCALE,
    Step,
    dense_reference,
    make_step,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from echo_vllm.vllm import tree_attn_cuda, tree_state  # noqa: E402
from echo_vllm.vllm.tree_attn_cuda import (  # noqa: E402
    EchoTreeFlashAttentionBackend,
    EchoTreeFlashAttentionImpl,
    fa_kv_views,
    fix_row_groups,
    merge_by_lse,
    merge_vllm,
    prefix_attention_reference,
    suffix_attention,
    suffix_kv,
    suffix_mask,
)


def test_module_imports_on_cpu():
    assert tree_attn_cuda.BACKEND_PATH.endswith("EchoTreeFlashAttentionBackend")
    assert EchoTreeFlashAttentionBackend.get_impl_cls() is EchoTreeFlashAttentionImpl
    assert EchoTreeFlashAttentionBackend.get_name() == "FLASH_ATTN"


def test_merge_vllm_agrees_with_the_torch_merge():
    """vLLM's own merge op (its torch fallback on CPU) equals `merge_by_lse`, the reference the split tests use."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((5, HEADS, HEAD), generator=gen)
    k = torch.randn((5, 11, KV_HEADS, HEAD), generator=gen)
    v = torch.randn((5, 11, KV_HEADS, HEAD), generator=gen)
    mask = torch.rand((5, 11), generator=gen) < 0.7
    mask[:, 0] = True
    mask[1, 7:] = False  # an empty suffix part
    out_a, lse_a = suffix_attention(q, k[:, :7], v[:, :7], mask[:, :7], SCALE)
    out_b, lse_b = suffix_attention(q, k[:, 7:], v[:, 7:], mask[:, 7:], SCALE)
    merged, _ = merge_by_lse(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(merge_vllm(out_a, lse_a, out_b, lse_b), merged, atol=1e-6, rtol=1e-6)


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


def _torch_suffix_merge(output, query, key, value, out_a, lse_a, batch, scale, softcap):
    """`tree_attn_triton.tree_suffix_merge`'s contract in torch (its specification), for the CPU wiring test."""
    rows = batch.fix_rows.long()
    k, v = suffix_kv(key, value, batch)
    out_b, lse_b = suffix_attention(query[rows], k, v, suffix_mask(batch), scale, softcap)
    output.index_copy_(0, rows, merge_by_lse(out_a, lse_a, out_b, lse_b)[0].to(output.dtype))


def test_impl_fused_branch_wiring(monkeypatch):
    """The CUDA branch of `_fix_tree_rows` (per-step fix-row groups, the FA prefix over the fix rows' queries, one
    suffix + merge call writing into the output) on CPU tensors, with the kernel's torch specification standing in
    for Triton: the same rows as the dense reference, the groups computed once per step."""
    step = make_step()
    impl = EchoTreeFlashAttentionImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "auto")
    calls = {"prefix": 0, "fused": 0}

    def prefix(q, kc, vc, table, cu, used, scale, softcap, *, max_seqlen_q, max_seqlen_k):
        calls["prefix"] += 1
        assert q.shape[0] == step.batch.num_fix_rows and table.shape[0] == len(REQS)
        return prefix_attention_reference(q, kc, vc, table, cu, used, scale, softcap)

    def fused(*args):
        calls["fused"] += 1
        _torch_suffix_merge(*args)

    monkeypatch.setattr(impl, "_prefix_fa", prefix)
    monkeypatch.setattr(tree_attn_cuda, "fused_suffix_merge_for", lambda device: fused)
    output = torch.full((step.query.shape[0], HEADS * HEAD), 7.0)
    for _ in range(2):  # two layers of one step
        impl._fix_tree_rows(step.batch, step.query, step.key, step.value, step.kv_cache, _meta(step), output)
    assert calls == {"prefix": 2, "fused": 2}
    assert list(step.batch.layer_plans) == ["fa_fix_rows"]  # computed by the first layer, shared by the second
    got = output.view(-1, HEADS, HEAD)
    torch.testing.assert_close(got[step.batch.fix_rows], dense_reference(step), atol=1e-5, rtol=1e-5)
    others = torch.ones(output.shape[0], dtype=torch.bool)
    others[step.batch.fix_rows] = False
    assert (got[others] == 7.0).all()
    # A KV-sharing layer (no key / value rows) takes the torch path, which reads the drafts from the paged cache.
    shared = torch.full_like(output, 7.0)
    impl._fix_tree_rows(step.batch, step.query, None, None, step.kv_cache, _meta(step), shared)
    assert calls == {"prefix": 3, "fused": 2}
    torch.testing.assert_close(shared, output, atol=1e-5, rtol=1e-5)


def test_no_fused_kernel_off_cuda():
    assert tree_attn_cuda.fused_suffix_merge_for(torch.device("cpu")) is None


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
