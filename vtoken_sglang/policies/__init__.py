"""Eviction policies behind one interface (``base.Policy``); each adapter is a few lines."""

from vtoken_sglang.policies.base import Policy, PolicyConfig, RowBlock, row_block
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


def make_policy(name: str, cfg: PolicyConfig) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](cfg)


__all__ = ["POLICIES", "Policy", "PolicyConfig", "RowBlock", "make_policy", "row_block"]
