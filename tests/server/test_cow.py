"""Copy-on-write of radix-tree prefix pages in real SGLang (CPU, tiny model, page 16, radix cache on): the same
loads with ``--vtoken-cow on`` and ``off`` give identical greedy tokens (the same victims; copy-on-write only
changes where live tokens are), the shared prompt's pages are released by the requests that copied, the tree's
slots stay untouched for later requests, a prefix that does not pay is not copied, and nothing leaks."""

import json
import time

import pytest
from conftest import PY, REPO, STRICT, on_servers, prometheus_values, run_all

from vtoken_sglang.tools.bench_load import bench_serving_command, random_ids_load
from vtoken_sglang.tools.launcher import SglangServer, default_server_args

pytestmark = pytest.mark.server

# streaming keeps the 4 sinks and the 64 newest tokens: once a request has generated past its window, only the
# sinks of its (long) prompt are live for it
FLAGS = [
    "--enable-vtoken",
    "--vtoken-policy",
    "streaming",
    "--vtoken-budget",
    "80",
    "--vtoken-recent",
    "64",
    "--vtoken-sinks",
    "4",
]
SYSTEM = "You are a careful assistant. Answer briefly and cite the page you used. " * 24  # ~58 pages
SHARED = [SYSTEM + f"Question {i}: what is {i} plus {i}?" for i in range(6)]
# 8 requests over a ~5-page prompt: each must keep its sinks (a page) live, 8 pages of copies for 5: never pays
CROWD = [("Reply in one word. Be terse. " * 8) + f"Case {i}." for i in range(8)]


@pytest.fixture(scope="module")
def cow_runs(tiny_model, tmp_path_factory):
    modes = ("on", "off")
    servers = {
        cow: SglangServer(
            tiny_model,
            default_server_args() + FLAGS + ["--vtoken-cow", cow, "--enable-metrics", "--decode-log-interval", "10"],
            log_path=tmp_path_factory.mktemp(f"cow_{cow}") / "server.log",
            env=STRICT,
        )
        for cow in modes
    }
    results = {}

    def run(cow: str, s: SglangServer) -> dict:
        info = lambda: s.get("/get_server_info")["internal_states"][0]["vtoken"]  # noqa: E731
        shared = [o["output_ids"] for o in s.generate(SHARED, 120, ignore_eos=True)]
        after_shared = info()
        crowd = [o["output_ids"] for o in s.generate(CROWD, 120, ignore_eos=True)]
        after_crowd = info()
        # a later request over the shared prompt, read from the tree's (never rewritten) pages
        probe = s.post(
            "/generate",
            {
                "text": SHARED[2],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "top_logprobs_num": 5,
            },
        )["meta_info"]
        fork, gsp = run_programs(s, tiny_model, tmp_path_factory.mktemp(f"gsp_{cow}") / "gsp.jsonl")
        time.sleep(2)  # idle: SGLang's strict memory check runs
        out = {
            "shared": shared,
            "crowd": crowd,
            "after_shared": after_shared,
            "after_crowd": after_crowd,
            "probe": (meta_top(probe), probe["cached_tokens"]),
            "fork": fork,
            "gsp": gsp,
            "idle": info(),
        }
        if cow == "on":  # one more load, on this server only: bench_serving and the shared-document program
            results["bench"] = run_bench_and_qa(s, tiny_model, tmp_path_factory.mktemp("bench") / "bench.jsonl")
            time.sleep(2)
            results["bench"].update(state=info(), metrics=prometheus_values(s.get_text("/metrics")))
        out.update(log=s.log_text(), healthy=s.proc.poll() is None)
        return out

    results.update(on_servers(servers, run))
    return results


