"""Compiled ops (csrc/, `torch.ops.echo.*`) with a logged fallback to the torch reference.

`select_budget(tree, gates, k_max)` (ECHO) and `select_eagle2(tree, k_max)` (EAGLE-2's rerank) are the
tree-level API; both call `select_budget_flat(...)`, the op's flat schema, which is
`echo_vllm.core.budget.select_budget_reference`, bit for bit, computed by the compiled `echo::select_budget` op when the extension `echo_vllm._C` is built for the inputs' device, and by the
reference otherwise (logged once per device type on the "echo_vllm" logger). `active_implementation()` says
which one runs, for `echo-vllm doctor`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from echo_vllm.core.budget import BudgetSelection, select_budget_reference
from echo_vllm.core.gating import Gates
from echo_vllm.core.tree import DraftTree

__all__ = [
    "BudgetSelection",
    "active_implementation",
    "cpu_isa_calls",
    "op_available",
    "select_budget",
    "select_budget_flat",
    "select_eagle2",
]

_LOG = logging.getLogger("echo_vllm")

_C: Any = None
_LOAD_ERROR: str | None = None
try:
    from echo_vllm import _C  # type: ignore[attr-defined,no-redef,unused-ignore]  # a .so (csrc), absent until built
except ImportError as exc:  # not built, or built against another torch (undefined symbol)
    _LOAD_ERROR = f"echo_vllm._C is not importable ({exc}); build it with `pip install --no-build-isolation -e .`"
else:
    from echo_vllm.ops import _fake  # noqa: F401 - fake impls for torch.compile / FakeTensorMode

_fallback_logged: set[str] = set()


def ops_defined(*names: str) -> bool:
    """Whether the loaded extension registers every `echo::` op in `names` (an older build may lack newer ones)."""
    if _C is None:
        return False
    try:
        for name in names:
            getattr(torch.ops.echo, name)  # resolving the overload packet is the check
    except (AttributeError, RuntimeError):
        return False
    return True


def op_takes(name: str, argument: str) -> bool:
    """Whether the loaded `echo::<name>` op's schema has `argument` (a build older than a schema change lacks it)."""
    if not ops_defined(name):
        return False
    packet = getattr(torch.ops.echo, name)
    return any(a.name == argument for a in packet.default._schema.arguments)


_ENV_DATA: Any = getattr(os.environ, "_data", None)  # CPython's encoded store behind os.environ (POSIX: bytes)


def _env_switch(name: str) -> Callable[[], bool]:
    """A live test of os.environ.get(name) == "1" that reads CPython's encoded store with a pre-encoded key: the
    gates ask several times per engine step (every draft depth, the selection, the feedback), and py-spy put
    `os.environ.get` (Mapping.get, key and value encoding) at ~0.1 % of a batch-4 step on the 2-core testbed.
    Still live: a switch set at run time (tests' monkeypatch) takes effect. Other os.environ types: plain `get`."""
    if _ENV_DATA is not None and hasattr(os.environ, "encodekey") and hasattr(os.environ, "encodevalue"):
        key, one, data = os.environ.encodekey(name), os.environ.encodevalue("1"), _ENV_DATA
        return lambda: data.get(key) == one
    return lambda: os.environ.get(name) == "1"


class CpuOpsGate:
    """Whether a family of CPU-only compiled ops serves a device now, else its torch twin; the reason for the torch
    path is logged once: another device, an extension without the ops, or the family's A/B switch `env`=1."""

    def __init__(self, env: str, torch_path: str, family: str) -> None:
        self.env, self.torch_path, self.family = env, torch_path, family
        self._switched_off = _env_switch(env)
        self._logged = False

    def serves(self, device: torch.device, defined: bool) -> bool:
        if device.type == "cpu" and defined and not self._switched_off():
            return True
        if not self._logged:
            self._logged = True
            if device.type != "cpu":
                why = f"no {device.type} kernel"
            elif not defined:
                why = _LOAD_ERROR or f"echo_vllm._C predates {self.family} (rebuild: `make install`)"
            else:
                why = f"{self.env}=1"
            _LOG.info("%s (%s)", self.torch_path, why)
        return False


def _cuda_compiled() -> bool:
    return _C is not None and bool(_C.cuda_compiled())


def op_available(device: torch.device | str) -> bool:
    """Whether the compiled op serves tensors on `device` (cpu, cuda; meta through the fake impl)."""
    if _C is None:
        return False
    kind = torch.device(device).type
    if kind == "cuda":
        return _cuda_compiled()
    return kind in ("cpu", "meta")


