"""Attention scores of the newest query over the live keys (vtoken_sglang.scoring): equal to the attention
probabilities Hugging Face transformers reports for the tiny model (eager attention, ``output_attentions=True``),
reduced over heads the same way; GQA and a compacted (evicted) live row handled; collected in the real server,
where the score-based policies run end to end."""

import random
import time

import pytest
import torch

from vtoken_sglang.scoring import decode_scores_headsum

STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "VTOKEN_SGLANG_CHECK_POSITIONS": "1"}
_rng = random.Random(3)
PROMPT_IDS = [[_rng.randrange(10, 2000) for _ in range(40 + 23 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def hf_run(tiny_model):
    """One forward of the tiny model in transformers: per layer, HF's probabilities and the q/k it attended with."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import eager_attention_forward

    captured = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured.append((query.detach().clone(), key.detach().clone()))
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("vtoken_capture", capture)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32, attn_implementation="vtoken_capture")
    ids = torch.randint(10, 2000, (1, 77), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    return model.config, captured, [a[0, :, -1, :] for a in out.attentions]  # newest query: [Hq, T] per layer


def _as_pool(key: torch.Tensor, seed: int):
    """Scatter HF's keys ``[1, Hkv, T, D]`` into a shuffled slot pool, as a paged KV buffer holds them."""
    T = key.shape[2]
    perm = torch.randperm(T + 40, generator=torch.Generator().manual_seed(seed))[:T]
    pool = torch.randn(T + 40, key.shape[1], key.shape[3])  # garbage in the unused slots
    pool[perm] = key[0].transpose(0, 1)
    return pool, perm


def test_scores_equal_hf_attention_probabilities(hf_run):
    cfg, captured, probs = hf_run
    scale = cfg.head_dim ** -0.5
    assert cfg.num_attention_heads != cfg.num_key_value_heads  # the tiny model is GQA
    for layer, ((q, k), p) in enumerate(zip(captured, probs)):
        pool, slots = _as_pool(k, seed=layer)
        got = decode_scores_headsum(q[0, :, -1, :][None], pool, slots[None], torch.tensor([k.shape[2]]), scale)
        torch.testing.assert_close(got[0], p.sum(0), rtol=1e-4, atol=1e-6)
        assert got[0].sum().item() == pytest.approx(cfg.num_attention_heads, rel=1e-5)


def test_live_row_subset_and_batch(hf_run):
    """A compacted row (only some tokens live, in logical order) renormalizes over the live set; rows of a batch
    with different lengths are independent."""
    cfg, captured, _ = hf_run
    scale = cfg.head_dim ** -0.5
    q, k = captured[1]
    T = k.shape[2]
    pool, slots = _as_pool(k, seed=5)
    live = torch.tensor(sorted(torch.randperm(T - 1, generator=torch.Generator().manual_seed(1))[:30].tolist()) + [T - 1])
    qn = q[0, :, -1, :]
    rows = torch.zeros(2, T, dtype=torch.int64)
    rows[0, : len(live)] = slots[live]
    rows[1] = slots
    got = decode_scores_headsum(torch.stack([qn, qn]), pool, rows, torch.tensor([len(live), T]), scale)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    kk = k[0][:, live].repeat_interleave(group, 0)  # [Hq, L, D]
    want = torch.softmax(torch.einsum("hd,hld->hl", qn, kk) * scale, -1).sum(0)
    torch.testing.assert_close(got[0, : len(live)], want, rtol=1e-4, atol=1e-6)
    assert bool((got[0, len(live):] == 0).all())
    assert got[1].sum().item() == pytest.approx(cfg.num_attention_heads, rel=1e-5)


TRITON_CHECK = """
import torch
from vtoken_sglang.scoring.reference import decode_scores_headsum
from vtoken_sglang.scoring.triton_scores import decode_scores_headsum_triton
g = torch.Generator().manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
for B, Hq, Hkv, D, W, block in [(3, 4, 2, 32, 50, 16), (2, 6, 2, 24, 37, 16), (2, 8, 8, 16, 5, 32), (4, 32, 8, 128, 70, 32)]:
    k = torch.randn(300, Hkv, D, generator=g)
    slots = torch.stack([torch.randperm(300, generator=g)[:W] for _ in range(B)])
    live = torch.randint(1, W + 1, (B,), generator=g)
    live[-1] = 0 if B > 3 else live[-1]  # an empty row gives zeros in both
    q = torch.randn(B, Hq, D, generator=g)
    want = decode_scores_headsum(q, k, slots, live, D ** -0.5)
    got = decode_scores_headsum_triton(q.to(device), k.to(device), slots.to(device), live.to(device), D ** -0.5,
                                       block_w=block).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_triton_kernel_equals_reference():
    """The Triton kernel against the torch reference: natively on CUDA, under TRITON_INTERPRET=1 elsewhere (GQA
    groups of 1, 2, 3 and 4 heads, head dims that are not powers of two, partial blocks, an empty row)."""
    pytest.importorskip("triton")
    from conftest import PY, run_all

    env = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    (run,) = run_all([[PY, "-c", TRITON_CHECK]], env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def hf_mean_attention(model, ids: list[int]) -> torch.Tensor:
    """transformers' attention of the last position over all positions, mean over heads and layers."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return torch.stack([a[0, :, -1, :].mean(0) for a in out.attentions]).mean(0)


@pytest.mark.server
def test_server_collects_hf_equal_scores_and_score_policies_are_transparent(tiny_model, tmp_path):
    """In the real server: (1) the scores collected for a decoding request equal transformers' attention
    probabilities for the same tokens (a request under budget: nothing evicted yet); (2) for h2o, tova and
    scissorhands, Naive-Evict and vToken give identical greedy tokens, vToken holds fewer pages, nothing leaks."""
    from transformers import AutoModelForCausalLM

    from vtoken_sglang.serving import SglangServer, default_server_args

    dump = tmp_path / "scores.pt"
    prompt = list(range(100, 177))
    runs, steps = {}, []
    for policy in ("h2o", "tova", "scissorhands"):
        for reclaim in ("off", "on"):
            flags = default_server_args() + ["--enable-vtoken", "--vtoken-policy", policy, "--vtoken-budget", "96",
                                             "--vtoken-recent", "8", "--vtoken-reclaim", reclaim]
            first = (policy, reclaim) == ("h2o", "off")
            env = {**STRICT, "VTOKEN_SGLANG_SCORE_DUMP": str(dump)} if first else STRICT
            with SglangServer(tiny_model, flags, env=env) as s:
                if first:  # 77 + 6 tokens < 96 + slack: scores over the full sequence, no eviction
                    s.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}})
                    deadline = time.monotonic() + 30  # the server writes the dump when it goes idle
                    while not (steps and steps[0][0][: len(prompt)] == prompt) and time.monotonic() < deadline:
                        time.sleep(0.5)
                        steps = torch.load(dump) if dump.exists() else []
                out = s.post("/generate", {"input_ids": PROMPT_IDS, "sampling_params": {
                    "max_new_tokens": 160, "temperature": 0.0, "ignore_eos": True}})
                time.sleep(2)
                runs[policy, reclaim] = (
                    [o["output_ids"] for o in out], s.get("/get_server_info")["internal_states"][0]["vtoken"], s.log_text())

    assert [len(seen) for seen, _ in steps] == [78, 79, 80, 81]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32, attn_implementation="eager")
    for seen, got in steps:
        torch.testing.assert_close(got, hf_mean_attention(hf, seen), rtol=1e-3, atol=1e-5)
    for policy in ("h2o", "tova", "scissorhands"):
        (ids_off, st_off, log_off), (ids_on, st_on, log_on) = runs[policy, "off"], runs[policy, "on"]
        assert st_off["tokens_evicted"] == st_on["tokens_evicted"] > 0, policy
        assert ids_off == ids_on, policy
        assert st_on["pages_reclaimed"] > 0 and st_on["peak_tracked_pages"] < st_off["peak_tracked_pages"], policy
        for st, log in ((st_off, log_off), (st_on, log_on)):
            assert st["live_tokens"] == 0 and st["allocated_pages"] == 0 and st["position_mismatches"] == 0, policy
            assert "memory leak" not in log and "Traceback" not in log, policy
