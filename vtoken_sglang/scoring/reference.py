"""Attention scores of decoding requests over their live keys: the torch implementation (CPU, and the reference
for the Triton kernel).

Contract (both implementations): for request ``i`` with live row ``slots[i, :live_len[i]]`` (KV slots in logical
order) and its newest query ``q[i]`` (``[num_q_heads, head_dim]``, after RoPE), per query head ``h``

    p[i, h, j] = softmax_j( scale * <q[i, h], K[slots[i, j], h // group]> ),   j < live_len[i]

with ``group = num_q_heads // num_kv_heads`` (GQA: each KV head serves ``group`` consecutive query heads). The
result is ``sum_h p[i, h, :]`` (``[B, W]``, float32, zero past ``live_len``): a *sum* over the heads this process
holds, so tensor-parallel ranks add their partial sums (one all-reduce) and divide by the total head count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def decode_scores_headsum(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    slots: torch.Tensor,
    live_len: torch.Tensor,
    scale: float,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """``q``: ``[B, Hq, D]``; ``k_buffer``: ``[num_slots, Hkv, D]``; ``slots``: ``[B, W]`` (entries past
    ``live_len`` are ignored); returns ``[B, W]`` float32 = softmax attention summed over the ``Hq`` heads.
    ``logit_cap > 0``: logits are soft-capped (``cap * tanh(x / cap)``) before the softmax, as the model does."""
    return layers_scores_headsum(q[None], [k_buffer], slots, live_len, scale, logit_cap)


def layers_scores_headsum(
    q: torch.Tensor,
    k_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    live_len: torch.Tensor,
    scale: float,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """``decode_scores_headsum`` of ``L`` layers at once, summed over them: ``q`` ``[L, B, Hq, D]``, ``k_buffers``
    one ``[num_slots, Hkv, D]`` per layer (same ``scale`` and ``logit_cap``). One gather per layer, then one matmul,
    softmax and sum for all layers (few ops: on a CPU each costs more than its arithmetic)."""
    L, B, Hq, D = q.shape
    Hkv = k_buffers[0].shape[1]
    assert Hq % Hkv == 0, "query heads must be a multiple of KV heads"
    W = slots.shape[1]
    dev = slots.device
    padding = torch.arange(W, device=dev)[None, :] >= live_len.to(dev)[:, None]
    live_slots = slots.masked_fill(padding, 0).to(torch.int64)  # padding reads slot 0, masked below
    # (slot, KV head) pairs in [B, Hkv, W] order: one gather per layer lays each head's keys out contiguously
    index = (live_slots[:, None, :] * Hkv + torch.arange(Hkv, device=dev)[None, :, None]).reshape(-1)
    keys = torch.empty(L, B * Hkv * W, D, dtype=torch.float32, device=dev)
    for layer, k_buffer in enumerate(k_buffers):
        keys[layer].copy_(k_buffer.reshape(-1, D).index_select(0, index))
    qg = q.to(torch.float32).view(L, B, Hkv, Hq // Hkv, D)  # query heads grouped by their KV head
    logits = torch.matmul(qg, keys.view(L, B, Hkv, W, D).transpose(-1, -2)).mul_(scale)  # [L, B, Hkv, group, W]
    if logit_cap > 0:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    logits = logits.masked_fill_(padding[None, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # rows with no live key (not expected) give 0
    return probs.view(L, B, Hq, W).sum(2).sum(0)


def window_scores_headsum(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    slots: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """SnapKV's observation window for one request at prefill: ``q`` ``[w, Hq, D]`` are its last ``w`` prompt
    queries, at positions ``q_pos`` (``[w]``, into its row); ``slots`` ``[L]`` its row's KV slots (the prompt, in
    order). Each query attends causally (keys ``j <= q_pos``). Returns ``[L]`` float32: the softmax probabilities
    summed over the window's queries and the ``Hq`` heads this process holds (same head-sum contract as above)."""
    w, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    assert Hq % Hkv == 0, "query heads must be a multiple of KV heads"
    L = slots.shape[0]
    keys = k_buffer[slots.to(torch.int64)].to(torch.float32)  # [L, Hkv, D]
    qg = q.to(torch.float32).view(w, Hkv, Hq // Hkv, D)
    logits = torch.einsum("wkgd,lkd->kgwl", qg, keys) * scale
    if logit_cap > 0:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    future = torch.arange(L, device=slots.device)[None, :] > q_pos.to(slots.device)[:, None]  # [w, L]
    logits = logits.masked_fill(future[None, None], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=(0, 1, 2))
