"""echo_vllm.bench.flights: steps in flight per request from the step each finished in (first come, first served)."""

from __future__ import annotations

import pytest

from echo_vllm.bench.flights import request_flights


def test_a_request_runs_from_the_step_after_the_slot_it_takes_was_freed():
    # Batch 2, four requests: 0 and 1 start at once and finish in steps 3 and 5; request 2 takes request 0's slot
    # (freed in step 3) and finishes in step 6; request 3 takes request 1's (step 5) and finishes in step 12.
    flights = request_flights([3, 5, 6, 12], max_num_seqs=2)
    assert flights.steps == [3, 5, 3, 7]
    assert flights.median == 4.0
    assert flights.slowest[:2] == [(3, 7), (1, 5)]
    assert flights.last_admitted == 7  # the drain: 7 steps after the queue emptied


def test_slots_free_in_finish_order_not_request_order():
    # Request 1 finishes first (step 2): request 2 takes its slot, not request 0's.
    flights = request_flights([4, 2, 5], max_num_seqs=2)
    assert flights.steps == [4, 2, 3]


def test_one_batch_runs_every_request_from_the_first_step():
    assert request_flights([2, 3], max_num_seqs=4).steps == [2, 3]
    assert request_flights([], max_num_seqs=4).steps == []
    with pytest.raises(ValueError, match="max_num_seqs"):
        request_flights([1], max_num_seqs=0)
