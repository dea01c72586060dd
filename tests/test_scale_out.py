"""Scaling out with vToken on CPU: data parallelism (``--dp-size 2``: two schedulers in one server, each with its
own runtime) and two vToken servers behind SGLang's router (``sglang_router``, the ``sglang-router`` package).
Every request completes with its exact length, every rank or worker evicts and reclaims, and nothing leaks
(SGLang's strict idle memory check is on; vToken holds no page at idle)."""

import concurrent.futures as cf
import random
import time
import urllib.error
import urllib.request

import pytest
from conftest import STRICT

from vtoken_sglang.router import SglangRouter
from vtoken_sglang.serving import SglangServer, default_server_args, started_together

pytestmark = pytest.mark.server

EVICT = ["--enable-vtoken", "--vtoken-policy", "random", "--vtoken-budget-ratio", "0.5", "--vtoken-recent", "8"]
NEW_TOKENS = 80


def load(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 16-100 random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 1999) for _ in range(rng.randint(16, 100))] for _ in range(n)]


def generate_all(url: str, prompts: list[list[int]]) -> list[dict]:
    import json

    def one(ids):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}}
        body["sampling_params"]["ignore_eos"] = True
        req = urllib.request.Request(
            url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            return {"error": err.code, "body": err.read().decode(errors="replace")[:300]}

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def idle_states(server: SglangServer, ranks: int, timeout: float = 60) -> list[dict]:
    """vToken's state of every scheduler once it is idle (no live token)."""
    deadline = time.monotonic() + timeout
    while True:
        states = [s["vtoken"] for s in server.get("/get_server_info")["internal_states"]]
        if (len(states) == ranks and all(s["live_tokens"] == 0 for s in states)) or time.monotonic() > deadline:
            return states
        time.sleep(1)


def check_worker_states(states: list[dict]) -> None:
    for st in states:
        assert st["tokens_evicted"] > 0 and st["pages_reclaimed"] > 0, st
        assert st["allocated_pages"] == 0 and st["pending_pages"] == 0 and st["position_mismatches"] == 0, st


def test_dp2_every_rank_evicts_and_reclaims(tiny_model):
    flags = default_server_args(max_total_tokens=4096) + ["--dp-size", "2"] + EVICT
    with SglangServer(tiny_model, flags, env=STRICT) as s:
        outs = generate_all(s.url, load(12))
        assert all(len(o["output_ids"]) == NEW_TOKENS for o in outs)
        states = idle_states(s, 2)
        assert len(states) == 2
        check_worker_states(states)
        assert s.proc.poll() is None and "memory leak" not in s.log_text()


def test_router_over_two_vtoken_servers(tiny_model, tmp_path):
    """32 concurrent requests through ``sglang_router.launch_router --policy cache_aware``: none refused. (The
    router answers ``/health`` before it has registered its workers; a load sent then gets ``503
    no_available_workers``. ``SglangRouter`` waits until ``/readiness`` reports both workers healthy.)"""
    flags = default_server_args(max_total_tokens=4096) + EVICT
    with started_together(SglangServer(tiny_model, flags, env=STRICT), SglangServer(tiny_model, flags, env=STRICT)) as (
        a,
        b,
    ):
        with SglangRouter([a.url, b.url], log_path=tmp_path / "router.log") as router:
            outs = generate_all(router.url, load(32, seed=1))
        refused = [o for o in outs if "error" in o]
        assert not refused, (len(refused), refused[0], router.log_path.read_text()[-3000:])
        assert all(len(o["output_ids"]) == NEW_TOKENS for o in outs)
        for server in (a, b):
            check_worker_states(idle_states(server, 1))
            assert server.proc.poll() is None and "memory leak" not in server.log_text()
