"""Sliding-window models under eviction (real SGLang on CPU, tiny random models with a 16-token window): a sliding
layer's decode query at logical position q sees exactly the live tokens whose logical position is in its window,
on a row compacted by eviction and relocation, on torch_native and on SGLang's Triton backend (its kernels under
the Triton interpreter, whose decode window is one position shorter than its prefill's: the reference follows it).

The reference is the same checkpoint in transformers, fed the server's tokens, with the evicted positions masked
(``masked_reference``) on every layer and, on the sliding layers, the window by logical position; the greedy
token must be the server's at every step. Budgets below the window (every in-window token of a request can be
evicted) and above it (the window reaches past evicted tokens), prompts longer than the window, a request that
stays under budget for its whole life (compared with the unmasked model, across the window), relocation,
copy-on-write of the prompts' tree pages, late fences (conftest) and SGLang's overlap scheduler on; nothing leaks
(SGLang's strict idle check, vToken's idle state). On the Triton backend every kernel of SGLang's GPU attention path
runs interpreted (extend and decode attention with two KV splits, the kv indices gathered from ``req_to_token``, each
row's last slot), and h2o's scores come from vToken's own Triton kernel. The real Gemma-3-270M is
``test_real_gemma3``'s."""

import pytest
import torch
from conftest import STRICT, greedy_with_victims, idle_states, on_servers
from masked_reference import load, masked_greedy, sliding_window

from vtoken_sglang.tools import launcher, tiny_families

pytestmark = pytest.mark.server

PROMPT_LENS = (10, 30, 45)
NEW_TOKENS = (12, 20, 20)
# server -> (family, attention backend, policy flags); window 16: budgets 12 (below) and 24 (above)
H2O_12 = ["--vtoken-policy", "h2o", "--vtoken-budget", "12", "--vtoken-sinks", "2", "--vtoken-recent", "4"]
H2O_24 = ["--vtoken-policy", "h2o", "--vtoken-budget", "24", "--vtoken-recent", "8"]
SERVERS = {
    "gemma3-h2o-12": ("gemma3", "torch_native", H2O_12),
    "gemma2-h2o-24": ("gemma2_window", "torch_native", H2O_24),
    "gemma3-triton-h2o-12": ("gemma3", "triton", H2O_12),
}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def window_runs(tmp_path_factory):
    """server -> {path, backend, prompts, outputs, events (per prompt), vtoken metrics, log}."""
    from transformers import AutoConfig

    logs = tmp_path_factory.mktemp("victims")
    servers, paths = {}, {}
    for name, (family, backend, flags) in SERVERS.items():
        paths[name] = str(tiny_families.build(family))
        env = {**STRICT, "VTOKEN_SGLANG_VICTIM_LOG": str(logs / f"{name}.jsonl")}
        args = launcher.default_server_args(4096, cpu_attention=backend) + ["--enable-vtoken", *flags]
        if backend == "triton":
            env["TRITON_INTERPRET"] = "1"
            args += ["--triton-attention-num-kv-splits", "2"]
        servers[name] = launcher.SglangServer(paths[name], args, env=env)

    def run(name, server):
        ids = prompts(AutoConfig.from_pretrained(paths[name]).vocab_size)
        got = greedy_with_victims(server, name, ids, NEW_TOKENS, logs / f"{name}.jsonl")
        return {**got, "path": paths[name], "backend": SERVERS[name][1], "idle": idle_states(server)[0]}

    return on_servers(servers, run)


@pytest.mark.parametrize("name", SERVERS)
def test_sliding_windows_by_logical_position_equal_transformers(window_runs, name):
    r = window_runs[name]
    m = r["vtoken"]
    assert "integrity check failed" not in r["log"] and m["position_mismatches"] == 0, r["log"][-3000:]
    assert m["tokens_evicted"] > 0 and m["tokens_moved"] > 0 and m["pages_reclaimed"] > 0, m  # relocation ran
    assert m["cow_copies"] > 0 and "'disable_overlap_schedule': False" in r["log"], m
    idle = r["idle"]
    assert idle["live_tokens"] == idle["allocated_pages"] == idle["pending_pages"] == 0, idle
    assert "memory leak" not in r["log"] and "Traceback" not in r["log"]
    if r["backend"] == "triton":  # h2o's scores from vToken's Triton kernel, interpreted, every decode step
        assert "'attention_backend': 'triton'" in r["log"]
        assert "[vtoken] scoring with the Triton kernel (interpreted)" in r["log"]
        assert m["steps_scored"] > 0 and m["steps_unscored"] == 0, m
    model = load(r["path"])
    window = sliding_window(model.config)
    assert window == 16 and max(PROMPT_LENS) > window
    span = window - 1 if r["backend"] == "triton" else window  # SGLang's Triton decode window
    changed = 0
    for i, (prompt, output, events) in enumerate(zip(r["prompts"], r["outputs"], r["events"])):
        assert len(output) == NEW_TOKENS[i]
        want = masked_greedy(model, prompt, output, events, decode_span=span)
        assert output == want, f"request {i} ({len(events)} evictions): server {output} vs transformers {want}"
        if events:
            changed += masked_greedy(model, prompt, output, [], decode_span=span) != output
        else:  # under budget for its whole life, across the window: the unmasked model's tokens
            assert len(prompt) + len(output) > window
    assert sum(e != [] for e in r["events"]) >= 2
    assert changed, "eviction changed no output: the masked reference would not see a wrong mask"


def test_a_request_under_budget_crosses_the_window(window_runs):
    """Above the window's budget the short request never evicts while its window slides past its first tokens
    (streaming above the window: the real Gemma-3's, ``test_real_gemma3``)."""
    assert window_runs["gemma2-h2o-24"]["events"][0] == []


def test_the_window_is_what_the_reference_masks(window_runs):
    """The reference with the whole row visible on sliding layers differs from the server (the window matters)."""
    r = window_runs["gemma3-h2o-12"]
    model = load(r["path"])
    model.config.layer_types = ["full_attention"] * len(model.config.layer_types)
    assert any(masked_greedy(model, p, o, e) != o for p, o, e in zip(r["prompts"], r["outputs"], r["events"])), (
        "the window changed nothing: these prompts would not catch a wrong window"
    )
