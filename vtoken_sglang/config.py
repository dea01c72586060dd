"""vToken's user-facing options, declared once: the engine's as the fields of ``VTokenConfig``, each policy's own by
its class (``policies.PolicyOption``, a ``VTokenConfig`` field ``vtoken_<name>`` made from it). The CLI flags
(``--vtoken-*``), ``sgl.Engine(vtoken_*=...)`` keywords and the policies' ``PolicyConfig`` are derived from them; so
are the policy names and which policies an option belongs to (from the policy classes: ``policies.BUILT_IN``).

Engine-agnostic: no ``sglang`` import. ``VTokenConfig`` is frozen and always valid (``VTokenConfig.build`` is the
only constructor that accepts user input); an invalid value or combination raises ``ConfigError`` whose message
is one line that names the flag.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from vtoken_sglang.option_fields import Option, describe, option
from vtoken_sglang.option_values import (
    optional,
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
    parse_layers,
    parse_on_off,
)
from vtoken_sglang.policies import EXTERNAL_POLICY, POLICY_OPTIONS, PolicyConfig, policy_class, scored
from vtoken_sglang.policies import POLICIES as POLICY_CLASSES
from vtoken_sglang.policies import scoring as scoring_of

POLICIES = tuple(POLICY_CLASSES)  # built in, in registry order
SCORE_POLICIES = scored("decode", "prefill")  # need attention scores collected by the engine
DECODE_SCORE_POLICIES = scored("decode")  # scored at decode steps (the others: once, at prefill)
_DRIVER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PolicyConfig)}  # sinks, recent, seed
PLANNERS = ("worker", "inline")
ENV_VAR = "VTOKEN_SGLANG_CONFIG"


class ConfigError(ValueError):
    """An invalid vToken option or combination; ``str(err)`` is the one line shown to the user."""


def _parse_policy(value: Any) -> str:
    """A built-in policy's name, or ``package.module:ClassName`` (a ``Policy`` subclass, loaded at validation)."""
    if isinstance(value, str) and (value in POLICIES or ":" in value):
        return value
    raise ValueError(f"expected one of {', '.join(POLICIES)}, or {EXTERNAL_POLICY}; got {value!r}")


def policy_field(name: str) -> str:
    """The ``VTokenConfig`` field (and ``sgl.Engine`` keyword) of the policy option ``name``."""
    return f"vtoken_{name}"


# The policies' own options, as fields (``VTokenConfig`` inherits them): each belongs to the policies declaring it.
_PolicyOptions = dataclasses.make_dataclass(
    "_PolicyOptions",
    [
        (policy_field(name), Any, option(o.default, o.help, o.parse, owners, o.check))
        for name, (o, owners) in POLICY_OPTIONS.items()
    ],
    frozen=True,
)


