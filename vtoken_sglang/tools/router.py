"""``SglangRouter``: SGLang's router (``sglang_router``) in front of several servers, as a context manager."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from vtoken_sglang.tools.launcher import cpu_env, free_port, signal_group, wait_until_ready


@dataclasses.dataclass
class SglangRouter:
    """``python -m sglang_router.launch_router`` over ``worker_urls``, as a context manager. Ready means its
    ``/readiness`` reports every worker healthy: its ``/health`` answers 200 at once, while the workers are still
    being registered in the background, and a request sent then fails with ``503 no_available_workers``."""

    worker_urls: list[str]
    args: list[str] = dataclasses.field(default_factory=lambda: ["--policy", "cache_aware"])
    port: int = dataclasses.field(default_factory=free_port)
    log_path: Path | None = None
    startup_timeout: float = 120.0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> SglangRouter:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--worker-urls", *self.worker_urls, *self.args]
        with open(self.log_path, "wb") as log:  # a file, not a pipe: the router logs every request
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_env(), start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        n = len(self.worker_urls)
        wait_until_ready(
            self.proc,
            self.url + "/readiness",
            lambda r: json.loads(r.read()).get("healthy_workers") == n,
            self.startup_timeout,
            lambda: f"router (exit status {self.proc.returncode}); log: {self.log_path}",
        )

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
