"""Shared fixtures. Servers are real SGLang processes on CPU with the project's tiny model (module-scoped:
one per configuration); nothing is downloaded.

Two folders: ``unit/`` starts no process (pure Python and torch, in this process: ``pytest tests/unit``, the fast
lane); ``server/`` starts processes (SGLang servers, ``sgl.Engine``, the real launcher, the compaction worker, scripts
in a subprocess), and each of its tests is marked ``server`` here, so ``-m "not server"`` selects ``unit/``. Helpers
shared by both (this file, ``core_helpers``, ``masked_reference``, ``model_dirs``, ``own_policy``) stay in ``tests/``,
which is on ``sys.path`` (pyproject's ``pythonpath``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vtoken_sglang.tools import launcher

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every server the tests start runs the core's integrity check at idle and every few eviction rounds.
os.environ.setdefault("VTOKEN_SGLANG_CHECK_INTEGRITY", "1")
os.environ.setdefault("VTOKEN_SGLANG_CHECK_INTEGRITY_EVERY", "4")
# ... and its copies' fences report done late, as CUDA events may (test_integration keeps instant-fence servers
# beside a late-fence one).
os.environ.setdefault("VTOKEN_SGLANG_FENCE_DELAY", "4")
INSTANT_FENCES = {"VTOKEN_SGLANG_FENCE_DELAY": "0"}
# A test has read all it checks (outputs, states, logs) when it stops its servers: SIGKILL at once (SGLang's graceful
# shutdown takes 5-6 s a server).
launcher.STOP_GRACE_S = 0.0


SERVER_DIR = Path(__file__).resolve().parent / "server"


def pytest_collection_modifyitems(config, items):
    """Every test under ``server/`` starts processes: mark it ``server`` (those already marked keep the one mark)."""
    for item in items:
        if SERVER_DIR in Path(item.path).resolve().parents and not item.get_closest_marker("server"):
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from vtoken_sglang.tools.tiny_model import build

    return str(build())


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct, float32, built from its registry package's GGUF (``vtoken_sglang.tools.pretrained``)."""
    from vtoken_sglang.tools.pretrained import build

    return str(build("smollm2"))


@pytest.fixture(scope="session")
def gemma3() -> str:
    """Gemma-3-270M, float32, built from its registry package's GGUF (``vtoken_sglang.tools.pretrained``)."""
    from vtoken_sglang.tools.pretrained import build

    return str(build("gemma3"))


def run_all(
    commands: list[list[str]], timeout: float = 300, env: dict | None = None
) -> list[subprocess.CompletedProcess]:
    """Run several commands at once (each SGLang import costs ~10 s of CPU) and return their results in order."""
    from vtoken_sglang.tools.launcher import cpu_env

    full_env = cpu_env(env)
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO)
        for c in commands
    ]
    results = []
    for cmd, p in zip(commands, procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    return results


def on_servers(servers: dict, fn) -> dict:
    """Start ``servers`` (name -> server) together, then run ``fn(name, server)`` on each in turn, and stop them;
    name -> result.
    Start-ups overlap (part of a CPU server's start is not CPU-bound); loads do not (two CPU-bound loads on these
    two cores take longer together than one after the other)."""
    from vtoken_sglang.tools.launcher import started_together

    with started_together(*servers.values()):
        return {name: fn(name, s) for name, s in servers.items()}


PY = sys.executable
# Server environment of the correctness tests: SGLang's idle memory check is strict, and every decode batch's
# positions are checked against SGLang's own request bookkeeping.
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "VTOKEN_SGLANG_CHECK_POSITIONS": "1"}


def prometheus_values(text: str) -> dict[str, float]:
    """``name -> value`` of the vToken series in a Prometheus text exposition (one scheduler: one series each)."""
    values = {}
    for line in text.splitlines():
        if line.startswith("sglang:vtoken_"):
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            values[name] = float(value)
    return values


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 16-100 random token ids."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, 1999) for _ in range(rng.randint(16, 100))] for _ in range(n)]


def generate_all(url: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Every prompt at once (greedy, ``ignore_eos``); an HTTP error comes back as ``{"error": code, "body": ...}``."""
    import concurrent.futures as cf
    import json
    import urllib.error
    import urllib.request

    def one(ids):
        sampling = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        req = urllib.request.Request(
            url + "/generate",
            data=json.dumps({"input_ids": ids, "sampling_params": sampling}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            return {"error": err.code, "body": err.read().decode(errors="replace")[:300]}

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def idle_states(server, ranks: int = 1, timeout: float = 60) -> list[dict]:
    """vToken's state of every scheduler of ``server`` once it is idle (no live token)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        states = [s["vtoken"] for s in server.get("/get_server_info")["internal_states"]]
        if (len(states) == ranks and all(s["live_tokens"] == 0 for s in states)) or time.monotonic() > deadline:
            return states
        time.sleep(1)


def greedy_with_victims(server, name: str, ids: list[list[int]], new_tokens, victims: Path, **request) -> dict:
    """One greedy batch of ``ids`` (``new_tokens`` each, or per prompt; ``ignore_eos``) on a server whose victim log
    is ``victims``, the requests named ``name-0``, ``name-1``, ...: {prompts, outputs, events (per prompt: what the
    log says each evicted), meta (per prompt), vtoken (the scheduler's state), log}. ``request``: more fields of the
    request (``image_data``)."""
    from vtoken_sglang.integration.observe import victim_log

    rids = [f"{name}-{i}" for i in range(len(ids))]
    counts = new_tokens if isinstance(new_tokens, (list, tuple)) else [new_tokens] * len(ids)
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in counts]
    body = {"input_ids": ids, "rid": rids, "sampling_params": params, **request}
    out = server.post("/generate", body, timeout=900)
    events = victim_log.read(victims)
    return {
        "prompts": ids,
        "outputs": [o["output_ids"] for o in out],
        "events": [events.get(rid, []) for rid in rids],
        "meta": [o["meta_info"] for o in out],
        "vtoken": server.get("/get_server_info")["internal_states"][0]["vtoken"],
        "log": server.log_text(),
    }
