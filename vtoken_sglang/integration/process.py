"""A scheduler process's vToken slot, and how hooks are given it.

``SchedulerProcess`` holds what one scheduler process serves with: its score collector (built before the model,
whose attention hook fills it while SGLang captures CUDA graphs) and its runtime (built with the scheduler). SGLang
applies registered hooks once, when plugins load, before any scheduler exists, so a hook cannot be handed its
runtime then: it is handed, as its first argument, the slot its runtime is put in (``bind``), and reads
``vt.runtime``. That is None before the scheduler is built and in processes that are not vToken schedulers; hooks
then take upstream's path. One scheduler per process: the serving hooks are bound to ``PROCESS``
(``plugin._register``); a test may bind them to a slot of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vtoken_sglang.integration.runtime import VTokenRuntime
    from vtoken_sglang.scoring import ScoreCollector


class SchedulerProcess:
    """What one scheduler process serves with: its score collector and its runtime (None until built)."""

    def __init__(self) -> None:
        self.scorer: ScoreCollector | None = None
        self.runtime: VTokenRuntime | None = None
        self.widest_window = 0  # the model's widest sliding window (0: none), seen as SGLang builds its layers
        self.sessions = None  # SGLang's ``StreamingSession`` records (``--enable-streaming-session``), else None
        self.turn_at_door = None  # the KV record of the streaming turn whose new tokens SGLang is bounding


PROCESS = SchedulerProcess()
"""This process's slot: the serving hooks are bound to it when they are registered."""


def bind(hook: Callable, vt: SchedulerProcess) -> Callable:
    """``hook`` with ``vt`` as its first argument, named as ``hook`` (the hook timer and the host-read counter key
    their figures by name)."""
    return functools.update_wrapper(functools.partial(hook, vt), hook)
