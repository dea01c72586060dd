"""How vToken's options enter SGLang: CLI flags, ``sgl.Engine`` keyword arguments, and checks against SGLang's args.

Flow (the only hooks that exist when vToken is off; they pass SGLang's own arguments through untouched):
- ``ServerArgs.add_cli_args`` (after): adds ``--enable-vtoken`` and ``--vtoken-*`` to the parser (string-typed, so a
  bad value is reported by us in one line instead of argparse's multi-page usage).
- ``ServerArgs.from_cli_args`` (around): takes those values off the Namespace, validates them and the combination
  with SGLang's flags, and exits with one ``error: ...`` line on a problem.
- ``Engine.__init__`` (around): pops ``enable_vtoken`` / ``vtoken_*`` keyword arguments before ``ServerArgs(**kw)``.
- ``Engine._launch_subprocesses`` (around): attaches the config to ``server_args._vtoken_config`` and exports it in
  ``$VTOKEN_SGLANG_CONFIG`` so that every spawned process (scheduler, detokenizer) sees it at plugin load; a
  scheduler's refusal of the model becomes one line.
The combinations refused are ``sglang_checks.check_sglang_args``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from vtoken_sglang.config import (
    ENV_VAR,
    OPTION_BY_NAME,
    OPTIONS,
    ConfigError,
    VTokenConfig,
    kwarg_display,
)
from vtoken_sglang.integration.startup import model_support
from vtoken_sglang.integration.startup.sglang_checks import check_sglang_args

CONFIG_ATTR = "_vtoken_config"  # bookkeeping attribute on ServerArgs (pickled into child processes)

_pending_engine_config: VTokenConfig | None = None
_pending_engine_error: ConfigError | None = None


def cli_display(name: str) -> str:
    return OPTION_BY_NAME[name].flag if name in OPTION_BY_NAME else "--" + name.replace("_", "-")


def exit_with_error(err: Exception) -> None:
    """The CLI's answer to bad input: one line on stderr, exit status 2, no traceback."""
    print(f"error: {err}", file=sys.stderr)
    raise SystemExit(2)


# --------------------------------------------------------------------------------------------- CLI


def add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    """AFTER ``ServerArgs.add_cli_args``: add vToken's flags to SGLang's parser."""
    group = parser.add_argument_group("vToken (token-level KV reclaim)")
    for opt in OPTIONS:
        if opt.is_switch:
            group.add_argument(opt.flag, dest=opt.name, action="store_true", default=False, help=opt.help)
        else:
            group.add_argument(
                opt.flag, dest=opt.name, type=str, default=None, metavar=opt.name.split("_")[-1].upper(), help=opt.help
            )


def from_cli_args(original, cls, args: argparse.Namespace, *rest, **kwargs):
    """AROUND ``ServerArgs.from_cli_args``: build the ServerArgs, then validate and attach vToken's config."""
    raw = {opt.name: getattr(args, opt.name) for opt in OPTIONS if getattr(args, opt.name, None) is not None}
    try:
        cfg = config_from_user(raw, cli_display)
    except ConfigError as err:
        exit_with_error(err)
    if cfg.enabled:  # refuse before SGLang resolves (and logs about) a combination vToken cannot serve
        try:
            check_sglang_args(argparse.Namespace(**vars(args)), cfg, cli_display, log=False)
        except ConfigError as err:
            exit_with_error(err)
    server_args = original(cls, args, *rest, **kwargs)
    try:
        attach(server_args, cfg, cli_display)
    except ConfigError as err:
        exit_with_error(err)
    return server_args


def config_from_user(raw: dict[str, Any], display) -> VTokenConfig:
    """Validate user values; options other than ``enable_vtoken`` are an error while vToken is off."""
    if not raw.get("enable_vtoken", False):
        given = [name for name in raw if name != "enable_vtoken"]
        if given:
            raise ConfigError(f"{display(given[0])} has no effect without {display('enable_vtoken')}")
    return VTokenConfig.build(raw, display)


# --------------------------------------------------------------------------------------------- sgl.Engine


def pop_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove vToken's keyword arguments from an ``Engine(**kwargs)`` dict (in place) and return them."""
    return {name: kwargs.pop(name) for name in list(kwargs) if name in OPTION_BY_NAME}


