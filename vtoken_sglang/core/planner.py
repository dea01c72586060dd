"""Reclaim planning: a pure function from a page-level snapshot to a plan, and the token-level packing of a plan.

Stages (PAPER.md "Reclaim backend"):
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

import torch


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
    """The plan that frees the most pages within the destination budget (see module docstring)."""
    P = snap.page_size
    live, owner = snap.live.cpu(), snap.owner.cpu()
    eligible = (owner >= 0) & ~snap.blocked.cpu() & (live > 0) & (live < P)
    pages = torch.nonzero(eligible).flatten()
    if pages.numel() == 0 or snap.free_for_relocation <= 0:
        return Plan.empty(snap.epoch)
    own, cnt = owner[pages].to(torch.int64), live[pages].to(torch.int64)
    # sort by (owner, live, page id): page ids are already ascending, so two stable sorts suffice
    order = torch.argsort(cnt, stable=True)
    order = order[torch.argsort(own[order], stable=True)]
    pages, own, cnt = pages[order], own[order], cnt[order]
    # per-owner prefix: k (1-based) and cumulative live count within the owner's segment
    seg_start = torch.ones_like(own, dtype=torch.bool)
    seg_start[1:] = own[1:] != own[:-1]
    seg_id = torch.cumsum(seg_start.to(torch.int64), 0) - 1
    first = torch.nonzero(seg_start).flatten()
    k = torch.arange(len(pages)) - first[seg_id] + 1
    cum = torch.cumsum(cnt, 0)
    cum = cum - torch.cat([cum.new_zeros(1), cum])[first][seg_id]
    dst = (cum + P - 1) // P
    gain = torch.where(dst <= snap.free_for_relocation, k - dst, torch.full_like(k, -1))  # prefixes that fit at all
    n_seg = len(first)
    best_gain = torch.full((n_seg,), -1, dtype=torch.int64).scatter_reduce(0, seg_id, gain, "amax")
    # shortest prefix reaching the best gain: smallest k with gain == best
    is_best = gain == best_gain[seg_id]
    big = torch.iinfo(torch.int64).max
    best_k = torch.full((n_seg,), big, dtype=torch.int64).scatter_reduce(0, seg_id, torch.where(is_best, k, big), "amin")
    seg_rows = own[first]
    seg_dst = (cum[first + best_k - 1] + P - 1) // P
    seg_moves = cum[first + best_k - 1]
    # admission: positive gain, by descending gain then row id, while destinations (and moves) fit
    cand = torch.nonzero(best_gain > 0).flatten()
    if cand.numel() == 0:
        return Plan.empty(snap.epoch)
    cand = cand[torch.argsort(seg_rows[cand], stable=True)]
    cand = cand[torch.argsort(-best_gain[cand], stable=True)]
    fits = torch.cumsum(seg_dst[cand], 0) <= snap.free_for_relocation
    if max_moves is not None:
        fits &= torch.cumsum(seg_moves[cand], 0) <= max_moves
    fits = torch.cumprod(fits.to(torch.int64), 0).bool()  # stop at the first that does not fit
    chosen = cand[fits]
    if chosen.numel() == 0:
        return Plan.empty(snap.epoch)
    chosen = chosen[torch.argsort(seg_rows[chosen])]
    take = torch.zeros(n_seg, dtype=torch.bool)
    take[chosen] = True
    in_prefix = take[seg_id] & (k <= best_k[seg_id])
    return Plan(
        epoch=snap.epoch,
        rows=seg_rows[chosen],
        n_dst=seg_dst[chosen],
        src_pages=pages[in_prefix],
        src_row=own[in_prefix],
        src_live=cnt[in_prefix].to(torch.int32),
    )


@dataclasses.dataclass(frozen=True)
class Moves:
    """Token-level relocation: entry ``(rows[i], cols[i])`` moves from slot ``src[i]`` to slot ``dst[i]``."""

    rows: torch.Tensor
    cols: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor


def pack_moves(slots: torch.Tensor, live_len: torch.Tensor, plan: Plan, dst_pages: torch.Tensor, page_size: int) -> Moves:
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
    dst = dst_pages.to(dev)[dst_start[r_i] + j // P] * P + j % P
    return Moves(rows=rows[r_i], cols=c, src=block[r_i, c], dst=dst)
