"""Sliding windows by logical position as an attention kernel reads them: used by ``gpu_check.py`` (row
``flashinfer_window``); needs torch, and FlashInfer for its kernel (run only where it is installed, on CUDA); no
sglang.

Rows compacted by eviction and relocated by the reclaimer (``tools.kv_engine``, K/V stamped with each token's request
and logical id) are windowed as vToken's FlashInfer hook windows them: per request the suffix ``(w, start)`` of its
row within ``span`` logical positions (``TokenTable.window_suffix``), gathered into FlashInfer's CSR indices
(``indptr = cumsum(w)``). Checks, after every step:

- the keys the indices point at are the live tokens of each row's logical window (brute force over this module's
  own account of what is live), and upstream's window (a row's last ``span`` entries) is not, at some step;
- with FlashInfer: its paged decode kernel over those indices, planned from the exact lengths, equals attention
  computed in torch over the same keys (random fp16 K/V), with and without split-KV.

``check_extend``: prompts evicted between prefill chunks (each round keeps a row's newest ``SPAN - 1`` entries, as
``parts.prefill_eviction`` keeps the widest window), each chunk's forward planned as upstream's FlashInfer prefill
updater plans a sliding layer over live lengths (``tests/extend_plan_check.py`` runs upstream's own updater): the
keys are each row's last ``window + chunk`` entries, which must be the live tokens of the chunk's logical windows;
with FlashInfer, its paged prefill kernel (causal, ``window_left``) over them equals torch attention masked by
logical position.
"""

from __future__ import annotations

import torch

from vtoken_sglang.tools.kv_engine import KVEngine, stamp

SPAN = 9  # logical positions a query sees, itself included (SGLang's sliding_window_size + 1 on FlashInfer)
STEPS = 16


def csr(lengths: torch.Tensor) -> torch.Tensor:
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lengths, 0)
    return indptr


def gather(slots: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Each row's columns ``[start, start + w)`` of ``slots``, concatenated (what FlashInfer's index kernel
    writes for ``paged_kernel_lens = w``, ``kv_start_idx = start``)."""
    owner = torch.repeat_interleave(torch.arange(len(rows)), w)
    col = torch.arange(int(w.sum())) - torch.repeat_interleave(csr(w)[:-1].long(), w) + start[owner]
    return slots[rows[owner], col].to(torch.int32)


def reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor):
    """Attention of one query per request (``q [bs, Hq, D]``) over the keys ``indices[indptr[b]:indptr[b+1]]`` of
    ``k, v [slots, Hkv, D]``, in float32."""
    return reference_extend(q, k, v, csr(torch.ones(len(indptr) - 1, dtype=torch.int64)), indptr, indices)


def reference_extend(q, k, v, qo_indptr, indptr, indices, q_pos=None, k_pos=None) -> torch.Tensor:
    """Attention of each request's queries ``q[qo_indptr[b]:qo_indptr[b+1]]`` (``q [tokens, Hq, D]``) over its keys
    ``indices[indptr[b]:indptr[b+1]]`` of ``k, v [slots, Hkv, D]``, in float32; with the logical positions
    ``q_pos``/``k_pos``, each query sees only the keys within ``SPAN - 1`` positions before it, causally."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    for b in range(len(indptr) - 1):  # a check, not a hot path
        qs, ks = slice(int(qo_indptr[b]), int(qo_indptr[b + 1])), slice(int(indptr[b]), int(indptr[b + 1]))
        idx = indices[ks].long()
        kb = k[idx].float().repeat_interleave(group, 1)
        vb = v[idx].float().repeat_interleave(group, 1)
        att = torch.einsum("qhd,nhd->hqn", q[qs].float(), kb) * q.shape[-1] ** -0.5
        if q_pos is not None:
            d = q_pos[qs][:, None] - k_pos[ks][None, :]
            att = att.masked_fill(((d < 0) | (d > SPAN - 1)).to(q.device)[None], float("-inf"))
        out[qs] = torch.einsum("hqn,nhd->qhd", att.softmax(-1), vb)
    return out


def paged_plan_args(q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor) -> tuple:
    """A FlashInfer paged wrapper's plan arguments over ``indices`` (pages of one token): indptr, indices, last page
    lengths, query heads, KV heads, head dim, page size."""
    dev = q.device
    ones = torch.ones(len(indptr) - 1, dtype=torch.int32, device=dev)
    return indptr.to(dev), indices.to(dev), ones, q.shape[1], k.shape[1], q.shape[2], 1


def flashinfer_decode(q, k, v, indptr, indices, split_kv: bool):
    """FlashInfer's paged decode (pages of one token, NHD) over ``indices``, planned from ``indptr``."""
    import flashinfer

    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        *paged_plan_args(q, k, indptr, indices), data_type=k.dtype, q_data_type=q.dtype, disable_split_kv=not split_kv
    )
    return wrapper.run(q, (k[:, None], v[:, None])).float()


def flashinfer_extend(q, k, v, qo_indptr, indptr, indices):
    """FlashInfer's paged prefill (pages of one token, NHD, causal, window ``SPAN - 1``) over ``indices``."""
    import flashinfer

    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        qo_indptr.to(q.device),
        *paged_plan_args(q, k, indptr, indices),
        causal=True,
        window_left=SPAN - 1,
        q_data_type=q.dtype,
        kv_data_type=k.dtype,
    )
    return wrapper.run(q, (k[:, None], v[:, None])).float()


