"""``benchmark/step_log.py``: per decode step series read from a server log, the vToken line paired with its step,
and the summaries the ShareGPT frontier reports (pages per request, utilisation)."""

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmark"))

import step_log  # noqa: E402


def decode(running: int, tokens: int, queued: int) -> str:
    return (
        f"[2026-12-06 18:00:00] Decode batch, #running-req: {running}, #token: {tokens}, token usage: "
        f"{tokens / 4096:.2f}, cuda graph: False, gen throughput (token/s): 50.00, #queue-req: {queued}, "
    )


def vtoken(live: int, pages: int) -> str:
    return (
        f"[2026-12-06 18:00:00] [vtoken] live: {live}, dead: 3, pages: {pages}, F: 0.100, evicted: 9, reclaimed "
        "pages: 0, moved: 0, plans admitted/rejected/stale: 0/0/0, planner: 0.0 ms, copy: 0.0 ms"
    )


PREFILL = "[2026-12-06 18:00:00] Prefill batch, #new-seq: 2, #new-token: 64, #running-req: 9, #queue-req: 1, "


def test_each_vtoken_line_belongs_to_the_decode_step_before_it():
    log = "\n".join([PREFILL, decode(2, 64, 1), vtoken(40, 4), "noise", decode(4, 160, 0), vtoken(100, 8)])
    s = step_log.read_steps(log)
    assert (s.running, s.held_tokens, s.queued) == ([2, 4], [64, 160], [1, 0])
    assert (s.live, s.tracked_pages) == ([40, 100], [4, 8])
    summary = s.summary(page=16)
    assert summary["steps"] == 2
    assert summary["mean_held_pages"] == pytest.approx((4 + 10) / 2)
    assert summary["pages_per_request"] == pytest.approx((4 / 2 + 10 / 4) / 2)
    assert summary["utilisation"] == pytest.approx(140 / 224, abs=1e-3)


def test_a_log_without_vtoken_lines_has_no_live_figures():
    s = step_log.read_steps("\n".join([decode(3, 96, 0), decode(3, 99, 0)]))
    assert s.live == [] and s.summary(16)["utilisation"] is None
    assert set(s.as_json()) == {"running", "held_tokens", "queued"}


def test_a_step_without_its_vtoken_line_is_an_error_not_a_shifted_series():
    with pytest.raises(ValueError, match="not one per step"):
        step_log.read_steps("\n".join([decode(2, 64, 0), vtoken(40, 4), decode(2, 80, 0)]))


def test_an_idle_log_has_no_summary():
    summary = step_log.read_steps(PREFILL).summary(16)
    assert summary == {"steps": 0, "mean_held_pages": None, "pages_per_request": None, "utilisation": None}
