"""Hooks on SGLang's admission and retraction: reservations and checks capped by eviction budgets (``admission``),
admission reopened by a round that made room, the radix cache's match leaving a prefill-scored prompt its window,
and reclaim before retracting."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vtoken_sglang.integration.hooks import sessions
from vtoken_sglang.integration.parts.request_lengths import RequestLengths
from vtoken_sglang.integration.process import SchedulerProcess

if TYPE_CHECKING:
    from vtoken_sglang.integration.runtime import VTokenRuntime


def cap_running_reservation(vt: SchedulerProcess, original, adder, req):
    """AROUND ``PrefillAdder._get_running_request_total_token_offset``: a running request's future KV is capped
    by its eviction budget."""
    upstream = original(adder, req)
    rt = vt.runtime
    if rt is None or rt.policy is None:
        return upstream
    return min(upstream, int(rt.admission.running_kv(RequestLengths.of([req]))[0]))


def cap_new_reservation(
    vt: SchedulerProcess, original, adder, prefix_len, extend_input_len, max_new_tokens, *args, **kwargs
):
    """AROUND ``PrefillAdder._update_prefill_budget``: a new request reserves for decode only what its eviction
    budget lets it keep beyond the prompt, and a prompt its first round trims reserves, beyond the pass's prefill,
    only what it keeps at its end (``Admission.new_request_kv``: negative then); a streaming session's turn, what it
    keeps beyond what its session's record holds (``Admission.turn_kv``)."""
    rt = vt.runtime
    if rt is not None and rt.policy is not None and max_new_tokens > 0:
        adm, prompt = rt.admission, prefix_len + extend_input_len
        if adm.turn is not None:  # a streaming session's turn (``admit_by_budget``)
            max_new_tokens = adm.turn_kv(*adm.turn, prompt, max_new_tokens, extend_input_len)
        else:
            max_new_tokens = adm.new_request_kv(prompt, max_new_tokens, extend_input_len)
    return original(adder, prefix_len, extend_input_len, max_new_tokens, *args, **kwargs)


def check_new_by_budget(
    vt: SchedulerProcess, original, adder, req, *args, total_tokens: int, extend_input_len: int, **kwargs
):
    """AROUND ``PrefillAdder._check_prefill_budget``: upstream checks a new request's fit with its whole remaining
    length (``total_tokens`` counts it), where ``cap_new_reservation`` charges only what its eviction budget lets
    it keep (a prompt its first round trims: what it keeps at its end); the check asks for that same amount. Then,
    where the request's prefill is transient (``Admission.trims_prompt``) or a prefix copy is pending (its own or
    that of a running or admitted request not evicted from yet, or whose copy waits: ``Admission.copy_room``,
    ``copy_pending``), the room
    free now must hold its prefill and the largest pending copy (``Admission.fits_now``), which is checked, not
    charged; a request that would run alone is checked without copies (a copy it has no room for leaves it holding
    its prompt, as Naive-Evict holds it). A refusal is recorded (``Admission.refused``) for
    ``reopen_after_round``."""
    rt = vt.runtime
    if rt is None or rt.policy is None:
        return original(adder, req, *args, total_tokens=total_tokens, extend_input_len=extend_input_len, **kwargs)
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    adm = rt.admission
    prompt = len(req.full_untruncated_fill_ids)
    max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
    if adm.turn is not None:  # a streaming session's turn: its record holds the rest; sessions never copy
        transient = max_new > 0 and adm.turn_trims(*adm.turn, prompt, max_new, extend_input_len)
        charge = adm.turn_kv(*adm.turn, prompt, max_new, extend_input_len)
        own_copy = 0
    else:
        transient = max_new > 0 and adm.trims_prompt(prompt, max_new, prompt - extend_input_len)
        charge = adm.new_request_kv(prompt, max_new, extend_input_len)
        own_copy = adm.new_copy_room(prompt, req.prefix_len, req.sampling_params.max_new_tokens)
    if max_new > 0:
        total_tokens -= max_new - charge
    others = [*adder.running_batch.reqs, *adder.can_run_list]
    copy = max(own_copy, adm.running_copy_room(copy_pending(rt, others))) if others else 0  # alone: as upstream
    fits, chunk_limit = original(
        adder, req, *args, total_tokens=total_tokens, extend_input_len=extend_input_len, **kwargs
    )
    room_now = int(adder.cur_rem_tokens)
    running = len(adder.running_batch.reqs)  # those admitted in this pass have their page charged by upstream
    peak = adm.prefill_peak(prompt, prompt - extend_input_len)  # a prompt evicted between chunks: not all of it
    if fits and (copy or transient) and not adm.fits_now(room_now, peak, copy, running):
        fits, chunk_limit = False, None
    if not fits:
        adm.refused(total_tokens, own_copy, peak, transient)
    return fits, chunk_limit


def closed_on_refusal(rt: VTokenRuntime, scheduler, running_batch) -> bool:
    """Whether SGLang's admission is shut by a refusal vToken recorded (``batch_is_full``) while requests wait:
    the only state in which a round's room is worth reading (``reopen_after_round``)."""
    return bool(running_batch.batch_is_full and scheduler.waiting_queue and rt.admission.refused_need is not None)


