"""vToken's CPU kernels for the Token Table (``cpu_ops/token_table.cpp``) against the torch ops they replace: two
tables, one with the kernels and one without, through the same random run (requests opened on a shared prefix in
tree pages that the engine wrote into their rows, decode tokens registered at once, late and several steps late,
some on pages the pool does not track yet, evictions, attention folded by sum and written over rows that share
slots, each into its own cells, requests ended and started again): after every step every tensor of both tables
and both pools is equal, bit for bit. The scoring kernel has its own test (``test_scoring``)."""

import shutil

import numpy as np
import pytest
import torch
from core_helpers import MiniEngine

from vtoken_sglang import cpu_ops
from vtoken_sglang.core.integrity import check_integrity
from vtoken_sglang.core.pages import FREE, TREE

P, ROWS, TREE_PAGES = 4, 6, 3
STATE = ("acc", "last")

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the CPU kernels")


def tensors(eng) -> dict[str, torch.Tensor]:
    t = eng.table
    out = {"live_len": t.live_len, "logical_len": t.logical_len, "slots": t.slots, "logical": t.logical}
    out |= {"readers": t.readers, "owner": eng.pool.owner, "page_live": eng.pool.live, "active": t.active}
    out |= {"n_shared": t.states.n_shared, "shared_base": t.states.base}
    return out | {f"state {name}": v for name, v in t.state.items()}


class Twins:
    """The same operations on a table with the kernels and one without."""

    def __init__(self):
        self.engines = [
            MiniEngine(num_pages=128, page_size=P, rows=ROWS, max_context=256, state_names=STATE, cpu_kernels=k)
            for k in (True, False)
        ]
        assert self.engines[0].table.kernels is not None and self.engines[1].table.kernels is None
        tree = [eng.pool.alloc(TREE_PAGES, TREE) for eng in self.engines]
        assert torch.equal(*tree)
        self.shared = (tree[0][:, None] * P + torch.arange(P)).flatten()
        self.open: list[int] = []

    def each(self, fn) -> None:
        for eng in self.engines:
            fn(eng, eng.table)
        a, b = (tensors(eng) for eng in self.engines)
        for name in a:
            assert torch.equal(a[name], b[name]), name
        check_integrity(self.engines[0].table)

    def start(self, row: int, prefix_pages: int, own: int) -> None:
        rows, n = torch.tensor([row]), prefix_pages * P

        def go(eng, t):
            t.open_rows(rows, shared=np.array([n]))
            t.slots[row, :n] = self.shared[:n].to(t.slots.dtype)  # the engine wrote the prefix (tree pages)
            t.sync_new_tokens(rows, torch.tensor([n]))  # as RequestRows.manage: not claimed, not counted
            eng.write(rows, torch.tensor([own]))

        self.each(go)
        self.open.append(row)

    def fold(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.each(lambda eng, t: (t.add_row_state("acc", rows, values), t.set_row_state("last", rows, values)))

    def evict(self, rows: torch.Tensor, cols: torch.Tensor) -> None:
        self.each(lambda eng, t: eng.evict(rows, cols))

    def close(self, row: int) -> None:
        self.each(lambda eng, t: eng.close(row))
        self.open.remove(row)

    def decode(self, rows: list[int], steps: int, how: str) -> None:
        """``steps`` decode tokens per row, written into the row store as an engine does (a new page from the pool,
        untracked, when the tail page is full), registered by ``how``."""
        r = torch.tensor(rows)

        def go(eng, t):
            written = t.live_len.clone()
            for _ in range(steps):
                for row in rows:
                    last = int(t.slots[row, written[row] - 1])
                    full = (last + 1) % P == 0
                    t.slots[row, written[row]] = int(eng.pool.alloc(1, FREE)[0]) * P if full else last + 1
                written[r] += 1
                if how == "decode":
                    t.sync_decode_tokens(r)
                elif how == "general":
                    t.sync_new_tokens(r, torch.ones_like(r), claim_pages=True)
                else:
                    t.defer_decode_tokens(r.numpy())
            t.settle()

        self.each(go)


def test_token_table_kernels_equal_the_torch_ops():
    g = np.random.default_rng(7)
    tw = Twins()
    for row in range(ROWS):
        tw.start(row, int(g.integers(0, TREE_PAGES + 1)), int(g.integers(1, 9)))
    for _ in range(150):
        op = g.choice(["decode", "decode", "evict", "fold", "fold", "restart"])
        rows = sorted(g.choice(tw.open, size=int(g.integers(1, len(tw.open) + 1)), replace=False).tolist())
        if op == "decode":
            tw.decode(rows, int(g.integers(1, 4)), str(g.choice(["decode", "general", "defer"])))
        elif op == "evict":
            live = tw.engines[0].table.live_len
            pairs = [(r, c) for r in rows for c in range(int(live[r]) - 1) if g.random() < 0.3]
            if pairs:
                tw.evict(*(torch.tensor(x) for x in zip(*pairs)))
        elif op == "fold":
            width = int(tw.engines[0].table.live_len[rows].max()) + int(g.integers(-2, 3))
            values = torch.from_numpy(g.standard_normal((len(rows), max(width, 1))).astype(np.float32))
            tw.fold(torch.tensor(rows), values)
        else:
            tw.close(rows[0])
            tw.start(rows[0], int(g.integers(0, TREE_PAGES + 1)), int(g.integers(1, 9)))
    t = tw.engines[0].table
    assert int(t.readers[tw.shared].max()) >= 2  # folds met slots that several rows read
    # ... and each of those rows keeps a state of its own for such a slot: they differ
    readers: dict[int, list[tuple[int, int]]] = {}
    for r in tw.open:
        for j in range(int(t.states.n_shared[r])):
            readers.setdefault(int(t.slots[r, j]), []).append((r, j))
    acc = t.row_state("acc", torch.tensor(tw.open), int(t.live_len.max()))
    per_slot = [{float(acc[tw.open.index(r), j]) for r, j in held} for held in readers.values() if len(held) > 1]
    assert per_slot and any(len(values) > 1 for values in per_slot)


def test_token_table_kernels_refuse_what_the_torch_ops_refuse():
    """A row past its context, and a row store pointing outside the pool, fail with an error, not a write out of
    bounds."""
    assert cpu_ops.load()
    eng = MiniEngine(num_pages=8, page_size=P, rows=2, max_context=8, cpu_kernels=True)
    t, rows = eng.table, torch.tensor([0])
    t.open_rows(rows)
    eng.write(rows, torch.tensor([8]))
    with pytest.raises(RuntimeError, match="row overflow"):
        t.sync_decode_tokens(rows)
    t.slots[1, 0] = 10**6
    t.open_rows(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="outside the pool"):
        t.sync_new_tokens(torch.tensor([1]), torch.tensor([1]), claim_pages=True)
