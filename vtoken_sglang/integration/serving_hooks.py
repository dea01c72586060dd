"""The serving hooks: registered only in scheduler processes of a server started with ``--enable-vtoken``.

Each function names the upstream symbol it hooks (all listed, fingerprinted, in ``patches/manifest.json``). They
find the process's ``VTokenRuntime`` in ``RUNTIME`` (one scheduler per process).
"""

from __future__ import annotations

import logging
import os

import torch

from vtoken_sglang.integration import options
from vtoken_sglang.integration.hook_timer import TIMER
from vtoken_sglang.integration.metrics_export import PrometheusExporter, log_line
from vtoken_sglang.integration.runtime import VTokenRuntime

logger = logging.getLogger("vtoken_sglang")

RUNTIME: VTokenRuntime | None = None


def scheduler_init(original, scheduler, server_args, *args, **kwargs) -> None:
    """AROUND ``Scheduler.__init__``: first refuse an unsupported model with one line, before any weight is
    loaded; then let SGLang build the scheduler, and build the runtime over its pools."""
    global RUNTIME
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_parallel

    reason = options.unsupported_model(ModelConfig.from_server_args(server_args))
    if reason:
        raise SystemExit(f"error: {reason}")
    original(scheduler, server_args, *args, **kwargs)

    cfg = options.current_config(scheduler.server_args)
    allocator = scheduler.token_to_kv_pool_allocator
    if type(allocator) is not PagedTokenToKVPoolAllocator or not hasattr(allocator.get_kvcache(), "k_buffer"):
        raise SystemExit(f"error: vToken needs SGLang's paged allocator over one K/V pool; this server built "
                         f"{type(allocator).__name__} over {type(allocator.get_kvcache()).__name__}")
    RUNTIME = VTokenRuntime(cfg, scheduler.req_to_token_pool, allocator, allocator.get_kvcache())
    if scheduler.enable_overlap and RUNTIME.req_to_token.is_cuda:  # copies wait for the forward in flight
        RUNTIME.reclaimer.engine.producer = scheduler.forward_stream
    RUNTIME.prompt_in_tree = not scheduler.server_args.disable_radix_cache
    tree = scheduler.tree_cache
    if not getattr(tree, "disable", True) and hasattr(tree, "tree_core"):  # SGLang's UnifiedRadixCache, on
        RUNTIME.tree = tree
        if cfg.vtoken_cow and RUNTIME.policy is not None:
            from vtoken_sglang.integration.prefix_cow import PrefixCow

            RUNTIME.cow = PrefixCow(tree, RUNTIME.table, RUNTIME.pool, RUNTIME.reclaimer.engine, RUNTIME.page_size,
                                    allow_copies=cfg.vtoken_reclaim)
    if cfg.vtoken_planner == "worker" and cfg.vtoken_reclaim:
        from sglang.srt.distributed.parallel_state import get_tp_group

        from vtoken_sglang.integration.worker_link import WorkerLink, tp_broadcaster

        group = get_tp_group()
        RUNTIME.worker_link = WorkerLink(RUNTIME.reclaimer, scheduler.req_to_token_pool.req_to_token.shape[0],
                                         group.rank_in_group, tp_broadcaster(group) if group.world_size > 1 else None)
        # a worker's plan arrives a step or more after its snapshot, and waits up to a cadence to be broadcast
        RUNTIME.reclaimer.max_plan_lag = 2 * RUNTIME.worker_link.every
    if RUNTIME.scorer is not None:
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        RUNTIME.tp_size = group.world_size

        def all_reduce(t: torch.Tensor) -> None:
            torch.distributed.all_reduce(t, group=group.cpu_group if t.device.type == "cpu" else group.device_group)

        RUNTIME.tp_all_reduce = all_reduce
        if SCORE_DUMP:
            RUNTIME.score_dump = []
    RUNTIME.pending_results = lambda: getattr(scheduler, "result_queue", ()) if scheduler.enable_overlap else ()
    scheduler._vtoken = RUNTIME
    logger.info("[vtoken] scheduler tp_rank=%d: %s", get_parallel().tp_rank, cfg.summary())


