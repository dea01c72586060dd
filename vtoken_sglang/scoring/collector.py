"""Keep the queries of the scored layers during a forward, then turn them into attention scores after it:

- decode steps (h2o, tova, scissorhands): every decode forward writes each request's newest query into static
  buffers (``DecodeQueryBuffers``: the same ops in an eager forward and in a CUDA graph's replay); every ``every``
  decode steps that query is scored over the request's live keys (``scores``), before the next forward starts;
- prefill (snapkv, ``prefill_window`` > 0): each request's last ``prefill_window`` prompt queries, copied out of the
  forward into a ``PrefillWindow``, scored over its prompt causally, summed over the window (``window_scores``).
  Windows wait in arrival order until their batch's results are processed (with SGLang's overlap scheduler that is
  after the next forward ran), and are taken by the key of their batch (``take_window``). A prompt evicted between
  its prefill chunks finds its chunk's window by its name (``window_of``), under every score policy.

Both are means over all query heads of all TP ranks and over the scored layers. Engine-agnostic: the engine calls
``begin_forward`` before each forward, ``keep_query`` from its scored attention layers, and ``scores`` /
``window_scores`` after the forward, when the keys are in the KV pool.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from vtoken_sglang.debug_switches import SWITCHES
from vtoken_sglang.scoring import cpu_kernel
from vtoken_sglang.scoring.query_buffers import DEFAULT_ROWS, DecodeQueryBuffers
from vtoken_sglang.scoring.reference import layers_scores_headsum, window_scores_headsum

logger = logging.getLogger("vtoken_sglang")


@functools.cache
def scores_impl(device: torch.device) -> Callable[..., torch.Tensor]:
    """``layers_scores_headsum``'s contract: the Triton kernel layer by layer on CUDA, and on CPU under
    ``TRITON_INTERPRET=1`` (the GPU path, interpreted); elsewhere the CPU kernel (all layers in one op,
    ``cpu_kernel``) where vToken's CPU kernels are built, else the torch reference (all layers at once). Chosen once
    per device (every scored step asks)."""
    if device.type != "cuda" and not SWITCHES.triton_interpret:
        return cpu_kernel.load() or layers_scores_headsum
    logger.info("[vtoken] scoring with the Triton kernel%s", "" if device.type == "cuda" else " (interpreted)")
    from vtoken_sglang.scoring.triton_scores import decode_scores_headsum_triton

    def triton_layers(q, k_buffers, slots, live_len, scale, logit_cap):
        out = decode_scores_headsum_triton(q[0], k_buffers[0], slots, live_len, scale, logit_cap)
        for layer in range(1, q.shape[0]):
            out += decode_scores_headsum_triton(q[layer], k_buffers[layer], slots, live_len, scale, logit_cap)
        return out

    return triton_layers


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


@dataclass
class PrefillWindow:
    """One prefill forward's window: which query rows it keeps, per request ``(first kept row, w, position of the
    first)``, whether each request's prompt is complete after it, and the kept queries per scored layer."""

    key: Hashable
    rows: torch.Tensor
    segments: list[tuple[int, int, int]]
    complete: list[bool]
    queries: dict[int, tuple[torch.Tensor, float, float]] = field(default_factory=dict)

    def lengths(self) -> list[int]:
        """Each request's row length after the prefill (prefix + extend)."""
        return [pos + w for _, w, pos in self.segments]


