"""Hooks on SGLang's decode allocation and release: a managed row is compacted, so its next slot follows the
tail-page rule (``core.pages.tail_room``), not ``seq_len % page_size``, and its pages are released by vToken
(SGLang's segment free assumes dense rows). Every hook takes upstream's path while no row is managed."""

from __future__ import annotations

import numpy as np
import torch

from vtoken_sglang.core.pages import tail_room
from vtoken_sglang.debug_switches import SWITCHES
from vtoken_sglang.integration.observe import victim_log
from vtoken_sglang.integration.observe.host_reads import host_array
from vtoken_sglang.integration.process import SchedulerProcess


def _needs_page(last_slot: torch.Tensor, page_size: int) -> torch.Tensor:
    return tail_room(last_slot.to(torch.int64), page_size) == 0


def alloc_decode_slots(vt: SchedulerProcess, original, allocator, seq_lens, seq_lens_cpu, last_loc, *args, **kwargs):
    """AROUND ``PagedTokenToKVPoolAllocator.alloc_decode``: one slot per request by the tail-page rule. Same
    contract as upstream: None when out of pages. Inside ``prepare_for_decode`` the rule is taken on the host
    mirrors of the batch's rows (its layout, ``RequestRows.preparing``; ``RequestRows.needs_page``: no device read),
    elsewhere on ``last_loc``."""
    rt = vt.runtime
    if args or kwargs or rt is None or rt.rows.n_managed == 0:  # every row dense: upstream's rule holds
        return original(allocator, seq_lens, seq_lens_cpu, last_loc, *args, **kwargs)
    P = allocator.page_size
    out = (last_loc + 1).to(torch.int64)
    preparing = rt.rows.preparing
    if preparing is not None and len(preparing.host_rows) == len(seq_lens_cpu):
        at = np.flatnonzero(rt.rows.needs_page(preparing.host_rows, host_array(seq_lens_cpu) - 1))
        if len(at) == 0:
            return out
        slots = allocator.alloc(len(at) * P)
        if slots is None:
            return None
        out[torch.from_numpy(at).to(out.device)] = slots[::P].to(out.dtype)
        return out
    need = _needs_page(last_loc, P)
    n_new = int(need.sum())
    if n_new:
        slots = allocator.alloc(n_new * P)
        if slots is None:
            return None
        out[need] = slots[::P].to(out.dtype)
    return out


