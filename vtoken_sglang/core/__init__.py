"""The engine-agnostic vToken runtime: torch only, no ``sglang`` import anywhere below this package.

- ``pages.PageAccounting`` (the pool interface) and ``pages.PagePool`` (its own free list): page ownership, live
  counts, free list with a relocation reserve
- ``token_table.TokenTable``: per request, the slots of its live tokens in logical order; per KV slot, the token's
  logical position, policy state and readers; eviction (rows compacted) and the policy-facing API
- ``planner``: snapshot -> reclaim plan (pure) and token-level packing
- ``copy_engine``: K/V relocation (CPU synchronous, CUDA on a side stream) with deferred release
- ``reclaimer.Reclaimer``: plan -> validate -> copy -> publish -> release, the loop an engine calls
- ``integrity.check_integrity``: invariants I1-I4 and page accounting
"""
