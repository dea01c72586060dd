"""The prepared device check: what only a GPU can tell about vToken's core and scoring, as one table.

    python3 benchmark/gpu_check.py [--device cuda|cpu] [--quick] [--json PATH]     (or benchmark/gpu_check.sh)

Needs torch and triton only (no sglang, no pytest); imports ``vtoken_sglang.core``, ``vtoken_sglang.scoring``,
``vtoken_sglang.tools.kv_engine`` (the test K/V engine) and ``scoring_cost.py``, ``graph_queries.py``,
``state_cells.py``, ``window_plans.py`` beside it.
Rows (``check  result  figure  unit/notes``), printed as each one finishes:

- correctness (``ok``/``FAIL``; any FAIL makes the exit status 1):
  ``copy_order``  the copy engine's copy runs after the writer of its sources and before a reader that called
                  ``order_before_next_forward`` (each side delayed in turn with ``torch.cuda._sleep``, so a
                  missing order reads stale values);
  ``overlap_order``  with ``producer`` set to a separate forward stream (SGLang's overlap scheduler), a copy runs
                  after that stream's late writer (and, as a control, reads stale values without it);
  ``fence_done``  ``Fence.done()`` is false while earlier work runs, does not block, and once true the copy
                  published before it is complete;
  ``reclaim_integrity``  a Reclaimer over a TokenTable with real evictions, relocating K/V stamped with
                  (request, logical id) in device buffers, then ``check_integrity`` (bytes included);
  ``late_release``  copies that complete late (the copy stream delayed): sources are freed at the same step, and
                  the same pages, as with copies that complete at once (a blocking wait at the release step),
                  everything pending is freed at idle, integrity after;
  ``triton_scores``  the Triton scoring kernel equals the torch reference (GQA groups 1-4, head dims that are
                  not powers of two, partial blocks, an empty row);
  ``window_scores``  SnapKV's ``window_scores_headsum`` on the device against a float64 CPU computation;
  ``state_per_request``  ``state_cells.check``: each request's own policy state (a shared prefix's included) on a
                  device Token Table, through folds, evictions, copy-on-write moves, packing and growth of the
                  cells: equal to a CPU table's bit for bit and to an account kept by (request, logical);
  ``flashinfer_window``  ``window_plans.check``: sliding windows by logical position over compacted, relocated rows
                  as vToken's FlashInfer hook plans them (each row's suffix ``(w, start)``): the indices point at
                  the live tokens of the logical window; where FlashInfer is installed (CUDA), its decode kernel
                  over them, planned from the exact lengths, equals torch attention (with and without split-KV);
  ``flashinfer_extend``  ``window_plans.check_extend``: prompts evicted between prefill chunks, each chunk's sliding
                  layer planned as SGLang's FlashInfer prefill updater plans it over live lengths: the keys are the
                  live tokens of the chunk's logical windows; with FlashInfer (CUDA), its paged prefill kernel
                  (causal, ``window_left``) over them equals torch attention masked by logical position;
  ``graph_queries``  ``graph_queries.check``: decode queries written by a captured CUDA graph's replays into the
                  score collector's static buffers equal an eager forward's, scores too, bit for bit (CPU: eager
                  against a per-step capture).
- timings (a FAIL here makes the exit status 2 when every correctness check passed; a copy that moved the wrong
  bits fails as a correctness check):
  ``copy_time[n]``  one relocation plan of n tokens over a Llama-8B-like KV pool (32 layers x K,V, 8 KV heads,
                  head dim 128, bf16): device ms per plan (CUDA events), tokens per second, host issue ms;
  ``scoring_cost[BxL]``  ``scoring_cost.run_shape``: torch and Triton scoring against one decode attention
                  pass; ratio = what the server runs (Triton on CUDA, torch on CPU) / attention, target <= 1;
  ``graph_scoring``  (CUDA) what the query writes add to a replayed decode step, and one step's scoring.

On CPU the copy engine is ``CpuCopyEngine``, Triton runs under its interpreter (``TRITON_INTERPRET=1``, set
here before the kernel module is imported) and every shape is tiny.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch  # importing torch does not import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # scoring_cost.py

from vtoken_sglang.core.copy_engine import CopyEngine, make_copy_engine  # noqa: E402
from vtoken_sglang.tools.kv_engine import KVEngine  # noqa: E402


@dataclasses.dataclass
class Row:
    check: str
    result: str  # "ok" | "FAIL" | "skip"
    figure: str
    notes: str
    correctness: bool = True
    data: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Setup:
    device: str
    quick: bool
    sleep: Callable[[float], None]  # delay the current CUDA stream by this many ms (no-op on CPU)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- set-up


def use_triton_interpreter_on_cpu(device: str) -> None:
    """Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when ``triton_scores`` is imported: set it
    before that import (nothing earlier imports triton)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    assert "vtoken_sglang.scoring.triton_scores" not in sys.modules, "triton kernels imported before the mode was set"


