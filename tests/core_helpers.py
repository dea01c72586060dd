"""Helpers for core tests: the small engine over real K/V tensors whose bytes encode (row, logical id)
(``vtoken_sglang.tools.kv_engine``, shared with ``benchmark/gpu_check.py`` and ``benchmark/reclaim_sim.py``)."""

from vtoken_sglang.tools.kv_engine import KVEngine as MiniEngine
from vtoken_sglang.tools.kv_engine import stamp

__all__ = ["MiniEngine", "stamp"]
