"""Copy-on-write of the radix tree's prefix pages, for managed requests (SGLang's ``UnifiedRadixCache``).

A managed request may evict tokens of its tree prefix: they leave its row (its view), but their pages stay with the
tree, locked by the request. ``PrefixCow.step`` asks the core's ``plan_cow`` which requests should copy their
live prefix tokens into private pages; for each one it copies them (the reclaimer's copy engine, ordered before
the next forward), rewrites its row, takes a lock on the node at its cut and drops its old lock, so the tree can
evict the nodes nobody locks any more under memory pressure.

Invariants: the tree's slots are never written or moved here (copy, never move), and freed only by SGLang's own
eviction of nodes nobody locks (``_make_room``, for the pages of a copy); a request that copied is
never inserted into the tree (``skip_radix_cache_insert`` is set at a request's first eviction); after a copy, the
request's row holds tree slots only for logical positions below its new ``cache_protected_len`` (the cut) and
its lock is on the node at the cut. The copies are a suffix of the row's shared prefix, so each entry's own policy
state goes with it into its private slot (``TokenTable.apply_moves``).
"""

from __future__ import annotations

import logging
import time

import torch
from sglang.srt.mem_cache.common import evict_from_tree_cache

from vtoken_sglang.core.copy_engine import copy_then_publish
from vtoken_sglang.core.cow import CowGroup, CowPlan, Holder, PrefixNode, plan_cow
from vtoken_sglang.core.pages import OutOfPages
from vtoken_sglang.core.planner import Moves
from vtoken_sglang.core.segments import packed_slots

logger = logging.getLogger("vtoken_sglang")


