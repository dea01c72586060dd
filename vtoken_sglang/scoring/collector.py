"""Per decode step: keep the queries of the scored layers during the forward, then turn them into each request's
attention over its live keys (mean over all query heads of all TP ranks and over the scored layers).

Engine-agnostic: the engine calls ``begin_forward`` before each forward, ``save_query`` from its attention layers
(only when ``wants(layer)``), and ``scores`` after the forward, when the new token's key is in the KV pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vtoken_sglang.scoring.reference import decode_scores_headsum


def scores_impl(device: torch.device) -> Callable[..., torch.Tensor]:
    """The Triton kernel on CUDA, the torch reference elsewhere (same contract)."""
    if device.type == "cuda":
        from vtoken_sglang.scoring.triton_scores import decode_scores_headsum_triton

        return decode_scores_headsum_triton
    return decode_scores_headsum


def resolve_layers(spec: str, num_layers: int) -> frozenset[int]:
    """``all`` or comma-separated indices (negative from the end) -> layer ids; raises ``ValueError`` out of range."""
    if spec == "all":
        return frozenset(range(num_layers))
    out = set()
    for raw in spec.split(","):
        i = int(raw)
        if not -num_layers <= i < num_layers:
            raise ValueError(f"layer {i} out of range for a model with {num_layers} layers")
        out.add(i % num_layers)
    return frozenset(out)


class ScoreCollector:
    def __init__(self, num_layers: int, layers: str = "all", every: int = 1):
        self.layers = resolve_layers(layers, num_layers)
        self.every = every
        self.decode_steps = 0
        self.active = False  # this forward is a scored decode step
        self.queries: dict[int, tuple[torch.Tensor, float, float]] = {}  # layer -> (q [T, Hq, D], scale, cap)
        self.steps_scored = 0

    def begin_forward(self, is_decode: bool) -> None:
        self.queries.clear()
        self.active = is_decode and self.decode_steps % self.every == 0
        self.decode_steps += int(is_decode)

    def wants(self, layer_id: int) -> bool:
        return self.active and layer_id in self.layers

    def save_query(self, layer_id: int, q: torch.Tensor, num_heads: int, head_dim: int, scale: float,
                   logit_cap: float = 0.0) -> None:
        self.queries[layer_id] = (q.detach().reshape(-1, num_heads, head_dim), scale, logit_cap)

    def scores(self, key_buffer: Callable[[int], torch.Tensor], slots: torch.Tensor, live_len: torch.Tensor,
               all_reduce: Callable[[torch.Tensor], None] | None = None, tp_size: int = 1) -> torch.Tensor | None:
        """``[B, W]`` mean attention probabilities of the last forward's queries (the first ``B`` rows), or None
        when the forward was not scored. ``all_reduce`` sums a tensor over the TP group in place (every rank holds
        ``Hq / tp_size`` heads; all ranks must call it in the same steps, which they do: steps are global)."""
        if not self.queries:
            return None
        B = slots.shape[0]
        acc = torch.zeros(slots.shape, dtype=torch.float32, device=slots.device)
        heads = 0
        impl = scores_impl(slots.device)
        for layer_id, (q, scale, cap) in sorted(self.queries.items()):
            acc += impl(q[:B], key_buffer(layer_id), slots, live_len, scale, cap)
            heads = q.shape[1]
        if all_reduce is not None and tp_size > 1:
            all_reduce(acc)
        layers = len(self.queries)
        self.queries.clear()
        self.steps_scored += 1
        return acc / (heads * tp_size * layers)
