"""``h2o`` (Heavy-Hitter Oracle): keep the tokens with the highest accumulated attention, plus the recent window."""

import torch

from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.policies.base import Policy, RowBlock


class H2OPolicy(Policy):
    name = "h2o"
    needs_scores = True
    state_names = ("h2o_acc",)

    def observe(self, table: TokenTable, rows: torch.Tensor, attn: torch.Tensor, prefill: bool = False) -> None:
        table.add_row_state("h2o_acc", rows, attn)

    def keep_score(self, block: RowBlock) -> torch.Tensor:
        return block.state["h2o_acc"].to(torch.float64)
