"""A peer side by side on the same CPU: OpenVINO GenAI's continuous batching (paged, blocks of 32 tokens) with and
without its own cache eviction, and SGLang plain, Naive-Evict and vToken, on one set of ShareGPT prompts (token ids,
the same for both engines), one pool and one per-request budget; or (``--task passkey``) on ``quality.py``'s pass-key
prompts, with each run's accuracy. Not part of the tests.

    bash scripts/setup_openvino.sh      # .venv-openvino and the fp32 IR of SmolLM2 (prints its directory)
    .venv/bin/python benchmark/peer_openvino.py [--requests 24] [--budget 160] [--json PATH]
    .venv/bin/python benchmark/peer_openvino.py --task passkey [--context 1000] [--budget 160 320] [--json PATH]

The load: ``--requests`` ShareGPT first turns through bench_serving's loader (``--seed``, pairs longer than
``--sharegpt-context-len`` left out), ``--output-len`` new tokens each (greedy, ``ignore_eos``), all sent at once,
tokenized once by SmolLM2's tokenizer; a pool of ``--max-total-tokens``. OpenVINO: its pipeline stepped until every
request ends (``openvino_runner.py``, in its own venv): the most requests scheduled in one step, its highest cache
usage. SGLang: ``serve_capacity.py``'s servers and figures (page 16, ``--decode-log-interval 1``), vToken and
Naive-Evict under h2o at ``--budget`` tokens. OpenVINO keeps whole blocks (sinks and recent window of its own, see
the runner), vToken single tokens; both score like H2O. Output tokens are compared within each engine (eviction
changes them; across engines the kernels differ). Each engine's plain run is its base speed: the throughputs say
how fast each engine is on this CPU, not what eviction costs.

``--task passkey``: ``quality.py``'s SmolLM2 pass-key prompts (``text_tasks``, ``--context`` tokens at most,
``--requests`` of them, ``--seed``; half ask first, half at the end) as token ids, each decoding quality's answer
tokens and its ``TAIL`` more (``--output-len`` unused), scored as quality scores them (the key in the answer's
decoded tokens). OpenVINO's full cache and SGLang plain once, then each ``--budget`` (one or more) under OpenVINO's
eviction, Naive-Evict and vToken. Per run: ``accuracy`` (and the prompts ``missed``, by index), the most running, the
peak and the mean share of the pool in use (OpenVINO: its cache usage averaged over all its steps, prompt chunks
included; SGLang: the pages held over its decode steps, ``mean_held_pages``, times the page over the pool), and
SGLang's retractions (OpenVINO's metrics count no preemptions: ``-``). ``--prefill-chunk N``: also ``vt+chunk``,
vToken with ``--vtoken-prefill-eviction on`` and chunks of N tokens (a prompt evicted to its budget after each
chunk, admitted by budget + chunk rather than its prompt; OpenVINO's eviction skips prefill, its cache may exceed
the limit there); its tokens differ from Naive-Evict's by design (later chunks see fewer tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import quality  # noqa: E402
from openvino_runner import BLOCK  # noqa: E402  (its openvino imports are inside its functions)
from serve_bench import add_dataset_args, finish, model_path  # noqa: E402
from serve_capacity import PAGE, RECENT, Load, measure, mode_flags, same_tokens  # noqa: E402

from vtoken_sglang.config import VTokenConfig  # noqa: E402
from vtoken_sglang.tools.bench_load import sharegpt_requests  # noqa: E402
from vtoken_sglang.tools.launcher import SglangServer, started_together  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICY = "h2o"  # OpenVINO's eviction scores like H2O (attention summed over steps)
MODES = ("plain", "naive", "vtoken")  # SGLang's runs (plain: no eviction, no budget)
CHUNKED = "vt+chunk"  # vToken evicting between prefill chunks (passkey, with --prefill-chunk)
SEEDS = {"sharegpt": 1, "passkey": 0}  # --seed's default per task (passkey: quality.py's)
Judge = Callable[[list[int]], bool]  # output ids -> the prompt answered exactly


def token_load(args, model: str) -> Load:
    """The ShareGPT prompts as SmolLM2's token ids (both engines get the same ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    reqs = sharegpt_requests(
        model, args.requests, args.output_len, args.sharegpt_context_len, args.seed, args.dataset_path
    )
    ids = [tok(r.prompt, add_special_tokens=False)["input_ids"] for r in reqs]
    return Load("ShareGPT", ids, [len(i) for i in ids], [r.output_len for r in reqs])


