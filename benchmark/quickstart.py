"""A smoke run: the tiny model, one real vToken server, a short bench_serving load, a printed summary.

    .venv/bin/python benchmark/quickstart.py [--num-prompts 32] [--json PATH] [-- extra server flags]

Everything runs locally (nothing is downloaded). The summary table is what bench_serving measured plus what the
server reports about itself. (The README's main job is ``serve_capacity.py --quick``, the memory table.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vtoken_sglang.tools.bench_load import bench_serving_command, random_ids_load  # noqa: E402
from vtoken_sglang.tools.launcher import (  # noqa: E402
    SglangServer,
    cpu_env,
    default_server_args,
)
from vtoken_sglang.tools.tiny_model import build  # noqa: E402


def run_load(url: str, model: str, num_prompts: int, input_len: int, output_len: int, out: Path) -> dict:
    cmd = bench_serving_command(url, model, out, *random_ids_load(num_prompts, input_len, output_len), progress=True)
    subprocess.run(cmd, check=True, env=cpu_env({"PYTHONWARNINGS": "ignore"}), stdout=subprocess.DEVNULL)
    return json.loads(out.read_text().strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the summary as JSON here")
    ap.add_argument("server_flags", nargs="*", help="extra launch_server flags (after --)")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    model = str(build())
    print(f"tiny model: {model}", flush=True)
    flags = default_server_args(page_size=None) + ["--enable-vtoken", *args.server_flags]
    with SglangServer(model, flags) as server, tempfile.TemporaryDirectory() as tmp:
        print(f"server: {server.url} (started in {time.monotonic() - t0:.0f} s; log {server.log_path})", flush=True)
        bench = run_load(
            server.url, model, args.num_prompts, args.input_len, args.output_len, Path(tmp) / "bench.jsonl"
        )
        info = server.get("/get_server_info")
        vtoken_line = next(
            (ln.split("[vtoken] ", 1)[1] for ln in server.log_text().splitlines() if "[vtoken] scheduler" in ln), "?"
        )
    summary = {
        "vtoken": vtoken_line,
        "page_size": info["page_size"],
        "max_total_tokens": info.get("max_total_num_tokens", info.get("max_total_tokens")),
        "completed": bench["completed"],
        "num_prompts": args.num_prompts,
        "output_throughput_tok_s": round(bench["output_throughput"], 1),
        "request_throughput_req_s": round(bench["request_throughput"], 2),
        "median_e2e_latency_ms": round(bench["median_e2e_latency_ms"], 1),
        "p99_e2e_latency_ms": round(bench["p99_e2e_latency_ms"], 1),
        "median_ttft_ms": round(bench["median_ttft_ms"], 1),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    width = max(map(len, summary))
    print("\nvtoken-sglang quickstart summary")
    print("-" * (width + 40))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if bench["completed"] == args.num_prompts else 1


if __name__ == "__main__":
    sys.exit(main())
