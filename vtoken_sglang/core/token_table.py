"""The Token Table: per request, its live KV entries in logical order; per page, live counts (``PagePool``).

Row ``r`` (one request) holds, in columns ``0 .. live_len[r]-1``::

    slots[r, j]        physical KV slot of the j-th live token      (this is SGLang's ``req_to_token[r, j]``)
    logical[r, j]      its logical position (RoPE position), strictly increasing in j
    state[name][r, j]  row-aligned policy state (e.g. accumulated attention), moved with the entry

and ``logical_len[r]`` is the next logical position (prompt + generated so far). Columns past ``live_len[r]`` are
garbage. Invariants (checked by ``integrity.check_integrity``):

- a private page's live count equals the number of live entries of its owner in it; a page whose count reaches 0
  is freed at once (that alone is Naive-Evict);
- the newest token of a request (its last column) is never evicted, so its page, the *tail page* that the next
  token is written into at ``slots[r, live_len-1] + 1``, stays owned by the request while it lives;
- eviction changes metadata only; relocation (``apply_moves``) changes slots, never logical ids or order.

All operations are batched over requests and vectorized (no per-token Python loop).
"""

from __future__ import annotations

import torch

from vtoken_sglang.core.pages import FREE, TREE, PagePool, tail_room
from vtoken_sglang.core.segments import repeat_rows, segment_ranks


