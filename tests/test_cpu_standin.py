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
