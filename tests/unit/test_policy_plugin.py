"""A policy from outside the project (``--vtoken-policy package.module:ClassName``): the example of
docs/policies.md loads and ranks as the built-in h2o does; the policy of ``own_policy`` (``SPEC``) is served by
real SGLang through the flag in server/test_scoring (``test_server_serves_a_policy_of_ones_own``: it evicts and gives
h2o's tokens and victims). (Policies that do not load are refused at start: test_options.BAD_CLI.)"""

import re
import sys
from pathlib import Path

import torch
from conftest import REPO
from core_helpers import MiniEngine
from own_policy import SPEC

from vtoken_sglang.config import VTokenConfig
from vtoken_sglang.policies import PolicyConfig, make_policy, policy_class, scoring


def docs_example(tmp_path: Path) -> str:
    """Write the policy of docs/policies.md into a module on ``sys.path``; its spec."""
    text = (REPO / "docs" / "policies.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "my_policies.py").write_text(code)
    sys.path.insert(0, str(tmp_path))
    return "my_policies:AccumulatedAttention"


def victims_after(spec: str, attns: list[torch.Tensor]) -> list[list[int]]:
    """Logical ids kept per request after observing ``attns`` and one eviction round (budget 20, recent 5)."""
    cls = policy_class(spec)
    eng = MiniEngine(num_pages=256, page_size=4, rows=4, max_context=256, state_names=cls.state_names)
    rows = torch.arange(3)
    eng.table.open_rows(rows)
    eng.write(rows, torch.tensor([40, 33, 26]))
    pol = make_policy(spec, PolicyConfig(budget=20, sinks=2, recent=5, slack=0))
    for attn in attns:
        pol.observe(eng.table, rows, attn)
    eng.evict(*pol.select_victims(eng.table, rows))
    return [eng.table.row_view(r)[1].tolist() for r in range(3)]


def test_docs_example_and_test_policy_rank_as_h2o(tmp_path):
    g = torch.Generator().manual_seed(1)
    attns = [torch.rand(3, 40, generator=g) for _ in range(4)]
    expected = victims_after("h2o", attns)
    assert [len(k) for k in expected] == [20, 20, 20]
    try:
        spec = docs_example(tmp_path)
        assert victims_after(spec, attns) == expected
        assert victims_after(SPEC, attns) == expected
        assert scoring(policy_class(spec)) == "decode"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_policies", None)


def test_external_policy_takes_the_options_of_policies_scored_like_it():
    cfg = VTokenConfig.build(
        {"enable_vtoken": True, "vtoken_policy": SPEC, "vtoken_budget": 96, "vtoken_score_every": 2}
    )
    assert cfg.scoring == "decode" and cfg.vtoken_score_every == 2
    assert VTokenConfig.from_json(cfg.to_json()) == cfg
