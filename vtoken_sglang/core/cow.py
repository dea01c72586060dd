"""Copy-on-write of shared prefix pages: which requests should copy their live prefix tokens out of the prefix
cache's pages, and where each one cuts its locked path.

Engine-agnostic (no engine import). The engine describes the prefix cache as a tree of nodes, each holding whole
pages, and every candidate request by the path of nodes it locks (root's child first), with how many of its live
tokens lie at or after the start of each node of that path. A request that *copies from cut d* moves its live
tokens of ``path[d:]`` into private pages (``ceil(live / page_size)`` new pages) and keeps only ``path[:d]``
locked. A node becomes evictable by the cache once no lock is left on it.

Rule (everything is counted in pages; a decision is taken only when it strictly lowers the projected count):

- a node is *releasable* when every lock on it belongs to a candidate request (``lock_ref`` equals the number of
  candidates whose path contains it); releasable nodes form a suffix of each candidate's path;
- candidates sharing releasable nodes form a group; the group copies when the pages of its releasable nodes
  exceed the pages its members' copies need (so a prefix shared by several requests is released only when all
  its holders copy, and only if that pays);
- otherwise each member alone may still copy the part of its path that nobody else holds, if that pays;
- under a bound on the pages copies may take now (``room``), a group that does not fit is split the same way, and
  its shared part waits for a later check.

``allow_copies=False`` (Naive-Evict: no relocation) accepts only decisions that copy nothing: nodes whose tokens
are dead for every holder are released.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from vtoken_sglang.core.pages import pages_for


@dataclasses.dataclass(frozen=True)
class PrefixNode:
    lock_ref: int  # locks held on the node (by any holder: requests, in-flight prefills, sessions)
    pages: int  # pages of KV the node holds


@dataclasses.dataclass(frozen=True)
class Holder:
    key: int  # the request (its row)
    path: tuple[int, ...]  # node ids from the root's child down to the node it locks
    live_from: tuple[int, ...]  # live_from[i]: its live tokens at or after the start of path[i] (within the path)

    def __post_init__(self):
        assert len(self.path) == len(self.live_from)
        assert all(a >= b for a, b in zip(self.live_from, self.live_from[1:])), "live_from must not grow with depth"


@dataclasses.dataclass(frozen=True)
class CowDecision:
    key: int
    cut: int  # keep path[:cut] locked; copy the live tokens of path[cut:]
    tokens: int  # live tokens to copy
    pages: int  # new private pages they need


@dataclasses.dataclass(frozen=True)
class CowGroup:
    """Decisions that release their nodes only together (every holder of a shared node copies): carried out whole
    or not at all. Each group alone strictly gains (``pages_released > pages_copied``), so any subset of a plan's
    groups may be carried out, in any order."""

    decisions: tuple[CowDecision, ...]
    pages_released: int  # pages of the nodes left without any lock
    pages_copied: int  # new private pages the copies take


@dataclasses.dataclass(frozen=True)
class CowPlan:
    groups: tuple[CowGroup, ...]
    deferred: bool = False  # a gainful release was left for a later check: its copies did not fit the room
    waiting: frozenset[int] = frozenset()  # keys of the holders whose gainful copy was left for a later check

    @property
    def decisions(self) -> tuple[CowDecision, ...]:
        return tuple(d for g in self.groups for d in g.decisions)

    @property
    def pages_released(self) -> int:
        return sum(g.pages_released for g in self.groups)

    @property
    def pages_copied(self) -> int:
        return sum(g.pages_copied for g in self.groups)

    @property
    def gain(self) -> int:
        return self.pages_released - self.pages_copied


def _suffix_start(path: Sequence[int], ok) -> int:
    i = len(path)
    while i > 0 and ok(path[i - 1]):
        i -= 1
    return i


def plan_cow(
    holders: Sequence[Holder],
    nodes: dict[int, PrefixNode],
    page_size: int,
    allow_copies: bool = True,
    room: int | None = None,
) -> CowPlan:
    """Decide which holders copy, and from which cut. Deterministic (the same input gives the same plan, so every
    tensor-parallel rank agrees).

    ``room``: pages the copies may take now (free, or held by nodes nobody locks), ``None`` for no bound. Groups
    are taken in order while they fit; each one taken adds its gain to the room (the nodes it releases become
    evictable). A group that pays but does not fit is split: its members copy the parts nobody else holds (those
    that fit), and the shared part waits for a later check (``CowPlan.deferred``; its holders in
    ``CowPlan.waiting``), when it costs only its own live tokens."""
    holders_of: dict[int, list[int]] = {}
    for h in holders:
        for n in h.path:
            holders_of.setdefault(n, []).append(h.key)
    releasable = {n for n, keys in holders_of.items() if nodes[n].lock_ref == len(keys)}
    by_key = {h.key: h for h in holders}

    # groups: holders joined by the releasable nodes they share (union-find over keys)
    parent = {h.key: h.key for h in holders}

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for n in sorted(releasable):
        keys = holders_of[n]
        for k in keys[1:]:
            parent[find(k)] = find(keys[0])
    groups: dict[int, list[int]] = {}
    for h in holders:
        if _suffix_start(h.path, releasable.__contains__) < len(h.path):
            groups.setdefault(find(h.key), []).append(h.key)

    out: list[CowGroup] = []
    left = float("inf") if room is None else room
    deferred = False
    waiting: set[int] = set()

    def take(group: CowGroup) -> None:
        nonlocal left, deferred
        if group.pages_copied > left:
            deferred = True
            waiting.update(d.key for d in group.decisions)
            return
        out.append(group)
        left += group.pages_released - group.pages_copied

    def decide(key: int, cut: int) -> CowDecision:
        tokens = by_key[key].live_from[cut]  # cut < len(path): every caller has something to release
        return CowDecision(key, cut, tokens, pages_for(tokens, page_size))

    for root in sorted(groups):
        members = groups[root]
        cuts = {k: _suffix_start(by_key[k].path, releasable.__contains__) for k in members}
        group = [decide(k, c) for k, c in cuts.items()]
        freed = sum(nodes[n].pages for n in {n for k, c in cuts.items() for n in by_key[k].path[c:]})
        cost = sum(d.pages for d in group)
        if freed > cost and (allow_copies or all(d.tokens == 0 for d in group)):
            if cost <= left:
                take(CowGroup(tuple(group), freed, cost))
                continue
            deferred = True
            waiting.update(members)  # the shared part waits, whatever each member copies alone now
        for k in members:  # alone: only the nodes nobody else holds
            cut = _suffix_start(by_key[k].path, lambda n: n in releasable and len(holders_of[n]) == 1)
            if cut == len(by_key[k].path):
                continue
            d, freed = decide(k, cut), sum(nodes[n].pages for n in by_key[k].path[cut:])
            if freed > d.pages and (allow_copies or d.tokens == 0):
                take(CowGroup((d,), freed, d.pages))
    return CowPlan(tuple(out), deferred, frozenset(waiting))
