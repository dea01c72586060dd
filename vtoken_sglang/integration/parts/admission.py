"""``Admission``: how much KV SGLang's admission reserves for a request, given its eviction budget.

SGLang admits a request when the free pages cover every running request's future KV plus the new one's; with
eviction, a request's future KV is capped by what its budget lets it keep (this is where the capacity gain comes
from). The hooks of ``hooks.admission`` ask ``future_kv``; pressure reclaim before retraction is the reclaimer's.
"""

from __future__ import annotations

import numpy as np

from vtoken_sglang.integration.observe.host_reads import on_host
from vtoken_sglang.policies import Policy


class Admission:
    def __init__(self, policy: Policy | None, reclaim: bool, prefix_copies: bool, page_size: int, prompt_in_tree: bool):
        """``reclaim``: evicted tokens' pages are compacted and freed (vToken; off: Naive-Evict).
        ``prefix_copies``: copy-on-write moves a request's live tree-prefix tokens to private pages (and the tree's
        pages become evictable). ``prompt_in_tree``: the radix cache takes each prompt's whole pages after prefill."""
        self.policy = policy
        self.reclaim = reclaim
        self.prefix_copies = prefix_copies
        self.page_size = page_size
        self.prompt_in_tree = prompt_in_tree

    @property
    def capped(self) -> bool:
        """Whether admission reserves by eviction budget: evicted tokens really give their memory back, with
        reclaim on, or (Naive-Evict) with a policy whose victims empty whole pages. Naive-Evict with scattered
        victims keeps almost every page, so it reserves the full remaining length, as upstream does."""
        return self.policy is not None and (self.reclaim or self.policy.frees_whole_pages)

    def future_kv(self, current_len: int, logical_now: int, remaining_new: int, protected: int = 0) -> int:
        """Most KV tokens a request holding ``current_len`` (``protected`` of them in its tree prefix's pages) can
        still add before it ends, given its eviction budget: its view ends at most at
        ``keep = max(budget(final), floor) + slack [+ page]`` tokens (``PolicyConfig.floor``: what trimming never
        goes below), so ``min(remaining_new, keep - held)``, at least 0, where ``held`` is what the request already
        holds toward that:
        - with prefix copies, its whole view (``current_len``): the prefix tokens it keeps end up in private pages,
          and the tree's pages they came from become evictable (SGLang counts those as available);
        - without, only its private tokens (``current_len - protected``): the prefix pages stay locked to the end,
          so evicting prefix tokens frees nothing and their room in the budget goes to private tokens.
        Expected case, like upstream's admission: the tail page and what compaction leaves (F <= theta) are covered
        by reclaiming before retracting; ``+ page`` for Naive-Evict, whose oldest page in the window stays partly
        dead. Not capped: ``remaining_new``."""
        if not self.capped:
            return remaining_new
        final = np.array([logical_now + max(remaining_new, 0)], dtype=np.int64)
        keep = max(int(on_host(self.policy.budget, final)[0]), self.policy.cfg.floor)
        keep += self.policy.cfg.slack + (0 if self.reclaim else self.page_size)
        held = current_len if self.prefix_copies else max(current_len - protected, 0)
        return max(0, min(remaining_new, keep - held))

    def new_request_kv(self, prompt_len: int, max_new_tokens: int) -> int:
        """What a request about to be admitted reserves for decode: its capped future KV after its prompt (with the
        radix cache on, the prompt's whole pages go to the tree after prefill, and are then protected)."""
        protected = prompt_len // self.page_size * self.page_size if self.prompt_in_tree else 0
        return self.future_kv(prompt_len, prompt_len, max_new_tokens, protected)
