"""The prepared device check (``benchmark/gpu_check.py``) runs on CPU: every check present and ok (its GPU rows
are the same code with CUDA buffers, the CUDA copy engine and native Triton)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

CHECKS = (
    "copy_order",
    "overlap_order",
    "fence_done",
    "reclaim_integrity",
    "late_release",
    "copy_time[",
    "triton_scores",
    "window_scores",
    "state_per_request",
    "flashinfer_window",
    "flashinfer_extend",
    "scoring_cost[",
    "graph_queries",
)


def test_gpu_check_passes_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run(
        [sys.executable, "benchmark/gpu_check.py", "--device", "cpu", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()]
    for name in CHECKS:
        found = [r for r in rows if r[0].startswith(name)]
        assert found and all(r[1] == "ok" for r in found), (name, run.stdout)
    doc = json.loads(out.read_text())
    assert doc["exit"] == 0 and doc["rows"] and all(r["result"] == "ok" for r in doc["rows"])
