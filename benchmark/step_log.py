"""Per decode step figures read from a server's log (``--decode-log-interval 1``, logging rank only).

SGLang's decode line gives the step's running requests, the KV slots in use (``#token``: the pool less its free
slots and the radix tree's evictable ones) and the queue. With a policy that evicts, vToken logs its own line right
after it at the same step: the live tokens of the rows it tracks and the pages those rows hold. A vToken line is
paired with the decode line before it: either every decode line has one, or none has (plain SGLang, policy
none), and then there are no live figures. Summaries are over the steps with at least one running request.
"""

from __future__ import annotations

import dataclasses
import re

DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+), #token: (\d+),.*?#queue-req: (\d+)")
VTOKEN_LINE = re.compile(r"\[vtoken\] live: (\d+), dead: \d+, pages: (\d+)")


@dataclasses.dataclass(frozen=True)
class StepSeries:
    """One value per logged decode step, in order; ``live`` and ``tracked_pages`` are empty for a log without vToken
    lines, else as long as ``running``."""

    running: list[int]
    held_tokens: list[int]
    queued: list[int]
    live: list[int]
    tracked_pages: list[int]

    def held_pages(self, page: int) -> list[float]:
        """KV pages in use at each step (SGLang's slots in use over the page size)."""
        return [t / page for t in self.held_tokens]

    def summary(self, page: int) -> dict[str, float | int | None]:
        """``mean_held_pages`` (pages in use, averaged over the steps), ``pages_per_request`` (pages in use over
        running requests, averaged over the steps: what a request retains), ``utilisation`` (live tokens over the
        KV slots in use, summed over the steps; None without vToken lines) and ``steps``. ``tracked_pages`` is no
        measure of use: with reclaim off vToken tracks only some of a row's pages."""
        busy = [i for i, n in enumerate(self.running) if n > 0]
        if not busy:
            return {"steps": 0, "mean_held_pages": None, "pages_per_request": None, "utilisation": None}
        held = self.held_pages(page)
        slots = sum(self.held_tokens[i] for i in busy) if self.live else 0
        return {
            "steps": len(busy),
            "mean_held_pages": round(sum(held[i] for i in busy) / len(busy), 1),
            "pages_per_request": round(sum(held[i] / self.running[i] for i in busy) / len(busy), 2),
            "utilisation": round(sum(self.live[i] for i in busy) / slots, 3) if slots else None,
        }

    def as_json(self) -> dict[str, list[int]]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v}


def read_steps(log: str) -> StepSeries:
    """The decode steps of ``log`` in order, each vToken line attached to the decode line before it."""
    running: list[int] = []
    held: list[int] = []
    queued: list[int] = []
    live: dict[int, int] = {}
    pages: dict[int, int] = {}
    for line in log.splitlines():
        if m := DECODE_LINE.search(line):
            running.append(int(m[1]))
            held.append(int(m[2]))
            queued.append(int(m[3]))
        elif (m := VTOKEN_LINE.search(line)) and running:
            live[len(running) - 1] = int(m[1])
            pages[len(running) - 1] = int(m[2])
    if live and len(live) != len(running):
        raise ValueError(f"{len(live)} vToken lines for {len(running)} decode lines: not one per step")
    steps = range(len(running)) if live else range(0)
    return StepSeries(running, held, queued, [live[i] for i in steps], [pages[i] for i in steps])
