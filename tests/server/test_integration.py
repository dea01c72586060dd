"""vToken inside real SGLang (CPU, tiny model, page 16, radix cache on): Naive-Evict and vToken evict the same
victims and give identical greedy tokens, with SGLang's overlap scheduler on and off, vToken holds fewer pages,
nothing leaks (SGLang's strict idle memory check is on), aborts and retraction too. (bench_serving, the frontend
programs and Prometheus: test_cow.py.)"""

import concurrent.futures
import json
import os
import signal
import time

import pytest
import torch
from conftest import INSTANT_FENCES, STRICT, generate_all, idle_states, on_servers, random_prompts

from vtoken_sglang.integration.observe import victim_log
from vtoken_sglang.tools.launcher import SglangServer, default_server_args, started_together
from vtoken_sglang.tools.router import SglangRouter

pytestmark = pytest.mark.server

EVICT = [
    "--enable-vtoken",
    "--vtoken-policy",
    "random",
    "--vtoken-budget-ratio",
    "0.5",
    "--vtoken-recent",
    "8",
    "--vtoken-sinks",
    "4",
]
PROMPTS = [("Reclaim moves live tokens out of sparse pages. " * (3 + i)) + str(i) for i in range(8)]
REUSE_PROMPT = PROMPTS[5] + " And once more."  # most of it in the radix tree after the load


@pytest.fixture(scope="module")
def naive_and_vtoken(tiny_model, tmp_path_factory):
    """Run the same concurrent load on a Naive-Evict server; a vToken server with SGLang's overlap scheduler (its
    default) and copies whose fences report done late, as CUDA events may (``late``); one without the overlap
    scheduler, fences done at once (``serial``); one whose plans come from the compaction worker, killed (-9) in
    the middle of the load (``worker``). The servers start together; their loads run one at a time."""
    counted = {"VTOKEN_SGLANG_COUNT_HOST_READS": "1"}
    instant = {**STRICT, **INSTANT_FENCES}
    victims = tmp_path_factory.mktemp("victims") / "late.jsonl"
    late = {**STRICT, **counted, "VTOKEN_SGLANG_FENCE_DELAY": "4", "VTOKEN_SGLANG_FENCE_SEED": "7"}
    late["VTOKEN_SGLANG_VICTIM_LOG"] = str(victims)
    env_of = {"late": late, "serial": {**instant, **counted}}
    modes = {
        "naive": ["--vtoken-reclaim", "off"],
        "serial": ["--vtoken-reclaim", "on", "--disable-overlap-schedule"],
        "worker": ["--vtoken-reclaim", "on", "--vtoken-planner", "worker"],
        "late": ["--vtoken-reclaim", "on"],
    }
    servers = {
        mode: SglangServer(
            tiny_model,
            default_server_args() + EVICT + extra,
            log_path=tmp_path_factory.mktemp(mode) / "server.log",
            env=env_of.get(mode, instant),
        )
        for mode, extra in modes.items()
    }

    def run(mode: str, s: SglangServer) -> dict:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(s.generate, PROMPTS, 160, ignore_eos=True)
            killed = kill_worker_once_it_planned(s, load) if mode == "worker" else None
            out = load.result()
        one = s.generate(PROMPTS[3], 160, ignore_eos=True)
        reuse = prefix_reuse_probe(s)
        if mode == "worker":
            wait_until_worker_is_back(s)
        time.sleep(2)  # idle: SGLang runs its memory check
        state = s.get("/get_server_info")["internal_states"][0]
        return {
            "ids": [o["output_ids"] for o in out],
            "rids": [o["meta_info"]["id"] for o in out],
            "prompt_tokens": [o["meta_info"]["prompt_tokens"] for o in out],
            "victims": victim_log.read(victims) if mode == "late" else None,
            "one": one["output_ids"],
            "vtoken": state["vtoken"],
            "reuse": reuse,
            "log": s.log_text(),
            "healthy": s.proc.poll() is None,
            "killed": killed,
        }

    with started_together(*servers.values()):
        runs = {mode: run(mode, s) for mode, s in servers.items()}
        runs["router"] = route(servers["late"], servers["worker"], tmp_path_factory.mktemp("router") / "router.log")
    return runs


ROUTED = 32  # requests sent through the router at once
ROUTED_TOKENS = 80


