"""``Admission``'s room for prefix copies (``copy_room``) and its reopening rule, on the numbers of the pass-key
load that retracted: prompts of 999 tokens (62 whole pages in the radix tree after prefill), 42 new tokens, h2o at
160 tokens, page 16. A request admitted at its budget still holds its whole prompt in locked tree pages until its
copy lands, and a copy needs free pages before it gives any back."""

from types import SimpleNamespace

import numpy as np

from vtoken_sglang.integration.parts.admission import Admission
from vtoken_sglang.policies import PolicyConfig, make_policy

PAGE = 16
PROMPT, NEW = 999, 42


def admission(reclaim: bool = True, copies: bool = True, in_tree: bool = True) -> Admission:
    policy = make_policy("h2o", PolicyConfig(budget=160, sinks=4, recent=16, slack=PAGE))
    return Admission(policy, reclaim, copies and reclaim, PAGE, in_tree)


def req(protected: int, prompt: int = PROMPT, new: int = NEW) -> SimpleNamespace:
    return SimpleNamespace(
        kv=SimpleNamespace(cache_protected_len=protected, kv_committed_len=prompt),
        origin_input_ids=[0] * prompt,
        output_ids=[],
        sampling_params=SimpleNamespace(max_new_tokens=new, ignore_eos=False),
    )


