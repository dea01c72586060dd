"""Helpers for core tests: a small engine over real K/V tensors whose bytes encode (row, logical id)."""

from __future__ import annotations

import torch

from vtoken_sglang.core.copy_engine import CpuCopyEngine
from vtoken_sglang.core.integrity import token_stamp
from vtoken_sglang.core.pages import PagePool
from vtoken_sglang.core.reclaimer import Reclaimer
from vtoken_sglang.core.token_table import TokenTable

stamp = token_stamp  # the K/V bytes written for (row, logical id)


class MiniEngine:
    """PagePool + TokenTable + Reclaimer over CPU K/V buffers ``[slots, 3]`` (2 layers x K, V)."""

    def __init__(
        self,
        num_pages=256,
        page_size=4,
        rows=16,
        max_context=1024,
        reserve=4,
        theta=0.0,
        state_names=(),
        grace_steps=1,
        reclaim=True,
        fence_delay=0,
        fence_seed=0,
        cpu_kernels=None,
    ):
        self.pool = PagePool(num_pages, page_size, reserve=reserve)
        self.table = TokenTable(rows, max_context, self.pool, state_names=state_names, cpu_kernels=cpu_kernels)
        self.kv = [torch.zeros((num_pages + 1) * page_size, 3) for _ in range(4)]
        self.reclaimer = Reclaimer(
            self.table,
            CpuCopyEngine(self.kv, fence_delay, fence_seed),
            theta=theta,
            grace_steps=grace_steps,
            enabled=reclaim,
        )

    def write(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        slots = self.table.alloc_slots(rows, counts)
        req = torch.repeat_interleave(rows, counts)
        start = torch.cumsum(counts, 0) - counts
        k = torch.arange(int(counts.sum())) - torch.repeat_interleave(start, counts)
        logical = self.table.logical_len[req] + k
        for buf in self.kv:
            buf[slots] = stamp(req, logical)
        self.table.sync_new_tokens(rows, counts, slots)
        return slots

    def evict(self, rows: torch.Tensor, cols: torch.Tensor) -> None:
        self.pool.free(self.table.evict(rows, cols))

    def close(self, row: int) -> None:
        self.pool.free(self.table.close_row(row))