def reopen_after_round(rt: VTokenRuntime, scheduler, running_batch, freed: bool) -> None:
    """After an eviction round, admission being ``closed_on_refusal``: SGLang keeps it shut until a request
    leaves; a round that made room (free or evictable tokens grew) reopens it when the room admission would now
    see (its own prefill budget: free and evictable tokens, less what the running requests reserve) fits the
    refused request, and the room free now its transient prefill and the largest pending prefix copy
    (``Admission.reopens``)."""
    if not freed:
        return
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    budget = scheduler.token_to_kv_pool_allocator.create_prefill_budget(
        scheduler.tree_cache,
        num_mixed_decode_tokens=running_batch.batch_size() if scheduler.is_mixed_chunk else 0,
    )
    reserved = rt.admission.running_reservation(
        running_batch.reqs, scheduler.new_token_ratio_tracker.current, CLIP_MAX_NEW_TOKENS
    )
    running_copy = rt.admission.running_copy_room(copy_pending(rt, running_batch.reqs))
    room_now = int(budget.remaining_current)
    if rt.admission.reopens(int(budget.remaining_total) - reserved, room_now, running_copy, len(running_batch.reqs)):
        running_batch.batch_is_full = False


def copy_pending(rt: VTokenRuntime, reqs: list) -> list:
    """The requests of ``reqs`` whose prefix copy may still come: not evicted from yet (admitted, or running before
    their first eviction: a copy is tried at a request's first eviction round), or whose gainful copy the last
    check left for later for lack of room (``PrefixCow.waiting``): admission leaves room for it, or the request
    holds its whole prompt to its end. A copy that does not pay at the first round (streaming keeps a prompt's
    tail, which leaves the tree's pages no emptier) is left to later checks, with no room held for it."""
    compacted = rt.rows.host_compacted
    waiting = rt.cow.waiting if rt.cow is not None else ()
    return [
        r
        for r in reqs
        if session_turn(r) is None
        and (r.kv.req_pool_idx is None or not compacted[r.kv.req_pool_idx] or r.kv.req_pool_idx in waiting)
    ]


def session_turn(req) -> tuple[int, int] | None:
    """``(held, protected)`` of a streaming session's turn running on its session's record (lent at its match: its
    live length, and its tokens in the tree pages of the session's first prompt), else None. Such a turn never
    copies its prefix (the session holds its tree lock)."""
    session = getattr(req, "session", None)
    if session is None or not session.streaming or not req.kv.holds_kv:
        return None
    return req.kv.kv_committed_len, req.kv.cache_protected_len


