"""Where reclaim plans come from, and when in the eviction round they are applied (``eviction_round``).

The round calls the same three methods with either planner, in one order: ``begin_round`` (at its start: the
sources of earlier plans whose grace step has come are freed, after a wait on their copy's fence),
``plan_now`` (after the round's evictions and copy-on-write, only in a round that trimmed some request) and
``end_step`` (at its end, always):
- ``InlinePlanning``: plans are made and applied in ``plan_now``, on the state the evictions just left;
- ``WorkerPlanning``: ``end_step`` sends the compaction worker a snapshot of that same state (at its cadence); the
  plan answering it arrives a step or more later and is applied in ``begin_round``, before that step's evictions
  change its source pages (``Reclaimer.validate`` drops it whole if they did anyway).
Every applied plan is folded into the ``plans`` digest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vtoken_sglang.core.planner import Plan
from vtoken_sglang.core.reclaimer import Reclaimer
from vtoken_sglang.integration.worker_link import WorkerLink


class InlinePlanning:
    def __init__(self, reclaimer: Reclaimer, fold: Callable[[str, torch.Tensor, torch.Tensor], None]):
        self.reclaimer = reclaimer
        self.fold = fold

    def begin_round(self) -> None:
        self.reclaimer.release_ready()

    def plan_now(self) -> None:
        self._folded(self.reclaimer.step())

    def end_step(self) -> None:
        pass

    def poll(self) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def _folded(self, plans: list[Plan]) -> None:
        for plan in plans:
            self.fold("plans", plan.src_pages, plan.src_live)


class WorkerPlanning(InlinePlanning):
    def __init__(self, reclaimer: Reclaimer, fold: Callable[[str, torch.Tensor, torch.Tensor], None], link: WorkerLink):
        super().__init__(reclaimer, fold)
        self.link = link

    def begin_round(self) -> None:
        self._folded(self.reclaimer.step(self.link.next_plan))

    def plan_now(self) -> None:
        pass

    def end_step(self) -> None:
        self.link.after_step()

    def poll(self) -> None:
        """At idle: take what the worker sent and check its health (rank 0 only; no collective)."""
        self.link.poll()

    def metrics(self) -> dict:
        return self.link.metrics()

    def close(self) -> None:
        self.link.close()
