"""prompt_head_window's plan (`echo_vllm.vllm.prompt_head_rows`): which first-pass rows the draft head runs when
requests join. Plain torch; the engine-level test (greedy identity with the cut) is tests/test_vllm_prompt_head_window.py."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm.vllm.prompt_head_rows import prompt_tail_plan


def _qsl(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return out


def test_a_prefilling_request_keeps_its_newest_rows_and_decoding_requests_keep_all():
    # Request 0 decodes with 2 drafts (3 rows), 1 prefills 7 rows, 2 decodes plain (1 row), 3 prefills 8 rows.
    qsl = _qsl([3, 7, 1, 8])
    plan = prompt_tail_plan(qsl, torch.tensor([False, True, False, True]), 2, 19)
    assert plan is not None
    assert plan.keep.tolist() == [0, 1, 2, 8, 9, 10, 17, 18]
    assert plan.query_start_loc.tolist() == [0, 3, 5, 6, 8]
    assert plan.query_start_loc.dtype == torch.int32
    assert plan.max_query_len == 3 and plan.num_cut == 11
    assert plan.cut.tolist() == [3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16]  # what the head's KV writer gets
    # A per-request sample index (each request's last valid row) lands on the same row after the cut.
    sample = torch.tensor([1, 9, 10, 18])  # request 0 rejected its last draft: its valid row is 1, not 2
    moved = sample - plan.shift
    assert plan.keep[moved].tolist() == sample.tolist()


def test_nothing_to_cut_gives_no_plan():
    qsl = _qsl([3, 7, 1])
    prefilling = torch.tensor([False, True, False])
    assert prompt_tail_plan(qsl, prefilling, 0, 11) is None  # the setting is off
    assert prompt_tail_plan(qsl, prefilling, 7, 11) is None  # the prompt chunk fits the window
    assert prompt_tail_plan(qsl, torch.tensor([False, False, False]), 2, 11) is None  # nobody prefills
    assert prompt_tail_plan(qsl, prefilling, 2, 16) is None  # rows past the last range (graph padding): left alone
    assert prompt_tail_plan(qsl, prefilling[:2], 2, 11) is None  # a flag per request is needed
    assert prompt_tail_plan(_qsl([]), torch.tensor([], dtype=torch.bool), 2, 0) is None


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=9),
    window=st.integers(1, 6),
)
def test_the_plan_is_each_request_s_tail_in_order(rows, window):
    lengths = [n for n, _ in rows]
    prefilling = torch.tensor([p for _, p in rows])
    total = sum(lengths)
    plan = prompt_tail_plan(_qsl(lengths), prefilling, window, total)
    expected, start, new_lengths = [], 0, []
    for n, p in rows:
        kept = min(n, window) if p else n
        expected += list(range(start + n - kept, start + n))
        new_lengths.append(kept)
        start += n
    if len(expected) == total:
        assert plan is None
        return
    assert plan is not None
    assert plan.keep.tolist() == expected
    assert plan.query_start_loc.tolist() == _qsl(new_lengths).tolist()
    assert plan.num_cut == total - len(expected) and plan.max_query_len == max(new_lengths)
    last = _qsl(lengths)[1:].long() - 1
    assert plan.keep[last - plan.shift].tolist() == last.tolist()  # every request's last row survives, mapped
    # The rows left out are the rest, in order, and each one's next row (its next token) is in its own request.
    assert plan.cut.tolist() == sorted(set(range(total)) - set(expected))
    request_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    assert torch.equal(request_of[plan.cut + 1], request_of[plan.cut])
