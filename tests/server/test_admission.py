"""Admission by eviction budget with the radix cache off and ``ignore_eos`` requests (bench_serving's default):
upstream admits those through ``PrefillAdder.add_one_req_ignore_eos``, which reserves every request's whole
remaining length. vToken (reclaim on) routes them through the general path, capped by eviction budgets, so more
run at once; Naive-Evict (reclaim off, scattered victims: nothing is freed) keeps upstream's path. Same victims,
so the same greedy tokens, and no retraction (the capped reservation holds)."""

import re

import pytest
from conftest import on_servers

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
PROMPTS = [[(7 * i + 13 * j) % 1999 + 1 for j in range(32)] for i in range(12)]
NEW_TOKENS = 224


def run(s: SglangServer) -> dict:
    # one batch request: every prompt reaches the scheduler at once, so what admission lets run together does not
    # depend on how the requests happened to arrive
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    outs = s.post("/generate", {"input_ids": PROMPTS, "sampling_params": sampling}, timeout=900)
    running = [int(n) for n in re.findall(r"#running-req: (\d+)", s.log_text())]
    return {
        "ids": [o["output_ids"] for o in outs],
        "max_running": max(running, default=0),
        "retractions": sum(o["meta_info"].get("num_retractions", 0) for o in outs),
    }


@pytest.fixture(scope="module")
def runs(tiny_model):
    modes = ("on", "off")
    flags = default_server_args(max_total_tokens=1024) + FLAGS
    servers = {reclaim: SglangServer(tiny_model, flags + ["--vtoken-reclaim", reclaim]) for reclaim in modes}
    return on_servers(servers, lambda _, s: run(s))


def test_ignore_eos_admission_uses_eviction_budgets_with_the_radix_cache_off(runs):
    vtoken, naive = runs["on"], runs["off"]
    assert all(len(ids) == NEW_TOKENS for ids in vtoken["ids"] + naive["ids"])
    assert vtoken["ids"] == naive["ids"]  # the same victims: admission order does not change what a request sees
    assert naive["max_running"] <= 4, naive  # upstream's ignore_eos path, whole lengths reserved
    assert vtoken["max_running"] >= naive["max_running"] + 2, (vtoken["max_running"], naive["max_running"])
    assert vtoken["retractions"] == 0
