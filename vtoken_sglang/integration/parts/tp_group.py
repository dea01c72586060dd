"""``TpGroup``: what vToken needs of the scheduler's tensor-parallel group: its rank and size, an in-place sum
(attention scores are reduced over the heads of every rank) and a broadcast from rank 0 (compaction plans)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class TpGroup:
    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], None] | None = None  # in-place sum over the group; None with one rank
    broadcast: Callable[[object], object] | None = None  # rank 0's picklable object -> every rank's copy

    @classmethod
    def of_scheduler(cls) -> TpGroup:
        """The TP group of this scheduler process (SGLang's ``get_tp_group``)."""
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return cls(group.rank_in_group, 1)

        def all_reduce(t: torch.Tensor) -> None:
            torch.distributed.all_reduce(t, group=group.cpu_group if t.device.type == "cpu" else group.device_group)

        def broadcast(obj):  # small objects (bytes frames or None) over the CPU (gloo) group
            box = [obj]
            torch.distributed.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
            return box[0]

        return cls(group.rank_in_group, group.world_size, all_reduce, broadcast)
