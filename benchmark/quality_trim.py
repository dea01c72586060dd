"""Why a policy keeps or loses the answer: one trim of the recall model's cache, offline, scored several ways.

    .venv/bin/python benchmark/quality_trim.py [--quick] [--ratios R ...] [--prompts N]

The recall model in transformers (``tests/masked_reference.py``: the evicted positions masked from every later
query), trimmed as the server trims a request at its first eviction round: after decode step 1 (the first two
answer tokens are computed with the whole prompt), down to ``ceil(ratio x length)`` tokens, the 4 sinks and 8
newest kept. What decides the victims:

- ``h2o``: the attention of decode step 1's query (mean over layers and heads): what the served h2o has then;
- ``h2o+prompt``: the same plus every prompt query's attention (H2O as its paper accumulates it);
- ``random``: a seeded draw;
- ``oracle``: the asked needle's tokens kept first (what any policy could at best do at that budget).

Per ratio: the share of prompts whose answer is still exactly right.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))

from masked_reference import load, masked_greedy  # noqa: E402
from quality import RECENT, SINKS  # noqa: E402

from vtoken_sglang.tools import recall_model  # noqa: E402

WAYS = ("h2o", "h2o+prompt", "random", "oracle")


def trimmed_right(model, p: recall_model.RecallPrompt, ratio: float, spec, gen: torch.Generator) -> dict[str, bool]:
    """For each way of scoring: is the answer right after the one trim?"""
    length = len(p.ids) + 1  # the prompt and the first answer token, after decode step 1
    with torch.no_grad():
        att = model(torch.tensor([p.ids + p.answer[:1]]), output_attentions=True).attentions
    mean = torch.stack([a[0] for a in att]).mean((0, 1))  # [T, T], mean over layers and heads
    needle = torch.zeros(length)
    needle[p.needle_at : p.needle_at + 1 + spec.value_len] = 1.0
    scores = {
        "h2o": mean[-1],
        "h2o+prompt": mean[:-1].sum(0) + mean[-1],
        "random": torch.rand(length, generator=gen),
        "oracle": needle,
    }
    budget = max(math.ceil(ratio * length), SINKS + RECENT)
    candidates = torch.arange(SINKS, length - RECENT)
    out = {}
    for way, score in scores.items():
        order = candidates[torch.argsort(score[candidates], stable=True)]  # lowest first, ties: older first
        victims = order[: length - budget].tolist()
        out[way] = masked_greedy(model, p.ids, p.answer, [(length, victims)]) == p.answer
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick recall model")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    ap.add_argument("--prompts", type=int, default=64)
    args = ap.parse_args(argv)
    spec = recall_model.QUICK if args.quick else recall_model.RecallSpec()
    model = load(str(recall_model.build(spec=spec)))
    prompts = recall_model.RecallTask(spec, spec.seed + 3).prompts(args.prompts)
    head = f"one trim after decode step 1: {args.prompts} prompts of {spec.context} tokens"
    print(f"{head}, sinks {SINKS}, recent {RECENT}")
    print(f"{'ratio':>6}" + "".join(f"{w:>12}" for w in WAYS))
    for ratio in args.ratios:
        gen = torch.Generator().manual_seed(0)
        right = dict.fromkeys(WAYS, 0)
        for p in prompts:
            for way, ok in trimmed_right(model, p, ratio, spec, gen).items():
                right[way] += ok
        print(f"{ratio:>6}" + "".join(f"{right[w] / len(prompts):>12.3f}" for w in WAYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
