"""``random``: evict uniformly random unprotected tokens, reproducibly.

A token's score is a hash of (seed, request key, logical id): the same on every TP rank, whatever the batch holds
or which row the request got, and the same with reclaim on or off (relocation changes slots, not logical ids), so
Naive-Evict and vToken evict the same victims.
"""

import torch

from vtoken_sglang.policies.base import Policy, RowBlock

_M1, _M2 = 0x5851F42D4C957F2D, 0x14057B7EF767814F  # odd multipliers (PCG / Knuth)
_MASK = (1 << 62) - 1


def mix_hash(seed: int, rows: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
    """A deterministic int64 hash in [0, 2^62) of (seed, row, logical id), vectorized (wraps like uint64)."""
    x = (rows[:, None] * _M1 + logical * _M2 + seed * 0x9E3779B97F4A7C15 % (1 << 63)) & _MASK
    x = ((x ^ (x >> 29)) * _M1) & _MASK
    x = ((x ^ (x >> 31)) * _M2) & _MASK
    return x ^ (x >> 27)


class RandomPolicy(Policy):
    name = "random"

    def keep_score(self, block: RowBlock) -> torch.Tensor:
        return mix_hash(self.cfg.seed, block.keys, block.logical).to(torch.float64)
