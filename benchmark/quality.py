"""Policy quality against memory in real SGLang, on the recall model (a small LLaMA trained here to find needles).

    .venv/bin/python benchmark/quality.py [--quick] [--json PATH] [--policies P ...] [--ratios R ...]

One server per (policy, budget ratio, mode): ``none`` (full KV cache) once, then each policy at each ratio as
Naive-Evict (``--vtoken-reclaim off``: evicted tokens only masked, their pages kept) and as vToken (reclaim on).
Every server gets the same prompts of ``recall_model.RecallTask`` (half ask their question first, half at the end)
at once, greedy; each request decodes its answer and ``TAIL`` tokens more (``ignore_eos``), so that the pages held
are read over decode steps after the eviction rounds, not only while a few-token answer ends. Per run:

- ``accuracy``: share of prompts answered exactly (the first answer-length tokens, every one right);
- ``mean_held_pages`` / ``peak_held_pages``: KV pages held over the load's decode steps (the tokens in use in
  SGLang's per-step decode log, which leaves out the radix tree's evictable pages, over the page size) and at their
  peak; decode steps only: at prefill every mode holds the whole prompts;
- ``max_running_requests`` on the fixed pool (``--max-total-tokens``, by default room for every prompt at once, so
  that the pages held are what the requests need; on a smaller pool, admission is bound by the whole prompts each
  prefill holds: ``serve_capacity.py`` is the capacity benchmark);
- ``identical_to_naive`` (vToken runs): the same output tokens (answer and tail) as Naive-Evict with the same
  policy and ratio, over the ``compared`` requests that neither run retracted (``retracted``: requests SGLang
  retracted for memory; such a request is prefilled again whole and trimmed anew, so its victims differ).

``--policies`` takes built-in names or ``package.module:ClassName`` (a policy of one's own, on ``PYTHONPATH``).
``--quick`` (CI): the quick recall model, policies random and h2o at ratio 0.5, and ``none``, on a pool without
the page of slack per request (``QUICK_POOL_SLACK``): Naive-Evict cannot hold every request at once, vToken can, and
its copy-on-write of the prompts' tree pages has to make room by evicting the tree pages it just released (the
path the full load takes); so there ``max_run`` is the figure to compare, and vToken's longer-running batch holds
more pages on average.
The figure: ``benchmark/plots.py`` draws ``quality_pages.png`` (accuracy against pages held per request, a curve
per policy) from ``results/quality.json``.
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

from serve_bench import finish, write_runs_json  # noqa: E402
from serve_capacity import PAGE  # noqa: E402

from vtoken_sglang import recall_model  # noqa: E402
from vtoken_sglang.serving import SglangServer, default_server_args, started_together  # noqa: E402

POLICIES = ("streaming", "random", "h2o", "tova", "scissorhands", "snapkv")
RATIOS = (0.5, 0.25, 0.125)
QUICK_POLICIES, QUICK_RATIOS = ("random", "h2o"), (0.5,)
QUICK_POOL_SLACK = 0  # tokens of slack per request in the quick run's pool (the full run: a page)
SINKS, RECENT, WINDOW = 4, 8, 8  # the question-first layout's question is in the sinks
TOGETHER = 5  # servers started at once (memory); the quick run's five in one group
TAIL = 32  # tokens decoded after the answer
DECODE = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+)")


def server_flags(policy: str, ratio: float | None, reclaim: str, pool: int) -> list[str]:
    flags = default_server_args(max_total_tokens=pool) + ["--decode-log-interval", "1", "--enable-vtoken"]
    if policy == "none":
        return flags
    flags += ["--vtoken-policy", policy, "--vtoken-budget-ratio", str(ratio), "--vtoken-reclaim", reclaim]
    flags += ["--vtoken-sinks", str(SINKS), "--vtoken-recent", str(RECENT)]
    if policy == "snapkv":
        flags += ["--vtoken-window", str(WINDOW)]
    return flags


def run_load(server: SglangServer, prompts: list[recall_model.RecallPrompt]) -> tuple[list[dict], dict]:
    """Every prompt at once; the responses (``output_ids``, ``meta_info``) and the server's vToken state after."""

    def one(p: recall_model.RecallPrompt) -> dict:
        sampling = {"max_new_tokens": len(p.answer) + TAIL, "temperature": 0.0, "ignore_eos": True}
        return server.post("/generate", {"input_ids": p.ids, "sampling_params": sampling}, timeout=1800)

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(one, prompts))
    time.sleep(1)
    return responses, server.get("/get_server_info")["internal_states"][0]["vtoken"]


def measure(config: dict, server: SglangServer, prompts: list[recall_model.RecallPrompt], pool: int) -> dict:
    start = len(server.log_text())  # SGLang's warm-up request is in the log before
    responses, state = run_load(server, prompts)
    outputs = [r["output_ids"] for r in responses]
    retracted = [r["meta_info"].get("num_retractions", 0) > 0 for r in responses]
    steps = [(int(running), int(tokens)) for running, tokens in DECODE.findall(server.log_text()[start:])]
    held = [tokens / PAGE for _, tokens in steps]
    right = [out[: len(p.answer)] == p.answer for out, p in zip(outputs, prompts)]
    return {
        **config,
        "accuracy": round(sum(right) / len(prompts), 4),
        # the layouts alternate (recall_model.RecallTask.prompts): the question first at even indices
        "accuracy_question_first": round(sum(right[0::2]) / max(len(right[0::2]), 1), 4),
        "accuracy_question_at_end": round(sum(right[1::2]) / max(len(right[1::2]), 1), 4),
        "mean_held_pages": round(sum(held) / max(len(held), 1), 1),
        "peak_held_pages": round(max(held, default=0)),
        "max_running_requests": max((running for running, _ in steps), default=0),
        "tokens_evicted": state["tokens_evicted"],
        "pages_reclaimed": state["pages_reclaimed"],
        **{k: state.get(k, 0) for k in ("cow_copies", "cow_pages_released", "cow_room_pages", "cow_deferred")},
        "retracted": sum(retracted),
        "_outputs": outputs,
        "_retracted": retracted,
    }


