"""Tensor parallelism on CPU (--tp 2, gloo): with vToken on, both ranks take every decision at the same step:
the same victims, the same plans, and the same page accounting at every decode step (free pages, pending pages,
plans applied), checked through each rank's digests, not assumed. The vToken servers run with copy fences that
report done late, after a number of queries drawn per rank from a different seed (as CUDA events complete at
different times on different GPUs): what each rank frees, and when, must not depend on it. Reclaim on vs off gives
identical outputs (h2o). Policies: h2o (score-based: each rank sees half of the heads; the scores are summed over
the TP group, so both ranks rank tokens alike) and random (decides from request keys and positions only). Plans
come from the inline planner (random: each rank plans for itself) or from the compaction worker (h2o: one, on rank
0, whose plans every rank applies)."""

import ast
import re
import time

import pytest
from conftest import on_servers

from vtoken_sglang.tools.launcher import SglangServer, default_server_args

pytestmark = pytest.mark.server

PROMPTS = [("Reclaim moves live tokens out of sparse pages. " * (3 + i)) + str(i) for i in range(6)]
IDLE = re.compile(r"\[vtoken\] idle tp_rank=(\d) (\{.*\})")
LATE = {"VTOKEN_SGLANG_FENCE_DELAY": "4", "VTOKEN_SGLANG_FENCE_SEED": "11"}  # the seed is combined with the rank
AGREE = ("digest_victims", "digest_plans", "digest_accounting", "tokens_evicted", "pages_reclaimed", "tokens_moved")


def tp2_server(tiny_model, policy: str, planner: str) -> SglangServer:
    """vToken with reclaim on and late fences, TP 2."""
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
        "on",
        "--vtoken-planner",
        planner,
    ]
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", **LATE}
    return SglangServer(tiny_model, flags, env=env)


def run_load(s: SglangServer) -> tuple[list, dict[int, dict]]:
    """The prompts' greedy tokens, then each rank's idle state once both ranks hold no live token."""
    ids = [o["output_ids"] for o in s.generate(PROMPTS, 100, ignore_eos=True)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ranks = {int(m.group(1)): ast.literal_eval(m.group(2)) for m in IDLE.finditer(s.log_text())}
        if len(ranks) == 2 and all(r["live_tokens"] == 0 for r in ranks.values()):
            break
        time.sleep(1)
    assert s.proc.poll() is None, s.log_tail()  # alive after SGLang's strict idle leak check
    return ids, ranks


@pytest.mark.parametrize("policy, planner", [("h2o", "worker"), ("random", "inline")])
def test_tp2_ranks_agree_and_reclaim_runs_on_both(tiny_model, policy, planner):
    """vToken with the inline planner (random: each rank plans from its own, identical state) or with the
    compaction worker (h2o: one, on rank 0; every rank applies what rank 0 broadcasts, whatever the policy), with
    late fences seeded differently on each rank. h2o's scores are summed over the ranks: both rank alike, so both
    pick the same victims (Naive-Evict against vToken is the one-rank tests': reclaim does not change victims)."""
    servers = {planner: tp2_server(tiny_model, policy, planner)}
    runs = on_servers(servers, lambda _, s: run_load(s))
    for ranks in [r for _, r in runs.values()]:
        assert set(ranks) == {0, 1}
        assert ranks[0]["tokens_evicted"] > 0
        for key in AGREE:
            assert ranks[0][key] == ranks[1][key], key
        assert ranks[0]["allocated_pages"] == ranks[1]["allocated_pages"] == 0
        assert ranks[0]["pending_pages"] == ranks[1]["pending_pages"] == 0
    _, ranks = runs[planner]
    assert ranks[0]["pages_reclaimed"] > 0 and ranks[0]["plans_admitted"] > 0
    # fences were late on both ranks, and the host waited for them at the release step
    assert ranks[0]["release_waits"] > 0 and ranks[1]["release_waits"] > 0
    if planner == "inline":  # planned on each rank
        assert all(rank["planner_ms"] > 0 for rank in ranks.values())
    else:  # planned in the worker, applied by both ranks from rank 0's broadcast
        assert ranks[0]["worker_plans_received"] > 0 and ranks[0]["worker_restarts"] == 0
        assert ranks[0]["planner_ms"] == 0 and "worker_up" not in ranks[1]
