"""Messages between the scheduler and the compaction worker: versioned, multipart ZMQ frames, no pickle.

Frame 0 is a JSON header ``{"v": VERSION, "type": ..., ...scalars, "arrays": [[name, dtype, length], ...]}``; the
following frames are the raw little-endian bytes of those arrays, in order. ``decode`` checks everything a peer
could get wrong (version, type, JSON, array names, dtypes, lengths, frame count, value ranges that matter) and
raises ``ProtocolError`` with one line; the receiver logs it and drops the message.

- ``snapshot`` (scheduler -> worker): ``epoch``, ``page_size``, ``free_for_relocation``, ``num_rows`` (owners are
  below it: the planner's work and memory grow with the largest owner); arrays ``live`` (int32), ``owner`` (int32,
  ``>= TREE``), ``blocked`` (bool), one entry per page.
- ``plan`` (worker -> scheduler): ``epoch`` (of the snapshot it answers); arrays ``rows``, ``n_dst``, ``src_pages``,
  ``src_row`` (int64), ``src_live`` (int32).
- ``hello`` (worker -> scheduler, once at start): ``pid``; no arrays.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from vtoken_sglang.core.pages import TREE
from vtoken_sglang.core.planner import Plan, Snapshot

VERSION = 2  # 2: snapshots carry num_rows
SNAPSHOT_ARRAYS = Snapshot.ARRAYS
PLAN_ARRAYS = Plan.ARRAYS


class ProtocolError(ValueError):
    """A message that is not a valid message of this protocol version; ``str(err)`` is one line."""


def _wire(a: np.ndarray) -> memoryview:
    """The array's bytes as they go on the wire (little-endian, C order): a view of ``a`` itself when it already is
    that (the common case: no copy), else of one converted copy."""
    return memoryview(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))).cast("B")


def _frames(kind: str, scalars: dict, arrays: list[tuple[str, np.ndarray]], views: bool) -> list[bytes | memoryview]:
    header = {
        "v": VERSION,
        "type": kind,
        **scalars,
        "arrays": [[name, str(a.dtype), int(a.size)] for name, a in arrays],
    }
    body = [_wire(a) for _, a in arrays]
    return [json.dumps(header).encode()] + (body if views else [bytes(b) for b in body])


def _numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    return t.detach().cpu().numpy().astype(dtype, copy=False)  # a view of a CPU tensor of that dtype


def encode_snapshot(snap: Snapshot, num_rows: int) -> list[bytes | memoryview]:
    """The snapshot's frames (``num_rows``: the row store's rows; every owner is below it). The array frames are
    views of the snapshot's (CPU) tensors, not copies: send them before those tensors change (ZMQ copies a frame
    into its message when it is sent)."""
    arrays = [(n, _numpy(getattr(snap, n), d)) for n, d in SNAPSHOT_ARRAYS]
    return _frames(
        "snapshot",
        {
            "epoch": snap.epoch,
            "page_size": snap.page_size,
            "num_rows": num_rows,
            "free_for_relocation": snap.free_for_relocation,
        },
        arrays,
        views=True,
    )


def encode_plan(plan: Plan) -> list[bytes]:
    """The plan's frames, as ``bytes`` (picklable: TP ranks receive plans through a broadcast of these)."""
    arrays = [(n, _numpy(getattr(plan, n), d)) for n, d in PLAN_ARRAYS]
    return _frames("plan", {"epoch": plan.epoch}, arrays, views=False)


MAX_INT = (1 << 62) - 1  # scalar fields stay int64 wherever they go (numpy arithmetic with a larger one overflows)


