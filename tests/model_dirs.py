"""Checkpoint directories of other families written without weights (a config and the tiny model's tokenizer):
what vToken refuses before any weight loads (``unit/test_model_support``, ``server/test_launcher_refusals``)."""

import shutil

# the tiny model's text geometry, for checkpoints of other families written without weights
TINY_GEOMETRY = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def config_only_model(tiny_model: str, path, cfg, arch: str) -> str:
    """A checkpoint directory of ``cfg`` with the tiny model's tokenizer and no weights."""
    cfg.architectures = [arch]
    cfg.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model}/{name}", path / name)
    return str(path)
