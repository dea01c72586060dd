"""Each policy against its definition, on a real Token Table (single request rows, page size 4)."""

import pytest
import torch
from core_helpers import MiniEngine

from vtoken_sglang.policies import POLICIES, PolicyConfig, make_policy
from vtoken_sglang.policies.random import mix_hash

STATE = ("h2o_acc", "tova_last", "sh_persist", "snap")


def engine_with(lengths, **kw):
    eng = MiniEngine(num_pages=512, page_size=4, rows=8, max_context=1024, state_names=STATE, **kw)
    rows = torch.arange(len(lengths))
    eng.table.open_rows(rows)
    eng.write(rows, torch.tensor(lengths))
    return eng, rows


def kept_logical(eng, row):
    return eng.table.row_view(row)[1].tolist()


def evict_with(eng, rows, policy, attn=None, prefill=False, **cfg):
    pol = make_policy(policy, PolicyConfig(**{"slack": 0, **cfg}))
    if attn is not None:
        pol.observe(eng.table, rows, attn, prefill=prefill)
    vr, vc = pol.select_victims(eng.table, rows)
    eng.evict(vr, vc)
    return pol


def test_streaming_keeps_exactly_sinks_and_recent():
    eng, rows = engine_with([100, 37])
    evict_with(eng, rows, "streaming", budget=4 + 16, sinks=4, recent=16)
    assert kept_logical(eng, 0) == list(range(4)) + list(range(84, 100))
    assert kept_logical(eng, 1) == list(range(4)) + list(range(21, 37))


def test_none_never_evicts():
    eng, rows = engine_with([50])
    evict_with(eng, rows, "none", budget=10, sinks=0, recent=1)
    assert kept_logical(eng, 0) == list(range(50))


def test_random_is_seeded_reproducible_and_respects_protection():
    kept = []
    for seed in (3, 3, 4):
        eng, rows = engine_with([200, 200])
        evict_with(eng, rows, "random", budget_ratio=0.5, sinks=2, recent=8, seed=seed)
        kept.append((kept_logical(eng, 0), kept_logical(eng, 1)))
    assert kept[0] == kept[1] and kept[0] != kept[2]
    k0, k1 = kept[0]
    assert len(k0) == 100 and k0[:2] == [0, 1] and k0[-8:] == list(range(192, 200))
    assert k0 != k1  # rows hash differently
    middle = set(range(2, 192)) - set(k0)
    assert len(middle) == 100 and min(middle) < 40 and max(middle) > 150  # spread, not a block


def test_random_hash_is_independent_of_batch_composition():
    lg = torch.arange(50)[None, :]
    alone = mix_hash(7, torch.tensor([5]), lg)
    batched = mix_hash(7, torch.tensor([1, 5, 9]), lg.expand(3, -1))
    assert torch.equal(alone[0], batched[1])


def test_h2o_keeps_top_accumulated_outside_recent():
    eng, rows = engine_with([40])
    g = torch.Generator().manual_seed(0)
    total = torch.zeros(1, 40)
    for _ in range(3):
        attn = torch.rand(1, 40, generator=g)
        total += attn
        pol = make_policy("h2o", PolicyConfig(budget=20, sinks=0, recent=5, slack=0))
        pol.observe(eng.table, rows, attn)
    evict_with(eng, rows, "h2o", budget=20, sinks=0, recent=5)
    top = torch.argsort(total[0, :35], descending=True)[:15].sort().values.tolist()
    assert kept_logical(eng, 0) == top + list(range(35, 40))


def test_tova_keeps_what_the_last_query_attends_to():
    eng, rows = engine_with([30])
    make_policy("tova", PolicyConfig(budget=10, sinks=0, recent=1)).observe(eng.table, rows, torch.rand(1, 30))
    last = torch.zeros(1, 30)
    last[0, [3, 7, 11, 13, 17, 19, 23, 27, 28]] = 1.0
    evict_with(eng, rows, "tova", attn=last, budget=10, sinks=0, recent=1)
    assert kept_logical(eng, 0) == [3, 7, 11, 13, 17, 19, 23, 27, 28, 29]


