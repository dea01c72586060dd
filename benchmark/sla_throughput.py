"""Throughput under a latency SLA (the paper's Table): plain SGLang, Naive-Evict and vToken, swept over request rates
with ``python -m sglang.bench_serving`` against real servers.

    .venv/bin/python benchmark/sla_throughput.py [--model-path M] [--quick] [--json PATH]

The model: ``--model-path`` (default SmolLM2-135M-Instruct, the real checkpoint the project builds; ``tiny`` for the
tiny random LLaMA). The load (``--dataset``): ShareGPT first turns through bench_serving's own loader, the default for
a real checkpoint (the paper's workload; ``--output-len`` new tokens each, 128 unless given, a pool of 4096), or
``random-ids`` prompts of exactly ``--input-len`` ids, the tiny model's default (pool and output length by model,
``DEFAULTS``: a real model's step is about 100x the tiny one's, so its requests are shorter and its pool sized to
the same pressure). Each mode gets one server (CPU, page 16, radix cache on, a ``--max-total-tokens`` small enough
that KV memory limits concurrency); on it, one bench_serving run per request rate (Poisson arrivals, exactly
``--output-len`` greedy tokens each, the same seed everywhere). From each run: output throughput (tok/s) and p95
end-to-end latency.

The SLA, written down (the paper's definition made exact):
1. Naive-Evict's *saturation point* (per policy) is the lowest swept rate whose output throughput is at least 97%
   of the highest throughput Naive-Evict reaches in the sweep (past it, a higher rate only adds queueing);
2. the SLA latency is 1.05 x Naive-Evict's p95 end-to-end latency at that rate;
3. a mode's *SLA throughput* is the highest output throughput among its runs whose p95 latency is within the SLA
   latency (0 if none).
Plain SGLang is measured against the SLA of the first policy's Naive-Evict. The table prints every (rate,
throughput, p95) point and each mode's SLA throughput relative to Naive-Evict's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from serve_bench import (  # noqa: E402
    SHAREGPT_DEFAULTS,
    TINY,
    add_dataset_args,
    add_model_path,
    dataset_of,
    finish,
    model_path,
)

from vtoken_sglang.tools import sharegpt  # noqa: E402
from vtoken_sglang.tools.bench_load import bench_serving_command, random_ids_load, sharegpt_load  # noqa: E402
from vtoken_sglang.tools.launcher import (  # noqa: E402
    SglangServer,
    cpu_env,
    default_server_args,
)

SATURATION = 0.97  # a rate within 3% of Naive-Evict's best throughput is its saturation point
SLA_SLACK = 1.05
DEFAULTS = {TINY: {"max_total_tokens": 4096, "output_len": 480}, "real": {"max_total_tokens": 2048, "output_len": 224}}
DEFAULTS["sharegpt"] = SHAREGPT_DEFAULTS


def load_flags(args) -> list[str]:
    """bench_serving's dataset flags for ``args``' load."""
    if args.dataset == "sharegpt":
        path = args.dataset_path or sharegpt.build()
        return sharegpt_load(args.requests, args.output_len, args.sharegpt_context_len, path)
    return random_ids_load(args.requests, args.input_len, args.output_len, 1.0)


def describe(args) -> str:
    """The load in words, for the table's first line."""
    if args.dataset == "sharegpt":
        return f"{args.requests} ShareGPT first turns per rate ({args.output_len} out)"
    return f"{args.requests} requests per rate x ({args.input_len} in, {args.output_len} out)"


def bench_rate(server: SglangServer, model: str, rate: float, args, seed: int) -> dict:
    """One bench_serving run at ``rate`` requests/s (``inf``: all at once); its output throughput and p95 latency."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.jsonl"
        cmd = bench_serving_command(
            server.url,
            model,
            out,
            *load_flags(args),
            rate=rate,
            seed=seed,
        )
        run = subprocess.run(cmd, capture_output=True, text=True, env=cpu_env(), timeout=1800)
        if run.returncode != 0:
            raise RuntimeError(f"bench_serving at rate {rate} failed: {run.stderr[-2000:]}")
        rec = json.loads(out.read_text().strip().splitlines()[-1])
    return {
        "rate": rate,
        "completed": rec["completed"],
        "output_throughput": round(rec["output_throughput"], 1),
        "p95_latency_s": round(rec["p95_e2e_latency_ms"] / 1e3, 2),
    }


def run_mode(model: str, mode: str, policy: str | None, args, bar) -> dict:
    flags = default_server_args(max_total_tokens=args.max_total_tokens)
    if mode != "plain":  # every mode runs SGLang's default (overlap) scheduling loop
        flags += [
            "--enable-vtoken",
            "--vtoken-policy",
            policy,
            "--vtoken-budget-ratio",
            str(args.budget_ratio),
            "--vtoken-recent",
            "16",
            "--vtoken-reclaim",
            "on" if mode == "vtoken" else "off",
        ]
    points = []
    with SglangServer(model, flags) as server:
        for i, rate in enumerate(args.rates):
            bar.set_postfix_str(f"{mode} {policy or ''} rate {rate}")
            points.append(bench_rate(server, model, rate, args, seed=7 + i))
            bar.update(1)
    return {
        "mode": mode,
        "policy": policy or "none",
        "budget_ratio": args.budget_ratio if mode != "plain" else 1.0,
        "max_total_tokens": args.max_total_tokens,
        "requests": args.requests,
        "dataset": args.dataset,
        "input_len": args.input_len if args.dataset == "random" else None,
        "output_len": args.output_len,
        "points": points,
    }


def sla_of(naive: dict) -> tuple[float, float]:
    """(saturation rate, SLA latency) from Naive-Evict's sweep (the rules in the module docstring)."""
    best = max(p["output_throughput"] for p in naive["points"])
    sat = next(p for p in naive["points"] if p["output_throughput"] >= SATURATION * best)
    return sat["rate"], SLA_SLACK * sat["p95_latency_s"]


