"""vToken inside one SGLang scheduler process: the core's Token Table over SGLang's ``req_to_token``, its page
accounting over SGLang's allocator, the policy and the reclaimer; and the operations the hooks call.

Which rows vToken manages: a request becomes *managed* the first time it exceeds its budget during decode. Until
then its row is exactly upstream's (dense, insertable in the radix tree). From then on:
- its row ``req_to_token[r, 0:seq_len]`` holds only live tokens, in logical order; ``seq_len`` = live count;
- ``req.skip_radix_cache_insert`` is set (its row no longer matches its token ids);
- tokens of its tree-owned prefix (logical positions below ``cache_protected_len``) are eviction candidates like any
  other, but evicting one only drops it from the request's view: its slot is the tree's, never moved or freed here,
  and its page stays allocated while the request locks the node. Copy-on-write (``prefix_cow``) copies the live
  ones into private pages and moves the lock up the tree, when that frees pages;
- its private pages are tracked in ``SglangPagePool`` (owner = row, live counts);
- positions come from the Token Table (``logical_len``), its next slot from the tail-page rule, and its pages are
  released by vToken (SGLang's segment free assumes dense rows).
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch

from vtoken_sglang.config import VTokenConfig
from vtoken_sglang.core.copy_engine import make_copy_engine
from vtoken_sglang.core.pages import FREE, OutOfPages, PagePool
from vtoken_sglang.core.reclaimer import Reclaimer
from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.integration.hook_timer import TIMER
from vtoken_sglang.policies import PolicyConfig, make_policy
from vtoken_sglang.policies.random import mix_hash
from vtoken_sglang.scoring import ScoreCollector

COW_EVERY = 4  # eviction rounds between copy-on-write checks (each walks the tree paths of the managed requests)


def request_key(req) -> int:
    """A request's identity for policies: a hash of its prompt token ids. The same on every TP rank, in every run,
    with reclaim on or off, and whatever row the request gets (rids are random; rows depend on timing)."""
    return zlib.crc32(np.asarray(req.origin_input_ids, dtype=np.int64).tobytes())


class SglangPagePool(PagePool):
    """Owners and live counts of the pages vToken tracks; the free list stays SGLang's allocator's.

    Untracked pages (free, tree-owned, or of unmanaged requests) have owner ``FREE`` here."""

    def __init__(self, allocator, reserve: int, device: torch.device):
        super().__init__(allocator.size // allocator.page_size, allocator.page_size, reserve=reserve, device=device)
        self._free = torch.empty(0, dtype=torch.int64, device=self.device)
        self.allocator = allocator

    def num_free(self, for_relocation: bool = False) -> int:
        pages = self.allocator.available_size() // self.page_size
        return pages if for_relocation else max(0, pages - self.reserve)

    def alloc(self, n: int, owner, for_relocation: bool = False) -> torch.Tensor:
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if n > self.num_free(for_relocation):
            raise OutOfPages(f"need {n} pages, {self.num_free(for_relocation)} available")
        slots = self.allocator.alloc(n * self.page_size)
        if slots is None:
            raise OutOfPages(f"SGLang's allocator refused {n} pages")
        pages = (slots[:: self.page_size] // self.page_size).to(self.device, torch.int64)
        self.owner[pages] = owner.to(self.device, torch.int32) if isinstance(owner, torch.Tensor) else owner
        return pages

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        pages = pages.to(self.device, torch.int64)
        assert bool((self.owner[pages] >= 0).all()), "freeing an untracked page"
        assert bool((self.live[pages] == 0).all()) and not bool(self.in_flight[pages].any())
        self.owner[pages] = FREE
        self.allocator.free_page_ids(pages.to(self.allocator.device))

    def disown(self, pages: torch.Tensor) -> None:
        """Stop tracking empty pages that SGLang itself will free."""
        pages = pages.to(self.device, torch.int64)
        assert bool((self.owner[pages] >= 0).all()) and bool((self.live[pages] == 0).all()) and not bool(self.in_flight[pages].any())
        self.owner[pages] = FREE

    def used_pages(self) -> int:
        return int((self.owner >= 0).sum())


class VTokenRuntime:
    def __init__(self, cfg: VTokenConfig, req_to_token_pool, allocator, kv_pool):
        self.cfg = cfg
        self.allocator = allocator
        self.req_to_token = req_to_token_pool.req_to_token
        dev = self.req_to_token.device
        self.page_size = allocator.page_size
        self.policy = make_policy(cfg.vtoken_policy, PolicyConfig(
            budget=cfg.vtoken_budget, budget_ratio=cfg.vtoken_budget_ratio, sinks=cfg.vtoken_sinks,
            recent=cfg.vtoken_recent, slack=max(self.page_size, 16), seed=cfg.vtoken_seed, history=cfg.vtoken_history,
            window=cfg.vtoken_window, pool_kernel=cfg.vtoken_pool,
        )) if cfg.vtoken_policy != "none" else None
        self.pool = SglangPagePool(allocator, reserve=0, device=dev)
        rows, width = self.req_to_token.shape
        self.table = TokenTable(rows, width, self.pool, slots=self.req_to_token,
                                state_names=self.policy.state_names if self.policy else ())
        buffers = list(kv_pool.k_buffer) + list(kv_pool.v_buffer)
        # Sources are free at once: without overlap no forward is in flight when plans are applied; with it, copies
        # wait for the forward in flight (the engine's producer stream) and the next forward waits for the copies.
        self.reclaimer = Reclaimer(self.table, make_copy_engine(buffers), theta=cfg.vtoken_theta,
                                   grace_steps=0, enabled=cfg.vtoken_reclaim)
        self.offset = torch.zeros(rows, dtype=torch.int64, device=dev)  # logical_len - live_len per row
        self.tokens_evicted = 0
        self.requests_managed = 0
        self.n_managed = 0  # rows managed now (== table.active.sum()); 0 lets every hook take upstream's path
        self.rounds = 0  # decode steps with an eviction round
        self.decode_steps = 0  # decode steps seen (the denominator of per-step costs)
        self.peak_pool_pages = 0  # SGLang's whole KV pool, sampled after each eviction round
        self.peak_tracked_pages = 0  # pages of managed requests
        self.peak_held_pages = 0  # SGLang's pool less the tree's evictable pages (radix cache on)
        self.reclaim_on_pressure = 0  # reclaims forced by a decode step that would not fit
        self.digest = {"victims": 0, "plans": 0}
        self.logged_rounds = 0
        self.position_checks = 0  # debug check of decode positions (VTOKEN_SGLANG_CHECK_POSITIONS=1)
        self.position_mismatches = 0
        self.pending_results = lambda: ()  # the overlap scheduler's queued (batch, result) pairs (scheduler hook)
        self.prompt_in_tree = True  # the radix cache takes each prompt's whole pages after prefill (scheduler hook)
        self.exporter = None  # metrics_export.PrometheusExporter, created on the first report when metrics are on
        # Score-based policies: queries saved by the attention hook, turned into scores after each scored step.
        self.kv_pool = kv_pool
        snapkv = cfg.vtoken_policy == "snapkv"
        self.scorer = (ScoreCollector(len(kv_pool.k_buffer), cfg.vtoken_score_layers, cfg.vtoken_score_every,
                                      decode=not snapkv, prefill_window=cfg.vtoken_window if snapkv else 0)
                       if self.policy is not None and self.policy.needs_scores else None)
        self.scoring_ms = 0.0  # time spent turning saved queries into scores (decode steps and prefill windows)
        self.prefill_complete: list[bool] = []  # per request of the last prefill forward: its prompt is all in
        self.tp_size = 1
        self.tree = None  # SGLang's radix cache when it is on (set by the scheduler hook)
        self.cow = None  # prefix_cow.PrefixCow, set by the scheduler hook when the radix cache is on and cow is wanted
        self.worker_link = None  # worker_link.WorkerLink with --vtoken-planner worker (set by the scheduler hook)
        self.tp_all_reduce = None  # set by the scheduler hook: in-place sum over the TP group
        # debug: (token ids seen, scores) per scored step of the batch's first request (snapkv: per prefill)
        self.score_dump = None

    # ------------------------------------------------------------------ requests

    def is_managed(self, row: int) -> bool:
        return self.n_managed > 0 and bool(self.table.active[row])

    def _manage(self, reqs: list) -> None:
        """Start tracking requests whose rows are still dense (upstream's)."""
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64, device=self.table.slots.device)
        lens = torch.tensor([r.kv.kv_committed_len for r in reqs], dtype=torch.int64, device=rows.device)
        keys = torch.tensor([request_key(r) for r in reqs], dtype=torch.int64, device=rows.device)
        self.table.open_rows(rows, keys)
        protected = torch.tensor([r.kv.cache_protected_len for r in reqs], dtype=torch.int64, device=rows.device)
        # register the whole row; only the request's own pages (past the tree prefix) are claimed and counted
        self.table.sync_new_tokens(rows, protected)
        self.table.sync_new_tokens(rows, lens - protected, claim_pages=True)
        for r in reqs:
            r.skip_radix_cache_insert = True
        self.requests_managed += len(reqs)
        self.n_managed += len(reqs)

    def release(self, req) -> None:
        """Before SGLang releases a managed request: free its private pages here and leave SGLang nothing of the
        row to free past the tree prefix (its segment free assumes a dense row). Without a tree prefix (radix cache
        off, or a prompt shorter than a page) SGLang asserts that a row it still holds is not empty: it gets one
        page of the request to free itself, as a one-slot row."""
        row = req.kv.req_pool_idx
        pages = self.table.close_row(row)
        self.n_managed -= 1
        self.offset[row] = 0
        keep = req.kv.cache_protected_len
        if keep == 0 and pages.numel():
            handed, pages = pages[:1], pages[1:]
            self.pool.disown(handed)
            self.req_to_token[row, 0] = (handed[0] * self.page_size).to(self.req_to_token.dtype)
            keep = 1
        self.pool.free(pages)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = keep

    # ------------------------------------------------------------------ per step

    def after_decode_alloc(self, batch) -> None:
        """``prepare_for_decode`` wrote one new slot per request at column ``seq_len``: register it."""
        if self.n_managed == 0:
            return
        rows = batch.req_pool_indices.to(torch.int64)
        managed = self.table.active[rows]
        n = int(managed.sum())
        if n:  # with eviction on, usually every row: no boolean indexing then
            self.table.sync_decode_tokens(rows if n == rows.numel() else rows[managed])

    def evict(self, batch, lock_holders: list = (), ending: set = frozenset()) -> None:
        """After a decode step: trim requests over budget (plus slack), then reclaim. Updates the batch.
        ``lock_holders``: requests outside the batch that may hold a radix-tree lock (the one being chunked).
        ``ending``: ids of requests whose not yet processed result ends them (overlap scheduler); left alone."""
        self.decode_steps += 1
        if self.policy is None:
            return
        link = self.worker_link
        if link is not None:  # a worker's plan: applied before this step's evictions change its source pages
            for plan in self.reclaimer.step(link.next_plan):
                self._fold(plan.src_pages, plan.src_live.to(torch.int64), "plans")
        try:
            self._evict(batch, lock_holders, ending)
        finally:
            if link is not None:
                link.after_step()  # snapshot the state after this step's evictions

    def _evict(self, batch, lock_holders: list = (), ending: set = frozenset()) -> None:
        # Vectorized over the batch: which running requests exceed budget + slack (by logical length).
        rows = batch.req_pool_indices.to(torch.int64)
        live = batch.seq_lens.to(torch.int64)
        running = torch.tensor([not r.finished() and id(r) not in ending for r in batch.reqs], dtype=torch.bool,
                               device=rows.device)
        if self.scorer is not None:
            self._observe_scores(batch, rows, live, running)
        logical = torch.where(self.table.active[rows], self.table.logical_len[rows], live)
        over_mask = running & (live > self.policy.budget(logical) + self.policy.cfg.slack)
        if not bool(over_mask.any()):
            return
        over = [batch.reqs[i] for i in torch.nonzero(over_mask).flatten().tolist()]
        new = [r for r in over if not self.is_managed(r.kv.req_pool_idx)]
        if new:
            self._manage(new)
        rows = torch.tensor([r.kv.req_pool_idx for r in over], dtype=torch.int64, device=self.table.slots.device)
        vr, vc = self.policy.select_victims(self.table, rows)
        if vr.numel():
            self._fold(self.table.row_key[vr], self.table.logical[vr, vc].to(torch.int64), "victims")
            self.pool.free(self.table.evict(vr, vc))
            self.tokens_evicted += int(vr.numel())
        if self.cow is not None and self.rounds % COW_EVERY == 0:
            # requests ending now are no candidates, but lock their paths until their results land
            staying = [r for r in batch.reqs if id(r) not in ending]
            going = [r for r in batch.reqs if id(r) in ending]
            self.cow.step(staying, [*lock_holders, *going])
        if self.worker_link is None:
            for plan in self.reclaimer.step():
                self._fold(plan.src_pages, plan.src_live.to(torch.int64), "plans")
        self._publish_lengths(batch)
        self.rounds += 1
        used = self.pool.num_pages - self.allocator.available_size() // self.page_size
        self.peak_pool_pages = max(self.peak_pool_pages, used)
        if self.tree is not None:  # pages the tree could give back on demand are not held by anyone
            held = used - self.tree.evictable_size() // self.page_size
            self.peak_held_pages = max(self.peak_held_pages, held)
        self.peak_tracked_pages = max(self.peak_tracked_pages, self.pool.used_pages())

    def after_prefill(self, batch) -> None:
        """After a prefill forward scored with a window (snapkv): each request whose prompt is now complete (not a
        middle chunk, not finished) is managed from here on, and its window's attention over the prompt goes
        into the policy's state. Its victims are taken at its first decode step, like every eviction."""
        if self.scorer is None or self.scorer.prefill_window == 0 or not self.scorer.window_segments:
            return
        t0 = time.perf_counter()
        rows = batch.req_pool_indices.to(torch.int64).tolist()
        lengths = [pos + w for _, w, pos in self.scorer.window_segments]
        slots = [self.req_to_token[r, :n].to(torch.int64) for r, n in zip(rows, lengths)]
        scores = self.scorer.window_scores(self.kv_pool.get_key_buffer, slots, self.tp_all_reduce, self.tp_size)
        self.scoring_ms += (time.perf_counter() - t0) * 1e3
        if scores is None:
            return
        keep = [i for i, (req, complete) in enumerate(zip(batch.reqs, self.prefill_complete))
                if complete and not req.finished() and not self.is_managed(rows[i]) and req.kv.kv_committed_len == lengths[i]]
        if not keep:
            return
        self._manage([batch.reqs[i] for i in keep])
        if self.score_dump is not None:
            self.score_dump.append((list(batch.reqs[keep[0]].origin_input_ids), scores[keep[0]].cpu()))
        block = torch.nn.utils.rnn.pad_sequence([scores[i] for i in keep], batch_first=True)
        self.policy.observe(self.table, torch.tensor([rows[i] for i in keep], dtype=torch.int64, device=block.device),
                            block, prefill=True)

    def _observe_scores(self, batch, rows: torch.Tensor, live: torch.Tensor, running: torch.Tensor) -> None:
        """After a scored decode step: every running request's attention over its live keys goes into the policy's
        row-aligned state. Score policies manage a request from its first decode step (its state must exist before
        it first exceeds its budget)."""
        t0 = time.perf_counter()
        slots = self.req_to_token[rows, : int(live.max())].to(torch.int64)
        attn = self.scorer.scores(self.kv_pool.get_key_buffer, slots, live, self.tp_all_reduce, self.tp_size)
        self.scoring_ms += (time.perf_counter() - t0) * 1e3
        if attn is None:
            return
        new = [r for r, run in zip(batch.reqs, running.tolist()) if run and not self.is_managed(r.kv.req_pool_idx)]
        if new:
            self._manage(new)
        if self.score_dump is not None and bool(running[0]):
            req = batch.reqs[0]
            seen = (list(req.origin_input_ids) + list(req.output_ids))[: int(self.table.logical_len[rows[0]])]
            self.score_dump.append((seen, attn[0, : int(live[0])].cpu()))
        if bool(running.any()):
            self.policy.observe(self.table, rows[running], attn[running])

    def _fold(self, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """Order-independent digest of decisions (victims, plans), compared across TP ranks by the tests."""
        h = int(mix_hash(17, a.to(torch.int64).cpu()[None, :], b.to(torch.int64).cpu()[None, :]).sum()) % (1 << 61)
        self.digest[name] = (self.digest[name] + h) % (1 << 61)

    def _publish_lengths(self, batch) -> None:
        """Write the Token Table's live lengths back into the batch and the requests (the rows already are)."""
        rows = batch.req_pool_indices.to(torch.int64)
        managed = self.table.active[rows]
        if not bool(managed.any()):
            return
        table_live = self.table.live_len[rows]
        live = torch.where(managed, table_live, batch.seq_lens.to(torch.int64))
        # rows are distinct; torch.where, not boolean indexing (a parallel region per call on shared cores)
        self.offset[rows] = torch.where(managed, self.table.logical_len[rows] - table_live, self.offset[rows])
        batch.seq_lens = live.to(batch.seq_lens.dtype)
        batch.seq_lens_cpu = live.cpu().to(batch.seq_lens_cpu.dtype)
        batch.orig_seq_lens = live.to(batch.orig_seq_lens.dtype)
        batch.seq_lens_sum = None
        for req, n, m in zip(batch.reqs, live.tolist(), managed.tolist()):
            if m:
                req.kv.kv_committed_len = req.kv.kv_allocated_len = n

    # ------------------------------------------------------------------ admission

    @property
    def admission_capped(self) -> bool:
        """Whether admission reserves by eviction budget (``future_kv``): evicted tokens really give their memory
        back, with reclaim on, or (Naive-Evict) with a policy whose victims empty whole pages."""
        return self.policy is not None and (self.reclaimer.enabled or self.policy.frees_whole_pages)

    def future_kv(self, current_len: int, logical_now: int, remaining_new: int, protected: int = 0) -> int:
        """Most KV tokens a request holding ``current_len`` (``protected`` of them in its tree prefix's pages) can
        still add before it ends, given its eviction budget: its view ends at most at
        ``keep = max(budget(final), recent) + slack [+ page]`` tokens, so ``min(remaining_new, keep - held)``, at
        least 0, where ``held`` is what the request already holds toward that:
        - with copy-on-write, its whole view (``current_len``): the prefix tokens it keeps end up in private pages,
          and the tree's pages they came from become evictable (SGLang counts those as available);
        - without, only its private tokens (``current_len - protected``): the prefix pages stay locked to the end,
          so evicting prefix tokens frees nothing and their room in the budget goes to private tokens.
        Expected case, like upstream's admission: the tail page and what compaction leaves (F <= theta) are covered
        by reclaiming before retracting; ``+ page`` for Naive-Evict, whose oldest page in the window stays partly
        dead.

        Only where evicted tokens really give their memory back: with reclaim on, or (Naive-Evict) with a policy
        whose victims empty whole pages. Naive-Evict with scattered victims keeps almost every page, so it
        reserves the full remaining length, as upstream does."""
        if not self.admission_capped:
            return remaining_new
        final = torch.tensor([logical_now + max(remaining_new, 0)])
        keep = max(int(self.policy.budget(final)[0]), max(self.policy.cfg.recent, 1))
        keep += self.policy.cfg.slack + (0 if self.reclaimer.enabled else self.page_size)
        held = current_len if self.cow is not None and self.cow.allow_copies else max(current_len - protected, 0)
        return max(0, min(remaining_new, keep - held))

    def reclaim_now(self) -> int:
        """Reclaim regardless of theta (memory is short): returns the pages freed."""
        if not self.reclaimer.enabled:
            return 0
        before = self.reclaimer.stats.pages_reclaimed
        for _ in range(8):
            plan = self.reclaimer.plan()
            if plan.is_empty() or not self.reclaimer.apply(plan):
                break
            self.reclaimer.release_ready()
        self.reclaim_on_pressure += 1
        return self.reclaimer.stats.pages_reclaimed - before

    # ------------------------------------------------------------------ allocation and positions

    def next_slots(self, last_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tail-page rule for one new token per request: ``last + 1`` while the page has room, else a new
        page. Returns (needs a new page, the slot when it does not)."""
        need = (last_loc + 1) % self.page_size == 0
        return need, last_loc + 1

    def decode_positions_offset(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return self.offset[req_pool_indices.to(torch.int64)]

    def metrics(self) -> dict:
        st = self.reclaimer.stats
        assert self.n_managed == int(self.table.active.sum()), "managed-row count out of step with the Token Table"
        return {
            "live_tokens": int(self.table.live_len[self.table.active].sum()),
            "allocated_pages": self.pool.used_pages(),
            "fragmentation": round(self.pool.fragmentation(), 4),
            "tokens_evicted": self.tokens_evicted,
            "decode_steps": self.decode_steps,
            "hook_ms": round(TIMER.ms, 3),
            "requests_managed": self.requests_managed,
            "resident_dead_tokens": int(self.pool.used_pages() * self.page_size - self.pool.live[self.pool.owner >= 0].sum()),
            "peak_pool_pages": self.peak_pool_pages,
            "peak_tracked_pages": self.peak_tracked_pages,
            "reclaim_on_pressure": self.reclaim_on_pressure,
            "digest_victims": self.digest["victims"],
            "digest_plans": self.digest["plans"],
            "position_checks": self.position_checks,
            "position_mismatches": self.position_mismatches,
            **({"scoring_ms": round(self.scoring_ms, 3), "steps_scored": self.scorer.steps_scored,
                "prefills_scored": self.scorer.prefills_scored} if self.scorer is not None else {}),
            **st.as_dict(),
            **(self.worker_link.metrics() if self.worker_link is not None else {}),
            **({"peak_held_pages": self.peak_held_pages} if self.tree is not None else {}),
            **(self.cow.metrics() if self.cow is not None else {}),
        }
