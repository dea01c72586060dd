"""The compaction worker process: receives page snapshots over ZMQ, answers with reclaim plans.

    python -m vtoken_sglang.worker.process --endpoint ipc:///tmp/x.sock --parent-pid PID

It connects a DEALER socket to the scheduler's endpoint, sends ``hello`` (a header-only message) so the scheduler
knows it is up, then plans every snapshot it receives with the same pure planner as the inline path
(``core.planner.plan_reclaim``). A malformed message is logged and dropped. It exits when its parent process is
gone (checked every ``--parent-check-s``; it then deletes the parent's IPC socket file, which a killed scheduler
leaves behind) or on SIGTERM, so a server shutdown leaves no worker and no socket file behind. It runs with one
torch thread and a lower CPU priority (``--nice``, default 10): the scheduler's loop comes first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import torch
import zmq

from vtoken_sglang.core.planner import plan_reclaim
from vtoken_sglang.worker import protocol

logger = logging.getLogger("vtoken_sglang.worker")


def hello_frames() -> list[bytes]:
    return [json.dumps({"v": protocol.VERSION, "type": "hello", "pid": os.getpid(), "arrays": []}).encode()]


def remove_ipc_file(endpoint: str) -> None:
    """Delete the file behind an ``ipc://`` endpoint, if it is still there. Only once the parent (its binder) is
    gone: on SIGTERM (a restart) the parent keeps the endpoint bound for the next worker."""
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint.removeprefix("ipc://"))
        except FileNotFoundError:
            pass


def background(nice: int) -> None:
    """Planning is background work: the scheduler's loop must keep its core. One torch thread (a plan is a few
    vector ops over the page arrays; torch would otherwise spin a thread per core), and a lower CPU priority, so on
    a machine with few cores the worker waits for the scheduler rather than the other way round."""
    torch.set_num_threads(1)
    if nice:
        os.nice(nice)


def serve(endpoint: str, parent_pid: int, parent_check_s: float = 1.0) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(hello_frames())
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    last_check = time.monotonic()
    while not stop:
        if time.monotonic() - last_check > parent_check_s:
            last_check = time.monotonic()
            if os.getppid() != parent_pid:
                logger.warning("[vtoken worker] parent %d is gone; exiting", parent_pid)
                remove_ipc_file(endpoint)  # the parent bound it and cannot remove it any more
                break
        if not dict(poller.poll(int(parent_check_s * 1000))).get(sock):
            continue
        frames = sock.recv_multipart()
        try:
            kind, header, arrays = protocol.decode(frames)
            if kind != "snapshot":
                raise protocol.ProtocolError(f"a worker expects snapshots, got {kind}")
        except protocol.ProtocolError as err:
            logger.warning("[vtoken worker] dropped a malformed message: %s", err)
            continue
        plan = plan_reclaim(protocol.to_snapshot(header, arrays))
        sock.send_multipart(protocol.encode_plan(plan))
    sock.close(0)
    ctx.term()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--parent-check-s", type=float, default=1.0)
    ap.add_argument("--nice", type=int, default=10, help="added to the worker's niceness (planning is background work)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    background(args.nice)
    return serve(args.endpoint, args.parent_pid, args.parent_check_s)


if __name__ == "__main__":
    sys.exit(main())
