"""Segment ids without a parallel region: ``segment_ids(counts)[j]`` is the segment that element ``j`` belongs to.

Same values as ``torch.repeat_interleave(torch.arange(len(counts)), counts)``. Why not that call: its CPU kernel
opens an intra-op parallel region for every call, whatever the size (grain 1). In a scheduler sharing its cores
with the tokenizer, the detokenizer and the model's own threads, the region waits for a thread to be scheduled:
profiled inside a CPU SGLang server (2 cores, 16 requests), that one call in the per-step token sync cost about
0.6 ms of a 20 ms decode step. Here: one ``index_add_`` and one ``cumsum`` over ``total`` elements, both serial
below ATen's grain size, and both plain kernels on CUDA.

Also the one packing rule (``packed_slots``): where the k-th token of a run packed densely into pages lands.
"""

from __future__ import annotations

import torch


def segment_ids(counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``counts``: non-negative int64 (one per segment). ``total``: ``counts.sum()`` if the caller knows it (saves a
    device sync). Returns int64 of length ``total``; segments of count 0 own no element."""
    return _segments(counts, total)[0]


def segment_ranks(counts: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segment_ids(counts), rank)``: ``rank[j]`` is element ``j``'s position within its segment."""
    ids, starts, total = _segments(counts, total)
    return ids, torch.arange(total, device=ids.device) - starts[ids]


def _segments(counts: torch.Tensor, total: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    counts = counts.to(torch.int64)
    if total is None:
        total = int(counts.sum())
    starts = torch.cumsum(counts, 0) - counts  # a segment of count 0 starts where the next one does
    marks = torch.zeros(total + 1, dtype=torch.int64, device=counts.device)
    marks.index_add_(0, starts, torch.ones_like(starts))
    return torch.cumsum(marks[:total], 0) - 1, starts, total


def repeat_rows(values: torch.Tensor, counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, in order (``torch.repeat_interleave(values, counts)``)."""
    return values[segment_ids(counts, total)]


def packed_slots(pages: torch.Tensor, first: torch.Tensor | int, k: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slots of tokens packed densely, in order, into consecutive entries of ``pages``: the ``k``-th token (from
    0) of a run whose pages start at ``pages[first]`` takes slot ``k % page_size`` of page
    ``pages[first + k // page_size]``. ``first`` and ``k`` broadcast (one run per element, or one run)."""
    return pages[first + k // page_size] * page_size + k % page_size


__all__ = ["segment_ids", "segment_ranks", "repeat_rows", "packed_slots"]
