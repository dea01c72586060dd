"""``RequestLengths``: the lengths of SGLang's requests that admission reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestLengths:
    """SGLang's requests' lengths as admission reads them, read in this one place: ``held`` (KV tokens the row holds
    now: its live length, ``kv_committed_len``), ``logical`` (prompt + output so far), ``remaining`` (new tokens
    still to come), ``protected`` (tokens in locked tree pages, ``cache_protected_len``), ``final`` (prompt +
    ``max_new_tokens``), ``ignore_eos``. Arrays of one length, one entry per request."""

    held: np.ndarray
    logical: np.ndarray
    remaining: np.ndarray
    protected: np.ndarray
    final: np.ndarray
    ignore_eos: np.ndarray  # bool

    @classmethod
    def of(cls, reqs: Sequence) -> RequestLengths:
        """The lengths of ``reqs`` (SGLang's ``Req``, running or admitted)."""
        n = len(reqs)

        def column(values, dtype=np.int64) -> np.ndarray:
            return np.fromiter(values, dtype=dtype, count=n)

        prompt = column(len(r.origin_input_ids) for r in reqs)
        output = column(len(r.output_ids) for r in reqs)
        max_new = column(r.sampling_params.max_new_tokens for r in reqs)
        return cls(
            held=column(r.kv.kv_committed_len for r in reqs),
            logical=prompt + output,
            remaining=max_new - output,
            protected=column(r.kv.cache_protected_len for r in reqs),
            final=prompt + max_new,
            ignore_eos=column((r.sampling_params.ignore_eos for r in reqs), dtype=bool),
        )
