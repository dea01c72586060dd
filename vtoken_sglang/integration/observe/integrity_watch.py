"""``IntegrityWatch``: the core's full integrity check (I1-I4 and page accounting against SGLang's allocator) in
the running server, with ``VTOKEN_SGLANG_CHECK_INTEGRITY=1``: after every ``VTOKEN_SGLANG_CHECK_INTEGRITY_EVERY``-th
trimming round (default 8) and whenever the scheduler goes fully idle after work. At idle it also requires that
no request is managed any more but the rows streaming sessions hold between turns (parked), and that vToken tracks
no page but theirs and relocation sources awaiting release. Each check
also compares ``RequestRows``' host mirrors (managed rows, offsets, tail positions) with the device state. A
violation is logged and raised (``IntegrityError``): the scheduler stops, loudly. Off: nothing runs."""

from __future__ import annotations

import logging

import numpy as np
import torch

from vtoken_sglang.core.integrity import IntegrityError, check_integrity
from vtoken_sglang.core.reclaimer import Reclaimer
from vtoken_sglang.debug_switches import SWITCHES
from vtoken_sglang.integration.observe.stats import RuntimeStats
from vtoken_sglang.integration.parts.request_rows import RequestRows

logger = logging.getLogger("vtoken_sglang")


class IntegrityWatch:
    def __init__(
        self,
        reclaimer: Reclaimer,
        rows: RequestRows,
        stats: RuntimeStats,
        enabled: bool = SWITCHES.check_integrity,
        every: int = SWITCHES.check_integrity_every,
    ):
        self.reclaimer = reclaimer
        self.rows = rows
        self.table = reclaimer.table
        self.stats = stats
        self.enabled = enabled
        self.every = max(every, 1)
        self.checked_at_step = 0  # decode_steps at the last idle check

    def after_round(self) -> None:
        if self.enabled and self.stats.rounds % self.every == 0:
            self._check("round")

    def at_idle(self) -> None:
        """The scheduler is fully idle: once per burst of work."""
        if not self.enabled or self.stats.decode_steps == self.checked_at_step:
            return
        self.checked_at_step = self.stats.decode_steps
        self._check("idle")
        pool = self.table.pages
        parked = self.rows.parked_rows()
        managed = np.flatnonzero(self.table.active.cpu().numpy())
        self._require(np.array_equal(managed, parked), "idle", "a request is still managed at idle")
        pending, held = self.reclaimer.pending_pages(), self.rows.owned_pages(parked)
        self._require(
            pool.used_pages() == pending + held,
            "idle",
            f"{pool.used_pages()} pages tracked at idle, {pending} of them awaiting release and {held} held by "
            "streaming sessions (leak)",
        )

    def _check(self, where: str) -> None:
        try:
            check_integrity(self.table)
        except IntegrityError as err:
            self._require(False, where, str(err))
        self._check_mirrors(where)
        self.stats.integrity_checks += 1

    def _check_mirrors(self, where: str) -> None:
        t, rows = self.table, self.rows
        active = t.active.cpu().numpy()
        self._require(bool((active == rows.host_active).all()), where, "the host mirror of managed rows is stale")
        idx = np.flatnonzero(active & (t.live_len.cpu().numpy() > 0))
        if len(idx) == 0:
            return
        r = torch.from_numpy(idx).to(t.slots.device)
        last = (t.slots[r, t.live_len[r] - 1].to(torch.int64) % t.page_size).cpu().numpy()
        offset = (t.logical_len[r] - t.live_len[r]).cpu().numpy()
        self._require(bool((last == rows.host_tail_pos[idx]).all()), where, "a host tail position is stale")
        self._require(bool((offset == rows.host_offset[idx]).all()), where, "a host position offset is stale")
        dense = ~rows.host_compacted[idx]  # released to upstream as dense rows: nothing evicted, nothing moved
        self._require(bool((offset[dense] == 0).all()), where, "a row not marked compacted has evicted tokens")

    def _require(self, ok: bool, where: str, what: str) -> None:
        if not ok:
            logger.error(
                "[vtoken] integrity check failed (%s, decode step %d): %s", where, self.stats.decode_steps, what
            )
            raise IntegrityError(f"vToken integrity check failed ({where}): {what}")
