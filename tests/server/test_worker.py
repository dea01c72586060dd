"""The compaction worker as a real process over real ZMQ sockets: its plans equal the inline planner's; malformed
messages are dropped on both sides; kill -9 and a hang are detected, the worker comes back, planning goes on; no
worker outlives its parent."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq
from core_helpers import MiniEngine, stamp
from hypothesis import event, given, settings
from hypothesis import strategies as st

from vtoken_sglang.core.integrity import check_integrity
from vtoken_sglang.core.planner import plan_reclaim
from vtoken_sglang.integration.observe.stats import RuntimeStats
from vtoken_sglang.integration.parts.plan_source import MAX_BACKOFF, WorkerPlans
from vtoken_sglang.worker import protocol
from vtoken_sglang.worker.client import WorkerClient


def fragmented_engine(seed: int = 0) -> MiniEngine:
    """Several requests whose pages are left sparse by scattered evictions (something to plan)."""
    eng = MiniEngine(num_pages=128, page_size=4, rows=8, reserve=4)
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(6)
    eng.table.open_rows(rows)
    eng.write(rows, torch.full((6,), 40))
    for r in range(6):
        n = int(eng.table.live_len[r])
        cols = torch.randperm(n - 1, generator=g)[: n // 2]
        eng.evict(torch.full_like(cols, r), cols)
    return eng


def wait_for(pred, timeout: float = 30.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(step)
    raise AssertionError("timed out")


def plan_fields(plan):
    return [plan.epoch] + [t.tolist() for t in (plan.rows, plan.n_dst, plan.src_pages, plan.src_row, plan.src_live)]


@pytest.fixture
def worker():
    eng = fragmented_engine()
    w = WorkerClient(eng.pool.num_pages, 8, reply_timeout_s=3.0, backoff_s=0.2)
    yield eng, w
    w.close()


def roundtrip(w: WorkerClient, snap):
    wait_for(lambda: w.poll() or w.ready)
    wait_for(lambda: w.submit(snap))  # False while the send queue is full (garbage the worker has not read yet)
    return wait_for(lambda: w.poll())


def test_worker_plans_equal_inline_and_garbage_is_dropped(worker):
    eng, w = worker
    snap = eng.reclaimer.snapshot()
    inline = plan_reclaim(snap)
    assert not inline.is_empty()
    assert plan_fields(roundtrip(w, snap)) == plan_fields(inline)
    # garbage to the worker: dropped there, it keeps serving
    w.sock.send_multipart([b"\x00\xffnot json"])
    w.sock.send_multipart([b'{"v": 99, "type": "snapshot"}'])
    w.sock.send_multipart(protocol.encode_snapshot(snap, 2))  # owners up to 5, past the rows it declares
    assert plan_fields(roundtrip(w, snap)) == plan_fields(inline)
    # garbage and out-of-bounds plans to the scheduler: ignored and counted, never raised
    rogue = w.ctx.socket(zmq.DEALER)
    rogue.connect(w.endpoint)
    bad = plan_reclaim(snap)
    bad = type(bad)(bad.epoch, bad.rows + 100, bad.n_dst, bad.src_pages, bad.src_row, bad.src_live)
    for frames in (
        [b"garbage"],
        [json.dumps({"v": protocol.VERSION, "type": "plan", "epoch": 0, "arrays": []}).encode()],
        protocol.encode_plan(bad),
    ):
        rogue.send_multipart(frames)
    wait_for(lambda: (w.poll(), w.stats.messages_ignored >= 3)[1])
    rogue.close(0)
    assert w.ready and w.stats.worker_restarts == 0


def test_snapshot_interval_backs_off_while_plans_are_empty():
    """``WorkerPlans`` over a real worker: while its plans come back empty (the trigger holds, nothing can be
    freed) the snapshot interval doubles up to ``MAX_BACKOFF * every``; the first plan that moves something brings
    it back to ``every``, and that plan is applied."""
    eng = MiniEngine(num_pages=128, page_size=4, rows=8, reserve=4)
    eng.table.open_rows(torch.arange(6))
    eng.write(torch.arange(6), torch.full((6,), 40))  # full pages only: every plan is empty
    eng.reclaimer.theta = -1.0  # yet the trigger holds
    stats = RuntimeStats()
    link = WorkerPlans(eng.reclaimer, stats.fold, 8, every=4)
    eng.reclaimer.max_plan_lag = 2 * link.every  # as the scheduler sets it
    intervals = []

    def step():
        link.begin_round()
        link.end_step()
        if link.client.in_flight is not None:  # the worker's answer arrives before the next step
            wait_for(lambda: (link.client.poll_messages(), link.client.in_flight is None)[1], step=0.002)
        intervals.append(link.interval)

    try:
        wait_for(lambda: (link.poll(), link.client.ready)[1])
        for _ in range(160):
            step()
        assert sorted(set(intervals)) == [4 * 2**k for k in range(MAX_BACKOFF.bit_length())]
        assert intervals[-1] == 4 * MAX_BACKOFF and eng.reclaimer.stats.plans_admitted == 0
        sent = link.client.stats.snapshots_sent
        assert sent < 160 // 4 // 2  # fewer than half of a fixed cadence's snapshots
        g = torch.Generator().manual_seed(0)
        for r in range(6):  # now something to reclaim
            cols = torch.randperm(39, generator=g)[:20]
            eng.evict(torch.full_like(cols, r), cols)
        for _ in range(4 * MAX_BACKOFF + 2):
            step()
            if eng.reclaimer.stats.plans_admitted:
                break
        assert eng.reclaimer.stats.plans_admitted == 1 and intervals[-1] == 4
    finally:
        link.close()


def edit_header(frame: bytes, change) -> bytes:
    header = json.loads(frame)
    change(header)
    return json.dumps(header).encode()


def test_protocol_rejects_malformed_messages():
    snap = fragmented_engine().reclaimer.snapshot()
    good = protocol.encode_snapshot(snap, 8)
    assert protocol.decode(good)[0] == "snapshot"
    for frames in (
        [],
        [b"[1]"],
        good[:2],
        [good[0]] + good[1:3] + [good[3][:-1]],
        [edit_header(good[0], lambda h: h.update(v=protocol.VERSION - 1))] + good[1:],
        [edit_header(good[0], lambda h: h.pop("num_rows"))] + good[1:],
        [edit_header(good[0], lambda h: h.update(num_rows=1))] + good[1:],  # owners up to 5
        [good[0].replace(b'"snapshot"', b'"plan"')] + good[1:],
        # headers that once raised other errors (IndexError, TypeError, RecursionError, ValueError)
        [edit_header(good[0], lambda h: h["arrays"][0].pop())] + good[1:],
        [edit_header(good[0], lambda h: h.update(type=["snapshot"]))] + good[1:],
        [b"[" * 100_000 + b"]" * 100_000],
        [b'{"v": ' + b"1" * 5000 + b"}"],
    ):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(frames)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 300) | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_protocol_fuzz_raises_only_protocol_errors(data):
    """Messages mutated in their bytes or in their header's structure (a value replaced, removed or shortened,
    at the top or inside ``arrays``): ``decode`` returns a message or raises ``ProtocolError``, nothing else
    (the scheduler and the worker catch only that). And what decodes, its receiver takes without an exception:
    the worker plans a snapshot; the scheduler bounds-checks a plan, then applies it or rejects it, and the
    Token Table and pool stay consistent."""
    eng = fragmented_engine()
    snap = eng.reclaimer.snapshot()
    frames = [
        bytes(f)
        for f in data.draw(
            st.sampled_from([protocol.encode_snapshot(snap, 8), protocol.encode_plan(plan_reclaim(snap))])
        )
    ]
    if data.draw(st.booleans()):  # bytes
        i = data.draw(st.integers(0, len(frames) - 1))
        f = bytearray(frames[i])
        for _ in range(data.draw(st.integers(1, 4))):
            at, cut = data.draw(st.integers(0, len(f))), data.draw(st.integers(0, 8))
            f[at : at + cut] = data.draw(st.binary(max_size=8))
        frames[i] = bytes(f)
    else:  # the header's structure
        header = json.loads(frames[0])
        parent = data.draw(st.sampled_from([header, header["arrays"], *header["arrays"]]))
        key = data.draw(st.sampled_from(sorted(parent) if isinstance(parent, dict) else range(len(parent))))
        op = data.draw(st.sampled_from(["replace", "remove", "shorten"]))
        if op == "replace":
            parent[key] = data.draw(JSON)
        elif op == "remove":
            del parent[key]
        elif isinstance(parent[key], list) and parent[key]:
            parent[key].pop()
        frames[0] = json.dumps(header).encode()
    try:
        kind, header, arrays = protocol.decode(frames)
        if kind == "plan":
            protocol.check_plan_bounds(arrays, eng.table.num_rows, eng.pool.num_pages)
    except protocol.ProtocolError:
        event("dropped")
        return
    if kind == "snapshot":
        plan_reclaim(protocol.to_snapshot(header, arrays))
        event("snapshot planned")
    elif kind == "plan":
        applied = eng.reclaimer.apply(protocol.to_plan(header, arrays))
        event(f"plan {'applied' if applied else 'rejected'}")
        eng.reclaimer.release_ready(force=True)
        check_integrity(eng.table, eng.kv, stamp)


def test_kill_and_hang_are_survived(worker):
    eng, w = worker
    snap = eng.reclaimer.snapshot()
    inline = plan_fields(plan_reclaim(snap))
    assert plan_fields(roundtrip(w, snap)) == inline
    first = w.proc.pid
    os.kill(first, signal.SIGKILL)  # kill -9
    wait_for(lambda: (w.poll(), w.stats.worker_restarts == 1 and w.ready)[1])
    assert w.proc.pid != first
    assert plan_fields(roundtrip(w, snap)) == inline
    second = w.proc.pid
    os.kill(second, signal.SIGSTOP)  # a hang: the reply never comes
    assert w.submit(snap)
    wait_for(lambda: (w.poll(), w.stats.worker_restarts == 2 and w.ready)[1])
    assert w.proc.pid != second
    assert plan_fields(roundtrip(w, snap)) == inline
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)


def test_no_worker_outlives_its_parent(tmp_path):
    """A parent that dies without closing: its worker notices, removes the parent's socket file and exits."""
    script = (
        "from vtoken_sglang.worker.client import WorkerClient\nimport os, time\n"
        "w = WorkerClient(16, 4)\n"
        "while not (w.poll() or w.ready): time.sleep(0.05)\n"
        "print(w.proc.pid, w.endpoint, flush=True)\nos._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid, endpoint = int(out.stdout.split()[0]), out.stdout.split()[1]
    socket_file = endpoint.removeprefix("ipc://")

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, timeout=15)
    assert not os.path.exists(socket_file)  # the orphaned worker removed its dead parent's socket file
    closed = WorkerClient(16, 4)
    wait_for(lambda: (closed.poll(), closed.ready)[1])
    pid = closed.proc.pid
    closed.close()
    assert gone()
