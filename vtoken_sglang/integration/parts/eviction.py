"""``Eviction``: step 3 of the round after a decode step (``runtime``): the requests over budget + slack give up
their victims.

Which requests are due is decided on the host (SGLang's host lengths, the rows' host offsets and due lengths), and
only those are looked at one by one: a round that evicts nothing reads nothing from the device and loops over no
request; in most rounds no row of the batch is due and nothing is even looked at (``RequestRows.skip_check``).
A due request becomes managed if it was not, is marked compacted at its first eviction (no longer insertable in
the radix tree), and its victims are dropped from its row in the Token Table; the pages left without a live token
are freed at once (that alone is Naive-Evict). Requests that ended, or end with the overlap scheduler's pending
result, are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Set

import numpy as np
import torch

from vtoken_sglang.core.row_layout import RowLayout
from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.debug_switches import SWITCHES
from vtoken_sglang.integration.observe import victim_log
from vtoken_sglang.integration.observe.stats import RuntimeStats
from vtoken_sglang.integration.parts.page_bridge import SglangPagePool
from vtoken_sglang.integration.parts.request_rows import RequestRows
from vtoken_sglang.policies import Policy

NONE_DUE = np.empty(0, dtype=np.int64)


class Eviction:
    def __init__(
        self,
        table: TokenTable,
        rows: RequestRows,
        pool: SglangPagePool,
        policy: Policy,
        stats: RuntimeStats,
        newest: int | None = None,
    ):
        """``newest``: the newest logical positions every round keeps (default: the policy's ``recent``). With
        streaming sessions on a model with sliding layers, at least the widest window: a session's next turn
        extends its row, and an extend's window on a sliding layer is taken by column, so the row's newest window
        must be dense (as between prefill chunks)."""
        self.table = table
        self.rows = rows
        self.pool = pool
        self.policy = policy
        self.stats = stats
        self.newest = newest

    def run(self, batch, layout: RowLayout | None, ending: Callable[[], Set[int]]) -> np.ndarray:
        """Evict from the requests of ``batch`` (its rows: ``layout``; None in a round that skips the check,
        ``RequestRows.skip_check``) over budget + slack; ``ending()``: ids of the requests the pending result ends.
        Returns the batch positions of the requests evicted from (int64, possibly empty)."""
        rows = self.rows
        if layout is None:
            return NONE_DUE
        host_rows = layout.host_rows
        at = rows.over_budget(layout, self.policy)
        if at.size:
            gone = ending()
            at = at[[not batch.reqs[i].finished() and id(batch.reqs[i]) not in gone for i in at.tolist()]]
        if not at.size:
            return at
        over = [batch.reqs[i] for i in at.tolist()]
        new = [r for r in over if not rows.is_managed(r.kv.req_pool_idx)]
        if new:
            rows.manage(new)
        first = [r for r in over if not rows.host_compacted[r.kv.req_pool_idx]]
        if first:
            rows.mark_compacted(first)
        table = self.table
        due = torch.from_numpy(host_rows[at]).to(table.slots.device)
        vr, vc = self.policy.select_victims(table, due, newest=self.newest)
        if vr.numel():
            logical = table.logical_at(vr, vc)
            self.stats.fold("victims", table.row_key[vr], logical)
            if SWITCHES.victim_log:
                victim_log.record(over, due, table.logical_len[due], vr, logical)
            self.pool.free(table.evict(vr, vc))
            self.stats.tokens_evicted += int(vr.numel())
        return at
