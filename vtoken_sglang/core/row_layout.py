"""``RowLayout``: one batch's rows as vToken lays them out, the one translation between an engine's lengths and
logical lengths.

An engine's lengths are live counts: a managed row holds only its live entries, in logical order, so its logical
length is its live length plus its offset, and a sliding layer's window is the row's suffix within the window's
span of logical positions (``TokenTable.window_suffix``). A row that is not managed is the engine's own dense row:
offset 0, its window the engine's. A layout is built once per forward, per decode preparation and per eviction
round (``RequestRows.layout``), and every reader (decode positions, M-RoPE, the backends' windows, decode slot
allocation, eviction, the lengths written back) takes its numbers from it instead of translating for itself.

Invariants: every array has one entry per batch entry, in batch order; ``host_offset`` is the host copy of
``offset`` (hooks decide on the host without a device read); ``any_managed`` False means every translation is the
identity, and readers take the engine's path. A layout describes its batch as it was when built: a round that
trims rows writes new lengths into the batch, and the next forward builds its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vtoken_sglang.core.token_table import TokenTable


@dataclass(frozen=True)
class RowLayout:
    table: TokenTable
    host_rows: np.ndarray  # int64: each batch entry's row of the row store (an engine's request-pool index)
    host_live: np.ndarray  # int64: its live length (the engine's sequence length)
    host_offset: np.ndarray  # int64: its logical length minus its live length (0: not managed)
    offset: torch.Tensor | None  # int64, on the table's device: ``host_offset`` (a forward's; None elsewhere, or
    # when no row is managed)
    any_managed: bool
    decoding: bool = False  # a decode forward's layout (extend rows are dense until their request is managed)
    _windows: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def host_logical(self) -> np.ndarray:
        """Each entry's logical length (int64)."""
        return self.host_live + self.host_offset

    def logical(self, live: torch.Tensor) -> torch.Tensor:
        """Logical lengths (or positions) from ``live`` ones, per batch entry (the first ``len(live)``), in
        ``live``'s dtype and on its device (a forward's layout)."""
        if self.offset is None:
            return live
        return live + self.offset[: len(live)].to(device=live.device, dtype=live.dtype)

    def window(self, rows: torch.Tensor, lengths: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding window of ``span`` logical positions over the rows ``rows`` (the engine's request-pool
        indices, possibly padded past the batch, as a CUDA graph's replay pads them) whose live lengths are
        ``lengths``: ``(w, start)`` (``TokenTable.window_suffix``) in ``lengths``' dtype. Computed once per span and
        batch size, and the same tensors for every layer of the forward."""
        key = (len(lengths), span)
        hit = self._windows.get(key)
        if hit is None:
            w, start = self.table.window_suffix(rows[: len(lengths)], lengths, span)
            hit = self._windows[key] = (w.to(lengths.dtype), start.to(lengths.dtype))
        return hit