class ScoreCollector:
    def __init__(
        self, num_layers: int, layers: str = "all", every: int = 1, decode: bool = True, prefill_window: int = 0
    ):
        self.layers = resolve_layers(layers, num_layers)
        self.every = every
        self.decode = decode
        self.prefill_window = prefill_window
        self.buffers = DecodeQueryBuffers(self.layers) if decode else None
        self.decode_forwards = 0  # decode forwards begun (compared with ``buffers.written()``)
        self.written_before = 0  # forwards the buffers counted before ``start_counting`` (graph capture warm-ups)
        self.active = False  # the last decode forward is to be scored (every ``every``-th)
        self.open_window: PrefillWindow | None = None  # the window of the forward running now
        self.windows: deque[PrefillWindow] = deque()  # windows whose results are not processed yet
        self.last_taken: PrefillWindow | None = None  # the window ``take_window`` gave last
        self.steps_scored = 0
        self.prefill_forwards_scored = 0

    def begin_forward(
        self,
        is_decode: bool,
        extend_lens: list[int] | None = None,
        prefix_lens: list[int] | None = None,
        key: Hashable = None,
        complete: list[bool] | None = None,
    ) -> None:
        """Before a forward. A prefill (``extend_lens`` / ``prefix_lens`` per request, in batch order; ``key``
        names its batch, ``complete`` whether each request's prompt is all in after it) is scored when a window is
        configured: the last ``min(prefill_window, extend_len)`` queries of each request."""
        self.open_window = None
        if is_decode:
            self.active = self.decode and self.decode_forwards % self.every == 0
            self.decode_forwards += 1
            return
        self.active = False
        if self.prefill_window > 0 and extend_lens:
            rows, segments, start, kept = [], [], 0, 0
            for n, prefix in zip(extend_lens, prefix_lens):
                w = min(self.prefill_window, n)
                rows.append(torch.arange(start + n - w, start + n))
                segments.append((kept, w, prefix + n - w))
                start, kept = start + n, kept + w
            done = complete if complete is not None else [True] * len(extend_lens)
            self.open_window = PrefillWindow(key, torch.cat(rows), segments, done)
            self.windows.append(self.open_window)

    def keep_query(
        self,
        layer_id: int,
        q: torch.Tensor,
        is_decode: bool,
        num_heads: int,
        head_dim: int,
        scale: float,
        logit_cap: float = 0.0,
        rows_bound: Callable[[], int] = lambda: DEFAULT_ROWS,
    ) -> None:
        """From a scored layer's attention forward (``layer_id in layers``): a decode query goes into the static
        buffers (every decode forward: a CUDA graph records it once); a prefill's window rows are copied out."""
        if is_decode:
            if self.buffers is not None:
                self.buffers.write(layer_id, q, num_heads, head_dim, scale, logit_cap, rows_bound)
            return
        window = self.open_window
        if window is not None:
            q = q.detach().reshape(-1, num_heads, head_dim)
            window.queries[layer_id] = (q.index_select(0, window.rows.to(q.device)), scale, logit_cap)

    def start_counting(self) -> None:
        """From now on every decode forward begun must be written: what the buffers counted before (the eager
        warm-ups of a CUDA graph capture, which begin no forward here) is set aside (one device read)."""
        self.written_before = (self.buffers.written() if self.buffers is not None else 0) - self.decode_forwards

    def decode_forwards_unwritten(self) -> int:
        """Decode forwards begun whose scored layers wrote no query (a CUDA graph captured without them; one device
        read)."""
        if self.buffers is None:
            return 0
        return max(self.decode_forwards - (self.buffers.written() - self.written_before), 0)

    def scores(
        self,
        key_buffer: Callable[[int], torch.Tensor],
        slots: torch.Tensor,
        live_len: torch.Tensor,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        tp_size: int = 1,
    ) -> torch.Tensor | None:
        """``[B, W]`` mean attention probabilities of the last decode forward's queries over the rows' live keys
        (``slots`` ``[B, W]``: the batch's rows, ``live_len`` their lengths), or None when that forward is not one
        to score. ``all_reduce`` sums a tensor over the TP group in place (every rank holds ``Hq / tp_size`` heads;
        all ranks must call it in the same steps, which they do: steps are global)."""
        if not self.active or self.buffers is None or self.buffers.q is None:
            return None
        self.active = False
        q = self.buffers.queries(slots.shape[0])  # [scored layers, B, Hq, D]
        impl = scores_impl(slots.device)
        acc = None
        for (scale, cap), layers in self.buffers.layer_groups().items():  # one group unless layers scale apart
            mine = q if len(layers) == q.shape[0] else q[[self.buffers.index[i] for i in layers]]
            part = impl(mine, [key_buffer(i) for i in layers], slots, live_len, scale, cap)
            acc = part if acc is None else acc + part
        if all_reduce is not None and tp_size > 1:
            all_reduce(acc)
        self.steps_scored += 1
        return acc / (self.buffers.q.shape[2] * tp_size * len(self.layers))

    def take_window(self, key: Hashable) -> PrefillWindow | None:
        """The oldest waiting window if it is ``key``'s batch's (windows of batches whose results never came are
        dropped on the way), else None."""
        while self.windows:
            window = self.windows.popleft()
            if window.key == key:
                self.last_taken = window
                return window
        return None

    def window_of(self, name: Hashable) -> tuple[PrefillWindow, int] | None:
        """The newest window of a prefill forward that extended the request ``name`` (an element of its key), waiting
        or the one taken last, with the request's index in it; None if there is none. How a prompt evicted between
        its chunks finds its last chunk's queries, before (overlap scheduler) or after its batch's results."""
        for window in (*reversed(self.windows), self.last_taken):
            if window is not None and name in window.key:
                return window, window.key.index(name)
        return None

    def window_scores(
        self,
        window: PrefillWindow,
        key_buffer: Callable[[int], torch.Tensor],
        rows_slots: list[torch.Tensor],
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        tp_size: int = 1,
    ) -> list[torch.Tensor]:
        """After a scored prefill: per request of ``window``'s forward (batch order), ``[L]`` = its window's
        attention over its row ``rows_slots[i]`` (``L`` = prefix + extend length), a mean over heads, ranks and
        layers and a sum over the window's queries. Every TP rank calls it after the same forwards (one all-reduce
        over all requests together)."""
        assert len(rows_slots) == len(window.segments), "one row per request of the prefill"
        out = [torch.zeros(s.shape[0], dtype=torch.float32, device=s.device) for s in rows_slots]
        heads = 0
        for layer_id, (q, scale, cap) in sorted(window.queries.items()):
            k = key_buffer(layer_id)
            for acc, slots, (first, w, pos) in zip(out, rows_slots, window.segments):
                q_pos = torch.arange(pos, pos + w, device=slots.device)
                acc += window_scores_headsum(q[first : first + w], k, slots, q_pos, scale, cap)
            heads = q.shape[1]
        if all_reduce is not None and tp_size > 1 and out:
            flat = torch.cat(out)
            all_reduce(flat)
            out = list(torch.split(flat, [s.shape[0] for s in rows_slots]))
        norm = heads * tp_size * len(window.queries)
        self.prefill_forwards_scored += 1
        return [o / norm for o in out]
