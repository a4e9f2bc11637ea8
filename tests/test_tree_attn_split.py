"""The tree fix rows' split recompute (echo_vllm.vllm.tree_attn_split, no vLLM needed) against a dense masked
reference: the composition the CUDA FlashAttention forward runs (`tree_fix_rows`: prefix over context + root,
masked suffix over the step's drafts, LSE merge), with `prefix_attention_reference` in place of the FA kernel, over
the synthetic step of tests/tree_attn_fixture.py. `gpu` tests run the same composition and KV compaction on CUDA
(scripts/device_trees.py runs them on a GPU machine without vLLM).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tree_attn_fixture import BLOCK, HEAD, HEADS, KV_HEADS, NUM_BLOCKS, SCALE, dense_reference, make_step

from echo_vllm.vllm import tree_attn_split, tree_state
from echo_vllm.vllm.tree_attn_split import (
    echo_compact_cuda,
    fa_kv_views,
    fix_row_groups,
    merge_by_lse,
    prefix_attention_reference,
    suffix_attention,
    suffix_kv,
    suffix_kv_paged,
    suffix_mask,
    tree_fix_rows,
)


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
    rows, real = tree_attn_split._suffix_rows(batch)
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
    # Both parts empty gives 0.
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_recompute_on_cuda_matches_dense_reference(dtype):
    """The whole composition on CUDA tensors (the torch prefix reference standing in for the FA kernel), from the
    step's rows and from the paged cache, against the float32 dense reference computed on the CPU."""
    step = make_step(dtype=dtype, device="cuda", seed=3)
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    want = dense_reference(step)
    for key, value in ((step.key, step.value), (None, None)):
        got = tree_fix_rows(step.query, key, value, key_cache, value_cache, step.block_table, step.batch, SCALE)
        assert got.device.type == "cuda" and got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), want, **tol)


@pytest.mark.gpu
def test_split_recompute_suffix_and_merge_make_no_host_sync():
    """What runs per layer on CUDA besides vLLM's kernels (fix-row groups, suffix gather and mask, masked suffix
    attention, LSE merge) never waits for the device: torch's sync debug mode raises on any host sync."""
    step = make_step(dtype=torch.bfloat16, device="cuda", seed=4)
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    groups = fix_row_groups(step.batch)
    q = step.query[step.batch.fix_rows.long()]
    prefix = prefix_attention_reference(
        q, key_cache, value_cache, step.block_table, groups.cu_seqlens_q, groups.seqused_k, SCALE
    )  # computed before: the reference prefix syncs (the FA kernel it stands for does not)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = tree_fix_rows(
            step.query, step.key, step.value, key_cache, value_cache, step.block_table, step.batch, SCALE,
            prefix_fn=lambda *args: prefix,
        )  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.testing.assert_close(got.cpu(), dense_reference(step), atol=2e-2, rtol=2e-2)
