"""SGLang's Triton kernels that read ``req_to_token`` and ``seq_lens`` on the decode path, over rows vToken
compacted: run as a script (``tests/server/test_index_kernels.py``), under ``TRITON_INTERPRET=1`` without a GPU.

- ``create_flashinfer_kv_indices_triton`` (``KVIndexTranslator.pack_read_stream``: the kv indices of FlashInfer's
  and the Triton backend's paged decode, a row's whole length or its last ``window`` entries), one program per row
  and token-block parallel;
- ``get_last_loc_triton`` and ``get_last_loc_triton_safe`` (the last slot of each row: where decode allocation
  puts the next token);
- FlashInfer's sliding-window decode plan: upstream's ``FlashInferIndicesUpdaterDecode.update_sliding_window``
  through vToken's hook on ``call_begin_forward`` (``hooks.windows``, registered with SGLang's hook registry) and
  upstream's gather (``pack_read_stream``). FlashInfer itself does not run on a CPU: each wrapper's plan is
  recorded (its device indptr and indices, and the host indptr it would plan with), through the wrapper's own
  plan and through ``fast_decode_plan`` (a captured graph's replays), both on a graph wrapper's index buffer (an
  eager wrapper's indices are allocated on CUDA). The sliding wrapper's keys must be the live tokens of each
  row's logical window, the full one's the whole row, and each plan's host lengths its device ones.

The rows come from the core (``tools.kv_engine``, K/V bytes stamped with each token's request and logical id):
requests append tokens, lose random victims (compacted rows), and the reclaimer relocates their live tokens into
fresh pages, with fences that report done late. After every step, the K/V that each kernel's slots point at must
be the stamps of the tokens this script knows to be live, in logical order (kept here independently of the Token
Table). Prints one line per kernel; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import functools
import os
import sys
import types

import numpy as np
import torch

assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(), "run with TRITON_INTERPRET=1 on CPU"

from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton  # noqa: E402
from sglang.kernels.ops.memory.common import get_last_loc_triton, get_last_loc_triton_safe  # noqa: E402
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

from vtoken_sglang.core.row_layout import RowLayout  # noqa: E402
from vtoken_sglang.integration.process import SchedulerProcess, bind  # noqa: E402
from vtoken_sglang.tools.kv_engine import KVEngine, stamp  # noqa: E402

WINDOW = 7  # a sliding window's suffix (kv_start_idx), shorter than most rows
SPAN = 9  # FlashInfer's sliding wrapper: logical positions a query sees, itself included (sliding_window_size + 1)
STEPS = 24


def kv_indices(slots, rows, lens, start, blocks: int) -> torch.Tensor:
    """The kernel's CSR stream over each row's columns ``start`` (None: 0) to ``lens``: as SGLang's sliding-window
    wrapper calls it, with the window's lengths (``paged_kernel_lens``) and its start per row (``kv_start_idx``)."""
    counts = lens - (start if start is not None else 0)
    indptr = torch.zeros(len(rows) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(counts, 0)
    out = torch.full((int(indptr[-1]),), -1, dtype=torch.int32)
    create_flashinfer_kv_indices_triton[(len(rows), blocks)](
        slots, rows, counts, indptr, start, out, slots.stride(0), TOKEN_BLOCK_PARALLEL=blocks > 1
    )
    return out


class PlanRecord:
    """In place of a FlashInfer decode wrapper of a captured CUDA graph (its indices in its own buffer): what its
    plan was given. ``fast``: it plans through ``fast_decode_plan`` (after capture), which takes an optional host
    indptr and otherwise reads the device one, as the wrapper's own plan always does."""

    def __init__(self, fast: bool, capacity: int):
        self.is_cuda_graph_enabled = True
        self._paged_kv_indices_buf = torch.full((capacity,), -1, dtype=torch.int32)
        if fast:
            self.begin_forward = functools.partial(record_plan, self)
        self.indptr = self.indices = self.host_indptr = None

    def begin_forward(self, indptr, indices, *args, **kwargs):
        record_plan(self, indptr, indices, *args, **kwargs)


def record_plan(wrapper: PlanRecord, indptr, indices, *args, global_override_indptr_cpu=None, **kwargs) -> None:
    wrapper.indptr, wrapper.indices = indptr.clone(), indices[: int(indptr[-1])].clone()
    host = global_override_indptr_cpu if global_override_indptr_cpu is not None else indptr.cpu()
    wrapper.host_indptr = host[: len(indptr)].to(torch.int64)


def flashinfer_updater(translator, rows: int, fast: bool):
    """Upstream's decode updater for a model with sliding layers (window ``SPAN - 1``), as its backend builds it,
    with two recording wrappers; ``fast``: plans go through ``fast_decode_plan``."""
    import sglang.srt.layers.attention.flashinfer_backend as fib

    if fast:
        fib.fast_decode_plan = record_plan  # FlashInfer's, which this CPU build does not import
    updater = object.__new__(fib.FlashInferIndicesUpdaterDecode)
    updater.sliding_window_size = SPAN - 1
    updater.attn_backend = types.SimpleNamespace(
        kv_index_translator=translator, dispatch_reason=fib.WrapperDispatch.SLIDING_WINDOW
    )
    updater.kv_indptr = [torch.zeros(rows + 1, dtype=torch.int32) for _ in range(2)]
    updater.kv_last_page_len = torch.ones(rows, dtype=torch.int32)
    updater._swa_kv_pool = None
    updater.num_qo_heads, updater.num_kv_heads, updater.head_dim = 4, 2, 16
    updater.data_type = updater.q_data_type = torch.float32
    return updater, [PlanRecord(fast, capacity=4096) for _ in range(2)]


def flashinfer_keys(updater, wrappers, translator, slots, rows, lens, eng) -> list[torch.Tensor]:
    """Upstream's sliding-window update over the batch; each wrapper's keys (the K stamps its indices point at),
    after checking that its plan's host indptr equals the device one."""
    from sglang.srt.mem_cache.kv_loc_plan import KVLocPlan

    pool_rows = rows.to(torch.int64)
    plan = KVLocPlan(
        source=translator, req_pool_indices=pool_rows, seq_lens=lens, seq_lens_cpu=lens, write_virtual=None
    )
    updater.update_sliding_window(
        lens, lens.clone(), int(lens.sum()), wrappers, None, None, plan=plan, req_pool_indices=pool_rows
    )
    for wrapper in wrappers:
        assert torch.equal(wrapper.host_indptr, wrapper.indptr.to(torch.int64)), "host and device lengths differ"
    return [eng.kv[0][wrapper.indices.long()] for wrapper in wrappers]


def main() -> int:
    from vtoken_sglang.integration.hooks import HOOKS

    target = "sglang.srt.layers.attention.flashinfer_backend.FlashInferIndicesUpdaterDecode.call_begin_forward"
    vt = SchedulerProcess()  # the slot the hook is bound to, as the plugin binds it to its process's
    HookRegistry.register(target, bind(HOOKS[target][1], vt), HookType.AROUND)
    HookRegistry.apply_hooks()
    g = torch.Generator().manual_seed(0)
    eng = KVEngine(num_pages=96, page_size=4, rows=8, max_context=256, reserve=4, fence_delay=4, fence_seed=3)
    table, rows = eng.table, torch.arange(6)
    table.open_rows(rows)
    live: list[list[int]] = [[] for _ in rows]  # each row's live logical ids, in order: this script's own account
    checked = dict.fromkeys(("kv_indices", "kv_indices_window", "kv_indices_blocks", "last_loc"), 0)
    checked |= dict.fromkeys(("flashinfer_window_plan", "flashinfer_window_fast_plan"), 0)
    translator = KVIndexTranslator(
        req_to_token=table.slots, token_to_kv_pool_allocator=None, token_to_kv_pool=None, page_size=1, device="cpu"
    )
    updaters = {
        name: flashinfer_updater(translator, len(rows), fast)
        for name, fast in (("flashinfer_window_plan", False), ("flashinfer_window_fast_plan", True))
    }
    runtime = types.SimpleNamespace(forward_layout=None)
    unhooked_differs = 0  # steps where upstream's window (the row's last entries) is not the logical one

    def fail(name: str, step: int) -> int:
        print(f"{name}: step {step}: the slots do not hold the live tokens in logical order", file=sys.stderr)
        return 1

    for step in range(STEPS):
        eng.load_step(rows, live, g, evict_one_in=5)  # victims: a fifth of each row's entries, never its newest
        slots = table.slots  # SGLang's req_to_token: int32, one row per request
        lens = torch.tensor([len(ids) for ids in live], dtype=torch.int32)  # what SGLang's seq_lens hold
        pool_rows = rows.to(torch.int32)
        window = (lens - WINDOW).clamp(min=0)
        want_all = stamp(torch.repeat_interleave(rows, lens.long()), torch.tensor([i for ids in live for i in ids]))
        in_window = [ids[len(ids) - min(len(ids), WINDOW) :] for ids in live]
        want_window = stamp(
            torch.repeat_interleave(rows, (lens - window).long()), torch.tensor([i for ids in in_window for i in ids])
        )
        for name, start, blocks, want in (
            ("kv_indices", None, 1, want_all),
            ("kv_indices_window", window, 1, want_window),
            ("kv_indices_blocks", None, 3, want_all),
        ):
            got = eng.kv[0][kv_indices(slots, pool_rows, lens, start, blocks).long()]
            if not torch.equal(got, want):
                return fail(name, step)
            checked[name] += len(rows)
        newest = stamp(rows, torch.tensor([ids[-1] for ids in live]))
        for fn in (get_last_loc_triton, get_last_loc_triton_safe):
            last = fn(slots, pool_rows.to(torch.int64), lens.to(torch.int64)).to(torch.int64)
            if not torch.equal(eng.kv[1][last], newest):
                return fail(fn.__name__, step)
        checked["last_loc"] += len(rows)
        logical_window = [[i for i in ids if i > ids[-1] - SPAN] for ids in live]
        want_logical = stamp(
            torch.repeat_interleave(rows, torch.tensor([len(ids) for ids in logical_window])),
            torch.tensor([i for ids in logical_window for i in ids]),
        )
        for name, (updater, wrappers) in updaters.items():
            vt.runtime = runtime
            zeros = np.zeros(len(rows), dtype=np.int64)  # the hook reads the table's offsets, not the layout's
            runtime.forward_layout = RowLayout(table, rows.numpy(), lens.numpy(), zeros, None, True, True)
            window_keys, full_keys = flashinfer_keys(updater, wrappers, translator, slots, rows, lens, eng)
            if not (torch.equal(window_keys, want_logical) and torch.equal(full_keys, want_all)):
                return fail(name, step)
            checked[name] += len(rows)
            vt.runtime = None  # upstream's path: the row's last SPAN entries
            window_keys, full_keys = flashinfer_keys(updater, wrappers, translator, slots, rows, lens, eng)
            unhooked_differs += not torch.equal(window_keys, want_logical)
    eng.reclaimer.release_ready(force=True)
    eng.check()
    st = eng.reclaimer.stats
    assert st.tokens_moved > 0 and st.release_waits > 0, "no relocation behind a late fence: nothing was checked"
    assert unhooked_differs > 0, "upstream's sliding window was right at every step: the hook was not tested"
    for name, n in checked.items():
        print(f"{name}: {n} rows right ({STEPS} steps, {st.tokens_moved} tokens relocated, {st.release_waits} late)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