def test_a_pending_copy_needs_the_pages_of_what_the_request_keeps():
    adm = admission()
    keep = 160 + PAGE  # budget + slack: what the copy may take at most
    assert adm.new_copy_room(PROMPT, 0, NEW) == -(-keep // PAGE) * PAGE == 176
    # running: one request still locking its whole prompt, two that copied down to a shared first page
    assert adm.running_copy_room([req(992), req(16), req(16)]) == 176
    assert adm.running_copy_room([req(16), req(16)]) == 16  # the largest pending copy, not their sum
    assert adm.running_copy_room([req(0)]) == 0


def test_no_copy_room_where_nothing_is_copied():
    assert admission().new_copy_room(100, 0, 20) == 0  # never over its budget: it never evicts, never copies
    assert admission(reclaim=False).new_copy_room(PROMPT, 0, NEW) == 0  # Naive-Evict copies nothing
    assert admission(copies=False).running_copy_room([req(992)]) == 0  # --vtoken-cow off
    # the radix cache off: only a matched prefix sits in locked tree pages
    assert admission(in_tree=False).new_copy_room(PROMPT, 0, NEW) == 0
    assert admission(in_tree=False).new_copy_room(PROMPT, 64, NEW) == 64


def test_the_charge_of_a_long_prompt_leaves_its_copy_out_and_the_check_asks_for_it():
    """What a request is charged for decode is capped by its budget (nothing beyond a prompt over it); the room
    of its copy is what the check adds, against the room free now. Without it, four such prompts filled a
    4096-token pool and none could copy."""
    adm = admission()
    assert adm.new_request_kv(PROMPT, NEW) == 0
    pool, held = 4096, 3 * 63 * PAGE  # three prompts admitted in one pass, their prefills counted
    copy = adm.new_copy_room(PROMPT, 0, NEW)
    assert PROMPT + adm.new_request_kv(PROMPT, NEW) < pool - held  # the charge alone admitted a fourth
    assert not adm.fits_now(pool - held, PROMPT, copy, running=3)  # its prefill and its copy do not fit
    assert adm.fits_now(pool - 2 * 63 * PAGE, PROMPT, copy, running=2)  # the third did


def test_the_copy_is_checked_against_the_room_free_now_with_the_running_requests_growth():
    """A copy borrows the room running requests reserve for later growth, not the pages they open before it is
    tried (two steps of a token each, each may cross a page boundary)."""
    adm = admission()
    need = 1008 + 176  # the prompt's whole pages and the copy's
    assert adm.fits_now(need + 16 * PAGE, PROMPT, 176, running=16)  # 16 requests, a page each
    assert not adm.fits_now(need + 16 * PAGE - 1, PROMPT, 176, running=16)


def test_reopening_asks_for_the_refused_request_and_the_largest_pending_copy():
    adm = admission()
    adm.refused(1000, copy=176, extend=PROMPT)
    assert not adm.reopens(1000, room_now=10**6)  # the room left by reservations does not fit the request
    assert not adm.reopens(1100, room_now=1100)  # fits the request, not its prefill and its copy
    assert not adm.reopens(1100, room_now=1200, running_copy=256)  # a running request's pending copy is larger
    assert adm.refused_need == 1000
    assert adm.reopens(1100, room_now=1200, running_copy=16)
    assert adm.refused_need is None and adm.reopened == 1
    assert not adm.reopens(10**6, room_now=10**6)  # nothing refused since


def test_ideal_is_unchanged_by_copies():
    """The benchmarks' ideal counts what a request keeps at its end; a copy's room is transient."""
    final = np.array([PROMPT + NEW] * 4)
    assert admission().ideal_running(final, 4096) == admission(copies=False).ideal_running(final, 4096)


def test_a_prompt_its_first_round_trims_is_charged_what_it_keeps_and_its_prefill_is_checked_against_the_room_now():
    """The peer's ShareGPT load (h2o at 160, 128 new tokens): a prompt of 645 tokens, charged whole (661 with
    its page), was refused against 519 tokens left by the running requests' reservations, while its first round
    takes it down to 176 and its copy lets its 40 tree pages go. Charged what it keeps, its prefill and copy are
    asked of the room free now instead."""
    adm, prompt, new = admission(), 645, 128
    assert adm.trims_prompt(prompt, new)
    upstream_total = prompt + new + PAGE  # SGLang's check: extend, max_new, a page of overhead
    charge = upstream_total - (new - adm.new_request_kv(prompt, new, extend=prompt))
    assert charge == 176 + PAGE < 519 < prompt + PAGE
    copy = adm.new_copy_room(prompt, 0, new)
    need_now = 656 + copy + 20 * PAGE  # its prefill's whole pages, its copy, a new page for each of 20 running
    assert adm.fits_now(need_now, prompt, copy, running=20)
    assert not adm.fits_now(need_now - 1, prompt, copy, running=20)
    # the pass reserves what the request keeps at its end (and its prefill's rounding to whole pages)
    assert -(-prompt // PAGE) * PAGE + adm.new_request_kv(prompt, new, extend=prompt) == 176 + 11


def test_prompts_that_keep_their_pages_are_charged_whole():
    adm = admission()
    assert not adm.trims_prompt(150, 128)  # never over what it keeps at its end
    assert not adm.trims_prompt(180, 128)  # 11 whole pages in the tree, a copy of 11: it does not pay
    assert adm.trims_prompt(200, 128)  # 12 whole pages in the tree against a copy of 11
    assert adm.new_request_kv(180, 128, extend=180) == adm.new_request_kv(180, 128) == 0
    assert not admission(reclaim=False).trims_prompt(PROMPT, NEW)  # Naive-Evict: scattered victims keep pages
    assert not admission(copies=False).trims_prompt(PROMPT, NEW)  # tree pages stay locked to the request's end
    assert admission(copies=False, in_tree=False).trims_prompt(PROMPT, NEW)  # private pages, compacted and freed


def test_reopening_asks_the_room_now_for_a_transient_prefill_without_copies():
    adm = admission(in_tree=False)
    adm.refused(192, copy=0, extend=645, transient=True)
    assert not adm.reopens(200, room_now=656 + 20 * PAGE - 1, running=20)
    assert adm.reopens(200, room_now=656 + 20 * PAGE, running=20)


def test_running_requests_reserve_upstreams_estimate_capped_by_their_budget():
    """A running request's reservation is upstream's (remaining tokens times the new-token ratio) capped by what its
    budget lets it add: a prompt over its budget adds nothing, a short one adds its estimate."""
    adm = admission()
    assert adm.running_reservation([req(992)], new_token_ratio=0.5, clip=4096) == 0
    assert adm.running_reservation([req(0, prompt=100, new=20)], new_token_ratio=0.5, clip=4096) == 10
    assert adm.running_reservation([req(0, prompt=150, new=200)], new_token_ratio=1.0, clip=4096) == 176 - 150