def alloc_decode(original, allocator, seq_lens, seq_lens_cpu, last_loc, *args, **kwargs):
    """REPLACE-like AROUND ``PagedTokenToKVPoolAllocator.alloc_decode``: the next slot of a request is
    ``last_loc + 1`` while its tail page has room, else the first slot of a new page. Upstream derives this from
    ``seq_len % page_size``, which no longer holds once a row is compacted. Same contract: None when out of pages."""
    if args or kwargs or RUNTIME is None or RUNTIME.n_managed == 0:  # every row dense: upstream's rule holds
        return original(allocator, seq_lens, seq_lens_cpu, last_loc, *args, **kwargs)
    P = allocator.page_size
    need = (last_loc + 1) % P == 0
    n_new = int(need.sum())
    out = (last_loc + 1).to(torch.int64)
    if n_new:
        slots = allocator.alloc(n_new * P)
        if slots is None:
            return None
        out[need] = slots[::P].to(out.dtype)
    return out


def new_tokens_required_next_decode(original, batch, selected_indices=None):
    """AROUND ``ScheduleBatch.new_tokens_required_next_decode``: count new pages by the tail-page rule."""
    if not batch.spec_algorithm.is_none() or RUNTIME is None or RUNTIME.n_managed == 0:
        return original(batch, selected_indices)
    reqs = batch.reqs if selected_indices is None else [batch.reqs[i] for i in selected_indices]
    if not reqs:
        return 0
    P = batch.token_to_kv_pool_allocator.page_size
    rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
    cols = torch.tensor([r.kv.kv_committed_len - 1 for r in reqs], dtype=torch.int64)
    last = RUNTIME.req_to_token[rows.to(RUNTIME.req_to_token.device), cols.to(RUNTIME.req_to_token.device)]
    from sglang.srt.managers import schedule_batch

    beam_rows = schedule_batch.num_beam_member_rows(reqs)
    return int(((last.to(torch.int64) + 1) % P == 0).sum()) * P + beam_rows


def prepare_for_decode(result, batch, *args, **kwargs) -> None:
    """AFTER ``ScheduleBatch.prepare_for_decode``: register the new slot of every managed request."""
    if RUNTIME is not None and batch.spec_algorithm.is_none():
        RUNTIME.after_decode_alloc(batch)


CHECK_POSITIONS = os.environ.get("VTOKEN_SGLANG_CHECK_POSITIONS") == "1"
# Debug: write the first request's collected scores per scored step to this file when the scheduler goes idle.
SCORE_DUMP = os.environ.get("VTOKEN_SGLANG_SCORE_DUMP")


def forward_batch_init_new(ret, cls, batch, *args, **kwargs):
    """AFTER ``ForwardBatch.init_new``: decode positions are logical positions (RoPE), not live counts.
    With ``VTOKEN_SGLANG_CHECK_POSITIONS=1`` each decode batch's positions are checked against SGLang's own
    request bookkeeping (prompt length + generated tokens - 1, counting results the overlap scheduler has not
    processed yet), independently of the Token Table."""
    if RUNTIME is not None and RUNTIME.scorer is not None:
        if ret.forward_mode.is_extend() and RUNTIME.scorer.prefill_window > 0:
            # a request whose prompt is still being chunked has inflight_middle_chunks > 0 while its chunk runs
            RUNTIME.prefill_complete = [r.inflight_middle_chunks <= 0 for r in batch.reqs]
            RUNTIME.scorer.begin_forward(False, ret.extend_seq_lens_cpu, ret.extend_prefix_lens_cpu)
        else:
            RUNTIME.scorer.begin_forward(ret.forward_mode.is_decode())
    if RUNTIME is not None and ret.forward_mode.is_decode() and ret.positions is not None:
        if RUNTIME.n_managed:  # unmanaged rows have offset 0
            ret.positions = ret.positions + RUNTIME.decode_positions_offset(ret.req_pool_indices).to(ret.positions.dtype)
        if CHECK_POSITIONS:
            # under the overlap scheduler a request's last result(s) may still be queued, not yet in output_ids
            queued = [id(r) for b, _ in RUNTIME.pending_results() for r in b.reqs]
            expected = [len(r.origin_input_ids) + len(r.output_ids) + queued.count(id(r)) - 1 for r in batch.reqs]
            got = ret.positions[: len(expected)].tolist()
            RUNTIME.position_checks += len(expected)
            bad = sum(g != e for g, e in zip(got, expected))
            if bad:
                RUNTIME.position_mismatches += bad
                logger.error("[vtoken] decode positions %s differ from logical positions %s", got, expected)
    return ret


