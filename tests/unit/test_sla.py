"""The SLA rules of ``benchmark/sla_throughput.py`` (saturation point, SLA latency, SLA throughput) on made-up
sweeps; the servers themselves run only in the benchmark."""

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmark"))

import sla_throughput  # noqa: E402


def sweep(*points):
    return {"points": [{"rate": r, "output_throughput": t, "p95_latency_s": p95} for r, t, p95 in points]}


def test_saturation_is_the_first_rate_near_the_best_throughput():
    naive = sweep((1, 100.0, 2.0), (2, 190.0, 3.0), (4, 196.0, 5.0), (float("inf"), 200.0, 9.0))
    rate, latency = sla_throughput.sla_of(naive)
    assert rate == 4 and abs(latency - 5.25) < 1e-9  # 196 >= 0.97 x 200; 1.05 x 5.0; not rate 2 (190 < 194)


def test_sla_throughput_is_the_best_point_within_the_latency():
    vtoken = sweep((1, 100.0, 2.0), (2, 200.0, 2.9), (4, 380.0, 5.2), (float("inf"), 420.0, 6.0))
    assert sla_throughput.sla_throughput(vtoken, 5.25) == 380.0
    assert sla_throughput.sla_throughput(vtoken, 1.0) == 0.0


def test_the_real_model_runs_sharegpt_by_default_and_the_tiny_model_random_ids(tmp_path):
    """bench_serving's default dataset is the default of a real checkpoint's sweep, through bench_serving's own
    ShareGPT flags; the tiny model keeps random ids of one length."""
    real = sla_throughput.parse_args(["--dataset-path", str(tmp_path / "sg.json")])
    assert (real.dataset, real.max_total_tokens, real.output_len) == ("sharegpt", 4096, 128)
    flags = sla_throughput.load_flags(real)
    assert flags[flags.index("--dataset-name") + 1] == "sharegpt"
    assert flags[flags.index("--dataset-path") + 1] == str(tmp_path / "sg.json")
    assert flags[flags.index("--sharegpt-output-len") + 1] == "128"
    assert flags[flags.index("--sharegpt-context-len") + 1] == "1024"
    assert "ShareGPT" in sla_throughput.describe(real)
    tiny = sla_throughput.parse_args(["--model-path", "tiny", "--quick"])
    assert (tiny.dataset, tiny.max_total_tokens, tiny.output_len, tiny.requests) == ("random", 4096, 480, 16)
    flags = sla_throughput.load_flags(tiny)
    assert flags[flags.index("--dataset-name") + 1] == "random-ids"
    assert flags[flags.index("--random-input-len") + 1] == "32"
    assert sla_throughput.parse_args(["--dataset", "random"]).output_len == 224  # a real model on random ids
