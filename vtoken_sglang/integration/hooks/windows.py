"""Hooks on the backends' sliding windows: a sliding layer's decode window is taken by logical position (the
forward's ``RowLayout.window``), not as the last ``window`` entries of a compacted row, which would reach logically
older tokens. Each hook takes upstream's path while no row is managed (every row dense: upstream's window is right).

Each backend keeps its own span (how many logical positions a query sees, itself included), so a row that never
evicted gets exactly upstream's window: torch_native and FlashInfer ``sliding_window_size + 1``, Triton's decode
``sliding_window_size`` (upstream's Triton decode window is one key shorter than its extend's and FlashInfer's)."""

from __future__ import annotations

from vtoken_sglang.core.row_layout import RowLayout
from vtoken_sglang.integration.process import SchedulerProcess


def decode_layout(vt: SchedulerProcess) -> RowLayout | None:
    """The layout of the decode forward being run when some row of it is managed, else None (upstream's window is
    right: extend rows are dense, a request being compacted only after its prefill)."""
    rt = vt.runtime
    layout = rt.forward_layout if rt is not None else None
    return layout if layout is not None and layout.any_managed and layout.decoding else None


def torch_native_decode_window(vt: SchedulerProcess, original, backend, *args, sliding_window_size=None, **kwargs):
    """AROUND ``TorchNativeAttnBackend._run_sdpa_forward_decode``: for a sliding layer (a window of
    ``sliding_window_size`` + 1 positions, the query's own included: upstream's mask), each request attends to its
    row's suffix ``[start, start + w)``, through upstream's own per-request column offset (``encoder_lens`` with
    ``is_cross_attn`` False) and no mask: one query sees every key of its suffix."""
    layout = decode_layout(vt)
    if layout is None or sliding_window_size is None or sliding_window_size < 0:
        return original(backend, *args, sliding_window_size=sliding_window_size, **kwargs)
    head, (req_pool_indices, seq_lens), rest = args[:5], args[5:7], args[7:]
    encoder_lens = rest[0] if rest else kwargs.pop("encoder_lens", None)
    if encoder_lens is not None or kwargs.get("is_cross_attn") or len(rest) > 1:
        raise RuntimeError("vToken: a sliding decode layer with encoder lengths (cross-attention) is not supported")
    w, start = layout.window(req_pool_indices, seq_lens, sliding_window_size + 1)
    return original(backend, *head, req_pool_indices, w, start, **{**kwargs, "is_cross_attn": False})


class _FromStart:
    """A KV index translator whose reads start at vToken's window starts (every other attribute is the
    translator's own)."""

    def __init__(self, translator, start):
        self._translator, self._start = translator, start

    def __getattr__(self, name):
        return getattr(self._translator, name)

    def pack_read_stream(self, plan, **kwargs):
        kwargs["kv_start_idx"] = self._start
        return self._translator.pack_read_stream(plan, **kwargs)


def triton_decode_window(
    vt: SchedulerProcess,
    original,
    window_kv_indptr,
    translator,
    plan,
    req_pool_indices,
    sliding_window_size,
    seq_lens,
    *args,
    **kwargs,
):
    """AROUND ``triton_backend.update_sliding_window_buffer`` (the eager decode path and every CUDA-graph replay's
    metadata step call it): in a decode forward, the window of each request is its row's suffix of ``w`` entries
    within ``sliding_window_size`` logical positions (upstream's Triton decode span), so lengths and indptr
    are ``w`` (at most the window: a captured graph's index buffer holds them) and the gather starts at ``start``.
    Upstream's body runs with ``w`` as the lengths (its clamp then changes nothing) and a translator whose gather
    starts at ``start``; its returned starts are replaced by ours."""
    layout = decode_layout(vt)
    if layout is None:
        return original(
            window_kv_indptr, translator, plan, req_pool_indices, sliding_window_size, seq_lens, *args, **kwargs
        )
    w, start = layout.window(req_pool_indices, seq_lens, sliding_window_size)
    indptr, indices, lens, _ = original(
        window_kv_indptr, _FromStart(translator, start), plan, req_pool_indices, sliding_window_size, w, *args, **kwargs
    )
    return indptr, indices, lens, start


def flashinfer_decode_window(
    vt: SchedulerProcess,
    original,
    updater,
    wrapper,
    lens,
    lens_sum,
    kv_indptr,
    kv_start_idx,
    spec_info,
    *args,
    req_pool_indices,
    **kwargs,
):
    """AROUND ``FlashInferIndicesUpdaterDecode.call_begin_forward`` (eager decode and every CUDA-graph replay's
    metadata step): the sliding wrapper's plan (the one call given ``kv_start_idx``) takes each request's suffix
    ``(w, start)`` within ``sliding_window_size + 1`` logical positions (upstream's span: its lengths clamped to
    that, ``window_left`` = the window) instead of the row's last entries.

    FlashInfer's decode plan partitions each request's keys by its host lengths and its kernel bounds them by the
    device ones, in unsigned arithmetic: the two must be equal. Upstream's host lengths (its clamp of
    ``seq_lens_cpu``) are only upper bounds of ``w``, so they are dropped (``seq_lens_cpu`` None): the plan then
    reads the device indptr itself, exact (FlashInfer's eager plan always does; under CUDA graphs this is the one
    device-to-host read a sliding model adds per decode step). ``lens_sum``, upstream's sum of the clamped lengths,
    bounds the indices an eager plan allocates."""
    layout = decode_layout(vt)
    if layout is None or kv_start_idx is None or updater.sliding_window_size is None:
        return original(
            updater, wrapper, lens, lens_sum, kv_indptr, kv_start_idx, spec_info, *args,
            req_pool_indices=req_pool_indices, **kwargs,
        )  # fmt: skip
    w, start = layout.window(req_pool_indices, lens + kv_start_idx, updater.sliding_window_size + 1)
    if args:
        args = (None, *args[1:])
    else:
        kwargs["seq_lens_cpu"] = None
    return original(
        updater, wrapper, w, lens_sum, kv_indptr, start, spec_info, *args, req_pool_indices=req_pool_indices, **kwargs
    )
