"""A small K/V engine over the real core, for tests, the device check and the simulator: ``PagePool`` +
``TokenTable`` + ``Reclaimer`` over real K/V buffers (``2 x layers`` tensors ``[slots, width]`` on any device), whose
bytes can encode each token's (row, logical id) (``token_stamp``), so that ``check()`` proves every live entry's K/V
where the table says it is.

Imports the core and torch only (no SGLang, no Triton): ``benchmark/gpu_check.py`` runs it on a machine with torch
and this repository alone. The copy engine is the buffers' device's (``make_copy_engine``: CUDA on a GPU, the CPU
engine, with its late fences if asked, elsewhere)."""

from __future__ import annotations

import torch

from vtoken_sglang.core.copy_engine import make_copy_engine
from vtoken_sglang.core.integrity import check_integrity, token_stamp
from vtoken_sglang.core.pages import PagePool
from vtoken_sglang.core.reclaimer import Reclaimer
from vtoken_sglang.core.token_table import TokenTable

stamp = token_stamp  # the K/V bytes written for (row, logical id)


class KVEngine:
    """The core's page pool, token table and reclaimer over K/V buffers ``kv`` (one per layer and K/V).

    ``reserve``: the pool's relocation reserve; ``reclaim``, ``theta``, ``grace_steps`` and ``reclaimer_options``
    (``keep_free``, ``low_watermark``, ``max_rounds``, ...): the reclaimer's; ``fence_delay``/``fence_seed``: the CPU
    copy engine's late fences."""

    def __init__(
        self,
        num_pages: int = 256,
        page_size: int = 4,
        rows: int = 16,
        max_context: int = 1024,
        reserve: int = 4,
        theta: float = 0.0,
        state_names=(),
        grace_steps: int = 1,
        reclaim: bool = True,
        fence_delay: int = 0,
        fence_seed: int = 0,
        cpu_kernels=None,
        device: str | torch.device = "cpu",
        layers: int = 2,
        width: int = 3,
        dtype: torch.dtype = torch.float32,
        **reclaimer_options,
    ):
        self.device = torch.device(device)
        self.pool = PagePool(num_pages, page_size, reserve=reserve)
        self.table = TokenTable(rows, max_context, self.pool, state_names=state_names, cpu_kernels=cpu_kernels)
        slots = (num_pages + 1) * page_size
        self.kv = [torch.zeros(slots, width, dtype=dtype, device=self.device) for _ in range(2 * layers)]
        engine = make_copy_engine(self.kv, fence_delay=fence_delay, fence_seed=fence_seed)
        self.reclaimer = Reclaimer(
            self.table, engine, theta=theta, grace_steps=grace_steps, enabled=reclaim, **reclaimer_options
        )

    def write(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append ``counts[i]`` tokens to request ``rows[i]``, their stamps written into every buffer; their slots."""
        slots = self.table.alloc_slots(rows, counts)
        req = torch.repeat_interleave(rows, counts)
        start = torch.cumsum(counts, 0) - counts
        k = torch.arange(int(counts.sum())) - torch.repeat_interleave(start, counts)
        values = stamp(req, self.table.logical_len[req] + k).to(self.device)
        at = slots.to(self.device)
        for buf in self.kv:
            buf[at] = values
        self.table.sync_new_tokens(rows, counts, slots)
        return slots

    def evict(self, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """Evict the entries ``(rows, cols)`` and free the pages left empty."""
        self.pool.free(self.table.evict(rows, cols))

    def evict_random(self, frac: float, g: torch.Generator) -> None:
        """Evict about ``frac`` of every active request's entries (never its newest) and free emptied pages."""
        t = self.table
        rows = torch.nonzero(t.active).flatten()
        width = int(t.live_len[rows].max())
        pick = (torch.rand(len(rows), width, generator=g) < frac) & (
            torch.arange(width)[None, :] < t.live_len[rows][:, None] - 1
        )
        r, c = torch.nonzero(pick, as_tuple=True)
        self.evict(rows[r], c)

    def load_step(self, rows: torch.Tensor, live: list[list[int]], g: torch.Generator, evict_one_in: int) -> None:
        """One step of a load whose live tokens the caller keeps its own account of (``live[i]``: the live logical
        ids of request ``rows[i]``, in order): every request appends 1-8 tokens, loses ``len // evict_one_in`` of
        its entries at random (never its newest), and the reclaimer takes a step; ``live`` follows."""
        self.append_live(rows, live, g)
        self.evict_live(rows, live, g, evict_one_in)
        self.reclaimer.step()

    def append_live(self, rows: torch.Tensor, live: list[list[int]], g: torch.Generator, most: int = 8) -> torch.Tensor:
        """1 to ``most`` new tokens per request, at its next logical positions; ``live`` follows. The counts."""
        counts = torch.randint(1, most + 1, (len(rows),), generator=g)
        firsts = self.table.logical_len[rows].tolist()
        self.write(rows, counts)
        for ids, first, n in zip(live, firsts, counts.tolist()):
            ids.extend(range(first, first + n))
        return counts

    def evict_live(
        self, rows: torch.Tensor, live: list[list[int]], g: torch.Generator, evict_one_in: int, keep_newest: int = 1
    ) -> None:
        """``len // evict_one_in`` of each request's entries at random, never among its ``keep_newest`` newest;
        ``live`` follows."""
        vr, vc = [], []
        for row, ids in zip(rows.tolist(), live):
            older = max(len(ids) - keep_newest, 0)
            cols = torch.randperm(older, generator=g)[: len(ids) // evict_one_in].sort().values.tolist()
            vr += [row] * len(cols)
            vc += cols
            for c in reversed(cols):
                del ids[c]
        self.evict(torch.tensor(vr, dtype=torch.int64), torch.tensor(vc, dtype=torch.int64))

    def truncate(self, rows: torch.Tensor, logical_end: torch.Tensor) -> None:
        """Roll requests ``rows`` back to ``logical_end`` (``TokenTable.truncate``) and free the pages emptied."""
        self.pool.free(self.table.truncate(rows, logical_end))

    def close(self, row: int) -> None:
        """End request ``row``: its pages go back to the pool."""
        self.pool.free(self.table.close_row(row))

    def check(self) -> None:
        """The core's integrity check, K/V bytes included (reading the buffers back orders after published
        copies)."""
        check_integrity(self.table, [b.cpu() for b in self.kv], stamp)