def check_extend(device: str) -> dict:
    """Runs the chunks; raises AssertionError on the first wrong key or output. Returns what was checked."""
    g = torch.Generator().manual_seed(6)
    eng = KVEngine(num_pages=128, page_size=4, rows=8, max_context=512, reserve=4, device=device)
    table, rows = eng.table, torch.arange(6)
    table.open_rows(rows)
    live: list[list[int]] = [[] for _ in rows]
    kernel = flashinfer_on(device)
    if kernel:
        k, v = (torch.randn(eng.kv[0].shape[0], 2, 64, generator=g).half().to(device) for _ in range(2))
    worst = 0.0
    for step in range(STEPS):
        counts = eng.append_live(rows, live, g, most=12)
        lens = torch.tensor([len(ids) for ids in live])
        w = torch.minimum(lens, SPAN - 1 + counts)  # upstream's paged_kernel_lens on a sliding layer
        indices = gather(table.slots, rows, w, lens - w)
        keys = [ids[len(ids) - n :] for ids, n in zip(live, w.tolist())]
        in_window = [[i for i in ids if i >= ids[len(ids) - c] - (SPAN - 1)] for ids, c in zip(live, counts.tolist())]
        assert keys == in_window, f"step {step}: the rows' last entries are not the chunks' logical windows"
        got = eng.kv[0][indices.to(device).long()].cpu()
        want = stamp(torch.repeat_interleave(rows, w), torch.tensor([i for x in keys for i in x]))
        assert torch.equal(got, want), f"step {step}: the indices are not the live tokens of the windows"
        if kernel:
            q = torch.randn(int(counts.sum()), 4, 64, generator=g).half().to(device)
            q_pos = torch.tensor([i for ids, c in zip(live, counts.tolist()) for i in ids[len(ids) - c :]])
            k_pos = torch.tensor([i for x in keys for i in x])
            qo = csr(counts)
            ref = reference_extend(q, k, v, qo, csr(w), indices.to(device), q_pos, k_pos)
            err = float((flashinfer_extend(q, k, v, qo, csr(w), indices) - ref).abs().max())
            assert err < 2e-2, f"step {step}: FlashInfer's prefill differs by {err:.2e}"
            worst = max(worst, err)
        eng.evict_live(rows, live, g, evict_one_in=3, keep_newest=SPAN - 1)  # the round between chunks
        eng.reclaimer.step()
    eng.reclaimer.release_ready(force=True)
    eng.check()
    assert eng.reclaimer.stats.tokens_moved > 0, "nothing relocated: compacted rows were not checked"
    assert all(ids[0] > 0 for ids in live), "rows were not compacted"
    moved = eng.reclaimer.stats.tokens_moved
    return {
        "steps": STEPS,
        "rows": len(rows),
        "span": SPAN,
        "tokens_moved": moved,
        "kernel": kernel,
        "max_abs_err": worst,
    }


def flashinfer_on(device: str) -> bool:
    """FlashInfer's kernels run here: installed, on CUDA."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return device == "cuda"


def check(device: str) -> dict:
    """Runs the steps; raises AssertionError on the first wrong key or output. Returns what was checked."""
    g = torch.Generator().manual_seed(5)
    eng = KVEngine(num_pages=96, page_size=4, rows=8, max_context=256, reserve=4, device=device)
    table, rows = eng.table, torch.arange(6)
    table.open_rows(rows)
    live: list[list[int]] = [[] for _ in rows]
    kernel = flashinfer_on(device)
    if kernel:
        slots = eng.kv[0].shape[0]
        k = torch.randn(slots, 2, 64, generator=g).half().to(device)
        v = torch.randn(slots, 2, 64, generator=g).half().to(device)
    upstream_wrong = worst = 0.0
    for step in range(STEPS):
        eng.load_step(rows, live, g, evict_one_in=4)
        lens = torch.tensor([len(ids) for ids in live])
        w, start = table.window_suffix(rows, lens, SPAN)
        indices = gather(table.slots, rows, w, start)
        in_window = [[i for i in ids if i > ids[-1] - SPAN] for ids in live]
        want = stamp(
            torch.repeat_interleave(rows, torch.tensor([len(x) for x in in_window])),
            torch.tensor([i for x in in_window for i in x]),
        )
        got = eng.kv[0][indices.to(device).long()].cpu()
        assert torch.equal(got, want), f"step {step}: the window's indices are not the live tokens of the window"
        last = lens.clamp(max=SPAN)
        upstream = eng.kv[0][gather(table.slots, rows, last, lens - last).to(device).long()].cpu()
        upstream_wrong += not torch.equal(upstream, want)
        if kernel:
            q = torch.randn(len(rows), 4, 64, generator=g).half().to(device)
            indptr = csr(w)
            ref = reference_decode(q, k, v, indptr, indices.to(device))
            for split_kv in (False, True):
                err = float((flashinfer_decode(q, k, v, indptr, indices, split_kv) - ref).abs().max())
                assert err < 2e-2, f"step {step}: FlashInfer (split_kv {split_kv}) differs by {err:.2e}"
                worst = max(worst, err)
    eng.reclaimer.release_ready(force=True)
    eng.check()
    assert eng.reclaimer.stats.tokens_moved > 0, "nothing relocated: compacted rows were not checked"
    assert upstream_wrong > 0, "the rows' last entries were the logical window at every step: nothing was checked"
    return {
        "steps": STEPS,
        "rows": len(rows),
        "span": SPAN,
        "tokens_moved": eng.reclaimer.stats.tokens_moved,
        "upstream_wrong_steps": int(upstream_wrong),
        "kernel": kernel,
        "max_abs_err": worst,
    }
