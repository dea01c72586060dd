"""``Registration``: tokens the engine wrote become live entries of the Token Table (part of ``TokenTable``, which
it is a base of): at once (``sync_new_tokens``, ``sync_decode_tokens``) or, for decode steps, at the next read
(``defer_decode_tokens``, ``settle``). On a CPU table with vToken's CPU kernels (``kernels``) tokens already in the
row store are registered in one op (``cpu_ops/token_table.cpp``: the same results as the torch ops here). Uses the
table's ``slots``, ``_live_len``/``_logical_len`` (``live_len``/``logical_len`` settle first), ``logical``,
``readers``, ``state``, ``pages``, ``page_size``, ``max_context``, ``_deferred``/``_n_deferred`` and ``kernels``.
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken_sglang.core.segments import segment_ranks


class Registration:
    def sync_new_tokens(
        self, rows: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor | None = None, claim_pages: bool = False
    ) -> None:
        """Register ``counts[i]`` newly written tokens of request ``rows[i]`` at the end of its row (logical ids
        ``logical_len ...``). ``slots``: their KV slots, concatenated in row order; ``None`` when the engine already
        wrote them into the row store (SGLang writes ``req_to_token`` itself). ``claim_pages``: pages of the new
        slots that the pool does not track yet (allocated by the engine) become owned by their row."""
        if slots is None and self.kernels is not None:
            self._register_in_kernel(rows, counts, claim_pages)
            return
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
        decode step). ``rows`` are distinct (a batch holds a request once), so no two new tokens share a page, and
        each lands in a page of its own row: the tail page with room, or a fresh one claimed here (its owner is
        written as the row either way). Hence no boolean indexing (a parallel region per call on shared cores), no
        filter for tree pages, and no host read. Fifteen small tensor ops: a row past ``max_context`` fails the
        indexing, and a page of another owner would fail the integrity check (I2), rather than spend checks here.
        With the CPU kernels: ``sync_new_tokens``'s, in one op."""
        if self.kernels is not None:
            self._register_in_kernel(rows, torch.ones_like(rows), claim_pages=True)
            return
        r = rows.to(torch.int64)
        col = self.live_len[r]
        new_slots = self.slots[r, col].to(torch.int64)  # fresh slots of the rows' own pages: no reader yet
        logical = self.logical_len[r]
        self.logical[new_slots] = logical.to(torch.int32)
        self.readers[new_slots] = 1
        for t in self.state.values():
            t[new_slots] = 0
        pages = new_slots // self.page_size
        self.pages.owner[pages] = r.to(torch.int32)
        self.pages.live.index_add_(0, pages, torch.ones_like(pages, dtype=torch.int32))
        self.live_len[r] = col + 1
        self.logical_len[r] = logical + 1

    def defer_decode_tokens(self, rows: np.ndarray) -> None:
        """``sync_decode_tokens`` of ``rows`` (distinct host row ids), registered at the next ``settle``: a decode
        step that nothing reads the table after costs one host add. Until then the rows' slots hold the tokens
        and nothing else shows them; whatever reads the table settles first."""
        self._deferred[rows] += 1
        self._n_deferred += len(rows)

    def settle(self) -> None:
        """Register every deferred decode token: the table, pages and policy state become what one
        ``sync_decode_tokens`` per deferred step would have left."""
        if not self._n_deferred:
            return
        rows = np.flatnonzero(self._deferred)
        counts = self._deferred[rows]
        self._deferred[rows] = 0
        self._n_deferred = 0
        if self.kernels is not None:  # a CPU table: the host arrays as they are
            self._register_in_kernel(torch.from_numpy(rows), torch.from_numpy(counts), claim_pages=True)
            return
        dev = self.slots.device
        r = torch.from_numpy(rows).to(dev)
        if counts.max() == 1:  # one step deferred (a table read after every step): the short path
            self.sync_decode_tokens(r)
        else:
            self.sync_new_tokens(r, torch.from_numpy(counts).to(dev), claim_pages=True)

    def _register_in_kernel(self, rows: torch.Tensor, counts: torch.Tensor, claim_pages: bool) -> None:
        """``sync_new_tokens(rows, counts, claim_pages=claim_pages)`` of tokens already in the row store, by the CPU
        kernel (``rows`` distinct)."""
        p = self.pages
        self.kernels.register_tokens(
            self.slots, rows, counts, self._live_len, self._logical_len, self.logical, self.readers,
            list(self.state.values()), p.owner, p.live, self.page_size, claim_pages,
        )  # fmt: skip

    def _register(self, r: torch.Tensor, col: torch.Tensor, logical: torch.Tensor, claim_pages: bool) -> None:
        """Entries ``(r[j], col[j])`` (already holding their slots) become live tokens with logical ids ``logical``;
        a slot's policy state starts at 0 when it gets its first reader; their pages gain a live token each."""
        new_slots = self.slots[r, col].to(torch.int64)
        self.logical[new_slots] = logical.to(torch.int32)
        first = new_slots[self.readers[new_slots] == 0]
        for t in self.state.values():
            t[first] = 0
        self.readers.index_add_(0, new_slots, torch.ones_like(new_slots, dtype=torch.int32))
        if claim_pages:
            pages = new_slots // self.page_size
            untracked = self.pages.owner[pages] == -1
            self.pages.owner[pages[untracked]] = r[untracked].to(torch.int32)
        self.pages.add_live(new_slots, +1)