def make_sleeper(device: str) -> Callable[[float], None]:
    """``sleep(ms)`` enqueues a busy wait of ``ms`` on the current CUDA stream (``torch.cuda._sleep`` counts clock
    cycles: calibrated once here). A no-op on CPU."""
    if device != "cuda":
        return lambda ms: None
    cycles = 20_000_000
    for _ in range(2):  # the first launch pays for start-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        per_ms = cycles / max(start.elapsed_time(end), 1e-3)
    return lambda ms: torch.cuda._sleep(int(ms * per_ms))


# ---------------------------------------------------------------------------------------------------- a. copy engine


def check_copy_order(s: Setup) -> Row:
    """Four rounds, each writing a new value into the sources: the writer delayed (an unordered copy would read the
    old sources), then the copy stream delayed (an unordered reader would read the old destinations)."""
    bufs = [torch.zeros(1 << 16, 8, device=s.device) for _ in range(4)]
    eng = make_copy_engine(bufs)
    src = torch.arange(0, 4096)  # host indices, as the reclaimer passes them
    dst = src + 8192
    src_d, dst_d = src.to(s.device), dst.to(s.device)
    issue_ms = []
    for value, slow in ((7.0, "writer"), (11.0, "copy"), (13.0, "writer"), (17.0, "copy")):
        if slow == "writer":
            s.sleep(20)
        for b in bufs:
            b[src_d] = value
        if slow == "copy" and s.device == "cuda":
            with torch.cuda.stream(eng.stream):
                s.sleep(20)
        ticket = eng.copy(src, dst)
        if slow == "writer":
            issue_ms.append(ticket.seconds * 1e3)
        eng.order_before_next_forward(ticket)
        got = torch.stack([b[dst_d].sum() for b in bufs]).cpu()  # the next "forward" reads the destinations
        want = value * src.numel() * 8
        if not bool((got == want).all()):
            raise AssertionError(f"{slow} delayed: reader saw sums {got.tolist()}, want {want}")
    sync(s.device)
    how = (
        f"writer / copy stream delayed 20 ms in turn; copy() took {max(issue_ms):.2f} ms on the host while the "
        "writer slept"
        if s.device == "cuda"
        else "CpuCopyEngine (synchronous)"
    )
    return Row("copy_order", "ok", "4/4", f"rounds ok; {how}", data={"copy_issue_ms_writer_asleep": issue_ms})


def check_overlap_order(s: Setup) -> Row:
    """SGLang's overlap scheduler: the last forward runs on its own stream, unordered with the scheduling stream
    that issues the copy. With the engine's ``producer`` set to that stream, a copy reads what the late forward
    wrote; the same round without it must read the old sources (the order comes from ``producer``)."""
    if s.device != "cuda":
        return Row("overlap_order", "ok", "-", "CpuCopyEngine (synchronous; the forward has finished)")
    bufs = [torch.zeros(1 << 16, 8, device=s.device) for _ in range(2)]
    src = torch.arange(0, 4096)
    dst = src + 8192
    src_d, dst_d = src.to(s.device), dst.to(s.device)
    forward = torch.cuda.Stream()
    seen = {}
    for ordered, value in ((True, 5.0), (False, 9.0)):
        eng = make_copy_engine(bufs)
        eng.producer = forward if ordered else None
        sync(s.device)
        with torch.cuda.stream(forward):
            s.sleep(20)
            for b in bufs:
                b[src_d] = value
        eng.order_before_next_forward(eng.copy(src, dst))
        seen[ordered] = float(torch.stack([b[dst_d].sum() for b in bufs]).sum().cpu())
        sync(s.device)
    want = 5.0 * src.numel() * 8 * len(bufs)
    if seen[True] != want:
        raise AssertionError(f"with producer: the copy read {seen[True]}, want {want}")
    control = "stale without it (control)" if seen[False] != 9.0 * src.numel() * 8 * len(bufs) else "control not stale"
    return Row("overlap_order", "ok", "1/1", f"copy after a forward stream delayed 20 ms; {control}")


