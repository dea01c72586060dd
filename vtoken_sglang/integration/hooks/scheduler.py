"""Hooks on SGLang's scheduler: build the runtime, refuse what it cannot serve, run the eviction round after each
decode step, and look at every row again after a batch that is not a decode step."""

from __future__ import annotations

import logging

from vtoken_sglang.config import VTokenConfig
from vtoken_sglang.integration.hooks import admission
from vtoken_sglang.integration.parts.score_link import make_scorer
from vtoken_sglang.integration.parts.tp_group import TpGroup
from vtoken_sglang.integration.process import SchedulerProcess
from vtoken_sglang.integration.runtime import VTokenRuntime
from vtoken_sglang.integration.startup import model_support, options
from vtoken_sglang.scoring import ScoreCollector

logger = logging.getLogger("vtoken_sglang")


def build_runtime(vt: SchedulerProcess, original, scheduler, server_args, *args, **kwargs) -> None:
    """AROUND ``Scheduler.__init__``: first refuse an unsupported model with one line, before any weight is
    loaded (and, while SGLang builds the model, an unsupported layer: ``refuse_unsupported_layer``); then build the
    score collector (score policies: SGLang's CUDA graph capture runs the attention hook), let SGLang build the
    scheduler, and build the runtime over it."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_parallel

    model_config = ModelConfig.from_server_args(server_args)
    reason = model_support.unsupported_model(model_config)
    if reason:
        model_support.refuse(reason)
    model_support.SERVING.update(model=model_support.model_name(model_config))
    scorer = make_scorer(options.current_config(server_args), model_config.num_attention_layers, server_args.device)
    vt.scorer = scorer
    original(scheduler, server_args, *args, **kwargs)
    cfg = options.current_config(scheduler.server_args)
    rt = runtime_over(scheduler, cfg, scorer, vt.widest_window)
    vt.runtime = rt
    if scheduler.server_args.enable_streaming_session:
        vt.sessions = scheduler.tree_cache.session
    logger.info("[vtoken] scheduler tp_rank=%d: %s", get_parallel().tp_rank, cfg.summary())
    logger.info(
        "[vtoken] device memory: %.3f MB of metadata beside a KV pool of %.3f GB (%.3f%%)",
        rt.device_bytes / 2**20,
        rt.kv_pool_bytes / 2**30,
        100 * rt.device_bytes / max(rt.kv_pool_bytes, 1),
    )


def runtime_over(scheduler, cfg: VTokenConfig, scorer: ScoreCollector | None, widest_window: int = 0) -> VTokenRuntime:
    """The runtime over a built SGLang scheduler's pools, tree, streams and TP group (``widest_window``: its
    model's widest sliding window, 0 for none); raises ``SystemExit`` with one line if they are not what vToken can
    serve (a paged allocator over one K/V pool)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    allocator = scheduler.token_to_kv_pool_allocator
    kv_pool = allocator.get_kvcache()
    if type(allocator) is not PagedTokenToKVPoolAllocator or not hasattr(kv_pool, "k_buffer"):
        raise SystemExit(
            f"error: vToken needs SGLang's paged allocator over one K/V pool; this server built "
            f"{type(allocator).__name__} over {type(kv_pool).__name__}"
        )
    req_to_token = scheduler.req_to_token_pool.req_to_token
    tree = scheduler.tree_cache
    on = not getattr(tree, "disable", True) and hasattr(tree, "tree_core")  # SGLang's UnifiedRadixCache, on
    overlap = scheduler.enable_overlap
    return VTokenRuntime(
        cfg,
        req_to_token,
        allocator,
        kv_pool,
        tree=tree if on else None,
        producer=scheduler.forward_stream if overlap and req_to_token.is_cuda else None,
        tp=TpGroup.of_scheduler(),
        prompt_in_tree=not scheduler.server_args.disable_radix_cache,
        pending_results=(lambda: getattr(scheduler, "result_queue", ())) if overlap else tuple,
        scorer=scorer,
        widest_window=widest_window,
        prefill_chunk=max(scheduler.chunked_prefill_size or 0, 0),
        sessions=bool(getattr(scheduler.server_args, "enable_streaming_session", False)),
    )


def refuse_unsupported_layer(vt: SchedulerProcess, result, layer, *args, **kwargs) -> None:
    """AFTER ``RadixAttention.__init__``: while SGLang builds the model, before its weights load, a layer vToken
    cannot serve stops the scheduler with one line."""
    reason = model_support.unsupported_layer(layer)
    if reason:
        model_support.refuse(reason)
    vt.widest_window = max(vt.widest_window, layer.sliding_window_size)


def evict_between_chunks(vt: SchedulerProcess, original, scheduler, req, *args, **kwargs):
    """AROUND ``Scheduler.stash_chunked_request``: a prompt evicted between its prefill chunks
    (``--vtoken-prefill-eviction``, ``parts.prefill_eviction``) is marked before upstream's stash (which then
    publishes nothing to the tree and only moves its prefix length on), and trimmed after it."""
    rt = vt.runtime
    if rt is None or rt.prefill is None or not rt.prefill.takes(req):
        return original(scheduler, req, *args, **kwargs)
    result = original(scheduler, req, *args, **kwargs)
    rt.after_chunk(req)
    return result


def run_eviction_round(vt: SchedulerProcess, scheduler, running_batch=None, last_batch=None, *args, **kwargs) -> None:
    """BEFORE ``Scheduler.get_next_batch_to_run``: the eviction round (``VTokenRuntime.after_decode``) of the
    decode step that ran last, after its forward and before the next batch is admitted and prepared; the same point
    with and without SGLang's overlap scheduler. Without overlap, that step's results are processed by now. With
    overlap they are not (they are processed after the next forward is launched), so requests whose queued result
    ends them by length are left alone, as the results would have finished them; a request that ends on a stop
    token is only known to have ended after this round (its extra victims change nothing it outputs). The round
    reads only the Token Table, the batch's rows and lengths, and the tree locks, none of which a pending result
    changes. Then admission, shut by a refusal, reopens if the round made room for the refused request
    (``admission.reopen_after_round``)."""
    rt = vt.runtime
    if rt is None or last_batch is None or not last_batch.forward_mode.is_decode() or last_batch.is_empty():
        return None
    closed = running_batch is not None and admission.closed_on_refusal(rt, scheduler, running_batch)
    room = _room(scheduler, rt) if closed else 0  # read only when it could reopen admission
    rt.after_decode(last_batch, [scheduler.chunked_req] if scheduler.chunked_req is not None else [])
    if closed:
        admission.reopen_after_round(rt, scheduler, running_batch, freed=_room(scheduler, rt) > room)
    return None


def _room(scheduler, rt) -> int:
    """Tokens admission may take: free in the allocator, and held by tree nodes nobody locks (a prefix copy turns
    a prompt's locked tree pages into such nodes without freeing any)."""
    return rt.allocator.available_size() + scheduler.tree_cache.evictable_size()


def recheck_after_prefill(vt: SchedulerProcess, result, scheduler, batch, *args, **kwargs) -> None:
    """AFTER ``Scheduler.process_batch_result``: after a batch that is not a decode step (a prefill, mixed or
    prebuilt batch: its requests join the decode batch), the next eviction round checks every row; after a prefill
    scored with a window (snapkv), rank the prompts (its window waited for its results, which the overlap scheduler
    processes after the next forward)."""
    rt = vt.runtime
    if rt is None or batch is None or batch.forward_mode.is_decode():
        return
    rt.rows.recheck()
    if rt.scores is not None and batch.forward_mode.is_extend():
        rt.scores.observe_prefill(batch)
