"""A peer side by side on the same CPU: OpenVINO GenAI's continuous batching (paged, blocks of 32 tokens) with and
without its own cache eviction, and SGLang plain, Naive-Evict and vToken, on one set of ShareGPT prompts (token ids,
the same for both engines), one pool and one per-request budget. Not part of the tests.

    bash scripts/setup_openvino.sh      # .venv-openvino and the fp32 IR of SmolLM2 (prints its directory)
    .venv/bin/python benchmark/peer_openvino.py [--requests 24] [--budget 160] [--json PATH]

The load: ``--requests`` ShareGPT first turns through bench_serving's loader (``--seed``, pairs longer than
``--sharegpt-context-len`` left out), ``--output-len`` new tokens each (greedy, ``ignore_eos``), all sent at once,
tokenized once by SmolLM2's tokenizer; a pool of ``--max-total-tokens``. OpenVINO: its pipeline stepped until every
request ends (``openvino_runner.py``, in its own venv): the most requests scheduled in one step, its highest cache
usage. SGLang: ``serve_capacity.py``'s servers and figures (page 16, ``--decode-log-interval 1``), vToken and
Naive-Evict under h2o at ``--budget`` tokens. OpenVINO keeps whole blocks (sinks and recent window of its own, see
the runner), vToken single tokens; both score like H2O. Output tokens are compared within each engine (eviction
changes them; across engines the kernels differ). Each engine's plain run is its base speed: the throughputs say
how fast each engine is on this CPU, not what eviction costs.
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

from serve_bench import add_dataset_args, finish, model_path  # noqa: E402
from serve_capacity import Load, measure, mode_flags, same_tokens  # noqa: E402

from vtoken_sglang.tools.bench_load import sharegpt_requests  # noqa: E402
from vtoken_sglang.tools.launcher import SglangServer, started_together  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICY = "h2o"  # OpenVINO's eviction scores like H2O (attention summed over steps)


def token_load(args, model: str) -> Load:
    """The ShareGPT prompts as SmolLM2's token ids (both engines get the same ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    reqs = sharegpt_requests(
        model, args.requests, args.output_len, args.sharegpt_context_len, args.seed, args.dataset_path
    )
    ids = [tok(r.prompt, add_special_tokens=False)["input_ids"] for r in reqs]
    return Load("ShareGPT", ids, [len(i) for i in ids], [r.output_len for r in reqs])


def openvino_run(args, load: Load, budget: int | None) -> dict:
    """``openvino_runner.py`` with the OpenVINO venv's Python; its JSON."""
    python = ROOT / ".venv-openvino" / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "load.json"
        payload = {"prompts": load.prompts, "output_lens": load.output_lens, "pool_tokens": args.max_total_tokens}
        spec.write_text(json.dumps(payload))
        cmd = [str(python), str(ROOT / "benchmark" / "openvino_runner.py"), args.ir, str(spec)]
        cmd += ["--budget", str(budget)] if budget else []
        print(f"[peer_openvino] OpenVINO, eviction {'at ' + str(budget) if budget else 'off'} ...", file=sys.stderr)
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if run.returncode != 0:
        raise RuntimeError(f"openvino_runner failed: {run.stderr[-3000:]}")
    out = json.loads(run.stdout)
    return {"engine": "openvino", "mode": "evict" if budget else "plain", "budget": budget, **out}


def sglang_runs(args, model: str, load: Load) -> list[dict]:
    """Plain SGLang, Naive-Evict and vToken (h2o at ``--budget``), started together, loads one after the other."""
    ns = argparse.Namespace(
        budget=args.budget,
        budget_ratio=None,
        max_total_tokens=args.max_total_tokens,
        requests=args.requests,
        input_len=None,
        output_len=args.output_len,
        dataset="sharegpt",
    )
    configs = [("plain", None), ("naive", POLICY), ("vtoken", POLICY)]
    servers = [SglangServer(model, mode_flags(ns, mode, policy, 0.0)) for mode, policy in configs]
    with started_together(*servers):
        runs = [measure(s, ns, load, mode, policy, 0.0) for s, (mode, policy) in zip(servers, configs)]
    return [{"engine": "sglang", **r} for r in runs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ir", help="OpenVINO IR directory (default: what scripts/setup_openvino.sh prints)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=160, help="tokens kept per request (both engines)")
    ap.add_argument("--seed", type=int, default=1, help="bench_serving's --seed: which ShareGPT conversations")
    ap.add_argument("--json", type=Path)
    add_dataset_args(ap)
    args = ap.parse_args(argv)
    args.ir = (
        args.ir
        or subprocess.run(
            ["bash", str(ROOT / "scripts" / "setup_openvino.sh")], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    model = model_path("smollm2")
    t0 = time.monotonic()
    load = token_load(args, model)
    runs = [openvino_run(args, load, None), openvino_run(args, load, args.budget)]
    runs += sglang_runs(args, model, load)
    sglang = {r["mode"]: r for r in runs if r["engine"] == "sglang"}
    same, compared = same_tokens(sglang["vtoken"], sglang["naive"])
    print(
        f"peer_openvino: {load.describe()}, pool {args.max_total_tokens} tokens, budget {args.budget} tokens "
        f"(OpenVINO: blocks of 32, SGLang: pages of 16)"
    )
    print(f"{'engine':<10}{'mode':<8}{'most running':>13}{'peak usage':>11}{'out tok/s':>10}  same as")
    for r in runs:
        usage = r.get("peak_cache_usage", r.get("peak_token_usage"))
        note = ""
        if (r["engine"], r["mode"]) == ("sglang", "vtoken"):
            note = f"Naive-Evict: {'yes' if same else 'NO'} ({compared} requests neither retracted)"
            r["identical_to_naive"], r["compared"] = same, compared
        print(
            f"{r['engine']:<10}{r['mode']:<8}{r['max_running_requests']:>13}{usage:>11.2f}"
            f"{r['output_throughput']:>10.1f}  {note}"
        )
        r.pop("ids", None)  # OpenVINO's tokens: not compared across engines (their kernels differ)
    ov_gain = runs[1]["max_running_requests"] / max(runs[0]["max_running_requests"], 1)
    vt = {r["mode"]: r["max_running_requests"] for r in runs if r["engine"] == "sglang"}
    print(
        f"eviction's gain in most running: OpenVINO x{ov_gain:.2f} over its full cache; vToken "
        f"x{vt['vtoken'] / max(vt['naive'], 1):.2f} over Naive-Evict, x{vt['vtoken'] / max(vt['plain'], 1):.2f} over "
        f"plain SGLang"
    )
    return finish(t0, runs, args.json)


if __name__ == "__main__":
    sys.exit(main())
