"""The CPU scoring kernel (``cpu_ops/scores.cpp``, built with vToken's other CPU kernels): ``layers_scores_headsum``'s
contract in one op, every scored layer at once. Where the CPU kernels are not there (``cpu_ops.load``), scoring on a
CPU uses the torch reference. Results equal the reference's up to float32 rounding (summation order)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vtoken_sglang import cpu_ops
from vtoken_sglang.scoring.reference import layers_scores_headsum

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel takes (q and K of the same one)


def kernel(q, k_buffers, slots, live_len, scale, logit_cap=0.0) -> torch.Tensor:
    """``layers_scores_headsum(q, k_buffers, slots, live_len, scale, logit_cap)`` by the kernel; a K cache in
    another dtype than the queries (fp8) by the reference, which converts it."""
    k_buffers = list(k_buffers)
    if q.dtype not in DTYPES or k_buffers[0].dtype != q.dtype:
        return layers_scores_headsum(q, k_buffers, slots, live_len, scale, logit_cap)
    return torch.ops.vtoken_cpu.decode_scores_headsum(q, k_buffers, slots, live_len, float(scale), float(logit_cap))


def load() -> Callable[..., torch.Tensor] | None:
    """``kernel`` where the CPU kernels are built (building them on the first call), else None."""
    return kernel if cpu_ops.load() else None