def passkey_load(args, model: str) -> tuple[Load, list[Judge]]:
    """``quality.py``'s pass-key prompts as token ids, each for its answer tokens and quality's ``TAIL`` more, and
    each prompt's judge (quality's)."""
    prompts = quality.text_load(model, "passkey", args.context, args.requests, args.seed).prompts
    ids = [p.ids for p in prompts]
    outs = [p.answer_tokens + quality.TAIL for p in prompts]
    return Load("pass-key", ids, [len(i) for i in ids], outs), [p.judge for p in prompts]


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


def sglang_runs(args, model: str, load: Load, budget: int, modes: tuple[str, ...] = MODES) -> list[dict]:
    """SGLang's ``modes`` (Naive-Evict and vToken: h2o at ``budget`` tokens; ``CHUNKED``: vToken evicting between
    prefill chunks of ``--prefill-chunk`` tokens), started together, loads one after the other."""
    ns = argparse.Namespace(
        budget=budget,
        budget_ratio=None,
        max_total_tokens=args.max_total_tokens,
        requests=args.requests,
        input_len=None,
        output_len=max(load.output_lens),
        dataset=args.task,
    )
    chunked = ["--vtoken-prefill-eviction", "on", "--chunked-prefill-size", str(args.prefill_chunk)]
    configs = [(mode, None if mode == "plain" else POLICY) for mode in modes]
    servers = [
        SglangServer(model, mode_flags(ns, "vtoken", policy, 0.0) + chunked)
        if mode == CHUNKED
        else SglangServer(model, mode_flags(ns, mode, policy, 0.0))
        for mode, policy in configs
    ]
    with started_together(*servers):
        runs = [
            {**measure(s, ns, load, "vtoken" if mode == CHUNKED else mode, policy, 0.0), "mode": mode}
            for s, (mode, policy) in zip(servers, configs)
        ]
    return [{"engine": "sglang", **r} for r in runs]


