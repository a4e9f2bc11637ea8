"""How many engine steps each request of a job was in flight, from the step each one finished in.

A job of N requests at max_num_seqs = B admits requests first come, first served: requests 0..B-1 run from the
first step, and request j >= B takes the slot the (j - B + 1)-th finished request left, so it runs from the step
after that finish. Its steps in flight are its finish step less that admission step (an upper bound by a step or
so when the scheduler's token budget delays a prompt). The last admitted request's flight is the job's drain: the
steps after the queue emptied. A method that spreads its requests' progress (deep drafts for some, few for others)
finishes its easy requests sooner and its hard ones later; in a closed job the hardest late request sets the
drain, which a server under sustained load never waits for (the bench's steady window).

Pure Python (no vLLM): the offline runner records the finish steps (`generate_with_steady_window(finished_at=)`,
the job's "finish_steps"), `scripts/profile_tree_step.py` prints the summary.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple


class Flights(NamedTuple):
    steps: list[int]  # per request (request order): engine steps from its admission to its finish
    median: float
    slowest: list[tuple[int, int]]  # (request index, steps in flight), the slowest first
    last_admitted: int  # steps in flight of the last admitted request (the drain, in steps)


def request_flights(finish_steps: list[int], max_num_seqs: int, top: int = 5) -> Flights:
    """Steps in flight per request from its finish step (1-based engine steps, request order)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1; got {max_num_seqs}")
    if not finish_steps:
        return Flights([], 0.0, [], 0)
    order = sorted(finish_steps)
    admitted = [0 if j < max_num_seqs else order[j - max_num_seqs] for j in range(len(finish_steps))]
    steps = [finish - start for finish, start in zip(finish_steps, admitted)]
    slowest = sorted(enumerate(steps), key=lambda item: (-item[1], item[0]))[:top]
    return Flights(steps, float(statistics.median(steps)), slowest, steps[-1])
