"""echo::select_budget (csrc/) against its specification, select_budget_reference: bit for bit, ties included.

The compiled op is needed: without echo_vllm._C these tests skip (ECHO_REQUIRE_CSRC=1 turns that into failures,
as scripts/device_check.sh does). CUDA tests are marked `gpu`.
"""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import echo_vllm.ops as ops
from echo_vllm.core.budget import CLASS_DEPTH, CLASS_WIDTH, candidate_class, select_budget_reference
from echo_vllm.core.tree import depth_major_layout

REQUIRE_CSRC = os.environ.get("ECHO_REQUIRE_CSRC") == "1"
pytestmark = pytest.mark.skipif(
    ops._C is None and not REQUIRE_CSRC, reason=f"compiled op not built: {ops.active_implementation()['reason']}"
)

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Tiny score set: ties everywhere, both zeros, a denormal pair, infinities and NaN.
TIE_SCORES = torch.tensor([0.0, -0.0, -1.0, -0.5, 1e-45, -1e-45, float("-inf"), float("inf"), float("nan")])
LAYOUTS = ("depth_major", "forest", "arbitrary")
SCORE_KINDS = ("ties", "continuous", "mixed")
K_KINDS = (
    "zero",
    "one",
    "below_batch",
    "c0_minus",
    "c0",
    "c0_plus",
    "total_minus",
    "total",
    "total_plus",
    "random",
    "huge",
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The reference's indexing ops oversubscribe a shared 2-core machine; one thread keeps the suite fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_case(
    seed: int,
    batch: int,
    num_nodes: int,
    layout: str,
    score_kind: str,
    valid_p: float,
    invalid_rows: bool,
    trunc_p: float,
    k_kind: str,
):
    """(scores, depth, parent, valid, spine, depth_cap, truncated, k_max), topologically numbered (parent < n)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, num_nodes)
    node = torch.arange(num_nodes)
    if layout == "depth_major":
        divisors = [k for k in (1, 2, 4, 8, num_nodes) if k and num_nodes % k == 0] or [1]
        top_k = divisors[int(torch.randint(len(divisors), (1,), generator=gen))]
        depth, spine = depth_major_layout(batch, num_nodes // top_k, top_k)
        slot = node % top_k
        prev = torch.where(slot == 0, torch.zeros_like(slot), torch.randint(0, top_k, shape, generator=gen))
        parent = torch.where(node >= top_k, node - top_k - slot + prev, torch.full_like(node, -1))
    else:
        # Random forest: parent uniform in [-1, n - 1].
        parent = (torch.rand(shape, generator=gen) * (node + 1)).floor().long() - 1
        if layout == "forest":
            depth = torch.zeros(shape, dtype=torch.int32)
            for n in range(num_nodes):
                p = parent[:, n]
                depth[:, n] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0).unsqueeze(1)).squeeze(1) + 1, 1)
        else:
            depth = torch.randint(-3, 10, shape, generator=gen, dtype=torch.int32)
            extreme = torch.rand(shape, generator=gen) < 0.05
            depth = torch.where(extreme & (torch.rand(shape, generator=gen) < 0.5), INT32_MIN, depth)
            depth = torch.where(extreme & (torch.rand(shape, generator=gen) < 0.5), INT32_MAX, depth).to(torch.int32)
        spine = torch.rand(shape, generator=gen) < 0.3
    parent = parent.to(torch.int32).contiguous()

    ties = TIE_SCORES[torch.randint(len(TIE_SCORES), shape, generator=gen)]
    smooth = -torch.rand(shape, generator=gen) * 10
    if score_kind == "ties":
        scores = ties
    elif score_kind == "continuous":
        scores = smooth
    else:
        scores = torch.where(torch.rand(shape, generator=gen) < 0.3, ties, smooth)
    valid = torch.rand(shape, generator=gen) < valid_p
    if invalid_rows:
        valid &= (torch.rand(batch, generator=gen) < 0.7).unsqueeze(1)
    lo, hi = (int(depth.min()), int(depth.max())) if depth.numel() else (0, 1)
    lo = min(max(lo, -5), 70)
    hi = max(min(hi, 70), lo)
    depth_cap = torch.randint(lo - 1, hi + 2, (batch,), generator=gen, dtype=torch.int32)
    depth_cap = torch.where(torch.rand(batch, generator=gen) < 0.1, INT32_MAX, depth_cap).to(torch.int32)
    truncated = torch.rand(batch, generator=gen) < trunc_p

    cls = candidate_class(scores, depth, valid, spine, depth_cap, truncated)
    c0 = int((cls == CLASS_DEPTH).sum())
    total = c0 + int((cls == CLASS_WIDTH).sum())
    k_max = {
        "zero": 0,
        "one": 1,
        "below_batch": int(torch.randint(max(batch, 1), (1,), generator=gen)),
        "c0_minus": c0 - 1,
        "c0": c0,
        "c0_plus": c0 + 1,
        "total_minus": total - 1,
        "total": total,
        "total_plus": total + 1,
        "random": int(torch.randint(total + 1, (1,), generator=gen)),
        "huge": 2**40,
    }[k_kind]
    return scores, depth, parent, valid, spine, depth_cap, truncated, max(k_max, 0)


def assert_same(expected, got, context=""):
    for name, want, have in zip(expected._fields, expected, got, strict=True):
        assert have.dtype == want.dtype, f"{name}: dtype {have.dtype} != {want.dtype} {context}"
        assert have.shape == want.shape, f"{name}: shape {tuple(have.shape)} != {tuple(want.shape)} {context}"
        have = have.cpu()
        if not torch.equal(have, want):
            bad = (have != want).nonzero()[:5].tolist()
            raise AssertionError(f"{name} differs at {bad} {context}")


case_params = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31 - 1),
        "layout": st.sampled_from(LAYOUTS),
        "score_kind": st.sampled_from(SCORE_KINDS),
        "valid_p": st.sampled_from([0.0, 0.5, 0.9, 1.0]),
        "invalid_rows": st.booleans(),
        "trunc_p": st.sampled_from([0.0, 0.5, 1.0]),
        "k_kind": st.sampled_from(K_KINDS),
    }
)

SHAPES = [(b, n) for b in (1, 7, 256) for n in (1, 64, 512)]


def _examples(batch: int, num_nodes: int) -> int:
    size = batch * num_nodes
    return 200 if size <= 512 else (50 if size <= 20_000 else 12)


def _check_case(params, batch, num_nodes, device="cpu"):
    args = make_case(batch=batch, num_nodes=num_nodes, **params)
    expected = select_budget_reference(*args)
    got = torch.ops.echo.select_budget(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
    assert_same(expected, got, f"B={batch} N={num_nodes} k_max={args[-1]} {params}")


@pytest.mark.parametrize("batch,num_nodes", SHAPES)
def test_matches_reference(batch, num_nodes):
    @settings(
        max_examples=_examples(batch, num_nodes),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(params=case_params)
    def check(params):
        _check_case(params, batch, num_nodes)

    check()


@given(params=case_params, batch=st.integers(0, 9), num_nodes=st.integers(0, 40))
@settings(max_examples=150, deadline=None)
def test_matches_reference_small_shapes(params, batch, num_nodes):
    _check_case(params, batch, num_nodes)


def test_all_invalid_and_edge_shapes():
    for batch, num_nodes in ((0, 5), (3, 0), (0, 0), (4, 16)):
        for k_max in (0, 3, 100):
            args = make_case(0, batch, num_nodes, "forest", "ties", 0.0, False, 1.0, "zero")[:-1]
            assert_same(select_budget_reference(*args, k_max), torch.ops.echo.select_budget(*args, k_max))


def test_wrapper_and_noncontiguous_inputs():
    args = make_case(3, 16, 64, "depth_major", "mixed", 0.9, True, 0.5, "random")
    expected = select_budget_reference(*args)
    # Transposed copies: same values, non-contiguous strides.
    strided = [a.t().contiguous().t() if isinstance(a, torch.Tensor) and a.dim() == 2 else a for a in args]
    assert not strided[0].is_contiguous()
    assert_same(expected, ops.select_budget_flat(*strided))


def _empty_outs(scores):
    batch, num_nodes = scores.shape
    return (
        torch.ones(batch, num_nodes, dtype=torch.bool, device=scores.device),
        torch.full((batch,), 77, dtype=torch.int32, device=scores.device),
        *(torch.full((batch, num_nodes), 77, dtype=torch.int32, device=scores.device) for _ in range(3)),
    )


def test_out_variant_overwrites_buffers():
    args = make_case(5, 7, 64, "forest", "ties", 0.9, True, 0.5, "c0_plus")
    expected = select_budget_reference(*args)
    outs = _empty_outs(args[0])
    torch.ops.echo.select_budget_out(*args, *outs)
    assert_same(expected, outs)
    outs2 = _empty_outs(args[0])
    result = ops.select_budget_flat(*args, out=outs2)
    assert all(r is o for r, o in zip(result, outs2, strict=True))
    assert_same(expected, result)


def test_k_max_beyond_int64_through_the_wrapper():
    args = make_case(4, 7, 64, "forest", "mixed", 0.9, False, 0.5, "zero")[:-1]
    for k_max in (2**63 - 1, 2**63, 2**70):
        assert_same(select_budget_reference(*args, k_max), ops.select_budget_flat(*args, k_max))
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="k_max"):
            ops.select_budget_flat(*args, bad)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_k_max_at_and_below_all_nodes(layout):
    # The wrapper clamps any larger k_max to B * N: the op must take B * N (and B * N - 1) like any other.
    for seed, valid_p, trunc_p in ((4, 0.9, 0.5), (5, 1.0, 1.0)):
        args = make_case(seed, 7, 64, layout, "mixed", valid_p, False, trunc_p, "zero")[:-1]
        for k_max in (7 * 64, 7 * 64 - 1):
            assert_same(select_budget_reference(*args, k_max), torch.ops.echo.select_budget(*args, k_max))
            assert_same(select_budget_reference(*args, k_max), ops.select_budget_flat(*args, k_max))


def _good_args(batch=4, num_nodes=8):
    return list(make_case(1, batch, num_nodes, "depth_major", "continuous", 1.0, False, 0.5, "random"))


@pytest.mark.parametrize(
    "index,bad,exc,name",
    [
        (0, torch.zeros(4, 8, dtype=torch.float64), TypeError, "scores"),
        (0, torch.zeros(32), ValueError, "scores"),
        (1, torch.zeros(4, 8, dtype=torch.int64), TypeError, "depth"),
        (1, torch.zeros(4, 9, dtype=torch.int32), ValueError, "depth"),
        (2, torch.zeros(4, 8, dtype=torch.float32), TypeError, "parent"),
        (3, torch.zeros(4, 8, dtype=torch.uint8), TypeError, "valid"),
        (4, torch.zeros(8, 4, dtype=torch.bool), ValueError, "spine"),
        (5, torch.zeros(5, dtype=torch.int32), ValueError, "depth_cap"),
        (5, torch.zeros(4, 1, dtype=torch.int32), ValueError, "depth_cap"),
        (6, torch.zeros(4, dtype=torch.int32), TypeError, "truncated"),
        (6, torch.zeros(4, dtype=torch.bool, device="meta"), ValueError, "truncated"),
        (7, -1, ValueError, "k_max"),
    ],
)
def test_bad_inputs_raise_from_the_op(index, bad, exc, name):
    args = _good_args()
    args[index] = bad
    with pytest.raises(exc, match=name):
        torch.ops.echo.select_budget(*args)
    with pytest.raises(exc, match=name):
        torch.ops.echo.select_budget_out(*args, *_empty_outs(args[0] if args[0].dim() == 2 else torch.zeros(4, 8)))


@pytest.mark.parametrize(
    "index,bad,exc,message",
    [
        (0, torch.zeros(4, 8, dtype=torch.float64), TypeError, "scores must be float32; got Double"),
        (0, torch.zeros(32), ValueError, "scores must be [B, N]; got shape [32]"),
        (1, torch.zeros(4, 8, dtype=torch.int64), TypeError, "depth must be Int; got Long"),
        (1, torch.zeros(4, 9, dtype=torch.int32), ValueError, "depth must have the shape of scores [4, 8]; got [4, 9]"),
        (5, torch.zeros(4, 1, dtype=torch.int32), ValueError, "depth_cap must be [B] = [4]; got [4, 1]"),
        (
            6,
            torch.zeros(4, dtype=torch.bool, device="meta"),
            ValueError,
            "truncated must be on the device of scores (cpu); got meta",
        ),
        (7, -1, ValueError, "k_max must be an integer >= 0; got -1"),
        (7, -(2**63), ValueError, "k_max must be an integer >= 0; got -9223372036854775808"),
    ],
)
def test_error_messages_are_exact(index, bad, exc, message):
    # The op's checks format without iostreams (csrc/check_msg.h): an extension linked against a static libstdc++
    # crashed formatting an integer into TORCH_CHECK's ostringstream (k_max = -1 above). Same text as before.
    args = _good_args()
    args[index] = bad
    with pytest.raises(exc, match="^" + re.escape(message)):
        torch.ops.echo.select_budget(*args)


@pytest.mark.parametrize(
    "index,bad,name",
    [
        (0, torch.zeros(4, 8, dtype=torch.uint8), "selected"),
        (1, torch.zeros(5, dtype=torch.int32), "counts"),
        (2, torch.zeros(8, 4, dtype=torch.int32).t(), "order"),  # right shape, not contiguous
        (3, torch.zeros(4, 8, dtype=torch.int64), "parent_local"),
        (4, torch.zeros(4, 7, dtype=torch.int32), "order_depth"),
    ],
)
def test_bad_out_buffers_raise(index, bad, name):
    args = _good_args()
    outs = list(_empty_outs(args[0]))
    outs[index] = bad
    with pytest.raises((TypeError, ValueError), match=name):
        torch.ops.echo.select_budget_out(*args, *outs)


def test_out_buffer_aliasing_an_input_raises():
    args = _good_args()
    outs = list(_empty_outs(args[0]))
    outs[0] = args[3]  # selected = valid
    with pytest.raises(RuntimeError, match="overlap|memory location"):
        torch.ops.echo.select_budget_out(*args, *outs)


def test_fake_tensor_mode_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _good_args(5, 24)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.echo.select_budget(*fake_args)
        with pytest.raises(TypeError, match="depth"):
            torch.ops.echo.select_budget(fake_args[0], fake_args[1].float(), *fake_args[2:])
    assert [tuple(t.shape) for t in out] == [(5, 24), (5,), (5, 24), (5, 24), (5, 24)]
    assert [t.dtype for t in out] == [torch.bool, torch.int32, torch.int32, torch.int32, torch.int32]
    meta = torch.ops.echo.select_budget(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    assert meta[0].device.type == "meta" and tuple(meta[1].shape) == (5,)


def test_opcheck():
    for seed, (batch, num_nodes) in enumerate(((3, 16), (1, 1), (6, 40))):
        args = make_case(seed, batch, num_nodes, "forest", "mixed", 0.9, False, 0.5, "random")
        torch.library.opcheck(torch.ops.echo.select_budget.default, args)
        torch.library.opcheck(torch.ops.echo.select_budget_out.default, (*args, *_empty_outs(args[0])))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_traces_the_op(dynamic):
    torch._dynamo.reset()

    def fn(scores, depth, parent, valid, spine, depth_cap, truncated):
        sel = ops.select_budget_flat(scores, depth, parent, valid, spine, depth_cap, truncated, 11)  # the wrapper
        outs = _empty_outs(scores)
        torch.ops.echo.select_budget_out(scores, depth, parent, valid, spine, depth_cap, truncated, 11, *outs)
        return sel.counts.sum() + outs[1].sum(), sel.order, outs[2]

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for batch, num_nodes in ((4, 16), (6, 24)):
        args = make_case(batch, batch, num_nodes, "depth_major", "mixed", 0.9, False, 0.5, "zero")[:-1]
        expected = select_budget_reference(*args, 11)
        total, order, order_out = compiled(*args)
        assert int(total) == 2 * int(expected.counts.sum())
        assert torch.equal(order, expected.order) and torch.equal(order_out, expected.order)


def test_fallback_logs_once_and_matches(monkeypatch, caplog):
    monkeypatch.setattr(ops, "_C", None)
    monkeypatch.setattr(ops, "_LOAD_ERROR", "echo_vllm._C is not importable (test)")
    monkeypatch.setattr(ops, "_fallback_logged", set())
    args = make_case(2, 7, 64, "depth_major", "ties", 0.9, True, 0.5, "random")
    with caplog.at_level(logging.WARNING, logger="echo_vllm"):
        first = ops.select_budget_flat(*args)
        second = ops.select_budget_flat(*args, out=_empty_outs(args[0]))
    assert_same(select_budget_reference(*args), first)
    assert_same(first, second)
    assert len([r for r in caplog.records if "fallback" in r.getMessage()]) == 1
    impl = ops.active_implementation()
    assert impl["cpu"] == "reference" and "not importable" in impl["reason"]


def test_active_implementation():
    impl = ops.active_implementation()
    assert impl["cpu"] == "csrc"
    assert impl["cuda"] in ("csrc", "reference", "unavailable")
    assert (impl["cuda"] == "unavailable") == (not torch.cuda.is_available())
    assert isinstance(impl["reason"], str) and impl["reason"]


# ---- CUDA (scripts/device_check.sh) ----


def _cuda_args(args):
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.gpu
def test_cuda_kernel_is_compiled():
    assert ops.active_implementation()["cuda"] == "csrc", ops.active_implementation()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,num_nodes", SHAPES)
def test_cuda_matches_reference(batch, num_nodes):
    @settings(
        max_examples=_examples(batch, num_nodes),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(params=case_params)
    def check(params):
        _check_case(params, batch, num_nodes, device="cuda")

    check()


@pytest.mark.gpu
@given(params=case_params, batch=st.integers(0, 40), num_nodes=st.integers(0, 300))
@settings(max_examples=150, deadline=None)
def test_cuda_matches_reference_random_shapes(params, batch, num_nodes):
    _check_case(params, batch, num_nodes, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("batch,num_nodes", [(256, 64), (100, 250), (512, 512), (2048, 128)])
def test_cuda_large_and_workspace_path(batch, num_nodes):
    # > ~25k nodes do not fit in shared memory: the kernel keeps its keys in a global workspace.
    for k_kind in ("c0_minus", "total_minus", "random"):
        params = {
            "seed": batch + num_nodes,
            "layout": "depth_major",
            "score_kind": "mixed",
            "valid_p": 0.9,
            "invalid_rows": True,
            "trunc_p": 0.5,
            "k_kind": k_kind,
        }
        _check_case(params, batch, num_nodes, device="cuda")


@pytest.mark.gpu
def test_cuda_reference_agrees_with_cpu_reference():
    args = make_case(11, 64, 64, "forest", "ties", 0.9, True, 0.5, "random")
    assert_same(select_budget_reference(*args), select_budget_reference(*_cuda_args(args)))


@pytest.mark.gpu
def test_cuda_graph_capture_of_out_variant():
    first = make_case(21, 64, 64, "depth_major", "mixed", 0.9, True, 0.5, "random")
    second = make_case(22, 64, 64, "depth_major", "ties", 0.9, True, 0.5, "random")
    k_max = first[-1]
    static = _cuda_args(first[:-1])
    outs = _empty_outs(static[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.select_budget_flat(*static, k_max, out=outs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.select_budget_flat(*static, k_max, out=outs)
    for case in (first, second):
        for buf, value in zip(static, case[:-1], strict=True):
            buf.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(select_budget_reference(*case[:-1], k_max), outs)


@pytest.mark.gpu
def test_cuda_bad_inputs_and_mixed_devices():
    args = _cuda_args(_good_args())
    args[5] = args[5].cpu()
    with pytest.raises(ValueError, match="depth_cap"):
        torch.ops.echo.select_budget(*args)
    args = _cuda_args(_good_args())
    args[1] = args[1].long()
    with pytest.raises(TypeError, match="depth"):
        torch.ops.echo.select_budget(*args)
