"""The scheduler's side of the compaction worker: start it, send snapshots, take plans, survive its faults.

Contract: ``submit`` and ``poll`` never block and never raise on the worker's behaviour. At most one snapshot is in
flight. A plan comes back with the epoch of its snapshot; the caller validates it (epoch, overlap with relocations
in flight, sources unchanged) and applies or drops it whole. If the worker dies, hangs past ``reply_timeout_s`` or
does not say hello within ``start_timeout_s``, it is killed and restarted after a back-off that doubles up to
``max_backoff_s`` (reset by the next plan); meanwhile ``ready`` is False and reclaim pauses. Messages that are not
valid protocol messages, or plans that index outside the pool, are logged, counted and dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid

import torch
import zmq

from vtoken_sglang.core.planner import Plan, Snapshot
from vtoken_sglang.worker import protocol

logger = logging.getLogger("vtoken_sglang")
# ``poll`` runs at every decode step. Reading the socket's state costs a syscall, checking the process a waitpid,
# both dear on shared cores: so the socket is read at every poll only while a reply is expected (a snapshot in
# flight, or the worker's hello), and otherwise (a stray message) at most every QUIET_POLL_S, like the health check.
QUIET_POLL_S = 0.1


@dataclasses.dataclass
class WorkerStats:
    snapshots_sent: int = 0
    plans_received: int = 0
    messages_ignored: int = 0  # malformed, unexpected or out-of-bounds
    worker_restarts: int = 0
    worker_up: int = 0  # 1 while a worker has said hello and is not known to be faulty


class WorkerClient:
    def __init__(
        self,
        num_pages: int,
        num_rows: int,
        reply_timeout_s: float = 5.0,
        start_timeout_s: float = 60.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        endpoint: str | None = None,
    ):
        self.num_pages, self.num_rows = num_pages, num_rows
        self.reply_timeout_s, self.start_timeout_s = reply_timeout_s, start_timeout_s
        self.backoff0, self.max_backoff = backoff_s, max_backoff_s
        self.backoff = backoff_s
        self.endpoint = (
            endpoint or f"ipc://{tempfile.gettempdir()}/vtoken-worker-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
        )
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.sock.bind(self.endpoint)
        self.stats = WorkerStats()
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.started_at = 0.0
        self.restart_at: float | None = None
        self.checked_at = 0.0  # when _check_health last looked
        self.read_at = 0.0  # when poll_messages last read the socket
        self.in_flight: tuple[int, float] | None = None  # (epoch, sent at)
        self.latest: Plan | None = None  # the newest plan received and not yet taken by poll()
        self._start()

    # ------------------------------------------------------------------ process

    def _start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "vtoken_sglang.worker.process",
            "--endpoint",
            self.endpoint,
            "--parent-pid",
            str(os.getpid()),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.started_at, self.ready, self.in_flight, self.restart_at = time.monotonic(), False, None, None

    def _fault(self, why: str) -> None:
        logger.warning(
            "[vtoken] compaction worker %s: %s; reclaim pauses, restart in %.1f s",
            self.proc.pid if self.proc else "-",
            why,
            self.backoff,
        )
        self._kill()
        self.ready, self.in_flight, self.stats.worker_up = False, None, 0
        self.restart_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, self.max_backoff)

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def _check_health(self) -> None:
        """The worker's health (exited, no hello, no reply in time) and a restart that is due: at most every
        ``QUIET_POLL_S``."""
        now = time.monotonic()
        if self.proc is None or now - self.checked_at < QUIET_POLL_S:  # closed, or checked a moment ago
            return
        self.checked_at = now
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.stats.worker_restarts += 1
                self._start()
            return
        if self.proc.poll() is not None:
            self._fault(f"exited with {self.proc.returncode}")
        elif not self.ready and now - self.started_at > self.start_timeout_s:
            self._fault(f"no hello within {self.start_timeout_s:.0f} s")
        elif self.in_flight is not None and now - self.in_flight[1] > self.reply_timeout_s:
            self._fault(f"no plan within {self.reply_timeout_s:.1f} s")

    # ------------------------------------------------------------------ messages

    def can_submit(self) -> bool:
        """The worker is up and has no snapshot of ours in hand (as of the last poll)."""
        return self.ready and self.in_flight is None

    def submit(self, snap: Snapshot) -> bool:
        """Send a snapshot if the worker is ready and idle; False otherwise (nothing is queued). A plan that
        arrived meanwhile is kept for the next ``poll``."""
        self.poll_messages()
        if not self.ready or self.in_flight is not None:
            return False
        try:
            self.sock.send_multipart(protocol.encode_snapshot(snap, self.num_rows), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.in_flight = (snap.epoch, time.monotonic())
        self.stats.snapshots_sent += 1
        return True

    def poll(self, device: torch.device | str = "cpu") -> Plan | None:
        """The newest plan that arrived since the last ``poll`` (or None), on ``device``; also the health check."""
        self.poll_messages()
        plan, self.latest = self.latest, None
        if plan is None or torch.device(device) == plan.rows.device:
            return plan
        return plan.to(device)

    def poll_messages(self) -> None:
        """Take every message waiting (non-blocking): hellos, and plans (the newest kept in ``latest``, on the
        CPU); then the health check. Without a reply expected, at most every ``QUIET_POLL_S``."""
        now = time.monotonic()
        if self.ready and self.in_flight is None and now - self.read_at < QUIET_POLL_S:
            self._check_health()
            return
        self.read_at = now
        while self.sock.get(zmq.EVENTS) & zmq.POLLIN:  # no poller built, no exception raised per empty check
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                kind, header, arrays = protocol.decode(frames)
                if kind == "hello":
                    self.ready, self.stats.worker_up = True, 1
                    continue
                if kind != "plan":
                    raise protocol.ProtocolError(f"the scheduler expects plans, got {kind}")
                protocol.check_plan_bounds(arrays, self.num_rows, self.num_pages)
                plan = protocol.to_plan(header, arrays, "cpu")
            except protocol.ProtocolError as err:
                self.stats.messages_ignored += 1
                logger.warning("[vtoken] ignored a message from the compaction worker: %s", err)
                continue
            if self.in_flight is not None and plan.epoch == self.in_flight[0]:
                self.in_flight = None
            self.stats.plans_received += 1
            self.backoff = self.backoff0
            self.latest = plan
        self._check_health()

    def close(self) -> None:
        """Stop the worker (SIGTERM, then SIGKILL) and release the socket. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._kill()
        self.proc = None
        self.restart_at = None
        if not self.sock.closed:
            self.sock.close(0)
            self.ctx.term()
        path = self.endpoint.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)
