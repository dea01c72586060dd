"""Eviction policies behind one interface (``base.Policy``); each adapter is a few lines. A policy from outside
the project is named ``package.module:ClassName`` and imported by ``policy_class`` in each process that serves it."""

import importlib
import inspect
import re

from vtoken_sglang.policies.base import SCORED_AT, Policy, PolicyConfig, RowBlock, row_block
from vtoken_sglang.policies.h2o import H2OPolicy
from vtoken_sglang.policies.none import NoEviction
from vtoken_sglang.policies.random import RandomPolicy
from vtoken_sglang.policies.scissorhands import ScissorhandsPolicy
from vtoken_sglang.policies.snapkv import SnapKVPolicy
from vtoken_sglang.policies.streaming import StreamingPolicy
from vtoken_sglang.policies.tova import TOVAPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (NoEviction, StreamingPolicy, RandomPolicy, H2OPolicy, ScissorhandsPolicy, TOVAPolicy, SnapKVPolicy)
}
EXTERNAL_SPEC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # package.module:ClassName


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def policy_class(spec: str) -> type[Policy]:
    """The class of a built-in policy (by name) or of ``package.module:ClassName`` (imported here). Raises
    ``ValueError`` whose message is one line when the module does not import or the class is not a usable
    ``Policy`` subclass."""
    if spec in POLICIES:
        return POLICIES[spec]
    if not EXTERNAL_SPEC.fullmatch(spec):
        raise ValueError(f"unknown policy {spec!r}; known: {', '.join(POLICIES)}, or package.module:ClassName")
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
    return cls


def scoring(cls: type[Policy]) -> str:
    """When ``cls`` needs attention scores: ``"decode"``, ``"prefill"``, or ``""`` (never)."""
    return cls.scored_at if cls.needs_scores else ""


def make_policy(spec: str, cfg: PolicyConfig) -> Policy:
    return policy_class(spec)(cfg)


__all__ = ["POLICIES", "Policy", "PolicyConfig", "RowBlock", "make_policy", "policy_class", "row_block", "scoring"]
