"""A policy from outside the project, written as a user would: ``--vtoken-policy own_policy:HeavyHitters`` loads it
(``unit/test_policy_plugin`` ranks with it; ``server/test_scoring`` serves it, with ``tests/`` on the server's
PYTHONPATH)."""

import torch

from vtoken_sglang.policies import Policy, RowBlock

SPEC = "own_policy:HeavyHitters"


class HeavyHitters(Policy):
    """H2O written as a user would: accumulated attention, under a state name of its own."""

    name = "heavy-hitters"
    needs_scores = True
    state_names = ("hh",)

    def observe(self, table, rows, attn, prefill=False):
        table.add_row_state("hh", rows, attn)

    def keep_score(self, block: RowBlock) -> torch.Tensor:
        return block.state["hh"]
