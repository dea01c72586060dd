"""Eviction between prefill chunks on SGLang's Triton attention backend (its kernels under the Triton interpreter:
extend attention over a compacted row's live prefix and the chunk, the sliding layers' extend windows taken by
column, kv indices gathered from ``req_to_token``) against torch_native, on the tiny random Gemma-3 (a 16-token
window on its sliding layers), h2o with the chunks' windows scored, relocation, late fences (conftest) and the
overlap scheduler on.

Prompts of 150 and 90 tokens in chunks of 32 at a budget of 24 (each chunk's round keeps its newest 16 positions,
the window): on both backends every request equals transformers fed the same tokens with each round's victims
hidden from the later queries and the window at logical positions (the Triton backend's decode window is one
position shorter than its prefill's, as ``test_sliding_windows`` says); the prompts' chunks (their extend
attention and windows, where the backends agree) take the same victims on both; nothing leaks.

torch_native's server also serves a streaming session of six turns: each turn extends the session's compacted row,
whose decode rounds keep its newest window (the next turn's extend window is taken by column), and equals the
reference fed the whole conversation with the window at logical positions."""

import pytest
import torch
from conftest import STRICT, greedy_with_victims, idle_states, on_servers
from masked_reference import load, masked_greedy, sliding_window

from vtoken_sglang.integration.observe import victim_log
from vtoken_sglang.tools import launcher, tiny_families
from vtoken_sglang.tools.session_client import Session

pytestmark = pytest.mark.server

PROMPT_LENS, NEW_TOKENS, CHUNK, BUDGET = (150, 90), 10, 32, 24
FLAGS = ["--enable-vtoken", "--vtoken-policy", "h2o", "--vtoken-budget", str(BUDGET), "--vtoken-recent", "8"]
FLAGS += ["--vtoken-prefill-eviction", "on", "--chunked-prefill-size", str(CHUNK)]
BACKENDS = ("torch_native", "triton")
SESSION_TURNS, SESSION_TURN = 6, 12  # a streaming session on torch_native's server: turns of 12 new tokens


@pytest.fixture(scope="module")
def backend_runs(tmp_path_factory):
    """backend -> {prompts, outputs, events, vtoken, log, idle}."""
    from transformers import AutoConfig

    path = str(tiny_families.build("gemma3"))
    g = torch.Generator().manual_seed(5)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    logs = tmp_path_factory.mktemp("victims")
    servers = {}
    for backend in BACKENDS:
        env = {**STRICT, "VTOKEN_SGLANG_VICTIM_LOG": str(logs / f"{backend}.jsonl")}
        args = launcher.default_server_args(4096, cpu_attention=backend) + FLAGS
        if backend == "triton":
            env["TRITON_INTERPRET"] = "1"
            args += ["--triton-attention-num-kv-splits", "2"]
        else:
            args += ["--enable-streaming-session"]
        servers[backend] = launcher.SglangServer(path, args, env=env)
    turns = [torch.randint(3, vocab, (SESSION_TURN,), generator=g).tolist() for _ in range(SESSION_TURNS)]

    def run(name, server):
        got = greedy_with_victims(server, name, ids, NEW_TOKENS, logs / f"{name}.jsonl")
        if name == "torch_native":
            session = Session(server, "sliding")
            for t in turns:
                session.turn(t, NEW_TOKENS)
            session.close()
            got["session"] = session
            got["session_events"] = victim_log.read(logs / f"{name}.jsonl", by="session")[session.id]
        return {**got, "path": path, "idle": idle_states(server)[0]}

    return on_servers(servers, run)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_evicted_prompts_equal_transformers_on_each_backend(backend_runs, backend):
    r = backend_runs[backend]
    m = r["vtoken"]
    assert "integrity check failed" not in r["log"] and m["position_mismatches"] == 0, r["log"][-3000:]
    assert f"'attention_backend': '{backend}'" in r["log"]
    assert m["prefill_rounds"] >= 3 and m["chunks_scored"] >= 3 and m["peak_extend_kv"] <= BUDGET + 16 + CHUNK, m
    idle = r["idle"]
    assert idle["live_tokens"] == idle["allocated_pages"] == idle["pending_pages"] == 0, idle
    model = load(r["path"])
    window = sliding_window(model.config)
    span = window - 1 if backend == "triton" else window  # SGLang's Triton decode window (test_sliding_windows)
    for i, (prompt, output, events) in enumerate(zip(r["prompts"], r["outputs"], r["events"])):
        assert any(nxt < len(prompt) for nxt, _ in events), (i, events)  # evicted between its chunks
        want = masked_greedy(model, prompt, output, events, decode_span=span)
        assert output == want, f"{backend} request {i}: server {output} vs transformers {want}"


def test_triton_takes_torch_natives_victims_between_chunks(backend_runs):
    native, triton = backend_runs["torch_native"], backend_runs["triton"]
    for i, prompt in enumerate(native["prompts"]):
        rounds = [[e for e in r["events"][i] if e[0] < len(prompt)] for r in (native, triton)]
        assert rounds[0] == rounds[1] != [], i


def test_a_streaming_session_on_a_sliding_model_keeps_its_window_across_turns(backend_runs):
    r = backend_runs["torch_native"]
    session, events = r["session"], r["session_events"]
    assert "integrity check failed" not in r["log"] and r["vtoken"]["position_mismatches"] == 0
    assert len(session.turns) == SESSION_TURNS and len(events) >= SESSION_TURNS - 1
    # every round kept what the next query's window sees (its 15 positions before it: a window of 16)
    assert all(max(evicted) <= nxt - 16 for nxt, evicted in events), events
    model = load(r["path"])
    for k, (prompt, output) in enumerate(session.turns):
        want = masked_greedy(model, prompt, output, events)
        assert output == want, f"turn {k}: server {output} vs transformers {want}"
