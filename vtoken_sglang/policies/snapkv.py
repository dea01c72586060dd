"""``snapkv``: at prefill, score prompt tokens by the attention of the last ``window`` prompt queries, max-pooled
over ``pool`` neighbouring positions; keep the highest. Generated tokens are never evicted before prompt tokens."""

import torch

from vtoken_sglang.core.token_table import TokenTable
from vtoken_sglang.option_values import parse_int
from vtoken_sglang.policies.base import Policy, PolicyOption, RowBlock


def _odd(width: int) -> str:
    return "" if width % 2 else "the pooling width must be odd (centred on each position)"


class SnapKVPolicy(Policy):
    name = "snapkv"
    needs_scores = True
    scored_at = "prefill"
    state_names = ("snap",)
    options = (  # the engine collects the window's queries (for any policy scored at prefill)
        PolicyOption(
            "window", 32, "Observation window: the last prompt queries whose attention ranks the prompt.", parse_int(1)
        ),
        PolicyOption("pool", 7, "Max-pooling width over neighbouring positions (odd).", parse_int(1), _odd),
    )

    def observe(self, table: TokenTable, rows: torch.Tensor, attn: torch.Tensor, prefill: bool = False) -> None:
        """At prefill, ``attn`` is ``[k, width]`` = attention summed over the observation window's queries."""
        if not prefill:
            return
        k = self.cfg.options["pool"]
        pooled = torch.nn.functional.max_pool1d(attn[:, None, :].to(torch.float32), k, stride=1, padding=k // 2)[
            :, 0, : attn.shape[1]
        ]
        table.set_row_state("snap", rows, pooled + 1.0)  # +1: scored prompt tokens rank above unscored 0

    def keep_score(self, block: RowBlock) -> torch.Tensor:
        # unscored (generated) tokens rank above every prompt token but below protected ones (which the driver sets
        # to inf), so they go only once no scored candidate is left
        prompt_scored = block.state["snap"] > 0
        top = torch.finfo(torch.float64).max
        return torch.where(
            prompt_scored,
            block.state["snap"].to(torch.float64),
            torch.full_like(block.state["snap"], top, dtype=torch.float64),
        )
