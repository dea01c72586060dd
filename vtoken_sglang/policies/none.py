"""``none``: never evicts (vToken's hooks only; the identity baseline)."""

import torch

from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.policies.base import Policy, RowBlock


class NoEviction(Policy):
    name = "none"

    def keep_score(self, block: RowBlock) -> torch.Tensor:
        return torch.zeros(block.valid.shape)

    def select_victims(self, table: TokenTable, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rows.new_empty(0), rows.new_empty(0)
