"""``Admission`` under eviction between prefill chunks (``--vtoken-prefill-eviction``): which prompts are evicted
between their chunks, what their prefill holds at its peak (their budget, a chunk and a page, not their prompt),
what they are charged (what they keep at their end: their chunks never reach the tree), and what is unchanged
without the flag. A 6,000-token prompt, streaming at 1,024 tokens, chunks of 512, pages of 16."""

from vtoken_sglang.integration.parts.admission import Admission
from vtoken_sglang.policies import PolicyConfig, make_policy

PAGE, CHUNK, BUDGET = 16, 512, 1024
KEPT = BUDGET + PAGE  # budget + slack


def admission(chunk: int = CHUNK, reclaim: bool = True, policy: str = "streaming", copies: bool = True) -> Admission:
    cfg = PolicyConfig(budget=BUDGET, sinks=4, recent=64, slack=PAGE)
    return Admission(make_policy(policy, cfg), reclaim, copies and reclaim, PAGE, True, chunk)


def test_a_long_prompt_holds_its_budget_a_chunk_and_a_page_at_its_prefill_peak():
    adm = admission()
    assert adm.evicts_in_prefill(6000)
    assert adm.prefill_peak(6000) == KEPT + CHUNK + PAGE == 1568
    # charged what it keeps at its end (its prefill is transient): the charge beyond its prefill is negative
    assert adm.trims_prompt(6000, 8)
    assert adm.new_request_kv(6000, 8, 6000) == KEPT - 6000
    # its chunks never reach the tree: only a matched prefix would sit in tree pages for a copy
    assert adm.new_copy_room(6000, 0, 8) == 0
    assert adm.new_copy_room(6000, 64, 8) == 64


def test_prompts_not_evicted_between_chunks_hold_their_whole_prefill():
    adm = admission()
    assert not adm.evicts_in_prefill(KEPT)  # within budget + slack: never over it
    assert not adm.evicts_in_prefill(KEPT + 100, matched=KEPT + 100 - CHUNK)  # what is left fits one chunk
    assert adm.prefill_peak(KEPT + 100, matched=600) == KEPT + 100 - 600
    assert adm.prefill_peak(1200) == 1200  # over budget, but its peak (all of it) is below budget + chunk + page
    assert not admission(chunk=0).evicts_in_prefill(6000)  # the flag off
    assert admission(chunk=0).prefill_peak(6000) == 6000


def test_naive_evict_with_scattered_victims_holds_its_pages_and_is_not_counted_as_evicting():
    assert not admission(reclaim=False, policy="random").evicts_in_prefill(6000)
    # streaming's victims empty whole pages: Naive-Evict frees them, a page of slack more at its end
    naive = admission(reclaim=False)
    assert naive.evicts_in_prefill(6000)
    assert naive.prefill_peak(6000) == KEPT + PAGE + CHUNK + PAGE
