"""Share a few floats from TP rank 0 with every rank, so that decisions built on rank-local timings agree.

The time-aware budget's cost model is fitted from step times, which each rank measures for itself; if ranks fitted
their own, they could choose different draft depths and then run different numbers of drafter forwards, whose
collectives would hang. So rank 0 fits and broadcasts at refit points (the same step on every rank). With one
rank, or outside an initialised vLLM (unit tests), the values come back unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _tp_group():
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    except Exception:  # noqa: BLE001 - vLLM absent or its groups not initialised (tests outside an engine)
        return None
    return group if getattr(group, "world_size", 1) > 1 else None


def broadcast_from_rank0(values: Sequence[float]) -> list[float]:
    group = _tp_group()
    if group is None:
        return [float(v) for v in values]
    # float64 on the group's CPU side (gloo) when there is one: the payload is tiny and needs no device copy.
    tensor = torch.tensor(list(values), dtype=torch.float64)
    cpu_group = getattr(group, "cpu_group", None)
    if cpu_group is not None:
        torch.distributed.broadcast(tensor, src=group.ranks[0], group=cpu_group)
        return tensor.tolist()
    return group.broadcast(tensor.to(group.device), src=0).cpu().tolist()