def test_scissorhands_counts_persistent_importance():
    eng, rows = engine_with([20])
    pol = make_policy("scissorhands", PolicyConfig(budget=8, sinks=0, recent=2, slack=0, options={"history": 4}))
    persistent = [1, 4, 6, 9, 12, 15]
    for step in range(6):
        attn = torch.full((1, 20), 0.01)
        attn[0, persistent] = 0.2
        attn[0, 2 + step] = 0.5  # a one-off spike does not make a token persistent
        pol.observe(eng.table, rows, attn)
    vr, vc = pol.select_victims(eng.table, rows)
    eng.evict(vr, vc)
    assert kept_logical(eng, 0) == persistent + [18, 19]


def test_snapkv_pools_prefill_window_and_spares_generated_tokens():
    eng, rows = engine_with([32])
    attn = torch.zeros(1, 32)
    attn[0, 10] = 1.0  # one hot spot; pooling (kernel 3) keeps its neighbours
    pol = evict_with(eng, rows, "snapkv", attn=attn, prefill=True, budget=8, sinks=0, recent=4, options={"pool": 3})
    assert kept_logical(eng, 0)[:3] == [9, 10, 11] and kept_logical(eng, 0)[-4:] == [28, 29, 30, 31]
    eng.write(rows, torch.tensor([6]))  # decode: generated tokens outrank prompt tokens
    vr, vc = pol.select_victims(eng.table, rows)
    eng.evict(vr, vc)
    assert kept_logical(eng, 0)[-6:] == list(range(32, 38))
    # once no scored prompt token is left, generated tokens go oldest first, and never a protected one
    eng.write(rows, torch.tensor([12]))
    vr, vc = pol.select_victims(eng.table, rows)
    eng.evict(vr, vc)
    assert kept_logical(eng, 0) == list(range(42, 50))
    eng, rows = engine_with([16])  # with sinks: they stay, whatever the unscored tokens rank
    pol = evict_with(eng, rows, "snapkv", attn=torch.rand(1, 16), prefill=True, budget=6, sinks=2, recent=4)
    eng.write(rows, torch.tensor([20]))
    vr, vc = pol.select_victims(eng.table, rows)
    eng.evict(vr, vc)
    assert kept_logical(eng, 0) == [0, 1, 32, 33, 34, 35]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_budget_ratio_and_slack_batch_evictions(policy):
    eng, rows = engine_with([64])
    cfg = dict(budget_ratio=0.5, sinks=2, recent=4, slack=8, seed=1)
    pol = make_policy(policy, PolicyConfig(**cfg))
    if pol.needs_scores:
        pol.observe(eng.table, rows, torch.rand(1, 64), prefill=True)
    vr, _ = pol.select_victims(eng.table, rows)
    assert len(vr) == (0 if policy == "none" else 32)
    eng.evict(*pol.select_victims(eng.table, rows))
    for _ in range(9):  # 9 new tokens: budget grows by ~4.5, live by 9 -> stays within slack
        eng.write(rows, torch.tensor([1]))
    assert len(pol.select_victims(eng.table, rows)[0]) == 0
    for _ in range(12):
        eng.write(rows, torch.tensor([1]))
    vr, _ = pol.select_victims(eng.table, rows)
    if policy != "none":
        assert int(eng.table.live_len[0]) - len(vr) == int(pol.budget(eng.table.logical_len[rows])[0])


def test_adapters_are_small():
    import inspect

    from vtoken_sglang.policies import base

    for cls in POLICIES.values():
        assert len(inspect.getsource(inspect.getmodule(cls)).splitlines()) < 50, cls.name
    assert inspect.getmodule(base.Policy) is base
