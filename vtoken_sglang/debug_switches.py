"""vToken's debug switches: the environment variables ``VTOKEN_SGLANG_*`` that turn on a check, a log or a
slower path, read once per process (at this module's first import) into one frozen ``DebugSwitches``,
``SWITCHES``. Every module asks ``SWITCHES``; none reads these variables itself. A spawned process inherits the
environment, so one export reaches every scheduler.

``TRITON_INTERPRET`` is Triton's own; vToken reads it here, once, like its own.

Not switches (channels between processes, read where they are used): ``VTOKEN_SGLANG_CONFIG`` (the configuration
the launcher passes on), ``VTOKEN_SGLANG_REFUSAL_FILE`` (a scheduler's refusal back to its launcher) and
``VTOKEN_SGLANG_MANIFEST`` (another patch manifest to check against).

Imports neither torch nor sglang.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

PREFIX = "VTOKEN_SGLANG_"


@dataclasses.dataclass(frozen=True)
class DebugSwitches:
    check_integrity: bool = False  # CHECK_INTEGRITY=1: the core's integrity check every few rounds and at idle
    check_integrity_every: int = 8  # CHECK_INTEGRITY_EVERY: trimming rounds between two checks
    check_positions: bool = False  # CHECK_POSITIONS=1: decode positions against SGLang's request bookkeeping
    count_host_reads: bool = False  # COUNT_HOST_READS=1: device-to-host reads of the hooks, per decode step
    fence_delay: int = 0  # FENCE_DELAY=N: the CPU copy engine's fences report done up to N queries late
    fence_seed: int = 0  # FENCE_SEED: the seed of those delays (combined with the TP rank)
    score_dump: str | None = None  # SCORE_DUMP=PATH: the first request's scores per scored step, written at idle
    victim_log: str | None = None  # VICTIM_LOG=PATH: every eviction decision as JSON lines
    cpu_kernel: bool = True  # CPU_KERNEL=0: torch ops instead of the C++ CPU kernels
    # TRITON_INTERPRET=1 (Triton's own switch, read here too): Triton kernels run interpreted on CPU tensors, so a
    # CPU server on SGLang's Triton attention backend runs the GPU path; vToken's scoring then takes it too
    triton_interpret: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> DebugSwitches:
        """The switches ``env`` sets; unset ones keep their defaults. A malformed number raises ``SystemExit``
        with one line naming the variable."""

        def text(name: str) -> str | None:
            return env.get(PREFIX + name) or None

        def number(name: str, default: int) -> int:
            value = text(name)
            if value is None:
                return default
            try:
                return int(value)
            except ValueError:
                raise SystemExit(f"error: ${PREFIX}{name} must be an integer, got {value!r}") from None

        return cls(
            check_integrity=text("CHECK_INTEGRITY") == "1",
            check_integrity_every=max(number("CHECK_INTEGRITY_EVERY", cls.check_integrity_every), 1),
            check_positions=text("CHECK_POSITIONS") == "1",
            count_host_reads=text("COUNT_HOST_READS") == "1",
            fence_delay=number("FENCE_DELAY", cls.fence_delay),
            fence_seed=number("FENCE_SEED", cls.fence_seed),
            score_dump=text("SCORE_DUMP"),
            victim_log=text("VICTIM_LOG"),
            cpu_kernel=text("CPU_KERNEL") != "0",
            triton_interpret=env.get("TRITON_INTERPRET") == "1",
        )


SWITCHES = DebugSwitches.from_env()