@dataclasses.dataclass(frozen=True)
class VTokenConfig(_PolicyOptions):
    """Validated vToken settings; each field is one option (``OPTIONS`` is derived from these fields, the policies'
    own options, ``vtoken_<name>``, from their classes). Invariants: ``budget`` and ``budget_ratio`` are not both
    set; with a policy other than ``none`` exactly one of them is set; an absolute budget covers ``sinks + recent``;
    a policy-specific option keeps its default under other policies and passes its check."""

    enable_vtoken: bool = option(
        False, "Enable vToken: token-level KV eviction whose freed slots return to the page pool.", parse_bool
    )
    vtoken_policy: str = option(
        "none",
        f"Eviction policy: {', '.join(POLICIES)} (none: hooks only, no eviction), or {EXTERNAL_POLICY}, a "
        "vtoken_sglang.policies.Policy subclass of your own (docs/policies.md).",
        _parse_policy,
    )
    vtoken_budget: int | None = option(
        None,
        "Tokens of KV kept per request (absolute). Exclusive with --vtoken-budget-ratio.",
        optional(parse_int(1)),
    )
    vtoken_budget_ratio: float | None = option(
        None,
        "Fraction of each request's tokens kept, in (0, 1]. Exclusive with --vtoken-budget.",
        optional(parse_float(0.0, 1.0, lo_open=True)),
    )
    vtoken_recent: int = option(
        _DRIVER_DEFAULTS["recent"], "Most recent tokens always kept (recent window).", parse_int(0)
    )
    vtoken_sinks: int = option(_DRIVER_DEFAULTS["sinks"], "First tokens always kept (attention sinks).", parse_int(0))
    vtoken_reclaim: bool = option(
        True,
        "on: compact live tokens and free pages (vToken); off: Naive-Evict (same victims, no relocation).",
        parse_on_off,
    )
    vtoken_theta: float = option(
        0.05, "Fragmentation F above which reclaim is planned, in [0, 1] (the paper: 0.25).", parse_float(0.0, 1.0)
    )
    vtoken_planner: str = option(
        "inline", "Where reclaim plans are made: worker (a ZMQ compaction process) or inline.", parse_choice(PLANNERS)
    )
    vtoken_seed: int = option(
        _DRIVER_DEFAULTS["seed"], "Seed of the random policy (identical on every TP rank).", parse_int(0)
    )
    vtoken_score_layers: str = option(
        "all",
        "Layers whose attention feeds score-based policies: all, or indices like 0,-1.",
        parse_layers,
        SCORE_POLICIES,
    )
    vtoken_score_every: int = option(
        1, "Collect attention scores every k decode steps.", parse_int(1), DECODE_SCORE_POLICIES
    )
    vtoken_cow: bool = option(
        True,
        "Copy-on-write of radix-tree prefix pages: a request copies its live prefix tokens to private pages and "
        "unlocks the tree's when that frees pages (on), or keeps them locked until it ends (off, the paper).",
        parse_on_off,
    )
    vtoken_prefill_eviction: bool = option(
        False,
        "Evict between prefill chunks: a prompt over its budget is held to its budget from its first chunk on "
        "(only its budget plus a chunk is ever in memory, so a prompt longer than the KV pool can be served); its "
        "chunks are not inserted into the radix tree. Off: a prompt is prefilled whole and trimmed at its first "
        "decode step.",
        parse_on_off,
    )

    @classmethod
    def build(
        cls, values: Mapping[str, Any], display: Callable[[str], str] = lambda n: OPTION_BY_NAME[n].flag
    ) -> VTokenConfig:
        """Parse and validate user values (missing keys take defaults). ``display`` names a field in errors
        (``--vtoken-budget`` for the CLI, ``vtoken_budget=`` for ``sgl.Engine``)."""
        unknown = sorted(set(values) - set(OPTION_BY_NAME))
        if unknown:
            raise ConfigError(
                f"unknown vToken option {display(unknown[0]) if unknown[0] in OPTION_BY_NAME else unknown[0]}"
            )
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
            raise ConfigError(
                f"{display('vtoken_budget')} and {display('vtoken_budget_ratio')} are exclusive; give one"
            )
        if self.vtoken_policy == "none" and (budget is not None or ratio is not None):
            given = "vtoken_budget" if budget is not None else "vtoken_budget_ratio"
            raise ConfigError(f"{display(given)} needs an eviction policy; {display('vtoken_policy')} is none")
        if self.vtoken_policy != "none" and budget is None and ratio is None:
            raise ConfigError(
                f"{display('vtoken_policy')} {self.vtoken_policy} needs a budget: give {display('vtoken_budget')} or "
                f"{display('vtoken_budget_ratio')}"
            )
        if self.vtoken_policy == "none" and self.vtoken_prefill_eviction:
            raise ConfigError(
                f"{display('vtoken_prefill_eviction')} needs an eviction policy; {display('vtoken_policy')} is none"
            )
        takes = self._takes_options_of(display)
        for opt in OPTIONS:
            if getattr(self, opt.name) != opt.default and not takes <= set(opt.policies):
                raise ConfigError(f"{display(opt.name)} needs {display('vtoken_policy')} {' or '.join(opt.policies)}")
        for opt in OPTIONS:
            value = getattr(self, opt.name)
            reason = opt.check(value) if opt.check is not None else ""
            if reason:
                raise ConfigError(f"{display(opt.name)} {value}: {reason}")
        floor = self.vtoken_sinks + self.vtoken_recent
        if budget is not None and budget < floor:
            raise ConfigError(
                f"{display('vtoken_budget')} {budget} is smaller than {display('vtoken_sinks')} + "
                f"{display('vtoken_recent')} "
                f"({self.vtoken_sinks} + {self.vtoken_recent} = {floor})"
            )

    def _takes_options_of(self, display: Callable[[str], str]) -> set[str]:
        """The built-in policies whose options this policy takes: itself, or for a policy of one's own every
        built-in one that is scored as it is (loading it: an error if it does not load)."""
        if self.vtoken_policy in POLICIES:
            return {self.vtoken_policy}
        try:
            kind = scoring_of(policy_class(self.vtoken_policy))
        except ValueError as err:
            raise ConfigError(f"{display('vtoken_policy')} {self.vtoken_policy}: {err}") from None
        return set(scored(kind))

    @property
    def scoring(self) -> str:
        """When the policy needs attention scores collected: ``"decode"``, ``"prefill"``, or ``""`` (never)."""
        return scoring_of(policy_class(self.vtoken_policy))

    def policy_config(self, slack: int) -> PolicyConfig:
        """What the policy reads of these options (every policy option, by name); ``slack``: see ``PolicyConfig``.
        Needs a budget (a policy other than ``none``)."""
        return PolicyConfig(
            budget=self.vtoken_budget,
            budget_ratio=self.vtoken_budget_ratio,
            sinks=self.vtoken_sinks,
            recent=self.vtoken_recent,
            slack=slack,
            seed=self.vtoken_seed,
            options={name: getattr(self, policy_field(name)) for name in POLICY_OPTIONS},
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
            f"vToken on: policy={self.vtoken_policy} budget={budget} sinks={self.vtoken_sinks} "
            f"recent={self.vtoken_recent} "
            f"reclaim={'on' if self.vtoken_reclaim else 'off'} cow={'on' if self.vtoken_cow else 'off'} "
            f"theta={self.vtoken_theta} planner={self.vtoken_planner} seed={self.vtoken_seed}"
        )


_POLICY_FIELDS = {policy_field(name) for name in POLICY_OPTIONS}
OPTIONS: tuple[Option, ...] = tuple(  # the engine's options first, then the policies' (help and error order)
    Option(
        f.name,
        f.default,
        f.metadata["help"] + describe(f.default, f.metadata["parse"]),
        f.metadata["parse"],
        f.metadata["policies"],
        f.metadata["check"],
    )
    for f in sorted(dataclasses.fields(VTokenConfig), key=lambda f: f.name in _POLICY_FIELDS)
)
OPTION_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
DEFAULTS = VTokenConfig()  # every option at its default (vToken off)


def kwarg_display(name: str) -> str:
    """How ``sgl.Engine`` keyword arguments are named in errors: by their keyword."""
    return name