def check_fence(s: Setup) -> Row:
    """CPU: every fence is done at once. CUDA: not done while earlier work runs, ``done()`` does not block, done
    after a sync, and a fence taken after ``order_before_next_forward`` is done only once the copy is."""
    bufs = [torch.zeros(1 << 12, 8, device=s.device) for _ in range(2)]
    eng = make_copy_engine(bufs)
    if s.device != "cuda":
        f = eng.fence()
        if not f.done():
            raise AssertionError("a CpuCopyEngine fence is not done")
        return Row("fence_done", "ok", "1/1", "CpuCopyEngine: every fence done at once")
    s.sleep(100)
    fence = eng.fence()
    t0 = time.perf_counter()
    early = fence.done()
    query_ms = (time.perf_counter() - t0) * 1e3
    if early:
        raise AssertionError("fence done while the work before it still ran")
    if query_ms > 5:
        raise AssertionError(f"done() blocked for {query_ms:.1f} ms")
    torch.cuda.current_stream().synchronize()
    if not fence.done():
        raise AssertionError("fence not done after a stream sync")
    with torch.cuda.stream(eng.stream):
        s.sleep(30)
    ticket = eng.copy(torch.arange(0, 1024), torch.arange(2048, 3072))
    eng.order_before_next_forward(ticket)
    after = eng.fence()
    polls = poll_until(after.done, timeout_s=10)
    if not ticket.event.query():
        raise AssertionError("fence after order_before_next_forward done before the copy")
    return Row(
        "fence_done",
        "ok",
        "3/3",
        f"pending while 100 ms ran (query {query_ms:.3f} ms); done after sync; "
        f"covers the published copy ({polls} polls)",
    )


def poll_until(cond: Callable[[], bool], timeout_s: float) -> int:
    """Poll ``cond`` until true; returns the number of polls. Raises ``TimeoutError``."""
    deadline, n = time.monotonic() + timeout_s, 0
    while not cond():
        n += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done after {timeout_s} s")
        time.sleep(0.001)
    return n


def stamped_engine(device: str, fence_delay: int = 0, fence_seed: int = 0) -> KVEngine:
    """8 requests over 320 pages of 16 tokens (reserve 8) in device K/V buffers ``[slots, 3]`` holding
    ``token_stamp`` bytes; host table; the reclaimer at theta 0, grace 1."""
    return KVEngine(
        num_pages=320,
        page_size=16,
        rows=8,
        max_context=4096,
        reserve=8,
        device=device,
        fence_delay=fence_delay,
        fence_seed=fence_seed,
    )


def check_reclaim(s: Setup) -> Row:
    """Prefill 8 requests, then decode steps with random evictions, a reclaim step each; one request ends and
    another starts midway. Integrity (bytes included) after every third step (reading the buffers back orders after
    the published copies; the steps between run without any sync, so fences may still be pending), and at the end."""
    g = torch.Generator().manual_seed(1)
    eng = stamped_engine(s.device)
    rows = torch.arange(8)
    eng.table.open_rows(rows)
    eng.write(rows, torch.randint(100, 300, (8,), generator=g))
    for step in range(12):
        eng.evict_random(0.25, g)
        eng.reclaimer.step()
        if step % 3 == 2:
            eng.check()
        if step == 5:
            eng.close(3)
            eng.table.open_rows(torch.tensor([3]))
            eng.write(torch.tensor([3]), torch.tensor([50]))
        eng.write(rows, torch.full((8,), 16))
    sync(s.device)
    for _ in range(2):
        eng.reclaimer.step()
    eng.check()
    st = eng.reclaimer.stats
    if st.pages_reclaimed == 0 or st.tokens_moved == 0:
        raise AssertionError(f"nothing was reclaimed: {st.as_dict()}")
    return Row(
        "reclaim_integrity",
        "ok",
        str(st.pages_reclaimed),
        f"pages reclaimed; {st.tokens_moved} tokens moved "
        f"in {st.plans_admitted} plans, 12 steps, check_integrity after every 3rd",
        data=st.as_dict(),
    )


