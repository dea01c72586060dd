"""``VTokenRuntime``: vToken inside one SGLang scheduler process, built once from the scheduler
(``from_scheduler``): the core's Token Table over SGLang's ``req_to_token``, its page accounting over SGLang's
allocator (``page_bridge``), the policy, the reclaimer and its planner, and the parts the hooks call:

- ``rows`` (``request_rows``): which requests are managed; their lengths and positions toward SGLang;
- ``admission``: how much KV admission reserves under eviction budgets;
- ``scores`` (``score_link``): attention scores into the policy's state (score policies only);
- ``cow`` (``prefix_cow``): copy-on-write of radix-tree prefix pages (radix cache and ``--vtoken-cow`` on);
- ``planning``: inline planner or compaction worker (``planning``, ``worker_link``);
- ``stats``, ``integrity``: counters and digests; the integrity check in the running server.
The eviction round that ties them together after each decode step is ``eviction_round.run_round``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch

from vtoken_sglang.config import VTokenConfig
from vtoken_sglang.core.copy_engine import make_copy_engine
from vtoken_sglang.core.reclaimer import Reclaimer
from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.integration.admission import Admission
from vtoken_sglang.integration.hook_timer import TIMER
from vtoken_sglang.integration.host_reads import HOST_READS
from vtoken_sglang.integration.integrity_watch import IntegrityWatch
from vtoken_sglang.integration.page_bridge import SglangPagePool
from vtoken_sglang.integration.planning import InlinePlanning, WorkerPlanning
from vtoken_sglang.integration.prefix_cow import PrefixCow
from vtoken_sglang.integration.request_rows import RequestRows
from vtoken_sglang.integration.score_link import ScoreLink
from vtoken_sglang.integration.stats import RuntimeStats
from vtoken_sglang.integration.tp_group import TpGroup
from vtoken_sglang.integration.worker_link import SNAPSHOT_EVERY, WorkerLink
from vtoken_sglang.policies import PolicyConfig, make_policy
from vtoken_sglang.scoring import ScoreCollector, cpu_kernel

# Debug: the CPU copy engine's fences report done only after a number of queries drawn from 0..N, seeded per TP
# rank, as CUDA events may (the copies themselves stay real and synchronous).
FENCE_DELAY = int(os.environ.get("VTOKEN_SGLANG_FENCE_DELAY", "0"))
FENCE_SEED = int(os.environ.get("VTOKEN_SGLANG_FENCE_SEED", "0"))
# pages vToken holds back from SGLang's allocator for relocation destinations (reclaim on): with one free page a
# plan can compact a row's sparse pages and free more, so reclaim under pressure can always start
RELOCATION_RESERVE = 2


def device_bytes(table: TokenTable, pool, rows: RequestRows) -> int:
    """Device memory vToken allocates beside SGLang's pools: the Token Table's per-slot and per-row metadata, the
    page pool's per-page arrays, the rows' position offsets. (The row store is SGLang's ``req_to_token``.)"""
    return table.metadata_bytes() + pool.metadata_bytes() + rows.device_bytes()


def make_scorer(cfg: VTokenConfig, num_layers: int, device: str) -> ScoreCollector | None:
    """The score collector of a score-based policy (None for the others). A scheduler builds it before SGLang
    builds the model: the attention hook writes queries into it while SGLang captures its CUDA graphs. Decode
    scoring on a CPU loads (or builds) the CPU kernels now, not at the first scored step."""
    if not cfg.scoring:
        return None
    prefill = cfg.scoring == "prefill"
    if not prefill and device == "cpu":
        cpu_kernel.load()
    return ScoreCollector(
        num_layers,
        cfg.vtoken_score_layers,
        cfg.vtoken_score_every,
        decode=not prefill,
        prefill_window=cfg.vtoken_window if prefill else 0,
    )


def kv_pool_bytes(kv_pool) -> int:
    """Bytes of SGLang's K/V pool (its own count: K and V, scale buffers included)."""
    size = kv_pool.get_kv_size_bytes()
    return int(sum(size)) if isinstance(size, tuple) else int(size)


class VTokenRuntime:
    """One scheduler's vToken state; every part is built here, from what the constructor is given."""

    def __init__(
        self,
        cfg: VTokenConfig,
        req_to_token,
        allocator,
        kv_pool,
        *,
        tree=None,
        producer=None,
        tp: TpGroup | None = None,
        prompt_in_tree: bool = True,
        pending_results: Callable[[], Iterable] = tuple,
        scorer: ScoreCollector | None = None,
        score_dump: bool = False,
    ):
        """``tree``: SGLang's radix cache when it is on; ``producer``: the forward stream when it is not this
        thread's (overlap scheduler on CUDA: copies wait for the forward in flight); ``prompt_in_tree``: the radix
        cache takes each prompt's whole pages after prefill; ``pending_results``: the overlap scheduler's queued
        (batch, result) pairs; ``scorer``: the score collector the attention hook fills (score policies; built
        here when not given)."""
        self.cfg = cfg
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.tree = tree
        self.tp = tp = tp or TpGroup()
        self.pending_results = pending_results
        self.policy = (
            make_policy(cfg.vtoken_policy, PolicyConfig.from_config(cfg, slack=max(self.page_size, 16)))
            if cfg.vtoken_policy != "none"
            else None
        )
        self.pool = SglangPagePool(
            allocator, device=req_to_token.device, reserve=RELOCATION_RESERVE if cfg.vtoken_reclaim else 0
        )
        rows, width = req_to_token.shape
        self.table = TokenTable(
            rows, width, self.pool, slots=req_to_token, state_names=self.policy.state_names if self.policy else ()
        )
        self.stats = RuntimeStats()
        self.rows = RequestRows(self.table, self.pool)
        self.kv_pool_bytes = kv_pool_bytes(kv_pool)
        worker = cfg.vtoken_planner == "worker" and cfg.vtoken_reclaim
        engine = make_copy_engine(
            list(kv_pool.k_buffer) + list(kv_pool.v_buffer), producer, FENCE_DELAY, hash((FENCE_SEED, tp.rank))
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
        self.planning = (
            WorkerPlanning(
                self.reclaimer,
                self.stats.fold,
                WorkerLink(self.reclaimer, rows, tp.rank, tp.broadcast if tp.size > 1 else None),
            )
            if worker
            else InlinePlanning(self.reclaimer, self.stats.fold)
        )
        self.cow = None
        if tree is not None and cfg.vtoken_cow and self.policy is not None:
            self.cow = PrefixCow(tree, self.table, self.pool, engine, self.page_size, allow_copies=cfg.vtoken_reclaim)
        self.admission = Admission(
            self.policy,
            cfg.vtoken_reclaim,
            self.cow is not None and self.cow.allow_copies,
            self.page_size,
            prompt_in_tree,
        )
        self.scores = None
        if self.policy is not None and self.policy.needs_scores:
            scorer = scorer or make_scorer(cfg, len(kv_pool.k_buffer), self.table.slots.device.type)
            self.scores = ScoreLink(scorer, self.policy, self.rows, kv_pool, tp, producer=producer, dump=score_dump)
        self.integrity = IntegrityWatch(self.reclaimer, self.rows, self.stats)
        self.exporter = None  # metrics_export.PrometheusExporter, created on the first report when metrics are on
        self.logged_rounds = 0  # stats.rounds at the last idle log line

    @property
    def device_bytes(self) -> int:
        """Device bytes vToken holds: the metadata, and the score collector's query buffers once allocated."""
        queries = self.scores.scorer.buffers if self.scores is not None else None
        return device_bytes(self.table, self.pool, self.rows) + (queries.nbytes() if queries is not None else 0)

    @classmethod
    def from_scheduler(
        cls, scheduler, cfg: VTokenConfig, scorer: ScoreCollector | None = None, score_dump: bool = False
    ) -> VTokenRuntime:
        """The runtime over a built SGLang scheduler's pools, tree, streams and TP group; raises ``SystemExit``
        with one line if they are not what vToken can serve (a paged allocator over one K/V pool)."""
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
        return cls(
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
            score_dump=score_dump,
        )

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

    def metrics(self) -> dict:
        pool, table = self.pool, self.table
        table.settle()
        active = table.active
        # one read: managed rows, their live tokens, private pages, the live tokens in those
        rows, live, *occupancy = torch.cat(
            [torch.stack([active.sum(), torch.where(active, table.live_len, 0).sum()]), pool.private_occupancy()]
        ).tolist()
        assert self.rows.n_managed == rows, "managed-row count out of step with the Token Table"
        return {
            "live_tokens": live,
            "allocated_pages": pool.used_pages(),
            "fragmentation": round(pool.fragmentation(occupancy), 4),
            "hook_ms": round(TIMER.ms, 3),
            "requests_managed": self.rows.requests_managed,
            "resident_dead_tokens": pool.used_pages() * self.page_size - occupancy[1],
            "pending_pages": self.reclaimer.pending_pages(),
            "reserved_pages": self.pool.reserved_pages(),
            "vtoken_device_bytes": self.device_bytes,
            "kv_pool_bytes": self.kv_pool_bytes,
            **self.stats.as_dict(with_tree=self.tree is not None),
            **(self.scores.metrics() if self.scores is not None else {}),
            **self.reclaimer.stats.as_dict(),
            **self.planning.metrics(),
            **HOST_READS.metrics(),
            **(self.cow.metrics() if self.cow is not None else {}),
        }


RUNTIME: VTokenRuntime | None = None  # this process's runtime (one scheduler per process), set by the init hook
