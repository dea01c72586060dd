"""``RowReads``: reading the Token Table through its rows (part of ``TokenTable``, which it is a base of).

A row's live entries are columns ``0 .. live_len[r]-1`` of the row store; their metadata is per KV slot, so every
read goes through the row's slots. Reads past a row's live length give padding (slot 0, state 0). The accessors use
the table's ``slots``, ``live_len`` (which settles deferred decode tokens; ``window_suffix`` reads the raw
``_live_len`` and ``_logical_len`` instead), ``logical``, ``state`` and ``states`` (each request's policy state:
``state_store``), ``active``, ``page_size``, ``settle`` and ``kernels`` (vToken's CPU kernels, or None).
"""

from __future__ import annotations

import torch


class RowReads:
    def valid(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``[k, width]``: which columns of ``rows`` are live entries."""
        return torch.arange(width, device=rows.device)[None, :] < self.live_len[rows][:, None]

    def row_slots(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``[k, width]`` int64 slots of ``rows``; past a row's live length, slot 0 (the padding page's)."""
        return self._live_slots(rows, width)[0]

    def _live_slots(self, rows: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``row_slots`` and ``valid`` of ``rows``, the mask computed once."""
        valid = self.valid(rows, width)
        return torch.where(valid, self.slots[:, :width].index_select(0, rows).to(torch.int64), 0), valid

    def logical_at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Logical ids of the live entries ``(rows[i], cols[i])``."""
        self.settle()
        return self.logical[self.slots[rows, cols].to(torch.int64)]

    def window_suffix(self, rows: torch.Tensor, lengths: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding window over each row's first ``lengths`` columns (an engine's sequence lengths: the newest
        entry last): the entries whose logical position is above ``q - span``, ``q`` the newest entry's. A row is
        in logical order, so they are its last ``w`` columns, from ``start = lengths - w``; returns ``(w, start)``
        (int64, on the rows' device). Static shapes (``[len(rows), span]``), no host read and no settle, so an
        engine's per-forward metadata step (a CUDA graph's replay's too) can run it: columns at or past a row's
        registered length hold deferred decode tokens, one logical position after another; a row that is not
        active is an engine's dense row (position = column), whose window is ``min(lengths, span)``."""
        r, n = rows.to(torch.int64), lengths.to(torch.int64)
        active = self.active[r]
        registered = torch.where(active, self._live_len[r], 0)
        offset = torch.where(active, self._logical_len[r] - self._live_len[r], 0)  # logical minus column
        cols = n[:, None] - span + torch.arange(span, device=n.device)[None, :]
        slots = self.slots[r[:, None], cols.clamp(min=0)].to(torch.int64)
        pos = torch.where(cols < registered[:, None], self.logical[slots].to(torch.int64), cols + offset[:, None])
        newest = n - 1 + offset
        w = ((cols >= 0) & (pos > (newest - span)[:, None])).sum(1)
        return w, n - w

    def row_logical(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``[k, width]`` logical ids of ``rows``' live entries (garbage past each live length)."""
        return self.logical[self.row_slots(rows, width)]

    def _state_cells(self, rows: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[k, width]`` policy-state cells of ``rows``' columns (``StateStore.index``; the padding slot's past a
        live length) and ``valid``."""
        slots, valid = self._live_slots(rows, width)
        return self.states.index(rows, width, slots), valid

    def row_state(self, name: str, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``[k, width]`` policy state of ``rows``' live entries, each request's own; 0 past each live length."""
        cells, valid = self._state_cells(rows, width)
        return torch.where(valid, self.state[name][cells], 0.0)

    def set_row_state(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values[k, width]`` as the state of ``rows``' live entries (columns past a live length are
        ignored). Every live entry has a cell of its own, a shared prefix's too: the other readers' states do not
        change."""
        self._fold(name, rows, values, "set")

    def add_row_state(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values[k, width]`` to the state of ``rows``' live entries (each its own)."""
        self._fold(name, rows, values, "sum")

    def _fold(self, name: str, rows: torch.Tensor, values: torch.Tensor, reduce: str) -> None:
        """``values[k, width]`` into the state of ``rows``' live entries, by ``reduce`` (``sum`` or ``set``): the
        CPU kernel where the table has it, else torch ops on the flat writes, where columns past a live length go to
        the padding slot 0 with value 0 (its state stays 0, the padding page never holds a token; no boolean mask:
        the same shapes every time, no device read). ``rows`` are distinct, so every other cell is written once."""
        s = self.states
        if self.kernels is not None:
            self.kernels.fold_rows(
                self.state[name], self.slots, rows, self.live_len, s.n_shared, s.base, s.pool_slots, values, reduce
            )
            return
        cells, valid = self._state_cells(rows, values.shape[1])
        cells, values = cells.reshape(-1), torch.where(valid, values.to(torch.float32), 0.0).reshape(-1)
        if reduce == "sum":
            self.state[name].index_add_(0, cells, values)
        else:
            self.state[name].index_put_((cells,), values)

    def row_view(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The live slots of ``row`` and their logical ids."""
        n = int(self.live_len[row])
        slots = self.slots[row, :n]
        return slots, self.logical[slots.to(torch.int64)]

    def tail_pages(self) -> torch.Tensor:
        """Page of the newest token of every active request (the page its next token is written into)."""
        rows = torch.nonzero(self.active & (self.live_len > 0)).flatten()
        last = self.slots[rows, self.live_len[rows] - 1].to(torch.int64)
        return last // self.page_size

    def lower_bound_pages(self) -> int:
        """Sum over active requests of ceil(live / page_size): the fewest pages their live tokens can occupy."""
        live = self.live_len[self.active]
        return int(((live + self.page_size - 1) // self.page_size).sum())
