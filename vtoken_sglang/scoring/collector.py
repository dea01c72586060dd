"""Keep the queries of the scored layers during a forward, then turn them into attention scores after it:

- decode steps (h2o, tova, scissorhands; every ``every`` steps): each request's newest query over its live keys;
- prefill (snapkv, ``prefill_window`` > 0): each request's last ``prefill_window`` prompt queries over its prompt,
  causally, summed over the window.

Both are means over all query heads of all TP ranks and over the scored layers. Engine-agnostic: the engine calls
``begin_forward`` before each forward, ``save_query`` from its attention layers (only when ``wants(layer)``), and
``scores`` / ``window_scores`` after the forward, when the keys are in the KV pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vtoken_sglang.scoring.reference import decode_scores_headsum, window_scores_headsum


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
    def __init__(
        self, num_layers: int, layers: str = "all", every: int = 1, decode: bool = True, prefill_window: int = 0
    ):
        self.layers = resolve_layers(layers, num_layers)
        self.every = every
        self.decode = decode
        self.prefill_window = prefill_window
        self.decode_steps = 0
        self.active = False  # this forward is scored (a scored decode step, or a prefill with a window)
        self.queries: dict[int, tuple[torch.Tensor, float, float]] = {}  # layer -> (q [T, Hq, D], scale, cap)
        self.window_rows: torch.Tensor | None = None  # prefill: which query rows of the forward are kept
        self.window_segments: list[
            tuple[int, int, int]
        ] = []  # prefill, per request: (first kept row, w, position of the first)
        self.steps_scored = 0
        self.prefill_forwards_scored = 0

    def begin_forward(
        self, is_decode: bool, extend_lens: list[int] | None = None, prefix_lens: list[int] | None = None
    ) -> None:
        """Before a forward. A prefill (``extend_lens`` / ``prefix_lens`` per request, in batch order) is scored
        when a window is configured: the last ``min(prefill_window, extend_len)`` queries of each request."""
        self.queries.clear()
        self.window_rows, self.window_segments = None, []
        self.active = self.decode and is_decode and self.decode_steps % self.every == 0
        self.decode_steps += int(is_decode)
        if not is_decode and self.prefill_window > 0 and extend_lens:
            rows, start, kept = [], 0, 0
            for n, prefix in zip(extend_lens, prefix_lens):
                w = min(self.prefill_window, n)
                rows.append(torch.arange(start + n - w, start + n))
                self.window_segments.append((kept, w, prefix + n - w))
                start, kept = start + n, kept + w
            self.window_rows = torch.cat(rows)
            self.active = True

    def wants(self, layer_id: int) -> bool:
        return self.active and layer_id in self.layers

    def save_query(
        self, layer_id: int, q: torch.Tensor, num_heads: int, head_dim: int, scale: float, logit_cap: float = 0.0
    ) -> None:
        q = q.detach().reshape(-1, num_heads, head_dim)
        if self.window_rows is not None:
            q = q.index_select(0, self.window_rows.to(q.device))
        self.queries[layer_id] = (q, scale, logit_cap)

    def scores(
        self,
        key_buffer: Callable[[int], torch.Tensor],
        slots: torch.Tensor,
        live_len: torch.Tensor,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        tp_size: int = 1,
    ) -> torch.Tensor | None:
        """``[B, W]`` mean attention probabilities of the last forward's queries (the first ``B`` rows), or None
        when the forward was not scored. ``all_reduce`` sums a tensor over the TP group in place (every rank holds
        ``Hq / tp_size`` heads; all ranks must call it in the same steps, which they do: steps are global)."""
        if not self.queries or self.window_rows is not None:
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

    def window_scores(
        self,
        key_buffer: Callable[[int], torch.Tensor],
        rows_slots: list[torch.Tensor],
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        tp_size: int = 1,
    ) -> list[torch.Tensor] | None:
        """After a scored prefill: per request of the forward (batch order), ``[L]`` = its window's attention over
        its row ``rows_slots[i]`` (``L`` = prefix + extend length), a mean over heads, ranks and layers and a sum
        over the window's queries. None when the forward was not a scored prefill. Every TP rank calls it after
        the same forwards (one all-reduce over all requests together)."""
        if not self.queries or self.window_rows is None:
            return None
        assert len(rows_slots) == len(self.window_segments), "one row per request of the prefill"
        out = [torch.zeros(s.shape[0], dtype=torch.float32, device=s.device) for s in rows_slots]
        heads = 0
        for layer_id, (q, scale, cap) in sorted(self.queries.items()):
            k = key_buffer(layer_id)
            for acc, slots, (first, w, pos) in zip(out, rows_slots, self.window_segments):
                q_pos = torch.arange(pos, pos + w, device=slots.device)
                acc += window_scores_headsum(q[first : first + w], k, slots, q_pos, scale, cap)
            heads = q.shape[1]
        if all_reduce is not None and tp_size > 1 and out:
            flat = torch.cat(out)
            all_reduce(flat)
            out = list(torch.split(flat, [s.shape[0] for s in rows_slots]))
        norm = heads * tp_size * len(self.queries)
        self.queries.clear()
        self.window_rows, self.window_segments = None, []
        self.prefill_forwards_scored += 1
        return [o / norm for o in out]
