"""vToken on a real pretrained checkpoint: SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, its chat template),
built by the project from the GGUF of a registry package (``vtoken_sglang.tools.pretrained``), float32, real SGLang
on CPU.

Chat prompts of English text (every one opens with the template's system prompt, so their first page is one radix
tree page for all) are served under streaming and h2o (decode scores) and snapkv (prefill scores), with relocation,
copy-on-write of the tree's pages, late fences and the overlap scheduler on. Each request must equal transformers
fed the same tokens with the positions the server's victim log says were evicted hidden from each later query
(``masked_reference``); the request that stays under budget must equal the unmasked model; eviction must change
some output (else a wrong mask would go unseen). Naive-Evict against vToken on this checkpoint: the quick quality
run below."""

from __future__ import annotations

import json

import pytest
from conftest import PY, STRICT, greedy_with_victims, on_servers, run_all
from masked_reference import load, masked_greedy

from vtoken_sglang.tools import launcher

pytestmark = pytest.mark.server

SINKS, RECENT, BUDGET = 4, 16, 48
QUESTIONS = (
    "What is two plus two?",  # under budget with its answer: never evicted
    "Explain in two sentences why the sky looks blue during the day and red at sunset.",
    "A library lends books for three weeks. Maria borrowed four novels on the first of May and returned two of them "
    "after ten days. When must she return the other two, and what happens if she keeps them longer?",
    "Write a short note to a neighbour asking them to water the tomatoes, feed the cat twice a day and collect the "
    "post while you are away for a week in the mountains. Mention where the spare key is hidden.",
    "Summarise the difference between a page of memory and a single token in a language model's key-value cache, "
    "and say why freeing single tokens does not give memory back to a paged allocator.",
)
NEW_TOKENS = (12, 40, 40, 40, 40)
POLICIES = {
    "streaming": [],
    "h2o": [],
    "snapkv": ["--vtoken-window", "8"],
}


