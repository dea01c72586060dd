"""Cost of attention-score collection against one decode attention pass, per layer, on the same inputs.

    .venv/bin/python benchmark/scoring_cost.py [--quick] [--json PATH] [--device cpu|cuda]

For each shape (batch B, live tokens L per request, query/KV heads, head dim): a paged KV pool with the requests'
live slots scattered through it (as after compaction), and the newest query of each request. Timed, median of
repeats:
- ``attn_ms``: one decode attention pass as a torch backend runs it: gather K and V through the rows, SDPA (GQA);
- ``score_ms``: ``vtoken_sglang.scoring.decode_scores_headsum`` (gather K through the rows, softmax, head sum);
  on CUDA also ``triton_ms``, the Triton kernel the server uses there, on a CPU ``cpu_kernel_ms``, the C++ kernel
  it uses there where it is built (``scoring/cpu_kernel.py``; same contract).
Target (issue: score-based policies): with scores every step, the scoring costs at most one extra decode attention
pass, i.e. ``ratio <= 1`` (the implementation the server runs on the device: Triton on CUDA, the C++ kernel on a
CPU, else torch, over ``attn_ms``). Every k steps divides it by k (``--vtoken-score-every``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtoken_sglang.scoring import cpu_kernel, decode_scores_headsum  # noqa: E402

SHAPES_QUICK = [(8, 512, 4, 2, 32), (32, 1024, 32, 8, 128)]
SHAPES_FULL = [(8, 512, 4, 2, 32), (8, 2048, 32, 8, 128), (32, 1024, 32, 8, 128), (64, 2048, 32, 8, 128)]


def decode_attention(q, k_pool, v_pool, slots, live_len, scale):
    """One decode attention pass through the rows (the work a torch decode backend does)."""
    W = slots.shape[1]
    valid = torch.arange(W, device=slots.device)[None, :] < live_len[:, None]
    idx = torch.where(valid, slots, 0)
    k = k_pool[idx].transpose(1, 2)  # [B, Hkv, W, D]
    v = v_pool[idx].transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )


def timed(fn, repeats: int, device: str) -> float:
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run_shape(B: int, L: int, Hq: int, Hkv: int, D: int, device: str, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    pool_slots = B * L * 2
    k_pool = torch.randn(pool_slots, Hkv, D, generator=g).to(device)
    v_pool = torch.randn(pool_slots, Hkv, D, generator=g).to(device)
    slots = torch.randperm(pool_slots, generator=g)[: B * L].view(B, L).sort(1).values.to(device)
    live = torch.randint(L // 2, L + 1, (B,), generator=g).to(device)
    q = torch.randn(B, Hq, D, generator=g).to(device)
    scale = D**-0.5
    attn_ms = timed(lambda: decode_attention(q, k_pool, v_pool, slots, live, scale), repeats, device)
    score_ms = timed(lambda: decode_scores_headsum(q, k_pool, slots, live, scale), repeats, device)
    triton_ms = None
    if device == "cuda":
        from vtoken_sglang.scoring.triton_scores import decode_scores_headsum_triton

        triton_ms = round(
            timed(lambda: decode_scores_headsum_triton(q, k_pool, slots, live, scale), repeats, device), 3
        )
    kernel, cpu_kernel_ms = cpu_kernel.load() if device == "cpu" else None, None
    if kernel is not None:
        cpu_kernel_ms = round(timed(lambda: kernel(q[None], [k_pool], slots, live, scale), repeats, device), 3)
    # what the server runs on this device
    used_ms = next(ms for ms in (triton_ms, cpu_kernel_ms, score_ms) if ms is not None)
    return {
        "triton_ms": triton_ms,
        "cpu_kernel_ms": cpu_kernel_ms,
        "batch": B,
        "live_tokens": L,
        "q_heads": Hq,
        "kv_heads": Hkv,
        "head_dim": D,
        "device": device,
        "attn_ms": round(attn_ms, 3),
        "score_ms": round(score_ms, 3),
        "ratio": round(used_ms / attn_ms, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    rows = [run_shape(*shape, args.device, args.repeats) for shape in (SHAPES_QUICK if args.quick else SHAPES_FULL)]
    print(
        f"scoring_cost on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; per layer, "
        f"median of {args.repeats}"
    )
    extra = [k for k in ("triton_ms", "cpu_kernel_ms") if any(r[k] is not None for r in rows)]
    extra_cols = "".join(f"{k:>14}" for k in extra)
    hdr = f"{'batch':>6}{'live':>6}{'Hq':>4}{'Hkv':>4}{'D':>5}{'attn_ms':>9}{'score_ms':>9}{extra_cols}{'ratio':>7}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        extra_cols = "".join(f"{r[k]:>14.3f}" for k in extra)
        print(
            f"{r['batch']:>6}{r['live_tokens']:>6}{r['q_heads']:>4}{r['kv_heads']:>4}{r['head_dim']:>5}"
            f"{r['attn_ms']:>9.3f}{r['score_ms']:>9.3f}{extra_cols}{r['ratio']:>7.2f}"
        )
    worst = max(r["ratio"] for r in rows)
    print(
        f"target ratio <= 1 (scores every step): {'met' if worst <= 1.0 else 'MISSED'} (worst ratio {worst:.2f}); "
        "every k steps divides the cost by k"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
