"""Tensor parallelism on CPU (--tp 2, gloo): with vToken on, both ranks apply the same victims and the same plans
(checked through each rank's decision digests, not assumed), and reclaim on vs off gives identical outputs. The
policy is score-based (each rank sees half of the heads; the scores are summed over the TP group, so both ranks
rank tokens alike); plans come from the inline planner (each rank plans for itself) or from the compaction worker
(one, on rank 0, whose plans every rank applies). Score-free policies (random, streaming) decide from request
keys and positions only, which every rank has alike."""

import ast
import re

import pytest

from vtoken_sglang.serving import SglangServer, default_server_args

pytestmark = pytest.mark.server

PROMPTS = [("Reclaim moves live tokens out of sparse pages. " * (3 + i)) + str(i) for i in range(6)]
IDLE = re.compile(r"\[vtoken\] idle tp_rank=(\d) (\{.*\})")


def run_tp2(tiny_model, policy: str, reclaim: str, planner: str = "inline") -> tuple[list, dict[int, dict]]:
    flags = default_server_args(max_total_tokens=8192) + [
        "--tp",
        "2",
        "--enable-vtoken",
        "--vtoken-policy",
        policy,
        "--vtoken-budget-ratio",
        "0.5",
        "--vtoken-recent",
        "8",
        "--vtoken-reclaim",
        reclaim,
        "--vtoken-planner",
        planner,
    ]
    with SglangServer(tiny_model, flags, env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}) as s:
        ids = [o["output_ids"] for o in s.generate(PROMPTS, 120, ignore_eos=True)]
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ranks = {int(m.group(1)): ast.literal_eval(m.group(2)) for m in IDLE.finditer(s.log_text())}
            if len(ranks) == 2 and all(r["live_tokens"] == 0 for r in ranks.values()):
                break
            time.sleep(1)
    return ids, ranks


def test_tp2_ranks_agree_and_reclaim_is_transparent(tiny_model):
    """h2o at TP 2: Naive-Evict, vToken with the inline planner (each rank plans from its own, identical state) and
    vToken with the compaction worker (one, on rank 0; every rank applies what rank 0 broadcasts)."""
    off_ids, off = run_tp2(tiny_model, "h2o", "off")
    inline_ids, inline = run_tp2(tiny_model, "h2o", "on", "inline")
    worker_ids, worker = run_tp2(tiny_model, "h2o", "on", "worker")
    for ranks in (off, inline, worker):
        assert set(ranks) == {0, 1}
        assert ranks[0]["tokens_evicted"] > 0
        for key in ("digest_victims", "digest_plans", "tokens_evicted", "pages_reclaimed", "tokens_moved"):
            assert ranks[0][key] == ranks[1][key], key
        assert ranks[0]["allocated_pages"] == ranks[1]["allocated_pages"] == 0
        assert ranks[0]["digest_victims"] == off[0]["digest_victims"]
    assert inline[0]["plans_admitted"] > 0 and worker[0]["plans_admitted"] > 0 and off[0]["plans_admitted"] == 0
    assert inline_ids == off_ids and worker_ids == off_ids
    # planned in the worker, applied by both ranks from rank 0's broadcast
    assert worker[0]["worker_plans_received"] > 0 and worker[0]["worker_restarts"] == 0 and worker[0]["planner_ms"] == 0
    assert "worker_up" not in worker[1] and inline[0]["planner_ms"] > 0