def stage_engine_config(raw: dict[str, Any], defer_errors: bool = False) -> None:
    """Validate ``sgl.Engine`` keyword arguments (a ``ConfigError``, a ValueError, names the keyword) and keep them
    for launch. ``defer_errors``: keep the error and raise it from the launch hook instead (used while SGLang's
    ``load_plugins`` is on the stack, which would log and swallow it)."""
    global _pending_engine_config, _pending_engine_error
    try:
        _pending_engine_config = config_from_user(raw, kwarg_display)
    except ConfigError as err:
        if not defer_errors:
            raise
        _pending_engine_error = err


_CHECKED_FIELDS = {
    "page_size": None,
    "speculative_algorithm": None,
    "enable_hierarchical_cache": False,
    "enable_unified_memory": False,
    "disaggregation_mode": "null",
    "attention_backend": None,
    "decode_attention_backend": None,
    "prefill_attention_backend": None,
    "device": None,
    "disable_cuda_graph": False,
    "cuda_graph_backend_decode": None,
    "disable_decode_cuda_graph": False,
    "enable_mixed_chunk": False,
    "enable_dp_attention": False,
    "attn_dp_size": None,
    "disable_radix_cache": False,
}


def engine_init(original, self, *args, **kwargs):
    """AROUND ``Engine.__init__``: vToken keywords never reach ``ServerArgs(**kwargs)``; a bad combination with
    SGLang's keywords fails here, before SGLang starts anything (the launch hook checks the full record again)."""
    stage_engine_config(pop_engine_kwargs(kwargs))
    if _pending_engine_config is not None and _pending_engine_config.enabled and "server_args" not in kwargs:
        probe = argparse.Namespace(**{name: kwargs.get(name, default) for name, default in _CHECKED_FIELDS.items()})
        check_sglang_args(probe, _pending_engine_config, kwarg_display)
    return original(self, *args, **kwargs)


def launch_subprocesses(original, cls, *args, **kwargs):
    """AROUND ``Engine._launch_subprocesses``: the last moment before children spawn (and, for ``sgl.Engine``,
    before ``resolve_once`` seals the record): attach and export the config; then launch, and if a scheduler
    refused the model while building it (``model_support.refuse``), say so in one line: the CLI exits with it,
    ``sgl.Engine`` raises it as a ``ConfigError``."""
    server_args = kwargs["server_args"] if "server_args" in kwargs else args[0]
    engine = _pending_engine_config is not None
    _attach_before_launch(server_args)
    if not current_config(server_args).enabled:
        return original(cls, *args, **kwargs)
    with model_support.refusals() as refused:
        try:
            return original(cls, *args, **kwargs)
        except Exception:
            reason = refused()
            if reason is None:
                raise
    if engine:
        raise ConfigError(reason)
    exit_with_error(ConfigError(reason))


def _attach_before_launch(server_args: Any) -> None:
    global _pending_engine_config, _pending_engine_error
    pending, _pending_engine_config = _pending_engine_config, None
    error, _pending_engine_error = _pending_engine_error, None
    if error is not None:
        raise error
    if pending is not None:
        attach(server_args, pending, kwarg_display)
    else:
        export(current_config(server_args))
    # The CLI resolved the record already (its model config is memoized on it): refuse an unsupported model here,
    # with one line. sgl.Engine resolves later; its schedulers run the same check before loading weights.
    model_config = getattr(server_args, "_model_config", None)
    if model_config is not None and current_config(server_args).enabled:
        reason = model_support.unsupported_model(model_config)
        if reason:
            exit_with_error(ConfigError(reason))


# --------------------------------------------------------------------------------------------- shared


def current_config(server_args: Any) -> VTokenConfig:
    text = getattr(server_args, CONFIG_ATTR, None)
    return VTokenConfig.from_json(text) if text else VTokenConfig()


def attach(server_args: Any, cfg: VTokenConfig, display) -> None:
    """Check the combination with SGLang's own args, fill vToken's defaults, store and export the config."""
    if cfg.enabled:
        check_sglang_args(server_args, cfg, display)
    setattr(server_args, CONFIG_ATTR, cfg.to_json())
    export(cfg)


def export(cfg: VTokenConfig) -> None:
    if cfg.enabled:
        os.environ[ENV_VAR] = cfg.to_json()
    else:
        os.environ.pop(ENV_VAR, None)
