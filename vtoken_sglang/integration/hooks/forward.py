"""Hooks on the forward: decode positions are logical positions (RoPE and M-RoPE), not live counts; a score
policy's collector learns what each forward is and keeps its scored layers' queries."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from vtoken_sglang.core.row_layout import RowLayout
from vtoken_sglang.debug_switches import SWITCHES
from vtoken_sglang.integration.observe.host_reads import host_array, uncounted
from vtoken_sglang.integration.parts.score_link import batch_key
from vtoken_sglang.integration.process import SchedulerProcess
from vtoken_sglang.scoring.query_buffers import DEFAULT_ROWS

if TYPE_CHECKING:
    from vtoken_sglang.integration.runtime import VTokenRuntime

logger = logging.getLogger("vtoken_sglang")


def begin_forward(vt: SchedulerProcess, original, cls, batch, *args, **kwargs):
    """AROUND ``ForwardBatch.init_new``: the forward's ``RowLayout`` is built first, for the hooks that read it
    inside ``init_new`` (M-RoPE) and during the forward (sliding windows); then decode positions are made logical
    positions (RoPE), not live counts, and score policies learn what the forward is. With
    ``DebugSwitches.check_positions`` each decode batch's positions are checked against SGLang's own request
    bookkeeping (prompt length + generated tokens - 1, counting results the overlap scheduler has not processed
    yet), independently of the Token Table."""
    rt = vt.runtime
    if rt is None:
        return original(cls, batch, *args, **kwargs)
    rt.forward_layout = layout = forward_layout(rt, batch)
    ret = original(cls, batch, *args, **kwargs)
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
    if ret.forward_mode.is_extend() and ret.positions is not None and layout is not None and layout.host_offset.any():
        # an extend of a compacted row (a prompt evicted between its prefill chunks): positions from its logical
        # prefix, not its live one (upstream's are prefix + arange(extend) per request)
        ret.positions = ret.positions + torch.repeat_interleave(
            layout.offset[: len(ret.extend_seq_lens)], ret.extend_seq_lens, output_size=ret.extend_num_tokens
        ).to(ret.positions.dtype)
    if ret.forward_mode.is_decode() and ret.positions is not None:
        if layout is not None and layout.any_managed:  # unmanaged rows have offset 0
            ret.positions = layout.logical(ret.positions)
        if SWITCHES.check_positions:
            with uncounted():
                _check_positions(rt, batch, ret.positions)
    return ret


def forward_layout(rt: VTokenRuntime, batch) -> RowLayout | None:
    """The ``RowLayout`` of the forward of ``batch`` (SGLang's ``ScheduleBatch``); None for a forward without rows
    (idle). A decode batch with managed rows always has SGLang's host rows and lengths."""
    decoding = batch.forward_mode.is_decode()
    if batch.req_pool_indices_cpu is None or batch.seq_lens_cpu is None:
        if decoding and rt.rows.n_managed:
            raise RuntimeError("vToken: a decode batch without SGLang's host rows and lengths (its *_cpu tensors)")
        return None
    return rt.rows.layout(
        host_array(batch.req_pool_indices_cpu), host_array(batch.seq_lens_cpu), batch.req_pool_indices, decoding
    )


def mrope_decode_positions(vt: SchedulerProcess, original, forward_batch, model_runner, batch) -> None:
    """AROUND ``ForwardBatch._compute_mrope_positions_decode``: M-RoPE decode positions from each request's
    logical length. Upstream derives them from the live lengths (``seq_lens - 1``, plus the request's
    ``mrope_position_delta`` with an image, or a model's precomputed positions indexed by length); this runs it on the
    logical lengths (the forward's ``RowLayout``: device and host, no device read) and restores the live ones.
    Swapping the lengths before upstream's branches, not offsetting its result, keeps its choice between them right:
    a compacted row's live length may fall inside a prompt whose positions a model precomputed."""
    rt = vt.runtime
    layout = rt.forward_layout if rt is not None else None
    if layout is None or not layout.any_managed:
        return original(forward_batch, model_runner, batch)
    live, live_cpu = forward_batch.seq_lens, forward_batch.seq_lens_cpu
    try:
        forward_batch.seq_lens = layout.logical(live)
        forward_batch.seq_lens_cpu = live_cpu + torch.from_numpy(layout.host_offset[: len(live_cpu)]).to(live_cpu.dtype)
        return original(forward_batch, model_runner, batch)
    finally:
        forward_batch.seq_lens, forward_batch.seq_lens_cpu = live, live_cpu


def mrope_extend_positions(vt: SchedulerProcess, original, forward_batch, model_runner, batch) -> None:
    """AROUND ``ForwardBatch._compute_mrope_positions_extend``: M-RoPE extend positions from each request's logical
    prefix (the forward's ``RowLayout``), not its live one: upstream takes a text row's positions from its prefix
    length (prompts evicted between prefill chunks are text only: ``prefill_eviction.plain_text``)."""
    rt = vt.runtime
    layout = rt.forward_layout if rt is not None else None
    if layout is None or not layout.host_offset.any():
        return original(forward_batch, model_runner, batch)
    live = batch.prefix_lens
    try:
        batch.prefix_lens = (np.asarray(live, dtype=np.int64) + layout.host_offset[: len(live)]).tolist()
        return original(forward_batch, model_runner, batch)
    finally:
        batch.prefix_lens = live


def _check_positions(rt: VTokenRuntime, batch, positions: torch.Tensor) -> None:
    # under the overlap scheduler a request's last result(s) may still be queued, not yet in output_ids
    queued = [id(r) for b, _ in rt.pending_results() for r in b.reqs]
    expected = [len(r.origin_input_ids) + len(r.output_ids) + queued.count(id(r)) - 1 for r in batch.reqs]
    got = positions[: len(expected)].tolist()
    rt.stats.position_checks += len(expected)
    bad = sum(g != e for g, e in zip(got, expected))
    if bad:
        rt.stats.position_mismatches += bad
        logger.error("[vtoken] decode positions %s differ from logical positions %s", got, expected)


def keep_scored_query(vt: SchedulerProcess, result, layer, q, k, v, forward_batch, *args, **kwargs):
    """AFTER ``RadixAttention.forward`` (registered only for score-based policies): a scored layer keeps its query.
    Decode forwards write it into the collector's static buffers with tensor ops only, the same ops whether the
    forward runs eagerly or is captured into a CUDA graph (whose replays then refill the buffers without this
    hook); a scored prefill copies out its window's rows. The keys are in the KV pool now; scores are computed
    after the forward."""
    scorer = vt.scorer
    if scorer is not None and layer.layer_id in scorer.layers:
        scorer.keep_query(
            layer.layer_id,
            q,
            forward_batch.forward_mode.is_decode(),
            layer.tp_q_head_num,
            layer.qk_head_dim,
            layer.scaling,
            layer.logit_cap,
            _decode_rows_bound,
        )
    return result


def _decode_rows_bound() -> int:
    """Query buffer rows: the larger of the collector's default and the largest decode CUDA graph (every captured
    batch fits), at most the scheduler's running-request cap (no decode batch is larger)."""
    from sglang.srt.runtime_context import get_exec, get_schedule

    graphs = get_exec().graph.cuda_graph_config  # None without CUDA graphs
    graph_bs = (graphs.decode.max_bs if graphs is not None else 0) or 0
    cap = get_schedule().max_running_requests or graph_bs or DEFAULT_ROWS
    return min(cap, max(DEFAULT_ROWS, graph_bs))
