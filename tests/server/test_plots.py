"""``benchmark/plots.py`` draws every figure, and the histogram it draws is consistent: each memory run's
page_live_hist (reclaim_sim.py) counts exactly its allocated pages and its live tokens.

Two sets of inputs: the committed results in benchmark/results (the JSON files the README's tables and figures were
printed from), and a fresh set made here (a real ``reclaim_sim.py --quick`` run for one policy and ratio, and small
server results in the two server scripts' record format), so the figures are drawn from new data too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmark"))

import reclaim_sim  # noqa: E402

RESULTS = REPO / "benchmark" / "results"
INPUTS = (
    "reclaim_sim.json",
    "sla_throughput_quick.json",
    "serve_capacity_shared_prefix_quick.json",
    "quality.json",
    "quality_smollm2_passkey_1k.json",
    "quality_smollm2_prose_1k.json",
    "serve_capacity_sharegpt_2048.json",
)
FIGURES = (
    "page_utilization.png",
    "retained_pages.png",
    "capacity_frontier.png",
    "throughput_latency.png",
    "shared_prefix_pages.png",
    "quality_pages.png",
    "quality_pages_smollm2.png",
    "quality_pages_smollm2_prose.png",
    "sharegpt_frontier.png",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_BYTES = 10_000  # a figure with axes, bars and text; an empty canvas is a few KB


def run_plots(results: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmark/plots.py", "--results", str(results), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def check_figures(run: subprocess.CompletedProcess, out: Path) -> None:
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    for name in FIGURES:
        path = out / name
        assert path.is_file(), (name, run.stdout)
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > MIN_BYTES, (name, len(data))
        assert sum(str(path) in line for line in run.stdout.splitlines()) == 1, (name, run.stdout)  # one line per file
    assert sorted(p.name for p in out.iterdir()) == sorted(FIGURES)


def check_page_live_hist(doc: dict) -> None:
    runs = [r for r in doc["runs"] if r["scenario"] == "memory"]
    assert runs
    for r in runs:
        key = (r["policy"], r["evict_ratio"], r["mode"])
        hist = r["page_live_hist"]
        assert len(hist) == r["page_size"] + 1, key
        assert all(isinstance(c, int) and c >= 0 for c in hist), key
        assert sum(hist) == r["pages"], key
        assert sum(k * c for k, c in enumerate(hist)) == r["live_tokens"], key
        assert abs(1 - r["live_tokens"] / (r["pages"] * r["page_size"]) - r["final_F"]) < 1e-3, key  # = final F


def server_results(folder: Path) -> None:
    """Small results in the records sla_throughput.py, serve_capacity.py --shared-prefix and quality.py write (only
    what plots.py reads): made-up figures, for drawing only."""
    inf = float("inf")
    sla = []
    for k, (mode, policy) in enumerate((("plain", "none"), ("naive", "random"), ("vtoken", "random"))):
        points = [
            {
                "rate": rate,
                "completed": 4,
                "output_throughput": 100.0 + 10 * k + 5 * i,
                "p95_latency_s": 2.0 + i - 0.3 * k,
            }
            for i, rate in enumerate((1.0, 2.0, inf))
        ]
        sla.append(
            {
                "mode": mode,
                "policy": policy,
                "requests": 4,
                "input_len": 8,
                "output_len": 32,
                "max_total_tokens": 512,
                "points": points,
                "saturation_rate": inf,
                "sla_latency_s": 4.2,
                "sla_throughput": max(p["output_throughput"] for p in points),
            }
        )
    (folder / INPUTS[1]).write_text(json.dumps({"runs": sla}))
    shared = [
        {
            "mode": mode,
            "policy": "random",
            "budget_ratio": 0.25,
            "degree": degree,
            "requests": 4,
            "system_len": 64,
            "question_len": 8,
            "output_len": 32,
            "mean_held_pages": 40.0 / degree + 5 * m,
            "peak_held_pages": 60 // degree + 5 * m,
        }
        for m, mode in enumerate(("cow", "no-cow", "naive"))
        for degree in (1, 2, 4)
    ]
    (folder / INPUTS[2]).write_text(json.dumps({"runs": shared}))
    quality = [{"policy": "none", "budget_ratio": 1.0, "mode": "vtoken", "accuracy": 1.0, "mean_held_pages": 80.0}]
    quality += [
        {
            "policy": policy,
            "budget_ratio": ratio,
            "mode": mode,
            "accuracy": 0.9 * ratio + 0.1 * k - 0.05 * (mode == "naive"),
            "mean_held_pages": 80.0 * ratio + 10 * (mode == "naive"),
        }
        for k, policy in enumerate(("random", "h2o"))
        for ratio in (0.5, 0.25)
        for mode in ("naive", "vtoken")
    ]
    for r in quality:
        r.update(prompts=16, context=64)
    (folder / INPUTS[3]).write_text(json.dumps({"runs": quality}))
    for r in quality:
        r.update(prompts=12, context=1000, task="passkey", model="SmolLM2-135M-Instruct")
    (folder / INPUTS[4]).write_text(json.dumps({"runs": quality}))
    for r in quality:
        r.update(task="prose")
    (folder / INPUTS[5]).write_text(json.dumps({"runs": quality}))
    for name, pool in ((INPUTS[6], 2048),):
        capacity = [
            {
                "mode": mode,
                "policy": policy,
                "max_total_tokens": pool,
                "page_size": 16,
                "requests": 8,
                "mean_prompt_len": 200.0,
                "output_len": 32,
                "budget": None,
                "budget_ratio": 0.5,
                "max_running_requests": pool // 512 * (2 if mode == "vtoken" else 1),
                "ideal_running": pool / 256,
                "pages_per_request": 12.0 if mode == "vtoken" else 18.0,
                "series": {
                    "running": [4, 4, 3, 2],
                    "held_tokens": [800, 832, 640, 480],
                    **({"live": [700, 720, 500, 300]} if mode != "plain" else {}),
                },
            }
            for mode, policy in [("plain", "none")] + [(m, p) for p in ("random", "h2o") for m in ("naive", "vtoken")]
        ]
        (folder / name).write_text(json.dumps({"runs": capacity}))


@pytest.fixture(scope="module")
def fresh_results(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("results")
    threads = torch.get_num_threads()
    try:  # the real script, in this process (it sets torch's threads to 1: put them back)
        assert (
            reclaim_sim.main(["--quick", "--policies", "random", "--ratios", "0.5", "--json", str(folder / INPUTS[0])])
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    server_results(folder)
    return folder


def test_page_live_hist_fresh_run(fresh_results):
    check_page_live_hist(json.loads((fresh_results / INPUTS[0]).read_text()))


def test_plots_fresh_results(fresh_results, tmp_path):
    check_figures(run_plots(fresh_results, tmp_path), tmp_path)


@pytest.mark.parametrize("missing", INPUTS)
def test_plots_missing_input_is_one_line_error(fresh_results, tmp_path, missing):
    results = tmp_path / "results"
    results.mkdir()
    for name in INPUTS:
        if name != missing:
            (results / name).write_bytes((fresh_results / name).read_bytes())
    run = run_plots(results, tmp_path / "out")
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing" in lines[0] and missing in lines[0], run.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_page_live_hist_committed_results():
    check_page_live_hist(json.loads((RESULTS / INPUTS[0]).read_text()))


def test_plots_committed_results(tmp_path):
    check_figures(run_plots(RESULTS, tmp_path), tmp_path)
