"""Serving capacity on real SGLang: plain SGLang, Naive-Evict and vToken on the same memory-bound load.

    .venv/bin/python benchmark/serve_capacity.py [--model-path M] [--quick] [--chat TEXT] [--json PATH]
    .venv/bin/python benchmark/serve_capacity.py --shared-prefix [--quick] [--json PATH]

Each mode gets its own server (CPU, page 16, radix cache on, a fixed ``--max-total-tokens`` small enough that KV
memory limits concurrency; all of a run's servers start together, and their loads run one after the other) and the
same load of long generations: N requests sent at once, each a short prompt of INPUT random token ids and exactly
OUTPUT greedy new tokens (ignore_eos). The model: ``--model-path`` (default SmolLM2-135M-Instruct, the real
checkpoint the project builds; ``tiny`` for the tiny random LLaMA). ``--quick`` sizes the load by the model
(``QUICK``). ``--chat TEXT``: the first vToken server answers TEXT as a chat completion before the loads (what a
user of it sees), printed, and its prefix flushed from the radix cache. Naive-Evict and vToken
evict the same victims (same policy, budget and seed). Admission reserves for each request what it can still
grow to: plain SGLang its full length; vToken its eviction budget (evicted tokens give their pages back through
reclaim); Naive-Evict its budget only when the policy's victims empty whole pages (streaming), else its full length
(random victims leave nearly every page with a live token, so eviction frees almost nothing).

Per run: ``max_running_requests`` (peak concurrently running, from the scheduler's per-step log), ``retractions`` (sum
of the requests' ``num_retractions``), ``peak_allocated_pages`` (peak KV pool usage from the same log),
``output_throughput`` (output tokens / wall seconds), ``p95_latency_s``, ``identical_to_naive`` (greedy token ids
equal to the Naive-Evict run of the same policy, over the ``compared`` requests neither run retracted: a retracted
request is prefilled again whole and trimmed anew, so its victims differ), ``step_ms`` (median scheduler time per
decode step: SGLang's per-step log gives #running-req and the step's gen throughput, and N / throughput is the time
since the previous decode step, the whole loop included), ``score_ms`` (vToken's scoring time per decode step: its
``scoring_ms`` counter over the run's decode steps, host time); over time, from the same log (``step_log``):
``series`` (per decode step: running, KV slots in use, queued and, with eviction, the live tokens and pages of the
rows vToken tracks), ``mean_held_pages``, ``pages_per_request`` (pages in use over running requests: what a request
retains, averaged over the steps) and ``utilisation`` (live tokens over the KV slots in use).

Score-based policies (h2o, tova, scissorhands, snapkv) need attention scores the engine collects; ``--score-every``
runs vToken once per k (the first k is the one compared with Naive-Evict), and the cost of scoring is read by
comparing ``step_ms`` with a score-free policy (random) on the same load ("off"). snapkv scores only prefills; its
prompt victims leave the radix tree's pages by copy-on-write.

``--shared-prefix`` runs the copy-on-write scenario instead: requests in groups of ``degree`` (1, 2, 4, 8) share a
random system prompt (``--system-len`` ids, then a question of ``--input-len``), on three servers: Naive-Evict,
vToken without copy-on-write (``--vtoken-cow off``: a request keeps the tree's prompt pages locked until it ends,
the paper's behaviour) and vToken with it. All three evict the same victims, prompt tokens included. Per degree:
``mean_pg`` and ``peak_pg`` (pages held, averaged over the load's logged steps and at their peak: SGLang's token
usage, which leaves out the tree's evictable pages), ``max_run`` and whether the tokens equal Naive-Evict's. The
peak comes at prefill, when every prompt is whole in every mode; the mean is what the decode phase holds. Target:
at degrees 1 and 2, copy-on-write holds >= 25% fewer pages (on the mean).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from serve_bench import (  # noqa: E402
    SHAREGPT_DEFAULTS,
    TINY,
    add_dataset_args,
    add_model_path,
    dash,
    dataset_of,
    decode_step_ms,
    finish,
    model_path,
    random_prompts,
)
from step_log import read_steps  # noqa: E402

from vtoken_sglang.config import DECODE_SCORE_POLICIES, VTokenConfig  # noqa: E402
from vtoken_sglang.integration.parts.admission import Admission, server_policy  # noqa: E402
from vtoken_sglang.tools.bench_load import sharegpt_requests  # noqa: E402
from vtoken_sglang.tools.launcher import SglangServer, default_server_args, started_together  # noqa: E402

PAGE = 16
# --quick's load per model: (--max-total-tokens, requests, input ids, output tokens, plain SGLang measured too). The
# tiny model's decode step is a few ms; a real model's (SmolLM2: 30 layers) about 0.25 s on 2 cores, nearly the
# same at 1 and 16 requests, so its load decodes half as many tokens (its prompts are longer: a batched prefill
# costs a few decode steps) and plain SGLang, which runs what Naive-Evict runs under random victims, is left out.
QUICK = {TINY: (4096, 16, 32, 480, True), "real": (4096, 16, 256, 256, False)}
RUNNING = re.compile(r"#running-req: (\d+)")
USAGE = re.compile(r"token usage: ([0-9.]+)")
RECENT = 16  # --vtoken-recent of every run
REQUESTS = 24  # --requests unless given (or --quick's load sets it)
TOGETHER = 4  # servers started at once (memory: a real model's server holds a few GB)


def run_load(server: SglangServer, prompts: list[list[int] | str], output_lens: list[int]) -> dict:
    """Every prompt (token ids, or a text the server tokenizes) sent at once, each for exactly its output length
    (greedy, ``ignore_eos``)."""

    def one(prompt, output_len):
        t0 = time.monotonic()
        out = server.post(
            "/generate",
            {
                ("text" if isinstance(prompt, str) else "input_ids"): prompt,
                "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
            },
            timeout=1800,
        )
        return out, time.monotonic() - t0

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts, output_lens))
    wall = time.monotonic() - t0
    lat = sorted(r[1] for r in results)
    return {
        "ids": [r[0]["output_ids"] for r in results],
        "retractions": sum(r[0]["meta_info"].get("num_retractions", 0) for r in results),
        "retracted": [r[0]["meta_info"].get("num_retractions", 0) > 0 for r in results],
        "output_throughput": round(sum(len(r[0]["output_ids"]) for r in results) / wall, 1),
        "p95_latency_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 2),
        "wall_s": round(wall, 1),
    }


@dataclasses.dataclass(frozen=True)
class Load:
    """The requests of a run: prompts (ids or texts), their token lengths and output lengths."""

    name: str
    prompts: list
    prompt_lens: list[int]
    output_lens: list[int]

    def describe(self) -> str:
        mean_in = sum(self.prompt_lens) / len(self.prompt_lens)
        mean_out = sum(self.output_lens) / len(self.output_lens)
        longest = max(self.prompt_lens)
        return f"{len(self.prompts)} {self.name} requests (mean {mean_in:.0f} in, max {longest}; {mean_out:.0f} out)"


def make_load(args, model: str) -> Load:
    """``--dataset``: ShareGPT first turns through bench_serving's own loader, or random ids of one length."""
    if args.dataset == "sharegpt":
        reqs = sharegpt_requests(
            model, args.requests, args.output_len, args.sharegpt_context_len, args.seed, args.dataset_path
        )
        return Load("ShareGPT", [r.prompt for r in reqs], [r.prompt_len for r in reqs], [r.output_len for r in reqs])
    prompts = random_prompts(args.requests, args.input_len)
    return Load("random-id", prompts, [args.input_len] * len(prompts), [args.output_len] * len(prompts))


