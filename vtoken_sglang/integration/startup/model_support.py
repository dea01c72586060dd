"""Which models and KV layouts vToken serves: everything else is refused at start with one ``error:`` line, before
any weight is loaded.

vToken keeps only live tokens in a row, in logical order, with their RoPE positions given from the Token Table. It
needs one token-granular pool of full-attention K/V pages that its relocation copies move token by token (K and V,
along the pool's first dimension), attention over the whole row, and plain decode positions. Refused, by what
SGLang itself says of the model (its ``ModelConfig``) or of each attention layer as the model is built:

- recurrent state (mamba, linear attention), a separate sliding-window pool, MLA latents: not a K/V page pool;
- encoder-decoder models and cross-attention layers: the decoder reads its row after the encoder's entries;
- a layer that attends in chunks (``use_irope``). Sliding windows are served: every verified attention backend
  takes them by logical position (``hooks.windows``);
- block-scaled KV dtypes (per-token scale buffers) and the HND layout: relocation would move K/V without their
  scales, or along the wrong dimension.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BLOCK_SCALED_KV_DTYPES = ("mxfp8", "nvfp4", "fp4_mx_block16")

REFUSAL_ENV = "VTOKEN_SGLANG_REFUSAL_FILE"  # where a scheduler writes why it refused (read by the launching process)
# what the scheduler being built serves (set by ``hooks.scheduler.build_runtime`` before SGLang builds the model)
SERVING: dict[str, Any] = {"model": "?"}


def unsupported_model(model_config) -> str | None:
    """Why vToken cannot serve this model (SGLang's own classification of it), or None."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import AttentionArch

    arch = model_name(model_config)
    if mambaish_config(model_config) is not None or model_config.attention_arch == AttentionArch.SSM:
        return f"model {arch}: hybrid mamba / linear-attention models are not supported with vToken"
    if model_config.is_hybrid_swa:
        return f"model {arch}: hybrid sliding-window models (separate SWA KV pool) are not supported with vToken"
    if model_config.attention_arch == AttentionArch.MLA:
        return f"model {arch}: MLA (latent KV) models are not supported with vToken yet"
    if model_config.is_encoder_decoder:
        return f"model {arch}: encoder-decoder models are not supported with vToken"
    return None


def model_name(model_config) -> str:
    return ",".join(getattr(model_config.hf_config, "architectures", None) or ["?"])


def unsupported_kv_layout(server_args: Any, flag: Callable[[str], str]) -> str | None:
    """Why vToken cannot move this server's KV cache token by token, or None (``flag``: how to name a field)."""
    from sglang.srt.environ import envs

    dtype = getattr(server_args, "kv_cache_dtype", "auto")
    if dtype in BLOCK_SCALED_KV_DTYPES:
        return (
            f"{flag('kv_cache_dtype')} {dtype}: block-scaled KV caches (per-token scale buffers) are not supported "
            "with vToken (its relocation copies move K and V only)"
        )
    if envs.SGLANG_USE_HND_KVCACHE.get():
        return (
            "SGLANG_USE_HND_KVCACHE=1: the HND KV layout is not supported with vToken (relocation moves tokens "
            "along the pool's first dimension)"
        )
    return None


def unsupported_layer(layer) -> str | None:
    """Why vToken cannot serve an attention layer (a built ``RadixAttention``) of the model in ``SERVING``."""
    name = SERVING["model"]
    if layer.is_cross_attention:
        return f"model {name}: layer {layer.layer_id} is a cross-attention layer; not supported with vToken"
    if getattr(layer, "use_irope", False):
        return f"model {name}: layer {layer.layer_id} attends in chunks (iRoPE); not supported with vToken"
    return None


def refuse(reason: str) -> None:
    """Stop this scheduler process: ``reason`` goes to the launching process, which says it (``refusals``), or,
    launched otherwise, to stderr."""
    path = os.environ.get(REFUSAL_ENV)
    if path:
        Path(path).write_text(reason)
        raise SystemExit(2)
    raise SystemExit(f"error: {reason}")


@contextlib.contextmanager
def refusals() -> Iterator[Callable[[], str | None]]:
    """Around launching schedulers: yields a function giving the first reason a scheduler refused, or None."""
    fd, name = tempfile.mkstemp(prefix="vtoken-refusal-")
    os.close(fd)
    previous = os.environ.get(REFUSAL_ENV)
    os.environ[REFUSAL_ENV] = name
    try:
        yield lambda: Path(name).read_text().strip() or None
    finally:
        os.unlink(name)
        if previous is None:
            os.environ.pop(REFUSAL_ENV, None)
        else:
            os.environ[REFUSAL_ENV] = previous
