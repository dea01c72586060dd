"""Policy quality against memory in real SGLang: exact answers against KV pages held, per policy and budget ratio.

    .venv/bin/python benchmark/quality.py [--model-path smollm2] [--task passkey|prose] [--context N] [--quick]
        [--json PATH] [--policies P ...] [--ratios R ...] [--prompts N] [--max-total-tokens N]

Tasks: on a pretrained checkpoint (by default SmolLM2-135M-Instruct, built by ``vtoken_sglang.tools.pretrained``), the
real-text tasks of ``vtoken_sglang.tools.text_tasks``: ``passkey`` (a 5-digit key hidden at a random depth in filler
text) and ``prose`` (a person's name copied out of one paragraph of hand-written prose among others naming other
people); ``--model-path recall``: the recall model trained here (``vtoken_sglang.tools.recall_model``, needles of token
ids). Half the prompts ask their question first, half at the end.

One server per (policy, budget ratio, mode): ``none`` (full KV cache) once, then each policy at each ratio as
Naive-Evict (``--vtoken-reclaim off``: evicted tokens only masked, their pages kept) and as vToken (reclaim on).
Every server gets the same prompts at once, greedy; each request decodes its answer and ``TAIL`` tokens more
(``ignore_eos``), so that the pages held are read over decode steps after the eviction rounds, not only while a
few-token answer ends. Per run:

- ``accuracy``: share of prompts answered exactly (recall: the answer's tokens, every one right; text tasks: the
  decoded answer, ``TextPrompt.correct``);
- ``mean_held_pages`` / ``peak_held_pages``: KV pages held over the load's decode steps, as SGLang counts them (the
  tokens in use in its per-step decode log, which leaves out the radix tree's evictable pages: tree pages that
  copy-on-write released count as free) over the page size, and at their peak; decode steps only: at prefill
  every mode holds the whole prompts;
- what vToken freed: ``pages_reclaimed`` (relocation's private pages) and ``cow_pages_released`` (the tree's pages
  copy-on-write left without a lock: on a long-prompt, short-answer load the prompt's tokens are all in the tree);
- ``max_running_requests`` on the fixed pool (``--max-total-tokens``, by default room for every prompt at once, so
  that the pages held are what the requests need; on a smaller pool, admission is bound by the whole prompts each
  prefill holds: ``serve_capacity.py`` is the capacity benchmark);
- ``identical_to_naive`` (vToken runs): the same output tokens (answer and tail) as Naive-Evict with the same
  policy and ratio, over the ``compared`` requests that neither run retracted (``retracted``: requests SGLang
  retracted for memory; such a request is prefilled again whole and trimmed anew, so its victims differ).

``--policies`` takes built-in names or ``package.module:ClassName`` (a policy of one's own, on ``PYTHONPATH``).
``--quick`` (CI): policies random and h2o at ratio 0.5 (no ``none`` run: h2o's accuracy shows the task is solvable;
random under vToken alone, the contrast in accuracy, and h2o under both modes), few short prompts (real model: pass
keys in ``QUICK_CONTEXT`` tokens; recall: its quick model) and a tail of ``QUICK_TAIL`` tokens, on a pool without the
page of slack per request (``QUICK_POOL_SLACK``): Naive-Evict cannot hold every request at once, vToken can, and its
copy-on-write of the prompts' tree pages has to make room by evicting the tree pages it just released (the path the
full load takes); so there ``max_run`` is the figure to compare, and vToken's longer-running batch holds more pages on
average.
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
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from serve_bench import add_model_path, finish, model_path, write_runs_json  # noqa: E402
from serve_capacity import PAGE  # noqa: E402

from vtoken_sglang.tools import recall_model, text_tasks  # noqa: E402
from vtoken_sglang.tools.launcher import SglangServer, default_server_args, started_together  # noqa: E402

POLICIES = ("streaming", "random", "h2o", "tova", "scissorhands", "snapkv")
RATIOS = (0.5, 0.25, 0.125)
QUICK_POLICIES, QUICK_RATIOS = ("random", "h2o"), (0.5,)
QUICK_NAIVE = ("h2o",)  # the quick run's policies also run under Naive-Evict
QUICK_POOL_SLACK = 0  # tokens of slack per request in the quick run's pool (the full run: a page)
SINKS, RECENT, WINDOW = 4, 8, 8  # the question-first layout's question is in the sinks (recall model)
TOGETHER = 5  # servers started at once (memory); the quick run's in one group
TAIL, QUICK_TAIL = 32, 8  # tokens decoded after the answer
RECALL = "recall"  # --model-path: the recall model trained here
TEXT_ANSWER = 10  # new tokens a text task's answer is read from (a 5-digit key, a first and last name)
CONTEXT, QUICK_CONTEXT = 1000, 400  # prompt tokens of the text tasks (at most)
PROMPTS, QUICK_PROMPTS = 24, 8
DECODE = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+)")


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]
    answer_tokens: int  # new tokens the answer is read from (the request decodes TAIL more)
    question_first: bool
    judge: Callable[[list[int]], bool]  # output ids (answer and tail) -> answered exactly


@dataclasses.dataclass(frozen=True)
class Load:
    prompts: list[Prompt]
    title: str  # what the table's header says of them
    spec: dict  # what determines them (into the JSON)


def recall_load(quick: bool, count: int) -> tuple[str, Load]:
    """The recall model (trained on first use, then cached) and ``count`` prompts of its task."""
    spec = recall_model.QUICK if quick else recall_model.RecallSpec()
    return str(recall_model.build(spec=spec)), recall_prompts(spec, count)


def recall_prompts(spec: recall_model.RecallSpec, count: int) -> Load:
    prompts = []
    for i, p in enumerate(recall_model.RecallTask(spec, spec.seed + 3).prompts(count)):
        answer = list(p.answer)
        prompts.append(Prompt(p.ids, len(answer), i % 2 == 0, lambda out, a=answer: out[: len(a)] == a))
    title = f"recall prompts of {spec.context} tokens ({spec.needles} needles of {spec.value_len} values)"
    return Load(prompts, title, {"task": "recall", "context": spec.context, **dataclasses.asdict(spec)})


def text_load(model: str, task: str, context: int, count: int, seed: int) -> Load:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for p in text_tasks.prompts(task, tok, context, count, seed):
        judge = lambda out, p=p: p.correct(tok.decode(out[:TEXT_ANSWER]))  # noqa: E731
        prompts.append(Prompt(p.ids, TEXT_ANSWER, p.question_first, judge))
    lengths = [len(p.ids) for p in prompts]
    title = f"{task} prompts of {min(lengths)}-{max(lengths)} tokens"
    return Load(prompts, title, {"task": task, "context": context, "seed": seed})


def server_flags(policy: str, ratio: float | None, reclaim: str, pool: int) -> list[str]:
    flags = default_server_args(max_total_tokens=pool) + ["--decode-log-interval", "1", "--enable-vtoken"]
    if policy == "none":
        return flags
    flags += ["--vtoken-policy", policy, "--vtoken-budget-ratio", str(ratio), "--vtoken-reclaim", reclaim]
    flags += ["--vtoken-sinks", str(SINKS), "--vtoken-recent", str(RECENT)]
    if policy == "snapkv":
        flags += ["--vtoken-window", str(WINDOW)]
    return flags


def run_load(server: SglangServer, prompts: list[Prompt], tail: int) -> tuple[list[dict], dict]:
    """Every prompt at once, each decoding its answer and ``tail`` tokens more; the responses (``output_ids``,
    ``meta_info``) and the server's vToken state after."""

    def one(p: Prompt) -> dict:
        sampling = {"max_new_tokens": p.answer_tokens + tail, "temperature": 0.0, "ignore_eos": True}
        return server.post("/generate", {"input_ids": p.ids, "sampling_params": sampling}, timeout=3600)

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(one, prompts))
    time.sleep(1)
    return responses, server.get("/get_server_info")["internal_states"][0]["vtoken"]


