"""FlashInfer's extend (prefill) plan over rows vToken compacted between prefill chunks: upstream's
``FlashInferIndicesUpdaterPrefill`` as its backend builds it, unhooked, given the batch's live lengths (what
``hooks.allocation.extend_over_live_rows`` makes them), under ``TRITON_INTERPRET=1`` without a GPU
(``tests/server/test_index_kernels.py`` runs it).

A load of prompts evicted between chunks (``tools.kv_engine``, K/V stamped with each token's request and logical
id): every step each row appends a chunk, the chunk's forward is planned, then a round evicts a third of each
row's entries but never its newest ``WINDOW`` (the rule of ``parts.prefill_eviction``: the newest
``max(recent, widest window)`` positions stay), and the reclaimer relocates live tokens behind late fences.
FlashInfer does not run on a CPU: each wrapper's plan is recorded. For a sliding model (window ``WINDOW``) and a
full-attention one, on the paged path and the ragged one (chunk K/V attended apart, the paged plan over the
prefix), every plan must point at the live tokens each query may see by logical position, in logical order; its
query lengths are the chunks; a sliding plan's ``window_left`` (paged) or custom mask (ragged), applied by column
distance, must equal the window by logical distance. Prints one line per plan; exits non-zero on the first
mismatch.
"""

from __future__ import annotations

import os
import sys
import types

import torch

assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(), "run with TRITON_INTERPRET=1 on CPU"

from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator  # noqa: E402
from sglang.srt.mem_cache.kv_loc_plan import KVLocPlan  # noqa: E402

from vtoken_sglang.tools.kv_engine import KVEngine, stamp  # noqa: E402

WINDOW = 8  # SGLang's sliding_window_size: a query sees itself and the WINDOW positions before it
STEPS = 20


class PlanRecord:
    """In place of a FlashInfer prefill wrapper (paged or ragged): what its plan was given."""

    is_cuda_graph_enabled = False

    def __init__(self):
        self.qo = self.indptr = self.indices = self.mask = None
        self.window_left = -1

    def begin_forward(self, qo_indptr, kv_indptr, kv_indices=None, *args, custom_mask=None, window_left=-1, **kw):
        self.qo, self.indptr = qo_indptr.clone(), kv_indptr.clone()
        if kv_indices is not None and torch.is_tensor(kv_indices):
            self.indices = kv_indices[: int(kv_indptr[-1])].clone()
        self.mask, self.window_left = custom_mask, window_left


def prefill_updater(translator, rows: int, sliding: bool):
    """Upstream's prefill updater for a model with sliding layers (``sliding``) or full attention only."""
    import sglang.srt.layers.attention.flashinfer_backend as fib

    updater = object.__new__(fib.FlashInferIndicesUpdaterPrefill)
    updater.sliding_window_size = WINDOW if sliding else None
    reason = fib.WrapperDispatch.SLIDING_WINDOW if sliding else None
    updater.attn_backend = types.SimpleNamespace(
        kv_index_translator=translator, dispatch_reason=reason, dq_paged_kernel_lens=None
    )
    updater.kv_indptr = [torch.zeros(rows + 1, dtype=torch.int32) for _ in range(2)]
    updater.qo_indptr = [torch.zeros(rows + 1, dtype=torch.int32) for _ in range(2)]
    updater.kv_last_page_len = torch.ones(rows, dtype=torch.int32)
    updater._swa_kv_pool = None
    updater.prefill_wrapper_ragged = PlanRecord()
    updater.num_qo_heads, updater.num_kv_heads, updater.head_dim = 4, 2, 16
    updater.data_type = updater.q_data_type = torch.float32
    update = updater.update_sliding_window if sliding else updater.update_single_wrapper
    return update, updater, [PlanRecord() for _ in range(2 if sliding else 1)]


def stamps_of(rows: torch.Tensor, ids: list[list[int]]) -> torch.Tensor:
    """The K stamps of ``ids[i]`` (logical ids) of each request ``rows[i]``, concatenated."""
    return stamp(
        torch.repeat_interleave(rows, torch.tensor([len(x) for x in ids])), torch.tensor([i for x in ids for i in x])
    )


def logical_mask(queries: list[list[int]], keys: list[list[int]]) -> torch.Tensor:
    """Per request, ``[query, key]`` flattened: the key within the query's window by logical position."""
    parts = [
        (torch.tensor(k)[None, :] >= torch.tensor(q)[:, None] - WINDOW).flatten() for q, k in zip(queries, keys) if k
    ]
    return torch.cat(parts) if parts else torch.ones(0, dtype=torch.bool)


