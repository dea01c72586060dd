"""``metrics(rt)``: one scheduler's vToken metrics as one flat dict, read by the log lines, ``/get_server_info`` and
Prometheus: the pool's and table's state (one device read), the counters of every part, and the debug counts; and
the device bytes vToken adds beside SGLang's KV pool (``device_bytes``, ``kv_pool_bytes``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vtoken_sglang.integration.observe.hook_timer import TIMER
from vtoken_sglang.integration.observe.host_reads import HOST_READS

if TYPE_CHECKING:
    from vtoken_sglang.core.token_table import TokenTable
    from vtoken_sglang.integration.parts.request_rows import RequestRows
    from vtoken_sglang.integration.runtime import VTokenRuntime


def device_bytes(table: TokenTable, pool, rows: RequestRows) -> int:
    """Device memory vToken allocates beside SGLang's pools: the Token Table's per-slot and per-row metadata, the
    page pool's per-page arrays, the rows' position offsets. (The row store is SGLang's ``req_to_token``.)"""
    return table.metadata_bytes() + pool.metadata_bytes() + rows.device_bytes()


def kv_pool_bytes(kv_pool) -> int:
    """Bytes of SGLang's K/V pool (its own count: K and V, scale buffers included)."""
    size = kv_pool.get_kv_size_bytes()
    return int(sum(size)) if isinstance(size, tuple) else int(size)


def metrics(rt: VTokenRuntime) -> dict:
    """The metrics of the runtime ``rt``, each named once here."""
    pool, table = rt.pool, rt.table
    table.settle()
    active = table.active
    # one read: managed rows, their live tokens, the shared entries among them, private pages, their live tokens
    rows, live, shared, *occupancy = torch.cat(
        [
            torch.stack([active.sum(), torch.where(active, table.live_len, 0).sum(), table.states.shared_entries()]),
            pool.private_occupancy(),
        ]
    ).tolist()
    assert rt.rows.n_managed == rows, "managed-row count out of step with the Token Table"
    return {
        "live_tokens": live,
        "allocated_pages": pool.used_pages(),
        "fragmentation": round(pool.fragmentation(occupancy), 4),
        "hook_ms": round(TIMER.ms, 3),
        "requests_managed": rt.rows.requests_managed,
        "resident_dead_tokens": pool.used_pages() * rt.page_size - occupancy[1],
        "pending_pages": rt.reclaimer.pending_pages(),
        "reserved_pages": pool.reserved_pages(),
        "vtoken_device_bytes": rt.device_bytes,
        "state_shared_entries": shared,
        "state_capacity": table.states.capacity,
        "state_compactions": table.states.compactions,
        "kv_pool_bytes": rt.kv_pool_bytes,
        "admission_reopened": rt.admission.reopened,
        **rt.stats.as_dict(with_tree=rt.tree is not None),
        **(rt.scores.metrics() if rt.scores is not None else {}),
        **rt.reclaimer.stats.as_dict(),
        **rt.plans.metrics(),
        **HOST_READS.metrics(),
        **(rt.cow.metrics() if rt.cow is not None else {}),
    }
