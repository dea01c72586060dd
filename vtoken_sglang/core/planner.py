"""Reclaim planning: a pure function from a page-level snapshot to a plan, and the token-level packing of a plan.

Stages:
1. Eligibility: a source page is private, not in flight, not its owner's tail page, and neither empty nor full.
2. Source choice per request: its eligible pages sorted by live count (sparsest first, page id breaks ties); it
   takes the prefix of k pages that maximizes ``k - ceil(live_in_prefix / P)`` (pages freed) among prefixes whose
   destinations fit the free pages, the shortest such prefix, so no token moves without paying for itself.
3. Headroom-aware admission: destinations come from the free pages including the relocation reserve; requests
   are admitted by descending gain (then row id) while their destinations fit. Every admitted request frees
   strictly more pages than it takes (I4).
4. Packing (``pack_moves``): a request's live tokens in its source pages, in logical order, fill
   ``ceil(T_live / P)`` destination pages densely.
Everything is vectorized over pages and requests; cost grows with pages, not with context length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import torch

from vtoken_sglang.core.segments import packed_slots


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the planner sees: per page live count, owner (row >= 0 private, < 0 free/tree), blocked mark (in
    flight or a tail page); the destination budget; the epoch it was taken at."""

    epoch: int
    page_size: int
    live: torch.Tensor  # int32 [num_pages + 1]
    owner: torch.Tensor  # int32 [num_pages + 1]
    blocked: torch.Tensor  # bool  [num_pages + 1]
    free_for_relocation: int

    ARRAYS: ClassVar[tuple[tuple[str, str], ...]] = (("live", "int32"), ("owner", "int32"), ("blocked", "bool"))
    """The per-page tensor fields and their dtypes, in wire order (``worker.protocol``)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per admitted request ``rows[i]``: ``n_dst[i]`` destination pages and its source pages
    ``src_pages[src_row == rows[i]]``, with their live counts at snapshot time (``src_live``, to detect change)."""

    epoch: int
    rows: torch.Tensor  # int64 [k]
    n_dst: torch.Tensor  # int64 [k]
    src_pages: torch.Tensor  # int64 [m]
    src_row: torch.Tensor  # int64 [m]
    src_live: torch.Tensor  # int32 [m]

    ARRAYS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("rows", "int64"),
        ("n_dst", "int64"),
        ("src_pages", "int64"),
        ("src_row", "int64"),
        ("src_live", "int32"),
    )
    """The tensor fields and their dtypes, in wire order (``worker.protocol``)."""
    PER_REQUEST: ClassVar[tuple[str, ...]] = ("rows", "n_dst")  # one entry per admitted request
    PER_PAGE: ClassVar[tuple[str, ...]] = ("src_pages", "src_row", "src_live")  # one entry per source page

    @classmethod
    def lengths_agree(cls, lengths: Mapping[str, int]) -> bool:
        """Whether arrays of these ``lengths`` (by field name) can make a plan: the per-request arrays all one
        length, the per-page arrays all one length. The first check of a plan from elsewhere (the worker
        protocol's on the wire, the reclaimer's before it indexes anything)."""
        return all(len({lengths[name] for name in group}) == 1 for group in (cls.PER_REQUEST, cls.PER_PAGE))

    def lengths(self) -> dict[str, int]:
        """Each array field's length."""
        return {name: getattr(self, name).numel() for name, _ in self.ARRAYS}

    def to(self, device: torch.device | str) -> Plan:
        return dataclasses.replace(self, **{name: getattr(self, name).to(device) for name, _ in self.ARRAYS})

    @property
    def pages_freed(self) -> int:
        return int(self.src_pages.numel())

    @property
    def pages_taken(self) -> int:
        return int(self.n_dst.sum())

    @property
    def tokens_moved(self) -> int:
        return int(self.src_live.sum())

    def is_empty(self) -> bool:
        return self.rows.numel() == 0

    @classmethod
    def empty(cls, epoch: int) -> Plan:
        e = torch.empty(0, dtype=torch.int64)
        return cls(epoch, e, e, e, e, e.to(torch.int32))


