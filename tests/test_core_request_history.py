"""RequestHistory: each request's running averages follow it through the engine's batch order."""

from __future__ import annotations

import pytest
import torch

from echo_vllm.core.request_history import RequestHistory


def _set(history: RequestHistory, values: dict[str, tuple[float, float]]) -> None:
    for i, rid in enumerate(history.req_ids):
        if rid in values:
            history.rows[i] = torch.tensor(values[rid], dtype=torch.float64)


def _by_id(history: RequestHistory) -> dict[str, tuple[float, float]]:
    return {rid: tuple(history.rows[i].tolist()) for i, rid in enumerate(history.req_ids)}


def test_rows_follow_their_requests_through_joins_leaves_and_reorders():
    history = RequestHistory(0.3, capacity=2)
    history.align(["a", "b"])
    _set(history, {"a": (1.0, 2.0), "b": (3.0, 0.5)})
    # Joined at the end (past the capacity): the old rows stay, the new ones start at zero.
    rows = history.align(["a", "b", "c"])
    assert rows.shape[0] >= 3 and _by_id(history) == {"a": (1.0, 2.0), "b": (3.0, 0.5), "c": (0.0, 0.0)}
    _set(history, {"c": (2.0, 2.0)})
    # Reordered, one left, one new: values follow the ids.
    history.align(["c", "d", "a"])
    assert _by_id(history) == {"c": (2.0, 2.0), "d": (0.0, 0.0), "a": (1.0, 2.0)}
    # Left from the end, then a new request takes the freed row: it starts at zero, not with the old row's values.
    history.align(["c", "d"])
    history.align(["c", "d", "e"])
    assert _by_id(history)["e"] == (0.0, 0.0)
    # A request that left and came back starts afresh.
    history.align(["b", "c"])
    assert _by_id(history) == {"b": (0.0, 0.0), "c": (2.0, 2.0)}


def test_factors_and_summary():
    history = RequestHistory(0.25, prior=2.0)
    assert history.summary()["requests"] == 0
    history.align(["x", "y"])
    _set(history, {"x": (2.0, 0.0), "y": (0.0, 2.0)})
    assert history.factors().tolist() == [2.0, 0.5]
    summary = history.summary()
    assert summary["alpha"] == 0.25 and summary["requests"] == 2
    assert summary["factor_min"] == 0.5 and summary["factor_max"] == 2.0


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_bad_weight_is_one_line(alpha):
    with pytest.raises(ValueError, match=r"request_history must be in \(0, 1\]"):
        RequestHistory(alpha)
