"""vToken's own device memory against SGLang's KV pool, for real model geometries and the tiny model in a server.

    .venv/bin/python benchmark/memory_footprint.py [--gpu-gib 80] [--mem-fraction 0.88] [--no-server] [--json PATH]

Geometries (bf16 KV, page 16): Llama-3.1-8B, Qwen2.5-7B, Mistral-7B at 8K, 32K and 128K contexts, on one GPU of
``--gpu-gib`` with ``--mem-fraction`` of it for weights and KV (the KV pool gets the rest after the weights). The
request rows are SGLang 0.5.23's default for that pool and context (``pool_configurator``: tokens / context x 512,
clamped to [2048, 4096], at most tokens / 2). vToken's bytes are computed by the code that allocates them in the
server (``runtime_metrics.device_bytes`` over a ``TokenTable``, ``PagePool`` and ``RequestRows`` built on the meta
device: nothing is allocated); the PagePool here keeps a free list, which the server's leaves to SGLang, so the
figure is an upper bound. A policy's state is a float32 per slot and as many again for the shared prefixes requests
read (``StateStore``'s first capacity: each request keeps its own state for them; the server grows it only when the
live shared entries need more, and reports it as ``state_capacity``). Decode-scored policies (h2o, tova,
scissorhands) add the score collector's query buffers (``DecodeQueryBuffers``: every layer, ``DEFAULT_ROWS``
requests, bf16). ``row-aligned`` is what the table held before its metadata was keyed by KV slot: one int32
``logical`` and one float32 per policy state, each ``[rows x context]``. Then the tiny model in a real server (CPU,
its 16K-token pool, SGLang's 2048 rows x 32K): ``vtoken_device_bytes`` and ``kv_pool_bytes`` as ``/get_server_info``
reports them. Target: <= 1% of the KV pool's bytes for every policy and real geometry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtoken_sglang.core.pages import PagePool  # noqa: E402
from vtoken_sglang.core.token_table import TokenTable  # noqa: E402
from vtoken_sglang.integration.observe.runtime_metrics import device_bytes  # noqa: E402
from vtoken_sglang.integration.parts.request_rows import RequestRows  # noqa: E402
from vtoken_sglang.policies import POLICIES, scoring  # noqa: E402
from vtoken_sglang.scoring.query_buffers import DEFAULT_ROWS, DecodeQueryBuffers  # noqa: E402

PAGE = 16
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    weight_gib: float  # bf16 weights

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2  # K and V, bf16


GEOMETRIES = (
    Geometry("Llama-3.1-8B", 32, 32, 8, 128, 14.96),
    Geometry("Qwen2.5-7B", 28, 28, 4, 128, 14.19),
    Geometry("Mistral-7B", 32, 32, 8, 128, 13.50),
)
CONTEXTS = (8192, 32768, 131072)


def sglang_default_rows(tokens: int, context: int) -> int:
    """SGLang 0.5.23's default request rows for a pool of ``tokens`` and a context of ``context``."""
    return min(max(min(int(tokens / context * 512), 4096), 2048), tokens // 2)


def vtoken_bytes(tokens: int, rows: int, context: int, state_names: tuple[str, ...]) -> int:
    """What the server allocates for this pool, rows and context (meta tensors: nothing is allocated)."""
    pool = PagePool(tokens // PAGE, PAGE, device="meta")
    store = torch.empty(rows, context, dtype=torch.int32, device="meta")  # SGLang's req_to_token
    table = TokenTable(rows, context, pool, slots=store, state_names=state_names)
    return device_bytes(table, pool, RequestRows(table, pool))


def query_buffer_bytes(g: Geometry, rows: int) -> int:
    """The score collector's decode query buffers (h2o, tova, scissorhands), every layer scored, bf16, as the server
    sizes them with decode CUDA graphs of at most ``DEFAULT_ROWS`` requests (meta tensors: nothing is allocated)."""
    buffers = DecodeQueryBuffers(frozenset(range(g.layers)))
    q = torch.empty(1, g.q_heads * g.head_dim, dtype=torch.bfloat16, device="meta")
    buffers.write(0, q, g.q_heads, g.head_dim, 1.0, 0.0, lambda: min(rows, DEFAULT_ROWS))
    return buffers.nbytes()


def geometry_rows(gpu_gib: float, fraction: float) -> list[dict]:
    out = []
    for g in GEOMETRIES:
        kv_pool = int((gpu_gib * fraction - g.weight_gib) * GIB)
        tokens = kv_pool // g.kv_bytes_per_token // PAGE * PAGE
        for context in CONTEXTS:
            rows = sglang_default_rows(tokens, context)
            for policy, cls in POLICIES.items():
                states = cls.state_names
                queries = query_buffer_bytes(g, rows) if scoring(cls) == "decode" else 0
                ours = vtoken_bytes(tokens, rows, context, states) + queries
                before = rows * context * 4 * (1 + len(states))
                out.append(
                    {
                        "model": g.name,
                        "context": context,
                        "rows": rows,
                        "kv_tokens": tokens,
                        "policy": policy,
                        "kv_pool_bytes": tokens * g.kv_bytes_per_token,
                        "vtoken_device_bytes": ours,
                        "query_buffer_bytes": queries,
                        "row_aligned_bytes": before,
                    }
                )
    return out


def measured_in_server() -> dict:
    """The tiny model's server (h2o: one state) reports its own figures."""
    from vtoken_sglang.tools.launcher import SglangServer, default_server_args
    from vtoken_sglang.tools.tiny_model import build

    flags = default_server_args() + ["--enable-vtoken", "--vtoken-policy", "h2o", "--vtoken-budget", "256"]
    with SglangServer(str(build()), flags) as s:
        st = s.get("/get_server_info")["internal_states"][0]["vtoken"]
    return {"policy": "h2o", "vtoken_device_bytes": st["vtoken_device_bytes"], "kv_pool_bytes": st["kv_pool_bytes"]}


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory (GiB); default an 80 GB H100")
    ap.add_argument("--mem-fraction", type=float, default=0.88, help="share for weights and KV (SGLang's static)")
    ap.add_argument("--no-server", action="store_true", help="skip the tiny model's real server")
    ap.add_argument("--json", type=Path, help="write the records here")
    args = ap.parse_args()

    rows = geometry_rows(args.gpu_gib, args.mem_fraction)
    print(f"one {args.gpu_gib:g} GiB GPU, {args.mem_fraction:g} for weights + KV, bf16 KV, page {PAGE}")
    print(
        "vToken: its device bytes now (h2o, tova, scissorhands: with the decode query buffers, every layer scored); "
        "row-aligned: before, one [rows x context] tensor for logical + one per state"
    )
    print(
        f"{'model':<14}{'context':>8}{'rows':>6}{'KV pool MiB':>13}{'states':>7}{'vToken MiB':>12}{'% of KV':>9}"
        f"{'row-aligned MiB':>17}{'% of KV':>9}  policies"
    )
    worst = max(100 * r["vtoken_device_bytes"] / r["kv_pool_bytes"] for r in rows)
    seen = set()
    for r in rows:
        states = len(POLICIES[r["policy"]].state_names)
        kind = lambda c: (len(c.state_names), scoring(c) == "decode")  # noqa: E731
        key = (r["model"], r["context"], kind(POLICIES[r["policy"]]))
        if key in seen:
            continue
        seen.add(key)
        same = [p for p, c in POLICIES.items() if kind(c) == key[2]]
        print(
            f"{r['model']:<14}{r['context']:>8}{r['rows']:>6}{mib(r['kv_pool_bytes']):>13}{states:>7}"
            f"{mib(r['vtoken_device_bytes']):>12}{100 * r['vtoken_device_bytes'] / r['kv_pool_bytes']:>8.3f}%"
            f"{mib(r['row_aligned_bytes']):>17}{100 * r['row_aligned_bytes'] / r['kv_pool_bytes']:>8.2f}%  "
            f"{', '.join(same)}"
        )
    print(f"largest share of the KV pool, every policy and geometry: {worst:.3f}% (target <= 1%)")
    record = {"gpu_gib": args.gpu_gib, "mem_fraction": args.mem_fraction, "geometries": rows, "worst_pct": worst}
    if not args.no_server:
        m = measured_in_server()
        record["tiny_server"] = m
        print(
            f"tiny model, real server ({m['policy']}): vToken {m['vtoken_device_bytes'] / 1024:.1f} KiB beside a KV "
            f"pool of {mib(m['kv_pool_bytes'])} MiB ({100 * m['vtoken_device_bytes'] / m['kv_pool_bytes']:.2f}%; its "
            "KV is 1 KiB per token, a real model's 56-128 KiB)"
        )
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
