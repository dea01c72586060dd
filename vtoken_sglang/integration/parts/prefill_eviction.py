"""``PrefillEviction``: the round between two prefill chunks of one prompt (``--vtoken-prefill-eviction``).

SGLang prefills a long prompt in chunks; between two chunks the request is in no batch (only the scheduler's
``chunked_req`` holds it) and upstream publishes what it computed to the radix tree (``Scheduler.
stash_chunked_request``). A prompt whose budget (taken at its whole prompt's length) plus slack it exceeds is
evicted from there instead:

- at its first chunk's stash it becomes managed (its row is still dense: upstream's) and compacted
  (``skip_radix_cache_insert``: upstream's stash then only moves ``prefix_len`` on, and publishes nothing); a prefix
  it matched in the tree stays the tree's, locked, its tokens eviction candidates like any other;
- after each chunk, while it is over its prompt's budget + slack, its policy picks victims down to that budget,
  among its tokens so far, keeping its sinks and its newest ``max(recent, widest sliding window)`` positions: the
  next chunk's window on a sliding layer is then the row's dense suffix, so every backend's extend window (taken by
  column) is the window by logical position, with no attention hook; pages left without a live token are freed
  at once, and sparse ones are packed as after a decode step (the inline planner);
- the request's own lengths become live (``kv_committed_len``) and its offset logical minus live; ``prefix_len``
  stays logical (upstream indexes the prompt's token ids with it). The next chunk extends the compacted row
  (``hooks.allocation.extend_over_live_rows``).

The last chunk has no stash: the decode round trims the request after it, as any other. Score policies rank what
they have at a chunk's round (nothing before decode: older first).
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.debug_switches import SWITCHES
from vtoken_sglang.integration.observe import victim_log
from vtoken_sglang.integration.observe.host_reads import on_host
from vtoken_sglang.integration.observe.stats import RuntimeStats
from vtoken_sglang.integration.parts.page_bridge import SglangPagePool
from vtoken_sglang.integration.parts.request_rows import RequestRows
from vtoken_sglang.policies import Policy


def prompt_len(req) -> int:
    """The logical length a request's prefill ends at (its prompt, with any earlier output of a resumed one)."""
    return len(req.full_untruncated_fill_ids)


def plain_text(req) -> bool:
    """Whether a request's positions and embeddings follow its token ids alone (no image, embeddings given or
    position overrides, whose chunking reads the prefix length as a token offset)."""
    return req.multimodal_inputs is None and req.input_embeds is None and req.positional_embed_overrides is None


class PrefillEviction:
    def __init__(
        self,
        table: TokenTable,
        rows: RequestRows,
        pool: SglangPagePool,
        policy: Policy,
        stats: RuntimeStats,
        widest_window: int,
    ):
        """``widest_window``: the widest sliding window of the model's layers (0: none)."""
        self.table = table
        self.rows = rows
        self.pool = pool
        self.policy = policy
        self.stats = stats
        self.newest = max(policy.cfg.recent, widest_window)

    def budget(self, logical_len: int) -> int:
        """Tokens a request whose prefill ends at ``logical_len`` keeps."""
        return int(on_host(self.policy.budget, np.array([logical_len], dtype=np.int64))[0])

    def takes(self, req) -> bool:
        """Whether the request being chunked is evicted between its chunks: it already is, or it is plain text whose
        prompt exceeds its budget plus slack. Called before upstream's stash; a request taken is managed and
        compacted from here on (upstream's stash will not publish its chunk)."""
        row = req.kv.req_pool_idx
        if self.rows.is_managed(row):
            return True
        n = prompt_len(req)
        if not plain_text(req) or n <= self.budget(n) + self.policy.cfg.slack:
            return False
        self.rows.manage([req])
        self.rows.mark_compacted([req])
        return True

    def after_chunk(self, req) -> int:
        """The round after a chunk of ``req`` (taken, stashed): victims down to its prompt's budget if it is over
        its budget + slack, their emptied pages freed; its lengths written. Returns the tokens evicted."""
        table = self.table
        row = torch.tensor([req.kv.req_pool_idx], dtype=torch.int64, device=table.slots.device)
        at = torch.tensor([prompt_len(req)], dtype=torch.int64, device=row.device)
        vr, vc = self.policy.select_victims(table, row, budget_at=at, newest=self.newest)
        n = int(vr.numel())
        if n:
            logical = table.logical_at(vr, vc)
            self.stats.fold("victims", table.row_key[vr], logical)
            if SWITCHES.victim_log:
                victim_log.record([req], row, table.logical_len[row], vr, logical)
            self.pool.free(table.evict(vr, vc))
            self.stats.tokens_evicted += n
            self.stats.prefill_tokens_evicted += n
            self.stats.prefill_rounds += 1
        self.rows.write_request(req)
        return n
