"""Which of SGLang's own arguments vToken refuses or adjusts, each naming the flag (``check_sglang_args``): run by
the option hooks (``options``) on the CLI's parsed flags, on ``sgl.Engine`` keywords, and on the full record before
children spawn.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vtoken_sglang.config import ConfigError, VTokenConfig, kwarg_display
from vtoken_sglang.integration.startup import model_support

logger = logging.getLogger(__name__)

VERIFIED_ATTENTION_BACKENDS = ("torch_native", "flashinfer", "triton")
DEFAULT_PAGE_SIZE = 16


def _sglang_display(display, name: str) -> str:
    return name if display is kwarg_display else "--" + name.replace("_", "-")


def graph_backend(server_args: Any, phase: str) -> str | None:
    """The CUDA-graph backend chosen for ``phase`` (``"decode"`` or ``"prefill"``) in any of SGLang 0.5.23's
    spellings, or None if none was chosen: ``"disabled"`` by the deprecated ``--disable-cuda-graph`` (both phases) or
    ``disable_{phase}_cuda_graph``, else ``--cuda-graph-backend-{phase}``, else ``cuda_graph_config[phase]["backend"]``
    (the flag wins over the config, as in SGLang's resolution)."""
    if getattr(server_args, "disable_cuda_graph", False) or getattr(server_args, f"disable_{phase}_cuda_graph", False):
        return "disabled"
    flag = getattr(server_args, f"cuda_graph_backend_{phase}", None)
    if flag is not None:
        return flag
    graphs = getattr(server_args, "cuda_graph_config", None)
    record = graphs.get(phase) if isinstance(graphs, dict) else getattr(graphs, phase, None)
    return record.get("backend") if isinstance(record, dict) else getattr(record, "backend", None)


def check_sglang_args(server_args: Any, cfg: VTokenConfig, display, log: bool = True) -> None:
    """Reject what vToken does not support yet, naming the SGLang flag; default ``page_size`` to 16.

    Runs on the unresolved record (CLI: on a copy of the parsed flags before SGLang builds its record, then inside
    ``from_cli_args`` on it; Engine: before ``resolve_once``). ``log``: say what it changes."""
    flag = lambda name: _sglang_display(display, name)  # noqa: E731
    page_size = server_args.page_size
    if page_size is None:
        server_args.page_size = DEFAULT_PAGE_SIZE
    elif page_size < 2:
        raise ConfigError(
            f"{flag('page_size')} {page_size}: vToken needs pages of at least 2 tokens (with one-token pages every "
            f"dead token is freed directly and there is nothing to reclaim); default with {display('enable_vtoken')} "
            f"is {DEFAULT_PAGE_SIZE}"
        )
    if server_args.speculative_algorithm:
        raise ConfigError(
            f"{flag('speculative_algorithm')} {server_args.speculative_algorithm}: speculative decoding is not "
            "supported with vToken"
        )
    if server_args.enable_hierarchical_cache:
        raise ConfigError(f"{flag('enable_hierarchical_cache')}: HiCache is not supported with vToken")
    if server_args.enable_unified_memory:
        raise ConfigError(f"{flag('enable_unified_memory')}: unified memory is not supported with vToken")
    chunk = server_args.chunked_prefill_size
    if cfg.vtoken_prefill_eviction and chunk is not None and chunk <= 0:
        raise ConfigError(
            f"{display('vtoken_prefill_eviction')} evicts between prefill chunks; {flag('chunked_prefill_size')} "
            f"{chunk} turns chunked prefill off"
        )
    if server_args.disaggregation_mode not in (None, "null"):
        raise ConfigError(
            f"{flag('disaggregation_mode')} {server_args.disaggregation_mode}: PD disaggregation is not supported "
            "with vToken"
        )
    for name in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        backend = getattr(server_args, name)
        if backend is not None and backend not in VERIFIED_ATTENTION_BACKENDS:
            raise ConfigError(
                f"{flag(name)} {backend}: not verified with vToken; use one of {', '.join(VERIFIED_ATTENTION_BACKENDS)}"
            )
    on_cpu = server_args.device == "cpu" or os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
    if server_args.attention_backend is None:
        server_args.attention_backend = "torch_native" if on_cpu else "flashinfer"
    if getattr(server_args, "pp_size", 1) > 1:
        raise ConfigError(f"{flag('pp_size')} {server_args.pp_size}: pipeline parallelism is not supported with vToken")
    if getattr(server_args, "enable_mixed_chunk", False):
        raise ConfigError(
            f"{flag('enable_mixed_chunk')}: mixed prefill/decode batches are not supported with vToken (decode rows "
            "in an extend batch get positions from their live length, not their logical one)"
        )
    attn_dp = getattr(server_args, "attn_dp_size", None) or 1
    if attn_dp > 1 or getattr(server_args, "enable_dp_attention", False):
        given = f"{flag('attn_dp_size')} {attn_dp}" if attn_dp > 1 else flag("enable_dp_attention")
        raise ConfigError(
            f"{given}: DP attention is not supported with vToken (it runs decode batches as extend batches, whose "
            "positions come from live lengths, not logical ones); use --dp-size without it"
        )
    from sglang.srt.environ import envs

    if envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.get():
        raise ConfigError(
            "SGLANG_ENABLE_METADATA_GLUE_GRAPH=1: a decode graph that replays the attention metadata step is not "
            "supported with vToken (its window lengths and FlashInfer plans are taken anew at every step)"
        )
    layout = model_support.unsupported_kv_layout(server_args, flag)
    if layout:
        raise ConfigError(layout)
    # A prefill scored with a window (snapkv) keeps its queries from the attention layers' Python forward, which a
    # prefill graph's replay (full or breakable) does not call: its prompts would tie and go oldest-first.
    chosen = graph_backend(server_args, "prefill")
    if cfg.scoring == "prefill" and not on_cpu and chosen != "disabled":
        if chosen is not None:
            raise ConfigError(
                f"{flag('cuda_graph_backend_prefill')} {chosen}: {display('vtoken_policy')} {cfg.vtoken_policy} "
                "scores each prompt in its prefill forward, which a prefill CUDA graph replays without the attention "
                "layers' hook; use disabled (the default with this policy)"
            )
        server_args.cuda_graph_backend_prefill = "disabled"
        if log:
            logger.info(
                "vToken: %s %s runs prefills without CUDA graphs (each prompt is scored in its prefill forward)",
                display("vtoken_policy"),
                cfg.vtoken_policy,
            )
