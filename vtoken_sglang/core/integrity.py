"""``check_integrity``: every invariant of vToken written once, as a check tests and the running server
(``VTOKEN_SGLANG_CHECK_INTEGRITY=1``) call.

- I1 token conservation: logical ids of each row strictly increasing and below ``logical_len``; with
  ``kv_stamp``, every live entry's K/V bytes equal what was written for (row, logical id) (relocation kept them).
- I2 unique mapping: a private slot is live in at most one entry, and only in the row that owns its page.
- I3 pre-attention visibility: no live entry points into a page in flight (rows are published only after their
  copy; sources are unreferenced until released).
- I4 layout: every private page with no live token is a relocation source awaiting release (nothing leaks), and
  every allocated page is owned by an active request, the tree, or is such a source.
- I5 state per request: the entries a row reads from pages it does not own are its column prefix
  ``[0, n_shared)`` (a table with policy state), whose cells are an extent of the row's own, inside the state's
  capacity and disjoint from every other row's; its other entries are private (their slot's cell).
- Page accounting: free pages have no owner and no live token, and no live entry points into one; live counts
  equal the table's entries per page; free + allocated == total (for a pool that tracks every page; a bridge to
  an engine's allocator tracks only its own pages, which must then not be on the engine's free list).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from vtoken_sglang.core.pages import FREE, TREE
from vtoken_sglang.core.token_table import TokenTable


def token_stamp(rows: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
    """The K/V bytes a test writes for token ``logical`` of request ``rows`` (``[n, 3]`` float32): distinct for
    every (row, logical), exact in float32. ``check_integrity(table, kv, token_stamp)`` then checks that every live
    entry still holds its own bytes after any relocation."""
    r, lg = rows.to(torch.float32), logical.to(torch.float32)
    return torch.stack([r * 65536 + lg, -lg - 1, r], 1)


class IntegrityError(AssertionError):
    pass


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise IntegrityError(what)


def live_entries(table: TokenTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, cols, slots, logical) of every live entry of every active request, flattened."""
    rows = torch.nonzero(table.active).flatten()
    if rows.numel() == 0:
        e = torch.empty(0, dtype=torch.int64, device=rows.device)
        return e, e, e, e
    width = max(int(table.live_len[rows].max()), 1)
    valid = torch.arange(width, device=rows.device)[None, :] < table.live_len[rows][:, None]
    r_i, c = torch.nonzero(valid, as_tuple=True)
    r = rows[r_i]
    slots = table.slots[r, c].to(torch.int64)
    return r, c, slots, table.logical[slots].to(torch.int64)


def _check_state_cells(table: TokenTable, rows: torch.Tensor, cols: torch.Tensor, private: torch.Tensor) -> None:
    """I5 (``state_store``)."""
    st = table.states
    ns = st.n_shared
    _require(bool((ns <= table.live_len).all()), "a row's shared prefix is longer than its live entries (I5)")
    _require(not bool(ns[~table.active].any()), "an ended row keeps a shared prefix (I5)")
    if not st.capacity:
        return
    shared = cols < ns[rows]
    _require(not bool((shared & private).any()), "an entry of the row's own page is in its shared prefix (I5)")
    _require(
        not bool((~shared & ~private).any()),
        "an entry on a page the row does not own is past its shared prefix: its state would be every reader's (I5)",
    )
    held, base, cap = st.extents()
    on_dev = torch.from_numpy(held).to(ns.device)
    _require(bool(table.active[on_dev].all()), "an ended row holds state cells (I5)")
    _require(bool((ns[on_dev].cpu().numpy() <= cap).all()), "a shared prefix outgrew its cells (I5)")
    _require(torch.equal(st.base[on_dev].cpu(), torch.from_numpy(base)), "state cells moved (I5)")
    order = np.argsort(base)
    ends = (base + cap)[order]
    _require(bool((ends[:-1] <= base[order][1:]).all()), "two rows' state cells overlap (I5)")
    _require(not len(ends) or int(ends[-1]) <= st.top <= st.capacity, "state cells beyond the capacity (I5)")


def check_integrity(
    table: TokenTable,
    kv: Sequence[torch.Tensor] | None = None,
    kv_stamp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Raise ``IntegrityError`` naming the first violated invariant. ``kv``/``kv_stamp``: the K/V buffers and the
    function giving the bytes written for (rows, logical ids), for the I1 byte check."""
    table.settle()
    pool, P = table.pages, table.page_size
    owner, live = pool.owner, pool.live
    # ---- page accounting
    free = pool.free_ids()
    is_free = torch.zeros_like(pool.in_flight).index_fill_(0, free, True)
    _require(len(torch.unique(free)) == len(free), "free list has duplicates")
    _require(
        bool((owner[free] == FREE).all()) and bool((live[free] == 0).all()), "a free page has an owner or live tokens"
    )
    if pool.tracks_every_page:
        _require(int((owner == FREE).sum()) == len(free), "a page is neither free nor allocated")
        _require(pool.used_pages() + len(free) == pool.num_pages, "free + allocated != total")
    else:
        _require(pool.used_pages() + len(free) <= pool.num_pages, "tracked + free > total")
    # ---- table vs pages
    rows, cols, slots, logical = live_entries(table)
    pages = slots // P
    private = owner[pages] >= 0
    _require(not bool(is_free[pages].any()), "a live entry points into a free page")
    _require(
        bool((owner[pages][private] == rows[private].to(torch.int32)).all()),
        "a live entry points into another request's page (I2)",
    )
    counted = torch.zeros_like(live).index_add_(0, pages[private], torch.ones_like(pages[private], dtype=live.dtype))
    priv_pages = owner >= 0
    _require(bool((counted[priv_pages] == live[priv_pages]).all()), "page live counts differ from the table")
    _require(len(torch.unique(slots[private])) == int(private.sum()), "a private slot is live twice (I2)")
    readers = torch.zeros_like(table.readers).index_add_(0, slots, torch.ones_like(slots, dtype=table.readers.dtype))
    _require(torch.equal(readers, table.readers), "slot reader counts differ from the rows")
    _check_state_cells(table, rows, cols, private)
    # ---- in flight and leaks
    _require(not bool(pool.in_flight[pages].any()), "a live entry points into a page in flight (I3)")
    empty_private = priv_pages & (live == 0)
    _require(
        bool((pool.in_flight[empty_private]).all()),
        "an empty private page is neither freed nor awaiting release (leak)",
    )
    owners = owner[priv_pages].to(torch.int64)
    _require(
        bool((table.active[owners] | pool.in_flight[priv_pages]).all()), "a page is owned by an ended request (leak)"
    )
    _require(int(owner[0]) == TREE, "the padding page was handed out")
    # ---- I1: logical order and ids
    if rows.numel():
        same_row = rows[1:] == rows[:-1]
        _require(bool((logical[1:][same_row] > logical[:-1][same_row]).all()), "logical ids out of order (I1)")
        _require(bool((logical < table.logical_len[rows]).all()), "a logical id beyond logical_len (I1)")
    _require(bool((table.live_len <= table.logical_len).all()), "more live entries than tokens")
    if kv is not None and kv_stamp is not None and rows.numel():
        expected = kv_stamp(rows, logical)
        for buf in kv:
            _require(
                torch.equal(
                    buf[slots].reshape(expected.shape[0], -1), expected.to(buf.dtype).reshape(expected.shape[0], -1)
                ),
                "K/V bytes of a live token changed (I1)",
            )
