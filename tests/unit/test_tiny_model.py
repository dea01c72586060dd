"""The tiny model is deterministic, reused from its directory, loadable by transformers, and long-context."""

import json
from pathlib import Path

import pytest

from vtoken_sglang.tools.tiny_model import STAMP, TinyModelSpec, build


def _digest_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_build_is_bit_for_bit_reproducible(tmp_path):
    a, b = build(tmp_path / "a"), build(tmp_path / "b")
    files_a, files_b = _digest_files(a), _digest_files(b)
    assert {"config.json", "model.safetensors", "tokenizer.json", STAMP} <= set(files_a)
    assert files_a == files_b


def test_existing_build_is_reused(tmp_path):
    d = build(tmp_path / "m")
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    assert build(d) == d
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before


def test_other_spec_rebuilds_and_foreign_dir_is_refused(tmp_path):
    d = build(tmp_path / "m", TinyModelSpec(seed=1))
    w1 = (d / "model.safetensors").read_bytes()
    build(d, TinyModelSpec(seed=2))
    assert (d / "model.safetensors").read_bytes() != w1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build(foreign)


def test_loads_with_transformers(tiny_model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model)
    assert cfg.model_type == "llama" and cfg.max_position_embeddings >= 32768
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n")
    ids = tok("The page table maps tokens, 12345 times!")["input_ids"]
    assert tok.decode(ids) == "The page table maps tokens, 12345 times!"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size) and torch.isfinite(logits).all()


def test_cli_prints_directory(tmp_path, capsys):
    from vtoken_sglang.tools.tiny_model import main

    assert main([str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert json.loads((tmp_path / "cli" / STAMP).read_text())["digest"] == TinyModelSpec().digest()


@pytest.mark.parametrize(
    "family", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral", "qwen3_moe", "qwen2_moe"]
)
def test_family_builds_bit_for_bit_and_is_what_it_says(family, tmp_path):
    """Each family's tiny model: the same bytes from two builds, reused when there, loaded by transformers as its
    architecture with the family's own parts, and taken by SGLang's model config and registry as servable."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.registry import ModelRegistry
    from transformers import AutoModelForCausalLM

    from vtoken_sglang.integration.startup import model_support
    from vtoken_sglang.tools import tiny_families

    a, b = tiny_families.build(family, tmp_path / "a"), tiny_families.build(family, tmp_path / "b")
    assert _digest_files(a) == _digest_files(b) and "tokenizer.json" in _digest_files(a)
    before = {p.name: p.stat().st_mtime_ns for p in a.iterdir()}
    assert tiny_families.build(family, a) == a and {p.name: p.stat().st_mtime_ns for p in a.iterdir()} == before
    arch = tiny_families.FAMILIES[family][0]
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    assert type(model).__name__ == arch
    names = {n for n, _ in model.named_parameters()}
    own = {
        "qwen2": "self_attn.q_proj.bias",
        "qwen3": "self_attn.q_norm.weight",
        "qwen2_moe": "mlp.shared_expert_gate",
        "qwen3_moe": "mlp.experts",
        "mixtral": "mlp.experts",
    }
    assert family not in own or any(own[family] in n for n in names), family
    if family == "gemma2":
        assert model.config.attn_logit_softcapping == 50.0 and model.config.sliding_window == 4096
        assert model.config.tie_word_embeddings and "lm_head.weight" not in names  # as SGLang's Gemma-2 computes
    if family == "gemma3":
        assert model.config.sliding_window == 16 and model.config.layer_types == ["sliding_attention", "full_attention"]
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).tolist() == (
        AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
        .generate(ids, max_new_tokens=4, do_sample=False)
        .tolist()
    )
    assert arch in ModelRegistry.get_supported_archs()
    assert model_support.unsupported_model(ModelConfig(str(a))) is None
