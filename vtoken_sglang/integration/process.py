"""This scheduler process's vToken objects, and the one way hooks reach them: ``current()`` (the runtime) and
``current_scorer()`` (the score collector, built before the model, whose attention hook fills it while SGLang
captures CUDA graphs, and before the runtime). One scheduler per process; in processes that are not vToken
schedulers both stay None and hooks take upstream's path."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vtoken_sglang.integration.runtime import VTokenRuntime
    from vtoken_sglang.scoring import ScoreCollector


class _Process:
    """What one scheduler process holds: its score collector (built before the model) and its runtime."""

    scorer: ScoreCollector | None = None
    runtime: VTokenRuntime | None = None


_PROCESS = _Process()


def current() -> VTokenRuntime | None:
    """This process's runtime: None before its scheduler is built."""
    return _PROCESS.runtime


def current_scorer() -> ScoreCollector | None:
    """This process's score collector (score policies), from before the model is built on."""
    return _PROCESS.scorer


def install(scorer: ScoreCollector | None = None, runtime: VTokenRuntime | None = None) -> None:
    """Set what ``current_scorer`` and ``current`` return (the scheduler's init hook, in two steps)."""
    if scorer is not None:
        _PROCESS.scorer = scorer
    if runtime is not None:
        _PROCESS.runtime = runtime
