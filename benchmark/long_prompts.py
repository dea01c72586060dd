"""Documents longer than the memory: pass keys in prompts of thousands of tokens, evicted between prefill chunks
(``--vtoken-prefill-eviction``), against the full cache on a pool that holds the prompts. Not part of the tests.

    .venv/bin/python benchmark/long_prompts.py [--model-path smollm2] [--lengths 4000 8000] [--budgets 512 1024]
        [--policies streaming random h2o snapkv] [--prompts 4] [--chunk 512] [--pool 2048] [--json PATH]

The load: ``--prompts`` pass-key prompts (``text_tasks``: a 5-digit key at a random depth of filler text, half
asking first, half at the end) of about each of ``--lengths`` tokens, all sent at once, each decoding its answer
(``quality.TEXT_ANSWER`` tokens) and ``TAIL`` more, greedy. Runs:

- ``full``: plain SGLang (no vToken) on a pool that holds every prompt of the length at once (``--max-total-tokens``
  = prompts x (length + answer) + a page each), prefilled in the same chunks; with ``--full transformers``,
  ``full_transformers``: transformers' greedy answers instead (where a full-cache server prefills too slowly here:
  Gemma-3 at 16K on torch_native takes minutes a chunk);
- each policy at each ``--budget`` (absolute tokens; sinks ``SINKS``, recent ``RECENT``) with eviction between
  chunks on a pool of ``--pool`` tokens (by default smaller than one prompt: the prompt cannot be held whole).

Per run: ``accuracy`` (the key in the answer's decoded tokens), ``peak_extend_kv`` (the most KV one request held in
a prefill chunk's forward: its live tokens and the chunk), ``max_running`` (per decode step, ``--decode-log-interval
1``), ``retracted``, and ``wall_s`` (the whole load). ``--prefill-time``: one prompt of the longest length alone,
one new token, full cache against streaming at the first budget: the time to its first token (its prefill), each
the best of ``PREFILL_REPEATS``.

``--room``: ``quality.py``'s 4K pass-key load on a pool of exactly its prompts (``--room-prompts`` prompts at the
first length, pool = their tokens), where vToken evicting at decode only freed nothing (each prompt prefilled whole,
its pages in the radix tree, and no room for a first copy-on-write copy): that against eviction between chunks, h2o
at the last budget: the pool's use at prefill and at decode, what was freed (pages reclaimed, tokens evicted at
prefill), the most running, accuracy.

Per run also ``peak_prefill_usage``: the pool's highest use that SGLang logs at a prefill batch (a fraction), and
in the table beside it the decode steps' (``peak_tokens_in_use`` over the pool).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from quality import DECODE, TEXT_ANSWER, Prompt, text_load  # noqa: E402
from serve_bench import add_model_path, finish, model_path  # noqa: E402

from vtoken_sglang.tools.launcher import SglangServer, default_server_args  # noqa: E402

PAGE = 16
SINKS, RECENT = 4, 64
TAIL = 4
PREFILL_REPEATS = 2
POLICIES = ("streaming", "random", "h2o", "snapkv")
PREFILL = re.compile(r"Prefill batch, .*?token usage: ([0-9.]+)")


def flags(pool: int, chunk: int, policy: str | None, budget: int | None, prefill: bool = True) -> list[str]:
    out = default_server_args(pool) + ["--chunked-prefill-size", str(chunk), "--decode-log-interval", "1"]
    if policy is None:
        return out
    out += ["--enable-vtoken", "--vtoken-policy", policy, "--vtoken-budget", str(budget)]
    out += ["--vtoken-sinks", str(SINKS), "--vtoken-recent", str(RECENT)]
    return out + (["--vtoken-prefill-eviction", "on"] if prefill else [])


def run(model: str, server_flags: list[str], prompts: list[Prompt], new_tokens: int | None = None) -> dict:
    """Every prompt at once (greedy, ``ignore_eos``); the figures of the module docstring."""
    import concurrent.futures as cf

    with SglangServer(model, server_flags) as server:
        start = len(server.log_text())

        def one(p: Prompt) -> dict:
            n = new_tokens or p.answer_tokens + TAIL
            body = {"input_ids": p.ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
            return server.post("/generate", body, timeout=7200)

        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            out = list(ex.map(one, prompts))
        wall = time.monotonic() - t0
        time.sleep(1)
        info = server.get("/get_server_info")["internal_states"][0]
        log = server.log_text()[start:]
        steps = [(int(r), int(t)) for r, t in DECODE.findall(log)]
        prefill_usage = max((float(u) for u in PREFILL.findall(log)), default=0.0)
    state = info.get("vtoken", {})
    right = [p.judge(o["output_ids"]) for p, o in zip(prompts, out)]
    return {
        "accuracy": round(sum(right) / len(right), 3),
        "missed": [i for i, r in enumerate(right) if not r],
        "peak_extend_kv": state.get("peak_extend_kv"),
        "max_running": max((r for r, _ in steps), default=0),
        "peak_tokens_in_use": max((t for _, t in steps), default=0),
        "peak_prefill_usage": prefill_usage,
        "retracted": sum(o["meta_info"].get("num_retractions", 0) > 0 for o in out),
        "prefill_tokens_evicted": state.get("prefill_tokens_evicted"),
        "pages_reclaimed": state.get("pages_reclaimed"),
        "wall_s": round(wall, 1),
    }


def full_in_transformers(model: str, prompts: list[Prompt]) -> dict:
    """The full cache's answers from transformers instead of a server (``--full transformers``: where the server's
    full-cache prefill of the length is too slow here): greedy, float32, SDPA, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()
    t0, right = time.monotonic(), []
    for p in prompts:
        with torch.inference_mode():
            out = lm.generate(torch.tensor([p.ids]), max_new_tokens=p.answer_tokens + TAIL, do_sample=False)
        right.append(p.judge(out[0, len(p.ids) :].tolist()))
    return {
        "accuracy": round(sum(right) / len(right), 3),
        "missed": [i for i, r in enumerate(right) if not r],
        "peak_extend_kv": None,
        "max_running": 1,
        "peak_tokens_in_use": 0,
        "retracted": 0,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_path(ap, default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4000, 8000])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--pool", type=int, default=2048, help="the KV pool of the runs that evict (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-time", action="store_true", help="also time one long prompt's prefill")
    ap.add_argument("--room", action="store_true", help="also the load on a pool of exactly its prompts")
    ap.add_argument("--room-prompts", type=int, default=8)
    ap.add_argument("--no-accuracy", action="store_true", help="skip the accuracy runs (only the extra figures)")
    full_help = "the full-cache run: a server on a pool that holds the prompts, or transformers (no pool)"
    ap.add_argument("--full", choices=("server", "transformers"), default="server", help=full_help)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    model = model_path(args.model_path)
    runs: list[dict] = []
    for length in [] if args.no_accuracy else args.lengths:
        load = text_load(model, "passkey", length, args.prompts, args.seed)
        longest = max(len(p.ids) for p in load.prompts)
        full_pool = sum(len(p.ids) + TEXT_ANSWER + TAIL + PAGE for p in load.prompts)
        spec = {"length": length, "longest": longest, "prompts": args.prompts, "chunk": args.chunk}
        if args.full == "transformers":
            runs.append({**spec, "run": "full_transformers", "pool": 0, **full_in_transformers(model, load.prompts)})
        else:
            full = run(model, flags(full_pool, args.chunk, None, None), load.prompts)
            runs.append({**spec, "run": "full", "pool": full_pool, **full})
        print(runs[-1], flush=True)
        for budget in args.budgets:
            for policy in args.policies:
                result = run(model, flags(args.pool, args.chunk, policy, budget), load.prompts)
                runs.append({**spec, "run": policy, "budget": budget, "pool": args.pool, **result})
                print(runs[-1], flush=True)
    if args.prefill_time:
        load = text_load(model, "passkey", max(args.lengths), 1, args.seed)
        n = len(load.prompts[0].ids)
        for name, server_flags in (
            ("full", flags(n + 2 * PAGE, args.chunk, None, None)),
            ("streaming", flags(args.pool, args.chunk, "streaming", args.budgets[0])),
        ):
            times = [run(model, server_flags, load.prompts, new_tokens=1)["wall_s"] for _ in range(PREFILL_REPEATS)]
            runs.append({"run": f"prefill_time_{name}", "length": n, "chunk": args.chunk, "first_token_s": min(times)})
            print(runs[-1], flush=True)
    if args.room:
        load = text_load(model, "passkey", args.lengths[0], args.room_prompts, args.seed)
        pool = sum(len(p.ids) for p in load.prompts)
        longest, budget = max(len(p.ids) for p in load.prompts), args.budgets[-1]
        for name, prefill in (("room_decode_eviction", False), ("room_prefill_eviction", True)):
            result = run(model, flags(pool, args.chunk, "h2o", budget, prefill), load.prompts)
            runs.append({"run": name, "longest": longest, "budget": budget, "pool": pool, **result})
            print(runs[-1], flush=True)
    print_table(runs)
    return finish(t0, runs, args.json)


def print_table(runs: list[dict]) -> None:
    head = "length | run | budget | pool | accuracy | peak KV in a chunk | pool used: prefill / decode | max running"
    print(f"\n| {head} | retracted | wall s |\n" + "|---" * 10 + "|")
    for r in runs:
        if "accuracy" not in r:
            continue
        print(
            f"| {r['longest']} | {r['run']} | {r.get('budget', '-')} | {r['pool']} | {r['accuracy']} | "
            f"{r['peak_extend_kv'] or '-'} | {r.get('peak_prefill_usage', '-')} / "
            f"{r['peak_tokens_in_use'] / max(r['pool'], 1):.2f} | "
            f"{r['max_running']} | {r['retracted']} | {r['wall_s']} |"
        )
    for r in runs:
        if "accuracy" not in r:
            print(f"| {r['length']} | {r['run']} | first token {r['first_token_s']} s |")


if __name__ == "__main__":
    raise SystemExit(main())
