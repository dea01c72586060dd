"""How a raw option value (a CLI string, or a typed ``sgl.Engine`` keyword) becomes a typed one: each parser
returns the value or raises ``ValueError`` with the reason, which ``config`` prefixes with the option's name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def parse_int(lo: int) -> Callable[[Any], int]:
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


def parse_float(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], float]:
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


def parse_choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}; got {value!r}")
        return value

    return parse


def parse_on_off(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("on", "off"):
        return value.lower() == "on"
    raise ValueError(f"expected on or off, got {value!r}")


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"expected True or False, got {value!r}")


def parse_layers(value: Any) -> str:
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


def optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else parse(value)
