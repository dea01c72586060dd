"""Token Table, planner, reclaimer and copy engine, one property at a time."""

import dataclasses

import numpy as np
import pytest
import torch
from core_helpers import MiniEngine, stamp

from vtoken_sglang.core.copy_engine import CpuCopyEngine, make_copy_engine
from vtoken_sglang.core.integrity import IntegrityError, check_integrity
from vtoken_sglang.core.pages import FREE, TREE, OutOfPages, PagePool
from vtoken_sglang.core.planner import Snapshot, pack_moves, plan_reclaim
from vtoken_sglang.core.segments import repeat_rows, segment_ids, segment_ranks


def sparse_engine(reserve=4, theta=0.0):
    """One request of 32 tokens in 8 pages of 4; every other token evicted (except the newest)."""
    eng = MiniEngine(num_pages=32, page_size=4, rows=4, max_context=256, reserve=reserve, theta=theta)
    row = torch.tensor([0])
    eng.table.open_rows(row)
    eng.write(row, torch.tensor([32]))
    cols = torch.arange(0, 30, 2)
    eng.evict(torch.zeros_like(cols), cols)
    return eng


class TestTokenTable:
    def test_appends_fill_the_tail_page_then_new_pages(self):
        eng = MiniEngine(num_pages=16, page_size=4, rows=2, max_context=64)
        row = torch.tensor([1])
        eng.table.open_rows(row)
        first = eng.write(row, torch.tensor([6])).tolist()
        assert first[1:4] == [first[0] + 1, first[0] + 2, first[0] + 3] and first[4] % 4 == 0
        second = eng.write(row, torch.tensor([3])).tolist()
        assert second[:2] == [first[5] + 1, first[5] + 2]  # rest of the tail page first
        check_integrity(eng.table, eng.kv, stamp)

    def test_eviction_is_metadata_only_and_frees_empty_pages_at_once(self):
        eng = MiniEngine(num_pages=16, page_size=4, rows=2, max_context=64)
        row = torch.tensor([0])
        eng.table.open_rows(row)
        eng.write(row, torch.tensor([12]))
        kv_before = [b.clone() for b in eng.kv]
        used = eng.pool.used_pages()
        eng.evict(torch.zeros(4, dtype=torch.int64), torch.tensor([0, 1, 2, 3]))  # the whole first page
        assert eng.pool.used_pages() == used - 1
        assert all(torch.equal(a, b) for a, b in zip(kv_before, eng.kv))
        assert eng.table.row_view(0)[1].tolist() == list(range(4, 12))
        check_integrity(eng.table, eng.kv, stamp)

    def test_newest_token_cannot_be_evicted(self):
        eng = MiniEngine(num_pages=16, page_size=4, rows=2, max_context=64)
        eng.table.open_rows(torch.tensor([0]))
        eng.write(torch.tensor([0]), torch.tensor([5]))
        with pytest.raises(AssertionError):
            eng.table.evict(torch.tensor([0]), torch.tensor([4]))

    def test_evict_token_by_logical_id(self):
        eng = MiniEngine(num_pages=16, page_size=4, rows=2, max_context=64)
        eng.table.open_rows(torch.tensor([0]))
        eng.write(torch.tensor([0]), torch.tensor([9]))
        eng.pool.free(eng.table.evict_token(0, 5))
        assert eng.table.row_view(0)[1].tolist() == [0, 1, 2, 3, 4, 6, 7, 8]

    def test_integrity_catches_a_corrupted_count(self):
        eng = sparse_engine()
        eng.pool.live[int(eng.table.slots[0, 0]) // 4] += 1
        with pytest.raises(IntegrityError, match="live counts"):
            check_integrity(eng.table)


class TestPlanner:
    def test_plan_frees_more_than_it_takes_and_skips_the_tail(self):
        eng = sparse_engine()
        plan = eng.reclaimer.plan()
        tail = int(eng.table.tail_pages()[0])
        assert plan.pages_freed > plan.pages_taken >= 1 and tail not in plan.src_pages.tolist()
        assert eng.reclaimer.apply(plan)
        check_integrity(eng.table, eng.kv, stamp)
        eng.reclaimer.step()  # grace over -> sources freed
        eng.reclaimer.step()
        # 17 live tokens in 8 pages: the 6 sparsest hold 12 -> 3 destinations (taking the 7th too would move 2
        # more tokens for no extra page); 8 - 6 + 3 = 5 = ceil(17 / 4), the lower bound
        st = eng.reclaimer.stats
        assert eng.pool.used_pages() == eng.table.lower_bound_pages() == 5
        assert (st.pages_reclaimed, st.tokens_moved) == (6, 12)
        check_integrity(eng.table, eng.kv, stamp)

    def test_packing_is_dense_and_in_logical_order(self):
        eng = sparse_engine()
        plan = eng.reclaimer.plan()
        dst_pages = torch.tensor([30, 31, 29, 28][: plan.pages_taken])
        moves = pack_moves(eng.table.slots, eng.table.live_len, plan, dst_pages, 4)
        expected = torch.cat([p * 4 + torch.arange(4) for p in dst_pages])[: len(moves.dst)]
        assert torch.equal(moves.dst, expected) and torch.equal(moves.cols, moves.cols.sort().values)

    def test_shared_in_flight_and_full_pages_are_not_sources(self):
        eng = sparse_engine()
        snap = eng.reclaimer.snapshot()
        pages = torch.unique(eng.table.row_view(0)[0].to(torch.int64) // 4)
        owner = snap.owner.clone()
        owner[pages[0]] = TREE
        blocked = snap.blocked.clone()
        blocked[pages[1]] = True
        plan = plan_reclaim(Snapshot(snap.epoch, 4, snap.live, owner, blocked, snap.free_for_relocation))
        assert pages[0].item() not in plan.src_pages.tolist() and pages[1].item() not in plan.src_pages.tolist()
        assert bool((snap.live[plan.src_pages] < 4).all())

    def test_admission_needs_headroom(self):
        eng = sparse_engine()
        snap = eng.reclaimer.snapshot()
        assert plan_reclaim(Snapshot(0, 4, snap.live, snap.owner, snap.blocked, 0)).is_empty()
        one = plan_reclaim(Snapshot(0, 4, snap.live, snap.owner, snap.blocked, 1))
        assert one.pages_taken == 1 and one.pages_freed >= 2  # best plan within one destination page

    def test_stale_and_overlapping_plans_are_rejected_whole(self):
        eng = sparse_engine()
        rec = eng.reclaimer
        plan = rec.plan()
        rec.epoch += 1
        assert not rec.apply(plan) and rec.stats.plans_stale == 1
        plan = rec.plan()
        assert rec.apply(plan)
        assert not rec.apply(plan) and rec.stats.plans_rejected == 1
        check_integrity(eng.table, eng.kv, stamp)

    def test_malformed_plans_are_rejected_whole(self):
        """Plans no planner makes (a worker's, garbled on the way) are rejected before anything moves; each of
        these would otherwise write past a row's destinations, move a token twice or free a page with live
        tokens (an assertion in ``apply`` or ``PagePool.free``, or silent corruption under ``python -O``)."""
        eng = MiniEngine(num_pages=64, page_size=4, rows=4, reserve=4)
        rows = torch.tensor([0, 1])
        eng.table.open_rows(rows)
        eng.write(rows, torch.tensor([32, 32]))
        for r in (0, 1):
            cols = torch.arange(0, 30, 2)
            eng.evict(torch.full_like(cols, r), cols)
        rec = eng.reclaimer
        plan = rec.plan()
        assert plan.rows.tolist() == [0, 1] and int(plan.n_dst.min()) >= 1
        first = plan.src_row == plan.rows[0]
        bad = {
            "a source page twice": dataclasses.replace(
                plan,
                src_pages=torch.cat([plan.src_pages, plan.src_pages[:1]]),
                src_row=torch.cat([plan.src_row, plan.src_row[:1]]),
                src_live=torch.cat([plan.src_live, plan.src_live[:1]]),
            ),
            "a row twice": dataclasses.replace(plan, rows=plan.rows[[0, 0]], n_dst=plan.n_dst[[0, 0]]),
            "a source of a row not named": dataclasses.replace(plan, rows=plan.rows[:1], n_dst=plan.n_dst[:1]),
            "too few destinations": dataclasses.replace(plan, n_dst=plan.n_dst - torch.tensor([1, 0])),
            "lengths differ": dataclasses.replace(plan, src_live=plan.src_live[:-1]),
            # counts whose products and sum overflow int64 (a fuzzed worker message found them)
            "huge destination counts": dataclasses.replace(plan, n_dst=torch.full((2,), (1 << 62) + (1 << 20))),
        }
        assert int(first.sum()) >= 2
        for name, p in bad.items():
            assert rec.validate(p) is not None and rec.validate(p).startswith("malformed"), name
            assert not rec.apply(p), name
        assert rec.stats.plans_rejected == len(bad) and rec.stats.plans_admitted == 0
        check_integrity(eng.table, eng.kv, stamp)
        assert rec.apply(plan)  # the plan itself is fine
        rec.release_ready(force=True)
        check_integrity(eng.table, eng.kv, stamp)

    def test_no_reserve_no_headroom_ordinary_allocation_cannot_take_it(self):
        pool = PagePool(8, 4, reserve=3)
        assert pool.num_free() == 5 and pool.num_free(for_relocation=True) == 8
        with pytest.raises(OutOfPages):
            pool.alloc(6, owner=0)
        assert len(pool.alloc(6, owner=0, for_relocation=True)) == 6


def test_late_fences_release_at_the_same_step_whatever_they_report():
    """Two "TP ranks" whose fences report done at different queries (as CUDA events may) free the same pages at the
    same step: a source is freed at its grace step after a wait on its fence, never when a query happens to say
    done. Nothing is freed before the grace step, and the invariants hold throughout."""
    runs = []
    for seed in (1, 2, 3):
        eng = MiniEngine(num_pages=128, page_size=4, rows=8, reserve=4, theta=0.0, fence_delay=4, fence_seed=seed)
        rows = torch.arange(6)
        eng.table.open_rows(rows)
        eng.write(rows, torch.full((6,), 40))
        g = torch.Generator().manual_seed(0)
        for r in range(6):
            cols = torch.randperm(int(eng.table.live_len[r]) - 1, generator=g)[:20]
            eng.pool.free(eng.table.evict(torch.full_like(cols, r), cols))
        rec, per_step = eng.reclaimer, []
        for _ in range(3):
            before = rec.stats.pages_reclaimed
            rec.step()
            check_integrity(eng.table, eng.kv, stamp)
            per_step.append((rec.stats.pages_reclaimed - before, rec.pending_pages(), eng.pool.num_free()))
        runs.append(per_step)
        late = [p for p in rec._pending if not p.fence.done()]
        rec.release_ready(force=True)
        assert rec.pending_pages() == 0 and all(p.fence.done() for p in late)
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0][0] == 0 and runs[0][0][1] > 0, "sources are held until their grace step"
    assert runs[0][1][0] == runs[0][0][1], "and freed at it"


def test_late_fence_reports_done_late_and_wait_completes_it():
    bufs = [torch.zeros(8, 2)]
    eng = CpuCopyEngine(bufs, fence_delay=3, fence_seed=0)
    queries = []
    for _ in range(20):
        f = eng.fence()
        n = 0
        while not f.done():
            n += 1
        queries.append(n)
    assert set(queries) <= {0, 1, 2, 3} and len(set(queries)) > 1
    f = next(f for f in iter(eng.fence, None) if not f.done())
    f.wait()
    assert f.done()


class TestCopyEngine:
    def test_cpu_copy_moves_every_buffer(self):
        bufs = [torch.randn(32, 2, 3) for _ in range(3)]
        ref = [b.clone() for b in bufs]
        eng = make_copy_engine(bufs)
        assert isinstance(eng, CpuCopyEngine)
        src, dst = torch.tensor([1, 5, 9]), torch.tensor([20, 21, 22])
        t = eng.copy(src, dst)
        eng.order_before_next_forward(t)
        assert eng.fence().done()
        for b, r in zip(bufs, ref):
            assert torch.equal(b[dst], r[src]) and torch.equal(b[:20], r[:20])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.gpu
class TestCudaCopyEngine:
    def test_copy_is_ordered_after_the_writer_and_before_the_reader(self):
        from vtoken_sglang.core.copy_engine import CudaCopyEngine

        bufs = [torch.zeros(1 << 16, 8, device="cuda") for _ in range(4)]
        eng = CudaCopyEngine(bufs)
        src = torch.arange(0, 4096, device="cuda")
        dst = src + 8192
        for b in bufs:  # the "forward" writes the sources on the current stream
            torch.cuda._sleep(1_000_000)
            b[src] = 7.0
        t = eng.copy(src, dst)
        eng.order_before_next_forward(t)
        fence = eng.fence()
        out = torch.stack([b[dst].sum() for b in bufs])  # the next "forward" reads the destinations
        torch.cuda.synchronize()
        assert fence.done() and bool((out == 7.0 * 4096 * 8).all())

    def test_copy_waits_for_the_forward_stream_under_overlap(self):
        """SGLang's overlap scheduler: the forward of the last step runs on its own stream, not ordered before the
        scheduling stream that issues the copy. With ``producer`` set, the copy still reads what that forward
        wrote; without it, it reads the old sources (so the order really comes from ``producer``)."""
        from vtoken_sglang.core.copy_engine import CudaCopyEngine

        bufs = [torch.zeros(1 << 16, 8, device="cuda") for _ in range(2)]
        src = torch.arange(0, 4096, device="cuda")
        dst = src + 8192
        forward = torch.cuda.Stream()
        got = {}
        for ordered in (True, False):
            eng = CudaCopyEngine(bufs)
            eng.producer = forward if ordered else None
            value = 5.0 if ordered else 9.0
            torch.cuda.synchronize()
            with torch.cuda.stream(forward):  # the forward in flight writes the sources, late
                torch.cuda._sleep(50_000_000)
                for b in bufs:
                    b[src] = value
            eng.order_before_next_forward(eng.copy(src, dst))
            got[ordered] = torch.stack([b[dst].sum() for b in bufs]).cpu()
            torch.cuda.synchronize()
        assert bool((got[True] == 5.0 * 4096 * 8).all())
        assert not bool((got[False] == 9.0 * 4096 * 8).all())  # unordered: the copy ran before the late writer

    def test_reclaimer_on_cuda_keeps_invariants(self):
        from vtoken_sglang.core.copy_engine import CudaCopyEngine
        from vtoken_sglang.core.reclaimer import Reclaimer
        from vtoken_sglang.core.token_table import TokenTable

        pool = PagePool(64, 4, reserve=4)
        table = TokenTable(4, 256, pool)
        kv = [torch.zeros(65 * 4, 3, device="cuda") for _ in range(2)]
        rec = Reclaimer(table, CudaCopyEngine(kv), theta=0.0)
        row = torch.tensor([0])
        table.open_rows(row)
        slots = table.alloc_slots(row, torch.tensor([32]))
        for b in kv:
            b[slots.cuda()] = stamp(torch.zeros(32, dtype=torch.int64), torch.arange(32)).cuda()
        table.sync_new_tokens(row, torch.tensor([32]), slots)
        pool.free(table.evict(torch.zeros(15, dtype=torch.int64), torch.arange(0, 30, 2)))
        assert rec.step()
        torch.cuda.synchronize()
        rec.step()
        rec.step()
        check_integrity(table, [b.cpu() for b in kv], stamp)
        assert rec.stats.pages_reclaimed > 0


def reference_plan(live, owner, blocked, P, B):
    """Brute force: per owner, every prefix of its eligible pages sorted (live, page id); best gain within B,
    shortest such prefix; admit by (-gain, row) while destinations fit."""
    per = {}
    for p in range(len(live)):
        if owner[p] >= 0 and not blocked[p] and 0 < live[p] < P:
            per.setdefault(owner[p], []).append((live[p], p))
    best = {}
    for o, pages in per.items():
        pages.sort()
        options = []
        for k in range(1, len(pages) + 1):
            t = sum(lv for lv, _ in pages[:k])
            dst = -(-t // P)
            if dst <= B:
                options.append((k - dst, -k, dst))
        if options:
            g, negk, dst = max(options)
            if g > 0:
                best[o] = (g, -negk, dst, [p for _, p in pages[:-negk]])
    used, rows = 0, []
    for o in sorted(best, key=lambda o: (-best[o][0], o)):
        if used + best[o][2] > B:
            break
        used += best[o][2]
        rows.append(o)
    rows.sort()
    return rows, [best[o][2] for o in rows], sorted(p for o in rows for p in best[o][3])


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(data=st.data(), P=st.sampled_from([2, 4, 16]), n=st.integers(1, 60), B=st.integers(0, 12))
def test_planner_matches_brute_force(data, P, n, B):
    live = data.draw(st.lists(st.integers(0, P), min_size=n, max_size=n))
    owner = data.draw(st.lists(st.integers(-2, 4), min_size=n, max_size=n))
    blocked = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    live[0], owner[0] = 0, TREE
    snap = Snapshot(
        0, P, torch.tensor(live, dtype=torch.int32), torch.tensor(owner, dtype=torch.int32), torch.tensor(blocked), B
    )
    plan = plan_reclaim(snap)
    rows, n_dst, pages = reference_plan(live, owner, blocked, P, B)
    assert plan.rows.tolist() == rows and plan.n_dst.tolist() == n_dst and sorted(plan.src_pages.tolist()) == pages
    assert plan.pages_taken <= B and (plan.is_empty() or plan.pages_freed > plan.pages_taken)


def test_segment_ids_equal_repeat_interleave():
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 2, 7, 40):
        for _ in range(30):
            counts = torch.randint(0, 4, (n,), generator=g)  # zeros included, leading and trailing too
            assert torch.equal(segment_ids(counts), torch.repeat_interleave(torch.arange(n), counts))
            ids, ranks = segment_ranks(counts)
            starts = torch.cumsum(counts, 0) - counts
            assert torch.equal(ids, segment_ids(counts)) and torch.equal(ranks, torch.arange(len(ids)) - starts[ids])
            values = torch.randint(0, 1000, (n,), generator=g)
            assert torch.equal(repeat_rows(values, counts, int(counts.sum())), torch.repeat_interleave(values, counts))


def test_decode_sync_equals_the_general_sync():
    """``sync_decode_tokens(rows)`` leaves the table and pool exactly as ``sync_new_tokens(rows, ones,
    claim_pages=True)``: slots written by the engine, one of them on a page the pool does not track yet."""
    engines = []
    for method in ("general", "decode"):
        eng = MiniEngine(num_pages=64, page_size=4, rows=4, state_names=("h2o_acc",))
        t, rows = eng.table, torch.tensor([0, 1, 3])
        t.open_rows(rows)
        eng.write(rows, torch.tensor([5, 8, 2]))
        eng.evict(torch.tensor([0, 3]), torch.tensor([1, 0]))
        t.state["h2o_acc"].fill_(7)  # state left in the new entries' cells must be reset
        last = t.slots[rows, t.live_len[rows] - 1].to(torch.int64)
        fresh = int(eng.pool.alloc(1, FREE)[0])  # the engine's own new page (row 1's pages are full)
        new = torch.where((last + 1) % 4 == 0, torch.tensor(fresh * 4), last + 1)
        assert int(((last + 1) % 4 == 0).sum()) == 1
        t.slots[rows, t.live_len[rows]] = new.to(t.slots.dtype)  # the engine writes the row store itself
        if method == "general":
            t.sync_new_tokens(rows, torch.ones_like(rows), claim_pages=True)
        else:
            t.sync_decode_tokens(rows)
        engines.append((eng, fresh))
    (a, fresh), (b, _) = engines
    for name in ("slots", "logical", "live_len", "logical_len"):
        assert torch.equal(getattr(a.table, name), getattr(b.table, name)), name
    assert torch.equal(a.table.state["h2o_acc"], b.table.state["h2o_acc"])
    assert torch.equal(a.pool.live, b.pool.live) and torch.equal(a.pool.owner, b.pool.owner)
    assert int(b.pool.owner[fresh]) == 1 and int(b.pool.live[fresh]) == 1
    assert b.table.live_len.tolist() == [5, 9, 0, 2]


def test_shared_prefix_slots_hold_one_state_per_reader():
    """Two requests reading the same tree slots keep a state each for them (set and added apart); a third reader
    starts at 0 while the others keep theirs; evicting a shared entry in one row, copy-on-write of another's
    shared suffix and closing a reader leave the others' states as they were."""
    from vtoken_sglang.core.pages import TREE

    eng = MiniEngine(num_pages=16, page_size=4, rows=4, state_names=("s",))
    t = eng.table
    tree = eng.pool.alloc(1, TREE)
    shared = (tree * 4 + torch.arange(4)).to(torch.int64)
    rows = torch.tensor([0, 2])
    t.open_rows(rows, shared=np.array([4, 4]))
    t.sync_new_tokens(rows, torch.tensor([4, 4]), torch.cat([shared, shared]))
    eng.write(rows, torch.tensor([2, 3]))
    assert t.readers[shared].tolist() == [2, 2, 2, 2] and t.states.n_shared[rows].tolist() == [4, 4]
    t.set_row_state("s", rows, torch.tensor([[1.0, 5.0, 2.0, 0.0, 9.0, 9.0, 0.0], [3.0, 4.0, 2.0, 1.0, 7.0, 7.0, 7.0]]))
    t.add_row_state("s", rows, torch.ones(2, 7))
    assert t.row_state("s", rows, 7).tolist() == [
        [2.0, 6.0, 3.0, 1.0, 10.0, 10.0, 0.0],
        [4.0, 5.0, 3.0, 2.0, 8.0, 8.0, 8.0],
    ]
    t.open_rows(torch.tensor([1]), shared=np.array([4]))  # a third reader: its own cells, from 0
    t.sync_new_tokens(torch.tensor([1]), torch.tensor([4]), shared)
    assert t.row_state("s", torch.tensor([1]), 4).tolist() == [[0.0, 0.0, 0.0, 0.0]]
    t.add_row_state("s", torch.tensor([1]), torch.full((1, 4), 0.5))
    eng.evict(torch.tensor([0]), torch.tensor([1]))  # row 0 drops its logical 1: its later entries move down
    assert t.states.n_shared[0].item() == 3
    assert t.row_state("s", torch.tensor([0]), 5).tolist() == [[2.0, 3.0, 1.0, 10.0, 10.0]]
    cols = torch.tensor([2, 3])  # copy-on-write of row 2's shared suffix into a page of its own
    fresh = eng.pool.alloc(1, 2, for_relocation=True) * 4 + torch.arange(2)
    t.apply_moves(torch.tensor([2, 2]), cols, fresh)
    assert t.states.n_shared[2].item() == 2 and t.slots[2, 2:4].tolist() == fresh.tolist()
    eng.close(0)
    assert t.row_state("s", torch.tensor([2]), 7).tolist() == [[4.0, 5.0, 3.0, 2.0, 8.0, 8.0, 8.0]]
    assert t.row_state("s", torch.tensor([1]), 4).tolist() == [[0.5, 0.5, 0.5, 0.5]]
    check_integrity(t)


def test_state_cells_are_compacted_and_grow_with_what_is_live():
    """Extents are bump-allocated as rows open; when they reach the capacity the live ones are packed (their values
    kept), and the capacity doubles only when the live ones need it; all rows closed, the next row starts at 0."""
    from vtoken_sglang.core.pages import TREE

    eng = MiniEngine(num_pages=8, page_size=4, rows=8, state_names=("s",))
    t, st = eng.table, eng.table.states
    assert st.capacity == t.pool_slots == 36
    tree = eng.pool.alloc(4, TREE)
    prefix = (tree[:, None] * 4 + torch.arange(4)).flatten()

    def start(row: int, n: int) -> None:
        r = torch.tensor([row])
        t.open_rows(r, shared=np.array([n]))
        t.sync_new_tokens(r, torch.tensor([n]), prefix[:n])
        t.add_row_state("s", r, torch.arange(n, dtype=torch.float32)[None, :] + 100 * row)

    for row in range(3):
        start(row, 12)  # 36 cells: the capacity
    eng.close(1)
    start(3, 10)  # 24 live + 10 > 36? no: packed, then placed
    assert st.compactions == 1 and st.capacity == 36 and st.top == 34
    start(4, 16)  # 34 + 16 > 36: packed (34 live), grown to max(72, 50)
    assert st.compactions == 2 and st.capacity == 72
    for row, n in ((0, 12), (2, 12), (3, 10), (4, 16)):
        want = torch.arange(n, dtype=torch.float32) + 100 * row
        assert torch.equal(t.row_state("s", torch.tensor([row]), n)[0], want), row
    check_integrity(t)
    assert (
        t.metadata_bytes() - MiniEngine(num_pages=8, page_size=4, rows=8, state_names=("s",)).table.metadata_bytes()
        == 36 * 4
    )
    for row in (0, 2, 3, 4):
        eng.close(row)
    assert st.top == 0 and int(st.n_shared.sum()) == 0


def test_deferred_decode_tokens_settle_to_one_sync_per_step():
    """Six decode steps registered at once when the table is next read (``defer_decode_tokens``, settled by the
    ``live_len`` read) leave the table and pool exactly as a ``sync_decode_tokens`` after every step, across page
    boundaries onto pages the pool does not track yet; nothing shows them before."""
    engines = []
    for deferred in (False, True):
        eng = MiniEngine(num_pages=64, page_size=4, rows=4, state_names=("h2o_acc",))
        t, rows = eng.table, torch.tensor([0, 1, 3])
        t.open_rows(rows)
        eng.write(rows, torch.tensor([5, 8, 2]))
        eng.evict(torch.tensor([0, 3]), torch.tensor([1, 0]))
        written = t.live_len.clone()
        for _ in range(6):
            last = t.slots[rows, written[rows] - 1].to(torch.int64)
            for i, row in enumerate(rows.tolist()):
                full = (int(last[i]) + 1) % 4 == 0
                slot = int(eng.pool.alloc(1, FREE)[0]) * 4 if full else int(last[i]) + 1
                t.slots[row, written[row]] = slot  # the engine writes the row store itself
            written[rows] += 1
            if deferred:
                t.defer_decode_tokens(rows.numpy())
                assert int(t.pages.live.sum()) == 13  # nothing registered yet (pool reads do not settle)
            else:
                t.sync_decode_tokens(rows)
        assert t.deferred_tokens == (18 if deferred else 0)
        assert torch.equal(t.live_len, written) and t.deferred_tokens == 0  # the read settled them
        engines.append(eng)
    a, b = engines
    for name in ("slots", "logical", "readers", "live_len", "logical_len"):
        assert torch.equal(getattr(a.table, name), getattr(b.table, name)), name
    assert torch.equal(a.table.state["h2o_acc"], b.table.state["h2o_acc"])
    assert torch.equal(a.pool.live, b.pool.live) and torch.equal(a.pool.owner, b.pool.owner)
    check_integrity(b.table)


def test_window_suffix_equals_brute_force_with_deferred_tokens():
    """``window_suffix``: per row, the entries whose logical position is within ``span`` of the newest's, computed
    from the row store without settling (deferred decode tokens at their positions), equals a brute-force count over
    the settled table's logical positions, across evictions and relocations; a row that is not active counts as
    dense (``min(length, span)``)."""
    g = torch.Generator().manual_seed(4)
    eng = MiniEngine(num_pages=128, page_size=4, rows=6, reserve=4)
    t, rows = eng.table, torch.tensor([0, 2, 3, 5])
    t.open_rows(rows)
    spans = (1, 3, 8, 64)
    shrunk = 0  # windows that evictions left shorter than a dense row's
    for step in range(12):
        eng.write(rows, torch.randint(1, 6, (len(rows),), generator=g))
        eng.evict_random(0.3, g)
        eng.reclaimer.step()
        written = t.live_len.clone()
        for _ in range(step % 3):  # decode steps written into the row store, registered at the next settle
            last = t.slots[rows, written[rows] - 1].to(torch.int64)
            for i, row in enumerate(rows.tolist()):
                full = (int(last[i]) + 1) % 4 == 0
                slot = int(eng.pool.alloc(1, FREE)[0]) * 4 if full else int(last[i]) + 1
                t.slots[row, written[row]] = slot
            written[rows] += 1
            t.defer_decode_tokens(rows.numpy())
        ask = torch.cat([rows, torch.tensor([1])])  # row 1: not active, an engine's dense row of 9
        lengths = torch.cat([written[rows], torch.tensor([9])])
        got = {span: t.window_suffix(ask, lengths, span) for span in spans}
        assert t.deferred_tokens == len(rows) * (step % 3)  # nothing settled
        t.settle()
        positions = [t.logical[t.slots[r, :n].to(torch.int64)] for r, n in zip(rows.tolist(), written[rows].tolist())]
        for span in spans:
            w, start = got[span]
            want = [int((pos > pos[-1] - span).sum()) for pos in positions] + [min(9, span)]
            assert w.tolist() == want and torch.equal(start, lengths - w), (step, span)
            shrunk += int((w < torch.clamp(lengths, max=span)).sum())
    assert shrunk > 0


def test_row_layout_translates_live_lengths_and_caches_windows_per_forward():
    """``RowLayout``: logical lengths are live ones plus each entry's offset (the identity without device offsets);
    a window is the table's ``window_suffix`` of the caller's rows and lengths, computed once per span and batch
    size (every layer of a forward gets the same tensors), in the lengths' dtype."""
    from vtoken_sglang.core.row_layout import RowLayout

    g = torch.Generator().manual_seed(7)
    eng = MiniEngine(num_pages=64, page_size=4, rows=4, reserve=2)
    t, rows = eng.table, torch.tensor([0, 1, 3])
    t.open_rows(rows)
    eng.write(rows, torch.tensor([9, 6, 11]))
    eng.evict_random(0.4, g)
    t.settle()
    live = t.live_len[rows]
    offset = t.logical_len[rows] - live
    assert int(offset.sum()) > 0  # something was evicted: the translation is not the identity
    layout = RowLayout(t, rows.numpy(), live.numpy(), offset.numpy(), offset, True, True)
    assert layout.logical(live.to(torch.int32)).tolist() == t.logical_len[rows].tolist()
    assert layout.host_logical.tolist() == t.logical_len[rows].tolist()
    plain = RowLayout(t, rows.numpy(), live.numpy(), np.zeros(3, dtype=np.int64), None, False)
    assert plain.logical(live) is live
    lengths = live.to(torch.int32)
    w, start = layout.window(rows, lengths, 3)
    want_w, want_start = t.window_suffix(rows, lengths, 3)
    assert w.dtype == torch.int32 and w.tolist() == want_w.tolist() and start.tolist() == want_start.tolist()
    assert layout.window(rows, lengths, 3)[0] is w  # the second layer of the forward reuses it
    assert layout.window(rows, lengths, 5)[0] is not w
