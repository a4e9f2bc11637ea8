"""The draft head's first-pass rows of plain steps, kept until the next step that drafts (one job: keep and merge).

Why: on a step whose budget verifies no drafts (draft depth 0), vLLM still runs the EAGLE head's first pass over
the step's tokens, only to write the head's KV for them ("the prefill forward pass above already ran to keep the
drafter KV cache in sync", llm_base_proposer.propose). At high load that pass is most of what a plain ECHO step
costs over no-spec decoding (batch 32 on the CPU testbed: ~3.5 of ~28 ms). Deferred, the same rows (head input
id, position, hidden state, KV slot) go in front of each request's rows of the next first pass, which writes the
same KV from the same inputs in one batched pass: with `deferred_head_window` 0 the head then drafts from the
context it would have had (up to float summation order); with a window W (default 1) only each request's W newest
rows are merged and older ones dropped (see DeferredHeadRows). Verification keeps the output exact whatever the
head saw.

A request's kept rows are merged only while they are the positions right before its rows of the merging step
(contiguous, oldest first); anything else (a finished or preempted request, a gap from a step vLLM ran without
the drafter) is dropped, which only leaves those head KV slots unwritten: drafts may get worse, output cannot.

Plain torch (no vLLM import): the proposer hands in its buffers' rows and gets index plans back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadRows:
    """First-pass rows of the EAGLE head, flat: row j is position `positions[j]` of request `keys[j]`."""

    input_ids: torch.Tensor  # [N] the head's input ids (already shifted: the token after each position)
    positions: torch.Tensor  # [N]
    hidden: torch.Tensor  # [N, H] the head's input hidden states (after combine_hidden_states)
    slots: torch.Tensor  # [N] KV slots (the EAGLE layers share the target's block table)
    keys: torch.Tensor  # [N] int64 request keys (stable per request while rows are kept)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def copy(self) -> HeadRows:
        """The rows as their own tensors (the proposer's buffers they view are overwritten next step)."""
        return HeadRows(
            self.input_ids.clone(), self.positions.clone(), self.hidden.clone(), self.slots.clone(), self.keys.clone()
        )

    def select(self, index: torch.Tensor) -> HeadRows:
        return HeadRows(
            self.input_ids[index], self.positions[index], self.hidden[index], self.slots[index], self.keys[index]
        )


@dataclass(frozen=True)
class MergedRows:
    """The merging step's first pass: kept rows of each request, then its own rows."""

    rows: HeadRows  # [N'] in the new order
    query_start_loc: torch.Tensor  # [B + 1] int32, the new per-request row ranges
    max_query_len: int
    current_to_merged: torch.Tensor  # [N] where each of the step's own rows went (maps token_indices_to_sample)
    num_merged: int  # kept rows that went in
    num_dropped: int  # kept rows that could not (finished, preempted, not contiguous, outside the window)
    num_deferred: int = 0  # rows deferred since the previous merge (trimmed ones included): merged / deferred is
    # the share of a plain step's head work that a later first pass pays


def request_of_rows(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[N] the request of every row of a flat batch with row ranges `query_start_loc` [B + 1]."""
    rows = torch.arange(num_rows, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), rows, right=True)


def valid_rows(query_start_loc: torch.Tensor, last_valid: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[N] bool: rows at or before their request's last valid row (after them: padding of rejected drafts)."""
    req = request_of_rows(query_start_loc, num_rows).clamp(max=max(0, last_valid.shape[0] - 1))
    rows = torch.arange(num_rows, device=query_start_loc.device)
    return rows <= last_valid.to(rows.dtype)[req]


class DeferredHeadRows:
    """Head rows of plain steps, at most `capacity` (the proposer grows its buffers by that much).

    `window` W > 0 (`deferred_head_window`): a merge takes only each request's W newest kept rows, and a full
    stash is trimmed to them instead of merged. Older rows never get the head's pass: their head KV slots stay
    unwritten (holes the head's attention reads as whatever the slot held), so drafts may get worse while the
    output cannot change. Why: after a long plain stretch (high load, where the depth plan sits at plain decoding)
    the full merge is head work on every position of the stretch, prompts of joining requests included, which
    plain decoding without ECHO never pays; an EAGLE-3 head leans mostly on the target's hidden states of the
    newest positions (measured on the testbed: 3 of 4 steps' rows dropped, prompts included, cost 5 % of its
    acceptance)."""

    def __init__(self, capacity: int, window: int = 0):
        if capacity < 1:
            raise ValueError(f"DeferredHeadRows: capacity must be >= 1; got {capacity}")
        if window < 0:
            raise ValueError(f"DeferredHeadRows: window must be >= 0 (0 = merge every kept row); got {window}")
        self.capacity = capacity
        self.window = window
        self._parts: list[HeadRows] = []
        self.num_rows = 0  # host count: the capacity check needs no device read
        self._deferred_since_merge = 0
        self.deferred_rows = 0  # lifetime counters (echo_stats)
        self.merged_rows = 0
        self.dropped_rows = 0
        self.deferred_steps = 0

    def summary(self) -> dict[str, int]:
        """What deferral did since the last reset (echo_stats()['deferred_head'])."""
        return {
            "deferred_steps": self.deferred_steps,
            "deferred_rows": self.deferred_rows,
            "merged_rows": self.merged_rows,
            "dropped_rows": self.dropped_rows,
            "kept_rows": self.num_rows,
        }

    def reset_counters(self) -> None:
        self.deferred_rows = self.merged_rows = self.dropped_rows = self.deferred_steps = 0

    def can_take(self, num_rows: int) -> bool:
        return self.num_rows + num_rows <= self.capacity

    def append(self, rows: HeadRows, covers: int | None = None) -> None:
        """Keep `rows`; `covers` (>= their number): the first-pass rows of the plain step they stand for, when the
        caller kept only the newest of them (window 1); the others count as deferred and dropped at once."""
        if not self.can_take(rows.num_rows):
            raise ValueError(f"DeferredHeadRows: {rows.num_rows} rows exceed the free {self.capacity - self.num_rows}")
        covered = rows.num_rows if covers is None else max(int(covers), rows.num_rows)
        if rows.num_rows:
            self._parts.append(rows)
        self.num_rows += rows.num_rows
        self.deferred_rows += covered
        self.dropped_rows += covered - rows.num_rows
        self._deferred_since_merge += covered
        self.deferred_steps += 1

    def trim(self) -> int:
        """window > 0: keep only each request's `window` newest kept rows (the ones a merge would take if the
        request's next rows follow them); returns how many were dropped. Without a window, nothing."""
        if self.window <= 0 or not self._parts:
            return 0
        kept = _concat(self._parts)
        n = kept.num_rows
        keys = kept.keys.to(torch.int64)
        # Group by request, append order kept within a group (stable), then rank each row from its group's end.
        order = torch.sort(keys, stable=True).indices
        sorted_keys = keys[order]
        _, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
        ends = torch.repeat_interleave(torch.cumsum(counts, 0), counts)
        from_end = ends - 1 - torch.arange(n, device=keys.device)
        keep = torch.sort(order[from_end < self.window]).values  # back to append order
        trimmed = kept.select(keep)
        dropped = n - trimmed.num_rows
        self._parts, self.num_rows = ([trimmed] if trimmed.num_rows else []), trimmed.num_rows
        self.dropped_rows += dropped
        return dropped

    def clear(self) -> int:
        """Drop every kept row (counted as dropped); returns how many."""
        dropped, self._parts, self.num_rows = self.num_rows, [], 0
        self.dropped_rows += dropped
        return dropped

    def take_merge(self, current: HeadRows, query_start_loc: torch.Tensor, keys_now: torch.Tensor) -> MergedRows:
        """Merge the kept rows into the step's own rows `current` (row ranges `query_start_loc`, request keys
        `keys_now` [B]) and forget them. Vectorised: no loop over requests."""
        device = current.input_ids.device
        batch = int(keys_now.shape[0])
        qsl = query_start_loc.to(torch.int64)
        num_current = current.num_rows
        kept = _concat(self._parts) if self._parts else None
        self._parts, self.num_rows = [], 0
        deferred, self._deferred_since_merge = self._deferred_since_merge, 0
        lengths = qsl[1:] - qsl[:-1]
        dropped = 0
        if kept is not None and (batch == 0 or num_current == 0):
            dropped, kept = kept.num_rows, None
            self.dropped_rows += dropped
        if kept is None or kept.num_rows == 0:
            return MergedRows(
                current, query_start_loc, int(lengths.max()) if batch else 0,
                torch.arange(num_current, device=device), 0, dropped, deferred,
            )  # fmt: skip
        n = kept.num_rows
        # The batch row of every kept row (B: not in this batch).
        sorted_keys, order = torch.sort(keys_now.to(torch.int64))
        slot = torch.searchsorted(sorted_keys, kept.keys).clamp(max=batch - 1)
        found = sorted_keys[slot] == kept.keys
        row_of = torch.where(found, order[slot], torch.full_like(slot, batch))
        # Group by batch row, oldest first (a stable sort keeps the append order within a request).
        perm = torch.sort(row_of * n + torch.arange(n, device=device)).indices
        grouped, row_sorted = kept.select(perm), row_of[perm]
        group_size = torch.bincount(row_sorted, minlength=batch + 1)
        group_start = torch.cumsum(group_size, 0) - group_size
        rank = torch.arange(n, device=device) - group_start[row_sorted]
        from_end = group_size[row_sorted] - 1 - rank
        # A kept row fits if it is the position right before the request's rows here, counted from the end ...
        first_here = torch.where(
            lengths > 0, current.positions.to(torch.int64)[qsl[:-1].clamp(max=num_current - 1)], -1
        )
        first_here = torch.cat([first_here, first_here.new_full((1,), -1)])  # group B: never fits
        fits = (row_sorted < batch) & (grouped.positions.to(torch.int64) == first_here[row_sorted] - 1 - from_end)
        # ... and every later row of its request fits too (a contiguous suffix; older rows behind a gap drop).
        last_misfit = torch.full((batch + 1,), -1, dtype=torch.int64, device=device)
        last_misfit.scatter_reduce_(0, row_sorted, torch.where(fits, -1, rank), reduce="amax")
        keep = fits & (rank > last_misfit[row_sorted])
        if self.window > 0:  # only the newest `window` rows (a contiguous suffix still)
            keep &= from_end < self.window
        merged_in = grouped.select(keep)
        row_kept = row_sorted[keep]
        kept_count = torch.bincount(row_kept, minlength=batch + 1)[:batch]
        new_lengths = lengths + kept_count
        new_qsl = torch.zeros(batch + 1, dtype=torch.int64, device=device)
        new_qsl[1:] = torch.cumsum(new_lengths, 0)
        kept_start = torch.cumsum(kept_count, 0) - kept_count
        kept_rank = torch.arange(row_kept.shape[0], device=device) - kept_start[row_kept]
        dest_kept = new_qsl[row_kept] + kept_rank
        req_current = request_of_rows(qsl, num_current)
        dest_current = (
            new_qsl[req_current]
            + kept_count[req_current]
            + (torch.arange(num_current, device=device) - qsl[req_current])
        )
        total = num_current + merged_in.num_rows
        rows = _scatter_rows(total, (dest_kept, merged_in), (dest_current, current))
        num_merged = merged_in.num_rows
        self.merged_rows += num_merged
        self.dropped_rows += n - num_merged
        return MergedRows(
            rows, new_qsl.to(query_start_loc.dtype), int(new_lengths.max()), dest_current, num_merged, n - num_merged,
            deferred,
        )  # fmt: skip


def _concat(parts: list[HeadRows]) -> HeadRows:
    if len(parts) == 1:
        return parts[0]
    return HeadRows(
        *(torch.cat([getattr(p, f) for p in parts]) for f in ("input_ids", "positions", "hidden", "slots", "keys"))
    )


def _scatter_rows(total: int, *pieces: tuple[torch.Tensor, HeadRows]) -> HeadRows:
    first = pieces[0][1]
    out = HeadRows(
        first.input_ids.new_empty(total),
        first.positions.new_empty(total),
        first.hidden.new_empty((total, first.hidden.shape[1])),
        first.slots.new_empty(total),
        first.keys.new_empty(total),
    )
    for dest, rows in pieces:
        out.input_ids[dest] = rows.input_ids.to(out.input_ids.dtype)
        out.positions[dest] = rows.positions.to(out.positions.dtype)
        out.hidden[dest] = rows.hidden.to(out.hidden.dtype)
        out.slots[dest] = rows.slots.to(out.slots.dtype)
        out.keys[dest] = rows.keys.to(out.keys.dtype)
    return out
