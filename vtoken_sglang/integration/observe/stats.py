"""``RuntimeStats``: vToken's counters in one scheduler, the digests of its decisions, and the metrics dict that
the log lines, ``/get_server_info`` and Prometheus show."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import torch

from vtoken_sglang.policies.random import mix_hash

DIGEST_MOD = 1 << 61


@dataclasses.dataclass
class RuntimeStats:
    tokens_evicted: int = 0
    rounds: int = 0  # decode steps with an eviction round that trimmed some request
    decode_steps: int = 0  # decode steps seen (the denominator of per-step costs)
    peak_pool_pages: int = 0  # SGLang's whole KV pool in use, sampled after each round
    peak_tracked_pages: int = 0  # pages of managed requests
    peak_held_pages: int = 0  # SGLang's pool in use less the tree's evictable pages (radix cache on)
    prefill_rounds: int = 0  # rounds between two prefill chunks of a prompt (``--vtoken-prefill-eviction``)
    prefill_tokens_evicted: int = 0  # tokens they evicted (also in ``tokens_evicted``)
    peak_extend_kv: int = 0  # the most KV a managed request held in a prefill chunk's forward: live + the chunk
    reclaim_on_pressure: int = 0  # reclaims forced by a decode step that would not fit
    pages_freed_on_pressure: int = 0  # what they freed (before SGLang checked the step again)
    position_checks: int = 0  # decode positions checked (VTOKEN_SGLANG_CHECK_POSITIONS=1)
    position_mismatches: int = 0
    integrity_checks: int = 0  # full integrity checks run (VTOKEN_SGLANG_CHECK_INTEGRITY=1)
    digest_victims: int = 0  # order-independent digests of decisions, compared across TP ranks and runs
    digest_plans: int = 0
    digest_accounting: int = 0  # per decode step: free pages, pending pages, plans applied (order-dependent)

    def fold(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Fold the pairs ``(a[i], b[i])`` into digest ``name`` (``victims``: row key, logical id; ``plans``:
        source page, its live count). Order-independent: a sum of per-pair hashes."""
        h = int(mix_hash(17, a.to(torch.int64).cpu()[None, :], b.to(torch.int64).cpu()[None, :]).sum()) % DIGEST_MOD
        attr = "digest_" + name
        setattr(self, attr, (getattr(self, attr) + h) % DIGEST_MOD)

    def fold_step(self, free_pages: int, pending_pages: int, plans_applied: int) -> None:
        """Fold one decode step's page accounting into ``digest_accounting``, in step order (host ints only): equal
        on every TP rank only if every rank saw the same free pages, pending pages and plans at every step."""
        h = zlib.crc32(struct.pack("<4q", self.decode_steps, free_pages, pending_pages, plans_applied))
        self.digest_accounting = (self.digest_accounting * 1_000_003 + h) % DIGEST_MOD

    def sample_pages(self, pool_pages_used: int, tracked: int, tree_evictable_pages: int | None) -> None:
        """Peaks after a round; ``tree_evictable_pages``: None without a radix tree."""
        self.peak_pool_pages = max(self.peak_pool_pages, pool_pages_used)
        if tree_evictable_pages is not None:  # pages the tree could give back on demand are not held by anyone
            self.peak_held_pages = max(self.peak_held_pages, pool_pages_used - tree_evictable_pages)
        self.peak_tracked_pages = max(self.peak_tracked_pages, tracked)

    def as_dict(self, with_tree: bool) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # flat ints: no deep copy
        if not with_tree:
            del out["peak_held_pages"]
        return out
