"""Each request's own policy state on the device (``core/state_store.py``): used by ``gpu_check.py`` (row
``state_per_request``); torch only, no sglang.

The same operations on a Token Table on the device and on one on the CPU (torch ops on both: the CPU kernels off),
checked after every step against an account kept here by (request, logical position): requests opened on a shared
prefix of tree pages (declared at open), private tokens appended, adds and writes folded into some rows, evictions
(inside the shared prefixes too), copy-on-write of a row's shared suffix (``apply_moves``), requests ended and new
ones opened past the cells' capacity (packing, then growth). Every live entry's state must equal the account on
both tables, bit for bit, and the two tables' state tensors must be equal.
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken_sglang.core.integrity import check_integrity
from vtoken_sglang.core.pages import TREE, PagePool
from vtoken_sglang.core.token_table import TokenTable

ROWS, P, TREE_PAGES, STEPS = 8, 4, 10, 80
NAMES = ("acc", "last")


class Twin:
    """A table and its pool on ``device``, with a shared prefix of ``TREE_PAGES`` tree pages."""

    def __init__(self, device: str):
        self.dev = torch.device(device)
        self.pool = PagePool(40, P, device=self.dev)
        self.table = TokenTable(ROWS, 128, self.pool, state_names=NAMES, cpu_kernels=False)
        tree = self.pool.alloc(TREE_PAGES, TREE)
        self.prefix = (tree[:, None] * P + torch.arange(P, device=self.dev)).flatten()

    def t(self, values) -> torch.Tensor:
        return torch.as_tensor(values, device=self.dev)


def fold(tw: Twin, name: str, add: bool, rows: list[int], values: np.ndarray) -> None:
    (tw.table.add_row_state if add else tw.table.set_row_state)(name, tw.t(rows), tw.t(values))


def evict(tw: Twin, row: int, cols: list[int]) -> None:
    tw.pool.free(tw.table.evict(tw.t([row] * len(cols)), tw.t(cols)))


def copy_on_write(tw: Twin, row: int, cols: list[int]) -> None:
    """The entries ``cols`` of ``row`` (a suffix of its shared prefix) into fresh pages of its own."""
    pages = tw.pool.alloc((len(cols) + P - 1) // P, row, for_relocation=True)
    dst = (pages[:, None] * P + torch.arange(P, device=tw.dev)).flatten()[: len(cols)]
    tw.table.apply_moves(tw.t([row] * len(cols)), tw.t(cols), dst)


def close(tw: Twin, row: int) -> None:
    tw.pool.free(tw.table.close_row(row))


def open_row(tw: Twin, row: int, n: int, own: int) -> None:
    """A request on the prefix's first ``n`` tokens, then ``own`` tokens of its own."""
    r = tw.t([row])
    tw.table.open_rows(r, shared=np.array([n]))
    tw.table.sync_new_tokens(r, tw.t([n]), tw.prefix[:n])
    tw.table.append(r, tw.t([own]))


def check(device: str) -> dict:
    g = np.random.default_rng(11)
    twins = [Twin(device), Twin("cpu")]
    account: dict[tuple[int, int], list[np.float32]] = {}  # (row, logical) -> [acc, last]
    live: list[int] = []
    capacity0 = twins[0].table.states.capacity

    def each(fn, *args) -> None:
        for tw in twins:
            fn(tw, *args)

    def verify(step: int) -> None:
        for tw in twins:
            t = tw.table
            check_integrity(t)
            for k, name in enumerate(NAMES):
                if not live:
                    continue
                rows = torch.tensor(live)
                width = max(int(t.live_len[rows.to(tw.dev)].max()), 1)
                got = t.row_state(name, rows.to(tw.dev), width).cpu()
                logical = t.row_logical(rows.to(tw.dev), width).cpu()
                for i, row in enumerate(live):
                    n = int(t.live_len[row])
                    want = [account.get((row, int(lg)), [np.float32(0)] * 2)[k] for lg in logical[i, :n]]
                    assert np.array_equal(got[i, :n].numpy(), np.array(want, dtype=np.float32)), (
                        f"step {step}: row {row}'s {name} state on {tw.dev} is not its own"
                    )
        for name in NAMES:
            a, b = (tw.table.state[name].cpu() for tw in twins)
            assert torch.equal(a, b), f"step {step}: the {device} and CPU tables' {name} cells differ"

    for step in range(STEPS):
        free = [r for r in range(ROWS) if r not in live]
        op = g.choice(["open", "open", "fold", "fold", "evict", "cow", "close"])
        room = twins[1].pool.num_free()  # pages (the same on both twins)
        if op == "open" and free and room >= 2:  # own tokens: at most 2 pages
            each(open_row, free[0], int(g.integers(1, TREE_PAGES * P + 1)), int(g.integers(1, 6)))
            live.append(free[0])
        elif op == "fold" and live:
            rows = sorted(g.choice(live, size=int(g.integers(1, len(live) + 1)), replace=False).tolist())
            width = int(twins[1].table.live_len[rows].max())
            values = g.standard_normal((len(rows), width)).astype(np.float32)
            name, add = ("acc", True) if g.random() < 0.5 else ("last", False)
            each(fold, name, add, rows, values)
            logical = twins[1].table.row_logical(torch.tensor(rows), width)
            k = NAMES.index(name)
            for i, row in enumerate(rows):
                for j in range(int(twins[1].table.live_len[row])):
                    cell = account.setdefault((row, int(logical[i, j])), [np.float32(0)] * 2)
                    cell[k] = cell[k] + values[i, j] if add else values[i, j]
        elif op == "evict" and live:
            row = int(g.choice(live))
            n = int(twins[1].table.live_len[row])
            cols = sorted(g.choice(n - 1, size=min(n - 1, int(g.integers(0, 4))), replace=False).tolist())
            if cols:
                each(evict, row, cols)
        elif op == "cow" and live:
            row = int(g.choice(live))
            ns = int(twins[1].table.states.n_shared[row])
            cols = list(range(int(g.integers(0, ns)), ns)) if ns else []
            if cols and twins[1].pool.num_free(for_relocation=True) >= (len(cols) + P - 1) // P:
                each(copy_on_write, row, cols)
        elif op == "close" and live:
            row = int(g.choice(live))
            each(close, row)
            live.remove(row)
            account = {key: v for key, v in account.items() if key[0] != row}
        verify(step)
    for row in [r for r in range(ROWS) if r not in live]:  # every row on the whole prefix: past the capacity
        each(open_row, row, TREE_PAGES * P, 1)
        live.append(row)
        verify(STEPS)
    st = twins[0].table.states
    assert st.compactions > 0 and st.capacity > capacity0, "the cells were never packed or grown: not exercised"
    return {"steps": STEPS, "compactions": st.compactions, "capacity": st.capacity, "capacity0": capacity0}
