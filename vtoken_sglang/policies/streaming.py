"""``streaming`` (StreamingLLM): keep the attention sinks and the most recent tokens; evict the oldest others."""

import torch

from vtoken_sglang.policies.base import Policy, RowBlock


class StreamingPolicy(Policy):
    name = "streaming"
    frees_whole_pages = True  # victims are the oldest non-sink tokens: pages behind the sinks empty in order

    def keep_score(self, block: RowBlock) -> torch.Tensor:
        return block.logical.to(torch.float64)  # older = lower = evicted first
