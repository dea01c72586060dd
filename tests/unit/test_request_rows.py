"""``RequestRows.over_budget``: the eviction round checks only rows whose logical length reached their due
length, and finds exactly the rows a full check (every row, every round) finds, whatever the policy's budget
(absolute or a ratio), the slack, trims and request ends; a row is checked about twice per trim, not every round,
and a round in which no row of the batch is due looks at none (``skip_check``)."""

import numpy as np
import pytest
import torch

from vtoken_sglang.core.pages import PagePool
from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.integration.parts.request_rows import DUE_HORIZON, RequestRows
from vtoken_sglang.policies import PolicyConfig, make_policy


@pytest.mark.parametrize(
    "cfg", [{"budget": 40}, {"budget_ratio": 0.5}, {"budget_ratio": 0.125}, {"budget_ratio": 0.9, "slack": 0}]
)
def test_due_rows_are_exactly_the_rows_over_budget(cfg):
    policy = make_policy("random", PolicyConfig(sinks=4, recent=8, **{"slack": 16, **cfg}))
    table = TokenTable(16, 64, PagePool(8, 16))
    rows = RequestRows(table, table.pages)
    rng = np.random.default_rng(0)
    host_rows = np.array([3, 7, 1, 12, 5, 9])
    live = rng.integers(1, 200, size=len(host_rows))
    rows.host_offset[host_rows] = rng.integers(0, 50, size=len(host_rows))
    rows.n_managed = len(host_rows)  # rows with a position offset are managed ones
    checked, found, ends, skipped = 0, 0, 0, 0
    for _ in range(400):
        logical = live + rows.host_offset[host_rows]
        expected = np.flatnonzero(live > policy.budget(torch.from_numpy(logical)).numpy() + policy.cfg.slack)
        if rows.skip_check():  # the round skips every row: none may be over
            got = np.empty(0, dtype=np.int64)
            skipped += 1
        else:
            checked += int((logical >= rows.host_due[host_rows]).sum())
            got = rows.over_budget(rows.layout(host_rows, live), policy)
        assert got.tolist() == expected.tolist()
        found += len(got)
        for i in got:  # trimmed to its budget: the offset takes what left the live count
            keep = int(policy.budget(torch.tensor([logical[i]]))[0])
            rows.host_offset[host_rows[i]] += live[i] - keep
            live[i] = keep
        if rng.random() < 0.05:  # a request ends; another takes its row with a fresh prompt
            i = rng.integers(len(host_rows))
            rows.forget(int(host_rows[i]))
            rows.recheck()  # the new request joins the batch after its prefill
            ends += 1
            live[i], rows.host_offset[host_rows[i]] = rng.integers(1, 200), 0
        live += 1  # a decode step: one token more, live and logical
    assert found > 10  # trims happened
    # a row is checked when it runs over, the round after its trim, at a new request, and once per horizon
    if policy.cfg.slack >= 16:  # the server's slack (at least a page): many rounds look at no row
        assert skipped > 100, skipped
    assert checked <= 2 * found + ends + len(host_rows) * (400 // DUE_HORIZON + 1), (checked, found, ends)
