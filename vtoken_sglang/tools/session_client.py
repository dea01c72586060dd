"""A client of one SGLang streaming session over HTTP (``/open_session`` with ``streaming``, ``/generate`` with
``session_params``, ``/close_session``), keeping the conversation the session holds: tests compare each turn with a
reference fed that conversation, benchmarks time each turn."""

from __future__ import annotations

import time


class Session:
    def __init__(self, server, name: str = "", timeout: float | None = None, streaming: bool = True):
        """``server``: a ``launcher.SglangServer`` (its ``post``); ``timeout``: the session's idle timeout (s).
        ``streaming=False``: no session, plain multi-turn chat (each turn sends the whole conversation)."""
        self.server, self.name, self.streaming = server, name, streaming
        body = {"capacity_of_str_len": 1 << 20, "streaming": True}
        if timeout is not None:
            body["timeout"] = timeout
        self.id = server.post("/open_session", body) if streaming else None
        self.history: list[int] = []  # the conversation the session holds: finished turns' inputs and outputs
        self.turns: list[tuple[list[int], list[int]]] = []  # per finished turn: (conversation before it, answer)
        self.meta: list[dict] = []  # per finished turn: SGLang's ``meta_info`` (``cached_tokens``, ``e2e_latency``)
        self.seconds: list[float] = []  # per finished turn: wall time of its request

    def turn(self, ids: list[int], new_tokens: int, rid: str | None = None, **sampling) -> list[int] | None:
        """One greedy turn appending ``ids`` (``ignore_eos``); its answer, or None if it was aborted."""
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True, **sampling}
        if self.streaming:
            body = {"input_ids": ids, "session_params": {"id": self.id}, "sampling_params": params}
        else:
            body = {"input_ids": self.history + ids, "sampling_params": params}
        if rid is not None:
            body["rid"] = rid
        start = time.perf_counter()
        out = self.server.post("/generate", body, timeout=900)
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            return None
        self.seconds.append(time.perf_counter() - start)
        prompt = self.history + ids
        self.turns.append((prompt, out["output_ids"]))
        self.meta.append(out["meta_info"])
        self.history = prompt + out["output_ids"]
        return out["output_ids"]

    @property
    def cached(self) -> list[int]:
        """Per finished turn, the prefix SGLang had cached (the tokens it did not prefill)."""
        return [m["cached_tokens"] for m in self.meta]

    def close(self) -> None:
        if self.streaming:
            self.server.post("/close_session", {"session_id": self.id})