def radix_attention_forward(result, layer, q, k, v, forward_batch, *args, **kwargs):
    """AFTER ``RadixAttention.forward`` (registered only for score-based policies): keep the query of a scored
    layer in a scored forward (a decode step, or a prefill's window for snapkv). The keys are in the KV pool now;
    scores are computed after the forward."""
    scorer = RUNTIME.scorer if RUNTIME is not None else None
    if scorer is not None and scorer.wants(layer.layer_id):
        scorer.save_query(layer.layer_id, q, layer.tp_q_head_num, layer.qk_head_dim, layer.scaling, layer.logit_cap)
    return result


def get_next_batch_to_run(scheduler, running_batch=None, last_batch=None, *args, **kwargs) -> None:
    """BEFORE ``Scheduler.get_next_batch_to_run``: the eviction round of the decode step that ran last, after its
    forward and before the next batch is admitted and prepared; the same point with and without SGLang's overlap
    scheduler. Without overlap, that step's results are processed by now. With overlap they are not (they are
    processed after the next forward is launched), so requests whose queued result ends them by length are left
    alone, as the results would have finished them; a request that ends on a stop token is only known to have
    ended after this round (its extra victims change nothing it outputs). The round reads only the Token Table,
    the batch's rows and lengths, and the tree locks, none of which a pending result changes."""
    if RUNTIME is None or last_batch is None or not last_batch.forward_mode.is_decode() or last_batch.is_empty():
        return None
    ending = set()
    queued = RUNTIME.pending_results() if RUNTIME.policy is not None else ()  # policy none: nothing to leave alone
    if queued:
        pending = {id(r) for b, _ in queued for r in b.reqs}
        ending = {id(r) for r in last_batch.reqs if id(r) in pending and r.next_output_finishes_by_length()}
    RUNTIME.evict(last_batch, [scheduler.chunked_req] if scheduler.chunked_req is not None else [], ending)
    return None


def process_batch_result(result, scheduler, batch, *args, **kwargs) -> None:
    """AFTER ``Scheduler.process_batch_result``: after a prefill scored with a window (snapkv), rank the prompts.
    (Score-based policies run without the overlap scheduler, so the window's queries are still this prefill's.)"""
    if RUNTIME is not None and batch is not None and batch.forward_mode.is_extend():
        RUNTIME.after_prefill(batch)


def release_kv_cache(original, req, tree_cache, *args, **kwargs):
    """AROUND ``mem_cache.common.release_kv_cache``: a managed request's pages are released by vToken."""
    if RUNTIME is not None and req.kv.req_pool_idx is not None and RUNTIME.is_managed(req.kv.req_pool_idx):
        RUNTIME.release(req)
    return original(req, tree_cache, *args, **kwargs)


def running_request_offset(original, adder, req):
    """AROUND ``PrefillAdder._get_running_request_total_token_offset``: a running request's future KV is capped
    by its eviction budget (this is where the capacity gain comes from)."""
    upstream = original(adder, req)
    if RUNTIME is None or RUNTIME.policy is None:
        return upstream
    remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
    logical = len(req.origin_input_ids) + len(req.output_ids)
    return min(upstream, RUNTIME.future_kv(req.kv.kv_committed_len, logical, remaining, req.kv.cache_protected_len))


def update_prefill_budget(original, adder, prefix_len, extend_input_len, max_new_tokens, *args, **kwargs):
    """AROUND ``PrefillAdder._update_prefill_budget``: a new request reserves for decode only what its eviction
    budget lets it keep beyond the prompt."""
    if RUNTIME is not None and RUNTIME.policy is not None and max_new_tokens > 0:
        current = prefix_len + extend_input_len
        # with the radix cache on, the prompt's whole pages go to the tree after prefill (then protected)
        protected = current // RUNTIME.page_size * RUNTIME.page_size if RUNTIME.prompt_in_tree else 0
        max_new_tokens = RUNTIME.future_kv(current, current, max_new_tokens, protected)
    return original(adder, prefix_len, extend_input_len, max_new_tokens, *args, **kwargs)


