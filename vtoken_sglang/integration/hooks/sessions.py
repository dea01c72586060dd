"""Hooks on SGLang's streaming sessions (``--enable-streaming-session``): a session's KV record is one row that
its turns borrow in turn (``session.streaming_session.StreamingSession``). Under vToken, once the row is managed it
stays managed across turns: between turns it is *parked* (``RequestRows.park``), compacted, with its tokens'
logical positions and policy state; the next turn extends it from its logical length (its prefix length to
SGLang; ``hooks.allocation.extend_over_live_rows`` gives the batch the live one), so a conversation holds its
budget, not its history, and each turn prefills only its own tokens. Rows that are not managed take upstream's
path throughout.

At the door a turn is bounded by the model's context, not by the pool (``refuse_turn_over_pool``): what it holds is
its session's live record, its new tokens and, at its end, what its budget keeps.

A turn that is aborted hands the record back to its request, which is released like any request (upstream's
rule: the session's next turn prefills its last finished history again, from the tree prefix it matches). Closing a
session (or its timeout) releases exactly the row's pages."""

from __future__ import annotations

import numpy as np

from vtoken_sglang.integration.process import SchedulerProcess


def lend_parked_row(vt: SchedulerProcess, original, session, params):
    """AROUND ``StreamingSession.try_match_prefix``: a turn borrowing a parked (managed) row matches the session's
    logical length ``L0`` (``RequestRows.unpark``; KV past the turn's key dropped first), not the record's live
    length: upstream is given a record that reads ``L0`` held, so its prefix is ``L0`` and its tail free frees
    nothing, and the record is written back live after it. The turn's ``Req`` is logical (``prefix_len`` = ``L0``)
    and its row live, as a prompt between prefill chunks."""
    rt = vt.runtime
    req = params.req
    kv = lent_record(session, req) if rt is not None and rt.rows.n_managed else None
    if kv is None or not rt.rows.is_managed(kv.req_pool_idx):
        return original(session, params)
    logical = rt.rows.unpark(_Record(kv), len(params.key))
    live = kv.kv_committed_len
    kv.kv_committed_len = kv.kv_allocated_len = logical
    try:
        result = original(session, params)
    finally:
        kv.kv_committed_len = kv.kv_allocated_len = live
    return result


def release_parked_row(vt: SchedulerProcess, original, session, session_id: str):
    """AROUND ``StreamingSession.release_session`` (close, timeout): a managed row's pages are released by vToken
    (``RequestRows.release``: upstream's segment free assumes a dense row); upstream then unlocks the session's tree
    prefix and frees what the record leaves it."""
    rt = vt.runtime
    slot = session.slots.get(session_id)
    if rt is not None and slot is not None and slot.kv.holds_kv:
        row = slot.kv.req_pool_idx
        rt.rows.forget(row)
        if rt.cow is not None:
            rt.cow.forget(row)
        if rt.rows.is_managed(row):
            rt.rows.release(_Record(slot.kv))
    return original(session, session_id)


def count_parked_pages(vt: SchedulerProcess, original, observer):
    """AROUND ``SchedulerPoolStatsObserver.session_held_tokens``: upstream counts a session's record as a dense row
    (its allocated length in whole pages, less its tree prefix); a parked row holds the pages it owns."""
    rt = vt.runtime
    if rt is None or rt.rows.n_managed == 0:
        return original(observer)
    records = [kv for kv in observer.tree_cache.session_records().values() if kv.holds_kv]
    managed = [kv for kv in records if rt.rows.is_managed(kv.req_pool_idx)]
    if not managed:
        return original(observer)
    from sglang.srt.managers.scheduler_components.pool_stats_observer import kv_private_tokens

    P = observer.tree_cache.page_size
    dense = sum(kv_private_tokens(kv, P) for kv in records if not rt.rows.is_managed(kv.req_pool_idx))
    rows = np.fromiter((kv.req_pool_idx for kv in managed), dtype=np.int64, count=len(managed))
    return dense + rt.rows.owned_pages(rows) * P


def drop_parked_on_flush(vt: SchedulerProcess, original, scheduler, *args, **kwargs):
    """AROUND ``Scheduler.flush_cache``: a flush (only when fully idle) drops every session and clears SGLang's
    pools; vToken stops tracking the parked rows first (their pages are cleared with the allocator)."""
    rt = vt.runtime
    if rt is None or rt.rows.n_managed == 0 or not scheduler.is_fully_idle(ignore_waiting=scheduler._engine_paused):
        return original(scheduler, *args, **kwargs)
    rt.release_before_idle()
    rt.rows.drop_parked()
    return original(scheduler, *args, **kwargs)


class _Record:
    """A session's KV record seen as a request (``RequestRows`` reads only ``req.kv``)."""

    __slots__ = ("kv",)

    def __init__(self, kv):
        self.kv = kv


def lent_record(sessions, req):
    """The KV record SGLang's ``StreamingSession`` records ``sessions`` will lend ``req`` (a turn after its
    session's first, not aborted), or None (also with sessions off: ``sessions`` None)."""
    if sessions is None or not sessions.will_lend_record(req):
        return None
    return sessions.slots[req.session.session_id].kv


def bound_turn_at_door(vt: SchedulerProcess, original, scheduler, req, *args, **kwargs):
    """AROUND ``Scheduler.init_req_max_new_tokens``: a streaming turn's new tokens are bounded by the context
    (upstream's clip) and not by what an empty pool holds after the whole conversation
    (``hooks.admission.keep_new_tokens_by_budget`` reads ``vt.turn_at_door``): the door checks what it holds."""
    vt.turn_at_door = lent_record(vt.sessions, req) if vt.runtime is not None else None
    try:
        return original(scheduler, req, *args, **kwargs)
    finally:
        vt.turn_at_door = None


def refuse_turn_over_pool(rt, req, kv) -> str | None:
    """A streaming turn of ``len(req.origin_input_ids)`` tokens (the conversation) on its session's record ``kv``:
    served when what it holds at its peak, its record's live tokens and its new ones, or at its end, what its budget
    keeps (the whole conversation without a capped budget), and a page, fits the pool; else one error line."""
    n = len(req.origin_input_ids)
    live = kv.kv_committed_len
    row = kv.req_pool_idx
    logical = int(rt.table.logical_len[row]) if rt.rows.is_managed(row) else live
    final = n + max(req.sampling_params.max_new_tokens or 0, 0)
    need = max(live + n - logical, rt.admission.kept_at_end_of(final)) + rt.page_size
    pool = rt.pool.num_pages * rt.page_size
    if need <= pool:
        return None
    return (
        f"Session {req.session.session_id}: this turn takes the conversation to {n} tokens and would hold {need} "
        f"tokens of KV (the session's {live}, the turn's {n - logical}, or what its budget keeps at its end, and a "
        f"page), more than the KV pool's {pool}: lower --vtoken-budget or raise --max-total-tokens; the session "
        "keeps its last finished turn."
    )