def run_bench_and_qa(server: SglangServer, model: str, out) -> dict:
    bench = bench_serving_command(server.url, model, out, *random_ids_load(24, 200, 96), seed=2)
    qa = [
        PY,
        str(REPO / "python/long_doc_qa.py"),
        "--url",
        server.url,
        "--questions",
        "5",
        "--doc-words",
        "400",
        "--max-tokens",
        "120",
    ]
    run, qa_run = run_all([bench, qa], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert qa_run.returncode == 0, qa_run.stderr[-3000:]
    result = json.loads(out.read_text().strip().splitlines()[-1])
    return {
        "completed": result["completed"],
        "throughput": result["output_throughput"],
        "answers": json.loads(qa_run.stdout),
    }


def meta_top(meta: dict) -> list:
    return [(t[1], round(t[0], 4)) for t in meta["output_top_logprobs"][0]]


def run_programs(server: SglangServer, model: str, gsp_out) -> tuple:
    """The fork program (branches share the conversation through the tree) and bench_serving's generated shared
    prefix dataset (3 system prompts, 4 questions each)."""
    bench = bench_serving_command(
        server.url,
        model,
        gsp_out,
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        "3",
        "--gsp-prompts-per-group",
        "4",
        "--gsp-system-prompt-len",
        "240",
        "--gsp-question-len",
        "16",
        "--gsp-output-len",
        "120",
        seed=3,
    )
    fork_run, gsp_run = run_all(
        [
            [
                PY,
                str(REPO / "python/multi_turn_fork.py"),
                "--url",
                server.url,
                "--branches",
                "3",
                "--max-tokens",
                "100",
            ],
            bench,
        ],
        timeout=600,
    )
    assert fork_run.returncode == 0, fork_run.stderr[-3000:]
    assert gsp_run.returncode == 0, gsp_run.stderr[-3000:]
    return json.loads(fork_run.stdout), json.loads(gsp_out.read_text().strip().splitlines()[-1])["completed"]


def test_identical_tokens_with_and_without_copy_on_write(cow_runs):
    on, off = cow_runs["on"], cow_runs["off"]
    assert on["after_shared"]["tokens_evicted"] > 0
    assert on["shared"] == off["shared"] and on["crowd"] == off["crowd"]
    assert on["fork"] == off["fork"] and on["gsp"] == off["gsp"] == 12
    assert on["idle"]["digest_victims"] == off["idle"]["digest_victims"]
    for run in (on, off):
        assert run["idle"]["position_checks"] > 1000 and run["idle"]["position_mismatches"] == 0


def test_shared_prompt_pages_are_released_and_held_pages_drop(cow_runs):
    on, off = cow_runs["on"]["after_shared"], cow_runs["off"]["after_shared"]
    assert on["cow_copies"] >= len(SHARED) and on["cow_tokens_copied"] > 0
    assert on["cow_pages_released"] >= 50  # the shared prompt's ~58 pages, once every holder copied
    assert "cow_copies" not in off
    assert on["peak_held_pages"] < off["peak_held_pages"]
    assert "[vtoken] copy-on-write:" in cow_runs["on"]["log"] or on["cow_copies"] > 0


def test_tree_pages_untouched_for_later_requests(cow_runs):
    """The probe reads the shared prompt from the tree: the same top logprobs as without copy-on-write."""
    on, off = cow_runs["on"]["probe"], cow_runs["off"]["probe"]
    assert on[1] >= 50 * 16 and on[1] == off[1]  # the prompt came from the tree
    assert on[0] == off[0]


def test_not_copied_when_it_does_not_pay(cow_runs):
    """Eight live holders of a five-page prompt: their copies would need more pages than the tree gives back."""
    st = cow_runs["on"]
    assert st["after_crowd"]["tokens_evicted"] > st["after_shared"]["tokens_evicted"]
    assert st["after_crowd"]["cow_tokens_copied"] == st["after_shared"]["cow_tokens_copied"]


def test_programs_copy_and_nothing_leaks(cow_runs):
    for cow in ("on", "off"):
        run = cow_runs[cow]
        assert run["healthy"], run["log"][-3000:]
        assert run["idle"]["allocated_pages"] == 0 and run["idle"]["live_tokens"] == 0
        assert "memory leak" not in run["log"] and "Scheduler hit an exception" not in run["log"]
    chats = cow_runs["on"]["fork"]  # the fork program's two conversations, each with its three branches
    assert len(chats) == 2 and all(len(c["details"]) == 3 and isinstance(c["summary"], str) for c in chats)
    # the fork and shared-prefix programs copied too
    assert cow_runs["on"]["idle"]["cow_copies"] > cow_runs["on"]["after_crowd"]["cow_copies"]


def test_bench_and_shared_document_program_and_metrics(cow_runs):
    """bench_serving and the shared-document program run against the copy-on-write server; vToken's metrics are in
    SGLang's periodic log and in Prometheus /metrics (counters equal to /get_server_info, idle gauges at 0)."""
    bench, log = cow_runs["bench"], cow_runs["on"]["log"]
    assert bench["completed"] == 24 and bench["throughput"] > 0
    assert len(bench["answers"]) == 5 and all(isinstance(a["answer"], str) for a in bench["answers"])
    state, metrics = bench["state"], bench["metrics"]
    assert state["allocated_pages"] == 0 and state["position_mismatches"] == 0
    assert "[vtoken] live: " in log and ", reclaimed pages: " in log
    for name in (
        "tokens_evicted",
        "pages_reclaimed",
        "tokens_moved",
        "plans_admitted",
        "planner_ms",
        "cow_copies",
        "cow_tokens_copied",
        "cow_pages_released",
        "cow_room_pages",
        "cow_deferred",
    ):
        assert metrics[f"sglang:vtoken_{name}_total"] == pytest.approx(state[name], rel=1e-3), name
    assert metrics["sglang:vtoken_cow_copies_total"] > 0
    assert metrics["sglang:vtoken_allocated_pages"] == 0 and metrics["sglang:vtoken_live_tokens"] == 0  # idle values
    assert metrics["sglang:vtoken_pending_pages"] == 0
    assert {
        "sglang:vtoken_fragmentation",
        "sglang:vtoken_resident_dead_tokens",
        "sglang:vtoken_plans_rejected_total",
        "sglang:vtoken_plans_stale_total",
        "sglang:vtoken_copy_ms_total",
    } <= set(metrics)
