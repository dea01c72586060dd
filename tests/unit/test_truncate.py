"""``TokenTable.truncate``: a request rolled back to a logical position (an undone turn's tokens dropped) over rows
that eviction compacted and the reclaimer relocated behind late fences (``tools.kv_engine``, K/V stamped with each
token's request and logical id). After every step the table's live entries must be this test's own account, the
core's integrity check (K/V bytes, page counts, no slot live twice) must hold, and a rolled-back row's next tokens
must take the positions it was rolled back to; at the end every page goes back to the pool."""

import pytest
import torch

from vtoken_sglang.tools.kv_engine import KVEngine

ROWS, STEPS = 6, 36


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rolled_back_rows_take_their_positions_again(seed):
    g = torch.Generator().manual_seed(seed)
    eng = KVEngine(num_pages=160, page_size=4, rows=8, max_context=512, reserve=4, fence_delay=3, fence_seed=seed)
    table, rows = eng.table, torch.arange(ROWS)
    table.open_rows(rows)
    live: list[list[int]] = [[] for _ in rows]  # each row's live logical ids, in order
    rolled_back = 0
    for step in range(STEPS):
        eng.append_live(rows, live, g)  # at each request's next positions: after a rollback, its end
        eng.evict_live(rows, live, g, evict_one_in=4)
        if step % 3 == 2:  # roll some rows back to a position between their first live token and their end
            pick = torch.nonzero(torch.rand(ROWS, generator=g) < 0.5).flatten()
            ends, before = [], table.logical_len[pick].clone()
            for i in pick.tolist():
                lo, hi = live[i][0] + 1, int(table.logical_len[i])
                ends.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
                live[i] = [x for x in live[i] if x < ends[-1]]
            eng.truncate(pick, torch.tensor(ends, dtype=torch.int64))
            assert table.logical_len[pick].tolist() == ends
            rolled_back += int((table.logical_len[pick] < before).sum())
        eng.reclaimer.step()
        eng.check()
        width = max(len(ids) for ids in live)
        got = table.row_logical(rows, width).tolist()
        assert table.live_len[rows].tolist() == [len(ids) for ids in live]
        assert [g_row[: len(ids)] for g_row, ids in zip(got, live)] == live, f"step {step}"
    eng.reclaimer.release_ready(force=True)
    eng.check()
    st = eng.reclaimer.stats
    assert rolled_back > 0 and st.tokens_moved > 0 and st.release_waits > 0, "nothing rolled back or relocated late"
    for row in rows.tolist():
        eng.close(row)
    eng.reclaimer.release_ready(force=True)
    assert eng.pool.used_pages() == 0, "a rolled-back row's pages were not all returned"


def test_truncate_refuses_to_empty_a_row_or_pass_its_end():
    eng = KVEngine(num_pages=16, page_size=4, rows=2, max_context=64)
    rows = torch.tensor([0])
    eng.table.open_rows(rows)
    eng.write(rows, torch.tensor([6]))
    with pytest.raises(AssertionError, match="past"):
        eng.table.truncate(rows, torch.tensor([7]))
    with pytest.raises(AssertionError, match="at least one"):
        eng.table.truncate(rows, torch.tensor([0]))
    eng.truncate(rows, torch.tensor([6]))  # the end itself: nothing dropped
    assert eng.table.live_len[0] == 6
