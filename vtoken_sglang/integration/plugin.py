"""SGLang plugin entry point (group ``sglang.srt.plugins``): ``register()`` runs in every SGLang process.

What it hooks, and when (every target is listed, with a fingerprint, in ``patches/manifest.json``):
- In the process the user started (launcher, or the program calling ``sgl.Engine``): the option hooks of
  ``options.py``. They are what makes ``--enable-vtoken`` exist; they pass SGLang's own arguments through.
- In spawned SGLang processes: nothing, unless ``$VTOKEN_SGLANG_CONFIG`` (exported by the launcher) enables vToken;
  then the serving hooks. With ``--enable-vtoken`` absent no serving hook is registered: upstream behaviour.
Before registering, the fingerprints of the targets are checked; a drifted upstream symbol disables vToken and,
if vToken was asked for, stops the process with one line naming the symbol.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections.abc import Callable

from vtoken_sglang.config import ENV_VAR, OPTION_BY_NAME, ConfigError, VTokenConfig
from vtoken_sglang.integration.startup import manifest, options

logger = logging.getLogger("vtoken_sglang")

# target -> (hook type name, hook function), per role. Keep in sync with patches/manifest.json (a test checks it).
OPTION_HOOKS: dict[str, tuple[str, Callable]] = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": ("AFTER", options.add_cli_args),
    "sglang.srt.server_args.ServerArgs.from_cli_args": ("AROUND", options.from_cli_args),
    "sglang.srt.entrypoints.engine.Engine.__init__": ("AROUND", options.engine_init),
    "sglang.srt.entrypoints.engine.Engine._launch_subprocesses": ("AROUND", options.launch_subprocesses),
}


def _serving_hooks(cfg: VTokenConfig | None = None) -> dict[str, tuple[str, Callable]]:
    """The scheduler-side hooks for ``cfg`` (all of them when ``cfg`` is None)."""
    from vtoken_sglang.integration.hooks import HOOKS, PREFILL_EVICTION_HOOKS, PREFILL_SCORING_HOOKS, SCORING_HOOKS

    if cfg is None:
        return {**HOOKS, **SCORING_HOOKS, **PREFILL_SCORING_HOOKS, **PREFILL_EVICTION_HOOKS}
    hooks = dict(HOOKS)
    if cfg.scoring:
        hooks.update(SCORING_HOOKS)
    if cfg.scoring == "prefill":
        hooks.update(PREFILL_SCORING_HOOKS)
    if cfg.vtoken_prefill_eviction:
        hooks.update(PREFILL_EVICTION_HOOKS)
    return hooks


def _is_user_process() -> bool:
    return multiprocessing.parent_process() is None


def _env_config() -> VTokenConfig:
    text = os.environ.get(ENV_VAR)
    if not text:
        return VTokenConfig()
    try:
        return VTokenConfig.from_json(text)
    except (ConfigError, ValueError) as err:
        raise SystemExit(f"error: ${ENV_VAR} is not a valid vToken configuration: {err}") from None


def _vtoken_requested() -> bool:
    """Whether this process was asked to run vToken (used only to decide how loudly to fail on drift)."""
    if _env_config().enabled:
        return True
    return any(arg == OPTION_BY_NAME["enable_vtoken"].flag for arg in sys.argv) or _inflight_engine_kwargs().get(
        "enable_vtoken", False
    )


def _inflight_engine_kwargs() -> dict:
    """The keyword dict of an ``Engine.__init__`` that is running right now without our hook.

    ``sgl.Engine.__init__`` calls ``load_plugins()`` itself, so the first Engine of a process starts before any
    hook exists; its ``kwargs`` dict is the one it is about to pass to ``ServerArgs(**kwargs)``. Returns ``{}``
    when no such frame is on the stack."""
    engine_mod = sys.modules.get("sglang.srt.entrypoints.engine")
    if engine_mod is None:
        return {}
    code = getattr(getattr(engine_mod.Engine.__init__, "__wrapped__", engine_mod.Engine.__init__), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            kwargs = frame.f_locals.get("kwargs")
            return kwargs if isinstance(kwargs, dict) else {}
        frame = frame.f_back
    return {}


def _register(hooks: dict[str, tuple[str, Callable]]) -> None:
    """Register with SGLang's hook registry; serving hooks are bound to this process's slot (``process.bind``),
    timed (``hook_timer``) and, in that debug mode, have their device-to-host reads counted (``host_reads``);
    option hooks are none of these."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from vtoken_sglang.integration.observe.hook_timer import TIMER
    from vtoken_sglang.integration.observe.host_reads import HOST_READS
    from vtoken_sglang.integration.process import PROCESS, bind

    for target, (kind, fn) in hooks.items():
        if target not in OPTION_HOOKS:
            fn = TIMER.timed(kind, HOST_READS.counted(kind, bind(fn, PROCESS)))
        HookRegistry.register(target, fn, HookType[kind])


def register() -> None:
    """Plugin entry point. Idempotent per process (SGLang's ``load_plugins`` runs it once)."""
    cfg = _env_config()
    hooks: dict[str, tuple[str, Callable]] = {}
    if _is_user_process():
        hooks.update(OPTION_HOOKS)
    if cfg.enabled:
        hooks.update(_serving_hooks(cfg))
    if not hooks:
        return
    try:
        manifest.check(set(hooks))
    except manifest.PatchDriftError as err:
        if _vtoken_requested():
            raise SystemExit(f"error: {err}") from None
        logger.warning("vToken disabled: %s", err)
        return
    _register(hooks)
    if _is_user_process():
        inflight = _inflight_engine_kwargs()
        if inflight:
            options.stage_engine_config(options.pop_engine_kwargs(inflight), defer_errors=True)
