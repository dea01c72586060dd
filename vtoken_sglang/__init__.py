"""vtoken-sglang: SGLang with vToken (token-level KV virtualization with page reclaim).

Subpackages: ``core`` (engine-agnostic runtime, no sglang import), ``integration`` (the SGLang plugin).
Importing this package imports neither torch nor sglang.
"""

__version__ = "0.1.0"
