"""The CPU scoring kernel (``cpu_scores.cpp``): ``layers_scores_headsum``'s contract in one op.

On a CPU the torch reference costs about twenty small ops per scored decode step; each costs tens of microseconds
right after a forward, and ops large enough to run in parallel stall whenever another process holds the second core.
The kernel does the same work in one op, on the calling thread for batches of the size a decode step has. It is
compiled here on first use (``torch.utils.cpp_extension``: a C++ compiler and ninja), cached by torch under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); concurrent builds (several schedulers starting at
once) wait for one. Where it cannot be built, or with ``VTOKEN_SGLANG_CPU_KERNEL=0``, scoring uses the torch
reference, and says so once. Results equal the reference's up to float32 rounding (summation order).

    python -m vtoken_sglang.scoring.cpu_kernel     # build it now (``scripts/setup.sh`` does)
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vtoken_sglang.scoring.reference import layers_scores_headsum

logger = logging.getLogger("vtoken_sglang")

SOURCE = Path(__file__).with_name("cpu_scores.cpp")
NAME = "vtoken_cpu_scores"
FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno"]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel takes (q and K of the same one)
ENABLED = os.environ.get("VTOKEN_SGLANG_CPU_KERNEL", "1") != "0"

_loaded: Callable[..., torch.Tensor] | None = None
_tried = False


def load() -> Callable[..., torch.Tensor] | None:
    """The kernel (``torch.ops.vtoken_cpu.decode_scores_headsum``, arguments as ``layers_scores_headsum``), built
    or loaded on the first call; None where it is switched off or cannot be built (one warning line, once)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    if not ENABLED:
        logger.info("[vtoken] CPU scoring kernel off (VTOKEN_SGLANG_CPU_KERNEL=0): scoring uses the torch reference")
        return None
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline(NAME, cpp_sources=[SOURCE.read_text()], is_python_module=False, extra_cflags=FLAGS)
        op = torch.ops.vtoken_cpu.decode_scores_headsum
    except Exception as e:  # no compiler, no ninja, a build error: the reference does the same work, slower
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        # a build log is long: its first line's head and the compiler's error
        reason = lines[0] if len(lines) <= 2 else f"{lines[0].split(':')[0]}: {lines[-2]}"
        logger.warning("[vtoken] CPU scoring kernel not built (%s): scoring uses the torch reference", reason)
        return None
    logger.info("[vtoken] scoring on CPU: the C++ kernel (ready in %.1f s)", time.perf_counter() - t0)

    def kernel(q, k_buffers, slots, live_len, scale, logit_cap=0.0):
        k_buffers = list(k_buffers)
        if q.dtype not in DTYPES or k_buffers[0].dtype != q.dtype:  # e.g. an fp8 KV cache: the reference converts
            return layers_scores_headsum(q, k_buffers, slots, live_len, scale, logit_cap)
        return op(q, k_buffers, slots, live_len, float(scale), float(logit_cap))

    _loaded = kernel
    return kernel


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not ENABLED:
        print("cpu_kernel: off (VTOKEN_SGLANG_CPU_KERNEL=0)")
        return 0
    if load() is None:
        print("cpu_kernel: not built; scoring on CPU uses the torch reference", file=sys.stderr)
        return 1
    print("cpu_kernel: ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