def _int(header: dict, key: str, lo: int = 0, hi: int = MAX_INT) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def decode(frames: list[bytes] | list[memoryview]) -> tuple[str, dict, dict[str, np.ndarray]]:
    """``(type, header, arrays)`` of a well-formed message; raises ``ProtocolError`` otherwise."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = json.loads(bytes(frames[0]))
    except (ValueError, RecursionError) as err:  # not JSON, not text, an integer too long, nested too deep
        raise ProtocolError(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    if header.get("v") != VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}, expected {VERSION}")
    kind = header.get("type")
    spec = {"snapshot": SNAPSHOT_ARRAYS, "plan": PLAN_ARRAYS, "hello": ()}.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    declared = header.get("arrays", [])
    if not (
        isinstance(declared, list)
        and len(declared) == len(spec)
        and all(isinstance(d, list) and len(d) == 3 and tuple(d[:2]) == s for d, s in zip(declared, spec))
    ):
        raise ProtocolError(f"{kind}: arrays must be {[n for n, _ in spec]} with dtypes {[d for _, d in spec]}")
    if len(frames) != 1 + len(spec):
        raise ProtocolError(f"{kind}: {len(frames) - 1} array frames, expected {len(spec)}")
    arrays = {}
    for (name, dtype), decl, raw in zip(spec, declared, frames[1:]):
        n = decl[2]
        dt = np.dtype(dtype).newbyteorder("<")
        if not isinstance(n, int) or n < 0 or len(raw) != n * dt.itemsize:
            raise ProtocolError(f"{kind}: array {name} has {len(raw)} bytes, expected {n} x {dt.itemsize}")
        arrays[name] = np.frombuffer(raw, dtype=dt).astype(
            dtype, copy=True
        )  # owned, writable: to_plan and to_snapshot share it
    if kind == "hello":
        _int(header, "pid", 1)
        return kind, header, arrays
    _int(header, "epoch")
    if kind == "snapshot":
        _int(header, "page_size", 1, 1 << 16)
        _int(header, "free_for_relocation", 0, len(arrays["live"]))
        _int(header, "num_rows", 1, 1 << 31)
        if not len(arrays["live"]) == len(arrays["owner"]) == len(arrays["blocked"]):
            raise ProtocolError("snapshot: live, owner and blocked differ in length")
        if (arrays["live"] < 0).any() or (arrays["live"] > header["page_size"]).any():
            raise ProtocolError("snapshot: a live count is outside [0, page_size]")
        if len(arrays["owner"]) and (arrays["owner"].min() < TREE or arrays["owner"].max() >= header["num_rows"]):
            raise ProtocolError(f"snapshot: an owner is outside [{TREE}, num_rows)")
    else:
        if not Plan.lengths_agree({name: len(a) for name, a in arrays.items()}):
            raise ProtocolError("plan: per-request or per-page arrays differ in length")
    return kind, header, arrays


def check_plan_bounds(arrays: dict[str, np.ndarray], num_rows: int, num_pages: int) -> None:
    """A decoded plan's indices inside the row store and the pool (page ids ``0..num_pages``); ``ProtocolError``
    otherwise. In numpy, before any tensor is made: a plan arrives every few steps, and each torch reduction would
    cost the scheduler more than the whole check does here. The plan's structure (a row or page twice, too few
    destinations, negative counts) is the reclaimer's check, for plans from anywhere (``Reclaimer.validate``)."""
    for name, hi in (("rows", num_rows), ("src_row", num_rows), ("src_pages", num_pages + 1)):
        a = arrays[name]
        if a.size and (a.min() < 0 or a.max() >= hi):
            raise ProtocolError(f"plan: {name} outside [0, {hi})")


# ``decode``'s arrays are fresh copies of the frames (``astype``): the tensors below share them, nothing else does.


def to_snapshot(header: dict, arrays: dict[str, np.ndarray]) -> Snapshot:
    tensors = {name: torch.from_numpy(arrays[name]) for name, _ in SNAPSHOT_ARRAYS}
    return Snapshot(header["epoch"], header["page_size"], free_for_relocation=header["free_for_relocation"], **tensors)


def to_plan(header: dict, arrays: dict[str, np.ndarray], device: torch.device | str = "cpu") -> Plan:
    return Plan(header["epoch"], **{name: torch.from_numpy(arrays[name]).to(device) for name, _ in PLAN_ARRAYS})
