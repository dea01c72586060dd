"""The reclaim simulator drives the real core: a small run has every record field, and vToken holds fewer pages
and fits more requests than Naive-Evict under random eviction (and not under none)."""

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmark"))

import reclaim_sim  # noqa: E402

SMALL = reclaim_sim.Setting(requests=4, context=512, decode=32, chunk=128, reserve=4, rounds=8)
FIELDS = {"policy", "evict_ratio", "page_size", "mode", "mean_F", "pages", "lower_bound_pages", "planner_ms_p50"}


def test_small_memory_run_and_capacity():
    naive = reclaim_sim.memory_run(SMALL, "random", 0.5, "naive")
    vtoken = reclaim_sim.memory_run(SMALL, "random", 0.5, "vtoken")
    assert FIELDS <= set(naive) and FIELDS <= set(vtoken)
    assert naive["lower_bound_pages"] == vtoken["lower_bound_pages"]  # the same victims
    assert vtoken["pages"] <= 1.05 * vtoken["lower_bound_pages"] + SMALL.requests < naive["pages"]
    assert vtoken["mean_F"] < 0.1 < naive["mean_F"] and vtoken["tokens_moved"] > 0
    budget = 4 * 512 // 16
    assert reclaim_sim.capacity(SMALL, "random", 0.5, "vtoken", budget) > reclaim_sim.capacity(
        SMALL, "random", 0.5, "naive", budget
    )


def test_no_eviction_no_gain():
    naive = reclaim_sim.memory_run(SMALL, "streaming", 0.5, "naive")
    vtoken = reclaim_sim.memory_run(SMALL, "streaming", 0.5, "vtoken")
    assert naive["pages"] == vtoken["pages"] or vtoken["pages"] < naive["pages"]
    assert naive["pages"] <= 1.05 * naive["lower_bound_pages"] + SMALL.requests  # whole pages die: nothing trapped


@pytest.mark.parametrize("policy", ["h2o", "tova", "scissorhands", "snapkv"])
def test_score_policies_same_victims_fewer_pages(policy):
    naive = reclaim_sim.memory_run(SMALL, policy, 0.5, "naive")
    vtoken = reclaim_sim.memory_run(SMALL, policy, 0.5, "vtoken")
    assert naive["lower_bound_pages"] == vtoken["lower_bound_pages"] and naive["live_tokens"] == vtoken["live_tokens"]
    assert vtoken["pages"] <= 1.05 * vtoken["lower_bound_pages"] + SMALL.requests < naive["pages"]
