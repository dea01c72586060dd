"""``VTokenRuntime``: vToken inside one SGLang scheduler process, and what it does after each decode step.

Built once per scheduler (``hooks.scheduler.build_runtime``), it owns one object per job:
- ``table`` (``core.token_table``) over SGLang's ``req_to_token``; ``pool`` (``page_bridge``): page accounting over
  SGLang's allocator; ``policy``; ``reclaimer`` (``core.reclaimer``) with its copy engine;
- ``rows`` (``request_rows``): which requests are managed, their lengths and positions toward SGLang;
- ``eviction`` (``eviction``): the round's victims, for the requests over budget + slack (with a policy);
- ``prefill`` (``prefill_eviction``): the round between two prefill chunks of a prompt (``after_chunk``);
- ``forward_layout`` (``core.row_layout``): the forward's rows, live and logical lengths and sliding windows, read by
  the forward's hooks (positions, M-RoPE, the backends' windows); built by ``hooks.forward.begin_forward``;
- ``scores`` (``score_link``): attention scores into the policy's state (score policies only);
- ``cow`` (``prefix_cow``): copy-on-write of radix-tree prefix pages (radix cache and ``--vtoken-cow`` on);
- ``plans`` (``plan_source``): the inline planner, or the compaction worker's plans;
- ``admission``: how much KV admission reserves under eviction budgets;
- ``stats``, ``integrity``: counters and digests; the integrity check in the running server.

The round, ``after_decode(batch)``, runs at the start of ``Scheduler.get_next_batch_to_run`` (after forward N,
before step N+1 is admitted and prepared; the same point with and without SGLang's overlap scheduler), over the
batch that just decoded, one call per step in the order they happen:

1. release what is due (``plans.begin_round``): relocation sources whose grace step has come are freed (after a
   wait on their copy's fence); a compaction worker's plan that arrived is applied;
2. fold scores (``scores.observe_decode``): a scored step's attention goes into the policy's state;
3. evict (``eviction.run``): requests over budget + slack become managed if they were not, and their victims are
   evicted (dropped from their rows in the Token Table; pages left without a live token are freed at once: that
   alone is Naive-Evict);
4. copy on write (``cow.step``) of tree-prefix pages: in a round that made some request managed (its first
   eviction, of its prompt's tokens: on a long-prompt, short-answer load the only round it may have), every
   ``COW_EVERY`` trimming rounds, and at the next one after a check that left a copy for lack of free pages;
5. reclaim (``plans.plan_now``): the inline planner plans and applies relocations (copy, then the rows are rewritten
   behind the copy engine's order; the sources are freed at a later round's step 1);
6. write lengths (``rows.write_lengths``): the trimmed requests' lengths, in the batch and the requests, from the
   Token Table (the others' are unchanged: a decode step adds one token to both their live and logical lengths);
7. watch: the peaks sampled, the integrity check every N-th round (``DebugSwitches.check_integrity``); at the end of
   every round, a snapshot for the worker at its cadence (``plans.end_step``) and the step's page accounting (free
   pages, pending pages, plans applied) folded into ``digest_accounting``, compared across TP ranks.
Steps 4-7 (but the last fold) run only in a round that evicted from some request. Requests whose queued result ends
them by length (the overlap scheduler's, ``_ending``) are left alone: the results would have finished them.

Hooks read it in the slot they are bound to (``process.SchedulerProcess``); ``hooks.scheduler`` builds it over a
scheduler; its metrics are ``observe.runtime_metrics``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Set

import numpy as np
import torch

from vtoken_sglang.config import VTokenConfig
from vtoken_sglang.core.copy_engine import make_copy_engine
from vtoken_sglang.core.reclaimer import Reclaimer
from vtoken_sglang.core.row_layout import RowLayout
from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.debug_switches import SWITCHES
from vtoken_sglang.integration.observe.host_reads import HOST_READS, host_array
from vtoken_sglang.integration.observe.integrity_watch import IntegrityWatch
from vtoken_sglang.integration.observe.runtime_metrics import device_bytes, kv_pool_bytes
from vtoken_sglang.integration.observe.stats import RuntimeStats
from vtoken_sglang.integration.parts.admission import Admission, server_policy
from vtoken_sglang.integration.parts.eviction import Eviction
from vtoken_sglang.integration.parts.page_bridge import SglangPagePool
from vtoken_sglang.integration.parts.plan_source import SNAPSHOT_EVERY, InlinePlans, WorkerPlans
from vtoken_sglang.integration.parts.prefill_eviction import PrefillEviction
from vtoken_sglang.integration.parts.prefix_cow import PrefixCow
from vtoken_sglang.integration.parts.request_rows import RequestRows
from vtoken_sglang.integration.parts.score_link import ScoreLink, make_scorer
from vtoken_sglang.integration.parts.tp_group import TpGroup
from vtoken_sglang.scoring import ScoreCollector

# pages held back from SGLang's allocator for relocation destinations: reclaim under pressure can always start
RELOCATION_RESERVE = 2
COW_EVERY = 4  # trimming rounds between copy-on-write checks (each walks the tree paths of the managed requests)


class VTokenRuntime:
    """One scheduler's vToken state; every part is built here, from what the constructor is given."""

    def __init__(
        self,
        cfg: VTokenConfig,
        req_to_token: torch.Tensor,
        allocator,
        kv_pool,
        *,
        tree=None,
        producer=None,
        tp: TpGroup | None = None,
        prompt_in_tree: bool = True,
        pending_results: Callable[[], Iterable] = tuple,
        scorer: ScoreCollector | None = None,
        widest_window: int = 0,
        prefill_chunk: int = 0,
        sessions: bool = False,
    ):
        """``tree``: SGLang's radix cache when it is on; ``producer``: the forward stream when it is not this
        thread's (overlap scheduler on CUDA: copies wait for the forward in flight); ``prompt_in_tree``: the radix
        cache takes each prompt's whole pages after prefill; ``pending_results``: the overlap scheduler's queued
        (batch, result) pairs; ``scorer``: the score collector the attention hook fills (score policies; built
        here when not given); ``widest_window``: the model's widest sliding window (0: none); ``prefill_chunk``:
        SGLang's prefill chunk (``--chunked-prefill-size``); ``sessions``: streaming sessions are on (rows extended
        across turns)."""
        self.cfg = cfg
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.tree = tree
        self.tp = tp = tp or TpGroup()
        self.pending_results = pending_results
        self.policy = server_policy(cfg, self.page_size)
        self.pool = SglangPagePool(
            allocator, device=req_to_token.device, reserve=RELOCATION_RESERVE if cfg.vtoken_reclaim else 0
        )
        rows, width = req_to_token.shape
        self.table = TokenTable(
            rows, width, self.pool, slots=req_to_token, state_names=self.policy.state_names if self.policy else ()
        )
        self.stats = RuntimeStats()
        self.rows = RequestRows(self.table, self.pool)
        self.forward_layout: RowLayout | None = None  # the forward being run's (``hooks.forward.begin_forward``)
        self.eviction = self.prefill = None
        if self.policy is not None:
            newest = max(self.policy.cfg.recent, widest_window) if sessions and widest_window else None
            self.eviction = Eviction(self.table, self.rows, self.pool, self.policy, self.stats, newest)
            if cfg.vtoken_prefill_eviction:
                self.prefill = PrefillEviction(self.table, self.rows, self.pool, self.policy, self.stats, widest_window)
        self.kv_pool_bytes = kv_pool_bytes(kv_pool)
        worker = cfg.vtoken_planner == "worker" and cfg.vtoken_reclaim
        engine = make_copy_engine(
            list(kv_pool.k_buffer) + list(kv_pool.v_buffer),
            producer,
            SWITCHES.fence_delay,
            hash((SWITCHES.fence_seed, tp.rank)),
        )
        # Copies wait for the forward in flight (the producer stream) and the next forward waits for the copies.
        # Sources are freed one round later, after a wait on the copy's fence: by then the forward that followed
        # the copy has been launched and the copy is done, so the wait is short and the step is the same on every
        # TP rank. A worker's plan arrives a step or more after its snapshot, and waits up to a cadence to be
        # broadcast.
        self.reclaimer = Reclaimer(
            self.table,
            engine,
            theta=cfg.vtoken_theta,
            grace_steps=1,
            max_plan_lag=2 * SNAPSHOT_EVERY if worker else 0,
            enabled=cfg.vtoken_reclaim,
        )
        self.plans = (
            WorkerPlans(self.reclaimer, self.stats.fold, rows, tp.rank, tp.broadcast if tp.size > 1 else None)
            if worker
            else InlinePlans(self.reclaimer, self.stats.fold)
        )
        self.cow = None
        if tree is not None and cfg.vtoken_cow and self.policy is not None:
            self.cow = PrefixCow(tree, self.table, self.pool, engine, self.page_size, allow_copies=cfg.vtoken_reclaim)
        copies = self.cow is not None and self.cow.allow_copies
        chunk = prefill_chunk if self.prefill is not None else 0  # admission counts chunk-evicted prompts by it
        self.admission = Admission(self.policy, cfg.vtoken_reclaim, copies, self.page_size, prompt_in_tree, chunk)
        self.scores = None
        if self.policy is not None and self.policy.needs_scores:
            scorer = scorer or make_scorer(cfg, len(kv_pool.k_buffer), self.table.slots.device.type)
            self.scores = ScoreLink(
                scorer, self.policy, self.rows, kv_pool, tp, producer=producer, dump=SWITCHES.score_dump is not None
            )
        self.integrity = IntegrityWatch(self.reclaimer, self.rows, self.stats)
        self.exporter = None  # metrics_export.PrometheusExporter, created on the first report when metrics are on
        self.logged_rounds = 0  # stats.rounds at the last idle log line

    # ------------------------------------------------------------------ the round after each decode step

    def after_decode(self, batch, lock_holders: Iterable = ()) -> None:
        """The eviction round over ``batch``, the decode step that just ran (the module docstring lists the
        steps). ``lock_holders``: requests outside the batch that may hold a radix-tree lock (the one being
        chunked)."""
        self._close_step()
        if self.policy is None:  # nothing is evicted: the round only counts the step
            return
        ending = functools.cache(lambda: self._ending(batch))  # asked only in a round that may evict
        self.plans.begin_round()  # 1. release what is due
        try:
            self._fold_scores(batch, ending)  # 2.
            managed = self.rows.requests_managed
            layout = None  # the batch's, built only in a round that looks at its rows
            if not self.rows.skip_check():
                layout = self.rows.layout(host_array(batch.req_pool_indices_cpu), host_array(batch.seq_lens_cpu))
            trimmed = self.eviction.run(batch, layout, ending)  # 3.
            if trimmed.size:
                self._copy_on_write(batch, lock_holders, ending, self.rows.requests_managed != managed)  # 4.
                self.plans.plan_now()  # 5. reclaim
                self.rows.write_lengths(batch, layout, trimmed)  # 6.
                self._watch()  # 7.
        finally:
            self.plans.end_step()
            self.stats.fold_step(
                self.allocator.available_size() // self.page_size,
                self.reclaimer.pending_pages(),
                self.reclaimer.stats.plans_admitted,
            )

    def after_chunk(self, req) -> None:
        """The round between two prefill chunks of ``req`` (``prefill`` takes it): sources due freed, its chunk
        scored, its victims evicted, sparse pages packed."""
        self.plans.begin_round()
        if self.scores is not None:
            self.scores.observe_chunk(req)
        if self.prefill.after_chunk(req):
            self.plans.plan_now()
            self.sample_pages()

    def _close_step(self) -> None:
        """The step since the last round is over: counted, and (debug) its host reads closed."""
        if HOST_READS.enabled:
            HOST_READS.end_step(self._activity())
        self.stats.decode_steps += 1

    def _fold_scores(self, batch, ending: Callable[[], Set[int]]) -> None:
        """A scored step's attention into the policy's state, for the requests still running."""
        if self.scores is None or not self.scores.scorer.active:
            return
        gone = ending()
        running = np.fromiter(
            (not r.finished() and id(r) not in gone for r in batch.reqs), dtype=bool, count=len(batch.reqs)
        )
        self.scores.observe_decode(
            batch, batch.req_pool_indices.to(torch.int64), batch.seq_lens.to(torch.int64), running
        )

    def _copy_on_write(
        self, batch, lock_holders: Iterable, ending: Callable[[], Set[int]], first_eviction: bool
    ) -> None:
        """Tree-prefix pages copied out for the managed requests that hold them, when a check is due."""
        cow = self.cow
        if cow is None or not (first_eviction or self.stats.rounds % COW_EVERY == 0 or cow.retry):
            return
        # requests ending now are no candidates, but lock their paths until their results land
        gone = ending()
        staying = [r for r in batch.reqs if id(r) not in gone]
        going = [r for r in batch.reqs if id(r) in gone]
        cow.step(staying, [*lock_holders, *going])

    def _watch(self) -> None:
        """A round that evicted: counted, the page peaks sampled, the integrity check at its cadence."""
        self.stats.rounds += 1
        self.sample_pages()
        self.integrity.after_round()

    def _ending(self, batch) -> frozenset:
        """Ids of the requests of ``batch`` whose queued (overlap scheduler) result ends them by length."""
        queued = self.pending_results()
        if not queued:
            return frozenset()
        pending = {id(r) for b, _ in queued for r in b.reqs}
        return frozenset(id(r) for r in batch.reqs if id(r) in pending and r.next_output_finishes_by_length())

    def _activity(self) -> tuple:
        """Counters that every kind of work between two rounds advances (``host_reads``: quiet vs busy steps)."""
        r = self.reclaimer.stats
        return (
            self.stats.rounds,
            self.stats.reclaim_on_pressure,
            r.plans_admitted,
            r.plans_rejected,
            r.plans_stale,
            r.pages_reclaimed,
            self.plans.metrics().get("worker_snapshots_sent", 0),
            self.rows.requests_managed,
            self.rows.n_managed,
        )

    # ------------------------------------------------------------------ outside the round

    @property
    def device_bytes(self) -> int:
        """Device bytes vToken holds: the metadata, and the score collector's query buffers once allocated."""
        queries = self.scores.scorer.buffers if self.scores is not None else None
        return device_bytes(self.table, self.pool, self.rows) + (queries.nbytes() if queries is not None else 0)

    def reclaim_under_pressure(self) -> int:
        """A decode step would not fit: reclaim regardless of theta. Returns the pages freed."""
        if not self.reclaimer.enabled:
            return 0
        self.stats.reclaim_on_pressure += 1
        freed = self.reclaimer.reclaim_now()
        self.stats.pages_freed_on_pressure += freed
        return freed

    def release_before_idle(self) -> None:
        """The scheduler is about to go idle (and SGLang to check its pool for leaks): free every relocation
        source still pending, waiting for its copy (the server is idle: the wait costs nothing), and give the
        relocation reserve back to SGLang's allocator."""
        self.reclaimer.release_ready(force=True)
        self.pool.return_reserve()

    def sample_pages(self) -> None:
        self.table.settle()  # the pages of deferred decode tokens are tracked once registered
        used = self.pool.num_pages - self.allocator.available_size() // self.page_size
        evictable = self.tree.evictable_size() // self.page_size if self.tree is not None else None
        self.stats.sample_pages(used, self.pool.used_pages(), evictable)