def chat_prompts(path: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def real_runs(smollm2, tmp_path_factory):
    """policy -> {prompts, outputs, events (per prompt), vtoken state, log}: vToken under each policy."""
    logs = tmp_path_factory.mktemp("victims")
    base = ["--enable-vtoken", "--vtoken-budget", str(BUDGET), "--vtoken-sinks", str(SINKS)]
    base += ["--vtoken-recent", str(RECENT)]
    servers = {}
    for name, extra in POLICIES.items():
        flags = base + ["--vtoken-policy", name, *extra]
        env = {**STRICT, "VTOKEN_SGLANG_VICTIM_LOG": str(logs / f"{name}.jsonl")}
        servers[name] = launcher.SglangServer(smollm2, launcher.default_server_args(4096) + flags, env=env)
    ids = chat_prompts(smollm2)

    return on_servers(servers, lambda name, s: greedy_with_victims(s, name, ids, NEW_TOKENS, logs / f"{name}.jsonl"))


@pytest.fixture(scope="module")
def reference(smollm2):
    return load(smollm2)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_real_model_equals_transformers_with_the_evicted_tokens_masked(real_runs, reference, policy):
    r = real_runs[policy]
    m = r["vtoken"]
    assert "integrity check failed" not in r["log"] and m["position_mismatches"] == 0, r["log"][-3000:]
    assert m["tokens_evicted"] > 0, m
    if policy != "streaming":  # streaming's victims here are the prompt's tokens, in the tree's pages
        assert m["tokens_moved"] > 0 and m["pages_reclaimed"] > 0, m  # relocation ran
    changed = False
    for i, (prompt, output, events) in enumerate(zip(r["prompts"], r["outputs"], r["events"])):
        assert len(output) == NEW_TOKENS[i]
        assert (events == []) == (len(prompt) + NEW_TOKENS[i] <= BUDGET), (i, len(prompt), events)
        want = masked_greedy(reference, prompt, output, events)
        assert output == want, f"request {i} ({len(prompt)} prompt tokens): server {output} vs transformers {want}"
        # one request that eviction changed is enough (each unmasked forward costs a long prompt's)
        changed = changed or (events != [] and masked_greedy(reference, prompt, output, []) != output)
    assert changed, "eviction changed no output: the masked reference would not see a wrong mask"


def test_real_model_copies_the_shared_tree_page_on_write(real_runs):
    """Every prompt opens with the chat template's system prompt: its first page is one radix tree page for all."""
    copies = {p: real_runs[p]["vtoken"]["cow_copies"] for p in POLICIES}
    assert any(copies.values()), copies


def test_quality_quick_mode_on_the_real_model(tmp_path):
    """``quality.py --quick``: in real SGLang, SmolLM2 under h2o at ratio 0.5 finds the pass keys (so the task is
    solvable; the full cache's run is the full benchmark's) where random loses them; on a pool too small for
    Naive-Evict to run every request at once, h2o gives the same tokens with reclaim off (Naive-Evict) and on for
    every request Naive-Evict did not retract, and vToken (both policies) runs every request at once, none
    retracted, the prompts' tree pages copied out and released, room made by evicting tree pages released before;
    the benchmark writes its table and JSON."""
    out = tmp_path / "quality.json"
    (run,) = run_all([[PY, "benchmark/quality.py", "--quick", "--json", str(out)]], timeout=1500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "accuracy" in run.stdout and "cow_rel" in run.stdout
    runs = {(r["policy"], r["budget_ratio"], r["mode"]): r for r in json.loads(out.read_text())["runs"]}
    assert {r["task"] for r in runs.values()} == {"passkey"}, runs
    assert runs["h2o", 0.5, "vtoken"]["accuracy"] >= 0.95 > runs["random", 0.5, "vtoken"]["accuracy"], runs
    assert set(runs) == {("random", 0.5, "vtoken"), ("h2o", 0.5, "naive"), ("h2o", 0.5, "vtoken")}, set(runs)
    naive, h2o = runs["h2o", 0.5, "naive"], runs["h2o", 0.5, "vtoken"]
    prompts = h2o["prompts"]
    assert h2o["identical_to_naive"] and naive["tokens_evicted"] > 0, (naive, h2o)
    assert h2o["compared"] == prompts - naive["retracted"] >= prompts // 2, (naive, h2o)
    assert naive["max_running_requests"] < prompts and naive["cow_copies"] == naive["pages_reclaimed"] == 0, naive
    assert h2o["peak_held_pages"] < naive["peak_held_pages"], (naive, h2o)
    for policy in ("random", "h2o"):
        vtoken = runs[policy, 0.5, "vtoken"]
        assert vtoken["tokens_evicted"] > 0 and vtoken["retracted"] == 0, vtoken
        assert vtoken["max_running_requests"] == prompts, vtoken
        assert vtoken["cow_pages_released"] > 0 and vtoken["cow_room_pages"] > 0, vtoken


def test_sharegpt_capacity_on_the_real_model(tmp_path):
    """bench_serving's default workload, CI-sized: 24 ShareGPT first turns (prompts of 6 to 931 tokens) through
    ``serve_capacity.py`` on SmolLM2, random at ratio 0.5, 64 new tokens each, a pool of 2048: vToken runs more
    requests at once than Naive-Evict, with identical tokens, no request lost and no retraction Naive-Evict does not
    also make. (The full-size table: benchmark/SHAREGPT.md.)"""
    out = tmp_path / "capacity.json"
    cmd = [PY, "benchmark/serve_capacity.py", "--quick", "--requests", "24", "--output-len", "64"]
    (run,) = run_all([[*cmd, "--max-total-tokens", "2048", "--json", str(out)]], timeout=1500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    naive, vtoken = runs["naive"], runs["vtoken"]
    print({m: (r["max_running_requests"], r["ideal_running"], r["retractions"]) for m, r in runs.items()})
    assert naive["dataset"] == vtoken["dataset"] == "sharegpt" and vtoken["requests"] == 24
    assert vtoken["identical_to_naive"] and vtoken["vtoken"]["tokens_evicted"] > 0, vtoken
    assert vtoken["max_running_requests"] > naive["max_running_requests"], (naive, vtoken)
    assert vtoken["retractions"] <= naive["retractions"], (naive, vtoken)
