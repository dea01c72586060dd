"""``ScoreLink``: attention scores for score-based policies, from the queries the attention hook kept to the
policy's per-token state.

- decode (h2o, tova, scissorhands): after a scored step, every running request's attention over its live keys is
  folded into the policy's state of those entries (``Policy.observe``: each request's own, a tree prefix's entries
  included, so a request's state folds its own attention only), in the eviction round (before the next
  forward starts, with SGLang's overlap scheduler or without it). Such a request is managed from its first scored
  step (its state must exist before it first exceeds its budget); its row stays dense and insertable in the radix
  tree until it first evicts.
  The step reads nothing from the device: which requests run and how long their rows are come from the host.
- prefill (snapkv): when a prefill's results are processed, each request whose prompt is now complete (not a middle
  chunk, not finished) is managed, and its window's attention over the prompt goes into the policy's state; its
  victims are taken at its first decode step, like every eviction. With the overlap scheduler the next forward has
  run by then: the window's queries were copied out of their forward, and a request's row may hold that next
  decode step's token already.

A forward that should have been scored but whose scored layers kept no query is not scored silently: an error line
the first time, and ``steps_unscored`` / ``prefills_unscored`` count it (``prefills_scored`` counts prompts, so it
equals the prompts a snapkv server was sent, less those that ended at their prefill). Decode forwards are counted on
the device (a CUDA graph's replay runs no Python) and compared with those begun when the metrics are read.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vtoken_sglang.config import VTokenConfig
from vtoken_sglang.integration.observe.host_reads import host_array
from vtoken_sglang.integration.parts.request_rows import RequestRows
from vtoken_sglang.integration.parts.tp_group import TpGroup
from vtoken_sglang.policies import Policy
from vtoken_sglang.scoring import ScoreCollector, cpu_kernel
from vtoken_sglang.scoring.collector import PrefillWindow

logger = logging.getLogger(__name__)


CHUNK_WINDOW = 32
"""Queries that score a prefill chunk's keys for a decode-scored policy (h2o, tova, scissorhands) evicting between
prefill chunks: the chunk's last ones, an observation window as SnapKV's (snapkv's own: ``--vtoken-window``)."""


def make_scorer(cfg: VTokenConfig, num_layers: int, device: str) -> ScoreCollector | None:
    """The score collector of a score-based policy (None for the others). A scheduler builds it before SGLang
    builds the model: the attention hook writes queries into it while SGLang captures its CUDA graphs. Decode
    scoring on a CPU loads (or builds) the CPU kernels now, not at the first scored step."""
    if not cfg.scoring:
        return None
    prefill = cfg.scoring == "prefill"
    if not prefill and device == "cpu":
        cpu_kernel.load()
    window = cfg.vtoken_window if prefill else CHUNK_WINDOW if cfg.vtoken_prefill_eviction else 0
    return ScoreCollector(
        num_layers, cfg.vtoken_score_layers, cfg.vtoken_score_every, decode=not prefill, prefill_window=window
    )


def batch_key(reqs) -> tuple:
    """The key a prefill's window is kept under: its requests' ids, in batch order."""
    return tuple(r.rid for r in reqs)


class ScoreLink:
    def __init__(
        self,
        scorer: ScoreCollector,
        policy: Policy,
        rows: RequestRows,
        kv_pool,
        tp: TpGroup,
        producer=None,
        dump: bool = False,
    ):
        """``producer``: the CUDA stream forwards run on when it is not the caller's (overlap scheduler): scoring
        waits for it on the device. ``dump``: keep (token ids seen, scores) per scored step of the batch's first
        request (snapkv: per prefill), for ``DebugSwitches.score_dump``."""
        self.scorer = scorer
        scorer.start_counting()  # built after SGLang captured its graphs
        self.policy = policy
        self.rows = rows
        self.table = rows.table
        self.kv_pool = kv_pool
        self.tp = tp
        self.producer = producer
        self.scoring_ms = 0.0  # time spent turning kept queries into scores (decode steps and prefill windows)
        self.dump: list | None = [] if dump else None
        self.prompts_scored = 0
        self.chunks_scored = 0  # prefill chunks of prompts evicted between chunks, scored before their round
        self.unscored = {"decode": 0, "prefill": 0}  # scored forwards whose layers kept no query

    def _missed(self, kind: str, count: int = 1) -> None:
        """``count`` forwards that were to be scored (``kind``) kept no query of the scored layers."""
        first = self.unscored[kind] == 0
        self.unscored[kind] += count
        if first and count:
            logger.error(
                "[vtoken] a %s forward that %s scores ran without the attention hook of its scored layers (a CUDA "
                "graph captured without it?): it is not scored, so its tokens rank by age (counted in %s)",
                kind,
                self.policy.name,
                "steps_unscored" if kind == "decode" else "prefills_unscored",
            )

    def observe_decode(self, batch, rows: torch.Tensor, live: torch.Tensor, running: np.ndarray) -> None:
        """After a decode step (``rows``, ``live`` lengths on the device, ``running``: host mask of the requests
        still running, all in batch order). No device read."""
        if not self.scorer.active:
            return
        t0 = time.perf_counter()
        if self.producer is not None:  # the forward of the step may still run on its own stream (overlap, CUDA)
            torch.cuda.current_stream(rows.device).wait_stream(self.producer)
        width = int(host_array(batch.seq_lens_cpu).max())
        slots = self.table.slots[:, :width].index_select(0, rows)
        attn = self.scorer.scores(self.kv_pool.get_key_buffer, slots, live, self.tp.all_reduce, self.tp.size)
        self.scoring_ms += (time.perf_counter() - t0) * 1e3
        if attn is None:
            return
        host_rows = host_array(batch.req_pool_indices_cpu)
        new = np.flatnonzero(running & ~self.rows.host_active[host_rows])
        if new.size:
            self.rows.manage([batch.reqs[i] for i in new.tolist()])
        if self.dump is not None and running[0]:
            req = batch.reqs[0]
            seen = (list(req.origin_input_ids) + list(req.output_ids))[: int(self.table.logical_len[rows[0]])]
            self.dump.append((seen, attn[0, : int(live[0])].cpu()))
        if running.all():
            self.policy.observe(self.table, rows, attn)
        elif running.any():
            at = torch.from_numpy(np.flatnonzero(running)).to(rows.device)
            self.policy.observe(self.table, rows[at], attn[at])

    def observe_prefill(self, batch) -> None:
        """When a prefill's results are processed (snapkv): rank the prompts it completed by its window."""
        if self.scorer.prefill_window == 0:
            return
        window = self.scorer.take_window(batch_key(batch.reqs))
        if window is None or self.scorer.decode:  # a decode-scored policy's windows score chunks only
            return
        if not window.queries:
            self._missed("prefill")
            return
        t0 = time.perf_counter()
        rows = host_array(batch.req_pool_indices_cpu).tolist()  # a request ended at its prefill has none now
        lengths = window.lengths()
        slots = [self.table.slots[r, :n].to(torch.int64) for r, n in zip(rows, lengths)]
        scores = self.scorer.window_scores(window, self.kv_pool.get_key_buffer, slots, self.tp.all_reduce, self.tp.size)
        self.scoring_ms += (time.perf_counter() - t0) * 1e3
        # a request's row is its prompt, and (overlap scheduler) the slot of a decode step prepared since
        # (a prompt evicted between its chunks is managed and compacted from its first: its last chunk ranks it)
        keep = [
            i
            for i, (req, complete) in enumerate(zip(batch.reqs, window.complete))
            if complete
            and not req.finished()
            and (not self.rows.is_managed(rows[i]) or self.rows.host_compacted[rows[i]])
            and req.kv.kv_committed_len - lengths[i] in (0, 1)
        ]
        if not keep:
            return
        new = [batch.reqs[i] for i in keep if not self.rows.is_managed(rows[i])]
        if new:
            self.rows.manage(new)
        self.prompts_scored += len(keep)
        if self.dump is not None:
            self.dump.append((list(batch.reqs[keep[0]].origin_input_ids), scores[keep[0]].cpu()))
        block = torch.nn.utils.rnn.pad_sequence([scores[i] for i in keep], batch_first=True)
        kept_rows = torch.tensor([rows[i] for i in keep], dtype=torch.int64, device=block.device)
        self.policy.observe(self.table, kept_rows, block, prefill=True)

    def observe_chunk(self, req) -> None:
        """Before the round between two prefill chunks of ``req`` (managed): its chunk's window of queries (its last
        ones) over its live keys, into the policy's state (``Policy.observe`` with ``prefill``)."""
        found = self.scorer.window_of(req.rid)
        if found is None:
            return
        window, i = found
        if not window.queries:
            self._missed("prefill")
            return
        t0 = time.perf_counter()
        if self.producer is not None:  # the chunk's forward may still run on its own stream (overlap, CUDA)
            torch.cuda.current_stream(self.table.slots.device).wait_stream(self.producer)
        mine = PrefillWindow(window.key, window.rows, [window.segments[i]], [True], window.queries)
        row = req.kv.req_pool_idx
        slots = [self.table.slots[row, : mine.lengths()[0]].to(torch.int64)]
        scores = self.scorer.window_scores(mine, self.kv_pool.get_key_buffer, slots, self.tp.all_reduce, self.tp.size)
        self.scoring_ms += (time.perf_counter() - t0) * 1e3
        rows = torch.tensor([row], dtype=torch.int64, device=scores[0].device)
        self.policy.observe(self.table, rows, scores[0][None], prefill=True)
        self.chunks_scored += 1

    def metrics(self) -> dict:
        """Counters; checks the decode forwards written on the device against those begun (one device read)."""
        # a forward on the producer stream may still be on its way to writing its stamp
        unwritten = self.scorer.decode_forwards_unwritten() - (self.producer is not None)
        if unwritten > self.unscored["decode"]:
            self._missed("decode", unwritten - self.unscored["decode"])
        return {
            "scoring_ms": round(self.scoring_ms, 3),
            "steps_scored": self.scorer.steps_scored,
            "prefills_scored": self.prompts_scored,
            "chunks_scored": self.chunks_scored,
            "steps_unscored": self.unscored["decode"],
            "prefills_unscored": self.unscored["prefill"],
        }
