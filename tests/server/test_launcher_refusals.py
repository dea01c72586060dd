"""The real launcher refuses at start, with one line: ``python -m sglang.launch_server`` and the first
``sgl.Engine`` of a fresh process (bad keywords, models vToken cannot serve; the parsing itself runs in-process in
``unit/test_options``), and a manifest whose fingerprints no longer match the installed sglang (the check itself:
``unit/test_manifest``)."""

import json

from conftest import PY, run_all
from model_dirs import config_only_model

from vtoken_sglang.integration.startup import manifest


def mamba_model(tiny_model: str, path) -> str:
    """A Mamba checkpoint directory with no weights (vToken refuses it before any weight is read)."""
    from transformers import MambaConfig

    cfg = MambaConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=2, state_size=8)
    return config_only_model(tiny_model, path, cfg, "MambaForCausalLM")


def test_real_launcher_help_and_refusals(tiny_model, tmp_path):
    """The real ``python -m sglang.launch_server`` and the first ``sgl.Engine`` of a fresh process: the help lists
    vToken's flags, bad keywords are refused before anything starts; models vToken cannot serve are refused at start
    with one line (exit 2, as a bad flag: ``test_bad_cli_exits_with_one_line`` runs the launcher's own parsing in
    this process): Mamba by its config, in the scheduler before any weight loads. (A layer refused as SGLang
    builds it, Gemma-2's window on FlashInfer, is ``unit/test_model_support``'s: SGLang's launcher needs FlashInfer
    installed before any scheduler starts, and this CPU machine has none.)"""
    engine_script = (
        "import sglang as sgl\n"
        f"sgl.Engine(model_path={tiny_model!r}, enable_vtoken=True, vtoken_policy='tova', vtoken_budget=8)\n"
    )
    cpu = ["--enable-vtoken", "--device", "cpu", "--dtype", "float32"]
    help_run, engine_run, mamba_run = run_all(
        [
            [PY, "-m", "sglang.launch_server", "--help"],
            [PY, "-c", engine_script],
            [
                PY,
                "-m",
                "sglang.launch_server",
                "--model-path",
                mamba_model(tiny_model, tmp_path / "mamba"),
                *cpu,
            ],
        ]
    )
    assert help_run.returncode == 0
    for flag in (
        "--enable-vtoken",
        "--vtoken-policy",
        "--vtoken-budget",
        "--vtoken-budget-ratio",
        "--vtoken-recent",
        "--vtoken-sinks",
        "--vtoken-reclaim",
        "--vtoken-theta",
        "--vtoken-planner",
        "--vtoken-seed",
        "--page-size",
        "--max-total-tokens",
    ):
        assert flag in help_run.stdout, flag
    assert engine_run.returncode != 0
    assert "vtoken_budget 8 is smaller than vtoken_sinks + vtoken_recent" in engine_run.stderr.strip().splitlines()[-1]
    assert mamba_run.returncode == 2 and "Traceback" not in mamba_run.stderr, mamba_run.stderr[-2000:]
    errors = [line for line in mamba_run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: model MambaForCausalLM: hybrid mamba / linear-attention models are not supported with vToken"
    ]


def test_launcher_refuses_to_run_vtoken_on_drift(tmp_path, tiny_model):
    data = manifest.load()
    target = "sglang.srt.server_args.ServerArgs.add_cli_args"
    for e in data["patches"]:
        if e["target"] == target:
            e["fingerprints"][target] = "0" * 64
    tampered = tmp_path / "manifest.json"
    tampered.write_text(json.dumps(data))
    env = {manifest.ENV_OVERRIDE: str(tampered)}
    with_vtoken, without = run_all(
        [
            [PY, "-m", "sglang.launch_server", "--model-path", tiny_model, "--enable-vtoken"],
            [PY, "-m", "sglang.launch_server", "--help"],
        ],
        env=env,
    )
    assert with_vtoken.returncode != 0
    last = with_vtoken.stderr.strip().splitlines()[-1]
    assert last.startswith("error: vToken was built against sglang 0.5.23: " + target) and "changed upstream" in last
    assert "Traceback" not in with_vtoken.stderr
    assert without.returncode == 0 and "--enable-vtoken" not in without.stdout  # vToken off, upstream untouched
