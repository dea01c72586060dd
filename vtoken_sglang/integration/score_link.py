"""``ScoreLink``: attention scores for score-based policies, from the queries the attention hook kept to the
policy's per-token state.

- decode (h2o, tova, scissorhands): after a scored step, every running request's attention over its live keys is
  folded into the policy's row-aligned state. Such a request is managed from its first decode step (its state must
  exist before it first exceeds its budget).
- prefill (snapkv): after a prefill forward, each request whose prompt is now complete (not a middle chunk, not
  finished) is managed, and its window's attention over the prompt goes into the policy's state; its victims are
  taken at its first decode step, like every eviction.

A forward that should have been scored but whose scored layers kept no query (their attention ran without the
Python forward the hook is on: a CUDA graph replay) is not scored silently: an error line the first time, and
``steps_unscored`` / ``prefills_unscored`` count it (``prefills_scored`` counts prompts, so it equals the prompts
a snapkv server was sent, less those that ended at their prefill).
"""

from __future__ import annotations

import logging
import time

import torch

from vtoken_sglang.integration.request_rows import RequestRows
from vtoken_sglang.integration.tp_group import TpGroup
from vtoken_sglang.policies import Policy
from vtoken_sglang.scoring import ScoreCollector

logger = logging.getLogger(__name__)


class ScoreLink:
    def __init__(
        self, scorer: ScoreCollector, policy: Policy, rows: RequestRows, kv_pool, tp: TpGroup, dump: bool = False
    ):
        """``dump``: keep (token ids seen, scores) per scored step of the batch's first request (snapkv: per
        prefill), for ``VTOKEN_SGLANG_SCORE_DUMP``."""
        self.scorer = scorer
        self.policy = policy
        self.rows = rows
        self.table = rows.table
        self.kv_pool = kv_pool
        self.tp = tp
        self.scoring_ms = 0.0  # time spent turning kept queries into scores (decode steps and prefill windows)
        self.prefill_complete: list[bool] = []  # per request of the last prefill forward: its prompt is all in
        self.dump: list | None = [] if dump else None
        self.prompts_scored = 0
        self.unscored = {"decode": 0, "prefill": 0}  # scored forwards whose layers kept no query

    def _missed(self, kind: str) -> bool:
        """Whether the forward was to be scored (``kind``) but none of the scored layers kept its query."""
        if self.scorer.queries:
            return False
        self.unscored[kind] += 1
        if self.unscored[kind] == 1:
            logger.error(
                "[vtoken] a %s forward that %s scores ran without the attention hook of its scored layers (a CUDA "
                "graph replay?): it is not scored, so its tokens rank by age (counted in %s)",
                kind,
                self.policy.name,
                "steps_unscored" if kind == "decode" else "prefills_unscored",
            )
        return True

    def observe_decode(self, batch, rows: torch.Tensor, live: torch.Tensor, running: torch.Tensor) -> None:
        """After a decode step (``rows``, ``live`` lengths and ``running`` mask of its batch)."""
        if self.scorer.active and self._missed("decode"):
            return
        t0 = time.perf_counter()
        slots = self.table.slots[rows, : int(live.max())].to(torch.int64)
        attn = self.scorer.scores(self.kv_pool.get_key_buffer, slots, live, self.tp.all_reduce, self.tp.size)
        self.scoring_ms += (time.perf_counter() - t0) * 1e3
        if attn is None:
            return
        new = [r for r, run in zip(batch.reqs, running.tolist()) if run and not self.rows.is_managed(r.kv.req_pool_idx)]
        if new:
            self.rows.manage(new)
        if self.dump is not None and bool(running[0]):
            req = batch.reqs[0]
            seen = (list(req.origin_input_ids) + list(req.output_ids))[: int(self.table.logical_len[rows[0]])]
            self.dump.append((seen, attn[0, : int(live[0])].cpu()))
        if bool(running.any()):
            self.policy.observe(self.table, rows[running], attn[running])

    def observe_prefill(self, batch) -> None:
        """After a prefill forward scored with a window (snapkv)."""
        if self.scorer.prefill_window == 0 or not self.scorer.window_segments or self._missed("prefill"):
            return
        t0 = time.perf_counter()
        rows = batch.req_pool_indices.to(torch.int64).tolist()
        lengths = [pos + w for _, w, pos in self.scorer.window_segments]
        slots = [self.table.slots[r, :n].to(torch.int64) for r, n in zip(rows, lengths)]
        scores = self.scorer.window_scores(self.kv_pool.get_key_buffer, slots, self.tp.all_reduce, self.tp.size)
        self.scoring_ms += (time.perf_counter() - t0) * 1e3
        if scores is None:
            return
        keep = [
            i
            for i, (req, complete) in enumerate(zip(batch.reqs, self.prefill_complete))
            if complete
            and not req.finished()
            and not self.rows.is_managed(rows[i])
            and req.kv.kv_committed_len == lengths[i]
        ]
        if not keep:
            return
        self.rows.manage([batch.reqs[i] for i in keep])
        self.prompts_scored += len(keep)
        if self.dump is not None:
            self.dump.append((list(batch.reqs[keep[0]].origin_input_ids), scores[keep[0]].cpu()))
        block = torch.nn.utils.rnn.pad_sequence([scores[i] for i in keep], batch_first=True)
        kept_rows = torch.tensor([rows[i] for i in keep], dtype=torch.int64, device=block.device)
        self.policy.observe(self.table, kept_rows, block, prefill=True)

    def metrics(self) -> dict:
        return {
            "scoring_ms": round(self.scoring_ms, 3),
            "steps_scored": self.scorer.steps_scored,
            "prefills_scored": self.prompts_scored,
            "steps_unscored": self.unscored["decode"],
            "prefills_unscored": self.unscored["prefill"],
        }
