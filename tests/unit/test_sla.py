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
