"""``scissorhands``: keep tokens whose importance persists over a history window.

Each observation marks a token important when its attention is at least the mean over the row's live tokens; the
persistence count decays by ``1 - 1/history`` per observation, so it counts (softly) the important observations
among the last ``history``. Lowest persistence is evicted first.
"""

import torch

from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.option_values import parse_int
from vtoken_sglang.policies.base import Policy, PolicyOption, RowBlock


class ScissorhandsPolicy(Policy):
    name = "scissorhands"
    needs_scores = True
    state_names = ("sh_persist",)
    options = (
        PolicyOption(
            "history", 32, "History window, in scored steps, over which importance must persist.", parse_int(1)
        ),
    )

    def observe(self, table: TokenTable, rows: torch.Tensor, attn: torch.Tensor, prefill: bool = False) -> None:
        width = attn.shape[1]
        valid = table.valid(rows, width)
        mean = (attn * valid).sum(1, keepdim=True) / valid.sum(1, keepdim=True).clamp(min=1)
        hit = ((attn >= mean) & valid).to(torch.float32)
        decay = 1.0 - 1.0 / self.cfg.options["history"]
        table.set_row_state("sh_persist", rows, table.row_state("sh_persist", rows, width) * decay + hit)

    def keep_score(self, block: RowBlock) -> torch.Tensor:
        return block.state["sh_persist"].to(torch.float64)
