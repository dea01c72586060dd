"""The serving hooks: registered only in scheduler processes of a server started with ``--enable-vtoken``, each
named by the job it does and kept in a module by the part of SGLang it hooks (``scheduler``, ``allocation``,
``forward``, ``windows``, ``admission``, ``reporting``, ``sessions``). Every hook is given its process's slot as its
first argument when it is registered (``process.bind``) and reads its runtime there; every target is listed,
fingerprinted, in ``patches/manifest.json`` (a test holds the two to each other).

``HOOKS``: the whole table of scheduler-side hooks, target -> (hook type, function); ``SCORING_HOOKS``: the ones
registered only with a score-based policy (a Python call per attention layer per step is not free);
``PREFILL_SCORING_HOOKS``: only with a policy scored at prefill; ``PREFILL_EVICTION_HOOKS``: only with
``--vtoken-prefill-eviction`` (the bound of its continuation chunks).
"""

from __future__ import annotations

from vtoken_sglang.integration.hooks import admission, allocation, forward, reporting, scheduler, sessions, windows

_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_ATTN = "sglang.srt.layers.attention"
_REPORTER = "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter"
_SESSION = "sglang.srt.session.streaming_session.StreamingSession"
HOOKS = {
    f"{_SCHED}.__init__": ("AROUND", scheduler.build_runtime),
    "sglang.srt.layers.radix_attention.RadixAttention.__init__": ("AFTER", scheduler.refuse_unsupported_layer),
    f"{_SCHED}.get_next_batch_to_run": ("BEFORE", scheduler.run_eviction_round),
    f"{_SCHED}.process_batch_result": ("AFTER", scheduler.recheck_after_prefill),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode": (
        "AROUND",
        allocation.alloc_decode_slots,
    ),
    f"{_BATCH}.new_tokens_required_next_decode": ("AROUND", allocation.count_decode_pages),
    f"{_BATCH}.prepare_for_decode": ("AROUND", allocation.register_decode_slots),
    "sglang.srt.mem_cache.common.release_kv_cache": ("AROUND", allocation.release_request),
    f"{_SCHED}.stash_chunked_request": ("AROUND", scheduler.evict_between_chunks),
    "sglang.srt.mem_cache.allocation.alloc_for_extend": ("AROUND", allocation.extend_over_live_rows),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend": (
        "AROUND",
        allocation.alloc_extend_slots,
    ),
    f"{_BATCH}.prepare_for_extend": ("AFTER", allocation.live_extend_sum),
    f"{_FORWARD_BATCH}.init_new": ("AROUND", forward.begin_forward),
    f"{_FORWARD_BATCH}._compute_mrope_positions_decode": ("AROUND", forward.mrope_decode_positions),
    f"{_FORWARD_BATCH}._compute_mrope_positions_extend": ("AROUND", forward.mrope_extend_positions),
    f"{_ATTN}.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode": (
        "AROUND",
        windows.torch_native_decode_window,
    ),
    f"{_ATTN}.triton_backend.update_sliding_window_buffer": ("AROUND", windows.triton_decode_window),
    f"{_ATTN}.flashinfer_backend.FlashInferIndicesUpdaterDecode.call_begin_forward": (
        "AROUND",
        windows.flashinfer_decode_window,
    ),
    f"{_ADDER}._get_running_request_total_token_offset": ("AROUND", admission.cap_running_reservation),
    f"{_ADDER}._update_prefill_budget": ("AROUND", admission.cap_new_reservation),
    f"{_ADDER}._check_prefill_budget": ("AROUND", admission.check_new_by_budget),
    f"{_ADDER}.add_one_req": ("AROUND", admission.admit_by_budget),
    f"{_BATCH}.check_decode_mem": ("AROUND", admission.reclaim_before_retract),
    f"{_SCHED}.get_internal_state": ("AFTER", reporting.add_server_info),
    f"{_SCHED}.on_idle": ("AROUND", reporting.settle_at_idle),
    f"{_REPORTER}.report_decode_stats": ("AFTER", reporting.log_decode_metrics),
    f"{_SESSION}.try_match_prefix": ("AROUND", sessions.lend_parked_row),
    f"{_SESSION}.release_session": ("AROUND", sessions.release_parked_row),
    "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver.session_held_tokens": (
        "AROUND",
        sessions.count_parked_pages,
    ),
    f"{_SCHED}.flush_cache": ("AROUND", sessions.drop_parked_on_flush),
    f"{_SCHED}.init_req_max_new_tokens": ("AROUND", sessions.bound_turn_at_door),
    # the door: bounds by the context where a prompt or a turn holds less than its length (prefill eviction,
    # streaming sessions); upstream's otherwise
    "sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info": ("AFTER", admission.context_bounds_prompts),
    "sglang.srt.managers.utils.validate_input_length": ("AROUND", admission.refuse_prompt_over_pool),
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.max_new_tokens_for_memory": (
        "AROUND",
        admission.keep_new_tokens_by_budget,
    ),
}
PREFILL_EVICTION_HOOKS = {
    f"{_ADDER}.add_chunked_req": ("AROUND", admission.cap_chunk_by_room),
}
SCORING_HOOKS = {
    "sglang.srt.layers.radix_attention.RadixAttention.forward": ("AFTER", forward.keep_scored_query),
}
PREFILL_SCORING_HOOKS = {
    "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len": (
        "AROUND",
        admission.leave_scored_window_to_extend,
    ),
}