def plan_reclaim(snap: Snapshot, max_moves: int | None = None) -> Plan:
    """The plan that frees the most pages within the destination budget (see module docstring).

    Per request, with its eligible pages sorted sparsest first, the gain of taking the first k is
    ``g(k) = k - ceil(T(k) / P)``; since each page holds fewer than P live tokens, g never decreases in k. So the
    best prefix that fits the budget B is the longest with ``T(k) <= B * P``, and the plan takes the shortest
    prefix with the same gain. Both are found on a [rows, P] histogram of (owner, live count), without sorting
    pages: a few vectorized passes over the page arrays plus O(rows * P). Runs in numpy on the host (the
    snapshot is host data; numpy's per-call overhead is a fraction of torch's at these sizes)."""
    P, B = snap.page_size, snap.free_for_relocation
    live = snap.live.cpu().numpy().astype(np.int64)
    owner = snap.owner.cpu().numpy().astype(np.int64)
    eligible = (owner >= 0) & ~snap.blocked.cpu().numpy() & (live > 0) & (live < P)
    if B <= 0:
        return Plan.empty(snap.epoch)
    R = int(owner.max()) + 1
    if R <= 0:
        return Plan.empty(snap.epoch)
    key = np.where(eligible, owner * P + live, R * P)  # ineligible pages go to a discarded bucket
    hist = np.bincount(key, minlength=R * P + 1)[: R * P].reshape(R, P)  # pages per (owner, live count)
    v = np.arange(P)
    k_end = np.cumsum(hist, 1)  # pages taken once bucket v is taken whole
    t_end = np.cumsum(hist * v, 1)  # tokens moved then
    k_before, t_before = k_end - hist, t_end - hist * v
    rr = np.arange(R)
    # longest prefix within the budget: whole buckets while t_end <= B*P, then `partial` pages of the next one
    cap = B * P
    fit_v = (t_end <= cap).sum(1)
    whole = fit_v >= P
    fv = np.minimum(fit_v, P - 1)
    tb, kb, hb = t_before[rr, fv], k_before[rr, fv], hist[rr, fv]
    partial = np.minimum(np.maximum((cap - tb) // np.maximum(fv, 1), 0), hb)
    k_max = np.where(whole, k_end[:, -1], kb + partial)
    t_max = np.where(whole, t_end[:, -1], tb + partial * fv)
    best = k_max - (t_max + P - 1) // P
    # shortest prefix reaching `best`: first bucket whose end reaches it, then j* pages into that bucket
    g_end = k_end - (t_end + P - 1) // P
    cut_v = np.argmax((g_end >= best[:, None]) & (hist > 0), 1)
    t0 = t_before[rr, cut_v]
    need = t0 - P * (k_before[rr, cut_v] - best)
    cut_j = np.maximum(-(-need // (P - cut_v)), 1)  # ceil(need / (P - v)), at least 1
    moves = t0 + cut_j * cut_v
    n_dst = (moves + P - 1) // P
    # admission: positive gain, by descending gain then row id, while destinations (and moves) fit
    cand = np.nonzero(best > 0)[0]
    if cand.size == 0:
        return Plan.empty(snap.epoch)
    cand = cand[np.argsort(-best[cand], kind="stable")]
    fits = np.cumsum(n_dst[cand]) <= B
    if max_moves is not None:
        fits &= np.cumsum(moves[cand]) <= max_moves
    chosen = np.sort(cand[np.cumprod(fits).astype(bool)])
    if chosen.size == 0:
        return Plan.empty(snap.epoch)
    take = np.zeros(R + 1, dtype=bool)
    take[chosen] = True
    # materialize: the owner's pages below the cut bucket, and the first cut_j (by page id) in it
    own = np.where(eligible, owner, R)
    mine = take[own]
    cut = np.append(cut_v, 0)[own]
    sel = mine & (live < cut)
    at_cut = np.nonzero(mine & (live == cut))[0]  # ascending page ids
    if at_cut.size:
        order = at_cut[np.argsort(own[at_cut], kind="stable")]  # page ids stay ascending within an owner
        o = own[order]
        start = np.ones(o.size, dtype=bool)
        start[1:] = o[1:] != o[:-1]
        first = np.nonzero(start)[0]
        rank = np.arange(o.size) - first[np.cumsum(start) - 1]
        sel[order[rank < cut_j[o]]] = True
    pages = np.nonzero(sel)[0]
    t = torch.from_numpy
    return Plan(
        epoch=snap.epoch,
        rows=t(chosen.astype(np.int64)),
        n_dst=t(n_dst[chosen].astype(np.int64)),
        src_pages=t(pages.astype(np.int64)),
        src_row=t(owner[pages]),
        src_live=t(live[pages].astype(np.int32)),
    )


@dataclasses.dataclass(frozen=True)
class Moves:
    """Token-level relocation: entry ``(rows[i], cols[i])`` moves from slot ``src[i]`` to slot ``dst[i]``."""

    rows: torch.Tensor
    cols: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor


def pack_moves(
    slots: torch.Tensor, live_len: torch.Tensor, plan: Plan, dst_pages: torch.Tensor, page_size: int
) -> Moves:
    """Greedy packing in logical order: the live entries of each planned row that lie in its source pages take,
    in row (= logical) order, consecutive slots of its destination pages (``dst_pages``: the rows' destination
    pages concatenated in ``plan.rows`` order). ``slots``/``live_len``: the Token Table's row store."""
    P = page_size
    dev = slots.device
    rows = plan.rows.to(dev)
    width = int(live_len[rows].max())
    block = slots[rows, :width].to(torch.int64)
    valid = torch.arange(width, device=dev)[None, :] < live_len[rows][:, None]
    is_src = torch.zeros(int(block.max()) // P + 2 if block.numel() else 1, dtype=torch.bool, device=dev)
    src_pages = plan.src_pages.to(dev)
    src_pages = src_pages[src_pages < len(is_src)]
    is_src[src_pages] = True
    moving = valid & is_src[block // P]
    idx = torch.cumsum(moving.to(torch.int64), 1) - 1  # position among the row's moving entries
    dst_start = (torch.cumsum(plan.n_dst, 0) - plan.n_dst).to(dev)
    r_i, c = torch.nonzero(moving, as_tuple=True)
    j = idx[r_i, c]
    dst = packed_slots(dst_pages.to(dev), dst_start[r_i], j, P)
    return Moves(rows=rows[r_i], cols=c, src=block[r_i, c], dst=dst)