def check_late_release(s: Setup) -> Row:
    """Relocation sources are freed at a fixed step, whatever the copy's timing: the same (freed, pending, free)
    pages at every step when the copies complete late (CUDA: the copy stream is delayed 30 ms before each step, so
    a fence is still pending at its release step; CPU: fences that report done late, delay 4, two seeds) as when
    they complete at once; at idle, ``release_ready(force=True)`` waits and frees everything pending; integrity
    (bytes included) after."""
    cuda = s.device == "cuda"

    def run(late: bool, seed: int) -> tuple[list, int, int]:
        g = torch.Generator().manual_seed(3)
        eng = stamped_engine(s.device, fence_delay=4 if late and not cuda else 0, fence_seed=seed)
        rec, rows = eng.reclaimer, torch.arange(8)
        eng.table.open_rows(rows)
        eng.write(rows, torch.randint(100, 300, (8,), generator=g))
        per_step = []
        for _ in range(8):
            eng.evict_random(0.3, g)
            if late and cuda:
                with torch.cuda.stream(rec.engine.stream):
                    s.sleep(30)
            before = rec.stats.pages_reclaimed
            rec.step()
            per_step.append((rec.stats.pages_reclaimed - before, rec.pending_pages(), eng.pool.num_free()))
            eng.write(rows, torch.full((8,), 16))
        pending_at_idle = rec.pending_pages()
        rec.release_ready(force=True)  # the server goes idle
        if rec.pending_pages() != 0:
            raise AssertionError("pages still pending after the idle release")
        eng.check()
        return per_step, rec.stats.release_waits, pending_at_idle

    instant, waits0, _ = run(False, 0)
    late_a, waits_a, idle_a = run(True, 1)
    late_b, waits_b, _ = run(True, 2)
    if late_a != instant or late_b != instant:
        raise AssertionError(f"release steps depend on fence timing: {instant} vs {late_a} vs {late_b}")
    if waits_a + waits_b == 0 or waits0 != 0:
        raise AssertionError(f"no release waited for a late fence (waits {waits0}, {waits_a}, {waits_b})")
    if idle_a == 0:
        raise AssertionError("nothing was pending at idle")
    how = "copy stream delayed 30 ms per step" if cuda else "CPU fences late (delay 4, seeds 1 and 2)"
    return Row(
        "late_release",
        "ok",
        f"{waits_a + waits_b}",
        f"releases waited on a late fence; 8 steps identical to instant copies ({how}); {idle_a} pages freed at idle",
        data={"per_step": instant, "release_waits": [waits0, waits_a, waits_b]},
    )


# ---------------------------------------------------------------------------------------------------- b. copy timings


@dataclasses.dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()


def copy_plan_sizes(s: Setup) -> tuple[KVShape, list[int]]:
    """CUDA: Llama-8B-like, 1k / 16k / 128k tokens (quick: 1k / 16k). CPU: 4 layers, 256 / 1k / 4k tokens."""
    if s.device == "cuda":
        return KVShape(32), [1024, 16384] if s.quick else [1024, 16384, 131072]
    return KVShape(4), [256, 1024, 4096]


def pool_slots(max_plan: int) -> tuple[int, int]:
    """(sources region, total slots): sources are drawn from ``[1, region)`` (at most 2/3 dense, as sparse pages),
    destinations are ``region + [0, n)`` (dense pages), so they never overlap."""
    region = max_plan + max_plan // 2 + 1
    return region, region + max_plan


