"""VTokenConfig: defaults, parsing, and every rejected combination gives one line naming the option."""

import pytest

from vtoken_sglang.config import OPTIONS, ConfigError, VTokenConfig, kwarg_display


def test_defaults_are_valid_and_off():
    cfg = VTokenConfig.build({})
    assert cfg == VTokenConfig()
    assert not cfg.enabled and cfg.vtoken_policy == "none" and cfg.vtoken_reclaim is True


def test_cli_strings_are_parsed():
    cfg = VTokenConfig.build(
        {
            "enable_vtoken": True,
            "vtoken_policy": "random",
            "vtoken_budget_ratio": "0.5",
            "vtoken_reclaim": "off",
            "vtoken_recent": "32",
            "vtoken_sinks": "0",
            "vtoken_seed": "7",
            "vtoken_theta": "0.3",
            "vtoken_planner": "inline",
        }
    )
    assert (cfg.vtoken_budget_ratio, cfg.vtoken_reclaim, cfg.vtoken_recent, cfg.vtoken_sinks, cfg.vtoken_seed) == (
        0.5,
        False,
        32,
        0,
        7,
    )


def test_json_round_trip():
    cfg = VTokenConfig.build({"enable_vtoken": True, "vtoken_policy": "streaming", "vtoken_budget": 256})
    assert VTokenConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    "values, names",
    [
        ({"vtoken_policy": "lru"}, "--vtoken-policy"),
        ({"vtoken_budget_ratio": "0"}, "--vtoken-budget-ratio"),
        ({"vtoken_budget_ratio": "1.5"}, "--vtoken-budget-ratio"),
        ({"vtoken_budget": "ten"}, "--vtoken-budget"),
        ({"vtoken_recent": "-1"}, "--vtoken-recent"),
        ({"vtoken_theta": "2"}, "--vtoken-theta"),
        ({"vtoken_reclaim": "maybe"}, "--vtoken-reclaim"),
        ({"vtoken_planner": "thread"}, "--vtoken-planner"),
        ({"vtoken_policy": "random"}, "--vtoken-budget"),
        ({"vtoken_budget": "100"}, "--vtoken-policy"),
        ({"vtoken_policy": "random", "vtoken_budget": "100", "vtoken_budget_ratio": "0.5"}, "--vtoken-budget-ratio"),
        ({"vtoken_policy": "h2o", "vtoken_budget": "60", "vtoken_sinks": "4", "vtoken_recent": "64"}, "--vtoken-sinks"),
    ],
)
def test_rejections_name_the_flag(values, names):
    with pytest.raises(ConfigError) as err:
        VTokenConfig.build({"enable_vtoken": True, **values})
    msg = str(err.value)
    assert names in msg and "\n" not in msg


def test_engine_keyword_names_in_errors():
    with pytest.raises(ConfigError, match=r"^vtoken_budget 10 is smaller than vtoken_sinks \+ vtoken_recent"):
        VTokenConfig.build({"enable_vtoken": True, "vtoken_policy": "random", "vtoken_budget": 10}, kwarg_display)


def test_budget_equal_to_floor_is_accepted():
    cfg = VTokenConfig.build({"enable_vtoken": True, "vtoken_policy": "streaming", "vtoken_budget": 68})
    assert cfg.vtoken_budget == 68


def test_every_option_has_a_field():
    fields = set(VTokenConfig.__dataclass_fields__)
    assert {o.name for o in OPTIONS} == fields


def test_policy_lists_agree_with_the_policy_classes():
    """config's lists of built-in policies (which options belong to which), the CLI's policy names, and each
    policy's own options are what the classes declare."""
    from vtoken_sglang.config import DECODE_SCORE_POLICIES, OPTION_BY_NAME, POLICIES, SCORE_POLICIES
    from vtoken_sglang.integration.startup.options import cli_display
    from vtoken_sglang.policies import BUILT_IN, scoring

    assert POLICIES == tuple(cls.name for cls in BUILT_IN)
    policy_help = OPTION_BY_NAME["vtoken_policy"].help
    for cls in BUILT_IN:
        name = cls.name
        assert name in policy_help and OPTION_BY_NAME["vtoken_policy"].parse(name) == name
        assert (name in SCORE_POLICIES) == bool(scoring(cls))
        assert (name in DECODE_SCORE_POLICIES) == (scoring(cls) == "decode")
        budget = {} if name == "none" else {"vtoken_budget": 512}  # none: no budget
        cfg = VTokenConfig.build({"enable_vtoken": True, "vtoken_policy": name, **budget})
        assert cfg.scoring == scoring(cls)
        for opt in cls.options:  # served as --vtoken-<name>, belongs to the policy, reaches it by name
            field = f"vtoken_{opt.name}"
            assert name in OPTION_BY_NAME[field].policies and cli_display(field) == "--vtoken-" + opt.name
            assert OPTION_BY_NAME[field].default == opt.default == cfg.policy_config(16).options[opt.name]
    owned = {f"vtoken_{o.name}" for cls in BUILT_IN for o in cls.options}
    for opt in OPTION_BY_NAME.values():  # an option of some policies only: theirs, or those scored alike
        if set(opt.policies) != set(POLICIES):
            assert opt.name in owned or set(opt.policies) in (set(SCORE_POLICIES), set(DECODE_SCORE_POLICIES))


def test_policies_do_not_import_config():
    """config derives from the policies; the policies (and the core under them) never import config."""
    from conftest import REPO

    for path in sorted((REPO / "vtoken_sglang" / "policies").glob("*.py")):
        assert "vtoken_sglang.config" not in path.read_text(), path.name


def test_a_policy_option_reaches_the_policy():
    cfg = VTokenConfig.build(
        {"enable_vtoken": True, "vtoken_policy": "snapkv", "vtoken_budget": 512, "vtoken_window": "8", "vtoken_pool": 3}
    )
    from vtoken_sglang.policies import make_policy

    pol = make_policy("snapkv", cfg.policy_config(slack=16))
    assert (cfg.vtoken_window, pol.cfg.options["window"], pol.cfg.options["pool"]) == (8, 8, 3)
    assert VTokenConfig.from_json(cfg.to_json()) == cfg