def budget_options(args, ratio: float) -> dict:
    """The eviction budget as VTokenConfig's options: ``--budget`` tokens if given, else ``ratio``."""
    return {"vtoken_budget": args.budget} if args.budget else {"vtoken_budget_ratio": ratio}


def budget_words(args) -> str:
    """The budget as the table's first line says it."""
    return f"budget {args.budget} tokens" if args.budget else f"budget ratio {args.budget_ratio}"


def ideal_running(load: Load, args, mode: str, policy: str | None) -> float:
    """``Admission.ideal_running`` of ``load`` on the server of ``mode`` and ``policy``: vToken charged its budget
    plus slack, Naive-Evict the same plus a page where its victims empty whole pages, else, like plain SGLang, its
    whole length."""
    cfg = None
    if mode != "plain":
        cfg = VTokenConfig.build(
            {
                "enable_vtoken": True,
                "vtoken_policy": policy,
                **budget_options(args, args.budget_ratio),
                "vtoken_recent": RECENT,
            }
        )
    admission = Admission(
        server_policy(cfg, PAGE) if cfg else None,
        reclaim=mode == "vtoken",
        prefix_copies=True,
        page_size=PAGE,
        prompt_in_tree=True,
    )
    final = [p + o for p, o in zip(load.prompt_lens, load.output_lens)]
    return round(admission.ideal_running(final, args.max_total_tokens), 1)