def sla_throughput(run: dict, latency: float) -> float:
    ok = [p["output_throughput"] for p in run["points"] if p["p95_latency_s"] <= latency]
    return max(ok, default=0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line with every default resolved (the load's by dataset and model, then ``--quick``'s)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="random only, 4 rates, 16 requests per point (tiny: about 8 min here)"
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--policies", nargs="+", default=None, help="default: random streaming (--quick: random)")
    ap.add_argument("--rates", nargs="+", type=float, default=None, help="requests/s, ascending (inf: all at once)")
    ap.add_argument("--budget-ratio", type=float, default=0.5)
    ap.add_argument("--max-total-tokens", type=int, help="default: ShareGPT 4096; random ids 2048 (tiny: 4096)")
    ap.add_argument("--requests", type=int, default=32, help="prompts per rate point")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, help="default: ShareGPT 128; random ids 224 (tiny: 480)")
    add_dataset_args(ap)
    add_model_path(ap, default="smollm2")
    args = ap.parse_args(argv)
    args.dataset = dataset_of(args)
    key = "sharegpt" if args.dataset == "sharegpt" else TINY if args.model_path == TINY else "real"
    for name, value in DEFAULTS[key].items():
        setattr(args, name, getattr(args, name) or value)
    if args.quick:
        args.policies = args.policies or ["random"]
        args.rates = args.rates or [1.0, 2.0, 4.0, float("inf")]
        args.requests = 16
    args.policies = args.policies or ["random", "streaming"]
    args.rates = args.rates or [1.0, 2.0, 4.0, 8.0, float("inf")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    model = model_path(args.model_path)
    t0 = time.monotonic()
    modes = [("plain", None)] + [(m, p) for p in args.policies for m in ("naive", "vtoken")]
    with tqdm(total=len(modes) * len(args.rates), desc="sla_throughput", unit="point", file=sys.stderr) as bar:
        runs = [run_mode(model, mode, policy, args, bar) for mode, policy in modes]
    print(
        f"sla_throughput: {describe(args)}, "
        f"--max-total-tokens {args.max_total_tokens}, page 16, budget ratio {args.budget_ratio}"
    )
    hdr = (
        f"{'mode':<8}{'policy':<11}"
        + "".join(f"{'r=' + format(r, 'g'):>16}" for r in args.rates)
        + f"{'SLA tok/s':>11}{'x naive':>9}"
    )
    print(hdr)
    print(f"{'':<19}" + "".join(f"{'tok/s  p95_s':>16}" for _ in args.rates))
    print("-" * len(hdr))
    first_naive = next(r for r in runs if r["mode"] == "naive")
    for r in runs:
        naive = next((n for n in runs if n["mode"] == "naive" and n["policy"] == r["policy"]), first_naive)
        r["saturation_rate"], r["sla_latency_s"] = sla_of(naive)
        r["sla_throughput"] = sla_throughput(r, r["sla_latency_s"])
        r["x_naive"] = round(r["sla_throughput"] / max(sla_throughput(naive, r["sla_latency_s"]), 1e-9), 2)
        cells = "".join(f"{p['output_throughput']:>9.1f}{p['p95_latency_s']:>7.2f}" for p in r["points"])
        print(f"{r['mode']:<8}{r['policy']:<11}{cells}{r['sla_throughput']:>11.1f}{r['x_naive']:>9.2f}")
    for policy in args.policies:
        n = next(r for r in runs if r["mode"] == "naive" and r["policy"] == policy)
        print(
            f"{policy}: Naive-Evict saturates at rate {n['saturation_rate']:g}; SLA = p95 <= {n['sla_latency_s']:.2f} s"
        )
    return finish(t0, runs, args.json)


if __name__ == "__main__":
    sys.exit(main())
