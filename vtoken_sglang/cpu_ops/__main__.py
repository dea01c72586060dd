"""``python -m vtoken_sglang.cpu_ops``: build vToken's CPU kernels now (exit 1 where they cannot be built)."""

import logging
import sys

from vtoken_sglang import cpu_ops
from vtoken_sglang.debug_switches import SWITCHES

logging.basicConfig(level=logging.INFO, format="%(message)s")
if not SWITCHES.cpu_kernel:
    print("cpu_ops: off (VTOKEN_SGLANG_CPU_KERNEL=0)")
elif not cpu_ops.load():
    print("cpu_ops: not built; scoring and the Token Table use torch ops on a CPU", file=sys.stderr)
    sys.exit(1)
else:
    print("cpu_ops: ready")
