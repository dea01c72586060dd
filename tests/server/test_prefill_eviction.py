"""Eviction between prefill chunks (``--vtoken-prefill-eviction``) on the real SmolLM2-135M-Instruct (context 8K),
float32, real SGLang on CPU: a pass-key prompt of about 6K tokens, three times a KV pool of 2K tokens, and one of
about 1.5K, in chunks of 512 at a budget of 1K, under streaming, h2o and snapkv, with relocation and late fences on
(the suite's default) and the integrity check.

Every request must be served; the most KV a request held in a chunk's forward (the server's ``peak_extend_kv``)
stays within budget + slack + chunk; each request's tokens equal transformers fed the same tokens with the positions
the victim log says each chunk's round evicted hidden from every later query (``masked_reference``: a chunk round's
event hides its victims from the next chunk's queries on). A prompt beyond the model's context still gets
upstream's one error line, and the server goes on serving. The real Gemma-3-270M (15 sliding layers, window 512):
a prompt of 10K tokens on a pool of 3K equals the reference masked by the victims and by the window at logical
positions, every chunk's round having kept the newest window."""

from __future__ import annotations

import random
import urllib.error

import pytest
from conftest import STRICT, greedy_with_victims, on_servers
from masked_reference import load, masked_greedy

from vtoken_sglang.tools import launcher
from vtoken_sglang.tools.text_tasks import passkey_prompt

pytestmark = pytest.mark.server

SINKS, RECENT, BUDGET, SLACK, CHUNK, POOL = 4, 64, 1024, 16, 512, 2048
LENGTHS = (6000, 1500)
GEMMA_LENGTH, GEMMA_POOL, GEMMA_BUDGET = 10_000, 3072, 1024  # window 512: each round keeps its newest 512
NEW_TOKENS = 8
POLICIES = {
    "streaming": [],
    "h2o": [],
    "snapkv": ["--vtoken-window", "8"],
}