def sharegpt(args, model: str) -> list[dict]:
    """The ShareGPT comparison at one budget: its runs, its table printed."""
    (budget,) = args.budget
    load = token_load(args, model)
    runs = [openvino_run(args, load, None), openvino_run(args, load, budget)]
    runs += sglang_runs(args, model, load, budget)
    sglang = {r["mode"]: r for r in runs if r["engine"] == "sglang"}
    same, compared = same_tokens(sglang["vtoken"], sglang["naive"])
    print(
        f"peer_openvino: {load.describe()}, pool {args.max_total_tokens} tokens, budget {budget} tokens "
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
    return runs


def score(run: dict, judges: list[Judge]) -> None:
    """``run``'s ``accuracy`` (share of prompts answered exactly), ``recovered`` (how many) and ``missed`` (the
    indices of the others), from its output ids (OpenVINO's ``ids``, SGLang's ``_ids``); OpenVINO's ids dropped
    after (not compared across engines)."""
    outputs = run.pop("ids", None) or run["_ids"]
    right = [judge(out) for judge, out in zip(judges, outputs, strict=True)]
    run["accuracy"], run["recovered"] = round(sum(right) / len(right), 4), sum(right)
    run["missed"] = [i for i, ok in enumerate(right) if not ok]


def mean_usage(run: dict, pool: int) -> float:
    """The mean share of the pool in use: OpenVINO's over its steps, SGLang's pages held over its decode steps."""
    if run["engine"] == "openvino":
        return run["mean_cache_usage"]
    return (run["mean_held_pages"] or 0.0) * PAGE / pool


def passkey_runs(args, model: str, load: Load) -> list[dict]:
    """OpenVINO's full cache, then its eviction at each ``--budget``; SGLang plain, Naive-Evict and vToken (and with
    ``--prefill-chunk`` vToken evicting between chunks) at the first budget (started together), then the evicting
    ones at each further budget."""
    runs = [openvino_run(args, load, None)] + [openvino_run(args, load, budget) for budget in args.budget]
    chunked = (CHUNKED,) if args.prefill_chunk else ()
    runs += sglang_runs(args, model, load, args.budget[0], MODES + chunked)
    for budget in args.budget[1:]:
        runs += sglang_runs(args, model, load, budget, ("naive", "vtoken") + chunked)
    return runs


def passkey(args, model: str) -> list[dict]:
    """The pass-key comparison at each ``--budget``: its runs (scored, vToken's tokens compared with Naive-Evict's
    at its budget), its table printed."""
    load, judges = passkey_load(args, model)
    runs = passkey_runs(args, model, load)
    naive = {r["budget"]: r for r in runs if (r["engine"], r["mode"]) == ("sglang", "naive")}
    print(
        f"peer_openvino: {load.describe()}, quality.py's prompts (context {args.context}, seed {args.seed}), pool "
        f"{args.max_total_tokens} tokens (OpenVINO: blocks of {BLOCK}, sinks {BLOCK}, recent {2 * BLOCK}; SGLang: "
        f"pages of {PAGE}, h2o, sinks {VTokenConfig.vtoken_sinks}, recent {RECENT})"
    )
    print(
        f"{'engine':<10}{'mode':<8}{'budget':>7}{'accuracy':>9}  {'missed':<10}{'most running':>13}{'peak usage':>11}"
        f"{'mean usage':>11}{'retracted':>10}{'out tok/s':>10}  same as"
    )
    for r in runs:
        note = ""
        if (r["engine"], r["mode"]) == ("sglang", "vtoken"):
            same, compared = same_tokens(r, naive[r["budget"]])
            note = f"Naive-Evict: {'yes' if same else 'NO'} ({compared} requests neither retracted)"
            r["identical_to_naive"], r["compared"] = same, compared
        score(r, judges)
        usage = r.get("peak_cache_usage", r.get("peak_token_usage"))
        missed = ",".join(map(str, r["missed"])) or "-"
        print(
            f"{r['engine']:<10}{r['mode']:<8}{r['budget'] or '-':>7}{r['accuracy']:>9.3f}  {missed:<10}"
            f"{r['max_running_requests']:>13}{usage:>11.2f}{mean_usage(r, args.max_total_tokens):>11.2f}"
            f"{r.get('retractions', '-'):>10}{r['output_throughput']:>10.1f}  {note}"
        )
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=tuple(SEEDS), default="sharegpt", help="the prompts (default sharegpt)")
    ap.add_argument("--ir", help="OpenVINO IR directory (default: what scripts/setup_openvino.sh prints)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=128, help="ShareGPT's new tokens a request")
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    budget_help = "tokens kept per request (both engines; passkey: one or more)"
    ap.add_argument("--budget", type=int, nargs="+", default=[160], help=budget_help)
    ap.add_argument("--seed", type=int, help="sharegpt: bench_serving's --seed (default 1); passkey: quality's (0)")
    ap.add_argument("--context", type=int, default=quality.CONTEXT, help="passkey: prompt tokens at most")
    chunk_help = "passkey: also vToken evicting between prefill chunks of this many tokens at each budget"
    ap.add_argument("--prefill-chunk", type=int, help=chunk_help)
    ap.add_argument("--json", type=Path)
    add_dataset_args(ap)
    args = ap.parse_args(argv)
    if args.task == "sharegpt" and len(args.budget) > 1:
        ap.error("--task sharegpt takes one --budget")
    if args.task == "sharegpt" and args.prefill_chunk:
        ap.error("--prefill-chunk is for --task passkey")
    args.seed = SEEDS[args.task] if args.seed is None else args.seed
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
    runs = sharegpt(args, model) if args.task == "sharegpt" else passkey(args, model)
    return finish(t0, runs, args.json)


if __name__ == "__main__":
    sys.exit(main())