def fit_plans(s: Setup, shape: KVShape, plans: list[int]) -> tuple[list[int], list[int]]:
    """(plans whose pool fits in half the free device memory, plans dropped)."""
    if s.device != "cuda":
        return plans, []
    free = torch.cuda.mem_get_info()[0]
    kept = [n for n in plans if pool_slots(n)[1] * shape.bytes_per_token <= free // 2]
    return kept, [n for n in plans if n not in kept]


def time_copy_rows(s: Setup) -> Iterator[Row]:
    """One row per plan size, over one pool sized for the largest; the pool lives as long as this generator."""
    shape, plans = copy_plan_sizes(s)
    plans, dropped = fit_plans(s, shape, plans)
    for n in dropped:
        yield Row(f"copy_time[{label(n)}]", "skip", "-", "pool does not fit in half the free memory", False)
    if not plans:
        return
    region, total = pool_slots(max(plans))
    bufs = [
        torch.empty(total, shape.kv_heads, shape.head_dim, dtype=shape.dtype, device=s.device)
        for _ in range(2 * shape.layers)
    ]
    eng = make_copy_engine(bufs)
    g = torch.Generator().manual_seed(2)
    for n in plans:
        yield guarded(f"copy_time[{label(n)}]", False, lambda n=n: time_one_plan(s, eng, shape, n, region, g))
    bufs.clear()
    eng.buffers.clear()
    if s.device == "cuda":
        torch.cuda.empty_cache()  # the pool (40 GiB for 128k tokens) before the scoring shapes


def label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def time_one_plan(s: Setup, eng: CopyEngine, shape: KVShape, n: int, region: int, g: torch.Generator) -> Row:
    """Median over repeats of: host issue time of ``copy`` + ``order_before_next_forward`` on an idle stream, and
    device time between CUDA events with the stream held back first (so the host is ahead and the events time the
    device)."""
    src = (torch.randperm(region - 1, generator=g)[:n] + 1).sort().values
    dst = region + torch.arange(n)
    repeats = 3 if s.quick else 5
    issue(eng, src, dst)  # warm-up: the caching allocator's temporaries for this size
    sync(s.device)
    host_ms, dev_ms, ahead = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        issue(eng, src, dst)
        host_ms.append((time.perf_counter() - t0) * 1e3)
        sync(s.device)
        if s.device == "cuda":
            ms, was_ahead = device_time(s, eng, src, dst)
            dev_ms.append(ms)
            ahead.append(was_ahead)
    check_copied(eng, src, dst)
    return copy_row(n, shape, statistics.median(dev_ms or host_ms), statistics.median(host_ms), all(ahead), s.device)


def issue(eng: CopyEngine, src: torch.Tensor, dst: torch.Tensor) -> None:
    eng.order_before_next_forward(eng.copy(src, dst))


def device_time(s: Setup, eng: CopyEngine, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, bool]:
    """(ms between events around copy + publish, whether the host had issued it all before the start event ran)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.sleep(20)
    start.record()
    issue(eng, src, dst)
    end.record()
    ahead = not start.query()
    end.synchronize()
    return start.elapsed_time(end), ahead


def check_copied(eng: CopyEngine, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The first and last buffer's sources get fresh random values; after one more copy the destinations hold the
    same bits (the pool itself is uninitialized, often zeros, which would prove nothing)."""
    d = eng.buffers[0].device
    src_d, dst_d = src.to(d), dst.to(d)
    ends = (eng.buffers[0], eng.buffers[-1])
    for b in ends:
        b[src_d] = torch.randn(src.numel(), *b.shape[1:], device=d).to(b.dtype)
    issue(eng, src, dst)
    for b in ends:
        if not torch.equal(b[dst_d].view(torch.int16), b[src_d].view(torch.int16)):
            raise AssertionError("destinations differ from sources after the copy")


def copy_row(n: int, shape: KVShape, dev_ms: float, host_ms: float, ahead: bool, device: str) -> Row:
    moved = 2 * n * shape.bytes_per_token  # read + write of the payload
    timing = "device (events)" if device == "cuda" else "wall (synchronous)"
    note = "" if ahead or device != "cuda" else "; host was not ahead: device time includes issue gaps"
    return Row(
        f"copy_time[{label(n)}]",
        "ok",
        f"{n / dev_ms * 1e3:.3g}",
        f"tokens/s; {dev_ms:.3f} ms/plan {timing}, host issue {host_ms:.3f} ms, {moved / dev_ms / 1e6:.1f} GB/s, "
        f"{2 * shape.layers} bufs x {shape.kv_heads}x{shape.head_dim} {str(shape.dtype)[6:]}{note}",
        False,
        {
            "tokens": n,
            "device_ms": dev_ms,
            "host_issue_ms": host_ms,
            "bytes_per_token": shape.bytes_per_token,
            "host_ahead": ahead,
        },
    )


# ---------------------------------------------------------------------------------------------------- c. Triton kernel


def triton_shapes(s: Setup) -> list[tuple]:
    """(B, Hq, Hkv, D, W, block_w, k dtype, rtol): the unit test's shapes (GQA 1-4, D 24 and 16, partial blocks, an
    empty last row when B > 3); on CUDA also bf16 keys, D 96 and a Llama-8B-like decode batch."""
    shapes = [
        (3, 4, 2, 32, 50, 16, torch.float32, 1e-5),
        (2, 6, 2, 24, 37, 16, torch.float32, 1e-5),
        (2, 8, 8, 16, 5, 32, torch.float32, 1e-5),
        (4, 32, 8, 128, 70, 32, torch.float32, 1e-5),
    ]
    if s.device == "cuda":
        shapes += [(5, 12, 4, 96, 300, 32, torch.bfloat16, 1e-5), (32, 32, 8, 128, 1024, 32, torch.float32, 1e-4)]
    return shapes


def check_triton(s: Setup) -> Row:
    from vtoken_sglang.scoring.reference import decode_scores_headsum
    from vtoken_sglang.scoring.triton_scores import decode_scores_headsum_triton

    g = torch.Generator().manual_seed(0)
    worst = 0.0
    shapes = triton_shapes(s)
    for B, Hq, Hkv, D, W, block, dtype, rtol in shapes:
        k = torch.randn(max(300, 2 * W), Hkv, D, generator=g).to(dtype)
        slots = torch.stack([torch.randperm(k.shape[0], generator=g)[:W] for _ in range(B)])
        live = torch.randint(1, W + 1, (B,), generator=g)
        if B > 3:
            live[-1] = 0  # an empty row gives zeros in both
        q = torch.randn(B, Hq, D, generator=g)
        want = decode_scores_headsum(q, k, slots, live, D**-0.5)
        dev = s.device
        got = decode_scores_headsum_triton(
            q.to(dev), k.to(dev), slots.to(dev), live.to(dev), D**-0.5, block_w=block
        ).cpu()
        err = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
        if not torch.allclose(got, want, rtol=rtol, atol=1e-6):
            raise AssertionError(f"B{B} Hq{Hq} Hkv{Hkv} D{D} W{W} {dtype}: max abs err {err:.2e}")
        worst = max(worst, err)
    interp = " (TRITON_INTERPRET=1)" if s.device == "cpu" else ""
    return Row(
        "triton_scores",
        "ok",
        f"{worst:.1e}",
        f"max abs err vs torch reference, {len(shapes)} shapes, GQA 1-4, "
        f"D 16-128 incl. 24{', 96, bf16 keys' if s.device == 'cuda' else ''}, empty row{interp}",
        data={"max_abs_err": worst},
    )


# ---------------------------------------------------------------------------------------------------- d. scoring cost


def scoring_rows(s: Setup) -> Iterator[Row]:
    """``scoring_cost.run_shape`` per shape. CUDA: Llama-8B-like (and a larger batch unless quick); CPU: tiny."""
    import scoring_cost

    if s.device == "cuda":
        shapes, repeats = [(32, 1024, 32, 8, 128)] + ([] if s.quick else [(64, 2048, 32, 8, 128)]), 15
    else:
        shapes, repeats = [(8, 512, 4, 2, 32)], 3 if s.quick else 5
    for sh in shapes:
        yield guarded(
            f"scoring_cost[B{sh[0]}xL{sh[1]}]",
            False,
            lambda sh=sh: scoring_row(scoring_cost.run_shape(*sh, s.device, repeats)),
        )


def scoring_row(r: dict) -> Row:
    kernels = {"triton": r["triton_ms"], "cpu kernel": r.get("cpu_kernel_ms")}
    tri = "".join(f", {name} {ms:.3f} ms" for name, ms in kernels.items() if ms is not None)
    used = next((name for name, ms in kernels.items() if ms is not None), "torch")
    verdict = "met" if r["ratio"] <= 1.0 else "MISSED"
    return Row(
        f"scoring_cost[B{r['batch']}xL{r['live_tokens']}]",
        "ok",
        f"{r['ratio']:.2f}",
        f"{used}/attn; torch {r['score_ms']:.3f} ms{tri}, attn {r['attn_ms']:.3f} ms per layer "
        f"(Hq{r['q_heads']} Hkv{r['kv_heads']} D{r['head_dim']}); target <= 1 {verdict}",
        False,
        r,
    )


# ---------------------------------------------------------------------------------------------------- e. window scores


def window_scores_f64(
    q: torch.Tensor, k_buffer: torch.Tensor, slots: torch.Tensor, q_pos: torch.Tensor, scale: float, logit_cap: float
) -> torch.Tensor:
    """The contract of ``window_scores_headsum`` computed independently in float64 on the CPU."""
    w, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    keys = k_buffer[slots].double()  # [L, Hkv, D]
    keys = keys.repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]: query head h reads KV head h // group
    logits = torch.einsum("whd,lhd->hwl", q.double(), keys) * scale
    if logit_cap > 0:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    causal = torch.arange(slots.numel())[None, :] <= q_pos[:, None]
    logits = logits.masked_fill(~causal[None], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=(0, 1))


