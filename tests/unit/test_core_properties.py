"""Property tests of the core: random interleavings of new requests (some reading a shared prefix in tree pages),
appends, decode steps the table registers late (whatever reads it next settles them), evictions by every policy,
reclaim plans (applied, stale, overlapping; every plan the planner makes is valid), copy-on-write of a row's prefix
tokens out of the tree, request ends; real K/V tensors; every step checks I1-I5, page accounting and slot reader
counts (including that every live token's K/V bytes are unchanged), and that every live entry's policy state is
its own request's: random folds (adds and writes) of one state into chosen rows, checked bit for bit against an
account kept here by (request, logical position), through evictions, relocations, copy-on-write and other rows'
folds on the same tree slots; at the end every page is free. The table's metadata is sized by the pool (and by
what is live), whatever its rows and context."""

import numpy as np
import pytest
import torch
from core_helpers import MiniEngine, stamp
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vtoken_sglang.core.integrity import check_integrity
from vtoken_sglang.core.pages import FREE, TREE, OutOfPages
from vtoken_sglang.policies import POLICIES, PolicyConfig, make_policy

STATE_NAMES = ("h2o_acc", "tova_last", "sh_persist", "snap", "own")  # "own": folded only by ``fold`` below
TREE_PAGES, TREE_ROW = 5, 99  # a shared prefix of 5 pages in the tree; its K/V bytes are stamped as row 99's


class CoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.eng = MiniEngine(
            num_pages=160,
            page_size=4,
            rows=8,
            max_context=512,
            reserve=4,
            theta=0.0,
            state_names=STATE_NAMES,
            grace_steps=1,
        )
        self.free_rows = list(range(8))
        self.live_rows: list[int] = []
        self.seed = 0
        P = self.eng.table.page_size
        tree = self.eng.pool.alloc(TREE_PAGES, TREE)
        self.tree_slots = (tree[:, None] * P + torch.arange(P)).flatten()
        for buf in self.eng.kv:
            buf[self.tree_slots] = stamp(torch.full_like(self.tree_slots, TREE_ROW), torch.arange(len(self.tree_slots)))
        self.tree_len = torch.zeros(8, dtype=torch.int64)  # tokens of the shared prefix each row started with
        self.own: dict[tuple[int, int], np.float32] = {}  # (row, logical) -> its "own" state; absent: 0

    def kv_stamp(self, rows: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        """The bytes of (row, logical): the tree's for a row's shared prefix tokens (copied or not)."""
        shared = logical < self.tree_len[rows]
        return stamp(torch.where(shared, TREE_ROW, rows), logical)

    def _rows(self, data, k=None):
        return sorted(
            data.draw(
                st.lists(st.sampled_from(self.live_rows), min_size=1, max_size=k or len(self.live_rows), unique=True)
            )
        )

    @rule(prompt=st.integers(1, 60))
    def new_request(self, prompt):
        if not self.free_rows:
            return
        row = self.free_rows.pop(0)
        self.eng.table.open_rows(torch.tensor([row]))
        try:
            self.eng.write(torch.tensor([row]), torch.tensor([prompt]))
        except OutOfPages:
            self.eng.close(row)
            self.free_rows.insert(0, row)
            return
        self.live_rows.append(row)

    @rule(prefix_pages=st.integers(1, TREE_PAGES), partial=st.integers(0, 3), own=st.integers(1, 20))
    def new_request_on_the_shared_prefix(self, prefix_pages, partial, own):
        """A request that starts with the tree's prefix (whole pages, and maybe part of the next, as SGLang's radix
        cache matches), then writes tokens of its own."""
        if not self.free_rows:
            return
        row = self.free_rows.pop(0)
        n = prefix_pages * self.eng.table.page_size + (partial if prefix_pages < TREE_PAGES else 0)
        t, r = self.eng.table, torch.tensor([row])
        t.open_rows(r, shared=np.array([n]))
        t.sync_new_tokens(r, torch.tensor([n]), self.tree_slots[:n])
        self.tree_len[row] = n
        self.live_rows.append(row)
        try:
            self.eng.write(r, torch.tensor([own]))
        except OutOfPages:
            pass

    @precondition(lambda self: bool((self.tree_len > 0).any()))
    @rule(data=st.data())
    def copy_on_write(self, data):
        """A row copies its live tokens that are still in tree pages into private pages of its own."""
        t, P = self.eng.table, self.eng.table.page_size
        row = data.draw(st.sampled_from([r for r in self.live_rows if self.tree_len[r] > 0] or [None]))
        if row is None:
            return
        n = int(t.live_len[row])
        cols = torch.nonzero(self.eng.pool.owner[t.slots[row, :n].to(torch.int64) // P] == TREE).flatten()
        if cols.numel() == 0:
            return
        try:
            pages = self.eng.pool.alloc((len(cols) + P - 1) // P, row, for_relocation=True)
        except OutOfPages:
            return
        dst = (pages[:, None] * P + torch.arange(P)).flatten()[: len(cols)]
        src = t.slots[row, cols].to(torch.int64)
        for buf in self.eng.kv:
            buf[dst] = buf[src]
        t.apply_moves(torch.full_like(cols, row), cols, dst)

    @precondition(lambda self: self.live_rows)
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        rows = self._rows(data)
        try:
            self.eng.write(torch.tensor(rows), torch.full((len(rows),), n))
        except OutOfPages:
            pass

    @precondition(lambda self: self.live_rows)
    @rule(data=st.data(), steps=st.integers(1, 6))
    def decode_registered_late(self, data, steps):
        """SGLang's decode steps: the engine writes each row's next slot into the row store (the rest of its own
        tail page, else a page the pool does not track yet) and the table defers registering it; the next rule
        reads the table with those tokens pending (the invariant below waits until something settled them)."""
        t, P = self.eng.table, self.eng.table.page_size
        rows = self._rows(data)
        for _ in range(steps):
            for row in rows:
                n = int(t._live_len[row]) + int(t._deferred[row])  # the engine's own length (its seq_len)
                if n == 0 or n >= t.max_context:
                    return
                last = int(t.slots[row, n - 1])
                if (last + 1) % P and int(self.eng.pool.owner[last // P]) == row:
                    slot = last + 1
                else:
                    try:
                        slot = int(self.eng.pool.alloc(1, FREE)[0]) * P
                    except OutOfPages:
                        return
                t.slots[row, n] = slot
                logical = int(t._logical_len[row]) + int(t._deferred[row])
                for buf in self.eng.kv:
                    buf[slot] = stamp(torch.tensor([row]), torch.tensor([logical]))[0]
                t.defer_decode_tokens(np.array([row]))

    @precondition(lambda self: self.live_rows)
    @rule(
        data=st.data(),
        policy=st.sampled_from(sorted(POLICIES)),
        ratio=st.sampled_from([0.3, 0.5, 0.8]),
        recent=st.integers(1, 6),
        sinks=st.integers(0, 3),
    )
    def evict(self, data, policy, ratio, recent, sinks):
        rows = torch.tensor(self._rows(data))
        pol = make_policy(policy, PolicyConfig(budget_ratio=ratio, sinks=sinks, recent=recent, slack=0, seed=self.seed))
        self.seed += 1
        if pol.needs_scores:
            width = int(self.eng.table.live_len[rows].max())
            attn = torch.softmax(torch.randn(len(rows), width, generator=torch.Generator().manual_seed(self.seed)), 1)
            pol.observe(self.eng.table, rows, attn, prefill=policy == "snapkv")
        vr, vc = pol.select_victims(self.eng.table, rows)
        self.eng.evict(vr, vc)

    @precondition(lambda self: self.live_rows)
    @rule(data=st.data(), add=st.booleans(), seed=st.integers(0, 2**16))
    def fold(self, data, add, seed):
        """Fold random values into the "own" state of some rows (``add_row_state`` or ``set_row_state``): each
        row's entries change, no other row's, a tree slot's other readers' neither."""
        t = self.eng.table
        rows = torch.tensor(self._rows(data))
        width = int(t.live_len[rows].max())
        values = torch.randn(len(rows), width, generator=torch.Generator().manual_seed(seed))
        (t.add_row_state if add else t.set_row_state)("own", rows, values)
        logical = t.row_logical(rows, width)
        for i, row in enumerate(rows.tolist()):
            for j in range(int(t.live_len[row])):
                key, v = (row, int(logical[i, j])), np.float32(values[i, j])
                self.own[key] = (self.own.get(key, np.float32(0)) + v) if add else v

    @invariant()
    def each_entry_keeps_its_own_state(self):
        t = self.eng.table
        if t.deferred_tokens or not self.live_rows:
            return
        rows = torch.tensor(self.live_rows)
        width = max(int(t.live_len[rows].max()), 1)
        got, logical = t.row_state("own", rows, width), t.row_logical(rows, width)
        for i, row in enumerate(self.live_rows):
            n = int(t.live_len[row])
            want = [self.own.get((row, int(lg)), np.float32(0)) for lg in logical[i, :n]]
            assert np.array_equal(got[i, :n].numpy(), np.array(want, dtype=np.float32)), (row, got[i, :n], want)

    @rule()
    def reclaim_step(self):
        rec = self.eng.reclaimer
        plan = rec.plan()
        assert plan.is_empty() or rec.validate(plan) is None  # what the step applies unchecked: a valid plan
        rec.step()

    @precondition(lambda self: self.live_rows)
    @rule()
    def stale_and_overlapping_plans_are_dropped(self):
        rec = self.eng.reclaimer
        plan = rec.plan()
        if plan.is_empty():
            return
        rec.epoch += 1  # the world moved on: the plan is now behind
        before = rec.stats.plans_stale
        assert not rec.apply(plan) and rec.stats.plans_stale == before + 1
        fresh = rec.plan()
        if not fresh.is_empty():
            assert rec.apply(fresh)
            assert not rec.apply(fresh)  # same sources again: overlaps the pages now in flight / changed

    @precondition(lambda self: self.live_rows)
    @rule(data=st.data())
    def end_request(self, data):
        row = data.draw(st.sampled_from(self.live_rows))
        self.eng.close(row)
        self.live_rows.remove(row)
        self.free_rows.append(row)
        self.tree_len[row] = 0
        self.own = {key: v for key, v in self.own.items() if key[0] != row}

    @invariant()
    def integrity(self):
        if self.eng.table.deferred_tokens:  # the next rule's reads must settle them (checked after it)
            return
        check_integrity(self.eng.table, self.eng.kv, self.kv_stamp)

    def teardown(self):
        """Every run ends with all requests closed and every page free."""
        for row in list(self.live_rows):
            self.eng.close(row)
        self.eng.reclaimer.release_ready(force=True)
        check_integrity(self.eng.table)
        assert int(self.eng.table.readers.sum()) == 0
        self.eng.pool.free(torch.unique(self.tree_slots // self.eng.table.page_size))
        assert len(self.eng.pool.free_ids()) == self.eng.pool.num_pages


TestCore = CoreMachine.TestCase
TestCore.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("rows, context", [(8, 512), (64, 8192), (512, 131072)])
def test_metadata_is_bounded_by_the_pool(rows, context):
    """The table's own metadata (every policy's state included) depends on the pool, not on rows x context: the
    row store it is given (SGLang's req_to_token) is the engine's. Policy state has a cell per slot and as many
    again for the shared prefixes requests read (``StateStore``: grown only by what is live)."""
    from vtoken_sglang.core.pages import PagePool
    from vtoken_sglang.core.token_table import TokenTable

    pool = PagePool(1000, 16, device="meta")
    store = torch.empty(rows, context, dtype=torch.int32, device="meta")
    table = TokenTable(rows, context, pool, slots=store, state_names=STATE_NAMES)
    per_slot = 4 + 4 + 2 * 4 * len(STATE_NAMES)  # logical, readers; per state a float32 per slot and per shared cell
    per_row = 8 + 8 + 1 + 8 + 8 + 8  # live_len, logical_len, active, row_key, n_shared, shared base
    assert table.metadata_bytes() == (1000 + 1) * 16 * per_slot + rows * per_row
