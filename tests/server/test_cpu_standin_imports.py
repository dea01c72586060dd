"""Every model module and multimodal processor SGLang registers imports on the CPU set-up (in a fresh process),
except the known few (the stand-in's checks in-process: ``unit/test_cpu_standin``)."""

import pytest

sgl_kernel = pytest.importorskip("sgl_kernel")
pytestmark = pytest.mark.skipif(
    not getattr(sgl_kernel, "IS_VTOKEN_CPU_STANDIN", False), reason="real sgl_kernel installed"
)


# Model modules SGLang 0.5.23 cannot import on this CPU set-up, and why: none of them is a model vToken serves
# (mamba hybrids and Inkling are refused; Grok-1's router and MiDashengLM's audio stack are not here).
IMPORT_ERRORS_LEFT = {
    "sglang.srt.models.falcon_mamba": "causal_conv1d_fn",
    "sglang.srt.models.mamba": "causal_conv1d_fn",
    "sglang.srt.models.grok": "fused_moe_router_cpu",
    "sglang.srt.models.inkling": "No module named 'cutlass'",
    "sglang.srt.multimodal.processors.inkling": "No module named 'cutlass'",
    "sglang.srt.models.midashenglm": "No module named 'torchaudio'",
    "sglang.srt.multimodal.processors.midashenglm": "No module named 'torchaudio'",
}


def test_import_errors_of_sglangs_model_and_processor_registries():
    """Every model module and multimodal processor SGLang registers imports on the CPU set-up, except the known
    few above (the Qwen-VL processor and the Qwen3.5 models among those that do): a new failure, or a fixed
    one, changes this list."""
    import subprocess
    import sys

    from vtoken_sglang.tools.launcher import cpu_env

    code = (
        "from sglang.srt.models.registry import ModelRegistry\n"
        "from sglang.srt.managers.multimodal_processor import import_processors, PROCESSOR_MAPPING\n"
        "import_processors('sglang.srt.multimodal.processors')\n"
        "print('archs', len(ModelRegistry.get_supported_archs()), 'processors', len(PROCESSOR_MAPPING))\n"
        "print('qwen2vl', any(c.__name__ == 'Qwen2VLForConditionalGeneration' for c in PROCESSOR_MAPPING))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cpu_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    errors = {}
    for line in r.stderr.splitlines():
        if "Ignore import error when loading " in line:
            name, why = line.split("Ignore import error when loading ", 1)[1].split(": ", 1)
            errors[name] = why
    assert set(errors) == set(IMPORT_ERRORS_LEFT), errors
    for name, why in IMPORT_ERRORS_LEFT.items():
        assert why in errors[name], (name, errors[name])
    assert "qwen2vl True" in r.stdout, r.stdout