def count_decode_pages(vt: SchedulerProcess, original, batch, selected_indices=None):
    """AROUND ``ScheduleBatch.new_tokens_required_next_decode``: count new pages by the tail-page rule (on the host
    mirrors)."""
    rt = vt.runtime
    if not batch.spec_algorithm.is_none() or rt is None or rt.rows.n_managed == 0:
        return original(batch, selected_indices)
    reqs = batch.reqs if selected_indices is None else [batch.reqs[i] for i in selected_indices]
    if not reqs:
        return 0
    from sglang.srt.managers import schedule_batch

    rows = np.fromiter((r.kv.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
    lens = np.fromiter((r.kv.kv_committed_len for r in reqs), dtype=np.int64, count=len(reqs))
    P = batch.token_to_kv_pool_allocator.page_size
    return int(rt.rows.needs_page(rows, lens).sum()) * P + schedule_batch.num_beam_member_rows(reqs)


def release_request(vt: SchedulerProcess, original, req, tree_cache, *args, **kwargs):
    """AROUND ``mem_cache.common.release_kv_cache``: a managed request's pages are released by vToken, but for a
    streaming session's turn that finishes or is retracted on its session's record: upstream keeps the record for
    the next turn, and its row stays managed (``RequestRows.park``, down to the turn's committed tokens)."""
    rt = vt.runtime
    if rt is not None and req.kv.req_pool_idx is not None:
        row = req.kv.req_pool_idx
        rt.rows.forget(row)
        if rt.cow is not None:
            rt.cow.forget(row)
        if rt.rows.is_managed(row):
            end = _kept_by_session(req, tree_cache)
            if end is None:
                rt.rows.release(req)
            else:
                rt.rows.park(req, end)
    return original(req, tree_cache, *args, **kwargs)


def _kept_by_session(req, tree_cache) -> int | None:
    """The logical length upstream's streaming session commits for ``req`` when it keeps the request's record
    (a turn on its session's record that finishes or is retracted: ``StreamingSession.try_cache_finished_req``);
    None when the record is released with the request (no session, or an aborted turn: the victim log's session is
    reset)."""
    session = getattr(tree_cache, "session", None)
    if session is None or session.borrowed_slot(req) is None:
        return None
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if isinstance(req.finished_reason, FINISH_ABORT):
        if SWITCHES.victim_log:  # the session's next turn sees its whole conversation again
            victim_log.record_reset(req.session.session_id)
        return None
    done = req.finished_len if req.finished_len is not None else len(req.output_ids)
    return len(req.origin_input_ids) + done


def register_decode_slots(vt: SchedulerProcess, original, batch, *args, **kwargs):
    """AROUND ``ScheduleBatch.prepare_for_decode``: its slot allocation sees the batch's layout
    (``RequestRows.preparing``); afterwards the new slot of every managed request is registered."""
    rt = vt.runtime
    if rt is None or not batch.spec_algorithm.is_none():
        return original(batch, *args, **kwargs)
    layout = rt.rows.layout(host_array(batch.req_pool_indices_cpu), host_array(batch.seq_lens_cpu))
    rt.rows.preparing = layout if layout.any_managed else None
    try:
        result = original(batch, *args, **kwargs)
    finally:
        rt.rows.preparing = None
    rt.rows.sync_decode(layout)
    return result


def extend_over_live_rows(vt: SchedulerProcess, original, batch, *args, **kwargs):
    """AROUND ``mem_cache.allocation.alloc_for_extend``: a managed request's chunk (a prompt evicted between its
    prefill chunks) extends its compacted row. Its ``Req`` stays logical (``prefix_len``: the prompt's tokens done);
    the batch's prefix and sequence lengths become live (replaced, not written: ``prepare_for_extend`` keeps its own
    lists logical), its prefix read from the row's live entries, and its slots follow the tail-page rule
    (``alloc_extend_slots``). Afterwards the new tokens are registered in the Token Table."""
    rt = vt.runtime
    if rt is None or rt.rows.n_managed == 0:
        return original(batch, *args, **kwargs)
    reqs = batch.reqs
    rows = np.fromiter((r.kv.req_pool_idx if r.kv.holds_kv else -1 for r in reqs), dtype=np.int64, count=len(reqs))
    at = np.flatnonzero(rt.rows.host_active[rows] & (rows >= 0))
    if not at.size:
        return original(batch, *args, **kwargs)
    ours = [reqs[i] for i in at.tolist()]
    logical = np.fromiter((r.prefix_len for r in ours), dtype=np.int64, count=len(ours))
    live = np.fromiter((r.kv.kv_committed_len for r in ours), dtype=np.int64, count=len(ours))
    shift = np.zeros(len(reqs), dtype=np.int64)
    shift[at] = logical - live
    prefix = np.asarray(batch.prefix_lens, dtype=np.int64) - shift
    batch.prefix_lens = prefix.tolist()
    batch.seq_lens = batch.seq_lens - torch.from_numpy(shift).to(batch.seq_lens.device, batch.seq_lens.dtype)
    batch.seq_lens_cpu = batch.seq_lens_cpu - torch.from_numpy(shift).to(batch.seq_lens_cpu.dtype)
    virtual = prefix.copy()  # what the allocator's page arithmetic is given (``alloc_extend_slots``)
    virtual[at] = (rt.rows.host_tail_pos[rows[at]] + 1) % rt.page_size
    rt.rows.extending = virtual
    for r, n in zip(ours, live.tolist()):
        r.prefix_len = n  # the row's prefix, for upstream's read of it (``_prefix_kv_indices``)
    try:
        result = original(batch, *args, **kwargs)
    finally:
        rt.rows.extending = None
        for r, n in zip(ours, logical.tolist()):
            r.prefix_len = n
    counts = np.asarray(batch.extend_lens, dtype=np.int64)[at]
    rt.rows.extend(rows[at], counts)
    rt.stats.peak_extend_kv = max(rt.stats.peak_extend_kv, int((live + counts).max()))
    return result


def alloc_extend_slots(
    vt: SchedulerProcess, original, allocator, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, *args, **kwargs
):
    """AROUND ``PagedTokenToKVPoolAllocator.alloc_extend``: upstream fills a request's last page from its prefix
    length modulo a page; a compacted row's last slot sits elsewhere in its page. Upstream's kernel and page count
    depend only on the prefix length modulo a page and the extend length, so they are given, for the rows of an
    extend that ``extend_over_live_rows`` prepared, the in-page position after the row's last slot as the prefix
    length (the tail-page rule): the same output as upstream's for dense rows."""
    rt = vt.runtime
    virtual = rt.rows.extending if rt is not None else None
    if virtual is None or len(virtual) != len(prefix_lens_cpu):
        return original(allocator, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, *args, **kwargs)
    pre_cpu = torch.from_numpy(virtual).to(prefix_lens_cpu.dtype)
    seq_cpu = pre_cpu + (seq_lens_cpu - prefix_lens_cpu).to(pre_cpu.dtype)
    return original(
        allocator,
        pre_cpu.to(prefix_lens.device, prefix_lens.dtype),
        pre_cpu,
        seq_cpu.to(seq_lens.device, seq_lens.dtype),
        seq_cpu.to(seq_lens_cpu.dtype),
        *args,
        **kwargs,
    )


def live_extend_sum(vt: SchedulerProcess, result, batch, *args, **kwargs) -> None:
    """AFTER ``ScheduleBatch.prepare_for_extend``: its length sum (upstream sums its logical list) is the live
    one when the batch extends a managed row."""
    rt = vt.runtime
    if rt is not None and rt.rows.n_managed and batch.seq_lens_cpu is not None:
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
