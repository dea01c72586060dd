"""Data parallelism with vToken on CPU (``--dp-size 2``: two schedulers in one server, each with its own runtime):
every request completes with its exact length, every rank evicts and reclaims, and nothing leaks (SGLang's strict
idle memory check is on; vToken holds no page at idle). Two vToken servers behind SGLang's router:
``test_integration.test_router_over_two_vtoken_servers`` (over that module's servers)."""

import pytest
from conftest import STRICT, generate_all, idle_states, random_prompts

from vtoken_sglang.tools.launcher import SglangServer, default_server_args

pytestmark = pytest.mark.server

EVICT = ["--enable-vtoken", "--vtoken-policy", "random", "--vtoken-budget-ratio", "0.5", "--vtoken-recent", "8"]
NEW_TOKENS = 80


def check_worker_states(states: list[dict]) -> None:
    for st in states:
        assert st["tokens_evicted"] > 0 and st["pages_reclaimed"] > 0, st
        assert st["allocated_pages"] == 0 and st["pending_pages"] == 0 and st["position_mismatches"] == 0, st


def test_dp2_every_rank_evicts_and_reclaims(tiny_model):
    flags = default_server_args(max_total_tokens=4096) + ["--dp-size", "2"] + EVICT
    with SglangServer(tiny_model, flags, env=STRICT) as s:
        outs = generate_all(s.url, random_prompts(12), NEW_TOKENS)
        assert all(len(o["output_ids"]) == NEW_TOKENS for o in outs)
        states = idle_states(s, 2)
        assert len(states) == 2
        check_worker_states(states)
        assert s.proc.poll() is None and "memory leak" not in s.log_text()
