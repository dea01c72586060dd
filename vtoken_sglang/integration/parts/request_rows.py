"""``RequestRows``: which of SGLang's requests vToken manages, and what their rows tell SGLang.

A request becomes *managed* the first time it exceeds its budget during decode (score policies: at its first
scored step; snapkv: after its prefill). Until then its row is exactly upstream's (dense, insertable in the radix
tree). From then on:
- its row ``req_to_token[r, 0:seq_len]`` holds only live tokens, in logical order, and ``seq_len`` = live count
  (``write_lengths``);
- from its first eviction on (``mark_compacted``), ``req.skip_radix_cache_insert`` is set (its row no longer
  matches its token ids). A managed request that never evicted (a score policy's, under budget) keeps a dense
  row: when it ends, its pages go back to SGLang untracked and upstream releases it, inserting it into the tree;
- tokens of its tree prefix (logical positions below ``cache_protected_len``) are eviction candidates like any
  other, but evicting one only drops it from the request's view: its slot is the tree's, never moved or freed here;
- its private pages are tracked in the ``SglangPagePool`` (owner = row, live counts);
- its decode positions are ``seq_len - 1 + offset[row]`` (``offset`` = logical_len - live_len), its next slot
  follows the tail-page rule, and its pages are released here (SGLang's segment free assumes dense rows).

Host mirrors (NumPy, per row) let the per-step hooks decide without reading a device tensor (a stall between
forwards on a GPU): ``host_active`` (managed), ``host_offset`` (``offset``) and ``host_tail_pos`` (the in-page
position of the row's last slot: the newest token is never evicted, and its page, the tail page, is never
relocated, so it changes only when a decode token is appended: ``(pos + 1) % page_size``, a new page at 0).
The integrity check in the server compares them with the device state.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from vtoken_sglang.core.pages import tail_room
from vtoken_sglang.core.row_layout import RowLayout
from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.integration.observe.host_reads import on_host
from vtoken_sglang.integration.parts.page_bridge import SglangPagePool

DUE_HORIZON = 64  # decode steps ahead a row's budget is evaluated at each check (one check per trim in most loads)


def request_key(req) -> int:
    """A request's identity for policies: a hash of its prompt token ids. The same on every TP rank, in every run,
    with reclaim on or off, and whatever row the request gets (rids are random; rows depend on timing)."""
    return zlib.crc32(np.asarray(req.origin_input_ids, dtype=np.int64).tobytes())


class RequestRows:
    def __init__(self, table: TokenTable, pool: SglangPagePool):
        self.table = table
        self.pool = pool
        self.req_to_token = table.slots
        self.page_size = pool.page_size
        n = table.slots.shape[0]
        self.offset = torch.zeros(n, dtype=torch.int64, device=table.slots.device)
        self.host_active = np.zeros(n, dtype=bool)
        self.host_offset = np.zeros(n, dtype=np.int64)
        self.host_tail_pos = np.zeros(n, dtype=np.int64)
        self.host_compacted = np.zeros(n, dtype=bool)  # managed and evicted at least once: not insertable
        self.host_parked = np.zeros(n, dtype=bool)  # managed, held by a streaming session between its turns
        # the logical length at which a row may first be over budget + slack (0: check at the next round)
        self.host_due = np.zeros(n, dtype=np.int64)
        self.quiet_rounds = 0  # rounds from now in which no batch row is due (``skip_check``)
        self.requests_managed = 0  # requests ever managed
        self.n_managed = 0  # rows managed now (== table.active.sum()); 0 lets every hook take upstream's path
        self.preparing: RowLayout | None = None  # the batch ``prepare_for_decode`` is preparing, with managed rows
        # the prefix lengths ``alloc_for_extend`` gives the allocator's page arithmetic (the tail-page rule)
        self.extending: np.ndarray | None = None

    def device_bytes(self) -> int:
        """Device bytes of the per-row position offsets (the host mirrors are host memory)."""
        return self.offset.numel() * self.offset.element_size()

    def is_managed(self, row: int) -> bool:
        return self.n_managed > 0 and bool(self.host_active[row])

    def layout(
        self, host_rows: np.ndarray, host_live: np.ndarray, device_rows: torch.Tensor | None = None, decoding=False
    ) -> RowLayout:
        """The ``RowLayout`` of a batch whose entries are the rows ``host_rows`` with live lengths ``host_live``
        (host arrays: SGLang's ``req_pool_indices_cpu`` and ``seq_lens_cpu``). ``device_rows``: the same rows on
        the device, for a forward's readers of device offsets (gathered there: no host-to-device copy)."""
        host_rows = host_rows.astype(np.int64, copy=False)
        host_live = host_live.astype(np.int64, copy=False)
        managed = self.n_managed > 0
        host_offset = self.host_offset[host_rows] if managed else np.zeros(len(host_rows), dtype=np.int64)
        offset = self.offset[device_rows.to(torch.int64)] if managed and device_rows is not None else None
        return RowLayout(self.table, host_rows, host_live, host_offset, offset, managed, decoding)

    def needs_page(self, rows: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """Whether each row's next decode token starts a new page (the tail-page rule, on the host mirrors).
        ``seq_lens``: the rows' lengths before that token; an unmanaged row is dense (its last slot's in-page
        position is ``(seq_len - 1) % page_size``)."""
        P = self.page_size
        pos = np.where(self.host_active[rows], self.host_tail_pos[rows], (seq_lens - 1) % P)
        return tail_room(pos, P) == 0

    def over_budget(self, layout: RowLayout, policy) -> np.ndarray:
        """Batch positions of the rows of a batch (``layout``) over ``policy``'s budget + slack.
        Only rows whose logical length reached their due length are checked, each ``DUE_HORIZON`` decode steps
        ahead at once: a decode step adds one token to both its live and logical lengths, so the step at which a
        row first runs over is known now, and the row is due then (or after the horizon, if it stays under)."""
        host_rows, live, logical = layout.host_rows, layout.host_live, layout.host_logical
        due = np.flatnonzero(logical >= self.host_due[host_rows])
        if not due.size:
            return due
        ahead = np.arange(DUE_HORIZON)
        future = logical[due][:, None] + ahead
        budget = on_host(policy.budget, future.ravel()).reshape(future.shape)
        over = budget + policy.cfg.slack < live[due][:, None] + ahead
        first = np.where(over.any(1), over.argmax(1), DUE_HORIZON)
        self.host_due[host_rows[due]] = logical[due] + first
        # the batch's next due row is due in max(gap, 1) rounds (each adds one logical token to every row)
        self.quiet_rounds = max(int((self.host_due[host_rows] - logical).min()), 1) - 1
        return due[first == 0]

    def skip_check(self) -> bool:
        """Whether this round's ``over_budget`` can be skipped: no row of the batch checked last is due, and no
        request has joined it since (``recheck``). Counts the round."""
        if self.quiet_rounds > 0:
            self.quiet_rounds -= 1
            return True
        return False

    def recheck(self) -> None:
        """Requests may join the decode batch (a batch that is not a decode step ran): check at the next round."""
        self.quiet_rounds = 0

    def forget(self, row: int) -> None:
        """The request in ``row`` ends (any request): the next one there is checked at its first round."""
        self.host_due[row] = 0

    def manage(self, reqs: list) -> None:
        """Start tracking requests whose rows are still dense (upstream's)."""
        dev = self.req_to_token.device
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64, device=dev)
        lens = torch.tensor([r.kv.kv_committed_len for r in reqs], dtype=torch.int64, device=dev)
        keys = torch.tensor([request_key(r) for r in reqs], dtype=torch.int64, device=dev)
        host_protected = np.fromiter((r.kv.cache_protected_len for r in reqs), dtype=np.int64, count=len(reqs))
        protected = torch.from_numpy(host_protected).to(dev)
        # the tree prefix is read from pages the row does not own: its policy state is the request's own cells
        self.table.open_rows(rows, keys, shared=host_protected)
        # register the whole row; only the request's own pages (past the tree prefix) are claimed and counted
        self.table.sync_new_tokens(rows, protected)
        self.table.sync_new_tokens(rows, lens - protected, claim_pages=True)
        host_rows = np.fromiter((r.kv.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        host_lens = np.fromiter((r.kv.kv_committed_len for r in reqs), dtype=np.int64, count=len(reqs))
        self.host_active[host_rows] = True
        self.host_offset[host_rows] = 0
        self.host_compacted[host_rows] = False
        self.host_tail_pos[host_rows] = (host_lens - 1) % self.page_size  # a dense row's last slot
        self.requests_managed += len(reqs)
        self.n_managed += len(reqs)

    def mark_compacted(self, reqs: list) -> None:
        """``reqs`` (managed) are about to evict: their rows stop matching their token ids."""
        for r in reqs:
            r.skip_radix_cache_insert = True
        self.host_compacted[[r.kv.req_pool_idx for r in reqs]] = True

    def release(self, req) -> None:
        """Before SGLang releases a managed request. A dense row (never evicted): stop tracking it and its pages,
        and let upstream release it (and insert it into the tree). A compacted row: free its private pages here
        and leave SGLang nothing of the row to free past the tree prefix (its segment free assumes a dense row).
        Without a tree prefix (radix cache off, or a prompt shorter than a page) SGLang asserts that a row it
        still holds is not empty: it gets one page of the request to free itself, as a one-slot row. ``req``: a
        request, or a streaming session's record (``.kv``)."""
        row = req.kv.req_pool_idx
        pages = self.table.close_row(row)
        self.n_managed -= 1
        self.host_parked[row] = False
        self.offset[row] = 0
        self.host_active[row] = False
        self.host_offset[row] = 0
        if not self.host_compacted[row]:
            self.pool.disown(pages)
            return
        self.host_compacted[row] = False
        keep = req.kv.cache_protected_len
        if keep == 0 and pages.numel():
            handed, pages = pages[:1], pages[1:]
            self.pool.disown(handed)
            self.req_to_token[row, 0] = (handed[0] * self.page_size).to(self.req_to_token.dtype)
            keep = 1
        self.pool.free(pages)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = keep

    def park(self, req, end: int) -> None:
        """A streaming session's turn on managed row ``req.kv.req_pool_idx`` (the session's record) ends: the row
        stays managed, compacted as it is, with its tokens' logical positions and policy state, for the session's
        next turn (``unpark``). Its KV past logical position ``end`` (the turn's committed tokens) is dropped; its
        live length is written into the record."""
        row = req.kv.req_pool_idx
        if int(self.table.logical_len[row]) > end:
            self.truncate_row(row, end)
        self.host_parked[row] = True
        self.write_request(req)

    def unpark(self, req, end: int) -> int:
        """The next turn of a parked row's session borrows its record: its KV past logical position ``end`` (what
        the turn's prompt does not repeat) is dropped. Returns the row's logical length, where the turn's new tokens
        start (its prefix length to SGLang); its live length is written into the record."""
        row = req.kv.req_pool_idx
        self.host_parked[row] = False
        logical = int(self.table.logical_len[row])
        if logical > end:
            self.truncate_row(row, end)
            logical = end
        self.write_request(req)
        return logical

    def truncate_row(self, row: int, end: int) -> None:
        """Roll managed ``row`` back to logical position ``end`` (``TokenTable.truncate``): emptied private pages
        freed, the host mirrors read back (its tail: the last live slot's in-page position when its page is the
        row's own, else the page's end, so that the next token opens a page)."""
        dev = self.req_to_token.device
        rows = torch.tensor([row], dtype=torch.int64, device=dev)
        self.pool.free(self.table.truncate(rows, torch.tensor([end], dtype=torch.int64, device=dev)))
        last = self.req_to_token[row, self.table.live_len[row] - 1].to(torch.int64)
        own = self.pool.owner[last // self.page_size] == row
        tail = torch.where(own, last % self.page_size, torch.full_like(last, self.page_size - 1))
        self.host_tail_pos[row] = int(tail)
        self.host_due[row] = 0

    def drop_parked(self) -> None:
        """SGLang clears its pools (a cache flush, fully idle): the parked rows stop being tracked, their pages
        cleared with the allocator."""
        for row in self.parked_rows().tolist():
            self.pool.disown(self.table.close_row(row))
            self.n_managed -= 1
            self.offset[row] = 0
            self.host_active[row] = self.host_parked[row] = self.host_compacted[row] = False
            self.host_offset[row] = 0

    def parked_rows(self) -> np.ndarray:
        """Rows held by streaming sessions between turns (managed, no request running on them)."""
        return np.flatnonzero(self.host_parked)

    def owned_pages(self, rows: np.ndarray) -> int:
        """Pages the managed ``rows`` own (tracked here; a tree prefix's pages are the tree's)."""
        if len(rows) == 0:
            return 0
        owners = torch.from_numpy(rows.astype(np.int64)).to(self.pool.owner.device)
        return int(torch.isin(self.pool.owner, owners.to(self.pool.owner.dtype)).sum())

    def sync_decode(self, layout: RowLayout) -> None:
        """``prepare_for_decode`` wrote one new slot per managed request of its batch (``layout``) at column
        ``seq_len``: the Token Table registers it when it is next read (``TokenTable.defer_decode_tokens``); the host
        mirrors now."""
        if not layout.any_managed:
            return
        host_rows = layout.host_rows
        managed = self.host_active[host_rows]
        n = int(managed.sum())
        if n == 0:
            return
        mine = host_rows if n == len(host_rows) else host_rows[managed]  # with eviction on, usually every row
        self.host_tail_pos[mine] = (self.host_tail_pos[mine] + 1) % self.page_size
        self.table.defer_decode_tokens(mine)  # registered when the table is next read

    def extend(self, host_rows: np.ndarray, counts: np.ndarray) -> None:
        """An extend wrote ``counts[i]`` new slots after the live entries of managed row ``host_rows[i]`` (by the
        tail-page rule: the last one sits ``counts[i]`` in-page positions after the old tail, modulo a page)."""
        dev = self.req_to_token.device
        rows = torch.from_numpy(host_rows).to(dev)
        self.table.sync_new_tokens(rows, torch.from_numpy(counts).to(dev), claim_pages=True)
        self.host_tail_pos[host_rows] = (self.host_tail_pos[host_rows] + counts) % self.page_size

    def write_request(self, req) -> None:
        """A managed request outside any batch (a prompt between two prefill chunks) may have been trimmed: its
        live length from the Token Table into it, and its position offset."""
        row = req.kv.req_pool_idx
        live, logical = (int(x) for x in torch.stack([self.table.live_len[row], self.table.logical_len[row]]))
        self.offset[row] = self.host_offset[row] = logical - live
        req.kv.kv_committed_len = req.kv.kv_allocated_len = live

    def write_lengths(self, batch, layout: RowLayout, at: np.ndarray) -> None:
        """The requests at batch positions ``at`` (managed) of ``batch`` (its layout before the round: ``layout``)
        were trimmed: write their live lengths from the Token Table into the batch and into them (their rows
        already hold the live slots), and their position offsets. The batch's length tensors are replaced, not
        written in place (a forward in flight may still read them)."""
        host_rows = layout.host_rows[at]
        dev = self.req_to_token.device
        rows = torch.from_numpy(host_rows).to(dev)
        live = self.table.live_len[rows]
        offset = self.table.logical_len[rows] - live
        self.offset[rows] = offset
        idx = torch.from_numpy(at).to(batch.seq_lens.device)
        for name in ("seq_lens", "orig_seq_lens"):
            lens = getattr(batch, name).clone()
            lens[idx] = live.to(lens.dtype)
            setattr(batch, name, lens)
        batch.seq_lens_sum = None
        host = torch.stack([live, offset]).cpu().numpy()  # the one read of the step: lengths the host needs
        lens_cpu = batch.seq_lens_cpu.clone()
        lens_cpu[torch.from_numpy(at)] = torch.from_numpy(host[0]).to(lens_cpu.dtype)
        batch.seq_lens_cpu = lens_cpu
        self.host_offset[host_rows] = host[1]
        for i, n in zip(at.tolist(), host[0].tolist()):
            batch.reqs[i].kv.kv_committed_len = batch.reqs[i].kv.kv_allocated_len = n
