"""``tova`` (Token Omission Via Attention): keep the tokens the newest query attends to most."""

import torch

from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.policies.base import Policy, RowBlock


class TOVAPolicy(Policy):
    name = "tova"
    needs_scores = True
    state_names = ("tova_last",)

    def observe(self, table: TokenTable, rows: torch.Tensor, attn: torch.Tensor, prefill: bool = False) -> None:
        table.set_row_state("tova_last", rows, attn)

    def keep_score(self, block: RowBlock) -> torch.Tensor:
        return block.state["tova_last"].to(torch.float64)