def flags(policy: str, extra: list[str]) -> list[str]:
    return launcher.default_server_args(POOL) + [
        "--enable-vtoken",
        "--vtoken-policy",
        policy,
        "--vtoken-budget",
        str(BUDGET),
        "--vtoken-sinks",
        str(SINKS),
        "--vtoken-recent",
        str(RECENT),
        "--vtoken-prefill-eviction",
        "on",
        "--chunked-prefill-size",
        str(CHUNK),
        *extra,
    ]


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    rng = random.Random(5)
    return [passkey_prompt(tok, n, rng, question_first=i % 2 == 1).ids for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def runs(smollm2, gemma3, prompts, tmp_path_factory):
    """policy -> {prompts, outputs, events, vtoken, log}: each policy's SmolLM2 server, one batch of both prompts;
    on streaming's, then a prompt beyond the context (``too_long``: its answer), and the short prompt again
    (``after``); ``gemma3``: the Gemma-3 server's run (``gemma3_server``). The servers start together."""
    logs = tmp_path_factory.mktemp("victims")
    servers = {
        name: launcher.SglangServer(
            smollm2, flags(name, extra), env={**STRICT, "VTOKEN_SGLANG_VICTIM_LOG": str(logs / f"{name}.jsonl")}
        )
        for name, extra in POLICIES.items()
    }
    servers["gemma3"], gemma3_prompts = gemma3_server(gemma3, logs / "gemma3.jsonl")

    def load_one(name, server):
        if name == "gemma3":
            return greedy_with_victims(server, name, gemma3_prompts, NEW_TOKENS, logs / "gemma3.jsonl")
        out = greedy_with_victims(server, name, prompts, NEW_TOKENS, logs / f"{name}.jsonl")
        if name != "streaming":
            return out
        params = {"max_new_tokens": 4, "temperature": 0}
        try:
            out["too_long"] = server.post("/generate", {"input_ids": prompts[0] * 2, "sampling_params": params})
        except urllib.error.HTTPError as err:  # refused: an error status with upstream's message
            out["too_long"] = err.read().decode()
        out["after"] = server.post("/generate", {"input_ids": prompts[1], "sampling_params": params}, timeout=300)
        return out

    return on_servers(servers, load_one)


@pytest.fixture(scope="module")
def reference(smollm2):
    return load(smollm2, attention="sdpa")


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_prompt_three_times_the_pool_is_served_within_budget_and_chunk(runs, policy):
    r = runs[policy]
    m = r["vtoken"]
    assert "integrity check failed" not in r["log"] and m["position_mismatches"] == 0, r["log"][-3000:]
    assert len(r["prompts"][0]) > 2.9 * POOL
    assert all(len(o) == NEW_TOKENS for o in r["outputs"])
    assert m["prefill_rounds"] > 0 and m["prefill_tokens_evicted"] > 0, m
    assert BUDGET < m["peak_extend_kv"] <= BUDGET + SLACK + CHUNK, m
    # every chunk round of the long prompt evicted down to its budget: its events start after its second chunk
    long_events = r["events"][0]
    assert long_events[0][0] <= BUDGET + SLACK + CHUNK and len(long_events) >= len(r["prompts"][0]) // CHUNK - 2


@pytest.mark.parametrize("policy", list(POLICIES))
def test_chunk_evicted_prompts_equal_transformers_with_each_rounds_victims_masked(runs, reference, policy):
    r = runs[policy]
    for i, (prompt, output, events) in enumerate(zip(r["prompts"], r["outputs"], r["events"])):
        want = masked_greedy(reference, prompt, output, events)
        assert output == want, f"request {i} ({len(prompt)} prompt tokens): server {output} vs transformers {want}"
    if policy == "streaming":  # eviction changed what the short prompt's answer saw (else a wrong mask goes unseen)
        prompt, output = r["prompts"][1], r["outputs"][1]
        assert masked_greedy(reference, prompt, output, []) != output


def test_a_prompt_beyond_the_context_gets_one_error_line_and_the_server_goes_on(runs):
    r = runs["streaming"]
    answer = r["too_long"]
    text = str(answer)
    assert "context length" in text or "maximum allowed length" in text, text
    assert len(r["after"]["output_ids"]) == 4


def gemma3_server(gemma3: str, log) -> tuple[launcher.SglangServer, list[list[int]]]:
    """The real Gemma-3-270M (15 of 18 layers in a 512-token window, context 32K) evicting between chunks, and its
    load: one pass-key prompt of 10K tokens on a pool of 3K, streaming at 1K, chunks of 512."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3)
    ids = [[tok.bos_token_id, *passkey_prompt(tok, GEMMA_LENGTH, random.Random(7), question_first=False).ids]]
    args = launcher.default_server_args(GEMMA_POOL) + [
        "--enable-vtoken",
        "--vtoken-policy",
        "streaming",
        "--vtoken-budget",
        str(GEMMA_BUDGET),
        "--vtoken-sinks",
        str(SINKS),
        "--vtoken-recent",
        str(RECENT),
        "--vtoken-prefill-eviction",
        "on",
        "--chunked-prefill-size",
        str(CHUNK),
    ]
    return launcher.SglangServer(gemma3, args, env={**STRICT, "VTOKEN_SGLANG_VICTIM_LOG": str(log)}), ids


def test_gemma3_prompt_over_three_pools_equals_transformers_masked_by_victims_and_window(runs, gemma3):
    r = runs["gemma3"]
    m = r["vtoken"]
    prompt, output, events = r["prompts"][0], r["outputs"][0], r["events"][0]
    assert "integrity check failed" not in r["log"] and m["position_mismatches"] == 0, r["log"][-3000:]
    assert len(prompt) > 3 * GEMMA_POOL and len(output) == NEW_TOKENS
    assert m["prefill_rounds"] > 0 and GEMMA_BUDGET < m["peak_extend_kv"] <= GEMMA_BUDGET + SLACK + CHUNK, m
    # each chunk's round (the ones before the prompt's end) kept the newest window: its sliding layers' next window
    chunk_rounds = [(nxt, evicted) for nxt, evicted in events if nxt < len(prompt)]
    assert len(chunk_rounds) > 10 and all(max(evicted) < nxt - 512 for nxt, evicted in chunk_rounds)
    reference = load(gemma3, attention="sdpa")
    assert output == masked_greedy(reference, prompt, output, events)
