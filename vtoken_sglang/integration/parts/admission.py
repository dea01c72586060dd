"""``Admission``: how much KV SGLang's admission reserves for a request, given its eviction budget, and when a
closed admission reopens.

SGLang admits a request when the free pages cover every running request's future KV plus the new one's; with
eviction, a request's future KV is capped by what its budget lets it keep (this is where the capacity gain comes
from). The hooks of ``hooks.admission`` ask ``future_kv`` (running requests) and ``new_request_kv`` (the request
being checked and charged: one rule for both); pressure reclaim before retraction is the reclaimer's. What lasts a
step or two (a prompt its first round trims, a prefix copy) is checked against the room free now (``fits_now``),
not charged against the running requests' reservations.

A refused admission shuts SGLang's admission until a request leaves (``ScheduleBatch.batch_is_full``). Eviction
rounds also make room (a prompt trimmed below what it was charged, pages compacted and freed, tree pages left to
eviction by a copy), so the refusal's need is kept (``refused``) and, after a round that made room, compared with
the room admission would now see (``reopens``): admission reopens when the refused request fits, not at every step
of a full batch. Both checks also ask the room free now for a transient prefill and the largest pending prefix copy
(``trims_prompt``, ``copy_room``, ``fits_now``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vtoken_sglang.config import VTokenConfig
from vtoken_sglang.core.pages import pages_for
from vtoken_sglang.integration.observe.host_reads import on_host
from vtoken_sglang.integration.parts.request_lengths import RequestLengths
from vtoken_sglang.policies import Policy, make_policy

MIN_SLACK = 16
"""Fewest tokens a request may hold over its budget before a round evicts (``PolicyConfig.slack``): a page, at least
this many."""

FIRST_ROUND_STEPS = 2
"""Steps from a request's admission to the round of its first eviction, which trims its prompt and tries its prefix
copy (its prefill, then its first decode): meanwhile each running request adds a token per decode step, and may
open a new page for it."""


def server_policy(cfg: VTokenConfig, page_size: int) -> Policy | None:
    """The eviction policy a server with ``cfg`` runs, as admission counts it (``None`` for policy ``none``)."""
    if cfg.vtoken_policy == "none":
        return None
    return make_policy(cfg.vtoken_policy, cfg.policy_config(slack=max(page_size, MIN_SLACK)))


class Admission:
    def __init__(
        self,
        policy: Policy | None,
        reclaim: bool,
        prefix_copies: bool,
        page_size: int,
        prompt_in_tree: bool,
        chunk: int = 0,
    ):
        """``reclaim``: evicted tokens' pages are compacted and freed (vToken; off: Naive-Evict).
        ``prefix_copies``: copy-on-write moves a request's live tree-prefix tokens to private pages (and the tree's
        pages become evictable). ``prompt_in_tree``: the radix cache takes each prompt's whole pages after prefill.
        ``chunk``: the prefill chunk of prompts evicted between their chunks (``--vtoken-prefill-eviction``; 0:
        off)."""
        self.policy = policy
        self.chunk = chunk
        self.reclaim = reclaim
        self.prefix_copies = prefix_copies
        self.page_size = page_size
        self.prompt_in_tree = prompt_in_tree
        self.refused_need: int | None = None  # tokens the last refused request needed; None: none refused since
        self.refused_copy = 0  # the room its own prefix copy needs (``copy_room``)
        self.refused_extend = 0  # the tokens its prefill takes
        self.refused_transient = False  # its prefill is trimmed by its first round (``trims_prompt``)
        self.reopened = 0  # times a round's freed room reopened a closed admission
        # (held, protected) of the streaming session's turn being admitted (``hooks.admission.admit_by_budget``)
        self.turn: tuple[int, int] | None = None

    @property
    def capped(self) -> bool:
        """Whether admission reserves by eviction budget: evicted tokens really give their memory back, with
        reclaim on, or (Naive-Evict) with a policy whose victims empty whole pages. Naive-Evict with scattered
        victims keeps almost every page, so it reserves the full remaining length, as upstream does."""
        return self.policy is not None and (self.reclaim or self.policy.frees_whole_pages)

    def future_kv_many(
        self, current_len: np.ndarray, logical_now: np.ndarray, remaining_new: np.ndarray, protected: np.ndarray
    ) -> np.ndarray:
        """Most KV tokens each request holding ``current_len`` (``protected`` of them in its tree prefix's pages)
        can still add before it ends, given its eviction budget: its view ends at most at
        ``keep = max(budget(final), floor) + slack [+ page]`` tokens (``PolicyConfig.floor``: what trimming never
        goes below), so ``min(remaining_new, keep - held)``, at least 0, where ``held`` is what the request already
        holds toward that:
        - with prefix copies, its whole view (``current_len``): the prefix tokens it keeps end up in private pages,
          and the tree's pages they came from become evictable (SGLang counts those as available);
        - without, only its private tokens (``current_len - protected``): the prefix pages stay locked to the end,
          so evicting prefix tokens frees nothing and their room in the budget goes to private tokens.
        Expected case, like upstream's admission: the tail page and what compaction leaves (F <= theta) are covered
        by reclaiming before retracting; ``+ page`` for Naive-Evict, whose oldest page in the window stays partly
        dead. Not capped: ``remaining_new``. int64 arrays of one length."""
        remaining_new = np.maximum(remaining_new, 0)
        if not self.capped:
            return remaining_new
        keep = self.kept_at_end((logical_now + remaining_new).astype(np.int64))
        held = current_len if self.prefix_copies else np.maximum(current_len - protected, 0)
        return np.maximum(0, np.minimum(remaining_new, keep - held))

    def kept_at_end(self, final_len: np.ndarray) -> np.ndarray:
        """The most KV tokens requests of logical length ``final_len`` (int64) hold at their end, as admission
        counts it: ``max(budget(final), floor) + slack``, + a page for Naive-Evict (where capped; not capped: the
        whole length)."""
        if not self.capped:
            return final_len
        keep = np.maximum(on_host(self.policy.budget, final_len), self.policy.cfg.floor)
        return keep + self.policy.cfg.slack + (0 if self.reclaim else self.page_size)

    def ideal_running(self, final_lens: Sequence[int], pool_tokens: int) -> float:
        """The most requests of logical lengths ``final_lens`` (prompt + output) a pool of ``pool_tokens`` holds at
        once when each is charged what admission reserves for it at its end (``kept_at_end``) plus the page it adds
        per request: the pool over the mean of that (the benchmarks' ideal)."""
        kept = self.kept_at_end(np.asarray(final_lens, dtype=np.int64)) + self.page_size
        return pool_tokens / float(np.mean(kept))

    def future_kv(self, current_len: int, logical_now: int, remaining_new: int, protected: int = 0) -> int:
        """``future_kv_many`` of one request."""
        one = [np.array([v], dtype=np.int64) for v in (current_len, logical_now, remaining_new, protected)]
        return int(self.future_kv_many(*one)[0])

    def new_request_kv(self, prompt_len: int, max_new_tokens: int, extend: int | None = None) -> int:
        """What a request about to be admitted is charged beyond its prefill of ``extend`` tokens (default: the whole
        prompt; the rest is a prefix it matched in the tree): its capped future KV after its prompt (with the radix
        cache on, the prompt's whole pages go to the tree after prefill, and are then protected). A prompt its first
        round trims (``trims_prompt``) is charged what it keeps at its end in place of its prefill, so this is then
        negative: its prefill is transient, checked against the room free now (``fits_now``), not against the running
        requests' reservations."""
        if extend is not None and self.trims_prompt(prompt_len, max_new_tokens, prompt_len - extend):
            return int(self.kept_at_end(np.array([prompt_len + max_new_tokens]))[0]) - extend
        return self.future_kv(prompt_len, prompt_len, max_new_tokens, self.prompt_in_tree_tokens(prompt_len))

    def turn_kv(self, held: int, protected: int, prompt_len: int, max_new_tokens: int, extend: int) -> int:
        """What a streaming session's turn (``prompt_len``: the conversation with its new tokens) is charged beyond
        its prefill of ``extend`` new tokens. The session's record already holds ``held`` tokens (its live length),
        ``protected`` of them in the tree pages of its first prompt (locked to its close, never copied): the turn may
        add what its budget lets it keep at its end beyond the private tokens held, less its prefill, at most
        ``max_new_tokens``. Negative when its first round trims (``turn_trims``: its prefill is transient)."""
        if not self.capped:
            return max_new_tokens
        keep = self.kept_at_end_of(prompt_len + max_new_tokens)
        return min(max_new_tokens, max(keep - max(held - protected, 0), 0) - extend)

    def turn_trims(self, held: int, protected: int, prompt_len: int, max_new_tokens: int, extend: int) -> bool:
        """Whether a streaming session's turn (``turn_kv``'s arguments) is trimmed by its first round: its private
        tokens after its prefill exceed what it keeps at its end."""
        keep = self.kept_at_end_of(prompt_len + max_new_tokens)
        return self.capped and max(held - protected, 0) + extend > keep

    def evicts_in_prefill(self, prompt_len: int, matched: int = 0) -> bool:
        """Whether a prompt is evicted between its prefill chunks (``parts.prefill_eviction``): eviction between
        chunks is on, evicted tokens give their pages back (``capped``), its prefill of ``prompt_len - matched``
        tokens is chunked, and it is over its prompt's budget + slack."""
        if not self.chunk or not self.capped or prompt_len - matched <= self.chunk:
            return False
        return prompt_len > self.kept_at_end_of(prompt_len)

    def prefill_peak(self, prompt_len: int, matched: int = 0) -> int:
        """The most tokens a request's prefill of ``prompt_len - matched`` tokens holds at once: all of them, or,
        evicted between its chunks, what its prompt's budget keeps plus a chunk and its tail page's room."""
        extend = prompt_len - matched
        if not self.evicts_in_prefill(prompt_len, matched):
            return extend
        return min(extend, self.kept_at_end_of(prompt_len) + self.chunk + self.page_size)

    def kept_at_end_of(self, logical_len: int) -> int:
        """``kept_at_end`` of one request."""
        return int(self.kept_at_end(np.array([logical_len], dtype=np.int64))[0])

    def trims_prompt(self, prompt_len: int, max_new_tokens: int, matched: int = 0) -> bool:
        """Whether a request's first eviction round (its first decode) takes it from its whole prompt down to what it
        keeps at its end and lets its prompt's pages go: its prompt is over ``kept_at_end``, evicted tokens give
        their pages back (``capped``), and its prompt's pages are private, or in the tree and released by a copy
        that pays (more whole pages than the copy takes: ``PrefixCow``). Without copies, tree pages stay locked to
        the request's end."""
        if not self.capped:
            return False
        keep = int(self.kept_at_end(np.array([prompt_len + max_new_tokens]))[0])
        if self.evicts_in_prefill(prompt_len, matched):
            return True  # its chunks never reach the tree, and what it keeps of them is private
        if prompt_len <= keep:
            return False
        protected = max(self.prompt_in_tree_tokens(prompt_len), matched)
        if protected == 0:
            return True
        return self.prefix_copies and self.whole_pages(protected) > self.whole_pages(min(protected, keep))

    def prompt_in_tree_tokens(self, prompt_len: int) -> int:
        """Tokens of a prompt the radix cache takes (locked by its request) after prefill: its whole pages, or none
        when the cache does not take prompts."""
        return prompt_len // self.page_size * self.page_size if self.prompt_in_tree else 0

    def copy_room(self, protected: np.ndarray, final_len: np.ndarray) -> int:
        """Free tokens the largest pending prefix copy needs, for requests holding ``protected`` tokens in locked
        tree pages and of logical length ``final_len`` at their end (int64 arrays of one length). A request that
        evicts (its final length over ``kept_at_end``) copies its live prefix tokens, at most what it keeps, to new
        private pages before the tree's pages become evictable: a copy needs room before it gives any back, and
        without it the request holds its whole prompt to its end while admission counted it at its budget. Copies
        run one group after another, each release making room for the next, so admission leaves room for the
        largest copy, not for all of them. In whole pages; 0 without prefix copies."""
        if not self.prefix_copies or len(protected) == 0:
            return 0
        keep = self.kept_at_end(final_len)
        return self.whole_pages(int(np.where(final_len > keep, np.minimum(protected, keep), 0).max()))

    def running_copy_room(self, reqs: Sequence) -> int:
        """``copy_room`` of the requests ``reqs`` (SGLang's ``Req``), running or admitted: their locked tree tokens
        now, their prompt and ``max_new_tokens`` at the end (``RequestLengths``)."""
        if not self.prefix_copies or len(reqs) == 0:
            return 0
        lengths = RequestLengths.of(reqs)
        return self.copy_room(lengths.protected, lengths.final)

    def new_copy_room(self, prompt_len: int, matched: int, max_new_tokens: int) -> int:
        """``copy_room`` of a request about to be prefilled: the tokens that will sit in locked tree pages after its
        prefill are its prompt's whole pages when the radix cache takes prompts, else the prefix it matched."""
        in_tree = 0 if self.evicts_in_prefill(prompt_len, matched) else self.prompt_in_tree_tokens(prompt_len)
        protected = max(in_tree, matched)
        return self.copy_room(np.array([protected], dtype=np.int64), np.array([prompt_len + max_new_tokens]))

    def fits_now(self, room_now: int, extend: int, copy: int, running: int) -> bool:
        """Whether the room free now (free and evictable tokens, less the prefills of requests admitted in the same
        pass: SGLang's ``remaining_current``) holds a new request's prefill of ``extend`` tokens, ``copy`` (the largest
        pending copy's room) and a new page for each of the ``running`` requests (until the request's first eviction
        round, each adds ``FIRST_ROUND_STEPS`` tokens, which open a page at a page boundary), in whole pages. Asked
        where something transient is pending: a prompt its first round trims (charged at what it keeps,
        ``new_request_kv``) or a prefix copy. Both last a step or two (a copy is made only
        when its release turns more tree pages evictable than it takes), so they borrow the room the running
        requests reserve for their later growth: checked against the room free now, not against what their
        reservations leave (upstream's check, made first with the request's charge)."""
        return self.whole_pages(extend) + copy + running * self.whole_pages(FIRST_ROUND_STEPS) <= room_now

    def whole_pages(self, tokens: int) -> int:
        """``tokens`` rounded up to whole pages."""
        return pages_for(tokens, self.page_size) * self.page_size

    def running_reservation(self, reqs: Sequence, new_token_ratio: float, clip: int) -> int:
        """What admission reserves for the future KV of the running requests ``reqs``: per request upstream's
        estimate (its remaining new tokens, clipped at ``clip``, times ``new_token_ratio``, or 1 for ``ignore_eos``)
        capped by ``future_kv`` (``hooks.admission.cap_running_reservation``), summed."""
        if len(reqs) == 0:
            return 0
        lengths = RequestLengths.of(reqs)
        ratio = np.where(lengths.ignore_eos, 1.0, new_token_ratio)
        upstream = np.minimum(lengths.remaining, clip) * ratio
        if self.policy is None:
            return int(upstream.sum())
        return int(np.minimum(upstream, self.running_kv(lengths)).sum())

    def running_kv(self, lengths: RequestLengths) -> np.ndarray:
        """``future_kv_many`` of running requests, from their ``lengths``."""
        return self.future_kv_many(lengths.held, lengths.logical, lengths.remaining, lengths.protected)

    def refused(self, need: int, copy: int = 0, extend: int = 0, transient: bool = False) -> None:
        """Admission refused a request needing ``need`` tokens of room (SGLang's check: it needs more than that),
        whose prefill takes ``extend`` tokens, whose own prefix copy will need ``copy`` (``copy_room`` of it alone),
        and whose prefill is ``transient`` (``trims_prompt``)."""
        self.refused_need, self.refused_copy, self.refused_extend = need, copy, extend
        self.refused_transient = transient

    def reopens(self, room: int, room_now: int, running_copy: int = 0, running: int = 0) -> bool:
        """After a round that made room while admission is closed: whether ``room`` (what SGLang's admission would
        now see, the running requests' reservations deducted) fits the refused request, and, where its prefill is
        transient or a copy is pending (its own or ``running_copy``, the ``running`` requests' largest), ``room_now``
        (free and evictable tokens) its prefill and that copy (``fits_now``). Reopening forgets the refusal (the next
        one records its own)."""
        if self.refused_need is None or room <= self.refused_need:
            return False
        copy = max(self.refused_copy, running_copy)
        if (copy or self.refused_transient) and not self.fits_now(room_now, self.refused_extend, copy, running):
            return False
        self.refused_need = None
        self.reopened += 1
        return True
