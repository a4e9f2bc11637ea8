"""The kept head rows of plain steps (echo_vllm.vllm.deferred_head): the vectorised merge against a per-request
reference, the contiguity rule that drops what cannot be merged, and the padding rows a plain step leaves out."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.vllm.deferred_head import DeferredHeadRows, HeadRows, valid_rows

HIDDEN = 3


def _rows(keys: list[int], positions: list[int]) -> HeadRows:
    n = len(keys)
    pos = torch.tensor(positions, dtype=torch.int64)
    key = torch.tensor(keys, dtype=torch.int64)
    return HeadRows(
        input_ids=(1000 * key + pos).to(torch.int32),
        positions=pos,
        hidden=torch.stack([key.float(), pos.float(), torch.arange(n).float()], dim=1).reshape(n, HIDDEN),
        slots=10_000 + 100 * key + pos,
        keys=key,
    )


def _reference(parts, current_positions, keys_now, window=0):
    """Per request: its kept rows' contiguous suffix ending right before its first row here (at most `window` of
    them when window > 0), then its own rows."""
    kept = [(int(k), int(p)) for part in parts for k, p in zip(part.keys, part.positions)]
    out_keys, out_pos, lengths, merged = [], [], [], 0
    for key, positions in zip(keys_now, current_positions):
        mine = [p for k, p in kept if k == key]
        take = []
        if positions:
            expected = positions[0] - 1
            for p in reversed(mine):
                if p != expected or (window and len(take) == window):
                    break
                take.append(p)
                expected -= 1
        take.reverse()
        merged += len(take)
        out_keys += [key] * (len(take) + len(positions))
        out_pos += take + positions
        lengths.append(len(take) + len(positions))
    return out_keys, out_pos, lengths, merged


@st.composite
def _cases(draw):
    batch = draw(st.integers(1, 5))
    keys_now = draw(st.permutations(list(range(7))))[:batch]
    current_positions = []
    for _ in range(batch):
        length = draw(st.integers(0, 3))
        start = draw(st.integers(0, 12))
        current_positions.append(list(range(start, start + length)))
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        keys = draw(st.lists(st.integers(0, 7), max_size=6))
        positions = [draw(st.integers(0, 14)) for _ in keys]
        parts.append((keys, positions))
    return keys_now, current_positions, parts, draw(st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_merge_matches_the_per_request_reference(case):
    keys_now, current_positions, raw_parts, window = case
    kept = DeferredHeadRows(capacity=1000, window=window)
    parts = [_rows(k, p) for k, p in raw_parts]
    for part in parts:
        kept.append(part)
    flat_keys = [k for k, ps in zip(keys_now, current_positions) for _ in ps]
    current = _rows(flat_keys, [p for ps in current_positions for p in ps])
    lengths = torch.tensor([len(ps) for ps in current_positions])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0).to(torch.int32)])
    merged = kept.take_merge(current, qsl, torch.tensor(keys_now))
    ref_keys, ref_pos, ref_lengths, ref_merged = _reference(parts, current_positions, keys_now, window)
    assert merged.rows.keys.tolist() == ref_keys
    assert merged.rows.positions.tolist() == ref_pos
    assert torch.diff(merged.query_start_loc).tolist() == ref_lengths
    assert merged.query_start_loc.dtype == qsl.dtype
    assert merged.num_merged == ref_merged
    total_kept = sum(len(k) for k, _ in raw_parts)
    assert merged.num_dropped == total_kept - ref_merged
    assert merged.num_deferred == total_kept  # every row deferred since the previous merge
    # Every row carries its own payload along (ids, hidden states, slots move with the row).
    assert merged.rows.input_ids.tolist() == [1000 * k + p for k, p in zip(ref_keys, ref_pos)]
    assert merged.rows.slots.tolist() == [10_000 + 100 * k + p for k, p in zip(ref_keys, ref_pos)]
    assert merged.rows.hidden[:, :2].tolist() == [[float(k), float(p)] for k, p in zip(ref_keys, ref_pos)]
    # The step's own rows: where each went (token_indices_to_sample is remapped with it).
    assert merged.rows.positions[merged.current_to_merged].tolist() == current.positions.tolist()
    if ref_lengths:
        assert merged.max_query_len == max(ref_lengths)
    assert kept.num_rows == 0 and kept.summary()["merged_rows"] == ref_merged


def test_a_request_resumes_exactly_where_its_kept_rows_end():
    kept = DeferredHeadRows(capacity=16)
    kept.append(_rows([5, 9], [10, 3]))  # plain step 1: request 5 at 10, request 9 at 3
    kept.append(_rows([5, 9], [11, 4]))  # plain step 2
    current = _rows([9, 5, 5], [5, 12, 13])  # the drafting step: request 9 first now, request 5 with two rows
    merged = kept.take_merge(current, torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([9, 5]))
    assert merged.rows.positions.tolist() == [3, 4, 5, 10, 11, 12, 13]
    assert merged.query_start_loc.tolist() == [0, 3, 7]
    assert merged.current_to_merged.tolist() == [2, 5, 6]
    assert (merged.num_merged, merged.num_dropped) == (4, 0)


def test_finished_preempted_and_gapped_rows_are_dropped_not_merged():
    kept = DeferredHeadRows(capacity=16)
    kept.append(_rows([1, 2, 3], [7, 20, 4]))
    kept.append(_rows([1, 2, 3], [8, 21, 6]))  # request 3 has a gap (5 missing)
    # Request 1 is gone (finished); request 2 was preempted and restarts at 0; request 3 continues at 7.
    current = _rows([2, 3], [0, 7])
    merged = kept.take_merge(current, torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([2, 3]))
    assert merged.rows.positions.tolist() == [0, 6, 7]  # only request 3's contiguous suffix (6) goes in
    assert (merged.num_merged, merged.num_dropped) == (1, 5)
    assert kept.summary()["dropped_rows"] == 5


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=6), max_size=4), st.integers(0, 3))
def test_trim_keeps_each_requests_newest_rows_in_append_order(raw_parts, window):
    kept = DeferredHeadRows(capacity=1000, window=window)
    position = 0
    appended = []  # (key, position) in append order; positions unique so rows can be told apart
    for keys in raw_parts:
        positions = list(range(position, position + len(keys)))
        position += len(keys)
        kept.append(_rows(keys, positions))
        appended += list(zip(keys, positions))
    dropped = kept.trim()
    if window == 0:
        expected = appended
    else:
        newest = {k: [p for kk, p in appended if kk == k][-window:] for k in {k for k, _ in appended}}
        expected = [(k, p) for k, p in appended if p in newest[k]]
    assert dropped == len(appended) - len(expected)
    assert kept.num_rows == len(expected) and kept.summary()["dropped_rows"] == dropped
    merged_keys = [k for part in kept._parts for k in part.keys.tolist()]
    merged_pos = [p for part in kept._parts for p in part.positions.tolist()]
    assert list(zip(merged_keys, merged_pos)) == expected
    # The trimmed rows still count as deferred at the next merge (their head work was never paid).
    merged = kept.take_merge(_rows([], []), torch.zeros(1, dtype=torch.int32), torch.tensor([], dtype=torch.int64))
    assert merged.num_deferred == len(appended)


def test_a_window_merges_only_the_newest_rows_of_a_long_plain_stretch():
    kept = DeferredHeadRows(capacity=64, window=2)
    for step in range(5):  # five plain steps of request 7 at positions 20..24
        kept.append(_rows([7], [20 + step]))
    merged = kept.take_merge(_rows([7], [25]), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([7]))
    assert merged.rows.positions.tolist() == [23, 24, 25]
    assert (merged.num_merged, merged.num_dropped, merged.num_deferred) == (2, 3, 5)
    with pytest.raises(ValueError, match="window must be >= 0"):
        DeferredHeadRows(4, window=-1)


def test_rows_kept_for_a_whole_plain_step_count_what_they_stand_for():
    """The window-1 plain step keeps only each request's newest row (`covers`: the rows of the step): the others
    count as deferred and dropped at once, so merged / deferred is the share of head work merges really pay."""
    kept = DeferredHeadRows(capacity=64, window=1)
    kept.append(_rows([3, 4], [9, 30]), covers=7)  # a step of 7 rows: request 4 joined with a 6-row prompt chunk
    kept.append(_rows([3, 4], [10, 31]), covers=2)
    assert kept.num_rows == 4
    assert kept.summary() == {
        "deferred_steps": 2, "deferred_rows": 9, "merged_rows": 0, "dropped_rows": 5, "kept_rows": 4,
    }  # fmt: skip
    merged = kept.take_merge(_rows([3, 4], [11, 32]), torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([3, 4]))
    assert merged.rows.positions.tolist() == [10, 11, 31, 32]
    assert (merged.num_merged, merged.num_deferred) == (2, 9)
    assert kept.summary()["dropped_rows"] == 7  # 5 never kept + 2 older kept rows the window left out


def test_capacity_is_checked_on_the_host():
    kept = DeferredHeadRows(capacity=3)
    assert kept.can_take(3) and not kept.can_take(4)
    kept.append(_rows([1, 2], [0, 0]))
    assert not kept.can_take(2)
    with pytest.raises(ValueError, match="exceed the free 1"):
        kept.append(_rows([1, 2], [1, 1]))
    assert kept.clear() == 2 and kept.num_rows == 0
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        DeferredHeadRows(0)


def test_valid_rows_leave_out_the_rejected_padding():
    qsl = torch.tensor([0, 3, 4, 7])
    last_valid = torch.tensor([1, 3, 4])  # request 0 keeps rows 0-1, request 1 row 3, request 2 row 4
    assert valid_rows(qsl, last_valid, 7).tolist() == [True, True, False, True, True, False, False]


def test_window_one_plain_step_keeps_the_row_vllm_would_lay_out_last():
    """EchoProposer._defer_newest_rows (window 1, a plain step, no vLLM propose): per request the row vLLM's
    first pass lays out last - input id = the next token, the last valid position (token_indices_to_sample, else
    the end of the request's rows), the fc of that row's auxiliary hidden states, its KV slot - and the step's
    rows counted as deferred. Other windows take the general path."""
    from types import SimpleNamespace

    from echo_vllm.vllm.proposer import EchoProposer

    qsl = torch.tensor([0, 1, 5, 7], dtype=torch.int32)  # request 0: 1 row; 1: a 4-row prompt chunk; 2: 2 rows
    aux = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)  # [N, 3H], H = 2
    fc = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    cad = SimpleNamespace(query_start_loc=qsl, slot_mapping=torch.arange(100, 107), batch_size=lambda: 3)
    kwargs = {
        "common_attn_metadata": cad,
        "target_hidden_states": aux,
        "target_positions": torch.tensor([4, 0, 1, 2, 3, 8, 9]),
        "next_token_ids": torch.tensor([41, 42, 43]),
        "token_indices_to_sample": torch.tensor([0, 4, 5]),  # request 2's last row was a rejected draft
    }

    def proposer(window: int):
        return SimpleNamespace(
            deferred_head=DeferredHeadRows(capacity=64, window=window),
            method="eagle3",
            model=SimpleNamespace(combine_hidden_states=lambda h: h @ fc),
            _request_keys=lambda batch: torch.tensor([7, 8, 9][:batch]),
        )

    p = proposer(1)
    assert EchoProposer._defer_newest_rows(p, kwargs)
    (rows,) = p.deferred_head._parts
    assert rows.input_ids.tolist() == [41, 42, 43]
    assert rows.positions.tolist() == [4, 3, 8]
    assert torch.equal(rows.hidden, aux[[0, 4, 5]] @ fc)
    assert rows.slots.tolist() == [100, 104, 105] and rows.keys.tolist() == [7, 8, 9]
    assert p.deferred_head.summary()["deferred_rows"] == 7  # the step's rows, 4 of them dropped at once
    # Without token_indices_to_sample the last row of each request is the one.
    p = proposer(1)
    assert EchoProposer._defer_newest_rows(p, {**kwargs, "token_indices_to_sample": None})
    assert p.deferred_head._parts[0].positions.tolist() == [4, 3, 9]
    for window in (0, 2):
        p = proposer(window)
        assert not EchoProposer._defer_newest_rows(p, kwargs) and p.deferred_head.num_rows == 0
