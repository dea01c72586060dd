"""Sliding windows on a real pretrained checkpoint: Gemma-3-270M (18 layers, 15 of them attending in a 512-token
window, the others to the whole row), built by the project from the GGUF of a registry package
(``vtoken_sglang.tools.pretrained``), float32, real SGLang on CPU (torch_native).

Pass-key prompts of English text longer than the window (about 600, 1,000 and 1,400 tokens) under streaming with a
budget below the window and h2o with a budget above it, relocation and late fences on: every request equals
transformers fed the same tokens with the evicted positions hidden from each later query, and on the sliding layers
the window by logical position (``masked_reference``); the request under h2o's budget (its window slides past its
first tokens) equals the unmasked model; eviction changes some output."""

from __future__ import annotations

import random

import pytest
from conftest import STRICT, greedy_with_victims, on_servers
from masked_reference import load, masked_greedy, sliding_window

from vtoken_sglang.tools import launcher, text_tasks

pytestmark = pytest.mark.server

TARGETS = (600, 1000, 1400)  # prompt tokens (at most)
NEW_TOKENS = 8
SERVERS = {  # window 512: budgets 384 (below) and 640 (above)
    "streaming-384": ["--vtoken-policy", "streaming", "--vtoken-budget", "384", "--vtoken-recent", "128"],
    "h2o-640": ["--vtoken-policy", "h2o", "--vtoken-budget", "640", "--vtoken-recent", "64"],
}


def passkey_prompts(path: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(3)
    return [[tok.bos_token_id, *text_tasks.passkey_prompt(tok, n, rng, False).ids] for n in TARGETS]


@pytest.fixture(scope="module")
def gemma3_runs(gemma3, tmp_path_factory):
    """server -> {prompts, outputs, events (per prompt), vtoken metrics, log}."""
    logs = tmp_path_factory.mktemp("victims")
    servers = {}
    for name, flags in SERVERS.items():
        env = {**STRICT, "VTOKEN_SGLANG_VICTIM_LOG": str(logs / f"{name}.jsonl")}
        args = launcher.default_server_args(8192) + ["--enable-vtoken", "--vtoken-sinks", "4", *flags]
        servers[name] = launcher.SglangServer(gemma3, args, env=env)
    ids = passkey_prompts(gemma3)

    return on_servers(servers, lambda name, s: greedy_with_victims(s, name, ids, NEW_TOKENS, logs / f"{name}.jsonl"))


@pytest.fixture(scope="module")
def reference(gemma3):
    return load(gemma3)


@pytest.mark.parametrize("name", SERVERS)
def test_gemma3_equals_transformers_masked_by_victims_and_window(gemma3_runs, reference, name):
    r = gemma3_runs[name]
    m = r["vtoken"]
    assert "integrity check failed" not in r["log"] and m["position_mismatches"] == 0, r["log"][-3000:]
    assert m["tokens_evicted"] > 0, m
    window = sliding_window(reference.config)
    assert window == 512 and all(len(p) > window for p in r["prompts"])
    changed = False
    for i, (prompt, output, events) in enumerate(zip(r["prompts"], r["outputs"], r["events"])):
        assert len(output) == NEW_TOKENS
        want = masked_greedy(reference, prompt, output, events)
        assert output == want, f"request {i} ({len(prompt)} prompt tokens): server {output} vs transformers {want}"
        # one request that eviction changed is enough (each unmasked forward costs a long prompt's)
        changed = changed or (events != [] and masked_greedy(reference, prompt, output, []) != output)
    if name.startswith("h2o"):
        assert r["events"][0] == [] and all(r["events"][1:]), [len(e) for e in r["events"]]
        # the victims are prompt tokens in the radix tree's pages: the rows move onto private copies of them
        assert m["cow_copies"] > 0, m
    else:
        assert all(r["events"]), [len(e) for e in r["events"]]
    assert changed, "eviction changed no output: the masked reference would not see a wrong mask"
