"""vToken's CPU kernels, one extension (``torch.ops.vtoken_cpu``) built from the C++ sources here:

- ``scores.cpp``: ``decode_scores_headsum``, the decode scores of every scored layer in one op
  (``scoring/cpu_kernel.py`` wraps it);
- ``token_table.cpp``: ``register_tokens`` and ``fold_rows``, the Token Table's per-step writes (registering decode
  tokens, folding attention into policy state) in one op each (``TokenTable`` uses them for CPU tensors).

On a CPU the torch ops they replace cost tens of microseconds each right after a forward, and ops large enough to
run in parallel stall whenever another process holds the other core; a scored decode step ran about forty of them.
The kernels run on the calling thread for batches of the size a decode step has, and give the torch ops' results
(the Token Table's bit for bit, the scores up to float32 rounding). They are compiled on first use
(``torch.utils.cpp_extension``: a C++ compiler and ninja) and cached by torch under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``; one build per version of the sources); concurrent builds (several schedulers
starting at once) wait for one. Where they cannot be built, or with ``VTOKEN_SGLANG_CPU_KERNEL=0``, the torch ops
run instead, and a log line says so once.

    python -m vtoken_sglang.cpu_ops     # build them now (``scripts/setup.sh`` does)
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from vtoken_sglang.debug_switches import SWITCHES

logger = logging.getLogger("vtoken_sglang")

SOURCES = [Path(__file__).with_name(name) for name in ("scores.cpp", "token_table.cpp")]
FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno"]


def extension_name() -> str:
    """The build's name, by the sources and flags: two checkouts of different versions on one machine build and
    load their own (a shared name would have each rebuild the other's, and a process could load the other's ops)."""
    digest = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in SOURCES), " ".join(FLAGS).encode()]))
    return f"vtoken_cpu_ops_{digest.hexdigest()[:12]}"


_state: dict[str, bool] = {}


def load() -> bool:
    """True when ``torch.ops.vtoken_cpu`` is there (built or loaded on the first call); False where the kernels are
    switched off or cannot be built (one log line, the first time)."""
    if "ready" in _state:
        return _state["ready"]
    _state["ready"] = False
    if not SWITCHES.cpu_kernel:
        logger.info("[vtoken] CPU kernels off (VTOKEN_SGLANG_CPU_KERNEL=0): scoring and the Token Table use torch ops")
        return False
    t0 = time.perf_counter()
    try:
        import torch
        from torch.utils.cpp_extension import load as build

        build(extension_name(), sources=[str(p) for p in SOURCES], extra_cflags=FLAGS, is_python_module=False)
        torch.ops.vtoken_cpu.register_tokens  # noqa: B018 (raises if the library did not register its ops)
    except Exception as e:  # no compiler, no ninja, a build error: the torch ops do the same work, slower
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        # a build log is long: its first line's head and the compiler's error
        reason = lines[0] if len(lines) <= 2 else f"{lines[0].split(':')[0]}: {lines[-2]}"
        logger.warning("[vtoken] CPU kernels not built (%s): scoring and the Token Table use torch ops", reason)
        return False
    logger.info("[vtoken] CPU kernels ready in %.1f s (scoring, Token Table)", time.perf_counter() - t0)
    _state["ready"] = True
    return True
