"""vToken's flags inside SGLang's own argument flow, in this process: bad values and combinations exit at start
with one line naming the flag (status 2, no traceback), sgl.Engine rejects bad keywords, SGLang's flags still work.
(The real launcher, its --help and its refusals at start: ``server/test_launcher_refusals``.)"""

import pytest

BAD_CLI = [
    (["--vtoken-policy", "random"], "--vtoken-policy has no effect without --enable-vtoken"),
    (["--enable-vtoken", "--vtoken-policy", "lru"], "--vtoken-policy: expected one of"),
    (["--enable-vtoken", "--page-size", "1"], "--page-size 1: vToken needs pages of at least 2 tokens"),
    (
        ["--enable-vtoken", "--vtoken-policy", "random", "--vtoken-budget", "40"],
        "--vtoken-budget 40 is smaller than --vtoken-sinks + --vtoken-recent",
    ),
    (["--enable-vtoken", "--vtoken-policy", "random"], "--vtoken-policy random needs a budget"),
    (["--enable-vtoken", "--vtoken-budget-ratio", "0.5"], "--vtoken-budget-ratio needs an eviction policy"),
    (
        ["--enable-vtoken", "--speculative-algorithm", "EAGLE"],
        "--speculative-algorithm EAGLE: speculative decoding is not supported",
    ),
    (["--enable-vtoken", "--enable-hierarchical-cache"], "--enable-hierarchical-cache: HiCache is not supported"),
    (["--enable-vtoken", "--enable-unified-memory"], "--enable-unified-memory: unified memory is not supported"),
    (
        ["--enable-vtoken", "--disaggregation-mode", "decode"],
        "--disaggregation-mode decode: PD disaggregation is not supported",
    ),
    (
        ["--enable-vtoken", "--attention-backend", "intel_amx"],
        "--attention-backend intel_amx: not verified with vToken",
    ),
    (
        ["--enable-vtoken", "--enable-mixed-chunk"],
        "--enable-mixed-chunk: mixed prefill/decode batches are not supported",
    ),
    (["--enable-vtoken", "--pp-size", "2"], "--pp-size 2: pipeline parallelism is not supported"),
    (["--enable-vtoken", "--kv-cache-dtype", "nvfp4"], "--kv-cache-dtype nvfp4: block-scaled KV caches"),
    # a policy of one's own (package.module:ClassName) that does not load, or is not a complete Policy
    (
        ["--enable-vtoken", "--vtoken-policy", "no_such_pkg.mod:Keep", "--vtoken-budget", "512"],
        "--vtoken-policy no_such_pkg.mod:Keep: cannot import no_such_pkg.mod (ModuleNotFoundError: No module named",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "json:NoSuchClass", "--vtoken-budget", "512"],
        "--vtoken-policy json:NoSuchClass: module json has no NoSuchClass",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "json:JSONDecoder", "--vtoken-budget", "512"],
        "--vtoken-policy json:JSONDecoder: json:JSONDecoder is not a subclass of vtoken_sglang.policies.Policy",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "vtoken_sglang.policies.base:Policy", "--vtoken-budget", "512"],
        "vtoken_sglang.policies.base:Policy does not implement keep_score",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "json:", "--vtoken-budget", "512"],
        "--vtoken-policy json:: unknown policy 'json:'",
    ),
    (  # decode-scored like h2o: takes h2o's options, not scissorhands'
        ["--enable-vtoken", "--vtoken-policy", "vtoken_sglang.policies.h2o:H2OPolicy", "--vtoken-budget", "512"]
        + ["--vtoken-history", "8"],
        "--vtoken-history needs --vtoken-policy scissorhands",
    ),
    (
        ["--enable-vtoken", "--dp-size", "2", "--attn-dp-size", "2"],
        "--attn-dp-size 2: DP attention is not supported with vToken",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "random", "--vtoken-budget", "512", "--vtoken-score-every", "2"],
        "--vtoken-score-every needs --vtoken-policy h2o or scissorhands or tova",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "snapkv", "--vtoken-budget", "512", "--vtoken-score-every", "2"],
        "--vtoken-score-every needs --vtoken-policy h2o or scissorhands or tova",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "h2o", "--vtoken-budget", "512", "--vtoken-history", "8"],
        "--vtoken-history needs --vtoken-policy scissorhands",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "snapkv", "--vtoken-budget", "512", "--vtoken-pool", "4"],
        "--vtoken-pool 4: the pooling width must be odd",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "snapkv", "--vtoken-budget", "512", "--vtoken-window", "0"],
        "--vtoken-window: must be >= 1",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "h2o", "--vtoken-budget", "512", "--vtoken-score-layers", "x"],
        "--vtoken-score-layers: expected all or a comma-separated list",
    ),
    (
        ["--enable-vtoken", "--vtoken-prefill-eviction", "on"],
        "--vtoken-prefill-eviction needs an eviction policy; --vtoken-policy is none",
    ),
    (
        ["--enable-vtoken", "--vtoken-policy", "streaming", "--vtoken-budget", "512", "--vtoken-prefill-eviction", "on"]
        + ["--chunked-prefill-size", "-1"],
        "--vtoken-prefill-eviction evicts between prefill chunks; --chunked-prefill-size -1 turns chunked prefill off",
    ),
]