def add_one_req(original, adder, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req``: with the radix cache off, upstream admits an ``ignore_eos`` request
    through ``add_one_req_ignore_eos``, whose check has every request grow by its whole remaining length and
    never asks ``_get_running_request_total_token_offset``: a vToken server admitted those loads (bench_serving's
    default) as if nothing were evicted. Where eviction budgets do give memory back, such a request takes
    upstream's general path instead, the one it takes with the radix cache on: running requests reserve their
    capped future KV (``running_request_offset``), the new one its capped budget (``update_prefill_budget``).
    ``ignore_eos`` is hidden for this call only: on the general path upstream reads the flag of running requests
    (their offsets), never that of the request being admitted."""
    sp = req.sampling_params
    if RUNTIME is None or not sp.ignore_eos or not RUNTIME.admission_capped:
        return original(adder, req, *args, **kwargs)
    sp.ignore_eos = False
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        sp.ignore_eos = True


def check_decode_mem(original, batch, *args, **kwargs):
    """AROUND ``ScheduleBatch.check_decode_mem``: before SGLang retracts, reclaim (regardless of theta)."""
    ok = original(batch, *args, **kwargs)
    if ok or RUNTIME is None:
        return ok
    if RUNTIME.reclaim_now() == 0:
        return ok
    return original(batch, *args, **kwargs)


def scheduler_idle(result, scheduler, *args, **kwargs) -> None:
    """AFTER ``Scheduler.on_idle``: log this rank's metrics once per burst of work (TP ranks are compared by it),
    bring the Prometheus series to their idle values, and let the compaction worker's client check its health."""
    if RUNTIME is not None and RUNTIME.rounds != RUNTIME.logged_rounds:
        from sglang.srt.runtime_context import get_parallel

        RUNTIME.logged_rounds = RUNTIME.rounds
        m = RUNTIME.metrics()
        logger.info("[vtoken] idle tp_rank=%d %s", get_parallel().tp_rank, m)
        if RUNTIME.exporter is not None:
            RUNTIME.exporter.update(m)
    if RUNTIME is not None and RUNTIME.worker_link is not None:
        RUNTIME.worker_link.poll()
    if RUNTIME is not None and RUNTIME.score_dump:
        torch.save(RUNTIME.score_dump, SCORE_DUMP + ".tmp")
        os.replace(SCORE_DUMP + ".tmp", SCORE_DUMP)  # readers never see a partial file
        RUNTIME.score_dump = []  # each idle writes the steps since the last one


def report_decode_stats(result, reporter, *args, **kwargs) -> None:
    """AFTER ``SchedulerMetricsReporter.report_decode_stats``: at the same cadence as SGLang's periodic decode
    log line (``--decode-log-interval``), a ``[vtoken]`` line beside it on the logging rank, and the Prometheus
    series when metrics are enabled for this scheduler."""
    if RUNTIME is None or reporter.forward_ct_decode % reporter.decode_log_interval != 0:
        return
    if not (reporter.is_stats_logging_rank or reporter.current_scheduler_metrics_enabled):
        return
    m = RUNTIME.metrics()
    if reporter.is_stats_logging_rank:
        logger.info(log_line(m))
    if reporter.current_scheduler_metrics_enabled:
        if RUNTIME.exporter is None:
            RUNTIME.exporter = PrometheusExporter(reporter.metrics_collector.labels)
        RUNTIME.exporter.update(m)


def get_internal_state(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.get_internal_state``: vToken's metrics under ``"vtoken"`` (``/get_server_info`` shows
    them in ``internal_states``), with ``hook_ms`` per hook (not in the log lines: one entry per hook)."""
    if RUNTIME is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["vtoken"] = {**RUNTIME.metrics(),
                                           "hook_ms_by_hook": {k: round(v, 3) for k, v in TIMER.by_hook.items()}}
    return result


HOOKS = {
    "sglang.srt.managers.scheduler.Scheduler.__init__": ("AROUND", scheduler_init),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode": ("AROUND", alloc_decode),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.new_tokens_required_next_decode": ("AROUND", new_tokens_required_next_decode),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode": ("AFTER", prepare_for_decode),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": ("AFTER", forward_batch_init_new),
    "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run": ("BEFORE", get_next_batch_to_run),
    "sglang.srt.managers.scheduler.Scheduler.process_batch_result": ("AFTER", process_batch_result),
    "sglang.srt.mem_cache.common.release_kv_cache": ("AROUND", release_kv_cache),
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state": ("AFTER", get_internal_state),
    "sglang.srt.managers.scheduler.Scheduler.on_idle": ("AFTER", scheduler_idle),
    "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats": (
        "AFTER", report_decode_stats),
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset": ("AROUND", running_request_offset),
    "sglang.srt.managers.schedule_policy.PrefillAdder._update_prefill_budget": ("AROUND", update_prefill_budget),
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req": ("AROUND", add_one_req),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem": ("AROUND", check_decode_mem),
}
# Only with a score-based policy (a Python call per attention layer per step is not free).
SCORING_HOOKS = {
    "sglang.srt.layers.radix_attention.RadixAttention.forward": ("AFTER", radix_attention_forward),
}