def window_shapes(s: Setup) -> list[tuple]:
    """(w, L, Hq, Hkv, D, k dtype, logit cap)."""
    shapes = [(8, 77, 6, 2, 24, torch.float32, 0.0), (4, 40, 4, 4, 16, torch.float32, 30.0)]
    if s.device == "cuda":
        shapes += [(32, 1000, 32, 8, 128, torch.float32, 0.0), (32, 1000, 32, 8, 128, torch.bfloat16, 50.0)]
    return shapes


def check_window(s: Setup) -> Row:
    from vtoken_sglang.scoring.reference import window_scores_headsum

    g = torch.Generator().manual_seed(3)
    worst = 0.0
    shapes = window_shapes(s)
    for w, L, Hq, Hkv, D, dtype, cap in shapes:
        k = torch.randn(2 * L, Hkv, D, generator=g).to(dtype)
        slots = torch.randperm(2 * L, generator=g)[:L]
        q = torch.randn(w, Hq, D, generator=g)
        q_pos = torch.arange(L - w, L)
        dev = s.device
        got = window_scores_headsum(q.to(dev), k.to(dev), slots.to(dev), q_pos.to(dev), D**-0.5, cap).cpu()
        want = window_scores_f64(q, k, slots, q_pos, D**-0.5, cap)
        err = float((got.double() - want).abs().max())
        if got.device.type != "cpu" or not torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5):
            raise AssertionError(f"w{w} L{L} Hq{Hq} Hkv{Hkv} D{D} {dtype} cap {cap}: max abs err {err:.2e}")
        worst = max(worst, err)
    return Row(
        "window_scores",
        "ok",
        f"{worst:.1e}",
        f"max abs err vs float64 CPU, {len(shapes)} shapes "
        f"(causal window, GQA, logit cap{', bf16 keys' if s.device == 'cuda' else ''})",
        data={"max_abs_err": worst},
    )


