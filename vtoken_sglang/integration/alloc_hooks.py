"""Hooks on SGLang's decode allocation, release and positions: a managed row is compacted, so its next slot
follows the tail-page rule (``core.pages.tail_room``), not ``seq_len % page_size``; its pages are released by
vToken (SGLang's segment free assumes dense rows); and its RoPE position is its logical one, not its live count.
Every hook takes upstream's path while no row is managed."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from vtoken_sglang.core.pages import tail_room
from vtoken_sglang.integration import runtime
from vtoken_sglang.integration.host_reads import host_array, uncounted
from vtoken_sglang.integration.score_link import batch_key

logger = logging.getLogger("vtoken_sglang")

CHECK_POSITIONS = os.environ.get("VTOKEN_SGLANG_CHECK_POSITIONS") == "1"


def _needs_page(last_slot: torch.Tensor, page_size: int) -> torch.Tensor:
    return tail_room(last_slot.to(torch.int64), page_size) == 0


def alloc_decode(original, allocator, seq_lens, seq_lens_cpu, last_loc, *args, **kwargs):
    """AROUND ``PagedTokenToKVPoolAllocator.alloc_decode``: one slot per request by the tail-page rule. Same
    contract as upstream: None when out of pages. Inside ``prepare_for_decode`` the rule is taken on the host
    mirrors (``RequestRows.needs_page``: no device read), elsewhere on ``last_loc``."""
    rt = runtime.RUNTIME
    if args or kwargs or rt is None or rt.rows.n_managed == 0:  # every row dense: upstream's rule holds
        return original(allocator, seq_lens, seq_lens_cpu, last_loc, *args, **kwargs)
    P = allocator.page_size
    out = (last_loc + 1).to(torch.int64)
    rows = _PREPARING.get("rows")
    if rows is not None and len(rows) == len(seq_lens_cpu):
        at = np.flatnonzero(rt.rows.needs_page(rows, host_array(seq_lens_cpu) - 1))
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


def new_tokens_required_next_decode(original, batch, selected_indices=None):
    """AROUND ``ScheduleBatch.new_tokens_required_next_decode``: count new pages by the tail-page rule (on the host
    mirrors)."""
    rt = runtime.RUNTIME
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


def release_kv_cache(original, req, tree_cache, *args, **kwargs):
    """AROUND ``mem_cache.common.release_kv_cache``: a managed request's pages are released by vToken."""
    rt = runtime.RUNTIME
    if rt is not None and req.kv.req_pool_idx is not None:
        rt.rows.forget(req.kv.req_pool_idx)
        if rt.rows.is_managed(req.kv.req_pool_idx):
            rt.rows.release(req)
    return original(req, tree_cache, *args, **kwargs)


_PREPARING: dict = {}  # "rows": host row ids of the batch ``prepare_for_decode`` is preparing (for alloc_decode)


def prepare_for_decode(original, batch, *args, **kwargs):
    """AROUND ``ScheduleBatch.prepare_for_decode``: its slot allocation sees the batch's host rows; afterwards the
    new slot of every managed request is registered."""
    rt = runtime.RUNTIME
    if rt is None or not batch.spec_algorithm.is_none():
        return original(batch, *args, **kwargs)
    _PREPARING["rows"] = host_array(batch.req_pool_indices_cpu) if rt.rows.n_managed else None
    try:
        result = original(batch, *args, **kwargs)
    finally:
        _PREPARING.clear()
    rt.rows.sync_decode(batch)
    return result


def forward_batch_init_new(ret, cls, batch, *args, **kwargs):
    """AFTER ``ForwardBatch.init_new``: decode positions are logical positions (RoPE), not live counts; score
    policies learn what the forward is. With ``VTOKEN_SGLANG_CHECK_POSITIONS=1`` each decode batch's positions are
    checked against SGLang's own request bookkeeping (prompt length + generated tokens - 1, counting results the
    overlap scheduler has not processed yet), independently of the Token Table."""
    rt = runtime.RUNTIME
    if rt is None:
        return ret
    if rt.scores is not None:
        scorer = rt.scores.scorer
        if ret.forward_mode.is_extend() and scorer.prefill_window > 0:
            # a request whose prompt is still being chunked has inflight_middle_chunks > 0 while its chunk runs
            scorer.begin_forward(
                False,
                ret.extend_seq_lens_cpu,
                ret.extend_prefix_lens_cpu,
                key=batch_key(batch.reqs),
                complete=[r.inflight_middle_chunks <= 0 for r in batch.reqs],
            )
        else:
            scorer.begin_forward(ret.forward_mode.is_decode())
    if ret.forward_mode.is_decode() and ret.positions is not None:
        if rt.rows.n_managed:  # unmanaged rows have offset 0
            ret.positions = ret.positions + rt.rows.position_offset(ret.req_pool_indices).to(ret.positions.dtype)
        if CHECK_POSITIONS:
            with uncounted():
                _check_positions(rt, batch, ret.positions)
    return ret


def _check_positions(rt, batch, positions: torch.Tensor) -> None:
    # under the overlap scheduler a request's last result(s) may still be queued, not yet in output_ids
    queued = [id(r) for b, _ in rt.pending_results() for r in b.reqs]
    expected = [len(r.origin_input_ids) + len(r.output_ids) + queued.count(id(r)) - 1 for r in batch.reqs]
    got = positions[: len(expected)].tolist()
    rt.stats.position_checks += len(expected)
    bad = sum(g != e for g, e in zip(got, expected))
    if bad:
        rt.stats.position_mismatches += bad
        logger.error("[vtoken] decode positions %s differ from logical positions %s", got, expected)
