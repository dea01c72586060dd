"""Which models vToken refuses before any weight loads (``integration.model_support``): by SGLang's own model config
(encoder-decoder; M-RoPE is served), by each attention layer SGLang builds (a real ``RadixAttention``: cross-attention,
chunked iRoPE; sliding windows are served on every verified backend), and by
the KV layout (block-scaled dtypes, HND). The refusal through the real launcher, with one line, is in
``server/test_launcher_refusals``."""

import argparse

import pytest
from model_dirs import TINY_GEOMETRY, config_only_model

from vtoken_sglang.integration.startup import model_support


def test_models_refused_by_their_config(tiny_model, tmp_path):
    from sglang.srt.configs.model_config import ModelConfig
    from transformers import Qwen2VLConfig, WhisperConfig

    mrope = Qwen2VLConfig(**TINY_GEOMETRY, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    qwen_vl = config_only_model(tiny_model, tmp_path / "qwen2vl", mrope, "Qwen2VLForConditionalGeneration")
    whisper_cfg = WhisperConfig(vocab_size=2048, d_model=64, encoder_layers=1, decoder_layers=1)
    whisper = config_only_model(tiny_model, tmp_path / "whisper", whisper_cfg, "WhisperForConditionalGeneration")
    assert model_support.unsupported_model(ModelConfig(qwen_vl)) is None  # M-RoPE: served (server/test_mrope)
    assert model_support.unsupported_model(ModelConfig(whisper)) == (
        "model WhisperForConditionalGeneration: encoder-decoder models are not supported with vToken"
    )
    assert model_support.unsupported_model(ModelConfig(tiny_model)) is None


@pytest.mark.parametrize(
    "kwargs, refused",
    [
        ({"sliding_window_size": 63}, None),  # windowed by logical position on every backend (hooks.windows)
        ({}, None),
        ({"is_cross_attention": True}, "is a cross-attention layer"),
        ({"use_irope": True}, "attends in chunks (iRoPE)"),
    ],
)
def test_layers_refused_as_sglang_builds_them(monkeypatch, kwargs, refused):
    from sglang.srt.layers.radix_attention import RadixAttention

    monkeypatch.setitem(model_support.SERVING, "model", "Gemma2ForCausalLM")
    layer = RadixAttention(4, 16, 0.25, 2, layer_id=3, **kwargs)
    reason = model_support.unsupported_layer(layer)
    if refused is None:
        assert reason is None
    else:
        assert reason.startswith("model Gemma2ForCausalLM: layer 3 ") and refused in reason, reason


def test_every_verified_backend_windows_by_logical_position():
    """Sliding layers are served on every attention backend vToken accepts, so each has a window hook: a backend
    added to the verified list without one would attend to logically older tokens of a compacted row."""
    from vtoken_sglang.integration.hooks import HOOKS, windows
    from vtoken_sglang.integration.startup.sglang_checks import VERIFIED_ATTENTION_BACKENDS

    hooked = {
        target.split(".")[4]
        for target, (_, fn) in HOOKS.items()
        if target.startswith("sglang.srt.layers.attention.") and fn.__module__ == windows.__name__
    }
    assert hooked == {f"{backend}_backend" for backend in VERIFIED_ATTENTION_BACKENDS}


def test_kv_layouts_relocation_cannot_move(monkeypatch):
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for dtype in model_support.BLOCK_SCALED_KV_DTYPES:
        reason = model_support.unsupported_kv_layout(argparse.Namespace(kv_cache_dtype=dtype), flag)
        assert reason.startswith(f"--kv-cache-dtype {dtype}: block-scaled KV caches"), reason
    for dtype in ("auto", "fp8_e4m3", "bf16"):
        assert model_support.unsupported_kv_layout(argparse.Namespace(kv_cache_dtype=dtype), flag) is None
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    reason = model_support.unsupported_kv_layout(argparse.Namespace(kv_cache_dtype="auto"), flag)
    assert reason.startswith("SGLANG_USE_HND_KVCACHE=1: the HND KV layout is not supported"), reason
