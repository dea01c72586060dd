"""Admission by eviction budget with the radix cache off and ``ignore_eos`` requests (bench_serving's default):
upstream admits those through ``PrefillAdder.add_one_req_ignore_eos``, which reserves every request's whole
remaining length. vToken (reclaim on) routes them through the general path, capped by eviction budgets, so more
run at once; Naive-Evict (reclaim off, scattered victims: nothing is freed) keeps upstream's path. Same victims,
so the same greedy tokens, and no retraction (the capped reservation holds).

Mixed prompt lengths (ShareGPT's shape): a long prompt is charged what it keeps at its end, but it is prefilled
whole and trimmed to its budget by the first round, so a prefill that does not fit the room free now is refused
until a round trims the prompts before it; admission, shut by that refusal, must reopen when a round frees room
(``Admission.reopens``), or the pool stays partly idle while requests wait."""

import re

import pytest
from conftest import on_servers

from vtoken_sglang.config import VTokenConfig
from vtoken_sglang.integration.parts.admission import Admission, server_policy
from vtoken_sglang.tools.launcher import SglangServer, default_server_args

pytestmark = pytest.mark.server

# 12 requests of 32 + 224 tokens (16 pages each, page 16) in a 64-page pool: upstream's ignore_eos path fits 3;
# at budget ratio 0.5 a request keeps about half its tokens, so about twice as many fit
FLAGS = [
    "--disable-radix-cache",
    "--decode-log-interval",
    "1",
    "--enable-vtoken",
    "--vtoken-policy",
    "random",
    "--vtoken-budget-ratio",
    "0.5",
    "--vtoken-recent",
    "16",
]
POOL = 1024
PROMPTS = [[(7 * i + 13 * j) % 1999 + 1 for j in range(32)] for i in range(12)]
NEW_TOKENS = 224
# 24 requests, prompts of 320 and 16 tokens in turn, 64 new tokens each: a long prompt is prefilled whole (320) and
# kept at most at 192 + slack, so two long prefills leave no room now for a third, while what the requests keep
# leaves room for about 7 (measured: 7, after 4 reopenings; Naive-Evict 4)
MIXED = [[(11 * i + 5 * j) % 1999 + 1 for j in range(16 if i % 2 else 320)] for i in range(24)]
MIXED_NEW = 64


def run(s: SglangServer, prompts: list[list[int]], new_tokens: int) -> dict:
    # one batch request: every prompt reaches the scheduler at once, so what admission lets run together does not
    # depend on how the requests happened to arrive
    start = len(s.log_text())
    sampling = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    outs = s.post("/generate", {"input_ids": prompts, "sampling_params": sampling}, timeout=900)
    running = [int(n) for n in re.findall(r"#running-req: (\d+)", s.log_text()[start:])]
    return {
        "ids": [o["output_ids"] for o in outs],
        "max_running": max(running, default=0),
        "retractions": sum(o["meta_info"].get("num_retractions", 0) for o in outs),
        "reopened": s.get("/get_server_info")["internal_states"][0]["vtoken"]["admission_reopened"],
    }


@pytest.fixture(scope="module")
def runs(tiny_model):
    modes = ("on", "off")
    flags = default_server_args(max_total_tokens=POOL) + FLAGS
    servers = {reclaim: SglangServer(tiny_model, flags + ["--vtoken-reclaim", reclaim]) for reclaim in modes}
    return on_servers(servers, lambda _, s: {"uniform": run(s, PROMPTS, NEW_TOKENS), "mixed": run(s, MIXED, MIXED_NEW)})


def test_ignore_eos_admission_uses_eviction_budgets_with_the_radix_cache_off(runs):
    vtoken, naive = runs["on"]["uniform"], runs["off"]["uniform"]
    assert all(len(ids) == NEW_TOKENS for ids in vtoken["ids"] + naive["ids"])
    assert vtoken["ids"] == naive["ids"]  # the same victims: admission order does not change what a request sees
    assert naive["max_running"] <= 4, naive  # upstream's ignore_eos path, whole lengths reserved
    assert vtoken["max_running"] >= naive["max_running"] + 2, (vtoken["max_running"], naive["max_running"])
    assert vtoken["retractions"] == 0


def test_admission_reopens_when_a_round_frees_room_on_mixed_prompt_lengths(runs):
    vtoken, naive = runs["on"]["mixed"], runs["off"]["mixed"]
    assert all(len(ids) == MIXED_NEW for ids in vtoken["ids"] + naive["ids"])
    assert vtoken["ids"] == naive["ids"]
    cfg = VTokenConfig.build(
        {"enable_vtoken": True, "vtoken_policy": "random", "vtoken_budget_ratio": 0.5, "vtoken_recent": 16}
    )
    admission = Admission(server_policy(cfg, 16), reclaim=True, prefix_copies=True, page_size=16, prompt_in_tree=False)
    ideal = admission.ideal_running([len(p) + MIXED_NEW for p in MIXED], POOL)
    # without reopening, admission stays shut from the first refusal until the first requests end
    assert vtoken["max_running"] >= 0.9 * ideal, (vtoken["max_running"], ideal)
    assert vtoken["reopened"] > runs["on"]["uniform"]["reopened"]
    assert vtoken["retractions"] == 0
