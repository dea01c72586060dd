"""The serving hooks: registered only in scheduler processes of a server started with ``--enable-vtoken``.

This module builds the process's ``VTokenRuntime`` (``runtime.RUNTIME``; one scheduler per process), runs the
eviction round after each decode step, and keeps a scored layer's queries; ``HOOKS`` is the whole table of
scheduler-side hooks, from the modules by job (``alloc_hooks``, ``admission_hooks``, ``report_hooks``). Each hook
names the upstream symbol it hooks; all are listed, fingerprinted, in ``patches/manifest.json``.
"""

from __future__ import annotations

import functools
import logging

from vtoken_sglang.integration import admission_hooks, alloc_hooks, model_support, options, report_hooks, runtime
from vtoken_sglang.integration.eviction_round import run_round
from vtoken_sglang.integration.runtime import VTokenRuntime
from vtoken_sglang.scoring import ScoreCollector
from vtoken_sglang.scoring.query_buffers import DEFAULT_ROWS

logger = logging.getLogger("vtoken_sglang")


def scheduler_init(original, scheduler, server_args, *args, **kwargs) -> None:
    """AROUND ``Scheduler.__init__``: first refuse an unsupported model with one line, before any weight is
    loaded (and, while SGLang builds the model, an unsupported layer: ``model_support.radix_attention_init``); then
    build the score collector (score policies: SGLang's CUDA graph capture runs the attention hook), let SGLang
    build the scheduler, and build the runtime over it."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_parallel

    model_config = ModelConfig.from_server_args(server_args)
    reason = model_support.unsupported_model(model_config)
    if reason:
        model_support.refuse(reason)
    model_support.SERVING.update(model=model_support.model_name(model_config), context_len=model_config.context_len)
    global SCORER
    SCORER = runtime.make_scorer(
        options.current_config(server_args), model_config.num_attention_layers, server_args.device
    )
    original(scheduler, server_args, *args, **kwargs)
    cfg = options.current_config(scheduler.server_args)
    rt = VTokenRuntime.from_scheduler(scheduler, cfg, SCORER, score_dump=report_hooks.SCORE_DUMP is not None)
    runtime.RUNTIME = rt
    logger.info("[vtoken] scheduler tp_rank=%d: %s", get_parallel().tp_rank, cfg.summary())
    logger.info(
        "[vtoken] device memory: %.3f MB of metadata beside a KV pool of %.3f GB (%.3f%%)",
        rt.device_bytes / 2**20,
        rt.kv_pool_bytes / 2**30,
        100 * rt.device_bytes / max(rt.kv_pool_bytes, 1),
    )


def get_next_batch_to_run(scheduler, running_batch=None, last_batch=None, *args, **kwargs) -> None:
    """BEFORE ``Scheduler.get_next_batch_to_run``: the eviction round of the decode step that ran last, after its
    forward and before the next batch is admitted and prepared; the same point with and without SGLang's overlap
    scheduler. Without overlap, that step's results are processed by now. With overlap they are not (they are
    processed after the next forward is launched), so requests whose queued result ends them by length are left
    alone, as the results would have finished them; a request that ends on a stop token is only known to have
    ended after this round (its extra victims change nothing it outputs). The round reads only the Token Table,
    the batch's rows and lengths, and the tree locks, none of which a pending result changes."""
    rt = runtime.RUNTIME
    if rt is None or last_batch is None or not last_batch.forward_mode.is_decode() or last_batch.is_empty():
        return None
    if rt.policy is None:  # nothing is evicted: the round only counts the step
        run_round(rt, last_batch)
        return None
    ending = functools.cache(lambda: _ending(rt, last_batch))  # asked only in a round that may trim
    run_round(rt, last_batch, [scheduler.chunked_req] if scheduler.chunked_req is not None else [], ending)
    return None


def _ending(rt, batch) -> frozenset:
    """Ids of the requests of ``batch`` whose queued (overlap scheduler) result ends them by length."""
    queued = rt.pending_results()
    if not queued:
        return frozenset()
    pending = {id(r) for b, _ in queued for r in b.reqs}
    return frozenset(id(r) for r in batch.reqs if id(r) in pending and r.next_output_finishes_by_length())


def process_batch_result(result, scheduler, batch, *args, **kwargs) -> None:
    """AFTER ``Scheduler.process_batch_result``: after a batch that is not a decode step (a prefill, mixed or
    prebuilt batch: its requests join the decode batch), the next eviction round checks every row; after a prefill
    scored with a window (snapkv), rank the prompts (its window waited for its results, which the overlap scheduler
    processes after the next forward)."""
    rt = runtime.RUNTIME
    if rt is None or batch is None or batch.forward_mode.is_decode():
        return
    rt.rows.recheck()
    if rt.scores is not None and batch.forward_mode.is_extend():
        rt.scores.observe_prefill(batch)


def radix_attention_forward(result, layer, q, k, v, forward_batch, *args, **kwargs):
    """AFTER ``RadixAttention.forward`` (registered only for score-based policies): a scored layer keeps its query.
    Decode forwards write it into the collector's static buffers with tensor ops only, the same ops whether the
    forward runs eagerly or is captured into a CUDA graph (whose replays then refill the buffers without this
    hook); a scored prefill copies out its window's rows. The keys are in the KV pool now; scores are computed
    after the forward."""
    scorer = SCORER
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


SCORER: ScoreCollector | None = None  # this scheduler's score collector (score policies), built before the model

_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
HOOKS = {
    f"{_SCHED}.__init__": ("AROUND", scheduler_init),
    "sglang.srt.layers.radix_attention.RadixAttention.__init__": ("AFTER", model_support.radix_attention_init),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode": (
        "AROUND",
        alloc_hooks.alloc_decode,
    ),
    f"{_BATCH}.new_tokens_required_next_decode": ("AROUND", alloc_hooks.new_tokens_required_next_decode),
    f"{_BATCH}.prepare_for_decode": ("AROUND", alloc_hooks.prepare_for_decode),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": ("AFTER", alloc_hooks.forward_batch_init_new),
    f"{_SCHED}.get_next_batch_to_run": ("BEFORE", get_next_batch_to_run),
    f"{_SCHED}.process_batch_result": ("AFTER", process_batch_result),
    "sglang.srt.mem_cache.common.release_kv_cache": ("AROUND", alloc_hooks.release_kv_cache),
    f"{_SCHED}.get_internal_state": ("AFTER", report_hooks.get_internal_state),
    f"{_SCHED}.on_idle": ("AROUND", report_hooks.scheduler_idle),
    "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats": (
        "AFTER",
        report_hooks.report_decode_stats,
    ),
    f"{_ADDER}._get_running_request_total_token_offset": ("AROUND", admission_hooks.running_request_offset),
    f"{_ADDER}._update_prefill_budget": ("AROUND", admission_hooks.update_prefill_budget),
    f"{_ADDER}.add_one_req": ("AROUND", admission_hooks.add_one_req),
    f"{_BATCH}.check_decode_mem": ("AROUND", admission_hooks.check_decode_mem),
}
# Only with a score-based policy (a Python call per attention layer per step is not free).
SCORING_HOOKS = {
    "sglang.srt.layers.radix_attention.RadixAttention.forward": ("AFTER", radix_attention_forward),
}
