"""Model families under vToken, against transformers (real SGLang on CPU, tiny random models of each family).

Each family's server evicts with the streaming policy (4 sinks, 16 recent tokens, a budget of 32 against prompts up
to 70 tokens) and reclaims (late fences, from conftest); its victim log (``integration.victim_log``) says which
logical positions each request dropped and from which query on. The reference is the same checkpoint in transformers,
fed the server's tokens, with an attention mask that hides from each query exactly the tokens evicted before it, at
their logical positions: its greedy choice must be the server's token at every step. A request that stays under
budget is compared with the unmasked model (vToken installed, nothing evicted). The families' own parts run in both:
QKV bias (Qwen2), QK norms (Qwen3), experts (Mixtral, Qwen3-MoE). Gemma-2 and Gemma-3 (soft-capping, (1 + w) norms,
sliding windows crossed under eviction) are ``test_sliding_windows``'s. LLaMA is checked the same way in
``test_integration`` (random victims, relocation, the overlap scheduler, a shared prompt prefix); SGLang serves
Mistral checkpoints with its LLaMA model class. Which families vToken refuses, and why, is ``test_model_support``."""

from __future__ import annotations

import pytest
import torch
from conftest import STRICT, greedy_with_victims, on_servers
from masked_reference import load, masked_greedy

from vtoken_sglang.tools import launcher, tiny_families

FAMILIES = ("qwen2", "qwen3", "mixtral", "qwen3_moe")
SINKS, RECENT, BUDGET = 4, 16, 32
PROMPT_LENS = (12, 41, 57, 70)
NEW_TOKENS = (16, 48, 48, 48)  # the first request stays under budget (+ slack) for its whole life


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_sglang_serves_mistral_with_its_llama_model():
    """Mistral's tiny model is served by a subclass of SGLang's LLaMA that computes nothing of its own (only a
    loader of Mistral's own checkpoint format): the LLaMA checks cover it."""
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.mistral import MistralForCausalLM

    assert issubclass(MistralForCausalLM, LlamaForCausalLM)
    assert {"forward", "__init__"}.isdisjoint(vars(MistralForCausalLM))


@pytest.fixture(scope="module")
def family_runs(tiny_model, tmp_path_factory):
    """family -> {path, prompts, outputs (in prompt order), events (per prompt), vtoken metrics, log}."""
    logs = tmp_path_factory.mktemp("victims")
    flags = ["--enable-vtoken", "--vtoken-policy", "streaming", "--vtoken-budget", str(BUDGET)]
    flags += ["--vtoken-sinks", str(SINKS), "--vtoken-recent", str(RECENT), "--context-length", "2048"]
    servers, paths = {}, {}
    for family in FAMILIES:
        paths[family] = str(tiny_families.build(family))
        env = {**STRICT, "VTOKEN_SGLANG_VICTIM_LOG": str(logs / f"{family}.jsonl")}
        servers[family] = launcher.SglangServer(paths[family], launcher.default_server_args(4096) + flags, env=env)

    def run(family, server):
        from transformers import AutoConfig

        ids = prompts(AutoConfig.from_pretrained(paths[family]).vocab_size)
        got = greedy_with_victims(server, family, ids, NEW_TOKENS, logs / f"{family}.jsonl")
        return {**got, "path": paths[family]}

    return on_servers(servers, run)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_equals_transformers_with_the_evicted_tokens_masked(family_runs, family):
    r = family_runs[family]
    m = r["vtoken"]
    assert "integrity check failed" not in r["log"] and m["position_mismatches"] == 0, r["log"][-3000:]
    assert m["tokens_evicted"] > 0 and m["tokens_moved"] > 0 and m["pages_reclaimed"] > 0, m  # relocation ran
    model = load(r["path"])
    changed = 0
    for i, (prompt, output, events) in enumerate(zip(r["prompts"], r["outputs"], r["events"])):
        assert len(output) == NEW_TOKENS[i]
        if i == 0:
            assert events == [], "the short request never goes over budget"
        else:
            assert events, f"request {i} ({len(prompt)} prompt tokens) evicted nothing"
        gone = 0
        for next_position, evicted in events:  # the streaming rule: never a sink or a recent token; down to budget
            assert min(evicted) >= SINKS and max(evicted) < next_position - RECENT, (next_position, evicted)
            gone += len(evicted)
            assert next_position - gone <= BUDGET
        want = masked_greedy(model, prompt, output, events)
        assert output == want, f"request {i}: server {output} vs transformers {want}"
        changed += events != [] and masked_greedy(model, prompt, output, []) != output
    assert changed, "eviction changed no output: the masked reference would not see a wrong mask"
