"""Build the project's tiny LLaMA model: deterministic, local, nothing downloaded.

    python -m vtoken_sglang.tools.tiny_model [DIR]        # prints the model directory

Contract:
- LLaMA architecture (``LlamaForCausalLM``), seeded random weights, a byte-level BPE tokenizer trained here on a
  seeded synthetic corpus, a chat template, ``max_position_embeddings`` >= 32768.
- Bit-for-bit reproducible: the same ``TinyModelSpec`` gives the same bytes on every machine (weights are drawn
  from one seeded ``torch.Generator`` in a fixed order; the corpus comes from a seeded ``random.Random``).
- Reused when it exists: a directory whose ``vtoken_tiny_model.json`` stamp equals the spec is returned as is.
  A build writes into a temporary sibling and renames it into place, so a half-built model is never reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

STAMP = "vtoken_tiny_model.json"
ENV_DIR = "VTOKEN_TINY_MODEL_DIR"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

_WORDS = (
    "the of and to in is that it for as with was on be by this are from at or an have not which but "
    "all can they were one their there has been more when will would who what so if out up about into "
    "than them only other time some could these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last might "
    "us great old year off come since against go came right used take three memory page token cache "
    "request server model attention layer policy evict reclaim compact table slot value key query batch "
    "decode prefill schedule kernel stream event copy plan budget window score heavy recent sink random"
).split()
_CODE = (
    "def class return import from self None True False for while if else elif try except with yield "
    "lambda pass break continue assert raise print len range list dict int str float"
).split()


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the model's bytes. Changing a field gives a different model."""

    version: int = 1
    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    init_std: float = 0.08
    corpus_lines: int = 4000

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def default_dir(spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """``$VTOKEN_TINY_MODEL_DIR`` if set, else a per-spec folder under the user's cache."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "vtoken-sglang" / f"tiny-llama-{spec.digest()}"


def _corpus(spec: TinyModelSpec) -> list[str]:
    """Seeded synthetic text: English-like sentences, code-like lines and digits, so BPE learns merges."""
    rng = random.Random(spec.seed)
    lines = []
    for i in range(spec.corpus_lines):
        if i % 4 == 3:
            words = rng.choices(_CODE + _WORDS[:40], k=rng.randint(4, 12))
            lines.append("    " + " ".join(words) + f"({rng.randint(0, 999)}):")
        else:
            words = rng.choices(_WORDS, k=rng.randint(5, 20))
            words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice([".", ",", "?", "!", f" {rng.randint(0, 99999)}."]))
    return lines


def _train_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<|pad|>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _config(spec: TinyModelSpec, vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "mlp_bias": False,
    }


def _weights(spec: TinyModelSpec, vocab_size: int) -> dict:
    """Seeded normal weights (norms = 1) in a fixed name order, stored as bf16."""
    import torch

    h, f, v = spec.hidden_size, spec.intermediate_size, vocab_size
    d = h // spec.num_attention_heads
    kv = spec.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    gen = torch.Generator().manual_seed(spec.seed)
    out = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            t = torch.ones(shapes[name])
        else:
            t = torch.randn(shapes[name], generator=gen) * spec.init_std
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def build(out_dir: str | os.PathLike | None = None, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Return a directory holding the tiny model, building it unless an identical build is already there."""
    out = Path(out_dir) if out_dir is not None else default_dir(spec)
    return reuse_or_build(
        out, {"spec": dataclasses.asdict(spec), "digest": spec.digest()}, lambda tmp: _write(spec, tmp)
    )


def _write(spec: TinyModelSpec, tmp: Path) -> None:
    from safetensors.torch import save_file

    _train_tokenizer(spec, tmp)
    vocab_size = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"].__len__()
    vocab_size = max(vocab_size, spec.vocab_size)
    (tmp / "config.json").write_text(json.dumps(_config(spec, vocab_size), indent=2, sort_keys=True))
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}, indent=2)
    )
    save_file(_weights(spec, vocab_size), str(tmp / "model.safetensors"), metadata={"format": "pt"})


def reuse_or_build(out: Path, stamp: dict, write: Callable[[Path], None]) -> Path:
    """``out`` if its ``STAMP`` equals ``stamp``; else ``write(tmp)`` into a temporary sibling, stamp it and rename
    it into place (a half-built model is never reused). Refuses to replace a directory that holds no stamp."""
    if (out / STAMP).is_file() and json.loads((out / STAMP).read_text()) == stamp:
        return out
    if out.exists() and any(out.iterdir()) and not (out / STAMP).is_file():
        raise FileExistsError(f"{out} exists and does not hold a vtoken tiny model; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=out.parent))
    try:
        write(tmp)
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_cli(doc: str, build_dir: Callable[[str | None], Path], argv: list[str] | None) -> int:
    """``python -m <module> [DIR]`` of a model builder: prints the built (or reused) directory; the usage is the
    third line of the module's docstring."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] in ("-h", "--help")):
        print(doc.strip().splitlines()[2].strip())
        return 0 if args and args[0] in ("-h", "--help") else 2
    print(build_dir(args[0] if args else None))
    return 0


def main(argv: list[str] | None = None) -> int:
    return build_cli(__doc__, build, argv)


if __name__ == "__main__":
    sys.exit(main())
