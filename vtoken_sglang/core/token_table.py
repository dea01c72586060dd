"""The Token Table: per request, its live KV entries in logical order; per KV slot, the metadata of the token in
it; per page, live counts (``PageAccounting``).

Row ``r`` (one request) holds, in columns ``0 .. live_len[r]-1``, the physical KV slots of its live tokens::

    slots[r, j]          physical KV slot of the j-th live token      (this is SGLang's ``req_to_token[r, j]``)

and each slot ``s`` read by some row holds the metadata of its token, read through the rows like the K/V::

    logical[s]           its logical position (RoPE position); strictly increasing along each row
    readers[s]           how many active rows hold ``s`` among their live entries

so vToken's metadata is sized by the KV pool (``pool_slots``), not by rows x context. ``logical_len[r]`` is the
next logical position (prompt + generated so far). Columns past ``live_len[r]`` are garbage. A slot of a shared
prefix (a radix-tree page) is read by several rows: its logical position is the same for all (a prefix starts at
position 0). Policy state is each request's own (``state_store.StateStore``): per slot for a row's private
entries, per row for the shared prefix it declared when it opened (``open_rows(shared=...)``); 0 when the entry
starts.
Invariants (checked by ``integrity.check_integrity``):

- a private page's live count equals the number of live entries of its owner in it; a page whose count reaches 0
  is freed at once (that alone is Naive-Evict); ``readers[s]`` counts the live entries that hold ``s``;
- the newest token of a request (its last column) is never evicted, so its page, the *tail page* that the next
  token is written into at ``slots[r, live_len-1] + 1``, stays owned by the request while it lives;
- eviction changes the rows only; relocation (``apply_moves``) changes slots and carries their metadata to the
  new slots, never changing logical ids or order.

Decode tokens the engine already wrote into the row store may be registered late (``defer_decode_tokens``, a host
count per row; ``settle`` registers them all): every reader of the table settles first, the length properties
``live_len``/``logical_len`` and every method here by themselves, so a deferred token is never seen missing.

All operations are batched over requests and vectorized (no per-token Python loop).
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken_sglang import cpu_ops
from vtoken_sglang.core.pages import TREE, PageAccounting, tail_room
from vtoken_sglang.core.registration import Registration
from vtoken_sglang.core.row_reads import RowReads
from vtoken_sglang.core.segments import packed_slots, repeat_rows, segment_ranks
from vtoken_sglang.core.state_store import StateStore


class TokenTable(RowReads, Registration):
    def __init__(
        self,
        num_rows: int,
        max_context: int,
        pages: PageAccounting,
        slots: torch.Tensor | None = None,
        state_names: tuple[str, ...] = (),
        cpu_kernels: bool | None = None,
    ):
        """``slots``: an existing int32 ``[num_rows, max_context]`` tensor to use as the row store (SGLang's
        ``req_to_token``); a new one is made otherwise. Per-slot metadata covers the pool's pages 0..num_pages.
        ``cpu_kernels``: register tokens and fold state with vToken's CPU kernels (``cpu_ops``; same results as the
        torch ops); default: on a CPU where they are built."""
        dev = pages.device
        self.pages = pages
        self.page_size = pages.page_size
        self.num_rows = num_rows
        self.max_context = max_context
        self.slots = slots if slots is not None else torch.zeros(num_rows, max_context, dtype=torch.int32, device=dev)
        assert self.slots.shape == (num_rows, max_context)
        self.pool_slots = (pages.num_pages + 1) * self.page_size
        self.logical = torch.zeros(self.pool_slots, dtype=torch.int32, device=dev)
        self.readers = torch.zeros(self.pool_slots, dtype=torch.int32, device=dev)
        self.states = StateStore(state_names, self.pool_slots, num_rows, dev)
        self.state = self.states.tensors  # name -> float32 [pool_slots + extent capacity] (``StateStore``)
        self._live_len = torch.zeros(num_rows, dtype=torch.int64, device=dev)
        self._logical_len = torch.zeros(num_rows, dtype=torch.int64, device=dev)
        self._deferred = np.zeros(num_rows, dtype=np.int64)  # decode tokens written, not registered yet (host)
        self._n_deferred = 0
        self.active = torch.zeros(num_rows, dtype=torch.bool, device=dev)
        self.row_key = torch.arange(num_rows, dtype=torch.int64, device=dev)  # per-request identity for policies
        if cpu_kernels is None:
            cpu_kernels = dev.type == "cpu" and cpu_ops.load()
        elif cpu_kernels and not cpu_ops.load():
            raise RuntimeError("cpu_kernels=True, but vToken's CPU kernels are not there (see the log line above)")
        self.kernels = torch.ops.vtoken_cpu if cpu_kernels else None

    @property
    def live_len(self) -> torch.Tensor:
        """``[num_rows]`` live entries per row (deferred tokens settled first)."""
        if self._n_deferred:
            self.settle()
        return self._live_len

    @property
    def logical_len(self) -> torch.Tensor:
        """``[num_rows]`` next logical position per row (deferred tokens settled first)."""
        if self._n_deferred:
            self.settle()
        return self._logical_len

    @property
    def deferred_tokens(self) -> int:
        """Decode tokens written into the row store and not registered yet (``defer_decode_tokens``)."""
        return self._n_deferred

    def metadata_bytes(self) -> int:
        """Device bytes of vToken's own per-slot and per-row metadata (the row store is the engine's)."""
        tensors = [self.logical, self.readers, self.live_len, self.logical_len, self.active, self.row_key]
        return sum(t.numel() * t.element_size() for t in tensors) + self.states.nbytes()

    # ------------------------------------------------------------------ request lifetime

    def open_rows(self, rows: torch.Tensor, keys: torch.Tensor | None = None, shared: np.ndarray | None = None) -> None:
        """Start requests in ``rows`` (empty rows). ``keys``: a stable identity per request (default: the row),
        so that policies decide the same whatever row an engine gives the request. ``shared[i]`` (host ints,
        default 0): the number of leading entries row ``rows[i]`` registers first from pages it does not own (a
        tree prefix); each keeps its policy state in the row's own cells."""
        self.settle()
        assert not bool(self.active[rows].any()), "row already in use"
        self.active[rows] = True
        self.live_len[rows] = 0
        self.logical_len[rows] = 0
        self.row_key[rows] = rows.to(torch.int64) if keys is None else keys.to(torch.int64)
        self.states.open(rows, shared)

    def close_row(self, row: int) -> torch.Tensor:
        """End a request: drop its entries and return the private pages it held (the caller frees them, after
        whatever grace its engine needs). Tree pages are left to the tree."""
        self.settle()
        n = int(self.live_len[row])
        slots = self.slots[row, :n].to(torch.int64)
        self.readers.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
        pages = torch.unique(slots // self.page_size)
        pages = pages[self.pages.owner[pages] == row]
        self.pages.live[pages] = 0
        self.active[row] = False
        self.live_len[row] = 0
        self.states.close(row)
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
            first = (torch.cumsum(new_pages, 0) - new_pages)[req[spill]]  # each request's first fresh page
            out[spill] = packed_slots(fresh, first, beyond[spill], P)
        return out

    def append(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Allocate slots for new tokens and register them (a standalone engine's write path). Returns the slots."""
        slots = self.alloc_slots(rows, counts)
        self.sync_new_tokens(rows, counts, slots)
        return slots

    # ------------------------------------------------------------------ eviction

    def evict(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Evict the live entries at ``(rows[i], cols[i])`` (column indices into the current live rows; pairs
        unique). Compacts the affected rows stably, decrements page counts and returns the private pages that
        became empty; the caller frees them (``PageAccounting.free``) at once, or after its engine's grace period.
        Metadata only: no KV moves."""
        self.settle()
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
        return self._drop(affected, width, keep, victims)

    def _drop(self, rows: torch.Tensor, width: int, keep: torch.Tensor, victims: torch.Tensor) -> torch.Tensor:
        """Keep the ``[k, width]`` columns ``keep`` of ``rows`` (compacted stably, with their policy state) and let
        go of the entries in slots ``victims``; the private pages left empty."""
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept columns first, in order
        self.slots[rows, :width] = torch.gather(self.slots[rows, :width], 1, order)
        self.states.compact_rows(rows, width, keep, order)
        self.live_len[rows] = keep.sum(1)
        self.readers.index_add_(0, victims, torch.full_like(victims, -1, dtype=torch.int32))
        return self.pages.add_live(victims, -1)

    def evict_token(self, row: int, logical_id: int) -> torch.Tensor:
        """The paper's single-token API: evict the token with logical id ``logical_id`` of request ``row``."""
        n = int(self.live_len[row])
        logical = self.row_logical(torch.tensor([row], device=self.slots.device), n)[0]
        col = int(torch.searchsorted(logical.contiguous(), torch.tensor(logical_id, dtype=torch.int32)))
        assert col < n and int(logical[col]) == logical_id, "token is not live"
        return self.evict(torch.tensor([row]), torch.tensor([col]))

    def truncate(self, rows: torch.Tensor, logical_end: torch.Tensor) -> torch.Tensor:
        """Roll requests back: drop each row ``rows[i]``'s live entries at logical positions ``>= logical_end[i]``
        (its newest: the tokens of a turn that is undone) and make ``logical_end[i]`` its next logical position, so
        that its next tokens take those positions again. Rows unique; each keeps at least one entry, and no end is
        past its row's logical length. Returns the private pages left empty; the caller frees them. Entries sit in
        column order within a row's own page (appends and relocations fill pages in order), so the slots after the
        new last entry in its page are the dropped ones': the tail-page rule holds after."""
        self.settle()
        if rows.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.slots.device)
        rows, end = rows.to(torch.int64), logical_end.to(torch.int64).to(self.slots.device)
        assert bool((end <= self.logical_len[rows]).all()), "truncate past a row's logical length"
        live = self.live_len[rows]
        width = int(live.max())
        valid = torch.arange(width, device=rows.device)[None, :] < live[:, None]
        keep = valid & (self.row_logical(rows, width).to(torch.int64) < end[:, None])
        assert bool(keep[:, 0].all()), "a truncated row keeps at least one entry"
        r, c = torch.nonzero(valid & ~keep, as_tuple=True)
        self.logical_len[rows] = end
        return self._drop(rows, width, keep, self.slots[rows[r], c].to(torch.int64))

    # ------------------------------------------------------------------ relocation (internal)

    def apply_moves(self, rows: torch.Tensor, cols: torch.Tensor, new_slots: torch.Tensor) -> None:
        """Publish a relocation: the entries at ``(rows, cols)`` now live at ``new_slots`` (their K/V already
        copied there, into fresh slots of their rows' own pages). Live counts move from old to new pages; each
        entry's logical id and policy state go to its new slot (a tree slot keeps its own for its other readers;
        a shared entry becomes private, ``StateStore.move_sources``); logical ids and order are unchanged. The old
        pages are not freed here: the reclaimer releases them after the grace period."""
        self.settle()
        rows, cols = rows.to(torch.int64), cols.to(torch.int64)
        old = self.slots[rows, cols].to(torch.int64)
        new = new_slots.to(torch.int64)
        self.logical[new] = self.logical[old]
        src = self.states.move_sources(rows, cols, old)
        for t in self.state.values():
            t[new] = t[src]
        self.readers[new] = 1
        self.readers.index_add_(0, old, torch.full_like(old, -1, dtype=torch.int32))
        self.pages.add_live(old, -1)
        self.slots[rows, cols] = new.to(self.slots.dtype)
        self.pages.add_live(new, +1)


__all__ = ["TokenTable", "TREE"]