def active_implementation() -> dict:
    """{"cpu": "csrc" | "reference", "cuda": "csrc" | "reference" | "unavailable", "reason": str}."""
    cuda_device = torch.cuda.is_available()
    if _C is None:
        return {"cpu": "reference", "cuda": "reference" if cuda_device else "unavailable", "reason": _LOAD_ERROR}
    if not cuda_device:
        cuda, reason = "unavailable", "echo_vllm._C loaded; no CUDA device visible to torch"
    elif _cuda_compiled():
        cuda, reason = "csrc", "echo_vllm._C loaded with its CUDA kernel"
    else:
        cuda, reason = "reference", "echo_vllm._C was built without CUDA (no nvcc or a CPU torch at build time)"
    return {"cpu": "csrc", "cuda": cuda, "reason": reason}


def cpu_isa_calls() -> dict[str, dict[str, int]] | None:
    """Calls so far of each CPU kernel that has an AVX2 build, per build that ran: {"draft_logp": {"avx2": n,
    "baseline": m}, "tree_fix_attention": {...}} (counted once per parallel chunk); None when the extension
    lacks the counter. The outputs of both builds agree, so this is how a test proves which one an AVX2 machine
    takes."""
    if not ops_defined("cpu_isa_calls"):
        return None
    counts = list(torch.ops.echo.cpu_isa_calls())
    kernels = ("draft_logp", "tree_fix_attention")
    return {name: {"avx2": counts[2 * i], "baseline": counts[2 * i + 1]} for i, name in enumerate(kernels)}


def _log_fallback(device: torch.device) -> None:
    if device.type in _fallback_logged:
        return
    _fallback_logged.add(device.type)
    why = _LOAD_ERROR if _C is None else f"echo_vllm._C has no {device.type} kernel"
    _LOG.warning("echo::select_budget fallback active on %s: using the torch reference (%s)", device.type, why)


def select_budget(
    tree: DraftTree, gates: Gates, k_max: int, *, out: Sequence[torch.Tensor] | None = None
) -> BudgetSelection:
    """ECHO's batch-wide budget over `tree` under `gates`: depth for the spines (Priority 1), then width for the
    requests `gates.widen` allows (Priority 2); the first K_max nodes of the whole batch in that order."""
    return select_budget_flat(
        tree.scores, tree.depth, tree.parent, tree.valid, tree.spine, gates.depth_cap, gates.widen, k_max, out=out
    )


def select_eagle2(tree: DraftTree, k_max: int) -> BudgetSelection:
    """EAGLE-2's rule on the same op: every valid node competes on path score alone for the K_max slots (no
    gates, no spine priority), i.e. every valid node is a class-0 candidate and every depth cap is D."""
    batch, _ = tree.scores.shape
    gates = Gates.open(batch, tree.max_depth, tree.scores.device)
    return select_budget_flat(
        tree.scores, tree.depth, tree.parent, tree.valid, tree.valid, gates.depth_cap, gates.widen, k_max
    )


def select_budget_flat(
    scores: torch.Tensor,
    depth: torch.Tensor,
    parent: torch.Tensor,
    valid: torch.Tensor,
    spine: torch.Tensor,
    depth_cap: torch.Tensor,
    truncated: torch.Tensor,
    k_max: int,
    *,
    out: Sequence[torch.Tensor] | None = None,
) -> BudgetSelection:
    """The op's flat schema (csrc/README.md; see echo_vllm.core.budget). With `out=(selected, counts, order, parent_local,
    order_depth)` (preallocated, contiguous, right shapes/dtypes) the results are written there, with no
    allocation on the compiled path, so the call can sit inside a CUDA graph."""
    if out is not None and len(out) != 5:
        raise ValueError(
            f"out must hold 5 tensors (selected, counts, order, parent_local, order_depth); got {len(out)}"
        )
    if isinstance(k_max, bool) or not isinstance(k_max, (int, torch.SymInt)):
        raise ValueError(f"k_max must be an integer >= 0; got {k_max!r}")
    if isinstance(k_max, int) and k_max > scores.numel():
        # The reference takes any Python int; the op's schema is int64. Beyond B * N the result is the same.
        k_max = scores.numel()
    if op_available(scores.device):
        if out is None:
            return BudgetSelection(
                *torch.ops.echo.select_budget(scores, depth, parent, valid, spine, depth_cap, truncated, k_max)
            )
        torch.ops.echo.select_budget_out(scores, depth, parent, valid, spine, depth_cap, truncated, k_max, *out)
        return BudgetSelection(*out)
    _log_fallback(scores.device)
    result = select_budget_reference(scores, depth, parent, valid, spine, depth_cap, truncated, k_max)
    if out is None:
        return result
    for name, target, value in zip(BudgetSelection._fields, out, result, strict=True):
        if target.shape != value.shape or target.dtype != value.dtype:
            raise ValueError(
                f"{name} (out) must be {value.dtype} {tuple(value.shape)}; got {target.dtype} {tuple(target.shape)}"
            )
        target.copy_(value)
    return BudgetSelection(*out)
