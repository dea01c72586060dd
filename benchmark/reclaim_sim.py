"""Reclaim simulator: drives the real vToken core (PagePool, TokenTable, policies, Reclaimer) through prefill and
decode of many requests, Naive-Evict against vToken, and prints the paper's memory table.

    .venv/bin/python benchmark/reclaim_sim.py [--quick] [--json PATH] [--theta 0.25]

Nothing is re-implemented here: eviction, page accounting, planning and relocation are the core's own code; the
K/V buffers are real (small) tensors so copies really happen.

Scenario "memory" (the paper's setting): N requests with CONTEXT-token prompts, page 16; each policy at eviction
ratios 0.3/0.5/0.7 (``evict_ratio`` = fraction of each request's tokens evicted; budget ratio = 1 - it); prefill,
evict to budget, then DECODE steps with eviction in batches (slack 16). Naive-Evict frees only pages that became
empty; vToken also runs the reclaimer each step (theta, reserve, low watermark). Recorded at the end: resident
pages, the lower bound sum(ceil(live / P)); mean_F = mean over all steps (the prefill eviction and every decode
step) of F = 1 - mean utilization of allocated pages, sampled after the step (pages awaiting release count);
page_live_hist = how many allocated pages hold 0, 1, ..., P live tokens at the end (benchmark/plots.py draws it).

Scenario "capacity": a fixed page budget; C requests arrive together, are prefilled round-robin in chunks of
CHUNK tokens with eviction (and, for vToken, reclaim) after each chunk, then decode together. ``capacity`` is the
largest C that runs to the end without running out of pages (binary search). The frontier repeats it at the
paper's budgets (5427 and 11519 pages; scaled by CONTEXT / 16384 in --quick).

Synthetic attention for score-based policies (documented model, deterministic): token t of request r has a fixed
heavy-tailed importance w = u^(-1/1.2) (Pareto, u uniform from a hash of (r, t)); the attention of step s is
proportional to w * (1 + 0.3 * noise(r, t, s)) * (1 + 2 * exp(-(len - t) / 64)) (a recency bump), normalized over
the live tokens. Both modes see the same scores, so they evict the same victims. SnapKV observes only the prefill
(its window: the prompt's attention of that step; each chunk re-ranks the prompt so far) and, as in the paper,
evicts prompt tokens first; tova ranks by the last step alone, h2o by the sum, scissorhands by persistence.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtoken_sglang.core.pages import OutOfPages, PagePool  # noqa: E402
from vtoken_sglang.policies import PolicyConfig, make_policy  # noqa: E402
from vtoken_sglang.policies.random import mix_hash  # noqa: E402
from vtoken_sglang.tools.kv_engine import KVEngine  # noqa: E402

PAGE = 16
PAPER_BUDGETS = (5427, 11519)


@dataclasses.dataclass(frozen=True)
class Setting:
    requests: int = 16
    context: int = 16384
    decode: int = 256
    chunk: int = 1024
    slack: int = 16
    sinks: int = 4
    recent: int = 64
    theta: float = 0.05
    reserve: int = 8
    rounds: int = 8
    score_every: int = 1
    seed: int = 0


def synthetic_attention(
    rows: torch.Tensor, logical: torch.Tensor, valid: torch.Tensor, logical_len: torch.Tensor, step: int
) -> torch.Tensor:
    u = (mix_hash(12345, rows, logical).to(torch.float64) + 1) / float(1 << 62)
    w = u.clamp(min=1e-12).pow(-1 / 1.2)
    noise = (mix_hash(777 + step, rows, logical).to(torch.float64) / float(1 << 62)) * 2 - 1
    recency = 1 + 2 * torch.exp(-(logical_len[:, None] - logical).to(torch.float64) / 64)
    a = (w * (1 + 0.3 * noise) * recency).masked_fill(~valid, 0)
    return (a / a.sum(1, keepdim=True)).to(torch.float32)


class Sim:
    """One engine: pool + table + policy (+ reclaimer when vToken)."""

    def __init__(self, s: Setting, policy: str, evict_ratio: float, mode: str, num_pages: int, rows: int):
        self.s, self.mode = s, mode
        self.policy = make_policy(
            policy,
            PolicyConfig(budget_ratio=1 - evict_ratio, sinks=s.sinks, recent=s.recent, slack=s.slack, seed=s.seed),
        )
        # relocation leaves the engine one step of allocations: a page per request (decode) and a prefill chunk
        keep = rows + s.chunk // PAGE + 1
        # and compacts regardless of theta once free pages fall to that level (the low watermark)
        # The simulated engine is synchronous (no forward in flight reads the old rows), so sources are freed
        # right after their copy (grace 0); SGLang's overlap scheduler needs grace 1 (see the integration).
        # K/V: one layer of small float16 buffers (copies really happen; no stamps are written).
        eng = KVEngine(
            num_pages,
            PAGE,
            rows,
            s.context + s.decode + 8,
            reserve=s.reserve if mode == "vtoken" else 0,
            state_names=self.policy.state_names,
            layers=1,
            width=2,
            dtype=torch.float16,
            theta=s.theta,
            reclaim=mode == "vtoken",
            keep_free=keep,
            low_watermark=keep,
            grace_steps=0,
            max_rounds=s.rounds,
        )
        self.pool, self.table, self.reclaimer = eng.pool, eng.table, eng.reclaimer
        self.f_samples: list[float] = []
        self.step_no = 0

    def write(self, rows: torch.Tensor, n: int) -> None:
        self.table.append(rows, torch.full((len(rows),), n, dtype=torch.int64))

    def observe(self, rows: torch.Tensor, prefill: bool) -> None:
        if not self.policy.needs_scores or (not prefill and self.step_no % self.s.score_every):
            return
        t = self.table
        width = int(t.live_len[rows].max())
        valid = torch.arange(width)[None, :] < t.live_len[rows][:, None]
        attn = synthetic_attention(
            rows.to(torch.int64), t.row_logical(rows, width).to(torch.int64), valid, t.logical_len[rows], self.step_no
        )
        self.policy.observe(t, rows, attn, prefill=prefill)

    def evict_and_reclaim(self, rows: torch.Tensor) -> None:
        vr, vc = self.policy.select_victims(self.table, rows)
        self.pool.free(self.table.evict(vr, vc))
        self.reclaimer.step()
        self.f_samples.append(self.pool.fragmentation())  # pages awaiting release count as held
        self.step_no += 1


def page_live_hist(pool: PagePool) -> list[int]:
    """How many allocated (private) pages hold 0, 1, ..., page_size live tokens: page_size + 1 counts."""
    live = pool.live[pool.private_mask()].to(torch.int64)
    return torch.bincount(live, minlength=pool.page_size + 1).tolist()


def memory_run(s: Setting, policy: str, ratio: float, mode: str) -> dict:
    per_req_pages = (s.context + s.decode) // PAGE + 2
    sim = Sim(s, policy, ratio, mode, num_pages=s.requests * per_req_pages + s.reserve + 8, rows=s.requests)
    rows = torch.arange(s.requests)
    sim.table.open_rows(rows)
    sim.write(rows, s.context)
    sim.observe(rows, prefill=True)
    sim.evict_and_reclaim(rows)
    for _ in range(s.decode):
        sim.write(rows, 1)
        sim.observe(rows, prefill=False)
        sim.evict_and_reclaim(rows)
    sim.reclaimer.release_ready(force=True)
    samples = sim.reclaimer.planner_ms_samples
    return {
        "scenario": "memory",
        "policy": policy,
        "evict_ratio": ratio,
        "page_size": PAGE,
        "mode": mode,
        "requests": s.requests,
        "context": s.context,
        "decode": s.decode,
        "theta": s.theta,
        "mean_F": round(statistics.fmean(sim.f_samples), 4) if sim.f_samples else 0.0,
        "final_F": round(sim.pool.fragmentation(), 4),
        "pages": sim.pool.used_pages(),
        "lower_bound_pages": sim.table.lower_bound_pages(),
        "live_tokens": int(sim.table.live_len.sum()),
        "page_live_hist": page_live_hist(sim.pool),
        "planner_ms_p50": round(statistics.median(samples), 3) if samples else 0.0,
        "planner_calls": len(samples),
        "pages_reclaimed": sim.reclaimer.stats.pages_reclaimed,
        "tokens_moved": sim.reclaimer.stats.tokens_moved,
    }


def fits(s: Setting, policy: str, ratio: float, mode: str, budget: int, c: int) -> bool:
    """Do ``c`` concurrent requests run to the end within ``budget`` pages?"""
    sim = Sim(s, policy, ratio, mode, num_pages=budget, rows=c)
    rows = torch.arange(c)
    sim.table.open_rows(rows)
    try:
        for start in range(0, s.context, s.chunk):
            n = min(s.chunk, s.context - start)
            for r in range(c):
                row = rows[r : r + 1]
                sim.write(row, n)
                sim.observe(row, prefill=True)
                sim.evict_and_reclaim(row)
        for _ in range(s.decode):
            sim.write(rows, 1)
            sim.observe(rows, prefill=False)
            sim.evict_and_reclaim(rows)
    except OutOfPages:
        return False
    return True


def capacity(s: Setting, policy: str, ratio: float, mode: str, budget: int) -> int:
    lo, hi = 0, 1
    while fits(s, policy, ratio, mode, budget, hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(s, policy, ratio, mode, budget, mid) else (lo, mid)
    return lo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4K contexts, fewer decode steps (same record fields)")
    ap.add_argument("--json", type=Path, help="write {'runs': [...]} here")
    ap.add_argument("--theta", type=float, default=Setting.theta, help="reclaim trigger on F (the paper used 0.25)")
    ap.add_argument("--policies", nargs="+", default=["random", "h2o", "tova", "scissorhands", "snapkv", "streaming"])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = Setting(theta=args.theta)
    if args.quick:
        s = dataclasses.replace(s, context=2048, decode=64, chunk=512, score_every=4)
    scale = s.context / 16384
    cap_budget = round(PAPER_BUDGETS[0] * scale)
    t0 = time.monotonic()
    runs = []
    print(
        f"reclaim_sim: {s.requests} requests x {s.context} tokens, page {PAGE}, decode {s.decode}, theta {s.theta}, "
        f"capacity at {cap_budget} pages{' (quick)' if args.quick else ''}",
        flush=True,
    )
    hdr = (
        f"{'policy':<13}{'ratio':>6} {'mode':<7}{'mean_F':>8}{'pages':>8}{'lower_bd':>9}"
        f"{'pages/lb':>9}{'capacity':>9}{'plan_ms':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for policy in args.policies:
        for ratio in args.ratios:
            for mode in ("naive", "vtoken"):
                rec = memory_run(s, policy, ratio, mode)
                rec["page_budget"] = cap_budget
                rec["capacity"] = capacity(s, policy, ratio, mode, cap_budget)
                runs.append(rec)
                print(
                    f"{policy:<13}{ratio:>6.1f} "
                    f"{mode:<7}{rec['mean_F']:>8.3f}{rec['pages']:>8}{rec['lower_bound_pages']:>9}"
                    f"{rec['pages'] / max(rec['lower_bound_pages'], 1):>9.3f}{rec['capacity']:>9}"
                    f"{rec['planner_ms_p50']:>8.2f}",
                    flush=True,
                )
    print("\ncapacity frontier (evict ratio 0.5)")
    print(f"{'policy':<13}{'budget':>8}{'naive':>7}{'vtoken':>7}{'gain':>7}{'ideal':>7}")
    for policy in [p for p in ("random", "scissorhands") if p in args.policies]:
        for paper_budget in PAPER_BUDGETS:
            budget = round(paper_budget * scale)
            caps = {}
            for mode in ("naive", "vtoken"):
                caps[mode] = capacity(s, policy, 0.5, mode, budget)
                runs.append(
                    {
                        "scenario": "frontier",
                        "policy": policy,
                        "evict_ratio": 0.5,
                        "page_size": PAGE,
                        "mode": mode,
                        "page_budget": budget,
                        "capacity": caps[mode],
                        "context": s.context,
                        "decode": s.decode,
                    }
                )
            print(
                f"{policy:<13}{budget:>8}{caps['naive']:>7}{caps['vtoken']:>7}"
                f"{caps['vtoken'] / max(caps['naive'], 1):>7.2f}{2.0:>7.2f}",
                flush=True,
            )
    print(
        "\nsummary vs targets (vToken): mean_F <= 0.05; pages <= 1.05 x lower bound + 1 per request; capacity gain "
        ">= 0.9 x 1/(1-ratio) for random and scissorhands"
    )
    for rec in (r for r in runs if r["scenario"] == "memory" and r["mode"] == "vtoken"):
        naive = next(
            r
            for r in runs
            if r["scenario"] == "memory"
            and r["mode"] == "naive"
            and r["policy"] == rec["policy"]
            and r["evict_ratio"] == rec["evict_ratio"]
        )
        gain = rec["capacity"] / max(naive["capacity"], 1)
        ideal = 1 / (1 - rec["evict_ratio"])
        ok_f = rec["mean_F"] <= 0.05
        ok_p = rec["pages"] <= 1.05 * rec["lower_bound_pages"] + rec["requests"]
        ok_c = gain >= 0.9 * ideal if rec["policy"] in ("random", "scissorhands") else None
        rec["capacity_gain"] = round(gain, 3)
        print(
            f"  {rec['policy']:<13}{rec['evict_ratio']:.1f}  F {'ok ' if ok_f else 'MISS'}  pages "
            f"{'ok ' if ok_p else 'MISS'}  "
            f"capacity x{gain:.2f} (ideal {ideal:.2f}) {'' if ok_c is None else ('ok' if ok_c else 'MISS')}"
        )
    print(f"\nwall {time.monotonic() - t0:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"setting": dataclasses.asdict(s), "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
