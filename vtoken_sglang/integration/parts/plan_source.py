"""Where reclaim plans come from, and when the round applies them (``VTokenRuntime.after_decode``).

The round calls the same three methods with either source, in one order: ``begin_round`` (first: the sources of
earlier plans whose grace step has come are freed, after a wait on their copy's fence), ``plan_now`` (after the
round's evictions and copy-on-write, only in a round that trimmed some request) and ``end_step`` (last, always).
Every plan applied is folded into the ``plans`` digest.

- ``InlinePlans`` (``--vtoken-planner inline``): plans are made and applied in ``plan_now``, on the state the
  evictions just left.
- ``WorkerPlans`` (``--vtoken-planner worker``): plans come from a compaction worker process (``worker.client``).
  One worker per server, started by TP rank 0's scheduler; every rank applies the plans rank 0 broadcasts over the
  TP group's CPU group. Why one, not one per rank: ranks must keep identical page accounting (SGLang's schedulers
  decide admission and retraction independently, from the same state), and replies from per-rank workers arrive at
  different steps. The broadcast happens only in steps where reclaim is wanted, which every rank agrees on (same
  state, same trigger), so all ranks enter it together. Per step:
  1. ``begin_round`` (``Reclaimer.step(external=next_plan)``): rank 0 takes the newest plan the worker sent
     (non-blocking). With one rank, a plan that arrived is validated and applied or dropped at once, before this
     step's evictions change its source pages (``Reclaimer.validate`` drops it whole if they did anyway). With TP,
     in every step where reclaim is wanted, the plan (or nothing) is broadcast and every rank validates and applies
     it, or drops it, the same way (only rank 0 knows when a plan arrived; broadcasting only every ``every``-th step
     would find a plan's sources changed by the evictions since).
  2. ``end_step``: once ``interval`` steps have passed since the last snapshot, if the worker is idle and reclaim
     is still wanted, rank 0 sends it a snapshot of the state after this step's changes. The cadence bounds the
     scheduler's share of the work (trigger, snapshot, encoding) to an eighth of it per step with ``every`` 8, the
     default; plans stay valid across it (the reclaimer accepts plans up to ``2 * every`` epochs old, and checks
     their sources anyway). ``interval`` is ``every``, doubled after each empty plan up to ``every * MAX_BACKOFF``
     and back to ``every`` after a plan that moves something or while free pages are at the low watermark:
     fragmentation above theta that no plan can reduce (thinly spread live tokens, tail pages, no room for
     destinations) would otherwise cost a snapshot every ``every`` steps for nothing.
  If the worker is down, rank 0 broadcasts nothing: reclaim pauses (pressure still reclaims inline before
  retracting), serving goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from vtoken_sglang.core.planner import Plan
from vtoken_sglang.core.reclaimer import Reclaimer
from vtoken_sglang.worker import protocol
from vtoken_sglang.worker.client import WorkerClient

Fold = Callable[[str, torch.Tensor, torch.Tensor], None]  # RuntimeStats.fold: a digest's name, keys, values


class InlinePlans:
    """Plans made and applied in the round, by the scheduler (the inline planner)."""

    def __init__(self, reclaimer: Reclaimer, fold: Fold):
        self.reclaimer = reclaimer
        self.fold = fold

    def begin_round(self) -> None:
        self.reclaimer.release_ready()

    def plan_now(self) -> None:
        self._folded(self.reclaimer.step())

    def end_step(self) -> None:
        pass

    def poll(self) -> None:
        """At idle: nothing to take (a worker's plans only)."""

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def _folded(self, plans: list[Plan]) -> None:
        for plan in plans:
            self.fold("plans", plan.src_pages, plan.src_live)


MAX_BACKOFF = 8  # the longest snapshot interval, in units of ``every``
SNAPSHOT_EVERY = 8  # the base snapshot cadence, in decode steps


class WorkerPlans(InlinePlans):
    """Plans from the compaction worker (rank 0's ``WorkerClient``), broadcast to every TP rank."""

    def __init__(
        self,
        reclaimer: Reclaimer,
        fold: Fold,
        num_rows: int,
        tp_rank: int = 0,
        broadcast: Callable[[object], object] | None = None,
        every: int = SNAPSHOT_EVERY,
        **client_kwargs,
    ):
        super().__init__(reclaimer, fold)
        self.every = every
        self.steps = 0  # decode steps seen; the same count on every rank
        self.interval = every  # rank 0: steps between snapshots (grows while the worker's plans come back empty)
        self.last_submit = 0  # rank 0: the step of the last snapshot sent
        self.restarts_seen = 0  # rank 0: worker restarts as of the last poll
        self.broadcast = broadcast  # TP size > 1: rank 0's object -> every rank's copy
        self.client = WorkerClient(reclaimer.pool.num_pages, num_rows, **client_kwargs) if tp_rank == 0 else None
        self.held: Plan | None = None
        self.device = reclaimer.pool.device
        self.loop_ms = 0.0  # scheduler time spent in next_plan and end_step (polling, broadcast, snapshot, send)
        self.loop_cpu_ms = 0.0  # the same spans in this thread's CPU time: without the waits for a shared core

    def begin_round(self) -> None:
        self._folded(self.reclaimer.step(self.next_plan))

    def plan_now(self) -> None:
        pass  # the worker plans; its plans are applied at the start of a round

    def poll(self) -> None:
        """Rank 0: take what the worker sent, and run the client's health check (restarts progress even while
        the scheduler is idle). No collective: safe to call from one rank alone (also at idle)."""
        if self.client is not None:
            newest = self.client.poll(self.device)
            if self.client.stats.worker_restarts != self.restarts_seen:  # a new worker: the base cadence again
                self.restarts_seen, self.interval = self.client.stats.worker_restarts, self.every
            if newest is not None:
                self.held = newest
                self.interval = min(2 * self.interval, MAX_BACKOFF * self.every) if newest.is_empty() else self.every

    def next_plan(self) -> Plan | None:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.steps += 1
        try:
            self.poll()
            if self.broadcast is None:  # one rank: whatever arrived is validated by the reclaimer now
                plan, self.held = self.held, None
                return plan
            if not self.reclaimer.needs_reclaim():  # every step: a plan waiting for a cadence step goes stale
                return None
            plan, self.held = self.held, None
            frames = self.broadcast(protocol.encode_plan(plan) if plan is not None else None)
            if frames is not None and self.client is None:
                _, header, arrays = protocol.decode(frames)
                plan = protocol.to_plan(header, arrays, self.device)
            return plan
        finally:
            self.loop_ms += (time.perf_counter() - t0) * 1e3
            self.loop_cpu_ms += (time.thread_time() - c0) * 1e3

    def end_step(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        since, rc = self.steps - self.last_submit, self.reclaimer
        if self.client is not None and since >= self.every and self.client.can_submit():
            # past the backed-off interval, or at the low watermark (the base cadence)
            if (since >= self.interval or rc.pool.num_free() <= rc.low_watermark) and rc.needs_reclaim():
                # the pool's own tensors, not copies: the message is built and sent (copied) at once
                if self.client.submit(rc.snapshot(copy=False)):
                    self.last_submit = self.steps
        self.loop_ms += (time.perf_counter() - t0) * 1e3
        self.loop_cpu_ms += (time.thread_time() - c0) * 1e3

    def metrics(self) -> dict:
        times = {"worker_link_ms": round(self.loop_ms, 3), "worker_link_cpu_ms": round(self.loop_cpu_ms, 3)}
        if self.client is None:
            return times
        st = self.client.stats
        return {
            **times,
            "worker_interval": self.interval,
            "worker_up": st.worker_up,
            "worker_restarts": st.worker_restarts,
            "worker_pid": self.client.proc.pid if self.client.proc else 0,
            "worker_snapshots_sent": st.snapshots_sent,
            "worker_plans_received": st.plans_received,
            "worker_messages_ignored": st.messages_ignored,
        }

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
