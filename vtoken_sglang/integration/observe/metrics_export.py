"""vToken's metrics where SGLang users look for metrics: the periodic decode log line and Prometheus ``/metrics``.

SGLang runs prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher before the
schedulers start): series created in a scheduler process appear in the HTTP server's ``/metrics``. Names are
``sglang:vtoken_<name>`` with the scheduler's own labels (model name, tp/pp rank, ...). Levels are gauges
(``mostrecent`` across processes, like SGLang's own); running totals are counters (``..._total``), advanced by the
difference since the last export so they stay monotonic.
"""

from __future__ import annotations

from typing import Any

GAUGES = ("live_tokens", "resident_dead_tokens", "allocated_pages", "fragmentation", "pending_pages")
COUNTERS = (
    "pages_reclaimed",
    "tokens_moved",
    "tokens_evicted",
    "plans_admitted",
    "plans_rejected",
    "plans_stale",
    "planner_ms",
    "copy_ms",
    "scoring_ms",
    "cow_copies",
    "cow_tokens_copied",
    "cow_pages_released",
    "cow_room_pages",
    "cow_deferred",
)
DOC = {
    "live_tokens": "Live tokens of requests vToken manages.",
    "resident_dead_tokens": "Evicted tokens still occupying slots of pages vToken tracks.",
    "allocated_pages": "KV pages held by requests vToken manages.",
    "fragmentation": "Intra-page waste F: dead slots / allocated slots of tracked pages.",
    "pending_pages": "Relocation source pages copied out and not freed yet (freed one round after their copy).",
    "pages_reclaimed": "Pages freed by relocation.",
    "tokens_moved": "Live tokens relocated by compaction.",
    "tokens_evicted": "Tokens evicted by the policy.",
    "plans_admitted": "Relocation plans applied.",
    "plans_rejected": "Relocation plans dropped (overlap or changed sources).",
    "plans_stale": "Relocation plans dropped for a stale epoch.",
    "planner_ms": "Milliseconds spent planning relocation.",
    "copy_ms": "Milliseconds spent issuing KV copies.",
    "scoring_ms": "Milliseconds spent computing attention scores (score-based policies; 0 otherwise).",
    "cow_copies": "Copy-on-write decisions: requests that copied their live prefix tokens out of radix-tree pages.",
    "cow_tokens_copied": "Live prefix tokens copied out of radix-tree pages.",
    "cow_pages_released": "Radix-tree pages left without any lock by copy-on-write (the tree may evict them).",
    "cow_room_pages": "Pages of unlocked radix-tree nodes evicted to make room for copy-on-write copies.",
    "cow_deferred": "Copy-on-write releases left for a later check: their new pages were not free.",
}


def log_line(m: dict[str, Any]) -> str:
    """One compact line of the metrics SGLang's decode log line is read beside."""
    return (
        f"[vtoken] live: {m['live_tokens']}, dead: {m['resident_dead_tokens']}, pages: {m['allocated_pages']}, "
        f"F: {m['fragmentation']:.3f}, evicted: {m['tokens_evicted']}, reclaimed pages: {m['pages_reclaimed']}, "
        f"moved: {m['tokens_moved']}, plans admitted/rejected/stale: {m['plans_admitted']}/{m['plans_rejected']}/"
        f"{m['plans_stale']}, planner: {m['planner_ms']:.1f} ms, copy: {m['copy_ms']:.1f} ms"
    )


class PrometheusExporter:
    """Gauges and counters for one scheduler process. Create it only when SGLang's metrics are enabled (after
    ``PROMETHEUS_MULTIPROC_DIR`` is set)."""

    def __init__(self, labels: dict[str, Any]):
        from prometheus_client import Counter, Gauge

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        self.gauges = {
            n: Gauge(f"sglang:vtoken_{n}", DOC[n], labelnames=names, multiprocess_mode="mostrecent") for n in GAUGES
        }
        self.counters = {n: Counter(f"sglang:vtoken_{n}", DOC[n], labelnames=names) for n in COUNTERS}
        self.last = {n: 0.0 for n in COUNTERS}
        for metric in (*self.gauges.values(), *self.counters.values()):
            metric.labels(**self.labels)  # every series exists from the first export, at 0

    def update(self, m: dict[str, Any]) -> None:
        for n, g in self.gauges.items():
            g.labels(**self.labels).set(float(m[n]))
        for n, c in self.counters.items():
            delta = float(m.get(n, 0.0)) - self.last[n]
            if delta > 0:
                c.labels(**self.labels).inc(delta)
                self.last[n] = float(m[n])
