"""The CPU set-up's sgl_kernel stand-in computes what sglang's CPU call sites expect (checked through them)."""

import os

import pytest
import torch

sgl_kernel = pytest.importorskip("sgl_kernel")
pytestmark = pytest.mark.skipif(
    not getattr(sgl_kernel, "IS_VTOKEN_CPU_STANDIN", False), reason="real sgl_kernel installed"
)


def test_setup_made_cpu_engine_the_default():
    assert os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def test_copy_all_layer_kv_cache_through_sglang():
    from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_func

    g = torch.Generator().manual_seed(0)
    bufs = [torch.randn(64, 2, 8, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    ref = [b.clone() for b in bufs]
    src = torch.tensor([3, 10, 11, 40, 63], dtype=torch.int64)
    tgt = torch.tensor([10, 5, 60, 41, 0], dtype=torch.int64)  # 10 is both a source and a target
    for r in ref:
        r[tgt] = r[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    copy_all_layer_kv_cache_func(ptrs, strides, torch.cat([tgt, tgt]), torch.cat([src, src]), 5, 8, {})
    for b, r in zip(bufs, ref):
        assert torch.equal(b, r)


def test_assign_req_to_token_pool_through_sglang():
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func

    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    start, end = torch.tensor([0, 5, 30]), torch.tensor([4, 7, 32])
    loc = torch.arange(100, 108, dtype=torch.int64)
    assign_req_to_token_pool_func(rows, req_to_token, start, end, loc, 3)
    assert req_to_token[2, :4].tolist() == [100, 101, 102, 103]
    assert req_to_token[0, 5:7].tolist() == [104, 105]
    assert req_to_token[3, 30:32].tolist() == [106, 107]
    assert int(req_to_token.sum()) == sum(range(100, 108))


@pytest.mark.parametrize(
    "name, act",
    [
        ("silu_and_mul", torch.nn.functional.silu),
        ("gelu_and_mul", torch.nn.functional.gelu),
        ("gelu_tanh_and_mul", lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
    ],
)
def test_gated_activations(name, act):
    x = torch.randn(5, 16)
    out = torch.empty(5, 8)
    res = getattr(sgl_kernel, name)(x, out)
    assert res is out and torch.allclose(out, act(x[:, :8]) * x[:, 8:])


def test_speculative_helpers_refuse_clearly():
    with pytest.raises(NotImplementedError, match="speculative decoding"):
        sgl_kernel.verify_tree_greedy_cpu()


def test_sigmoid_gate_through_qwen3_5():
    """Qwen3.5's CPU ``fused_sigmoid_mul`` (the op, in place) is ``attn_output * sigmoid(gate)``, its documented
    definition, with the gate given per head as the model gives it."""
    from sglang.srt.models import qwen3_5

    g = torch.Generator().manual_seed(1)
    x, gate = torch.randn(5, 4 * 8, generator=g), torch.randn(5, 4, 16, generator=g)[..., :8]  # a strided gate
    want = x * torch.sigmoid(gate.reshape(5, 32))
    kept = x.clone()
    assert torch.allclose(qwen3_5.fused_sigmoid_mul(x, gate, inplace=False), want) and torch.equal(x, kept)
    assert qwen3_5.fused_sigmoid_mul(x, gate) is x and torch.allclose(x, want)


def test_gemma_qk_norms_equal_sglangs_native_norm():
    """The QK norms Qwen3.5 runs on CPU equal SGLang's ``GemmaRMSNorm.forward_native`` per head; the gated form
    takes q and the gate from the per-head interleaved projection."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d = 4, 2, 16
    norms = [GemmaRMSNorm(d, eps=1e-6) for _ in range(2)]
    for n in norms:
        n.weight.data.copy_(torch.randn(d, generator=g) * 0.1)
    q, k = torch.randn(3, heads * d, generator=g), torch.randn(3, kv_heads * d, generator=g)
    want_q, want_k = (n.forward_native(t.reshape(-1, d)) for n, t in zip(norms, (q, k)))
    got_q, got_k = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(q, k, norms[0].weight, norms[1].weight, 1e-6, d)
    assert torch.allclose(got_q, want_q, atol=1e-6) and torch.allclose(got_k, want_k, atol=1e-6)
    gate = torch.randn(3, heads * d, generator=g)
    q_gate = torch.stack([q.reshape(3, heads, d), gate.reshape(3, heads, d)], 2).reshape(3, -1)
    got = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate, k, norms[0].weight, norms[1].weight, 1e-6, d, heads
    )
    assert torch.allclose(got[0], want_q, atol=1e-6) and torch.allclose(got[1], want_k, atol=1e-6)
    assert torch.equal(got[2], gate.reshape(-1, d))


def test_gdn_projection_split():
    """``[q | k | v | z]`` and ``[b | a]`` per token -> ``[q | k | v]``, z per value head, b, a."""
    nqk, nv, hqk, hv, tokens = 2, 4, 8, 6, 3
    qkv = 2 * nqk * hqk + nv * hv
    qkvz = torch.arange(tokens * (qkv + nv * hv), dtype=torch.float32).reshape(tokens, -1)
    ba = torch.arange(tokens * 2 * nv, dtype=torch.float32).reshape(tokens, -1)
    mixed, z, b, a = torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, nqk, nv, hqk, hv)
    assert torch.equal(mixed, qkvz[:, :qkv]) and torch.equal(z.reshape(tokens, -1), qkvz[:, qkv:])
    assert z.shape == (tokens, nv, hv) and torch.equal(b, ba[:, :nv]) and torch.equal(a, ba[:, nv:])
