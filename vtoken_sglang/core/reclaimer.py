"""The reclaim loop an engine calls between forward passes: snapshot -> plan -> validate -> copy -> publish ->
release after the grace period.

``Reclaimer.step()`` once per engine step (the epoch). A plan is applied whole or dropped whole:
- stale: taken more than ``max_plan_lag`` epochs ago (a worker's plan that arrives late);
- rejected: it is malformed (no planner makes it: a worker's plan garbled on the way), it overlaps pages in flight,
  a source no longer looks as planned (owner, live count, tail), a row ended, or its destinations do not fit now
  (I4).
Source pages stay ``in_flight`` (and allocated) until ``grace_steps`` epochs have passed; then the host waits
for the copy engine's fence taken after the copy (by then the forward that followed the copy has finished, so the
wait is short) and frees them: nothing can still read them (I3). When they are freed depends on the epoch only,
never on when a fence happens to report done, so every TP rank frees the same pages at the same step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from vtoken_sglang.core.copy_engine import CopyEngine, Fence, copy_then_publish
from vtoken_sglang.core.pages import PageAccounting
from vtoken_sglang.core.planner import Plan, Snapshot, pack_moves, plan_reclaim
from vtoken_sglang.core.segments import repeat_rows
from vtoken_sglang.core.token_table import TokenTable


@dataclasses.dataclass
class ReclaimStats:
    pages_reclaimed: int = 0
    tokens_moved: int = 0
    plans_admitted: int = 0
    plans_rejected: int = 0
    plans_stale: int = 0
    planner_ms: float = 0.0  # total
    copy_ms: float = 0.0  # total
    planner_calls: int = 0
    release_waits: int = 0  # releases whose fence was not done yet at their step: the host waited for the copy

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # flat numbers: no deep copy


@dataclasses.dataclass
class _Pending:
    release_epoch: int
    fence: Fence
    pages: torch.Tensor


class Reclaimer:
    def __init__(
        self,
        table: TokenTable,
        engine: CopyEngine,
        theta: float = 0.05,
        low_watermark: int = 0,
        grace_steps: int = 1,
        max_plan_lag: int = 0,
        enabled: bool = True,
        keep_free: int = 0,
        max_rounds: int = 1,
    ):
        """``keep_free``: free pages relocation leaves to the engine's next allocations (beyond the pool's reserve,
        which relocation may always use): the bounded evacuation headroom. ``max_rounds``: plans per step; rounds
        after the first happen only when sources come back at once (``grace_steps == 0``, a synchronous engine),
        so the reserve refills between rounds."""
        self.table = table
        self.pool: PageAccounting = table.pages
        self.engine = engine
        self.theta = theta
        self.low_watermark = low_watermark
        self.grace_steps = grace_steps
        self.max_plan_lag = max_plan_lag
        self.enabled = enabled
        self.keep_free = keep_free
        self.max_rounds = max_rounds
        self.epoch = 0
        self.stats = ReclaimStats()
        self.planner_ms_samples: list[float] = []
        self._pending: list[_Pending] = []

    # ------------------------------------------------------------------ planning

    def needs_reclaim(self) -> bool:
        """The trigger: fragmentation above theta, or free pages at or below the low watermark."""
        self.table.settle()
        if not self.enabled:
            return False
        return self.pool.fragmentation() > self.theta or self.pool.num_free() <= self.low_watermark

    def snapshot(self, copy: bool = True) -> Snapshot:
        """The planner's input. ``copy=False`` shares the pool's live/owner tensors (an inline plan made and
        applied before anything changes); a snapshot sent elsewhere must be a copy."""
        self.table.settle()
        blocked = self.pool.in_flight.clone()
        blocked[self.table.tail_pages()] = True
        free = self.pool.num_free(for_relocation=True)
        budget = max(min(free, self.pool.reserve), free - self.keep_free)
        live, owner = (self.pool.live.clone(), self.pool.owner.clone()) if copy else (self.pool.live, self.pool.owner)
        return Snapshot(self.epoch, self.pool.page_size, live, owner, blocked, budget)

    def plan(self) -> Plan:
        t0 = time.perf_counter()
        plan = plan_reclaim(self.snapshot(copy=False))
        ms = (time.perf_counter() - t0) * 1e3
        self.stats.planner_ms += ms
        self.stats.planner_calls += 1
        self.planner_ms_samples.append(ms)
        return plan

    # ------------------------------------------------------------------ applying

    def validate(self, plan: Plan) -> str | None:
        """Why ``plan`` cannot be applied now (``"stale"`` or another reason), or None if it can."""
        self.table.settle()
        if self.epoch - plan.epoch > self.max_plan_lag or plan.epoch > self.epoch:
            return "stale"
        malformed = self._malformed(plan)
        if malformed is not None:
            return malformed
        pool, src = self.pool, plan.src_pages
        if bool(pool.in_flight[src].any()):
            return "overlaps a relocation in flight"
        if not bool((pool.owner[src] == plan.src_row.to(torch.int32)).all()):
            return "a source page changed owner"
        if not bool((pool.live[src] == plan.src_live).all()):
            return "a source page's live count changed"
        if not bool(self.table.active[plan.rows].all()):
            return "a planned request ended"
        tails = self.table.tail_pages()
        if bool(torch.isin(src, tails).any()):
            return "a source page became a tail page"
        if plan.pages_taken >= plan.pages_freed:
            return "does not free more pages than it takes"
        if plan.pages_taken > pool.num_free(for_relocation=True):
            return "not enough free pages for the destinations"
        return None

    def _malformed(self, plan: Plan) -> str | None:
        """What makes ``plan`` one that no planner makes, or None. Checked before anything is indexed by it: a
        duplicate row or source page, a source of a row the plan does not name, a row given more destination
        pages than the plan has source pages (no plan takes more than it frees; huge counts would overflow the
        checks below), or fewer destination slots than a row's live tokens in its sources would make
        ``pack_moves`` write past a row's destinations, or free a page whose live tokens were not moved. (Index
        bounds are the receiver's check: the worker client's.)"""
        if not Plan.lengths_agree(plan.lengths()):
            return "malformed: array lengths differ"
        src_row, P = plan.src_row, self.pool.page_size
        k, m = plan.rows.numel(), plan.src_pages.numel()
        rows, order = torch.sort(plan.rows)
        if k and (int(plan.n_dst.min()) < 0 or bool((rows[1:] == rows[:-1]).any())):
            return "malformed: a negative destination count, or a row twice"
        if k and int(plan.n_dst.max()) > m:
            return "malformed: more destination pages than the plan's source pages"
        if m and torch.unique(plan.src_pages).numel() != m:
            return "malformed: a source page twice"
        at = torch.searchsorted(rows, src_row).clamp_(max=max(k - 1, 0))
        if m and (k == 0 or not bool((rows[at] == src_row).all())):
            return "malformed: a source page of a row the plan does not name"
        moving = torch.zeros(k, dtype=torch.int64, device=rows.device).index_add_(
            0, order[at], plan.src_live.to(torch.int64)
        )
        if bool((moving > plan.n_dst * P).any()):
            return "malformed: fewer destination slots than tokens to move"
        return None

    def apply(self, plan: Plan) -> bool:
        """Validate, then relocate and publish the whole plan. Returns whether it was applied."""
        reason = self.validate(plan)
        if reason is not None:
            if reason == "stale":
                self.stats.plans_stale += 1
            else:
                self.stats.plans_rejected += 1
            return False
        self._relocate(plan)
        return True

    def _relocate(self, plan: Plan) -> None:
        """Copy and publish ``plan``, valid now (``validate``): made from this very state, or checked."""
        pool = self.pool
        dst_pages = pool.alloc(
            plan.pages_taken, repeat_rows(plan.rows, plan.n_dst, plan.pages_taken), for_relocation=True
        )
        pool.in_flight[plan.src_pages] = True
        pool.in_flight[dst_pages] = True
        moves = pack_moves(self.table.slots, self.table.live_len, plan, dst_pages, pool.page_size)
        assert moves.src.numel() == plan.tokens_moved, "plan and table disagree"
        ticket = copy_then_publish(self.engine, self.table, moves)
        pool.in_flight[dst_pages] = False  # the sources stay in flight until their fence (release_ready)
        self._pending.append(_Pending(self.epoch + self.grace_steps, self.engine.fence(), plan.src_pages))
        st = self.stats
        st.plans_admitted += 1
        st.tokens_moved += plan.tokens_moved
        st.copy_ms += ticket.seconds * 1e3

    def release_ready(self, force: bool = False) -> int:
        """Free the source pages whose grace period is over (all of them with ``force``: at idle, or under memory
        pressure), each after a blocking wait on its copy's fence. Returns the number of pages freed."""
        keep, freed = [], 0
        for p in self._pending:
            if force or p.release_epoch <= self.epoch:
                if not p.fence.done():
                    self.stats.release_waits += 1
                    p.fence.wait()
                self.pool.in_flight[p.pages] = False
                self.pool.free(p.pages)
                freed += int(p.pages.numel())
            else:
                keep.append(p)
        self._pending = keep
        self.stats.pages_reclaimed += freed
        return freed

    def pending_pages(self) -> int:
        return sum(int(p.pages.numel()) for p in self._pending)

    # ------------------------------------------------------------------ the loop

    def step(self, external: Callable[[], Plan | None] | None = None) -> list[Plan]:
        """One engine step: release what is due, plan and apply while triggered (up to ``max_rounds``), advance
        the epoch. Returns the plans applied. ``external``: plans come from elsewhere (a compaction worker); it is
        called once, and the plan it returns, if any, is validated and applied or dropped like an inline one."""
        self.release_ready()
        if external is None:
            applied = self._plan_and_apply(self.max_rounds if self.grace_steps == 0 else 1, force=False)
        else:
            plan = external()
            applied = [plan] if plan is not None and not plan.is_empty() and self.apply(plan) else []
            if applied:
                self.release_ready()
        self.epoch += 1
        return applied

    def reclaim_now(self, rounds: int = 8) -> int:
        """Memory is short: plan and apply regardless of theta, up to ``rounds`` plans, within the current epoch,
        waiting for each plan's copy to free its sources at once. Sources of earlier plans still in their grace
        period are freed first (a blocking wait on their fences), so their pages count too. Returns the pages
        freed."""
        if not self.enabled:
            return 0
        before = self.stats.pages_reclaimed
        self.release_ready(force=True)
        self._plan_and_apply(rounds, force=True)
        return self.stats.pages_reclaimed - before

    def _plan_and_apply(self, rounds: int, force: bool) -> list[Plan]:
        """The reclaim loop: while triggered (or ``force``d), plan, apply, and release what is due (``force``d:
        everything, waiting for the copies), until a plan is empty or refused, or ``rounds`` plans are applied."""
        applied: list[Plan] = []
        while len(applied) < rounds and (force or self.needs_reclaim()):
            plan = self.plan()  # from the state as it is: valid as made (the property tests check it is)
            if plan.is_empty():
                break
            self._relocate(plan)
            applied.append(plan)
            self.release_ready(force)  # grace_steps=0 or forced: the sources come back at once
        return applied
