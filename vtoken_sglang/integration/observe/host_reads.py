"""Device-to-host reads made by vToken's hooks, counted per decode step (debug: ``VTOKEN_SGLANG_COUNT_HOST_READS=1``).

On a GPU, reading a device tensor's value on the host waits for everything queued before it on the stream: under
SGLang's overlap scheduler, a read between two forwards is a stall of the pipeline. Those reads are: ``bool()``,
``int()``, ``float()``, ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to()`` from a device to the
CPU, and the ops whose output size depends
on the data (``nonzero``, boolean-mask indexing and assignment, ``unique``, ``masked_select``,
``repeat_interleave`` without ``output_size``). Upstream SGLang's decode step reads none outside the point where
it takes the sampled tokens; what vToken adds is what this counts.

How: every serving hook is wrapped by ``counted`` (with the mode on only), which runs vToken's own code under a
``TorchFunctionMode`` that counts those calls; the upstream call an AROUND hook wraps is not counted. Every tensor
counts (on CPU there is no other device to tell host tensors from), except through ``host_array`` (the view of a
tensor SGLang keeps on the host by contract: ``seq_lens_cpu``, ``req_pool_indices_cpu``; it asserts that it is on
the CPU), ``on_host`` (a tensor rule applied to host arrays) and ``uncounted`` (debug checks). A *step* is the
interval between two eviction rounds (one decode iteration: the round, then the next batch's preparation and
forward); it is *quiet* if in it vToken neither trimmed, nor applied, dropped or released a plan, nor sent a
snapshot, nor reclaimed under pressure, nor started or ended a managed request. Reads made to report metrics
(``REPORTING`` hooks) are counted per hook only; ``host_reads_quiet_where`` names the reads of quiet steps.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from vtoken_sglang.debug_switches import SWITCHES

# Hooks that read to report (SGLang's decode log cadence, /get_server_info, idle): counted per hook, not per step.
REPORTING = frozenset({"log_decode_metrics", "add_server_info", "settle_at_idle"})
_VALUE_READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy"}
_DATA_SIZED = {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "_unique2"}


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def is_host_read(func, args: tuple, kwargs: dict) -> bool:
    """Whether this torch call reads data on the host (or sizes its output by the data)."""
    name = getattr(func, "__name__", "")
    if name in _VALUE_READS or name in _DATA_SIZED:
        return True
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        return _has_bool_index(args[1])
    if name == "repeat_interleave":
        return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) and (
            kwargs.get("output_size") is None
        )
    if name == "to" and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
        targets = [*args[1:], kwargs.get("device")]
        return any((isinstance(t, str) and t.startswith("cpu")) or getattr(t, "type", None) == "cpu" for t in targets)
    return False


class HostReads(TorchFunctionMode):
    def __init__(self, enabled: bool) -> None:
        super().__init__()
        self.enabled = enabled  # off: ``counted`` leaves every hook as it is and nothing counts
        self.counting = False
        self.depth = 0  # hooks running (an AROUND hook's upstream call may run another hook)
        self.hook = ""
        self.by_hook: dict[str, dict[str, int]] = {}  # hook -> torch function -> reads
        self.step = 0  # reads in the current step
        self.step_reads: dict[str, int] = {}  # the current step's reads by "hook.function"
        self.quiet_reads: dict[str, int] = {}  # reads made in quiet steps, by "hook.function" (what to remove)
        self.steps = 0
        self.quiet_steps = 0
        self.quiet_max = 0
        self.busy_max = 0
        self.total = 0
        self.last_activity: tuple = ()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting and is_host_read(func, args, kwargs):
            per_hook = self.by_hook.setdefault(self.hook, {})
            name = getattr(func, "__name__", "?")
            per_hook[name] = per_hook.get(name, 0) + 1
            if self.hook not in REPORTING:
                self.step += 1
                where = f"{self.hook}.{name}"
                self.step_reads[where] = self.step_reads.get(where, 0) + 1
        return func(*args, **kwargs)

    def counted(self, kind: str, fn: Callable) -> Callable:
        """``fn`` (a hook of ``kind``) with its reads counted; ``fn`` itself when the mode is off."""
        if not self.enabled:
            return fn
        name = fn.__name__

        def run(call, *args, **kwargs):
            prev = (self.counting, self.hook)
            self.counting, self.hook = True, name
            self.depth += 1
            try:
                if self.depth == 1:
                    with self:
                        return call(*args, **kwargs)
                return call(*args, **kwargs)
            finally:
                self.depth -= 1
                self.counting, self.hook = prev

        if kind == "AROUND":

            @functools.wraps(fn)
            def around(original, *args, **kwargs):
                def upstream(*a, **kw):
                    prev, self.counting = self.counting, False
                    try:
                        return original(*a, **kw)
                    finally:
                        self.counting = prev

                return run(fn, upstream, *args, **kwargs)

            return around

        @functools.wraps(fn)
        def plain(*args, **kwargs):
            return run(fn, *args, **kwargs)

        return plain

    def end_step(self, activity: tuple) -> None:
        """Close the step that ran since the last call (the eviction round calls it first thing). ``activity``:
        counters that any work of a busy step advances; the step was quiet if they did not move."""
        quiet, self.last_activity = activity == self.last_activity, activity
        self.steps += 1
        self.total += self.step
        if quiet:
            self.quiet_steps += 1
            self.quiet_max = max(self.quiet_max, self.step)
            for where, n in self.step_reads.items():
                self.quiet_reads[where] = self.quiet_reads.get(where, 0) + n
        else:
            self.busy_max = max(self.busy_max, self.step)
        self.step = 0
        self.step_reads = {}

    def metrics(self) -> dict:
        if not self.enabled:
            return {}
        return {
            "host_reads_steps": self.steps,
            "host_reads_quiet_steps": self.quiet_steps,
            "host_reads_quiet_max": self.quiet_max,
            "host_reads_busy_max": self.busy_max,
            "host_reads_per_step": round(self.total / max(self.steps, 1), 3),
            "host_reads_quiet_where": dict(self.quiet_reads),
        }


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Reads that are not the step's own: host work on host arrays, and debug checks that exist only to be run
    with a check switch on (``VTOKEN_SGLANG_CHECK_POSITIONS``)."""
    prev, HOST_READS.counting = HOST_READS.counting, False
    try:
        yield
    finally:
        HOST_READS.counting = prev


def host_array(t: torch.Tensor) -> np.ndarray:
    """The values of a tensor SGLang keeps on the host by contract (``*_cpu``), as a NumPy view: not a device read,
    so not counted."""
    assert t.device.type == "cpu", "host_array of a device tensor"
    if not HOST_READS.enabled:  # nothing counts
        return t.numpy()
    with uncounted():
        return t.numpy()


def on_host(fn: Callable, *arrays: np.ndarray) -> np.ndarray:
    """``fn``, a function of tensors, applied to host arrays (as CPU tensors) and its result as an array: host
    work, not counted. How the host mirrors use a rule written once for tensors (a policy's budget)."""
    with uncounted():
        return fn(*(torch.from_numpy(a) for a in arrays)).numpy()


HOST_READS = HostReads(SWITCHES.count_host_reads)
