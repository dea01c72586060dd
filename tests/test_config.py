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
    """config's lists of built-in policies (which options belong to which) say what the classes say."""
    from vtoken_sglang.config import DECODE_SCORE_POLICIES, POLICIES, SCORE_POLICIES
    from vtoken_sglang.policies import POLICIES as CLASSES
    from vtoken_sglang.policies import scoring

    assert tuple(CLASSES) == POLICIES
    assert {n for n, c in CLASSES.items() if scoring(c)} == set(SCORE_POLICIES)
    assert {n for n, c in CLASSES.items() if scoring(c) == "decode"} == set(DECODE_SCORE_POLICIES)
