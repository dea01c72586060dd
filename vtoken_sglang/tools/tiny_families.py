"""Tiny random-weight models of the families users serve, for the tests: nothing downloaded.

    python -m vtoken_sglang.tools.tiny_families FAMILY [DIR]      # prints the model directory

Contract (as ``tiny_model``, whose tokenizer every family shares):
- each family is its transformers config class at the tiny model's text geometry (``TinyModelSpec``: hidden size,
  layers, heads, KV heads, vocabulary), plus what makes the family itself (``FAMILIES``, 10 of them: Qwen2's QKV
  bias, Qwen3's QK norms, Mistral without a sliding window, Gemma-2's sliding window and soft-capping (and
  ``gemma2_window``: a 16-token window, which short tests cross), Gemma-3's sliding and full layers (a 16-token
  window), Mixtral's and Qwen3-MoE's experts, Qwen2-MoE's experts and shared expert, Qwen2-VL's M-RoPE and a
  one-block vision tower);
- a vision family (``_VISION``) adds its special tokens to the shared tokenizer (ids after its vocabulary) and
  writes the files ``AutoProcessor`` reads (image processor: 56x56 pixels at least, so a 56x56 image is 4 tokens,
  as SGLang's own minimum for Qwen2-VL; 112x112 at most in transformers, SGLang serves up to its own maximum);
- weights drawn from one seeded ``torch.Generator`` in parameter-name order, stored as bf16: the same spec gives the
  same bytes on every machine with the same transformers;
- cached per family and spec (a stamp; built in a temporary sibling and renamed, ``tiny_model.reuse_or_build``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from vtoken_sglang.tools import tiny_model

# what the Gemma families share (Gemma-2's window and soft-caps as its real checkpoints have them)
_GEMMA = {
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_act": "gelu_pytorch_tanh",  # SGLang's Gemma-2 reads this older name
    "tie_word_embeddings": True,  # SGLang's Gemma models always compute logits with the embedding
}
# family -> (architecture, transformers config class, what the family adds to the shared geometry)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 32}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
    # a window no short load crosses (SGLang attends to the last 4095); ``gemma2_window``'s is crossed
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {**_GEMMA, "sliding_window": 4096}),
    "gemma2_window": ("Gemma2ForCausalLM", "Gemma2Config", {**_GEMMA, "sliding_window": 16}),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {
            **_GEMMA,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        },
    ),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 96,
            "norm_topk_prob": True,
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 96,
            "shared_expert_intermediate_size": 96,
        },
    ),
    "qwen2_vl": (
        "Qwen2VLForConditionalGeneration",
        "Qwen2VLConfig",
        {
            "rms_norm_eps": 1e-6,  # SGLang's vision LayerNorms take this eps; transformers' are 1e-6
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6]},  # sums to head_dim / 2
            "vision_config": {  # its hidden_size (the merger's output) is the text's, set by family_config
                "depth": 1,
                "embed_dim": 32,
                "num_heads": 2,
                "mlp_ratio": 4,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "in_chans": 3,  # SGLang reads this older name of in_channels
            },
        },
    ),
}
SPEC = tiny_model.TinyModelSpec()  # the geometry every family shares by default
# parameters whose value multiplies as (1 + w) in the family's norms: drawn around 0, the others' norms are 1
_OFFSET_NORMS = ("gemma2", "gemma2_window", "gemma3")
# families that scale their input embeddings by sqrt(hidden size) and compute logits with the same (tied) matrix:
# their embeddings are drawn that much smaller, or the residual stream is the input token's own embedding and
# every greedy output repeats it
_NORMALIZED_TIED_EMBEDDINGS = ("gemma2", "gemma2_window", "gemma3")
# vision families -> their special tokens (appended to the shared tokenizer, in this order) and image processor
_VISION: dict[str, dict] = {
    "qwen2_vl": {
        "tokens": {
            "vision_start_token_id": "<|vision_start|>",
            "vision_end_token_id": "<|vision_end|>",
            "image_token_id": "<|image_pad|>",
            "video_token_id": "<|video_pad|>",
        },
        "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
    },
}


def family_config(family: str, spec: tiny_model.TinyModelSpec = SPEC, vocab_size: int = 0):
    """The transformers config of ``family`` at ``spec``'s geometry (``vocab_size``: the tokenizer's, if larger)."""
    import transformers

    arch, cls, extra = FAMILIES[family]
    extra = copy.deepcopy(extra)  # transformers fills the dicts it is given (rope_theta into rope_parameters)
    if "vision_config" in extra:
        extra["vision_config"]["hidden_size"] = spec.hidden_size
    cfg = getattr(transformers, cls)(
        vocab_size=max(vocab_size, spec.vocab_size),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **{"tie_word_embeddings": False, **extra},
    )
    cfg.architectures = [arch]
    return cfg


def default_dir(family: str, spec: tiny_model.TinyModelSpec = SPEC) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "vtoken-sglang" / f"tiny-{family}-{_digest(family, spec)}"


def _digest(family: str, spec: tiny_model.TinyModelSpec) -> str:
    key = {
        "family": family,
        "family_spec": FAMILIES[family],
        "spec": dataclasses.asdict(spec),
        "draw": [family in _OFFSET_NORMS, family in _NORMALIZED_TIED_EMBEDDINGS],
    }
    if family in _VISION:  # only there, so the other families' digests stay what they were
        key["vision"] = _VISION[family]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def build(family: str, out_dir: str | os.PathLike | None = None, spec: tiny_model.TinyModelSpec = SPEC) -> Path:
    """A directory holding ``family``'s tiny model, built unless an identical build is already there."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    out = Path(out_dir) if out_dir is not None else default_dir(family, spec)
    stamp = {"family": family, "digest": _digest(family, spec)}
    return tiny_model.reuse_or_build(out, stamp, lambda tmp: _write(family, spec, tmp))


