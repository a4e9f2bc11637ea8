"""Which rows of a step verified drafts, and where they were drafted: the proposer's feedback hand-off.

The batch order usually stays between the drafting step and the verifying one (then row i is row i, with no
per-request Python); requests can join at the end, leave from the end, or be moved (vLLM condenses its persistent
batch when a request in the middle finishes): then the ids are matched. Both paths must give the same rows.
"""

from __future__ import annotations

import random

import pytest
import torch

from echo_vllm.vllm.proposer import EchoProposer


def _by_ids(drafted, current, num_draft):
    """The rule by hand: every current row with drafts whose request was drafted, and its drafted row."""
    pairs = [(i, drafted.index(r)) for i, r in enumerate(current) if num_draft[i] > 0 and r in drafted]
    return pairs


@pytest.mark.parametrize("seed", range(40))
def test_verified_rows_match_the_id_by_id_rule(seed):
    rng = random.Random(seed)
    drafted = [f"r{i}" for i in range(rng.randint(1, 9))]
    kind = seed % 4
    if kind == 0:
        current = list(drafted)  # unchanged
    elif kind == 1:
        current = drafted + [f"new{i}" for i in range(rng.randint(1, 3))]  # joined at the end
    elif kind == 2:
        current = drafted[: rng.randint(0, len(drafted))]  # left from the end
    else:
        current = list(drafted)
        rng.shuffle(current)  # moved (condensed)
        current = current[: rng.randint(0, len(current))] + ["new"]
    low = 1 if seed % 8 >= 4 else 0  # half the cases: every drafted row verified something (the fast path)
    num_draft = [rng.randint(low, 3) if r in drafted else 0 for r in current]
    got = EchoProposer._verified_rows(drafted, current, num_draft, "cpu")
    want = _by_ids(drafted, current, num_draft)
    if not want:
        assert got is None
        return
    assert got is not None
    cur, old, verified = got
    assert list(zip(cur.tolist(), old.tolist())) == want
    assert verified.tolist() == [num_draft[i] for i, _ in want]


def test_no_drafts_anywhere_is_none():
    assert EchoProposer._verified_rows(["a"], ["a"], [], "cpu") is None
    assert EchoProposer._verified_rows(["a", "b"], ["a", "b"], [0, 0], "cpu") is None
    cur, old, verified = EchoProposer._verified_rows(["a", "b"], ["b", "a"], [2, 0], "cpu")
    assert cur.tolist() == [0] and old.tolist() == [1] and verified.tolist() == [2] and cur.dtype == torch.long


def test_kept_rows_are_none_when_vllm_drops_no_drafts():
    """The chain steps' kept-rows mask: None (every row kept) from the mask's host copy when nothing is dropped,
    else the device mask's complement; without a host copy, always the device mask's."""
    import types

    import numpy as np

    proposer = object.__new__(EchoProposer)
    proposer._depth = torch.zeros(1)
    dropped = np.array([False, True, False, False])
    proposer._runner = types.SimpleNamespace(
        discard_request_mask=types.SimpleNamespace(np=dropped, gpu=torch.from_numpy(dropped))
    )
    assert proposer._kept_rows_unless_all(3).tolist() == [True, False, True]
    dropped[1] = False
    assert proposer._kept_rows_unless_all(3) is None
    dropped[3] = True  # a stale row past the batch does not count
    assert proposer._kept_rows_unless_all(3) is None
    proposer._runner.discard_request_mask = types.SimpleNamespace(gpu=torch.from_numpy(dropped))  # no host copy
    assert proposer._kept_rows_unless_all(3).tolist() == [True, True, True]