class TokenTable:
    def __init__(
        self,
        num_rows: int,
        max_context: int,
        pages: PagePool,
        slots: torch.Tensor | None = None,
        state_names: tuple[str, ...] = (),
    ):
        """``slots``: an existing int32 ``[num_rows, max_context]`` tensor to use as the row store (SGLang's
        ``req_to_token``); a new one is made otherwise."""
        dev = pages.device
        self.pages = pages
        self.page_size = pages.page_size
        self.num_rows = num_rows
        self.max_context = max_context
        self.slots = slots if slots is not None else torch.zeros(num_rows, max_context, dtype=torch.int32, device=dev)
        assert self.slots.shape == (num_rows, max_context)
        self.logical = torch.zeros(num_rows, max_context, dtype=torch.int32, device=dev)
        self.state = {name: torch.zeros(num_rows, max_context, dtype=torch.float32, device=dev) for name in state_names}
        self.live_len = torch.zeros(num_rows, dtype=torch.int64, device=dev)
        self.logical_len = torch.zeros(num_rows, dtype=torch.int64, device=dev)
        self.active = torch.zeros(num_rows, dtype=torch.bool, device=dev)
        self.row_key = torch.arange(num_rows, dtype=torch.int64, device=dev)  # per-request identity for policies

    # ------------------------------------------------------------------ request lifetime

    def open_rows(self, rows: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """Start requests in ``rows`` (empty rows). ``keys``: a stable identity per request (default: the row),
        so that policies decide the same whatever row an engine gives the request."""
        assert not bool(self.active[rows].any()), "row already in use"
        self.active[rows] = True
        self.live_len[rows] = 0
        self.logical_len[rows] = 0
        self.row_key[rows] = rows.to(torch.int64) if keys is None else keys.to(torch.int64)

    def close_row(self, row: int) -> torch.Tensor:
        """End a request: drop its entries and return the private pages it held (the caller frees them, after
        whatever grace its engine needs). Tree pages are left to the tree."""
        n = int(self.live_len[row])
        slots = self.slots[row, :n]
        pages = torch.unique((slots // self.page_size).to(torch.int64))
        pages = pages[self.pages.owner[pages] == row]
        self.pages.live[pages] = 0
        self.active[row] = False
        self.live_len[row] = 0
        return pages

    # ------------------------------------------------------------------ appends

    def alloc_slots(self, rows: torch.Tensor, counts: torch.Tensor, for_relocation: bool = False) -> torch.Tensor:
        """Slots for ``counts[i]`` new tokens of each request ``rows[i]``, concatenated in row order: first the rest
        of the request's tail page (``last slot + 1 ...``), then new pages (``pages.tail_room``)."""
        P = self.page_size
        counts = counts.to(torch.int64)
        live = self.live_len[rows]
        last = torch.where(
            live > 0, self.slots[rows, (live - 1).clamp(min=0)].to(torch.int64), torch.full_like(live, -1)
        )
        tail_page_is_own = (last >= 0) & (self.pages.owner[(last // P).clamp(min=0)] == rows.to(torch.int32))
        room = torch.where(tail_page_is_own, tail_room(last, P), torch.zeros_like(last))
        in_tail = torch.minimum(room, counts)
        new_pages = (counts - in_tail + P - 1) // P
        fresh = self.pages.alloc(int(new_pages.sum()), repeat_rows(rows.to(torch.int64), new_pages), for_relocation)
        # The k-th new token of a request: tail slot last+1+k while k < in_tail, then its fresh pages in order.
        req, k = segment_ranks(counts)
        out = last[req] + 1 + k
        beyond = k - in_tail[req]
        spill = beyond >= 0
        if bool(spill.any()):
            page_idx = (torch.cumsum(new_pages, 0) - new_pages)[req[spill]] + beyond[spill] // P
            out[spill] = fresh[page_idx] * P + beyond[spill] % P
        return out

    def append(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Allocate slots for new tokens and register them (a standalone engine's write path). Returns the slots."""
        slots = self.alloc_slots(rows, counts)
        self.sync_new_tokens(rows, counts, slots)
        return slots

    def sync_new_tokens(
        self, rows: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor | None = None, claim_pages: bool = False
    ) -> None:
        """Register ``counts[i]`` newly written tokens of request ``rows[i]`` at the end of its row (logical ids
        ``logical_len ...``). ``slots``: their KV slots, concatenated in row order; ``None`` when the engine already
        wrote them into the row store (SGLang writes ``req_to_token`` itself). ``claim_pages``: pages of the new
        slots that the pool does not track yet (allocated by the engine) become owned by their row."""
        counts = counts.to(torch.int64)
        total = int(counts.sum())
        if total == 0:
            return
        req, k = segment_ranks(counts, total)
        r = rows.to(torch.int64)[req]
        col = self.live_len[r] + k
        assert int(col.max()) < self.max_context, "row overflow"
        if slots is not None:
            self.slots[r, col] = slots.to(self.slots.dtype)
        self._register(r, col, self.logical_len[r] + k, claim_pages)
        self.live_len.index_add_(0, rows.to(torch.int64), counts)
        self.logical_len.index_add_(0, rows.to(torch.int64), counts)

    def sync_decode_tokens(self, rows: torch.Tensor) -> None:
        """One new token per request, already in the row store, its page claimed if untracked: what
        ``sync_new_tokens(rows, ones, claim_pages=True)`` does, in less than half the tensor ops (it runs every
        decode step). ``rows`` are distinct (a batch holds a request
        once), so no two new tokens share a page, and each lands in a page of its own row: the tail page with
        room, or a fresh one claimed here. Hence no boolean indexing (a parallel region per call on shared
        cores) and no filter for tree pages. No host read: its checks run on the device."""
        r = rows.to(torch.int64)
        col = self.live_len[r]
        # checked on the device (no host read in the per-step path; on CPU it raises at once)
        torch._assert_async(col.max() < self.max_context, "row overflow")
        self.logical[r, col] = self.logical_len[r].to(torch.int32)
        for t in self.state.values():
            t[r, col] = 0
        pages = self.slots[r, col].to(torch.int64) // self.page_size
        owner, r32 = self.pages.owner[pages], r.to(torch.int32)
        owner = torch.where(owner == FREE, r32, owner)
        torch._assert_async((owner == r32).all(), "a decode token in a page of another owner")
        self.pages.owner[pages] = owner
        ones = torch.ones_like(r)
        self.pages.live.index_add_(0, pages, ones.to(torch.int32))
        self.live_len.index_add_(0, r, ones)
        self.logical_len.index_add_(0, r, ones)

    def _register(self, r: torch.Tensor, col: torch.Tensor, logical: torch.Tensor, claim_pages: bool) -> None:
        """Entries ``(r[j], col[j])`` (already holding their slots) become live tokens with logical ids ``logical``;
        per-token policy state starts at 0; their pages gain a live token each."""
        new_slots = self.slots[r, col].to(torch.int64)
        self.logical[r, col] = logical.to(torch.int32)
        for t in self.state.values():
            t[r, col] = 0
        if claim_pages:
            pages = new_slots // self.page_size
            untracked = self.pages.owner[pages] == -1
            self.pages.owner[pages[untracked]] = r[untracked].to(torch.int32)
        self.pages.add_live(new_slots, +1)

    # ------------------------------------------------------------------ eviction

    def evict(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Evict the live entries at ``(rows[i], cols[i])`` (column indices into the current live rows; pairs
        unique). Compacts the affected rows stably, decrements page counts and returns the private pages that
        became empty; the caller frees them (``PagePool.free``) at once, or after its engine's grace period.
        Metadata only: no KV moves."""
        if rows.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.slots.device)
        rows, cols = rows.to(torch.int64), cols.to(torch.int64)
        assert bool((cols < self.live_len[rows] - 1).all()), "victim out of range, or the newest token"
        victims = self.slots[rows, cols].to(torch.int64)
        affected, inverse = torch.unique(rows, return_inverse=True)
        width = int(self.live_len[affected].max())
        keep = torch.arange(width, device=rows.device)[None, :] < self.live_len[affected][:, None]
        keep[inverse, cols] = False
        assert int(self.live_len[affected].sum() - keep.sum()) == len(cols), "duplicate victims"
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept columns first, in order
        for store in (self.slots, self.logical, *self.state.values()):
            block = store[affected, :width]
            store[affected, :width] = torch.gather(block, 1, order)
        self.live_len[affected] = keep.sum(1)
        return self.pages.add_live(victims, -1)

    def evict_token(self, row: int, logical_id: int) -> torch.Tensor:
        """The paper's single-token API: evict the token with logical id ``logical_id`` of request ``row``."""
        n = int(self.live_len[row])
        col = int(torch.searchsorted(self.logical[row, :n].contiguous(), torch.tensor(logical_id, dtype=torch.int32)))
        assert col < n and int(self.logical[row, col]) == logical_id, "token is not live"
        return self.evict(torch.tensor([row]), torch.tensor([col]))

    # ------------------------------------------------------------------ relocation (internal)

    def apply_moves(self, rows: torch.Tensor, cols: torch.Tensor, new_slots: torch.Tensor) -> None:
        """Publish a relocation: the entries at ``(rows, cols)`` now live at ``new_slots`` (their K/V already
        copied there). Live counts move from old to new pages; logical ids and order are unchanged. The old
        pages are not freed here: the reclaimer releases them after the grace period."""
        rows, cols = rows.to(torch.int64), cols.to(torch.int64)
        old = self.slots[rows, cols].to(torch.int64)
        self.pages.add_live(old, -1)
        self.slots[rows, cols] = new_slots.to(self.slots.dtype)
        self.pages.add_live(new_slots.to(torch.int64), +1)

    # ------------------------------------------------------------------ views

    def row_view(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(self.live_len[row])
        return self.slots[row, :n], self.logical[row, :n]

    def tail_pages(self) -> torch.Tensor:
        """Page of the newest token of every active request (the page its next token is written into)."""
        rows = torch.nonzero(self.active & (self.live_len > 0)).flatten()
        last = self.slots[rows, self.live_len[rows] - 1].to(torch.int64)
        return last // self.page_size

    def lower_bound_pages(self) -> int:
        """Sum over active requests of ceil(live / page_size): the fewest pages their live tokens can occupy."""
        live = self.live_len[self.active]
        return int(((live + self.page_size - 1) // self.page_size).sum())


__all__ = ["TokenTable", "TREE"]