@pytest.fixture(scope="module")
def plugins_loaded():
    """Load SGLang's plugins in this process, exactly as the launcher does first thing."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.mark.parametrize("argv, message", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_bad_cli_exits_with_one_line(plugins_loaded, capsys, tiny_model, argv, message):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(SystemExit) as exc:
        prepare_server_args(["--model-path", tiny_model, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_metadata_glue_graph_refused(plugins_loaded, capsys, monkeypatch, tiny_model):
    """SGLang's env switch that captures the decode metadata step into a graph would replay vToken's window
    lengths and FlashInfer plans frozen: refused at start, one line."""
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1")
    with pytest.raises(SystemExit) as exc:
        prepare_server_args(["--model-path", tiny_model, "--enable-vtoken"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: SGLANG_ENABLE_METADATA_GLUE_GRAPH=1: a decode graph"), err


def test_good_cli_attaches_config_and_defaults(plugins_loaded, tiny_model):
    from sglang.srt.server_args import prepare_server_args

    from vtoken_sglang.config import VTokenConfig

    args = prepare_server_args(
        [
            "--model-path",
            tiny_model,
            "--enable-vtoken",
            "--vtoken-policy",
            "streaming",
            "--vtoken-budget",
            "512",
            "--vtoken-reclaim",
            "off",
            "--max-total-tokens",
            "4096",
        ]
    )
    cfg = VTokenConfig.from_json(args._vtoken_config)
    assert cfg.enabled and cfg.vtoken_policy == "streaming" and cfg.vtoken_budget == 512 and not cfg.vtoken_reclaim
    assert args.page_size == 16 and args.attention_backend == "torch_native" and args.max_total_tokens == 4096
    assert not args.disable_overlap_schedule  # SGLang's overlap scheduler stays on
    scored = prepare_server_args(
        ["--model-path", tiny_model, "--enable-vtoken", "--vtoken-policy", "h2o", "--vtoken-budget", "512"]
    )
    assert not scored.disable_overlap_schedule  # score policies too: a step is scored before the next one launches


def test_without_vtoken_sglang_args_are_untouched(plugins_loaded, tiny_model):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", tiny_model, "--page-size", "1", "--max-total-tokens", "4096"])
    assert args.page_size == 1 and args.attention_backend is None
    assert "enable_vtoken" not in {f for f in type(args).__struct_fields__}


def test_engine_rejects_bad_keywords_before_starting(plugins_loaded, tiny_model):
    import sglang as sgl

    from vtoken_sglang.config import ConfigError

    with pytest.raises(ConfigError, match=r"^vtoken_policy random needs a budget"):
        sgl.Engine(model_path=tiny_model, enable_vtoken=True, vtoken_policy="random")
    with pytest.raises(ConfigError, match=r"^page_size 1: vToken needs pages"):
        sgl.Engine(model_path=tiny_model, enable_vtoken=True, page_size=1)


@pytest.mark.parametrize(
    "graph_flags",
    [
        [],
        ["--cuda-graph-backend-decode", "full"],
        ["--cuda-graph-backend-decode", "breakable"],
        ["--disable-cuda-graph"],
    ],
)
def test_decode_score_policies_on_a_gpu_keep_their_graph_flags(plugins_loaded, tiny_model, monkeypatch, graph_flags):
    """On a GPU, h2o/tova/scissorhands start with decode CUDA graphs and the overlap scheduler as the user chose
    them (their queries are written into static buffers a graph's replay refills). (Checked on the parsed flags,
    as the launcher checks them before SGLang resolves its record for the device.)"""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from vtoken_sglang.integration.startup.options import check_sglang_args, cli_display, config_from_user

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", tiny_model, "--device", "cuda", *graph_flags])
    before = vars(args).copy()
    for policy in ("h2o", "tova", "scissorhands"):
        cfg = config_from_user({"enable_vtoken": True, "vtoken_policy": policy, "vtoken_budget": "512"}, cli_display)
        check_sglang_args(args, cfg, cli_display, log=False)
    changed = {k for k, v in vars(args).items() if before.get(k) != v}
    assert changed <= {"page_size", "attention_backend"}, changed


@pytest.mark.parametrize(
    "graph_flags, outcome",
    [
        ([], "disabled"),  # turned off, with a log line
        (["--cuda-graph-backend-prefill", "disabled"], "disabled"),
        (["--disable-cuda-graph"], None),  # both phases off: nothing to change
        (["--cuda-graph-backend-prefill", "breakable"], "refused"),
        (["--cuda-graph-config", '{"prefill": {"backend": "full"}}'], "refused"),
    ],
)
def test_snapkv_on_a_gpu_runs_prefills_without_graphs(
    plugins_loaded, tiny_model, monkeypatch, caplog, graph_flags, outcome
):
    """On a GPU, snapkv's prompts are scored in their prefill forward, which a prefill CUDA graph replays without
    the attention hook: vToken turns prefill graphs off (saying so) and refuses an explicit prefill graph backend."""
    import argparse
    import logging

    from sglang.srt.server_args import ServerArgs

    from vtoken_sglang.config import ConfigError
    from vtoken_sglang.integration.startup.options import check_sglang_args, cli_display, config_from_user

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", tiny_model, "--device", "cuda", *graph_flags])
    cfg = config_from_user({"enable_vtoken": True, "vtoken_policy": "snapkv", "vtoken_budget": "512"}, cli_display)
    if outcome == "refused":
        with pytest.raises(ConfigError, match="--cuda-graph-backend-prefill (breakable|full): --vtoken-policy snapkv"):
            check_sglang_args(args, cfg, cli_display, log=False)
        return
    with caplog.at_level(logging.INFO):
        check_sglang_args(args, cfg, cli_display)
    assert args.cuda_graph_backend_prefill == outcome
    said = "--vtoken-policy snapkv runs prefills without CUDA graphs" in caplog.text
    assert said == (graph_flags == [])
