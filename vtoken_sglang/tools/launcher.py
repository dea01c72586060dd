"""Start and stop a real ``python -m sglang.launch_server`` process (tests, demo, benchmarks share this).

``SglangServer`` is a context manager: it starts the server in its own process group with its log in a file,
waits until ``/health`` answers 200 (failing early, with the log's tail, if the process dies), and on exit
sends SIGTERM to the whole group, then SIGKILL after ``stop_grace`` seconds (0: at once), so no SGLang process
outlives it. (The router in front of several: ``router.SglangRouter``.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STOP_GRACE_S = 30.0
"""The default ``SglangServer.stop_grace``."""
PORT_RETRIES = 3
"""Start-ups retried on a fresh port when the HTTP port was taken between ``free_port`` and the server's bind (by
another process starting at the same time)."""
BIND_ERROR = "error while attempting to bind on address"  # uvicorn's line; the launcher then stays up, unbound


class PortTaken(RuntimeError):
    """The server could not bind its HTTP port."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for SGLang on this machine: offline hub, CPU engine (also the venv's default on CPU set-ups)."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not _has_cuda():
        env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        # torch's CUDA wheel ships libnccl, and SGLang would build a NCCL communicator for --tp > 1 on a CPU
        # device (and fail); a path that does not load makes it fall back to gloo, as CPU serving needs.
        env.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/no-nccl-on-cpu.so")
    env.update(extra or {})
    return env


def cpu_threads_bind(server_args: list[str]) -> str | None:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for a CPU server with more than one rank (``--tp-size`` x ``--dp-size``):
    SGLang's CPU engine otherwise gives each rank a NUMA node and stops at start when there are more ranks than
    nodes (one node here). The cores are dealt out round-robin, one group per rank (a rank may share a core on a
    small machine). None for a single rank."""
    ranks = _flag_value(server_args, ("--tp", "--tp-size"), 1) * _flag_value(server_args, ("--dp", "--dp-size"), 1)
    if ranks <= 1:
        return None
    cores = sorted(os.sched_getaffinity(0))
    groups = [cores[i::ranks] or [cores[i % len(cores)]] for i in range(ranks)]
    return "|".join(",".join(map(str, g)) for g in groups)


def _flag_value(args: list[str], names: tuple[str, ...], default: int) -> int:
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            return int(args[i + 1])
        for n in names:
            if a.startswith(n + "="):
                return int(a.split("=", 1)[1])
    return default


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def default_server_args(
    max_total_tokens: int = 16384, page_size: int | None = 16, cpu_attention: str = "torch_native"
) -> list[str]:
    """Flags for a small CPU server (torch_native attention, bounded KV pool, float32 for exact comparisons).
    ``--sleep-on-idle``: an idle SGLang scheduler otherwise busy-polls and holds a whole core, which on a 2-core
    machine halves the speed of everything else (tests and benchmarks that keep a server up between loads).
    ``cpu_attention``: the attention backend without CUDA (``triton``: SGLang's GPU kernels, which need
    ``TRITON_INTERPRET=1`` in the server's environment on a CPU)."""
    args = ["--max-total-tokens", str(max_total_tokens), "--dtype", "float32", "--sleep-on-idle"]
    if not _has_cuda():
        args += ["--device", "cpu", "--attention-backend", cpu_attention]
    if page_size is not None:
        args += ["--page-size", str(page_size)]
    return args


@dataclasses.dataclass
class SglangServer:
    model_path: str
    args: list[str] = dataclasses.field(default_factory=default_server_args)
    port: int = dataclasses.field(default_factory=free_port)
    log_path: Path | None = None
    env: dict[str, str] | None = None
    startup_timeout: float = 240.0
    # seconds a stop waits after SIGTERM before SIGKILL (SGLang drains in-flight requests, polling every 5 s, and
    # its launcher waits 5 s more once a child is gone); 0: SIGKILL at once, for callers that are done with the
    # server and its log when they stop it (the tests: ``STOP_GRACE_S``)
    stop_grace: float = dataclasses.field(default_factory=lambda: STOP_GRACE_S)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]

    def start(self, wait: bool = True) -> SglangServer:
        """Launch the server; with ``wait``, block until it is ready (see ``started_together`` for several)."""
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        log = open(self.log_path, "wb")
        env = cpu_env(self.env)
        bind = cpu_threads_bind(self.args) if not _has_cuda() else None
        if bind is not None:
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", bind)
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> SglangServer:
        """Block until ``/health`` answers 200; on failure (exit, timeout) stop the server and raise. A port taken
        before the server bound it: start again on a fresh one, up to ``PORT_RETRIES`` times."""
        for attempt in range(PORT_RETRIES + 1):
            try:
                self._wait_ready()
                return self
            except PortTaken:
                self.stop()
                if attempt == PORT_RETRIES:
                    raise
                self.port = free_port()
                self.start(wait=False)
            except BaseException:
                self.stop()
                raise
        return self

    def _wait_ready(self) -> None:
        wait_until_ready(
            self.proc,
            self.url + "/health",
            lambda r: r.status == 200,
            self.startup_timeout,
            lambda: f"server (exit status {self.proc.returncode}); log tail:\n{self.log_tail()}",
            failed=lambda: (
                PortTaken(f"port {self.port} taken: {self.log_tail(3)}") if BIND_ERROR in self.log_text() else None
            ),
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after ``stop_grace`` seconds. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None and self.stop_grace > 0:
            signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace)
            except subprocess.TimeoutExpired:
                pass
        signal_group(self.proc.pid, signal.SIGKILL)  # children that ignored SIGTERM
        if self.proc.poll() is None:
            self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> SglangServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ small HTTP client

    def post(self, path: str, payload: dict, timeout: float = 300.0) -> Any:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body.strip() else None  # some endpoints (``/close_session``) answer nothing

    def get(self, path: str, timeout: float = 60.0) -> Any:
        return json.loads(self.get_text(path, timeout))

    def get_text(self, path: str, timeout: float = 60.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def generate(self, text: str | list[str], max_new_tokens: int = 32, **sampling: Any) -> Any:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}
        return self.post("/generate", {"text": text, "sampling_params": params})


@contextlib.contextmanager
def started_together(*servers: SglangServer) -> Iterator[tuple[SglangServer, ...]]:
    """Launch every server at once, then wait for each (their start-ups overlap: on two CPU cores three servers
    are ready in about 1.5 times the time of one); on exit, signal them all before waiting for any."""
    try:
        for server in servers:
            server.start(wait=False)
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            if server.proc is not None and server.proc.poll() is None and server.stop_grace > 0:
                signal_group(server.proc.pid, signal.SIGTERM)
        for server in servers:
            server.stop()


def wait_until_ready(proc: subprocess.Popen, url: str, ready, timeout: float, what, failed=None) -> None:
    """Poll ``url`` until ``ready(response)``; fail early if ``proc`` exits, or raise what ``failed()`` returns (an
    exception, or None while nothing failed). ``what()``: the process and its log, for the error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what()} exited during start-up")
        error = failed() if failed is not None else None
        if error is not None:
            raise error
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if ready(r):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what()} not ready after {timeout:.0f} s")


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
