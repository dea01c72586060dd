"""Hooks on SGLang's decode allocation and release: a managed row is compacted, so its next slot follows the
tail-page rule (``core.pages.tail_room``), not ``seq_len % page_size``, and its pages are released by vToken
(SGLang's segment free assumes dense rows). Every hook takes upstream's path while no row is managed."""

from __future__ import annotations

import numpy as np
import torch

from vtoken_sglang.core.pages import tail_room
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
    """AROUND ``mem_cache.common.release_kv_cache``: a managed request's pages are released by vToken."""
    rt = vt.runtime
    if rt is not None and req.kv.req_pool_idx is not None:
        rt.rows.forget(req.kv.req_pool_idx)
        if rt.cow is not None:
            rt.cow.forget(req.kv.req_pool_idx)
        if rt.rows.is_managed(req.kv.req_pool_idx):
            rt.rows.release(req)
    return original(req, tree_cache, *args, **kwargs)


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