def route(a: SglangServer, b: SglangServer, log_path) -> dict:
    """After their own loads: ``ROUTED`` requests through SGLang's router (``sglang_router.launch_router --policy
    cache_aware``) over two of the vToken servers; their vToken states before and after (idle), logs, health."""
    before = [idle_states(s)[0] for s in (a, b)]
    with SglangRouter([a.url, b.url], log_path=log_path) as router:
        outs = generate_all(router.url, random_prompts(ROUTED, seed=1), ROUTED_TOKENS)
    time.sleep(2)  # idle: SGLang runs its memory check
    return {
        "outs": outs,
        "router_log": router.log_path.read_text()[-3000:],
        "before": before,
        "after": [idle_states(s)[0] for s in (a, b)],
        "logs": [s.log_text() for s in (a, b)],
        "healthy": [s.proc.poll() is None for s in (a, b)],
    }


def wait_until_worker_is_back(server: SglangServer, timeout: float = 120) -> None:
    """The restarted worker has said hello (its client checks health at every step and when the scheduler is idle)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = server.get("/get_server_info")["internal_states"][0]["vtoken"]
        if st["worker_restarts"] >= 1 and st["worker_up"] == 1:
            return
        time.sleep(0.5)
    raise AssertionError(f"the worker did not come back: {st}")


def kill_worker_once_it_planned(server: SglangServer, load) -> int:
    """kill -9 the compaction worker as soon as one of its plans was applied, while the load is still running
    (plans that move nothing come back too: the first ones may be empty)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not load.done():
        st = server.get("/get_server_info")["internal_states"][0]["vtoken"]
        if st.get("plans_admitted", 0) > 0:
            os.kill(st["worker_pid"], signal.SIGKILL)
            return st["worker_pid"]
        time.sleep(0.1)
    raise AssertionError("no plan of the worker was applied during the load")


def prefix_reuse_probe(server: SglangServer) -> dict:
    """One new request over a prompt the tree holds from the load before (its pages were shared by requests that
    evicted and had their private pages compacted): one token with its top logprobs, and how much of the prompt
    came from the tree. Any change to a tree slot would change these."""
    out = server.post(
        "/generate",
        {
            "text": REUSE_PROMPT,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "top_logprobs_num": 5,
        },
    )
    meta = out["meta_info"]
    return {
        "ids": out["output_ids"],
        "cached": meta["cached_tokens"],
        "top": [(t[1], t[0]) for t in meta["output_top_logprobs"][0]],
    }


def test_same_victims_identical_tokens(naive_and_vtoken):
    """Naive-Evict and every vToken server (late fences, no overlap, the worker killed mid-load): the same victims
    and tokens, in a batch and alone."""
    naive = naive_and_vtoken["naive"]
    assert naive["vtoken"]["tokens_evicted"] > 0
    for mode in ("late", "serial", "worker"):
        r = naive_and_vtoken[mode]
        assert r["vtoken"]["tokens_evicted"] == naive["vtoken"]["tokens_evicted"], mode
        assert r["vtoken"]["digest_victims"] == naive["vtoken"]["digest_victims"], mode
        assert r["ids"] == naive["ids"] and r["one"] == naive["one"], mode
    assert naive["one"] == naive["ids"][3]  # alone or in a batch: the same victims


def test_late_fences_change_nothing_seen(naive_and_vtoken):
    """Fences that report done late (``VTOKEN_SGLANG_FENCE_DELAY``, as CUDA events may): sources are freed at their
    fixed step after a wait, and everything is freed before the server goes idle (SGLang's strict idle leak check
    passed, the server is healthy, nothing pending); the same tokens and victims as with instant fences, and
    pages reclaimed. (Plans are not compared: how the tokenizer hands the load's 8 prompts to the scheduler varies
    between runs, and with it which pages a plan finds; victims are per request and do not vary.)"""
    late, instant = naive_and_vtoken["late"], naive_and_vtoken["serial"]
    assert late["ids"] == instant["ids"] and late["one"] == instant["one"]
    for key in ("tokens_evicted", "digest_victims"):
        assert late["vtoken"][key] == instant["vtoken"][key], key
    assert late["vtoken"]["release_waits"] > 0 and instant["vtoken"]["release_waits"] == 0  # the fences were late
    assert late["vtoken"]["pages_reclaimed"] > 0 and late["vtoken"]["pending_pages"] == 0


def test_quiet_decode_steps_read_nothing_from_the_device(naive_and_vtoken):
    """A decode step whose eviction round has nothing to do (no request over budget, no plan, nothing to release)
    makes no device-to-host read in vToken's hooks (what upstream's decode step has), with the overlap scheduler
    (``late``) and without it (``serial``); most steps are such steps (``VTOKEN_SGLANG_COUNT_HOST_READS``)."""
    for mode in ("late", "serial"):
        st = naive_and_vtoken[mode]["vtoken"]
        assert st["host_reads_steps"] == st["decode_steps"] > 0, mode
        assert st["host_reads_quiet_steps"] > st["host_reads_steps"] // 2, (mode, st)
        assert st["host_reads_quiet_max"] == 0, (mode, st["host_reads_quiet_where"])
        assert st["host_reads_busy_max"] > 0, (mode, st)  # the counter sees the reads of busy rounds


