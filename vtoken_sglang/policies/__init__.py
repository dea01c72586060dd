"""Eviction policies behind one interface (``base.Policy``); each adapter is a few lines. A policy from outside
the project is named ``package.module:ClassName`` and imported by ``policy_class`` in each process that serves it.

``BUILT_IN`` is the registry: a built-in policy is its module plus one entry there. Everything else that lists
policies is derived from the classes: ``config``'s policy names, the options each one takes and their flags
(``POLICY_OPTIONS``), and which are scored when (``scored``).
"""

import importlib
import inspect
import re

from vtoken_sglang.policies.base import SCORED_AT, Policy, PolicyConfig, PolicyOption, RowBlock, row_block, scoring
from vtoken_sglang.policies.h2o import H2OPolicy
from vtoken_sglang.policies.none import NoEviction
from vtoken_sglang.policies.random import RandomPolicy
from vtoken_sglang.policies.scissorhands import ScissorhandsPolicy
from vtoken_sglang.policies.snapkv import SnapKVPolicy
from vtoken_sglang.policies.streaming import StreamingPolicy
from vtoken_sglang.policies.tova import TOVAPolicy

BUILT_IN: tuple[type[Policy], ...] = (
    NoEviction,
    StreamingPolicy,
    RandomPolicy,
    H2OPolicy,
    ScissorhandsPolicy,
    TOVAPolicy,
    SnapKVPolicy,
)
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in BUILT_IN}
EXTERNAL_POLICY = "package.module:ClassName"  # how a policy of one's own is named
EXTERNAL_SPEC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # package.module:ClassName


def scored(*kinds: str) -> tuple[str, ...]:
    """The built-in policies whose ``scoring`` is one of ``kinds`` (``"decode"``, ``"prefill"``, ``""``), in
    registry order."""
    return tuple(name for name, cls in POLICIES.items() if scoring(cls) in kinds)


def _policy_options() -> dict[str, tuple[PolicyOption, tuple[str, ...]]]:
    """Each option the built-in policies declare, by name (in registry order), with the policies that declare it;
    policies share an option by declaring the same ``PolicyOption`` (one object: import it from the other)."""
    out: dict[str, tuple[PolicyOption, tuple[str, ...]]] = {}
    for cls in BUILT_IN:
        for opt in cls.options:
            first, owners = out.get(opt.name, (opt, ()))
            if first != opt:
                raise TypeError(f"policies {owners[0]} and {cls.name} declare option {opt.name} differently")
            out[opt.name] = (opt, owners + (cls.name,))
    return out


POLICY_OPTIONS = _policy_options()


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def policy_class(spec: str) -> type[Policy]:
    """The class of a built-in policy (by name) or of ``package.module:ClassName`` (imported here). Raises
    ``ValueError`` whose message is one line when the module does not import or the class is not a usable
    ``Policy`` subclass."""
    if spec in POLICIES:
        return POLICIES[spec]
    if not EXTERNAL_SPEC.fullmatch(spec):
        raise ValueError(f"unknown policy {spec!r}; known: {', '.join(POLICIES)}, or {EXTERNAL_POLICY}")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any failure of the user's module is reported, in one line
        raise ValueError(f"cannot import {module_name} ({_one_line(err)})") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"module {module_name} has no {attr}")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"{spec} is not a subclass of vtoken_sglang.policies.Policy")
    if inspect.isabstract(cls):
        raise ValueError(f"{spec} does not implement {', '.join(sorted(cls.__abstractmethods__))}")
    if cls.needs_scores and cls.scored_at not in SCORED_AT:
        raise ValueError(f"{spec}.scored_at is {cls.scored_at!r}; expected one of {', '.join(SCORED_AT)}")
    names = cls.state_names
    if not (isinstance(names, tuple) and all(isinstance(n, str) for n in names) and len(set(names)) == len(names)):
        raise ValueError(f"{spec}.state_names must be a tuple of distinct strings, got {names!r}")
    opts = cls.options
    if not (isinstance(opts, tuple) and all(isinstance(o, PolicyOption) for o in opts)):
        raise ValueError(f"{spec}.options must be a tuple of vtoken_sglang.policies.PolicyOption, got {opts!r}")
    return cls


def make_policy(spec: str, cfg: PolicyConfig) -> Policy:
    return policy_class(spec)(cfg)


__all__ = [
    "BUILT_IN",
    "EXTERNAL_POLICY",
    "POLICIES",
    "POLICY_OPTIONS",
    "Policy",
    "PolicyConfig",
    "PolicyOption",
    "RowBlock",
    "make_policy",
    "policy_class",
    "row_block",
    "scored",
    "scoring",
]
