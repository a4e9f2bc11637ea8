"""The Triton suffix+merge kernel of the CUDA tree fix-up against its specification (`tree_attn_split`: the masked
`suffix_attention` merged by `merge_by_lse` with the prefix part), over the synthetic step of
tests/tree_attn_fixture.py.

Runs on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1 with triton importable). The
CPU test venv has no Triton (it breaks `import vllm` next to the CPU torch: scripts/postinstall_cpu.py), so in CI
these tests skip; scripts/device_check.sh runs them on a GPU machine.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from tree_attn_fixture import HEAD, SCALE, dense_reference, make_step

from echo_vllm.vllm.tree_attn_split import fa_kv_views, fix_row_groups, prefix_attention_reference, tree_fix_rows

pytest.importorskip("triton")
if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1", allow_module_level=True)

from echo_vllm.vllm.tree_attn_triton import tree_fix_rows_fused, tree_suffix_merge


def _prefix(step, batch=None):
    batch = batch or step.batch
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    groups = fix_row_groups(batch)
    q = step.query[batch.fix_rows.long()]
    return prefix_attention_reference(
        q, key_cache, value_cache, step.block_table, groups.cu_seqlens_q, groups.seqused_k, SCALE
    )


def _fused(step, out_a, lse_a, batch=None, softcap=0.0):
    batch = batch or step.batch
    output = torch.full_like(step.query, 7.0)  # every row not fixed must stay as the stock kernel left it
    tree_suffix_merge(output, step.query, step.key, step.value, out_a, lse_a, batch, SCALE, softcap)
    return output


def _assert_fix_rows(step, output, spec, dtype, softcap):
    """The fix rows equal the torch specification (and, without softcap, the dense reference); every other row
    keeps the 7.0 it was poisoned with."""
    rows = step.batch.fix_rows.long()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(output[rows].float(), spec.to(dtype).float(), **tol)
    others = torch.ones(step.query.shape[0], dtype=torch.bool, device=DEVICE)
    others[rows] = False
    assert (output[others] == 7.0).all()
    if not softcap:
        loose = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
        torch.testing.assert_close(output[rows].float().cpu(), dense_reference(step), **loose)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_kernel_equals_the_split_specification(dtype, softcap):
    step = make_step(dtype=dtype, device=DEVICE, seed=5)
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    out_a, lse_a = _prefix(step)
    if softcap:  # the prefix part with the same softcap, as FA computes it
        groups = fix_row_groups(step.batch)
        q = step.query[step.batch.fix_rows.long()]
        out_a, lse_a = prefix_attention_reference(
            q, key_cache, value_cache, step.block_table, groups.cu_seqlens_q, groups.seqused_k, SCALE, softcap
        )
    out_a = out_a.to(dtype)  # FA returns the query dtype and a float32 LSE
    output = _fused(step, out_a, lse_a, softcap=softcap)
    spec = tree_fix_rows(
        step.query, step.key, step.value, key_cache, value_cache, step.block_table, step.batch, SCALE, softcap,
        prefix_fn=lambda *args: (out_a, lse_a),
    )  # fmt: skip
    _assert_fix_rows(step, output, spec, dtype, softcap)


def test_a_wrong_mask_changes_the_result():
    step = make_step(device=DEVICE, seed=6)
    out_a, lse_a = _prefix(step)
    good = _fused(step, out_a, lse_a)
    own = torch.bitwise_left_shift(
        torch.ones_like(step.batch.fix_bits), step.batch.fix_rows - step.batch.root_row[step.batch.fix_req] - 1
    )
    wrong = dataclasses.replace(step.batch, fix_bits=own)
    bad = _fused(step, out_a, lse_a, batch=wrong)
    rows = step.batch.fix_rows.long()
    assert not torch.allclose(good[rows], bad[rows], atol=1e-3)
    torch.testing.assert_close(bad[rows].cpu(), dense_reference(step, drop_ancestors=True), atol=1e-4, rtol=1e-4)


def test_merge_conventions_empty_prefix_and_positive_infinity():
    """An empty prefix part (lse -inf, or +inf as FA may report it) leaves the suffix alone."""
    step = make_step(device=DEVICE, seed=7)
    out_a, lse_a = _prefix(step)
    rows = step.batch.fix_rows.long()
    spec_neg = tree_fix_rows(
        step.query, step.key, step.value, *fa_kv_views(step.kv_cache, HEAD), step.block_table, step.batch, SCALE,
        prefix_fn=lambda *args: (torch.zeros_like(out_a), torch.full_like(lse_a, float("-inf"))),
    )  # fmt: skip
    for fill in (float("-inf"), float("inf")):
        got = _fused(step, torch.zeros_like(out_a), torch.full_like(lse_a, fill))
        torch.testing.assert_close(got[rows], spec_neg, atol=1e-5, rtol=1e-5)


def test_suffix_kernel_padded_grid():
    """Only the first num_fix rows are written: the rest of a graph's padded buffers is left alone."""
    step = make_step(device=DEVICE, seed=11)
    out_a, lse_a = _prefix(step)
    rows = step.batch.fix_rows.long()
    full = _fused(step, out_a, lse_a)
    output = torch.full_like(step.query, 7.0)
    real = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    tree_suffix_merge(output, step.query, step.key, step.value, out_a, lse_a, step.batch, SCALE, num_fix=real)
    torch.testing.assert_close(output[rows[:4]], full[rows[:4]], atol=0, rtol=0)
    assert (output[rows[4:]] == 7.0).all()


