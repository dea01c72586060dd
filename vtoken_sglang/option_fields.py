"""One user-facing option: the ``VTokenConfig`` field that declares it (``option``) and what is derived from that
field (``Option``: flag, help with its default, parser, the policies it belongs to, a further check)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vtoken_sglang.option_values import parse_bool, parse_on_off
from vtoken_sglang.policies import POLICIES


@dataclasses.dataclass(frozen=True)
class Option:
    """One user-facing option, derived from its ``VTokenConfig`` field: name, default, CLI help, a parser from the
    raw (str or typed) value, the policies it belongs to, and a further check of the parsed value (the reason it
    is refused, '' if fine; ``PolicyOption.check``)."""

    name: str
    default: Any
    help: str
    parse: Callable[[Any], Any]
    policies: tuple[str, ...]
    check: Callable[[Any], str] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        """A flag without a value (``--enable-vtoken``): an option that is True or False."""
        return self.parse is parse_bool


def option(
    default: Any,
    help: str,
    parse: Callable[[Any], Any],
    policies: tuple[str, ...] = tuple(POLICIES),
    check: Callable[[Any], str] | None = None,
) -> Any:
    """A ``VTokenConfig`` field that is a user-facing option: its default, CLI help (without the default, which is
    appended), parser, the policies it belongs to (set to anything but its default with another policy, it is
    an error), and its further check (``Option.check``)."""
    return dataclasses.field(
        default=default, metadata={"help": help, "parse": parse, "policies": policies, "check": check}
    )


def describe(default: Any, parse: Callable[[Any], Any]) -> str:
    """The help's default, as the user writes it (none for a switch or a default of None)."""
    if default is None:
        return ""
    if parse is parse_on_off:
        return f" Default: {'on' if default else 'off'}."
    return "" if parse is parse_bool else f" Default: {default}."
