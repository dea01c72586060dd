"""K/V relocation: ``buf[dst] <- buf[src]`` for every K and V buffer of every layer.

Contract (one interface, two implementations):
- ``copy(src, dst)`` enqueues the copy after all work already issued on the caller's stream (the forward that
  last wrote the sources) and returns a ``Ticket``. Sources and destinations are disjoint.
- ``order_before_next_forward(ticket)``: work issued afterwards on the caller's stream (the row rewrite, then the
  next forward that reads the new rows) runs only after the copy completed (I3). No host synchronization.
- ``fence()``: a marker after the work issued so far on the caller's stream; ``Fence.done()`` tells, without
  blocking, whether it has completed. Source pages are released only when the fence taken after the last
  forward that could read them is done (the grace period).
- ``producer``: a stream the forwards run on when it is not the caller's (SGLang's overlap scheduler: the caller
  is the scheduling stream, and the forward of the last step may still run). Every copy also waits for the work
  already queued there: the forward that wrote the sources, and that may still read freed pages a copy writes.
  The next forward is queued after the caller's stream, so ``order_before_next_forward`` orders it after the copy,
  and pages freed by eviction or by a plan are next written only after that forward: no grace period is needed.

``copy_then_publish`` is that order as one call, for every relocation of live entries (reclaim, copy-on-write).

``CpuCopyEngine`` is synchronous: its copies are complete when ``copy`` returns. Its fences report so at once,
or, with ``fence_delay`` N (a debug mode, ``VTOKEN_SGLANG_FENCE_DELAY``), only from a query drawn in ``0..N`` on,
as a CUDA event may report late: the paths that run while a copy is still in flight then run on CPU too.
``CudaCopyEngine`` copies on a dedicated stream
ordered by CUDA events; its kernel is warmed up at construction.
"""

from __future__ import annotations

import abc
import dataclasses
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vtoken_sglang.core.planner import Moves
    from vtoken_sglang.core.token_table import TokenTable


@dataclasses.dataclass
class Ticket:
    event: object | None  # torch.cuda.Event on CUDA, None on CPU
    seconds: float  # host time spent issuing (CPU: doing) the copy


class Fence(abc.ABC):
    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the work before the fence has completed (non-blocking; may report late)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the work before the fence has completed."""


class _DoneFence(Fence):
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _LateFence(Fence):
    """A CPU fence over work that is complete, reporting it only from its ``queries + 1``-th ``done()`` on."""

    def __init__(self, queries: int):
        self.left = queries

    def done(self) -> bool:
        if self.left > 0:
            self.left -= 1
            return False
        return True

    def wait(self) -> None:
        self.left = 0


class _CudaFence(Fence):
    def __init__(self, event):
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class CopyEngine(abc.ABC):
    def __init__(self, buffers: Sequence[torch.Tensor]):
        """``buffers``: every K and V tensor, each indexed by slot along dim 0."""
        assert buffers, "no KV buffers"
        self.buffers = list(buffers)
        self.producer = None  # CUDA: the forward stream, when it is not the caller's (see the module docstring)

    @abc.abstractmethod
    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> Ticket: ...

    @abc.abstractmethod
    def order_before_next_forward(self, ticket: Ticket) -> None: ...

    @abc.abstractmethod
    def fence(self) -> Fence: ...


class CpuCopyEngine(CopyEngine):
    """Synchronous copy on the calling thread. ``fence_delay``: each fence reports not done for a number of
    queries drawn uniformly from ``0..fence_delay`` (seeded by ``fence_seed``); 0: done at once."""

    def __init__(self, buffers: Sequence[torch.Tensor], fence_delay: int = 0, fence_seed: int = 0):
        super().__init__(buffers)
        self.fence_delay = fence_delay
        self._rng = random.Random(fence_seed)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> Ticket:
        t0 = time.perf_counter()
        src, dst = src.to(torch.int64), dst.to(torch.int64)
        for buf in self.buffers:
            buf.index_copy_(0, dst, buf.index_select(0, src))
        return Ticket(None, time.perf_counter() - t0)

    def order_before_next_forward(self, ticket: Ticket) -> None:
        return None

    def fence(self) -> Fence:
        late = self._rng.randint(0, self.fence_delay) if self.fence_delay else 0
        return _LateFence(late) if late else _DoneFence()


class CudaCopyEngine(CopyEngine):
    """Copies on a dedicated CUDA stream, ordered by events against the caller's (scheduling) stream."""

    def __init__(self, buffers: Sequence[torch.Tensor], warmup: bool = True):
        super().__init__(buffers)
        dev = self.buffers[0].device
        assert dev.type == "cuda", "CudaCopyEngine needs CUDA buffers"
        self.device = dev
        self.stream = torch.cuda.Stream(device=dev)
        if warmup:  # compile/launch the kernels once, on the padding slot 0, before serving
            zero = torch.zeros(1, dtype=torch.int64, device=dev)
            self.order_before_next_forward(self.copy(zero, zero))
            torch.cuda.current_stream(dev).synchronize()

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> Ticket:
        t0 = time.perf_counter()
        caller = torch.cuda.current_stream(self.device)
        src = src.to(self.device, torch.int64, non_blocking=True)
        dst = dst.to(self.device, torch.int64, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(caller)  # after the forward that last wrote the sources, and after the index uploads
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            if self.producer is not None:
                self.stream.wait_stream(self.producer)
            for buf in self.buffers:
                buf.index_copy_(0, dst, buf.index_select(0, src))
            done = torch.cuda.Event()
            done.record(self.stream)
        src.record_stream(self.stream)
        dst.record_stream(self.stream)
        return Ticket(done, time.perf_counter() - t0)

    def order_before_next_forward(self, ticket: Ticket) -> None:
        torch.cuda.current_stream(self.device).wait_event(ticket.event)

    def fence(self) -> Fence:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return _CudaFence(ev)


def make_copy_engine(
    buffers: Sequence[torch.Tensor], producer=None, fence_delay: int = 0, fence_seed: int = 0
) -> CopyEngine:
    """The engine for the buffers' device; ``producer``: the forward stream when it is not the caller's (CUDA);
    ``fence_delay``/``fence_seed``: the CPU engine's late fences (CUDA events are late by nature)."""
    engine = CudaCopyEngine(buffers) if buffers[0].is_cuda else CpuCopyEngine(buffers, fence_delay, fence_seed)
    engine.producer = producer
    return engine


def copy_then_publish(engine: CopyEngine, table: TokenTable, moves: Moves) -> Ticket:
    """Relocate live entries in the one safe order (I3): copy the K/V of ``moves.src`` to ``moves.dst`` (fresh
    slots, disjoint from the sources) behind ``engine``, order the next forward after that copy, then publish: the
    table's entries ``(moves.rows, moves.cols)`` now live at ``moves.dst``. The sources are left as they are;
    freeing them is the caller's, never before a fence taken after this call has passed (the reclaimer's grace
    period), or by whoever owns them after the forward ordered behind the copy (copy-on-write: the tree's pages)."""
    ticket = engine.copy(moves.src, moves.dst)
    engine.order_before_next_forward(ticket)
    table.apply_moves(moves.rows, moves.cols, moves.dst)
    return ticket