def test_refuses_mismatched_prefix_parts():
    step = make_step(device=DEVICE, seed=8)
    out_a, lse_a = _prefix(step)
    with pytest.raises(ValueError, match="prefix parts"):
        _fused(step, out_a[:-1], lse_a[:, :-1])


# --- the whole fix row in one kernel ---------------------------------------------------------------------------


def _whole(step, batch=None, softcap=0.0, num_fix=None, block_k=16):
    batch = batch or step.batch
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    output = torch.full_like(step.query, 7.0)
    tree_fix_rows_fused(
        output, step.query, step.key, step.value, key_cache, value_cache, step.block_table, batch, SCALE, softcap,
        num_fix=num_fix, block_k=block_k,
    )  # fmt: skip
    return output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("block_k", [16, 64])
def test_whole_row_kernel_equals_the_split_specification(dtype, softcap, block_k):
    """Prefix over the paged cache (several key blocks across shuffled cache blocks at block_k 16) + suffix, vs
    `tree_fix_rows` with the torch prefix reference; the rows not fixed are untouched."""
    step = make_step(dtype=dtype, device=DEVICE, seed=9)
    key_cache, value_cache = fa_kv_views(step.kv_cache, HEAD)
    output = _whole(step, softcap=softcap, block_k=block_k)
    spec = tree_fix_rows(
        step.query, step.key, step.value, key_cache, value_cache, step.block_table, step.batch, SCALE, softcap
    )
    _assert_fix_rows(step, output, spec, dtype, softcap)


def test_whole_row_kernel_wrong_mask_and_padded_grid():
    step = make_step(device=DEVICE, seed=10)
    rows = step.batch.fix_rows.long()
    good = _whole(step)
    own = torch.bitwise_left_shift(
        torch.ones_like(step.batch.fix_bits), step.batch.fix_rows - step.batch.root_row[step.batch.fix_req] - 1
    )
    bad = _whole(step, batch=dataclasses.replace(step.batch, fix_bits=own))
    assert not torch.allclose(good[rows], bad[rows], atol=1e-3)
    torch.testing.assert_close(bad[rows].cpu(), dense_reference(step, drop_ancestors=True), atol=1e-4, rtol=1e-4)
    # A padded grid: only the first num_fix rows are real (the rest of the buffers is whatever a graph holds).
    real = 3
    part = _whole(step, num_fix=torch.tensor([real], dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(part[rows[:real]], good[rows[:real]], atol=0, rtol=0)
    assert (part[rows[real:]] == 7.0).all()