def configs(policies: list[str], ratios: list[float]) -> list[dict]:
    out = [{"policy": "none", "budget_ratio": 1.0, "mode": "vtoken"}]
    for policy in policies:
        for ratio in ratios:
            out += [{"policy": policy, "budget_ratio": ratio, "mode": mode} for mode in ("naive", "vtoken")]
    return out


def run(model: str, prompts: list[recall_model.RecallPrompt], todo: list[dict], pool: int, done) -> list[dict]:
    """The runs of ``todo``, ``TOGETHER`` servers started at once, their loads one after the other; ``done(runs)``
    after each group (the runs so far)."""
    runs = []
    for at in range(0, len(todo), TOGETHER):
        group = todo[at : at + TOGETHER]
        servers = [
            SglangServer(
                model,
                server_flags(c["policy"], c["budget_ratio"], "off" if c["mode"] == "naive" else "on", pool),
            )
            for c in group
        ]
        names = ", ".join(f"{c['policy']}/{c['budget_ratio']}/{c['mode']}" for c in group)
        print(f"[quality] starting {names} ...", file=sys.stderr, flush=True)
        with started_together(*servers):
            runs += [measure(c, s, prompts, pool) for c, s in zip(group, servers)]
        done(runs)
    naive = {(r["policy"], r["budget_ratio"]): r for r in runs if r["mode"] == "naive"}
    for r in runs:
        if r["mode"] == "vtoken" and r["policy"] != "none":
            base = naive[r["policy"], r["budget_ratio"]]
            both = zip(r["_outputs"], base["_outputs"], r["_retracted"], base["_retracted"])
            pairs = [(mine, theirs) for mine, theirs, *retracted in both if not any(retracted)]
            r["identical_to_naive"] = all(mine == theirs for mine, theirs in pairs)
            r["compared"] = len(pairs)
    return runs


def print_table(runs: list[dict], spec: recall_model.RecallSpec, prompts: int, pool: int) -> None:
    print(
        f"quality: {prompts} recall prompts of {spec.context} tokens ({spec.needles} needles of {spec.value_len} "
        f"values; half ask first, half at the end), page {PAGE}, pool {pool} tokens, sinks {SINKS}, recent {RECENT}"
    )
    print(
        f"{'policy':<14}{'ratio':>6}  {'mode':<8}{'accuracy':>9}{'q_first':>9}{'q_end':>9}"
        f"{'mean_pg':>9}{'peak_pg':>9}{'max_run':>9}{'retract':>8}  same"
    )
    for r in runs:
        same = {True: "yes", False: "NO", None: "-"}[r.get("identical_to_naive")]
        if r.get("compared", len(r["_outputs"])) < len(r["_outputs"]):
            same += f" ({r['compared']} not retracted)"
        print(
            f"{r['policy']:<14}{r['budget_ratio']:>6}  {r['mode']:<8}{r['accuracy']:>9.3f}"
            f"{r['accuracy_question_first']:>9.3f}{r['accuracy_question_at_end']:>9.3f}"
            f"{r['mean_held_pages']:>9.1f}{r['peak_held_pages']:>9}{r['max_running_requests']:>9}"
            f"{r['retracted']:>8}  {same}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick model, random and h2o at 0.5, a tight pool (CI)")
    ap.add_argument("--policies", nargs="+", help=f"default: {' '.join(POLICIES)}")
    ap.add_argument("--ratios", type=float, nargs="+", help=f"default: {' '.join(map(str, RATIOS))}")
    ap.add_argument("--prompts", type=int, help="prompts per run (default 64; quick 16)")
    ap.add_argument(
        "--max-total-tokens", type=int, help="the KV pool (default: room for every prompt at once; quick: just not)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    spec = recall_model.QUICK if args.quick else recall_model.RecallSpec()
    policies = args.policies or list(QUICK_POLICIES if args.quick else POLICIES)
    ratios = args.ratios or list(QUICK_RATIOS if args.quick else RATIOS)
    count = args.prompts or (16 if args.quick else 64)
    model = str(recall_model.build(spec=spec))
    prompts = recall_model.RecallTask(spec, spec.seed + 3).prompts(count)
    slack = QUICK_POOL_SLACK if args.quick else PAGE
    pool = args.max_total_tokens or count * (spec.context + 1 + spec.value_len + TAIL + slack)
    fields = dict(context=spec.context, prompts=count, max_total_tokens=pool, spec=dataclasses.asdict(spec))
    todo = [{**c, **fields} for c in configs(policies, ratios)]
    # a long run keeps what it measured: the runs so far are written after each group
    runs = run(model, prompts, todo, pool, lambda so_far: args.json and write_runs_json(args.json, so_far))
    print_table(runs, spec, count, pool)
    return finish(t0, runs, args.json)


if __name__ == "__main__":
    sys.exit(main())