def check_state_cells(s: Setup) -> Row:
    import state_cells

    r = state_cells.check(s.device)
    return Row(
        "state_per_request",
        "ok",
        f"{r['steps']}",
        f"steps: every live entry's state its request's own, {s.device} == CPU bit for bit; cells packed "
        f"{r['compactions']} times, grown {r['capacity0']} -> {r['capacity']}",
        data=r,
    )


def flashinfer_note(r: dict, kernel: str) -> str:
    """What a ``window_plans`` check says of FlashInfer's ``kernel`` (run only where FlashInfer is, on CUDA)."""
    if not r["kernel"]:
        return "FlashInfer's kernel not run (needs FlashInfer on CUDA)"
    return f"FlashInfer's {kernel} equals torch attention, max abs err {r['max_abs_err']:.1e}"


def check_window_plans(s: Setup) -> Row:
    import window_plans

    r = window_plans.check(s.device)
    kernel = flashinfer_note(r, "decode")
    return Row(
        "flashinfer_window",
        "ok",
        f"{r['steps']}",
        f"steps x {r['rows']} rows, span {r['span']}, {r['tokens_moved']} tokens relocated: window indices are the "
        f"live tokens of the logical window (the rows' last entries were not at {r['upstream_wrong_steps']} steps); "
        f"{kernel}",
        data=r,
    )


def check_extend_plans(s: Setup) -> Row:
    import window_plans

    r = window_plans.check_extend(s.device)
    kernel = flashinfer_note(r, "prefill")
    return Row(
        "flashinfer_extend",
        "ok",
        f"{r['steps']}",
        f"chunks x {r['rows']} rows, span {r['span']}, {r['tokens_moved']} tokens relocated: the indices are the "
        f"live tokens of the chunks' logical windows; {kernel}",
        data=r,
    )


# ---------------------------------------------------------------------------------------------------- f. CUDA graphs


def check_graph_queries(s: Setup) -> Row:
    import graph_queries

    r = graph_queries.check(s.device)
    how = (
        "graph replays equal eager forwards" if r["graph"] else "eager forward equals the per-step capture (no graphs)"
    )
    return Row(
        "graph_queries",
        "ok",
        f"{r['steps']}",
        f"decode steps: query buffers and scores bit for bit, {how}; forwards counted on the device {r['counted']}",
        data=r,
    )


