"""Property tests of the core: random interleavings of new requests, appends, evictions by every policy, reclaim
plans (applied, stale, overlapping), request ends; real K/V tensors; every step checks I1-I4 and page accounting
(including that every live token's K/V bytes are unchanged); at the end every page is free."""

import torch
from core_helpers import MiniEngine, stamp
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vtoken_sglang.core.integrity import check_integrity
from vtoken_sglang.core.pages import OutOfPages
from vtoken_sglang.policies import POLICIES, PolicyConfig, make_policy

STATE_NAMES = ("h2o_acc", "tova_last", "sh_persist", "snap")


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

    @precondition(lambda self: self.live_rows)
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        rows = self._rows(data)
        try:
            self.eng.write(torch.tensor(rows), torch.full((len(rows),), n))
        except OutOfPages:
            pass

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

    @rule()
    def reclaim_step(self):
        self.eng.reclaimer.step()

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

    @invariant()
    def integrity(self):
        check_integrity(self.eng.table, self.eng.kv, stamp)

    def teardown(self):
        """Every run ends with all requests closed and every page free."""
        for row in list(self.live_rows):
            self.eng.close(row)
        self.eng.reclaimer.release_ready(force=True)
        check_integrity(self.eng.table)
        assert len(self.eng.pool.free_ids()) == self.eng.pool.num_pages


TestCore = CoreMachine.TestCase
TestCore.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