def _write(family: str, spec: tiny_model.TinyModelSpec, tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    llama = tiny_model.build(spec=spec)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (llama / name).is_file():
            shutil.copy(llama / name, tmp / name)
    vocab = json.loads((llama / "config.json").read_text())["vocab_size"]
    if family in _VISION:
        token_ids = _write_processor(_VISION[family], llama, tmp)
        vocab = max(vocab, max(token_ids.values()) + 1)
    cfg = family_config(family, spec, vocab)
    auto = AutoModelForCausalLM
    if family in _VISION:
        for attr, token_id in token_ids.items():
            setattr(cfg, attr, token_id)
        auto = AutoModelForImageTextToText
    norms = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight") if family in _VISION else ("norm.weight",)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in auto.from_config(cfg).named_parameters()}  # tied: once
    gen = torch.Generator().manual_seed(spec.seed)
    state = {}
    for name in sorted(shapes):
        if name.endswith(norms) and family not in _OFFSET_NORMS:
            state[name] = torch.ones(shapes[name])
        else:
            state[name] = torch.randn(shapes[name], generator=gen) * spec.init_std
        if name.endswith("embed_tokens.weight") and family in _NORMALIZED_TIED_EMBEDDINGS:
            state[name] /= spec.hidden_size**0.5
    model = auto.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict({n: t.to(torch.bfloat16) for n, t in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and (not missing or cfg.tie_word_embeddings)
    model.tie_weights()
    model.save_pretrained(tmp, safe_serialization=True)


def _write_processor(vision: dict, llama: Path, tmp: Path) -> dict[str, int]:
    """The shared tokenizer plus ``vision``'s special tokens, and the processor's files, into ``tmp``: the config
    attributes naming the tokens -> their ids."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tok = AutoTokenizer.from_pretrained(llama)
    tok.add_special_tokens({"additional_special_tokens": list(vision["tokens"].values())})
    size = vision["size"]
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(size=size),
        chat_template=tok.chat_template,
    )
    processor.save_pretrained(tmp)
    return {attr: tok.convert_tokens_to_ids(token) for attr, token in vision["tokens"].items()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2 or args[0] not in FAMILIES:
        print(f"usage: python -m vtoken_sglang.tools.tiny_families {{{','.join(FAMILIES)}}} [DIR]", file=sys.stderr)
        return 2
    print(build(args[0], args[1] if len(args) > 1 else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
