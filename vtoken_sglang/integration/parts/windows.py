"""Sliding windows by logical position: a sliding layer's decode query at logical position q sees the live entries
of its row whose logical position is above ``q - span``. A row is compacted in logical order, so they are the row's
last ``w`` columns, from ``start``; SGLang's backends take ``(w, start)`` instead of the window they derive from the
row's length (``hooks.windows``).

Each backend keeps its own span (how many logical positions a query sees, itself included), so a row that never
evicted gets exactly upstream's window: torch_native and FlashInfer ``sliding_window_size + 1``, Triton's decode
``sliding_window_size`` (upstream's Triton decode window is one key shorter than its extend's and FlashInfer's).
"""

from __future__ import annotations

import torch

from vtoken_sglang.core.token_table import TokenTable


class SlidingWindows:
    """Per decode forward, each span's ``(w, start)`` for the forward's rows, computed once (the first sliding layer
    asks; the others reuse it). ``begin`` starts a forward; only decode forwards are windowed by the table (extend
    rows are dense: a request is compacted only after its prefill, and a retracted one re-prefills a fresh row)."""

    def __init__(self, table: TokenTable):
        self.table = table
        self.decoding = False
        self._cache: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, decoding: bool) -> None:
        self.decoding = decoding
        self._cache.clear()

    def suffix(self, rows: torch.Tensor, lengths: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w, start)`` of the rows ``rows`` (SGLang's ``req_pool_indices``) whose sequence lengths are ``lengths``
        (``TokenTable.window_suffix``), in ``lengths``' dtype; the same tensors for every layer of one forward."""
        key = (lengths.data_ptr(), len(lengths), span)
        hit = self._cache.get(key)
        if hit is None:
            w, start = self.table.window_suffix(rows[: len(lengths)], lengths, span)
            hit = self._cache[key] = (w.to(lengths.dtype), start.to(lengths.dtype))
        return hit
