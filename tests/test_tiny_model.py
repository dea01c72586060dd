"""The tiny model is deterministic, reused from its directory, loadable by transformers, and long-context."""

import json
from pathlib import Path

import pytest

from vtoken_sglang.tiny_model import STAMP, TinyModelSpec, build


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
    from vtoken_sglang.tiny_model import main

    assert main([str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert json.loads((tmp_path / "cli" / STAMP).read_text())["digest"] == TinyModelSpec().digest()
