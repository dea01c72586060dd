"""SGLang's Triton kernels that read ``req_to_token`` and ``seq_lens`` on the decode path, over rows vToken
compacted: run as a script (``tests/server/test_index_kernels.py``), under ``TRITON_INTERPRET=1`` without a GPU.

- ``create_flashinfer_kv_indices_triton`` (``KVIndexTranslator.pack_read_stream``: the kv indices of FlashInfer's
  and the Triton backend's paged decode, a row's whole length or its last ``window`` entries), one program per row
  and token-block parallel;
- ``get_last_loc_triton`` and ``get_last_loc_triton_safe`` (the last slot of each row: where decode allocation
  puts the next token).

The rows come from the core (``tools.kv_engine``, K/V bytes stamped with each token's request and logical id):
requests append tokens, lose random victims (compacted rows), and the reclaimer relocates their live tokens into
fresh pages, with fences that report done late. After every step, the K/V that each kernel's slots point at must
be the stamps of the tokens this script knows to be live, in logical order (kept here independently of the Token
Table). Prints one line per kernel; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(), "run with TRITON_INTERPRET=1 on CPU"

from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton  # noqa: E402
from sglang.kernels.ops.memory.common import get_last_loc_triton, get_last_loc_triton_safe  # noqa: E402

from vtoken_sglang.tools.kv_engine import KVEngine, stamp  # noqa: E402

WINDOW = 7  # a sliding window's suffix (kv_start_idx), shorter than most rows
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


def main() -> int:
    g = torch.Generator().manual_seed(0)
    eng = KVEngine(num_pages=96, page_size=4, rows=8, max_context=256, reserve=4, fence_delay=4, fence_seed=3)
    table, rows = eng.table, torch.arange(6)
    table.open_rows(rows)
    live: list[list[int]] = [[] for _ in rows]  # each row's live logical ids, in order: this script's own account
    checked = dict.fromkeys(("kv_indices", "kv_indices_window", "kv_indices_blocks", "last_loc"), 0)

    def fail(name: str, step: int) -> int:
        print(f"{name}: step {step}: the slots do not hold the live tokens in logical order", file=sys.stderr)
        return 1

    for step in range(STEPS):
        counts = torch.randint(1, 9, (len(rows),), generator=g)
        eng.write(rows, counts)
        for ids, n in zip(live, counts.tolist()):
            ids.extend(range(ids[-1] + 1 if ids else 0, (ids[-1] + 1 if ids else 0) + n))
        # victims: a fifth of each row's entries, never its newest (the engine writes after it)
        vr, vc = [], []
        for r, ids in enumerate(live):
            cols = torch.randperm(len(ids) - 1, generator=g)[: len(ids) // 5].sort().values.tolist()
            vr += [r] * len(cols)
            vc += cols
            for c in reversed(cols):
                del ids[c]
        eng.evict(torch.tensor(vr, dtype=torch.int64), torch.tensor(vc, dtype=torch.int64))
        eng.reclaimer.step()
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
    eng.reclaimer.release_ready(force=True)
    eng.check()
    st = eng.reclaimer.stats
    assert st.tokens_moved > 0 and st.release_waits > 0, "no relocation behind a late fence: nothing was checked"
    for name, n in checked.items():
        print(f"{name}: {n} rows right ({STEPS} steps, {st.tokens_moved} tokens relocated, {st.release_waits} late)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
