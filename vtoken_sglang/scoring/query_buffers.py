"""``DecodeQueryBuffers``: the query rows of the newest decode forward, per scored layer, in static device buffers.

Each scored attention layer writes its decode query into the same preallocated buffer every step, with plain tensor
ops (``write``): a CUDA graph captured with those ops refills the buffers at every replay, and an eager forward (CPU,
or a batch larger than any graph) runs the same code. Contract:

- ``q``: ``[layers, rows, Hq, D]`` in the model's dtype, allocated at the first write (a graph capture's, on a GPU)
  with ``rows`` = the bound given then; rows ``[0, B)`` of a layer hold the last decode forward's queries of its
  ``B`` requests, in batch order. Rows past ``B`` hold older steps' queries (or a graph's padding) and are not read.
- A batch larger than ``rows`` (eager only: a graph is never captured beyond ``rows``) keeps a reference to its
  query instead (``overflow``), read only for a batch that large.
- ``stamp``: decode forwards written, counted on the device by the first scored layer (a graph replay counts too);
  the host compares it with the decode forwards it began, without reading the device every step.
Step N's queries stay until forward N+1 writes: scores of step N are taken before forward N+1 starts (the eviction
round runs before the next batch is launched, with SGLang's overlap scheduler or without it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DEFAULT_ROWS = 256  # buffer rows when no larger decode graph is captured (eager batches beyond: ``overflow``)


class DecodeQueryBuffers:
    def __init__(self, layers: frozenset[int]):
        self.index = {layer: i for i, layer in enumerate(sorted(layers))}
        self.q: torch.Tensor | None = None
        self.stamp: torch.Tensor | None = None
        self.params: dict[int, tuple[float, float]] = {}  # layer -> (softmax scale, logit cap)
        self._groups: dict[tuple[float, float], list[int]] | None = None
        self.overflow: dict[int, torch.Tensor] = {}

    @property
    def rows(self) -> int:
        return 0 if self.q is None else self.q.shape[1]

    def write(
        self,
        layer_id: int,
        q: torch.Tensor,
        num_heads: int,
        head_dim: int,
        scale: float,
        logit_cap: float,
        rows_bound: Callable[[], int],
    ) -> None:
        """From a scored layer's decode forward (``q``: ``[B, Hq * D]`` or ``[B, Hq, D]``). ``rows_bound()``: the
        largest decode batch the engine can run (asked once, at the first write)."""
        q = q.reshape(-1, num_heads, head_dim)
        if self.q is None:
            self._allocate(q, rows_bound())
        i = self.index[layer_id]
        n = q.shape[0]
        if n <= self.q.shape[1]:
            self.q[i, :n].copy_(q)
        elif q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"vToken: a decode CUDA graph of batch {n} is captured beyond the {self.q.shape[1]} query buffer rows"
            )
        else:
            self.overflow[layer_id] = q
        if i == 0:
            self.stamp.add_(1)
        if layer_id not in self.params:
            self.params[layer_id] = (scale, logit_cap)

    def _allocate(self, q: torch.Tensor, rows: int) -> None:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():  # a graph would own (and refill) them
            raise RuntimeError("vToken: query buffers must be allocated by an eager forward before graph capture")
        self.q = torch.zeros(len(self.index), max(rows, 1), *q.shape[1:], dtype=q.dtype, device=q.device)
        self.stamp = torch.zeros(1, dtype=torch.int64, device=q.device)

    def queries(self, batch: int) -> torch.Tensor:
        """``[scored layers, batch, Hq, D]`` (layers in id order): the last decode forward's queries (``batch`` = its
        size)."""
        if batch > self.rows:
            return torch.stack([self.overflow[layer][:batch] for layer in self.index])
        return self.q[:, :batch]

    def layer_groups(self) -> dict[tuple[float, float], list[int]]:
        """Scored layer ids by their ``(scale, logit cap)``, in id order (one group for most models). Asked after a
        decode forward wrote every scored layer; a layer's parameters never change, so grouped once."""
        if self._groups is None:
            self._groups = {}
            for layer in self.index:
                self._groups.setdefault(self.params[layer], []).append(layer)
        return self._groups

    def written(self) -> int:
        """Decode forwards written so far (one device read)."""
        return 0 if self.stamp is None else int(self.stamp.item())

    def nbytes(self) -> int:
        if self.q is None:
            return 0
        return self.q.numel() * self.q.element_size() + self.stamp.numel() * self.stamp.element_size()