def admit_by_budget(vt: SchedulerProcess, original, adder, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req``: a streaming session's turn is named for its charge while it is admitted
    (``Admission.turn``: ``cap_new_reservation`` is not given the request). And with the radix cache off, upstream
    admits an ``ignore_eos`` request
    through ``add_one_req_ignore_eos``, whose check has every request grow by its whole remaining length and never
    asks ``_get_running_request_total_token_offset``. Where eviction budgets do give memory back, such a request
    takes upstream's general path instead, the one it takes with the radix cache on: running requests reserve
    their capped future KV (``cap_running_reservation``), the new one its capped budget (``cap_new_reservation``).
    ``ignore_eos`` is hidden for this call only: on the general path upstream reads the flag of running requests
    (their offsets), never that of the request being admitted."""
    sp = req.sampling_params
    rt = vt.runtime
    if rt is None:
        return original(adder, req, *args, **kwargs)
    rt.admission.turn = session_turn(req)
    hide = sp.ignore_eos and rt.admission.capped
    sp.ignore_eos = sp.ignore_eos and not hide
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        sp.ignore_eos = sp.ignore_eos or hide
        rt.admission.turn = None


def reclaim_before_retract(vt: SchedulerProcess, original, batch, *args, **kwargs):
    """AROUND ``ScheduleBatch.check_decode_mem``: before SGLang retracts, reclaim (regardless of theta)."""
    ok = original(batch, *args, **kwargs)
    rt = vt.runtime
    if ok or rt is None or rt.reclaim_under_pressure() == 0:
        return ok
    return original(batch, *args, **kwargs)


def leave_scored_window_to_extend(vt: SchedulerProcess, original, req, input_len):
    """AROUND ``Req._compute_max_prefix_len`` (policies scored at prefill): a prompt is scored by the attention of
    its last ``--vtoken-window`` queries, which only its own prefill computes (a cached prefix has no queries). The
    radix cache's match leaves at least those tokens to extend, so a request scores the same window whether it ran
    alone or another request had cached the rest of its prompt. Not a streaming session's turn: its session's row
    holds the conversation compacted, which cannot be prefilled again; the turn is scored by its own queries."""
    limit = original(req, input_len)
    scorer = vt.scorer
    session = getattr(req, "session", None)
    if scorer is None or scorer.prefill_window <= 0 or (session is not None and session.streaming):
        return limit
    return max(min(limit, input_len - scorer.prefill_window), 0)


def cap_chunk_by_room(vt: SchedulerProcess, original, adder, req):
    """AROUND ``PrefillAdder.add_chunked_req``: upstream runs a continuation chunk whatever memory is left (a whole
    chunk when its admission room is spent: "must make progress"), which fails with "Prefill out of memory" when
    the pool cannot give it. A prompt evicted between its chunks gives memory back after each one, so its next chunk
    is capped by the room free now (less its tail page's), in whole pages, and waits (upstream's path for a chunk
    that does not run this pass) while not even a page is free: decode steps go on meanwhile and free room."""
    rt = vt.runtime
    limit = adder.rem_chunk_tokens
    if rt is None or rt.prefill is None or limit is None or not rt.rows.is_managed(req.kv.req_pool_idx):
        return original(adder, req)
    P = rt.page_size
    cap = (int(adder.cur_rem_tokens) - P) // P * P
    if cap <= 0:
        return req
    adder.rem_chunk_tokens = min(limit, cap)
    try:
        return original(adder, req)
    finally:
        adder.rem_chunk_tokens += limit - min(limit, cap)


def context_bounds_prompts(vt: SchedulerProcess, result, worker, *args, **kwargs):
    """AFTER ``TpModelWorker.get_worker_info`` (``--vtoken-prefill-eviction`` or streaming sessions): upstream
    bounds a prompt (and a request's length) by the KV pool as well as by the context; a prompt evicted between its
    prefill chunks holds only its budget and a chunk, a session's turn its session's budget and its new tokens, so
    the scheduler's bounds become the context's, and the pool bound is vToken's check of what each prompt will hold
    (``refuse_prompt_over_pool``)."""
    from vtoken_sglang.integration.startup import options

    server_args = worker.server_args
    if not (options.current_config(server_args).vtoken_prefill_eviction or server_args.enable_streaming_session):
        return result
    info = list(result)
    info[4] = worker.model_config.context_len - 1  # max_req_len
    info[5] = info[4] - (result[4] - result[5])  # max_req_input_len, upstream's margin below it
    return tuple(info)


def refuse_prompt_over_pool(vt: SchedulerProcess, original, req, max_req_input_len, *args, **kwargs):
    """AROUND ``managers.utils.validate_input_length``: a prompt longer than the KV pool (upstream's bound, lifted
    by ``context_bounds_prompts``) is served when it is evicted between its prefill chunks and what it holds at its
    peak (its prompt's budget and a chunk, or at its end) fits the pool, and a streaming session's turn when what
    it holds does (``sessions.refuse_turn_over_pool``); otherwise upstream's check with upstream's bound. One error
    line names the bound it fails."""
    from vtoken_sglang.integration.parts.prefill_eviction import plain_text

    rt = vt.runtime
    if rt is None or (rt.prefill is None and vt.sessions is None):  # the bounds are upstream's
        return original(req, max_req_input_len, *args, **kwargs)
    n = len(req.origin_input_ids)
    kv = sessions.lent_record(vt.sessions, req)
    if kv is not None and n < max_req_input_len:
        return sessions.refuse_turn_over_pool(rt, req, kv)
    pool = rt.pool.num_pages * rt.page_size
    pool_bound = min(max_req_input_len, pool - 6)  # upstream's (``get_worker_info``)
    adm = rt.admission
    if n < pool_bound or n >= max_req_input_len or not (plain_text(req) and adm.evicts_in_prefill(n)):
        return original(req, max_req_input_len if n >= max_req_input_len else pool_bound, *args, **kwargs)
    final = n + max(req.sampling_params.max_new_tokens or 0, 0)
    need = max(adm.prefill_peak(n), adm.kept_at_end_of(final)) + rt.page_size
    if need > pool:
        return (
            f"Input length ({n} tokens) evicted between prefill chunks still holds {need} tokens of KV at its peak "
            f"(its budget, a prefill chunk and a page), more than the KV pool's {pool}: lower --vtoken-budget or "
            f"--chunked-prefill-size, or raise --max-total-tokens."
        )
    return None


def keep_new_tokens_by_budget(vt: SchedulerProcess, original, allocator, input_tokens, max_new_tokens, *a, **kw):
    """AROUND ``BaseTokenToKVPoolAllocator.max_new_tokens_for_memory``: upstream clips a request's new tokens to what
    an empty pool holds after its whole prompt (none for a prompt longer than the pool); a prompt evicted between
    its chunks holds only its budget, and a streaming session's turn (``vt.turn_at_door``) its session's, which the
    door checks (``refuse_prompt_over_pool``): their new tokens are not clipped by the pool."""
    rt = vt.runtime
    if rt is None or allocator is not rt.allocator:
        return original(allocator, input_tokens, max_new_tokens, *a, **kw)
    if vt.turn_at_door is None and not rt.admission.evicts_in_prefill(input_tokens):
        return original(allocator, input_tokens, max_new_tokens, *a, **kw)
    return max_new_tokens
