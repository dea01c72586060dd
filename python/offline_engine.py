"""Offline batch generation with an embedded ``sgl.Engine`` and vToken on (no HTTP server).

    python python/offline_engine.py [--model-path DIR] [--vtoken-policy none] [--prompts 8]

vToken's options are plain keyword arguments of ``sgl.Engine`` (``enable_vtoken=True, vtoken_policy=...``).
Prints one JSON object: the engine's vToken configuration and the generated token ids per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import sglang as sgl

PROMPTS = [
    "The page table maps each token to a slot.",
    "def evict(cache, budget):",
    "Memory is the scarce resource of serving.",
    "When a request ends its pages are freed,",
    "A heavy hitter is a token that many queries attend to.",
    "The scheduler admits a request if",
    "Reclaim moves live tokens out of sparse pages.",
    "The recent window keeps the last tokens.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="model directory (default: the project's tiny model)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--vtoken-policy", default="none")
    ap.add_argument("--vtoken-budget-ratio", type=float, default=None)
    ap.add_argument("--no-vtoken", action="store_true", help="plain SGLang, for comparison")
    args = ap.parse_args(argv)
    model = args.model_path
    if model is None:
        from vtoken_sglang.tools.tiny_model import build

        model = str(build())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs: dict = dict(model_path=model, max_total_tokens=8192, dtype="float32")
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        kwargs.update(device="cpu", attention_backend="torch_native")
    if not args.no_vtoken:
        kwargs.update(enable_vtoken=True, vtoken_policy=args.vtoken_policy)
        if args.vtoken_budget_ratio is not None:
            kwargs["vtoken_budget_ratio"] = args.vtoken_budget_ratio
    engine = sgl.Engine(**kwargs)
    try:
        prompts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[: args.prompts]
        outs = engine.generate(prompts, {"max_new_tokens": args.max_new_tokens, "temperature": 0.0})
        result = {
            "vtoken_config": getattr(engine.server_args, "_vtoken_config", None),
            "page_size": engine.server_args.page_size,
            "outputs": [{"prompt": p, "output_ids": o["output_ids"], "text": o["text"]} for p, o in zip(prompts, outs)],
        }
    finally:
        engine.shutdown()
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
