"""Pure-torch stand-in for the CPU build of ``sgl_kernel``, for the project's CPU set-up only.

Why: with ``SGLANG_USE_CPU_ENGINE=1`` sglang 0.5.23 imports a few helpers from ``sgl_kernel`` at module load.
The real CPU build of sgl-kernel is a source build that needs AVX-512/AMX and is not on PyPI; the CUDA wheel
cannot load without a GPU. This module defines those helpers in plain torch, and registers the
``torch.ops.sgl_kernel`` ops model modules look up at import (below); not ``convert_weight_packed``, sglang's test
for its AMX backend, so every sglang layer takes its ``forward_native`` path.

Installed by ``scripts/setup.sh --cpu`` through a ``.pth`` file in the virtual environment; never part of the
``vtoken-sglang`` distribution and never used on a GPU machine. Contract of each function: the same results as
the sgl-kernel CPU op of the same name, as sglang 0.5.23 calls it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__version__ = "0.0.0+vtoken-cpu-standin"
IS_VTOKEN_CPU_STANDIN = True


def _bytes_view(base_ptr: int, rows: int, row_bytes: int) -> np.ndarray:
    """A writable ``uint8[rows, row_bytes]`` view of host memory at ``base_ptr`` (no copy)."""
    buf = (ctypes.c_uint8 * (rows * row_bytes)).from_address(base_ptr)
    return np.frombuffer(buf, dtype=np.uint8).reshape(rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer b (base address ``data_ptrs[b]``, row size ``strides[b]`` bytes): row[tgt] <- row[src].

    All sources are read before any target is written (safe when the two sets overlap), as in the Triton kernel.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64).numpy()
    src = src_loc.to(torch.int64).numpy()
    rows = int(max(tgt.max(), src.max())) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        view = _bytes_view(int(base), rows, int(stride))
        view[tgt] = view[src]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[<i-th chunk>]``, chunks back to back."""
    del max_context_len  # the row width; torch indexing checks the bounds itself
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for row, s, e in zip(req_pool_indices.tolist(), starts, ends):
        n = e - s
        req_to_token[row, s:e] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _gated(act, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    d = x.shape[-1] // 2
    result = act(x[..., :d]) * x[..., d:]
    if out is None:
        return result
    out.copy_(result)
    return out


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``; written into ``out`` when given."""
    return _gated(torch.nn.functional.silu, x, out)


def gelu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` (exact gelu)."""
    return _gated(torch.nn.functional.gelu, x, out)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]``."""
    return _gated(lambda t: torch.nn.functional.gelu(t, approximate="tanh"), x, out)


def _unsupported(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding is not available with the CPU stand-in of sgl_kernel"
        )

    op.__name__ = name
    op.__doc__ = (
        "Imported by sglang at load time; only speculative decoding calls it, which CPU serving here does not run."
    )
    return op


# Speculative-decoding helpers: sglang imports them at module load under the CPU engine, but only EAGLE /
# speculative decoding calls them. They raise a clear error instead of computing something unverified.
for _name in (
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
):
    globals()[_name] = _unsupported(_name)
del _name


# ``torch.ops.sgl_kernel`` ops that sglang looks up when it imports a model module under the CPU engine (Qwen3.5,
# whose module the Qwen-VL multimodal processor imports, and the models built on it). Without them those modules
# fail to import and sglang skips them ("Ignore import error"). Each computes, in float32 like the Triton kernel
# sglang runs elsewhere for the same function, what that kernel computes; none of them is a layer's
# ``forward_native`` path, and ``convert_weight_packed`` (sglang's test for the AMX backend) stays unregistered.
_LIB = torch.library.Library("sgl_kernel", "DEF")  # noqa: TOR901 (the stand-in owns the namespace)


def _op(schema: str):
    def register(fn):
        _LIB.define(schema)
        _LIB.impl(schema.split("(", 1)[0], fn, "CompositeExplicitAutograd")
        return fn

    return register


@_op("fused_sigmoid_mul_cpu(Tensor(a!) x, Tensor gate) -> ()")
def fused_sigmoid_mul_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
    """In place: ``x <- x * sigmoid(gate)``; ``gate`` may be ``[tokens, heads, head_dim]`` against a 2-D ``x``."""
    x.copy_(x.float() * torch.sigmoid(gate.float().reshape(x.shape)))


def _gemma_rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + 1.0)).to(x.dtype)


@_op(
    "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) "
    "-> (Tensor, Tensor)"
)
def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps: float, head_dim: int):
    """Gemma RMSNorm (weight ``1 + w``) of every head of ``q`` and ``k``: ``[rows, head_dim]`` each, contiguous."""
    return (
        _gemma_rmsnorm_rows(q.reshape(-1, head_dim), q_weight, eps),
        _gemma_rmsnorm_rows(k.reshape(-1, head_dim), k_weight, eps),
    )


@_op(
    "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, "
    "int head_dim, int num_heads) -> (Tensor, Tensor, Tensor)"
)
def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, eps: float, head_dim: int, num_heads: int):
    """``q_gate`` interleaves per head ``[q_h0, gate_h0, q_h1, ...]``: the normalized q and k heads as in
    ``fused_qk_gemma_rmsnorm_cpu``, and the gate heads copied out; ``[tokens * heads, head_dim]`` each."""
    qg = q_gate.reshape(-1, num_heads, 2, head_dim)
    q, k_out = fused_qk_gemma_rmsnorm_cpu(qg[:, :, 0], k, q_weight, k_weight, eps, head_dim)
    return q, k_out, qg[:, :, 1].reshape(-1, head_dim).clone()


@_op(
    "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, "
    "int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)"
)
def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Per token, ``mixed_qkvz = [q | k | v | z]`` and ``mixed_ba = [b | a]`` -> ``[q | k | v]``, ``z`` as
    ``[tokens, heads_v, head_v]``, ``b`` and ``a`` as ``[tokens, heads_v]``; all new contiguous tensors."""
    qkv = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    z = mixed_qkvz[:, qkv : qkv + num_heads_v * head_v].reshape(-1, num_heads_v, head_v)
    return mixed_qkvz[:, :qkv].clone(), z.clone(), mixed_ba[:, :num_heads_v].clone(), mixed_ba[:, num_heads_v:].clone()
