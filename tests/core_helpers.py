"""Helpers for core tests: a small engine over real K/V tensors whose bytes encode (row, logical id)."""

from __future__ import annotations

import torch

from vtoken_sglang.core.copy_engine import CpuCopyEngine
from vtoken_sglang.core.pages import PagePool
from vtoken_sglang.core.reclaimer import Reclaimer
from vtoken_sglang.core.token_table import TokenTable


def stamp(rows: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
    """The K/V bytes written for token ``logical`` of request ``rows``: distinct for every (row, logical)."""
    r, lg = rows.to(torch.float32), logical.to(torch.float32)
    return torch.stack([r * 65536 + lg, -lg - 1, r], 1)


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
    ):
        self.pool = PagePool(num_pages, page_size, reserve=reserve)
        self.table = TokenTable(rows, max_context, self.pool, state_names=state_names)
        self.kv = [torch.zeros((num_pages + 1) * page_size, 3) for _ in range(4)]
        self.reclaimer = Reclaimer(
            self.table, CpuCopyEngine(self.kv), theta=theta, grace_steps=grace_steps, enabled=reclaim
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
