"""The eviction round: what vToken does after each decode step, in one fixed order.

It runs at the start of ``Scheduler.get_next_batch_to_run`` (after forward N, before step N+1 is admitted and
prepared; the same point with and without SGLang's overlap scheduler), over the batch that just decoded:

1. ``planning.begin_round``: relocation sources whose grace step has come are freed (after a wait on their copy's
   fence); a compaction worker's plan that arrived is applied;
2. scores: a scored step's attention goes into the policy's state (score policies);
3. trim: requests over budget + slack become managed if they were not, and their victims are evicted (marked
   dead in the Token Table; pages left without a live token are freed at once: that alone is Naive-Evict);
4. copy-on-write of tree-prefix pages: in a round that made some request managed (its first eviction, of its
   prompt's tokens: on a long-prompt, short-answer load the only round it may have), every ``COW_EVERY`` trimming
   rounds, and at the next one after a check that left a copy for lack of free pages;
5. ``planning.plan_now``: the inline planner plans and applies relocations (copy, then the rows are rewritten
   behind the copy engine's order; the sources are freed at the next round's step 1);
6. the batch's and requests' lengths are written from the Token Table, the peaks sampled, the integrity check run
   every N-th round (``VTOKEN_SGLANG_CHECK_INTEGRITY``);
7. ``planning.end_step``: a snapshot for the worker, at its cadence; the step's page accounting (free pages,
   pending pages, plans applied) is folded into ``digest_accounting``, compared across TP ranks.
Steps 4-6 run only in a round that trimmed some request, and step 6 writes only the trimmed requests' lengths
(the others' are unchanged: a decode step adds one token to both their live and logical lengths). Requests whose
queued result ends them by length (the overlap scheduler's, ``ending``) are left alone: the results would have
finished them.
"""

from __future__ import annotations

from collections.abc import Callable, Set

import numpy as np
import torch

from vtoken_sglang.integration import host_reads, victim_log
from vtoken_sglang.integration.host_reads import host_array

_NONE = np.empty(0, dtype=np.int64)
COW_EVERY = 4  # trimming rounds between copy-on-write checks (each walks the tree paths of the managed requests)


def run_round(rt, batch, lock_holders: list = (), ending: Callable[[], Set[int]] = frozenset) -> None:
    """The round over ``batch`` (``rt``: the ``VTokenRuntime``). ``lock_holders``: requests outside the batch that
    may hold a radix-tree lock (the one being chunked). ``ending()``: ids of requests whose pending result ends
    them (asked only in a round where some request may be over budget)."""
    if host_reads.ENABLED:
        host_reads.HOST_READS.end_step(_activity(rt))
    rt.stats.decode_steps += 1
    if rt.policy is None:
        return
    rt.planning.begin_round()
    try:
        managed = rt.rows.requests_managed
        trimmed = _trim(rt, batch, ending)
        if trimmed.size:
            first_eviction = rt.rows.requests_managed != managed
            if rt.cow is not None and (first_eviction or rt.stats.rounds % COW_EVERY == 0 or rt.cow.retry):
                # requests ending now are no candidates, but lock their paths until their results land
                gone = ending()
                staying = [r for r in batch.reqs if id(r) not in gone]
                going = [r for r in batch.reqs if id(r) in gone]
                rt.cow.step(staying, [*lock_holders, *going])
            rt.planning.plan_now()
            rt.rows.write_lengths(batch, trimmed)
            rt.stats.rounds += 1
            rt.sample_pages()
            rt.integrity.after_round()
    finally:
        rt.planning.end_step()
        rt.stats.fold_step(
            rt.allocator.available_size() // rt.page_size,
            rt.reclaimer.pending_pages(),
            rt.reclaimer.stats.plans_admitted,
        )


def _trim(rt, batch, ending: Callable[[], Set[int]]) -> np.ndarray:
    """Steps 2-3, vectorized over the batch. Returns the batch positions of the requests trimmed (over budget +
    slack). Which are is decided on the host (SGLang's host lengths, the rows' host offsets and due lengths), and
    only those are looked at one by one: a round that trims nothing reads nothing from the device and loops over no
    request; in most rounds no row of the batch is due and nothing is even looked at (``RequestRows.skip_check``)."""
    if rt.scores is not None and rt.scores.scorer.active:  # a step to score
        gone = ending()
        running = np.fromiter(
            (not r.finished() and id(r) not in gone for r in batch.reqs), dtype=bool, count=len(batch.reqs)
        )
        rt.scores.observe_decode(batch, batch.req_pool_indices.to(torch.int64), batch.seq_lens.to(torch.int64), running)
    if rt.rows.skip_check():
        return _NONE
    host_rows = host_array(batch.req_pool_indices_cpu)
    at = rt.rows.over_budget(host_rows, host_array(batch.seq_lens_cpu).astype(np.int64), rt.policy)
    if at.size:  # requests that ended (or end with the pending result) are left alone
        gone = ending()
        at = at[[not batch.reqs[i].finished() and id(batch.reqs[i]) not in gone for i in at.tolist()]]
    if not at.size:
        return at
    over = [batch.reqs[i] for i in at.tolist()]
    new = [r for r in over if not rt.rows.is_managed(r.kv.req_pool_idx)]
    if new:
        rt.rows.manage(new)
    first = [r for r in over if not rt.rows.host_compacted[r.kv.req_pool_idx]]
    if first:
        rt.rows.mark_compacted(first)
    table = rt.table
    rows = torch.from_numpy(host_rows[at]).to(table.slots.device)
    vr, vc = rt.policy.select_victims(table, rows)
    if vr.numel():
        logical = table.logical_at(vr, vc)
        rt.stats.fold("victims", table.row_key[vr], logical)
        if victim_log.PATH:
            victim_log.record(over, rows, table.logical_len[rows], vr, logical)
        rt.pool.free(table.evict(vr, vc))
        rt.stats.tokens_evicted += int(vr.numel())
    return at


def _activity(rt) -> tuple:
    """Counters that every kind of work between two rounds advances (``host_reads``: quiet vs busy steps)."""
    r = rt.reclaimer.stats
    sent = rt.planning.metrics().get("worker_snapshots_sent", 0)
    return (
        rt.stats.rounds,
        rt.stats.reclaim_on_pressure,
        r.plans_admitted,
        r.plans_rejected,
        r.plans_stale,
        r.pages_reclaimed,
        sent,
        rt.rows.requests_managed,
        rt.rows.n_managed,
    )