def test_overlap_scheduler_on_and_off_identical(naive_and_vtoken):
    """SGLang's overlap scheduler prepares step N+1 before step N's results are processed; vToken's eviction round
    runs after forward N and before N+1 is prepared in both loops: the same victims and tokens. (Reclaim plans are
    pool-wide and may differ: under overlap, requests that end at step N still hold their pages at that round.)"""
    overlap, serial = naive_and_vtoken["worker"], naive_and_vtoken["serial"]  # both: fences done at once
    assert "'disable_overlap_schedule': False" in overlap["log"] and "'disable_overlap_schedule': True" in serial["log"]
    assert overlap["ids"] == serial["ids"] and overlap["one"] == serial["one"]
    for key in ("tokens_evicted", "digest_victims"):
        assert overlap["vtoken"][key] == serial["vtoken"][key], key
    assert overlap["vtoken"]["pages_reclaimed"] > 0 and serial["vtoken"]["pages_reclaimed"] > 0


def test_worker_planner_survives_kill(naive_and_vtoken):
    """Plans from the worker process were applied; after kill -9 the worker came back (log line and metric),
    planning never ran in the scheduler, and the server's shutdown left no worker behind."""
    st, log = naive_and_vtoken["worker"]["vtoken"], naive_and_vtoken["worker"]["log"]
    assert st["plans_admitted"] > 0 and st["pages_reclaimed"] > 0 and st["planner_ms"] == 0
    assert (
        st["worker_restarts"] >= 1 and st["worker_up"] == 1 and st["worker_pid"] != naive_and_vtoken["worker"]["killed"]
    )
    assert "compaction worker" in log and "exited with -9" in log
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and os.path.exists(f"/proc/{st['worker_pid']}"):
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{st['worker_pid']}")


def test_decode_positions_are_logical_after_eviction(naive_and_vtoken):
    """Checked in the server against SGLang's own request bookkeeping (prompt + generated - 1), every decode step."""
    for mode in ("naive", "serial", "worker", "late"):
        st = naive_and_vtoken[mode]["vtoken"]
        assert st["requests_managed"] > 0 and st["position_checks"] > 1000
        assert st["position_mismatches"] == 0


def test_hook_time_is_broken_down_by_hook(naive_and_vtoken):
    """``hook_ms_by_hook`` names the hooks that ran and adds up to ``hook_ms``."""
    st = naive_and_vtoken["worker"]["vtoken"]
    by = st["hook_ms_by_hook"]
    assert {"register_decode_slots", "run_eviction_round", "alloc_decode_slots", "release_request"} <= set(by)
    assert all(v >= 0 for v in by.values()) and st["hook_ms"] > 0
    assert abs(sum(by.values()) - st["hook_ms"]) <= 0.001 * len(by) + 1e-6


def test_reclaim_frees_pages(naive_and_vtoken):
    naive = naive_and_vtoken["naive"]["vtoken"]
    assert naive["pages_reclaimed"] == 0 and naive["plans_admitted"] == 0
    for mode in ("late", "serial"):
        vtoken = naive_and_vtoken[mode]["vtoken"]
        assert vtoken["pages_reclaimed"] > 0 and vtoken["plans_admitted"] > 0 and vtoken["tokens_moved"] > 0, mode
        assert vtoken["peak_tracked_pages"] < naive["peak_tracked_pages"], mode
        assert vtoken["peak_pool_pages"] < naive["peak_pool_pages"], mode


def test_no_leaks(naive_and_vtoken):
    for mode in ("naive", "serial", "worker", "late"):
        r = naive_and_vtoken[mode]
        assert r["healthy"], r["log"][-3000:]
        assert r["vtoken"]["live_tokens"] == 0 and r["vtoken"]["allocated_pages"] == 0
        assert "memory leak" not in r["log"] and "Traceback" not in r["log"]


