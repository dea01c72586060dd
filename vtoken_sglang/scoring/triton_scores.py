"""Triton kernel for the scoring contract of ``reference.py`` (GPU; on CPU it runs under ``TRITON_INTERPRET=1``).

One program per (request, KV head): it reads the request's live slots from its row (paged, token-granular), loads
those keys once per pass, and computes the softmax of each of the KV head's ``group`` query heads over the live
keys in two passes (running max and sum, then the normalized probabilities summed over the group). The per-KV-head
partial sums ``[B, Hkv, W]`` are added in torch (deterministic; no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtoken_sglang.scoring.reference import decode_scores_headsum


@triton.jit
def _block_logits(q, K, Slots, b, h, offs_w, wmask, offs_d, dmask, scale, stride_kn, stride_kh, stride_sb):
    """Logits ``[BLOCK_G, BLOCK_W]`` of the group's queries against one block of the row's live keys."""
    slot = tl.load(Slots + b * stride_sb + offs_w, mask=wmask, other=0).to(tl.int64)
    k = tl.load(
        K + slot[:, None] * stride_kn + h * stride_kh + offs_d[None, :], mask=wmask[:, None] & dmask[None, :], other=0.0
    ).to(tl.float32)
    return tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale


@triton.jit
def _scores_kernel(
    Q,
    K,
    Slots,
    LiveLen,
    Out,
    scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_sb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(LiveLen + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < GROUP
    dmask = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_G], tl.float32)
    for w0 in range(0, n, BLOCK_W):  # pass 1: running max and sum of exp per query head
        offs_w = w0 + tl.arange(0, BLOCK_W)
        wmask = offs_w < n
        s = _block_logits(q, K, Slots, b, h, offs_w, wmask, offs_d, dmask, scale, stride_kn, stride_kh, stride_sb)
        s = tl.where(wmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        s_sum = s_sum * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m = m_new
    for w0 in range(0, n, BLOCK_W):  # pass 2: probabilities, summed over the group's query heads
        offs_w = w0 + tl.arange(0, BLOCK_W)
        wmask = offs_w < n
        s = _block_logits(q, K, Slots, b, h, offs_w, wmask, offs_d, dmask, scale, stride_kn, stride_kh, stride_sb)
        p = tl.exp(s - m[:, None]) / s_sum[:, None]
        p = tl.where(gmask[:, None] & wmask[None, :], p, 0.0)
        tl.store(Out + b * stride_ob + h * stride_oh + offs_w, tl.sum(p, axis=0), mask=wmask)


def decode_scores_headsum_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    slots: torch.Tensor,
    live_len: torch.Tensor,
    scale: float,
    logit_cap: float = 0.0,
    block_w: int = 32,
) -> torch.Tensor:
    """Same contract and result as ``reference.decode_scores_headsum`` (soft-capped logits fall back to it)."""
    if logit_cap > 0:
        return decode_scores_headsum(q, k_buffer, slots, live_len, scale, logit_cap)
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    assert Hq % Hkv == 0, "query heads must be a multiple of KV heads"
    group = Hq // Hkv
    q = q.contiguous()
    assert k_buffer.stride(2) == 1, "the head dimension of the K buffer must be contiguous"
    slots = slots.to(torch.int64).contiguous()
    live_len = live_len.to(device=q.device, dtype=torch.int32).contiguous()
    W = slots.shape[1]
    out = torch.zeros(B, Hkv, W, dtype=torch.float32, device=q.device)
    if B == 0 or W == 0:
        return out.sum(1)
    _scores_kernel[(B, Hkv)](
        q,
        k_buffer,
        slots,
        live_len,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        slots.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_G=max(triton.next_power_of_2(group), 1),
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_W=block_w,
    )
    return out.sum(1)