def mode_flags(args, mode: str, policy: str | None, ratio: float, every: int = 1) -> list[str]:
    flags = default_server_args(max_total_tokens=args.max_total_tokens) + ["--decode-log-interval", "1"]
    if mode != "plain":
        flags += [
            "--enable-vtoken",
            "--vtoken-policy",
            policy,
            *[f"--{k.replace('_', '-')}={v}" for k, v in budget_options(args, ratio).items()],
            "--vtoken-recent",
            str(RECENT),
            "--vtoken-reclaim",
            "on" if mode == "vtoken" else "off",
        ]
        if policy in DECODE_SCORE_POLICIES:  # scored at decode steps (not snapkv: once, at prefill)
            flags += ["--vtoken-score-every", str(every)]
    return flags


def measure(
    server: SglangServer, args, reqs: Load, mode: str, policy: str | None, ratio: float, every: int = 1
) -> dict:
    """The load ``reqs`` on ``server`` (started with ``mode_flags`` of the same arguments) and the run's figures."""
    print(f"[serve_capacity] {mode} {policy or ''}: load ...", file=sys.stderr, flush=True)
    start = len(server.log_text())  # the warm-up request and any chat before it are not the load's
    load = run_load(server, reqs.prompts, reqs.output_lens)
    time.sleep(1)
    info = server.get("/get_server_info")["internal_states"][0]
    log = server.log_text()[start:]
    running = [int(m) for m in RUNNING.findall(log)]
    usage = [float(m) for m in USAGE.findall(log)]
    steps = decode_step_ms(log)
    series = read_steps(log)
    vt = info.get("vtoken") or {}
    return {
        "mode": mode,
        "policy": policy or "none",
        "budget_ratio": None if args.budget else ratio if mode != "plain" else 1.0,
        "budget": args.budget if mode != "plain" else None,
        "score_every": every if policy in DECODE_SCORE_POLICIES else None,
        "step_ms": round(steps[len(steps) // 2], 2) if steps else None,
        "score_ms": round(vt["scoring_ms"] / len(steps), 3) if "scoring_ms" in vt and steps else None,
        "max_total_tokens": args.max_total_tokens,
        "page_size": PAGE,
        "requests": args.requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dataset": args.dataset,
        "mean_prompt_len": round(sum(reqs.prompt_lens) / len(reqs.prompt_lens), 1),
        "max_running_requests": max(running, default=0),
        "ideal_running": ideal_running(reqs, args, mode, policy),
        "peak_token_usage": max(usage, default=0.0),
        "admission_reopened": (info.get("vtoken") or {}).get("admission_reopened"),
        "retractions": load["retractions"],
        "peak_allocated_pages": round(max(usage, default=0.0) * args.max_total_tokens / PAGE),
        **series.summary(PAGE),
        "output_throughput": load["output_throughput"],
        "p95_latency_s": load["p95_latency_s"],
        "wall_s": load["wall_s"],
        "vtoken": info.get("vtoken"),
        "series": series.as_json(),
        "_ids": load["ids"],
        "_retracted": load["retracted"],
    }


def same_tokens(run: dict, naive: dict) -> tuple[bool, int]:
    """Whether ``run`` gave ``naive``'s tokens for every request neither retracted, and how many those are."""
    pairs = [
        (mine, theirs)
        for mine, theirs, *retracted in zip(run["_ids"], naive["_ids"], run["_retracted"], naive["_retracted"])
        if not any(retracted)
    ]
    return all(mine == theirs for mine, theirs in pairs), len(pairs)


def chat(server: SglangServer, question: str) -> None:
    """Print ``server``'s greedy chat answer to ``question`` (OpenAI API), then flush it from the radix cache."""
    body = {"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": 64}
    answer = server.post("/v1/chat/completions", {**body, "temperature": 0})["choices"][0]["message"]["content"]
    print(f"vToken server, chat: {question!r}\n  -> {answer.strip()!r}", flush=True)
    server.get_text("/flush_cache")


SHARED_MODES = (
    ("naive", ["--vtoken-reclaim", "off"]),
    ("no-cow", ["--vtoken-cow", "off"]),
    ("cow", ["--vtoken-cow", "on"]),
)


def shared_prefix_prompts(requests: int, degree: int, system_len: int, question_len: int, seed: int) -> list[list[int]]:
    """``requests`` prompts in groups of ``degree`` sharing a random system prompt of ``system_len`` ids, each with
    its own random question; the groups' system prompts are random, so they share no page."""
    systems = random_prompts(requests // degree, system_len, seed=seed)
    questions = random_prompts(requests, question_len, seed=seed + 1)
    return [systems[i // degree] + questions[i] for i in range(requests)]


def run_shared_prefix(model: str, args) -> list[dict]:
    """One server per mode (Naive-Evict, vToken without copy-on-write, vToken with it); on it, one load per sharing
    degree, each over new system prompts. Per load: the mean and the peak of SGLang's token usage over its logged
    steps (pages held: the pool less free pages and less the tree's evictable pages, which any allocation may take
    back), peak running requests, and the greedy tokens (compared across modes)."""
    runs = []
    for mode, extra in SHARED_MODES:
        flags = (
            default_server_args(max_total_tokens=args.max_total_tokens)
            + ["--decode-log-interval", "1"]
            + [
                "--enable-vtoken",
                "--vtoken-policy",
                args.policies[0],
                "--vtoken-budget-ratio",
                str(args.budget_ratio),
                "--vtoken-recent",
                "16",
            ]
            + extra
        )
        print(f"[serve_capacity] shared prefix, {mode}: starting a server ...", file=sys.stderr, flush=True)
        with SglangServer(model, flags) as server:
            for degree in args.degrees:
                start = len(server.log_text())
                prompts = shared_prefix_prompts(
                    args.requests, degree, args.system_len, args.input_len, seed=100 * degree
                )
                load = run_load(server, prompts, [args.output_len] * len(prompts))
                time.sleep(1)
                log = server.log_text()[start:]
                vt = server.get("/get_server_info")["internal_states"][0]["vtoken"]
                usage = [float(m) for m in USAGE.findall(log)]
                runs.append(
                    {
                        "mode": mode,
                        "policy": args.policies[0],
                        "budget_ratio": args.budget_ratio,
                        "degree": degree,
                        "requests": args.requests,
                        "system_len": args.system_len,
                        "question_len": args.input_len,
                        "output_len": args.output_len,
                        "max_total_tokens": args.max_total_tokens,
                        "max_running_requests": max((int(m) for m in RUNNING.findall(log)), default=0),
                        "peak_held_pages": round(max(usage, default=0.0) * args.max_total_tokens / PAGE),
                        "mean_held_pages": round(sum(usage) / max(len(usage), 1) * args.max_total_tokens / PAGE, 1),
                        "retractions": load["retractions"],
                        "output_throughput": load["output_throughput"],
                        "cow_copies": vt.get("cow_copies"),
                        "cow_pages_released": vt.get("cow_pages_released"),
                        "_ids": load["ids"],
                    }
                )
    for r in runs:
        base = next(b for b in runs if b["mode"] == "naive" and b["degree"] == r["degree"])
        r["identical_to_naive"] = r["_ids"] == base["_ids"]
    return runs


def print_shared_prefix(runs: list[dict], args) -> None:
    print(
        f"serve_capacity --shared-prefix: {args.requests} requests, system prompt {args.system_len} + question "
        f"{args.input_len} ids, {args.output_len} out, --max-total-tokens {args.max_total_tokens}, page {PAGE}, "
        f"{args.policies[0]} budget ratio {args.budget_ratio}; cumulative cow counters"
    )
    hdr = (
        f"{'degree':>6}  {'mode':<8}{'max_run':>8}{'mean_pg':>8}{'peak_pg':>8}{'retract':>8}{'out_tok/s':>10}{'cow':>6}"
        f"{'released':>9}{'same':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in sorted(runs, key=lambda r: r["degree"]):
        print(
            f"{r['degree']:>6}  {r['mode']:<8}{r['max_running_requests']:>8}{r['mean_held_pages']:>8.1f}"
            f"{r['peak_held_pages']:>8}{r['retractions']:>8}"
            f"{r['output_throughput']:>10.1f}{dash(r['cow_copies'], 'd'):>6}{dash(r['cow_pages_released'], 'd'):>9}"
            f"{'yes' if r['identical_to_naive'] else 'NO':>6}"
        )
    for degree in args.degrees:
        off = next(r for r in runs if r["mode"] == "no-cow" and r["degree"] == degree)
        on = next(r for r in runs if r["mode"] == "cow" and r["degree"] == degree)
        fewer = 1 - on["mean_held_pages"] / max(off["mean_held_pages"], 1)
        peak = 1 - on["peak_held_pages"] / max(off["peak_held_pages"], 1)
        verdict = f"  target (>= 25% fewer): {'met' if fewer >= 0.25 else 'MISSED'}" if degree <= 2 else ""
        print(
            f"degree {degree}: copy-on-write holds {100 * fewer:.0f}% fewer pages than vToken without it on average "
            "over "
            f"the steps ({off['mean_held_pages']} -> {on['mean_held_pages']}), {100 * peak:.0f}% fewer at the peak "
            f"({off['peak_held_pages']} -> {on['peak_held_pages']}){verdict}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    add_model_path(ap, default="smollm2")
    ap.add_argument("--chat", help="a question the first vToken server answers as a chat completion, printed")
    ap.add_argument("--policies", nargs="+", default=None, help="default: random streaming (--shared-prefix: random)")
    ap.add_argument("--budget-ratio", type=float, default=None, help="default: 0.5 (--shared-prefix: 0.25)")
    ap.add_argument("--budget", type=int, help="tokens kept per request, for --budget-ratio (not --shared-prefix)")
    ap.add_argument(
        "--shared-prefix",
        action="store_true",
        help="the shared-prefix scenario: Naive-Evict, vToken without and with copy-on-write, per sharing degree",
    )
    ap.add_argument("--degrees", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--max-total-tokens", type=int, default=None, help="default: 8192 (--shared-prefix: 32768)")
    ap.add_argument("--requests", type=int, help=f"default {REQUESTS} (--quick: its load's; ShareGPT 32)")
    ap.add_argument(
        "--input-len", type=int, default=None, help="prompt ids; default: 64 (--shared-prefix: the question, 16)"
    )
    ap.add_argument(
        "--output-len", type=int, default=None, help="default: 960 (ShareGPT: 128, its --sharegpt-output-len)"
    )
    add_dataset_args(ap)
    ap.add_argument("--seed", type=int, default=1, help="bench_serving's --seed: which ShareGPT conversations")
    ap.add_argument(
        "--score-every",
        nargs="+",
        type=int,
        default=[1, 4],
        help="score-based policies: vToken runs once per k (the first is compared with Naive-Evict)",
    )
    args = ap.parse_args(argv)
    if args.budget and (args.budget_ratio or args.shared_prefix):
        ap.error("--budget replaces --budget-ratio, and --shared-prefix takes ratios only")
    model = model_path(args.model_path)
    t0 = time.monotonic()
    if args.shared_prefix:
        args.policies = args.policies or ["random"]
        args.budget_ratio = args.budget_ratio or 0.25
        args.input_len = args.input_len or 16  # the question
        args.output_len = args.output_len or 960
        args.max_total_tokens = args.max_total_tokens or 32768
        if args.quick:
            args.requests, args.system_len, args.output_len = 8, 256, 256
        args.requests = args.requests or REQUESTS
        if any(args.requests % d for d in args.degrees):
            ap.error("--requests must be a multiple of every --degrees value")
        runs = run_shared_prefix(model, args)
        print_shared_prefix(runs, args)
        return finish(t0, runs, args.json)
    real = args.model_path != TINY
    args.dataset = dataset_of(args)
    args.policies = args.policies or (["random"] if args.quick and real else ["random", "streaming"])
    args.budget_ratio = args.budget_ratio or 0.5
    plain = True
    if args.dataset == "sharegpt":
        args.output_len = args.output_len or SHAREGPT_DEFAULTS["output_len"]
        args.max_total_tokens = args.max_total_tokens or SHAREGPT_DEFAULTS["max_total_tokens"]
        if args.quick:
            args.requests, plain = args.requests or 32, False
    else:
        args.input_len, args.max_total_tokens = args.input_len or 64, args.max_total_tokens or 8192
        args.output_len = args.output_len or 960
        if args.quick:
            args.max_total_tokens, args.requests, args.input_len, args.output_len, plain = QUICK[
                "real" if real else TINY
            ]
    args.requests = args.requests or REQUESTS
    load = make_load(args, model)
    todo = [("plain", None, 1.0, 1)] if plain else []
    for policy in args.policies:
        todo += [(mode, policy, args.budget_ratio, args.score_every[0]) for mode in ("naive", "vtoken")]
        if policy in DECODE_SCORE_POLICIES:  # the cost of scoring every k steps (other victims)
            todo += [("vtoken", policy, args.budget_ratio, k) for k in args.score_every[1:]]
    runs = []
    for at in range(0, len(todo), TOGETHER):
        group = todo[at : at + TOGETHER]
        servers = [SglangServer(model, mode_flags(args, *config)) for config in group]
        print(f"[serve_capacity] starting {len(servers)} servers ...", file=sys.stderr, flush=True)
        with started_together(*servers):
            if args.chat and at == 0:
                chat(next(s for s, c in zip(servers, group) if c[0] == "vtoken"), args.chat)
            runs += [measure(server, args, load, *config) for server, config in zip(servers, group)]
    for r in runs:  # each vToken run against the Naive-Evict run of its policy (the first k of a score policy)
        naive = next((n for n in runs if n["mode"] == "naive" and n["policy"] == r["policy"]), None)
        first = r["score_every"] in (None, args.score_every[0])
        if r["mode"] == "vtoken":
            r["identical_to_naive"], r["compared"] = same_tokens(r, naive) if first else (None, None)
        else:
            r["identical_to_naive"] = True if r["mode"] == "naive" else None
    print(
        f"serve_capacity: {load.describe()}, --max-total-tokens {args.max_total_tokens}, page {PAGE}, "
        f"{budget_words(args)}"
    )
    hdr = (
        f"{'mode':<8}{'policy':<13}{'every':>6}{'max_run':>8}{'ideal':>7}{'usage':>7}{'retract':>8}{'peak_pg':>8}"
        f"{'mean_pg':>8}{'pg/req':>7}{'util':>6}{'out_tok/s':>10}{'p95_s':>7}{'step_ms':>8}{'score_ms':>9}{'same':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in runs:
        same = "-" if r["identical_to_naive"] is None else ("yes" if r["identical_to_naive"] else "NO")
        print(
            f"{r['mode']:<8}{r['policy']:<13}{dash(r['score_every'], 'd'):>6}{r['max_running_requests']:>8}"
            f"{dash(r['ideal_running'], '.1f'):>7}{r['peak_token_usage']:>7.2f}{r['retractions']:>8}"
            f"{r['peak_allocated_pages']:>8}{dash(r['mean_held_pages'], '.1f'):>8}"
            f"{dash(r['pages_per_request'], '.2f'):>7}{dash(r['utilisation'], '.2f'):>6}"
            f"{r['output_throughput']:>10.1f}{r['p95_latency_s']:>7.2f}"
            f"{dash(r['step_ms'], '.2f'):>8}{dash(r['score_ms'], '.3f'):>9}{same:>6}"
        )
    for policy in args.policies:
        n = next(r for r in runs if r["mode"] == "naive" and r["policy"] == policy)
        v = next(r for r in runs if r["mode"] == "vtoken" and r["policy"] == policy)  # the first k
        gain = v["max_running_requests"] / max(n["max_running_requests"], 1)
        verdict = ""
        if v["ideal_running"]:
            verdict += f"; vToken runs {v['max_running_requests'] / v['ideal_running']:.2f} of its ideal"
        if policy == "random" and not args.budget and args.budget_ratio == 0.5 and args.dataset == "random":
            ok = gain >= 1.8 and v["retractions"] == 0 and v["identical_to_naive"]
            verdict = f"  target (>= 1.8, no retraction, identical): {'met' if ok else 'MISSED'}"
        print(
            f"{policy}: vToken / Naive-Evict max running = {gain:.2f}, retractions {n['retractions']} -> "
            f"{v['retractions']}, throughput x{v['output_throughput'] / max(n['output_throughput'], 1e-9):.2f}{verdict}"
        )
        if n["pages_per_request"] and v["pages_per_request"]:
            print(
                f"  {policy}: pages retained per running request {n['pages_per_request']:.2f} -> "
                f"{v['pages_per_request']:.2f} (x{v['pages_per_request'] / n['pages_per_request']:.2f}), live tokens "
                f"over slots in use {dash(n['utilisation'], '.2f')} -> {dash(v['utilisation'], '.2f')}"
            )
        if v["compared"] < len(v["_ids"]):
            print(f"  {policy}: tokens compared over the {v['compared']} requests neither run retracted")
    off = next((r for r in runs if r["mode"] == "vtoken" and r["policy"] == "random"), None)
    for policy in [p for p in args.policies if p in DECODE_SCORE_POLICIES]:
        parts = [
            f"every {r['score_every']}: step {dash(r['step_ms'], '.2f')} ms (scoring {dash(r['score_ms'], '.3f')} ms)"
            for r in runs
            if r["mode"] == "vtoken" and r["policy"] == policy
        ]
        base = f"; off (random, no scores): step {dash(off['step_ms'], '.2f')} ms" if off else ""
        print(f"{policy} scoring cost per decode step, vToken: {', '.join(parts)}{base}")
    return finish(t0, runs, args.json)


if __name__ == "__main__":
    sys.exit(main())