def test_router_over_two_vtoken_servers(naive_and_vtoken):
    """Two vToken servers (``late``: overlap scheduler, late fences; ``worker``: the compaction worker, restarted
    once) behind SGLang's router, after their own loads: none of the concurrent requests is refused (the router
    answers ``/health`` before it has registered its workers; ``SglangRouter`` waits until ``/readiness`` reports
    both healthy), every one has its length, both servers evict and reclaim for the routed load, and nothing leaks."""
    r = naive_and_vtoken["router"]
    refused = [o for o in r["outs"] if "error" in o]
    assert not refused, (len(refused), refused[0], r["router_log"])
    assert all(len(o["output_ids"]) == ROUTED_TOKENS for o in r["outs"])
    for before, after, log, healthy in zip(r["before"], r["after"], r["logs"], r["healthy"]):
        assert after["tokens_evicted"] > before["tokens_evicted"], (before, after)
        assert after["pages_reclaimed"] > before["pages_reclaimed"], (before, after)
        assert after["allocated_pages"] == 0 and after["pending_pages"] == 0, after
        assert after["position_mismatches"] == 0, after
        assert healthy and "memory leak" not in log and "Traceback" not in log


def test_metadata_is_sized_by_the_pool(naive_and_vtoken):
    """SGLang gives these servers 2048 request rows of 32768 tokens (its defaults for this model and pool): the
    row store is 256 MiB, the 16K-token KV pool 16 MiB. vToken's own device memory grows with the pool: a few
    bytes per KV slot and per row, reported beside the pool's size and in the start-up log."""
    for mode in ("naive", "late"):
        r = naive_and_vtoken[mode]
        st = r["vtoken"]
        assert 0 < st["vtoken_device_bytes"] < 0.02 * st["kv_pool_bytes"], st
        assert st["vtoken_device_bytes"] < 2048 * 32768 * 4 / 1000  # the row store: 1000 times what vToken holds
        assert "[vtoken] device memory: " in r["log"] and "max_running_requests=2048, context_len=32768" in r["log"]


def test_integrity_checked_in_the_running_server(naive_and_vtoken):
    """conftest turns VTOKEN_SGLANG_CHECK_INTEGRITY on: every server checked its invariants during the load and
    at idle, and none failed (a failure raises in the scheduler and the server dies)."""
    for mode in ("naive", "serial", "worker", "late"):
        r = naive_and_vtoken[mode]
        assert r["vtoken"]["integrity_checks"] > 0, mode
        assert "integrity check failed" not in r["log"], r["log"][-3000:]


