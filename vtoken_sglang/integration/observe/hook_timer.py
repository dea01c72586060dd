"""Host time spent inside vToken's serving hooks, per scheduler process (``hook_ms`` in the metrics).

Every serving hook is registered through ``timed(kind, fn)``: BEFORE/AFTER hooks are timed whole; an AROUND hook
is timed without the upstream call it wraps (the ``original`` it receives is timed and subtracted). Nested hooks
(an AROUND hook whose upstream call runs another hook) are counted once: the inner hook's time is inside the
subtracted upstream call and counted by the inner hook itself. ``by_hook``: the same time per hook function (where
vToken's time goes; ``/get_server_info`` shows it as ``hook_ms_by_hook``). Cost: two ``perf_counter`` calls and a
dict update per hook call.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable


class HookTimer:
    def __init__(self) -> None:
        self.ms = 0.0
        self.calls = 0
        self.by_hook: dict[str, float] = {}

    def _add(self, name: str, seconds: float) -> None:
        self.ms += seconds * 1e3
        self.calls += 1
        self.by_hook[name] = self.by_hook.get(name, 0.0) + seconds * 1e3

    def timed(self, kind: str, fn: Callable) -> Callable:
        name = fn.__name__
        if kind == "AROUND":

            @functools.wraps(fn)
            def around(original, *args, **kwargs):
                inner = 0.0

                def upstream(*a, **kw):
                    nonlocal inner
                    t = time.perf_counter()
                    try:
                        return original(*a, **kw)
                    finally:
                        inner += time.perf_counter() - t

                t0 = time.perf_counter()
                try:
                    return fn(upstream, *args, **kwargs)
                finally:
                    self._add(name, time.perf_counter() - t0 - inner)

            return around

        @functools.wraps(fn)
        def plain(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(name, time.perf_counter() - t0)

        return plain


TIMER = HookTimer()
