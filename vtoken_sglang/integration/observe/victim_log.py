"""Debug: every eviction decision of a scheduler as JSON lines, for references that replay what the model saw.

``VTOKEN_SGLANG_VICTIM_LOG=PATH``: each eviction round appends, per request it evicted from, one line
``{"rid", "tp_rank", "next_position", "evicted"}``: ``evicted`` holds the logical positions of the tokens made
dead, ``next_position`` the logical position of the row's next token (the first query that no longer sees them).
So the query at logical position ``q`` of request ``rid`` attends to every position ``<= q`` except those evicted
on lines with ``next_position <= q`` (prompt and decode tokens alike). A streaming session's turn adds
``"session"``: its positions are the conversation's, and a session's lines are read together
(``read(..., by="session")``). Off by default: the lines cost device reads and a Python loop over the trimmed
requests.
"""

from __future__ import annotations

import json
import os

import torch

from vtoken_sglang.debug_switches import SWITCHES


def record(reqs: list, rows: torch.Tensor, next_positions: torch.Tensor, vr: torch.Tensor, logical: torch.Tensor):
    """Append the victims of one round: ``reqs[i]`` holds row ``rows[i]`` whose next token is at
    ``next_positions[i]``; the round's victims are the rows ``vr`` and logical positions ``logical``."""
    from sglang.srt.runtime_context import get_parallel

    rank = get_parallel().tp_rank
    vr, logical = vr.cpu(), logical.cpu()
    lines = []
    for req, row, nxt in zip(reqs, rows.tolist(), next_positions.tolist()):
        evicted = sorted(logical[vr == row].tolist())
        if evicted:
            line = {"rid": req.rid, "tp_rank": rank, "next_position": nxt, "evicted": evicted}
            session = getattr(req, "session", None)
            if session is not None and session.streaming:
                line["session"] = session.session_id
            lines.append(line)
    with open(SWITCHES.victim_log, "a") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def record_reset(session_id: str) -> None:
    """A streaming session's record was dropped with its aborted turn (upstream's rule): its next turn prefills the
    conversation again, every position live. One line ``{"session", "tp_rank", "reset": true}``."""
    from sglang.srt.runtime_context import get_parallel

    with open(SWITCHES.victim_log, "a") as f:
        f.write(json.dumps({"session": session_id, "tp_rank": get_parallel().tp_rank, "reset": True}) + "\n")


def read(path: str | os.PathLike, tp_rank: int = 0, by: str = "rid") -> dict[str, list[tuple[int, list[int]]]]:
    """rid (``by="session"``: session id, turns of no session left out) -> ``[(next_position, evicted), ...]`` in
    round order, as ``tp_rank`` wrote them; a session's reset line drops its lines before it."""
    events: dict[str, list[tuple[int, list[int]]]] = {}
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e["tp_rank"] != tp_rank or by not in e:
                continue
            if e.get("reset"):
                events[e[by]] = []
            else:
                events.setdefault(e[by], []).append((e["next_position"], e["evicted"]))
    return events