def test_tokens_equal_transformers_with_the_evicted_tokens_masked(naive_and_vtoken, tiny_model):
    """The late-fence server's tokens (random victims, relocation, the overlap scheduler, prompts sharing a prefix
    in the radix tree) are transformers' greedy tokens with each query's mask hiding exactly the positions the
    server's victim log says it evicted before that query; without the mask, some of them differ (eviction changed
    what the model saw)."""
    from masked_reference import load, masked_greedy
    from transformers import AutoTokenizer

    r, model = naive_and_vtoken["late"], load(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert r["vtoken"]["tokens_moved"] > 0
    changed = 0
    for prompt, n, rid, output in zip(PROMPTS, r["prompt_tokens"], r["rids"], r["ids"]):
        ids = tok(prompt)["input_ids"]
        events = r["victims"].get(rid, [])
        assert len(ids) == n and events, rid
        assert output == masked_greedy(model, ids, output, events), rid
        changed += masked_greedy(model, ids, output, []) != output
    assert changed, "eviction changed no output: the masked reference would not see a wrong mask"


def test_tree_pages_are_what_the_model_computes_without_eviction(naive_and_vtoken, tiny_model):
    """The radix tree's slots are never moved or changed: a later request reusing a prefix shared by requests that
    evicted (and, under vToken, whose private pages were compacted) gets from the tree exactly the K/V of its
    prompt: its next token's top logprobs are transformers' over the whole prompt."""
    from masked_reference import load
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model)(REUSE_PROMPT)["input_ids"]
    with torch.no_grad():
        logprobs = load(tiny_model)(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    want = logprobs.topk(5)
    naive = naive_and_vtoken["naive"]["reuse"]
    for mode in ("naive", "late"):
        got = naive_and_vtoken[mode]["reuse"]
        assert got["cached"] == naive["cached"] > 0 and got["ids"] == [want.indices[0].item()], mode
        assert [t for t, _ in got["top"]] == want.indices.tolist(), mode
        assert [lp for _, lp in got["top"]] == pytest.approx(want.values.tolist(), abs=1e-4), mode


PRESSURE = ["--max-total-tokens", "1024", "--schedule-conservativeness", "0.05", "--max-running-requests", "8"]


def test_pressure_aborts_and_retraction(tiny_model):
    """A 1024-token pool that SGLang fills (it admits with 5% of its usual reservation, up to 8 requests):
    Naive-Evict, and vToken with late fences (conftest: delay 4; fences done at once are the easier case).

    1. Eight requests of 300 tokens sent together, more than the pool holds at their budgets: Naive-Evict keeps
       the pages of its scattered victims, runs a few at a time and retracts; vToken reclaims them (a reclaim
       under pressure waits for its copies and returns what it freed) and runs more of them at once: the same
       tokens in far fewer decode steps. Naive-Evict retracts: at conservativeness 0.05 SGLang over-admits by
       design. (Whether a round also reopens a closed admission here depends on when the refusal falls:
       test_admission checks reopening on a load made for it.)
    2. Sixteen requests on vToken: decode steps that would not fit reclaim first (sources of earlier plans still
       in their grace period included) and free pages.
    3. Sixteen ``ignore_eos`` requests on vToken, three aborted mid-generation, into the same pool.
    Naive-Evict runs 1 only (crowds and aborts under eviction without reclaim: test_server's and SGLang's paths).
    Every request ends, SGLang's strict idle memory check stays quiet, vToken holds no page afterwards."""
    import concurrent.futures as cf
    import urllib.error
    import urllib.request

    prompts = [("Memory is the scarce resource of serving. " * 5) + str(i) for i in range(16)]
    modes = {"off": STRICT, "late": STRICT}
    servers = {
        mode: SglangServer(
            tiny_model,
            default_server_args() + EVICT + PRESSURE + ["--vtoken-reclaim", "off" if mode == "off" else "on"],
            env=env,
        )
        for mode, env in modes.items()
    }

    def retractions(outs: list) -> int:
        return sum(o["meta_info"].get("num_retractions", 0) for o in outs)

    def abort_three(s: SglangServer) -> list[dict]:
        """Sixteen ``ignore_eos`` requests, three aborted after 4 s: the answers that came back."""

        def gen(i):
            body = {
                "text": prompts[i],
                "rid": f"r{i}",
                "sampling_params": {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True},
            }
            try:
                return s.post("/generate", body)
            except urllib.error.HTTPError as err:  # an aborted request answers with an error status
                return {"aborted": err.code}

        with cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(gen, i) for i in range(16)]
            time.sleep(4)
            for i in (1, 4, 7):
                req = urllib.request.Request(
                    s.url + "/abort_request",
                    data=json.dumps({"rid": f"r{i}"}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                urllib.request.urlopen(req, timeout=30).read()
            return [r for r in (f.result() for f in futures) if "output_ids" in r]

    def run(mode: str, s: SglangServer) -> dict:
        info = lambda: s.get("/get_server_info")["internal_states"][0]["vtoken"]  # noqa: E731
        out = {"together": s.generate(prompts[:8], 300)}
        out["after_together"] = info()
        if mode == "late":
            with cf.ThreadPoolExecutor(16) as pool:
                out["crowd"] = list(pool.map(lambda p: s.generate(p, 300), prompts))
            out["after_crowd"] = info()
            out["aborts"] = abort_three(s)
        time.sleep(3)
        return {**out, "idle": info(), "log": s.log_text(), "healthy": s.proc.poll() is None}

    runs = on_servers(servers, run)
    off, late = runs["off"], runs["late"]
    steps = {mode: r["after_together"]["decode_steps"] for mode, r in runs.items()}
    print({mode: (retractions(r["together"]), steps[mode]) for mode, r in runs.items()}, retractions(late["crowd"]))
    # 1: more of the eight at once (decode steps count the warm-up's few too)
    assert retractions(off["together"]) > 0
    assert steps["late"] < 0.75 * steps["off"], steps
    assert late["after_together"]["reclaim_on_pressure"] > 0, late["after_together"]
    # 2: reclaim under pressure frees pages, with late fences too (and every request completes)
    grew = late["after_crowd"]["reclaim_on_pressure"] - late["after_together"]["reclaim_on_pressure"]
    assert grew > 0 and late["after_crowd"]["pages_freed_on_pressure"] > 0, late["after_crowd"]
    assert late["after_crowd"]["release_waits"] > 0
    assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in late["crowd"])
    # 3: aborts
    assert len(late["aborts"]) >= 13 and all(
        len(o["output_ids"]) == 300 for o in late["aborts"] if o["meta_info"]["finish_reason"]["type"] == "length"
    )
    for r in runs.values():
        st = r["idle"]
        assert st["tokens_evicted"] > 0 and st["live_tokens"] == 0 and st["allocated_pages"] == 0, st
        assert st["pending_pages"] == 0 and st["reserved_pages"] == 0, st
        assert r["healthy"] and "memory leak" not in r["log"] and "Traceback" not in r["log"]