def check_plans(name, wrappers, ragged, eng, rows, live, counts) -> str | None:
    """What is wrong with the recorded plans of one chunk's forward, or None."""
    chunk = [ids[len(ids) - n :] for ids, n in zip(live, counts.tolist())]
    prefix = [ids[: len(ids) - n] for ids, n in zip(live, counts.tolist())]
    seen = prefix if ragged else live  # the ragged path attends the chunk's own K/V apart from the paged plan
    qo = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(counts, 0)
    for w, wrapper in enumerate(wrappers):
        sliding = w == 0 and len(wrappers) == 2
        keys = [[i for i in ids if i >= c[0] - WINDOW] for ids, c in zip(seen, chunk)] if sliding else seen
        if not torch.equal(wrapper.qo, qo):
            return f"{name}[{w}]: query lengths are not the chunks"
        if not torch.equal(eng.kv[0][wrapper.indices.long()], stamps_of(rows, keys)):
            return f"{name}[{w}]: the keys are not the live tokens the chunk may see, in logical order"
        if sliding and not ragged and wrapper.window_left != WINDOW:
            return f"{name}[{w}]: window_left {wrapper.window_left}"
        if sliding and ragged:  # by column distance over the plan's keys: must be the logical window
            want = logical_mask(chunk, keys)
            got = wrapper.mask.bool() if wrapper.mask is not None else torch.ones_like(want)
            if not torch.equal(got, want):
                return f"{name}[{w}]: the custom mask is not the window by logical position"
        if sliding and not ragged:  # FlashInfer masks by column: query j of the chunk at column kv_len - qo_len + j
            for c, k in zip(chunk, keys):
                cols = torch.arange(len(k))[None, :]
                qcol = len(k) - len(c) + torch.arange(len(c))[:, None]
                by_col = (cols >= qcol - WINDOW) & (cols <= qcol)
                by_pos = (torch.tensor(k)[None, :] >= torch.tensor(c)[:, None] - WINDOW) & (
                    torch.tensor(k)[None, :] <= torch.tensor(c)[:, None]
                )
                if not torch.equal(by_col, by_pos):
                    return f"{name}[{w}]: window_left by column is not the window by logical position"
    return None


def main() -> int:
    g = torch.Generator().manual_seed(1)
    eng = KVEngine(num_pages=128, page_size=4, rows=8, max_context=512, reserve=4, fence_delay=4, fence_seed=2)
    table, rows = eng.table, torch.arange(6)
    table.open_rows(rows)
    live: list[list[int]] = [[] for _ in rows]  # each row's live logical ids, in order: this script's own account
    translator = KVIndexTranslator(
        req_to_token=table.slots, token_to_kv_pool_allocator=None, token_to_kv_pool=None, page_size=1, device="cpu"
    )
    plans = {
        f"flashinfer_extend_{kind}_{path}": (prefill_updater(translator, len(rows), kind == "sliding"), path)
        for kind in ("sliding", "full")
        for path in ("paged", "ragged")
    }
    checked = dict.fromkeys(plans, 0)
    evicted = 0
    for step in range(STEPS):
        counts = eng.append_live(rows, live, g, most=12)  # the chunk, longer than the window at times
        lens = torch.tensor([len(ids) for ids in live], dtype=torch.int32)  # the batch's live seq_lens
        prefix = lens - counts.to(torch.int32)  # its live prefix_lens
        pool_rows = rows.to(torch.int64)
        plan = KVLocPlan(
            source=translator, req_pool_indices=pool_rows, seq_lens=lens, seq_lens_cpu=lens, write_virtual=None
        )
        for name, ((update, updater, wrappers), path) in plans.items():
            ragged = path == "ragged"
            update(
                pool_rows, lens, lens, int(lens.sum()), prefix, wrappers, ragged, None, None,
                extend_prefix_lens_cpu=prefix.tolist(), plan=plan,
            )  # fmt: skip
            wrong = check_plans(name, wrappers, ragged, eng, rows, live, counts)
            if ragged and wrong is None and not torch.equal(updater.prefill_wrapper_ragged.qo, wrappers[0].qo):
                wrong = f"{name}: the ragged wrapper's query lengths are not the chunks"
            if wrong:
                print(f"step {step}: {wrong}", file=sys.stderr)
                return 1
            checked[name] += len(rows)
        before = sum(len(ids) for ids in live)
        eng.evict_live(rows, live, g, evict_one_in=3, keep_newest=WINDOW)  # the round between chunks
        evicted += before - sum(len(ids) for ids in live)
        eng.reclaimer.step()
    eng.reclaimer.release_ready(force=True)
    eng.check()
    st = eng.reclaimer.stats
    assert st.tokens_moved > 0 and st.release_waits > 0, "no relocation behind a late fence: nothing was checked"
    assert evicted > 0 and all(ids[0] > 0 or len(ids) < ids[-1] + 1 for ids in live), "rows were not compacted"
    for name, n in checked.items():
        print(f"{name}: {n} rows right ({STEPS} steps, {evicted} evicted, {st.tokens_moved} tokens relocated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