def _share(right: list[bool]) -> float:
    return round(sum(right) / max(len(right), 1), 4)


def measure(config: dict, server: SglangServer, prompts: list[Prompt], tail: int) -> dict:
    start = len(server.log_text())  # SGLang's warm-up request is in the log before
    responses, state = run_load(server, prompts, tail)
    outputs = [r["output_ids"] for r in responses]
    retracted = [r["meta_info"].get("num_retractions", 0) > 0 for r in responses]
    steps = [(int(running), int(tokens)) for running, tokens in DECODE.findall(server.log_text()[start:])]
    held = [tokens / PAGE for _, tokens in steps]
    right = [p.judge(out) for out, p in zip(outputs, prompts)]
    return {
        **config,
        "accuracy": _share(right),
        "accuracy_question_first": _share([r for r, p in zip(right, prompts) if p.question_first]),
        "accuracy_question_at_end": _share([r for r, p in zip(right, prompts) if not p.question_first]),
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


def configs(
    policies: list[str], ratios: list[float], full: bool = True, naive: tuple[str, ...] | None = None
) -> list[dict]:
    """``none`` (the full cache; if ``full``), then for each policy and ratio Naive-Evict (for the policies in
    ``naive``; None: all) and vToken."""
    out = [{"policy": "none", "budget_ratio": 1.0, "mode": "vtoken"}] if full else []
    for policy in policies:
        modes = ("naive", "vtoken") if naive is None or policy in naive else ("vtoken",)
        for ratio in ratios:
            out += [{"policy": policy, "budget_ratio": ratio, "mode": mode} for mode in modes]
    return out


def run(model: str, prompts: list[Prompt], todo: list[dict], pool: int, tail: int, done) -> list[dict]:
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
            runs += [measure(c, s, prompts, tail) for c, s in zip(group, servers)]
        done(runs)
    naive = {(r["policy"], r["budget_ratio"]): r for r in runs if r["mode"] == "naive"}
    for r in runs:
        base = naive.get((r["policy"], r["budget_ratio"]))
        if r["mode"] == "vtoken" and base is not None:
            both = zip(r["_outputs"], base["_outputs"], r["_retracted"], base["_retracted"])
            pairs = [(mine, theirs) for mine, theirs, *retracted in both if not any(retracted)]
            r["identical_to_naive"] = all(mine == theirs for mine, theirs in pairs)
            r["compared"] = len(pairs)
    return runs


def print_table(runs: list[dict], load: Load, model: str, pool: int) -> None:
    print(
        f"quality: {len(load.prompts)} {load.title} on {Path(model).name} (half ask first, half at the end), "
        f"page {PAGE}, pool {pool} tokens, sinks {SINKS}, recent {RECENT}"
    )
    print(
        f"{'policy':<14}{'ratio':>6}  {'mode':<8}{'accuracy':>9}{'q_first':>9}{'q_end':>9}"
        f"{'mean_pg':>9}{'peak_pg':>9}{'max_run':>9}{'reclaim':>8}{'cow_rel':>8}{'retract':>8}  same"
    )
    for r in runs:
        same = {True: "yes", False: "NO", None: "-"}[r.get("identical_to_naive")]
        if r.get("compared", len(r["_outputs"])) < len(r["_outputs"]):
            same += f" ({r['compared']} not retracted)"
        print(
            f"{r['policy']:<14}{r['budget_ratio']:>6}  {r['mode']:<8}{r['accuracy']:>9.3f}"
            f"{r['accuracy_question_first']:>9.3f}{r['accuracy_question_at_end']:>9.3f}"
            f"{r['mean_held_pages']:>9.1f}{r['peak_held_pages']:>9}{r['max_running_requests']:>9}"
            f"{r['pages_reclaimed']:>8}{r['cow_pages_released']:>8}{r['retracted']:>8}  {same}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    add_model_path(ap, "smollm2", extra=(RECALL,))
    ap.add_argument("--task", choices=text_tasks.TASKS, default="passkey", help="the real-text task (default passkey)")
    ap.add_argument("--context", type=int, help=f"text tasks' prompt tokens (default {CONTEXT}; quick {QUICK_CONTEXT})")
    ap.add_argument("--seed", type=int, default=0, help="the text tasks' prompts")
    ap.add_argument("--quick", action="store_true", help="random and h2o at 0.5, few short prompts, a tight pool (CI)")
    ap.add_argument("--policies", nargs="+", help=f"default: {' '.join(POLICIES)}")
    ap.add_argument("--ratios", type=float, nargs="+", help=f"default: {' '.join(map(str, RATIOS))}")
    ap.add_argument("--prompts", type=int, help=f"prompts per run (default {PROMPTS}; quick {QUICK_PROMPTS})")
    ap.add_argument(
        "--max-total-tokens", type=int, help="the KV pool (default: room for every prompt at once; quick: just not)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    policies = args.policies or list(QUICK_POLICIES if args.quick else POLICIES)
    ratios = args.ratios or list(QUICK_RATIOS if args.quick else RATIOS)
    count = args.prompts or (QUICK_PROMPTS if args.quick else PROMPTS)
    if args.model_path == RECALL:
        model, load = recall_load(args.quick, args.prompts or (16 if args.quick else 64))
        count = len(load.prompts)
    else:
        model = model_path(args.model_path)
        context = args.context or (QUICK_CONTEXT if args.quick else CONTEXT)
        load = text_load(model, args.task, context, count, args.seed)
    slack, tail = (QUICK_POOL_SLACK, QUICK_TAIL) if args.quick else (PAGE, TAIL)
    pool = args.max_total_tokens or sum(len(p.ids) + 1 + p.answer_tokens + tail + slack for p in load.prompts)
    fields = dict(model=Path(model).name, task=load.spec["task"], context=load.spec["context"], prompts=count)
    fields.update(max_total_tokens=pool, tail=tail, spec=load.spec)
    todo = [{**c, **fields} for c in configs(policies, ratios, not args.quick, QUICK_NAIVE if args.quick else None)]
    # a long run keeps what it measured: the runs so far are written after each group
    runs = run(model, load.prompts, todo, pool, tail, lambda so_far: args.json and write_runs_json(args.json, so_far))
    print_table(runs, load, model, pool)
    return finish(t0, runs, args.json)


if __name__ == "__main__":
    sys.exit(main())
