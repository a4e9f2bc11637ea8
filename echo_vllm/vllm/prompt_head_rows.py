"""Which rows of a step the draft head's first pass runs when requests join (one job: the prompt-tail plan).

Why: vLLM's EAGLE proposer runs the head's first pass (the fc over the target's auxiliary hidden states, then the
head's decoder layer) over every row of the step's target forward, prompt chunks of joining requests included,
only to write the head's KV for those positions. Under load most steps carry such chunks: on the CPU testbed a
prompt row cost the proposer ~0.025 ms (batch 16 and 64, s33 refits), ~117 rows per HumanEval prompt, for 64
generated tokens per request. With `prompt_head_window` W the first pass runs only each prefilling request's W
newest rows (the last one is the row the head drafts from); its older prompt positions leave the head's KV
unwritten, as `deferred_head_window` leaves a plain stretch's (drafts may get worse, output cannot change:
verification decides every token).

Only prefilling requests (the runner's `is_prefilling`, on the host) are cut: a decoding request keeps all of its
rows (its next-token row and the rows of the drafts it verified), so chains and trees draft as before.
Plain torch (no vLLM import); the plan is computed on the host from host tensors (no device sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptTailPlan:
    """The first pass's rows after the cut, as index plans on the host.

    keep: [N'] int64 rows of the step kept, in order; query_start_loc: [B + 1] int32, the kept rows' per-request
    ranges; shift: [B] int64, how far each request's rows moved towards the front (its last row's old index
    minus its new one), which maps a per-request sample index; max_query_len: the longest kept range;
    num_cut: rows left out; cut: [num_cut] int64 those rows, in order (each is followed by a row of its own
    request: a request's kept tail holds its last row)."""

    keep: torch.Tensor
    query_start_loc: torch.Tensor
    shift: torch.Tensor
    max_query_len: int
    num_cut: int
    cut: torch.Tensor


def prompt_tail_plan(
    query_start_loc: torch.Tensor, is_prefilling: torch.Tensor, window: int, num_rows: int
) -> PromptTailPlan | None:
    """The plan that keeps each prefilling request's `window` newest rows (and every row of the others), or None
    when nothing would be cut (no prefilling request has more rows, a window of 0, rows past the batch's last
    range, e.g. padding a graph would carry).

    query_start_loc: [B + 1] the step's per-request row ranges (host); is_prefilling: [>= B] bool (host)."""
    batch = query_start_loc.shape[0] - 1
    if window <= 0 or batch <= 0 or is_prefilling.shape[0] < batch:
        return None
    prefilling = is_prefilling[:batch].to(torch.bool)
    if not bool(prefilling.any()):  # most steps under steady load: nobody joins, nothing more to compute
        return None
    qsl = query_start_loc.to(torch.int64)
    if int(qsl[-1]) != num_rows:
        return None
    lengths = qsl[1:] - qsl[:-1]
    kept = torch.where(prefilling, lengths.clamp(max=window), lengths)
    num_cut = int((lengths - kept).sum())
    if num_cut == 0:
        return None
    ends = qsl[1:]
    new_ends = torch.cumsum(kept, 0)
    # Row r of request i stays when it is among the request's kept[i] last rows.
    request = torch.repeat_interleave(torch.arange(batch), lengths)
    rows = torch.arange(num_rows)
    stays = rows >= (ends - kept)[request]
    keep = torch.nonzero(stays).squeeze(1)
    new_qsl = torch.zeros(batch + 1, dtype=torch.int32)
    new_qsl[1:] = new_ends.to(torch.int32)
    cut = torch.nonzero(~stays).squeeze(1)
    return PromptTailPlan(keep, new_qsl, ends - new_ends, int(kept.max()), num_cut, cut)
