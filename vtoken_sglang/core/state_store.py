"""``StateStore``: policy state per live entry, each request's own (part of ``TokenTable``, as ``table.states``).

A row's private entries (on pages it owns: one reader, invariant I2) keep their state in a cell per KV slot, moved
with the slot. The entries a row reads from pages it does not own (a radix-tree prefix, read by other requests too)
keep theirs in an *extent* of cells of the row's own, addressed by column: a request's score for a shared token
folds only that request's attention, from the moment it reads it. This works because those entries are a column
prefix ``[0, n_shared[r])`` of the row, and stay one:

- the row registers them first when it opens (a tree prefix is logical ``[0, k)``);
- eviction compacts a row stably, so kept shared entries stay first;
- copy-on-write moves a suffix of them into the row's own pages (``apply_moves``: ``n_shared`` drops to the first
  column moved); reclaim moves private entries only; decode tokens are private.

One index rule, both parts in one float32 tensor per state (``[pool_slots + capacity]``)::

    idx(r, j) = pool_slots + base[r] + j     if j < n_shared[r]
              = slots[r, j]                   otherwise

Every live entry has a cell of its own, so folds are plain adds and writes (no reduction over readers), the same
on every device and TP rank. Extents are allocated on the host when rows open (bump allocation, zeroed, no device
read) and compacted when the top reaches the capacity: one host read of ``n_shared``, the live extents packed, the
capacity doubled if they still do not fit. So the cells in use are the live shared entries (``shared_entries``), and
the capacity stays within ``max(pool_slots, 2 x peak)``. A table without states has no extents.
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken_sglang.core.segments import segment_ranks


class StateStore:
    def __init__(self, names: tuple[str, ...], pool_slots: int, num_rows: int, device: torch.device):
        self.pool_slots = pool_slots
        self.capacity = pool_slots if names else 0  # extent cells; covers every managed prompt read alone
        cells = pool_slots + self.capacity
        self.tensors = {name: torch.zeros(cells, dtype=torch.float32, device=device) for name in names}
        self.n_shared = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.base = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._host_base = np.zeros(num_rows, dtype=np.int64)
        self._host_cap = np.zeros(num_rows, dtype=np.int64)  # extent cells of each row (0: none)
        self.top = 0  # extent cells handed out since the last packing (the next extent starts here)
        self.compactions = 0

    def nbytes(self) -> int:
        """Device bytes: every state's cells and the two per-row arrays."""
        tensors = [*self.tensors.values(), self.n_shared, self.base]
        return sum(t.numel() * t.element_size() for t in tensors)

    def open(self, rows: torch.Tensor, shared: np.ndarray | None) -> None:
        """Rows start; ``shared[i]``: how many leading entries row ``rows[i]`` will read from pages it does not own
        (host ints). Their cells are allocated and zeroed."""
        declared = shared is not None and bool(self.tensors)
        counts = np.asarray(shared, np.int64) if declared else np.zeros(len(rows), dtype=np.int64)
        self.n_shared[rows] = torch.from_numpy(counts).to(self.n_shared.device)
        need = int(counts.sum())
        if need == 0:
            return
        if self.top + need > self.capacity:
            self._compact(need)
        host_rows = rows.cpu().numpy()
        bases = self.top + np.cumsum(counts) - counts
        self._host_base[host_rows], self._host_cap[host_rows] = bases, counts
        self.base[rows] = torch.from_numpy(bases).to(self.base.device)
        for t in self.tensors.values():
            t[self.pool_slots + self.top : self.pool_slots + self.top + need] = 0
        self.top += need

    def close(self, row: int) -> None:
        """A row ends: its extent is free (taken back at the next compaction, or at once once none is left)."""
        self.n_shared[row] = 0
        self._host_cap[row] = 0
        if not self._host_cap.any():
            self.top = 0

    def index(self, rows: torch.Tensor, width: int, slots: torch.Tensor) -> torch.Tensor:
        """``[k, width]`` state cells of ``rows``' columns, given their slots (``slots``, the padding slot past a live
        length: a shared column is always live)."""
        if not self.capacity:
            return slots
        col = torch.arange(width, device=slots.device)[None, :]
        own = self.pool_slots + self.base[rows][:, None] + col
        return torch.where(col < self.n_shared[rows][:, None], own, slots)

    def compact_rows(self, rows: torch.Tensor, width: int, keep: torch.Tensor, order: torch.Tensor) -> None:
        """Eviction of the ``[k, width]`` columns not in ``keep`` from ``rows``, whose entries move by ``order`` (the
        row store's stable compaction, kept columns first): each row's kept shared entries move down its extent
        with it. Static shapes, no host read."""
        if not self.capacity:
            return
        col = torch.arange(width, device=keep.device)[None, :]
        ns = self.n_shared[rows][:, None]
        was = col < ns
        cells = torch.where(was, self.pool_slots + self.base[rows][:, None] + col, 0)
        kept = (was & keep).sum(1)
        now = col < kept[:, None]
        dst = torch.where(now, cells, 0).reshape(-1)
        for t in self.tensors.values():
            moved = torch.gather(t[cells], 1, order)
            t[dst] = torch.where(now, moved, 0.0).reshape(-1)  # cell 0 (the padding slot's) takes zeros only
        self.n_shared[rows] = kept

    def move_sources(self, rows: torch.Tensor, cols: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """Relocation of the entries ``(rows, cols)`` from slots ``old`` into fresh slots of their rows' own pages:
        the cells their state comes from. A shared entry (copy-on-write moves a suffix of a row's shared prefix)
        becomes private, so ``n_shared`` drops to the first such column."""
        if not self.capacity:
            return old
        ns = self.n_shared[rows]
        was = cols < ns
        self.n_shared.scatter_reduce_(0, rows, torch.where(was, cols, ns), "amin")
        return torch.where(was, self.pool_slots + self.base[rows] + cols, old)

    def extents(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host view of the extents handed out: ``(rows, base, cells)`` of every row that holds some."""
        rows = np.flatnonzero(self._host_cap)
        return rows, self._host_base[rows], self._host_cap[rows]

    def shared_entries(self) -> torch.Tensor:
        """Live shared entries, all rows (a device scalar)."""
        return self.n_shared.sum()

    def _compact(self, need: int) -> None:
        """Pack the live extents from cell 0 (one host read of ``n_shared``); grow the capacity to
        ``max(2 x capacity, live + need)`` if ``need`` more cells would not fit."""
        self.compactions += 1
        ns = np.where(self._host_cap > 0, self.n_shared.cpu().numpy(), 0)
        host_rows = np.flatnonzero(ns)
        lens = ns[host_rows]
        live = int(lens.sum())
        capacity = self.capacity if live + need <= self.capacity else max(2 * self.capacity, live + need)
        bases = np.cumsum(lens) - lens
        dev = self.base.device
        rows = torch.from_numpy(host_rows).to(dev)
        req, k = segment_ranks(torch.from_numpy(lens).to(dev), live)
        src = self.pool_slots + self.base[rows][req] + k
        dst = self.pool_slots + torch.from_numpy(bases).to(dev)[req] + k
        grow = capacity != self.capacity
        for name, t in self.tensors.items():
            packed = torch.zeros(self.pool_slots + capacity, dtype=t.dtype, device=dev) if grow else t
            if grow:
                packed[: self.pool_slots] = t[: self.pool_slots]
            packed[dst] = t[src]
            self.tensors[name] = packed
        self.capacity = capacity
        self._host_base[:], self._host_cap[:] = 0, 0
        self._host_base[host_rows], self._host_cap[host_rows] = bases, lens
        self.base[rows] = torch.from_numpy(bases).to(dev)
        self.top = live