def graph_scoring_rows(s: Setup) -> Iterator[Row]:
    """CUDA only: what the query writes add to a replayed decode step, and what scoring a step costs beside it."""
    if s.device != "cuda":
        return
    import graph_queries

    r = graph_queries.timing(s.device, repeats=10 if s.quick else 30)
    added = r["step_with_queries_ms"] / r["step_ms"] - 1
    yield Row(
        "graph_scoring",
        "ok",
        f"{added:+.1%}",
        f"query writes in a replayed step ({r['step_ms']:.3f} -> {r['step_with_queries_ms']:.3f} ms, {r['layers']} "
        f"layers, batch {r['batch']}); scoring a step {r['scoring_ms']:.3f} ms (live {r['live']}, Hq{r['q_heads']} "
        f"Hkv{r['kv_heads']} D{r['head_dim']})",
        False,
        r,
    )


# ---------------------------------------------------------------------------------------------------- the table


def guarded(name: str, correctness: bool, fn: Callable[[], Row]) -> Row:
    """``fn()``'s row, or a FAIL row carrying the exception's first line. A failed assertion counts as a correctness
    failure in any row (a timing row also checks what it copied)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - one failure must not hide the other rows
        return Row(name, "FAIL", "-", one_line(exc), correctness or isinstance(exc, AssertionError))


def guarded_rows(name: str, correctness: bool, rows: Iterator[Row]) -> Iterator[Row]:
    """``rows`` as they come, then a FAIL row if producing them raised."""
    try:
        yield from rows
    except Exception as exc:  # noqa: BLE001
        yield Row(name, "FAIL", "-", one_line(exc), correctness)


def print_row(r: Row) -> None:
    print(f"{r.check:<24}{r.result:<7}{r.figure:>10}  {r.notes}", flush=True)


def single(name: str, fn: Callable[[Setup], Row], s: Setup) -> Iterator[Row]:
    yield guarded(name, True, lambda: fn(s))


def run_checks(s: Setup) -> list[Row]:
    """Every check in order, each row printed as soon as it is known (a timeout still leaves the rows so far)."""
    stages = [
        single("copy_order", check_copy_order, s),
        single("overlap_order", check_overlap_order, s),
        single("fence_done", check_fence, s),
        single("reclaim_integrity", check_reclaim, s),
        single("late_release", check_late_release, s),
        guarded_rows("copy_time", False, time_copy_rows(s)),
        single("triton_scores", check_triton, s),
        single("window_scores", check_window, s),
        single("state_per_request", check_state_cells, s),
        single("flashinfer_window", check_window_plans, s),
        single("flashinfer_extend", check_extend_plans, s),
        guarded_rows("scoring_cost", False, scoring_rows(s)),
        single("graph_queries", check_graph_queries, s),
        guarded_rows("graph_scoring", False, graph_scoring_rows(s)),
    ]
    rows: list[Row] = []
    for stage in stages:
        for r in stage:
            rows.append(r)
            print_row(r)
    return rows


def describe(device: str) -> str:
    try:
        tri = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        tri = "absent"
    where = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    return f"torch {torch.__version__}, triton {tri}, {where}"


def exit_status(rows: list[Row]) -> int:
    """1: a correctness check failed; 2: only a timing failed; 0: all ran."""
    if any(r.result == "FAIL" and r.correctness for r in rows):
        return 1
    return 2 if any(r.result == "FAIL" for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("CUDA is not available")
    use_triton_interpreter_on_cpu(args.device)
    t0 = time.perf_counter()
    s = Setup(args.device, args.quick, make_sleeper(args.device))
    print(f"gpu_check on {args.device}{' --quick' if args.quick else ''}: {describe(args.device)}", flush=True)
    hdr = f"{'check':<24}{'result':<7}{'figure':>10}  unit / notes"
    print(hdr + "\n" + "-" * 110, flush=True)
    rows = run_checks(s)
    status = exit_status(rows)
    wall = time.perf_counter() - t0
    failed = [r.check for r in rows if r.result == "FAIL"]
    print(
        f"{'all checks ok' if not failed else 'FAILED: ' + ', '.join(failed)}; wall {wall:.0f} s; exit {status}",
        flush=True,
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "device": args.device,
            "quick": args.quick,
            "env": describe(args.device),
            "wall_s": round(wall, 1),
            "exit": status,
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
