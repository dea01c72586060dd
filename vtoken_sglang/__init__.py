"""vtoken-sglang: SGLang with vToken (token-level KV virtualization with page reclaim).

Subpackages:

- ``core``: the engine-agnostic runtime (page accounting, Token Table, planner, copy engines, reclaimer,
  invariants); torch only, no sglang import.
- ``integration``: the SGLang plugin, the only code that touches SGLang, through its plugin hooks.
- ``policies``: the eviction policies behind one interface, and the registry of built-in ones.
- ``scoring``: attention-score collection for the score policies (torch reference, Triton, the CPU kernel).
- ``worker``: the compaction worker, planning reclaim in its own process over ZMQ.
- ``cpu_ops``: vToken's C++ CPU kernels (scoring, the Token Table's per-step writes), built on first use.
- ``tools``: tooling never imported by the runtime: the server launcher, the router, the load generator, the model
  builders (tiny, recall, real checkpoints) and the real-text tasks.

Beside them, ``config`` declares the user-facing options once. Importing this package imports neither torch nor
sglang.
"""

__version__ = "0.1.0"
