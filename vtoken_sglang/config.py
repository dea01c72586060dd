"""vToken's user-facing options: one table, used by the CLI (``--vtoken-*``), ``sgl.Engine(vtoken_*=...)`` and tests.

Engine-agnostic: no ``sglang`` import. ``VTokenConfig`` is frozen and always valid (``VTokenConfig.build`` is the
only constructor that accepts user input); an invalid value or combination raises ``ConfigError`` whose message
is one line that names the flag.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

POLICIES = ("none", "streaming", "random", "h2o", "scissorhands", "tova", "snapkv")
SCORE_POLICIES = ("h2o", "scissorhands", "tova", "snapkv")  # need attention scores collected by the engine
DECODE_SCORE_POLICIES = ("h2o", "scissorhands", "tova")  # scored at decode steps (snapkv: once, at prefill)
PLANNERS = ("worker", "inline")
ENV_VAR = "VTOKEN_SGLANG_CONFIG"


class ConfigError(ValueError):
    """An invalid vToken option or combination; ``str(err)`` is the one line shown to the user."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One user-facing option: field name, CLI help, default, and a parser from the raw (str or typed) value."""

    name: str
    default: Any
    help: str
    parse: Callable[[Any], Any]
    is_switch: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _parse_int(lo: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        try:
            out = int(value, 10) if isinstance(value, str) else int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected an integer, got {value!r}") from None
        if isinstance(value, float) and value != out:
            raise ValueError(f"expected an integer, got {value!r}")
        if out < lo:
            raise ValueError(f"must be >= {lo}, got {out}")
        return out

    return parse


def _parse_float(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
        if not (lo < out if lo_open else lo <= out) or out > hi:
            raise ValueError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {out}")
        return out

    return parse


def _parse_choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}; got {value!r}")
        return value

    return parse


def _parse_on_off(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("on", "off"):
        return value.lower() == "on"
    raise ValueError(f"expected on or off, got {value!r}")


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"expected True or False, got {value!r}")


def _parse_layers(value: Any) -> str:
    """``all``, or layer indices (negative counts from the last) as a comma list; normalized to a string."""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected all or a comma-separated list of layer indices, got {value!r}")
    if value.strip() == "all":
        return "all"
    try:
        layers = [int(v, 10) for v in value.split(",")]
    except ValueError:
        raise ValueError(f"expected all or a comma-separated list of layer indices, got {value!r}") from None
    if len(set(layers)) != len(layers):
        raise ValueError(f"layer listed twice in {value!r}")
    return ",".join(str(v) for v in layers)


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else parse(value)


OPTIONS: tuple[Option, ...] = (
    Option("enable_vtoken", False, "Enable vToken: token-level KV eviction whose freed slots return to the page pool.", _parse_bool, is_switch=True),
    Option("vtoken_policy", "none", f"Eviction policy: {', '.join(POLICIES)}. Default: none (hooks only, no eviction).", _parse_choice(POLICIES)),
    Option("vtoken_budget", None, "Tokens of KV kept per request (absolute). Exclusive with --vtoken-budget-ratio.", _optional(_parse_int(1))),
    Option("vtoken_budget_ratio", None, "Fraction of each request's tokens kept, in (0, 1]. Exclusive with --vtoken-budget.", _optional(_parse_float(0.0, 1.0, lo_open=True))),
    Option("vtoken_recent", 64, "Most recent tokens always kept (recent window). Default: 64.", _parse_int(0)),
    Option("vtoken_sinks", 4, "First tokens always kept (attention sinks). Default: 4.", _parse_int(0)),
    Option("vtoken_reclaim", True, "on: compact live tokens and free pages (vToken); off: Naive-Evict (same victims, no relocation). Default: on.", _parse_on_off),
    Option("vtoken_theta", 0.05, "Fragmentation F above which reclaim is planned, in [0, 1]. Default: 0.05 (the paper: 0.25).", _parse_float(0.0, 1.0)),
    Option("vtoken_planner", "inline", "Where reclaim plans are made: worker (a ZMQ compaction process) or inline. Default: inline.", _parse_choice(PLANNERS)),
    Option("vtoken_seed", 0, "Seed of the random policy (identical on every TP rank). Default: 0.", _parse_int(0)),
    Option("vtoken_score_layers", "all", "Layers whose attention feeds score-based policies: all, or indices like 0,-1. Default: all.", _parse_layers),
    Option("vtoken_score_every", 1, "Collect attention scores every k decode steps (h2o, tova, scissorhands). Default: 1.", _parse_int(1)),
    Option("vtoken_history", 32, "scissorhands: history window, in scored steps, over which importance must persist. Default: 32.", _parse_int(1)),
    Option("vtoken_window", 32, "snapkv: observation window, the last prompt queries whose attention ranks the prompt. Default: 32.", _parse_int(1)),
    Option("vtoken_cow", True, "Copy-on-write of radix-tree prefix pages: a request copies its live prefix tokens to private pages and unlocks the tree's when that frees pages (on), or keeps them locked until it ends (off, the paper). Default: on.", _parse_on_off),
    Option("vtoken_pool", 7, "snapkv: max-pooling width over neighbouring positions (odd). Default: 7.", _parse_int(1)),
)
OPTION_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class VTokenConfig:
    """Validated vToken settings. Invariants: ``budget`` and ``budget_ratio`` are not both set; with a policy other
    than ``none`` exactly one of them is set; an absolute budget covers ``sinks + recent``."""

    enable_vtoken: bool = False
    vtoken_policy: str = "none"
    vtoken_budget: int | None = None
    vtoken_budget_ratio: float | None = None
    vtoken_recent: int = 64
    vtoken_sinks: int = 4
    vtoken_reclaim: bool = True
    vtoken_theta: float = 0.05
    vtoken_planner: str = "inline"
    vtoken_seed: int = 0
    vtoken_score_layers: str = "all"
    vtoken_score_every: int = 1
    vtoken_history: int = 32
    vtoken_window: int = 32
    vtoken_pool: int = 7
    vtoken_cow: bool = True

    @classmethod
    def build(cls, values: Mapping[str, Any], display: Callable[[str], str] = lambda n: OPTION_BY_NAME[n].flag) -> VTokenConfig:
        """Parse and validate user values (missing keys take defaults). ``display`` names a field in errors
        (``--vtoken-budget`` for the CLI, ``vtoken_budget=`` for ``sgl.Engine``)."""
        unknown = sorted(set(values) - set(OPTION_BY_NAME))
        if unknown:
            raise ConfigError(f"unknown vToken option {display(unknown[0]) if unknown[0] in OPTION_BY_NAME else unknown[0]}")
        parsed: dict[str, Any] = {}
        for opt in OPTIONS:
            raw = values.get(opt.name, opt.default)
            try:
                parsed[opt.name] = opt.parse(raw)
            except ValueError as err:
                raise ConfigError(f"{display(opt.name)}: {err}") from None
        cfg = cls(**parsed)
        cfg._check_combinations(display)
        return cfg

    def _check_combinations(self, display: Callable[[str], str]) -> None:
        budget, ratio = self.vtoken_budget, self.vtoken_budget_ratio
        if budget is not None and ratio is not None:
            raise ConfigError(f"{display('vtoken_budget')} and {display('vtoken_budget_ratio')} are exclusive; give one")
        if self.vtoken_policy == "none" and (budget is not None or ratio is not None):
            given = "vtoken_budget" if budget is not None else "vtoken_budget_ratio"
            raise ConfigError(f"{display(given)} needs an eviction policy; {display('vtoken_policy')} is none")
        if self.vtoken_policy != "none" and budget is None and ratio is None:
            raise ConfigError(
                f"{display('vtoken_policy')} {self.vtoken_policy} needs a budget: give {display('vtoken_budget')} or {display('vtoken_budget_ratio')}"
            )
        if self.vtoken_policy not in SCORE_POLICIES and self.vtoken_score_layers != "all":
            raise ConfigError(f"{display('vtoken_score_layers')} needs a score-based policy ({', '.join(SCORE_POLICIES)})")
        for name, default, policies in (("vtoken_score_every", 1, DECODE_SCORE_POLICIES), ("vtoken_history", 32, ("scissorhands",)),
                                        ("vtoken_window", 32, ("snapkv",)), ("vtoken_pool", 7, ("snapkv",))):
            if getattr(self, name) != default and self.vtoken_policy not in policies:
                raise ConfigError(f"{display(name)} needs {display('vtoken_policy')} {' or '.join(policies)}")
        if self.vtoken_pool % 2 == 0:
            raise ConfigError(f"{display('vtoken_pool')} {self.vtoken_pool}: the pooling width must be odd (centred on each position)")
        floor = self.vtoken_sinks + self.vtoken_recent
        if budget is not None and budget < floor:
            raise ConfigError(
                f"{display('vtoken_budget')} {budget} is smaller than {display('vtoken_sinks')} + {display('vtoken_recent')} "
                f"({self.vtoken_sinks} + {self.vtoken_recent} = {floor})"
            )

    @property
    def enabled(self) -> bool:
        return self.enable_vtoken

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> VTokenConfig:
        return cls.build(json.loads(text))

    def summary(self) -> str:
        if not self.enabled:
            return "vToken off"
        budget = self.vtoken_budget if self.vtoken_budget is not None else self.vtoken_budget_ratio
        return (
            f"vToken on: policy={self.vtoken_policy} budget={budget} sinks={self.vtoken_sinks} recent={self.vtoken_recent} "
            f"reclaim={'on' if self.vtoken_reclaim else 'off'} cow={'on' if self.vtoken_cow else 'off'} theta={self.vtoken_theta} planner={self.vtoken_planner} seed={self.vtoken_seed}"
        )


def kwarg_display(name: str) -> str:
    """How ``sgl.Engine`` keyword arguments are named in errors: by their keyword."""
    return name
