"""Fake (meta) implementations of the `echo::` ops, for FakeTensorMode / torch.compile / meta tensors.

Registered when echo_vllm.ops loads the compiled library; torch also imports this module on demand (the C++
library names it with `set_python_module`). Shapes may be symbolic, so the checks avoid data and plain-int
assumptions; messages match the C++ op's.
"""

from __future__ import annotations

import torch

_INPUTS = (
    ("depth", torch.int32, False),
    ("parent", torch.int32, False),
    ("valid", torch.bool, False),
    ("spine", torch.bool, False),
    ("depth_cap", torch.int32, True),
    ("truncated", torch.bool, True),
)
_OUTPUTS = (
    ("selected", torch.bool, False),
    ("counts", torch.int32, True),
    ("order", torch.int32, False),
    ("parent_local", torch.int32, False),
    ("order_depth", torch.int32, False),
)


def _check_like(scores: torch.Tensor, name: str, tensor: torch.Tensor, dtype: torch.dtype, per_request: bool) -> None:
    expected = tuple(scores.shape[:1]) if per_request else tuple(scores.shape)
    if tuple(tensor.shape) != expected:
        what = f"[B] = [{scores.shape[0]}]" if per_request else f"the shape of scores {list(scores.shape)}"
        raise ValueError(f"{name} must be {what}; got {list(tensor.shape)}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}; got {tensor.dtype}")
    if tensor.device != scores.device:
        raise ValueError(f"{name} must be on the device of scores ({scores.device}); got {tensor.device}")


def check_inputs(scores, depth, parent, valid, spine, depth_cap, truncated, k_max) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, N]; got shape {list(scores.shape)}")
    if scores.dtype != torch.float32:
        raise TypeError(f"scores must be float32; got {scores.dtype}")
    for (name, dtype, per_request), tensor in zip(
        _INPUTS, (depth, parent, valid, spine, depth_cap, truncated), strict=True
    ):
        _check_like(scores, name, tensor, dtype, per_request)
    if isinstance(k_max, int) and k_max < 0:  # a SymInt is checked when it becomes concrete
        raise ValueError(f"k_max must be an integer >= 0; got {k_max}")


def _register() -> None:
    @torch.library.register_fake("echo::select_budget")
    def _select_budget_fake(scores, depth, parent, valid, spine, depth_cap, truncated, k_max):
        check_inputs(scores, depth, parent, valid, spine, depth_cap, truncated, k_max)
        shape = scores.shape
        return (
            scores.new_empty(shape, dtype=torch.bool),
            scores.new_empty(shape[:1], dtype=torch.int32),
            scores.new_empty(shape, dtype=torch.int32),
            scores.new_empty(shape, dtype=torch.int32),
            scores.new_empty(shape, dtype=torch.int32),
        )

    @torch.library.register_fake("echo::select_budget_out")
    def _select_budget_out_fake(
        scores,
        depth,
        parent,
        valid,
        spine,
        depth_cap,
        truncated,
        k_max,
        selected,
        counts,
        order,
        parent_local,
        order_depth,
    ):
        check_inputs(scores, depth, parent, valid, spine, depth_cap, truncated, k_max)
        for (name, dtype, per_request), tensor in zip(
            _OUTPUTS, (selected, counts, order, parent_local, order_depth), strict=True
        ):
            _check_like(scores, name, tensor, dtype, per_request)
        return None


def _op_defined() -> bool:
    try:
        torch.ops.echo.select_budget.default  # noqa: B018 - raises when the library is not loaded
    except (AttributeError, RuntimeError):
        return False
    return True


if not _op_defined():
    try:
        import echo_vllm._C  # noqa: F401
    except ImportError:
        pass
if _op_defined():
    _register()