class PrefixCow:
    def __init__(self, tree_cache, table, pool, engine, page_size: int, allow_copies: bool):
        self.tree = tree_cache
        self.core = tree_cache.tree_core
        self.table = table
        self.pool = pool
        self.engine = engine
        self.page_size = page_size
        self.allow_copies = allow_copies  # Naive-Evict: only releases whose live tokens are all gone
        self.copies = 0  # requests that copied (or, with nothing live there, just moved their lock up)
        self.tokens_copied = 0
        self.pages_released = 0  # pages of tree nodes left without a lock by a copy
        self.checks = 0
        self.room_pages = 0  # pages of unlocked tree nodes evicted to make room for copies
        self.deferred = 0  # checks that left a gainful release for later: its pages were not free
        self.retry = False  # the last check deferred a group: check again at the next trimming round
        self.waiting: set[int] = set()  # rows whose gainful copy the last check left for later (admission holds room)
        self.seconds = 0.0

    def candidates(self, reqs: list) -> list:
        """Running managed requests that lock a non-root node."""
        return [
            r
            for r in reqs
            if r.lock is not None
            and not r.finished()
            and r.kv.cache_protected_len > 0
            and bool(self.table.active[r.kv.req_pool_idx])
            and not self.tree.is_root(r.lock.node)
        ]

    def plan(self, cands: list, others: list) -> tuple[CowPlan, dict]:
        """The core's plan over the candidates ``cands``, and per request key its (req, path, first live column of
        each path node, end column of the prefix). A node's lock count is the number of requests, among ``cands``
        and the other lock holders ``others`` (running requests not managed, the request being chunked), whose
        locked path contains it: SGLang's tree core does not expose per-node counts (its Rust core has no node
        objects). In the configurations vToken accepts there is no other holder (HiCache and streaming sessions are
        refused at start); one it did not see could only make a copy not pay off, never make it wrong: the tree's
        slots are never touched, and the node stays locked by that holder."""
        locked = [r for r in others if r.lock is not None and not self.tree.is_root(r.lock.node)]
        paths = self.core.collect_path_info([r.lock.node for r in cands + locked])
        lock_ref: dict = {}
        pages: dict = {}
        for path in paths:
            for p in path:
                lock_ref[p.node_id] = lock_ref.get(p.node_id, 0) + 1
                pages[p.node_id] = (p.full_value_len or 0) // self.page_size
        nodes = {n: PrefixNode(lock_ref[n], pages[n]) for n in lock_ref}
        holders, info = [], {}
        for req, path in zip(cands, paths):
            if not path or path[-1].path_end != req.kv.cache_protected_len:
                continue  # the lock does not cover exactly the protected prefix: leave the request alone
            row = req.kv.req_pool_idx
            n = int(self.table.live_len[row])
            logical = self.table.row_logical(torch.tensor([row], device=self.table.slots.device), n)[0].contiguous()
            bounds = torch.tensor(
                [p.path_start for p in path] + [path[-1].path_end], dtype=logical.dtype, device=logical.device
            )
            cols = torch.searchsorted(logical, bounds).tolist()
            holders.append(Holder(row, tuple(p.node_id for p in path), tuple(cols[-1] - c for c in cols[:-1])))
            info[row] = (req, path, cols)
        self.checks += 1
        # the room copies may take: free pages, and those of tree nodes no one locks (``_make_room`` evicts them)
        room = self.pool.num_free(for_relocation=True) + self.tree.evictable_size() // self.page_size
        return plan_cow(holders, nodes, self.page_size, self.allow_copies, room), info

    def step(self, reqs: list, others: list = ()) -> int:
        """Plan and carry out copy-on-write for the running requests ``reqs`` (``others``: any other request that
        may hold a tree lock, e.g. the one being chunked); returns the pages released. The plan's groups are carried
        out in order, each whole or not at all; a group whose pages are not free evicts unlocked tree nodes for them
        (those the groups before it just released among them). The plan fits the room there is (free pages and
        unlocked tree pages): a group too large for it is split into its members' own parts, and its shared part,
        like a group that still does not fit, is left for the next check, which then comes at the next trimming
        round (``retry``)."""
        self.table.settle()
        self.retry = False
        cands = self.candidates(reqs)
        if not cands:
            return 0
        t0 = time.perf_counter()
        cand_ids = {id(r) for r in cands}
        plan, info = self.plan(cands, [r for r in list(reqs) + list(others) if r is not None and id(r) not in cand_ids])
        self.waiting = set(plan.waiting)
        if plan.deferred:
            self.retry = True
            self.deferred += 1
        taken: list[tuple[CowGroup, torch.Tensor]] = []  # groups whose pages are taken and whose copy is not issued
        released = 0
        for group in plan.groups:
            if group.pages_copied > self.pool.num_free(for_relocation=True):
                released += self._carry_out(taken, info)
                taken = []
                self._make_room(group.pages_copied)
            try:
                taken.append((group, self._take_pages(group)))
            except OutOfPages:
                self.retry = True
                self.deferred += 1
                self.waiting.update(d.key for d in group.decisions)
                logger.debug("[vtoken] copy-on-write deferred: %d pages needed, none free", group.pages_copied)
        released += self._carry_out(taken, info)
        self.seconds += time.perf_counter() - t0
        return released

    def forget(self, row: int) -> None:
        """The request in ``row`` ends: no copy of it waits."""
        self.waiting.discard(row)

    def _make_room(self, pages: int) -> None:
        """Evict unlocked radix-tree nodes (SGLang's own eviction, LRU) until ``pages`` pages can be taken, or
        nothing evictable is left."""
        short = pages - self.pool.num_free(for_relocation=True)
        if short > 0:
            before = self.pool.num_free(for_relocation=True)
            evict_from_tree_cache(self.tree, self.pool.allocator.available_size() + short * self.page_size)
            self.room_pages += self.pool.num_free(for_relocation=True) - before

    def _take_pages(self, group: CowGroup) -> torch.Tensor:
        """The new private pages of ``group``'s copies, owned by their rows (decision order, ``d.pages`` each)."""
        owners = [d.key for d in group.decisions for _ in range(d.pages)]
        owners = torch.tensor(owners, dtype=torch.int64, device=self.table.slots.device)
        return self.pool.alloc(len(owners), owners, for_relocation=True)

    def _carry_out(self, taken: list, info: dict) -> int:
        """One copy for the groups ``taken`` (into their pages), the rows rewritten behind it, then each request's
        lock moved up to its cut (the new node locked first). Returns the tree pages released."""
        if not taken:
            return 0
        self._copy(taken, info)
        decisions = [d for group, _ in taken for d in group.decisions]
        for d in decisions:
            req, path, _ = info[d.key]
            node = path[d.cut - 1].node_id if d.cut else self.tree.root_node_handle()
            lock = self.tree.lock(node)
            self.tree.unlock(req.lock)
            req.lock, req.last_node = lock, node
            req.kv.cache_protected_len = path[d.cut - 1].path_end if d.cut else 0
        released = sum(group.pages_released for group, _ in taken)
        self.copies += len(decisions)
        self.pages_released += released
        logger.debug(
            "[vtoken] copy-on-write: %d requests copy %d tokens into %d pages; %d tree pages released (%s)",
            len(decisions),
            sum(d.tokens for d in decisions),
            sum(group.pages_copied for group, _ in taken),
            released,
            [(d.key, d.cut, d.tokens) for d in decisions],
        )
        return released

    def _copy(self, taken: list, info: dict) -> None:
        """Copy every decision's live tokens past its cut into its group's new pages and rewrite the rows (one
        ``copy_then_publish``). The sources are tree slots still locked by these requests, the destinations pages
        free before this call: disjoint."""
        P = self.page_size
        dev = self.table.slots.device
        rows, cols, dst = [], [], []
        for group, pages in taken:
            first = 0
            for d in group.decisions:
                if d.tokens:
                    _, _, bounds = info[d.key]
                    c = torch.arange(bounds[d.cut], bounds[-1], device=dev)
                    assert len(c) == d.tokens
                    k = torch.arange(d.tokens, device=dev)
                    rows.append(torch.full_like(c, d.key))
                    cols.append(c)
                    dst.append(packed_slots(pages, first, k, P))
                first += d.pages
        if not rows:
            return
        rows, cols, dst = torch.cat(rows), torch.cat(cols), torch.cat(dst)
        src = self.table.slots[rows, cols].to(torch.int64)
        assert not bool((self.pool.owner[src // P] >= 0).any()), "copy-on-write source outside the tree's pages"
        copy_then_publish(self.engine, self.table, Moves(rows, cols, src, dst))
        self.tokens_copied += len(dst)

    def metrics(self) -> dict:
        return {
            "cow_copies": self.copies,
            "cow_tokens_copied": self.tokens_copied,
            "cow_pages_released": self.pages_released,
            "cow_checks": self.checks,
            "cow_room_pages": self.room_pages,
            "cow_deferred": self.deferred,
            "cow_ms": round(self.seconds * 1e3, 3),
        }
