"""vToken's overhead on real SGLang: scheduler time per decode step and serving throughput, same load, per mode.

    .venv/bin/python benchmark/overhead.py [--model-path M] [--quick] [--scores] [--json PATH] [--repeats R]

The model: ``--model-path`` (default ``tiny``, the tiny random LLaMA, whose few-ms step makes vToken's host time the
largest share it can be; ``smollm2`` for the real 30-layer checkpoint, whose relocation copies move 30 layers of K
and V per token). Modes, each on its own server (CPU, page 16, radix cache on, a KV pool large enough that memory never
limits the batch, so every mode runs the same batches):
- ``plain``: SGLang without vToken, its default (overlap) scheduling loop, which the vToken modes run too (the
  like-for-like baseline); ``plain_serial``: overlap scheduling off, for reference;
- ``hooks``: ``--enable-vtoken`` with policy none (every hook installed, nothing evicted);
- ``inline``: random eviction, budget ratio 0.5, reclaim planned in the scheduler (``--vtoken-planner inline``);
- ``worker``: the same, planned by the compaction worker process (``--vtoken-planner worker``).

Load: N requests sent at once (INPUT random token ids, OUTPUT greedy tokens, ignore_eos), once to warm up, then
``--repeats`` times measured. All servers are up together and the measured loads are interleaved (each repeat
runs every mode once, in a rotated order), so the drift of a shared machine falls on every mode alike. Figures
(over the measured repeats):
- ``out_tok/s``: median output throughput (tokens / wall); ``spread``: (max - min) / median of the repeats, the
  resolution of the comparison on this machine;
- ``step_ms``: median scheduler time per decode step (SGLang's decode log line, every 40 steps: #running-req /
  gen throughput over those steps);
- ``hook_ms/step``: host time inside vToken's hooks per decode step (``hook_ms``, upstream calls excluded);
- ``plan_ms/step``: planning time inside the scheduler loop per decode step: the inline planner's ``planner_ms``,
  or, with the worker, everything the scheduler does for it (``worker_link_ms``: poll, snapshot, send);
  ``plan_cpu/st``: the worker's share again in the scheduler thread's CPU time (``worker_link_cpu_ms``): the
  difference to ``plan_ms/step`` is time the scheduler waited for a core that another process held;
- ``copy_ms/step``: relocation copies issued per decode step;
- ``score_ms/st``: turning the kept queries into attention scores, per decode step (score policies).
Targets: hooks-only costs < 1% throughput versus plain SGLang (read with ``spread``; the direct figure is
``hook_ms/step`` over ``step_ms``); with the worker, planning inside the loop < 0.2 ms per decode step.

``--scores``: score policies at full speed, SGLang's overlap scheduler on in every mode: ``inline`` (random: no
scores), ``h2o`` (scored every step) and ``h2o_every4`` (``--vtoken-score-every 4``), same load. Target: h2o's decode
step <= 1.10 x random's; measured (the steps of two servers: read with ``spread``) and direct (random's step plus
the host time h2o adds in the hooks: the forward is the same model on the same batch).

``--sweep [N ...]`` (default 16 64 256): how vToken's host time grows with the batch. Three servers (a pool that
holds every request whole): ``hooks``; ``inline`` (random, ratio 0.5, reclaim on); and ``inline`` again with its
device-to-host reads counted (``VTOKEN_SGLANG_COUNT_HOST_READS=1``: the counting slows the hooks, so the times come
from the first two). For each N: N requests x (``--input-len`` 32, ``--output-len`` 192) sent at once, and per
mode: the decode step (SGLang's log), vToken's hook time per decode step and per request-step (one request in one
decode step), the reads per step. Targets: with eviction and reclaim, <= 0.5 ms per decode step at 16 and per
request-step at 256 within 1.5 x its value at 16; hooks-only < 1% of the step at every N.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from serve_bench import TINY, add_model_path, dash, decode_step_ms, finish, model_path, random_prompts  # noqa: E402

from vtoken_sglang.tools.launcher import SglangServer, default_server_args, started_together  # noqa: E402

EVICT = ["--vtoken-policy", "random", "--vtoken-budget-ratio", "0.5", "--vtoken-recent", "16"]
MODES: dict[str, list[str]] = {
    "plain": [],
    "plain_serial": ["--disable-overlap-schedule"],
    "hooks": ["--enable-vtoken"],
    "inline": ["--enable-vtoken", *EVICT, "--vtoken-planner", "inline"],
    "worker": ["--enable-vtoken", *EVICT, "--vtoken-planner", "worker"],
}
H2O = ["--enable-vtoken", "--vtoken-policy", "h2o", "--vtoken-budget-ratio", "0.5", "--vtoken-recent", "16"]
SCORE_MODES: dict[str, list[str]] = {"h2o": H2O, "h2o_every4": [*H2O, "--vtoken-score-every", "4"]}
ALL_MODES = {**MODES, **SCORE_MODES}
COUNTERS = (
    "hook_ms",
    "decode_steps",
    "planner_ms",
    "worker_link_ms",
    "worker_link_cpu_ms",
    "copy_ms",
    "pages_reclaimed",
    "scoring_ms",
)


def one_load(server: SglangServer, batch: list[list[int]], output_len: int) -> tuple[float, list]:
    """Send every request at once; (output tokens / wall seconds, the outputs)."""

    def one(ids):
        return server.post(
            "/generate",
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
            },
            timeout=1800,
        )

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(len(batch)) as pool:
        outs = list(pool.map(one, batch))
    return sum(len(o["output_ids"]) for o in outs) / (time.monotonic() - t0), [o["output_ids"] for o in outs]


def vtoken_state(server: SglangServer) -> dict:
    return server.get("/get_server_info")["internal_states"][0].get("vtoken") or {}


def vtoken_counters(server: SglangServer) -> dict[str, float]:
    state = vtoken_state(server)
    return {k: float(state.get(k, 0.0)) for k in COUNTERS}


def run_modes(model: str, modes: list[str], args) -> list[dict]:
    """Every mode's server up at once (idle ones sleep), then the measured loads interleaved: repeat ``r`` runs
    one load per mode, in an order rotated by ``r``, so a machine that drifts (other processes on shared cores)
    moves every mode alike instead of whichever server happened to run in a slow minute."""
    batch = random_prompts(args.requests, args.input_len)
    with contextlib.ExitStack() as stack:
        servers = {}
        for mode in modes:
            # SGLang's default log interval (40): vToken writes its own line beside each decode line, which at
            # interval 1 would add a metrics pass to every step that a default server does not make
            flags = (
                default_server_args(max_total_tokens=args.max_total_tokens)
                + ["--decode-log-interval", "40"]
                + ALL_MODES[mode]
            )
            print(f"[overhead] {mode}: starting a server ...", file=sys.stderr, flush=True)
            servers[mode] = stack.enter_context(SglangServer(model, flags))
        ids = {mode: one_load(servers[mode], batch, args.output_len)[1] for mode in modes}  # warm-up; outputs compared
        before = {mode: vtoken_counters(servers[mode]) for mode in modes}
        log_start = {mode: len(servers[mode].log_text()) for mode in modes}
        tputs: dict[str, list[float]] = {mode: [] for mode in modes}
        for r in range(args.repeats):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                tputs[mode].append(one_load(servers[mode], batch, args.output_len)[0])
        after = {mode: vtoken_counters(servers[mode]) for mode in modes}
        logs = {mode: servers[mode].log_text()[log_start[mode] :] for mode in modes}
    return [summarize(mode, args, tputs[mode], before[mode], after[mode], logs[mode], ids[mode]) for mode in modes]


def summarize(mode: str, args, tputs: list[float], before: dict, after: dict, log: str, ids: list) -> dict:
    delta = {k: after[k] - before[k] for k in COUNTERS}
    steps_log = decode_step_ms(log)
    steps = delta["decode_steps"]
    per_step = lambda k: round(delta[k] / steps, 4) if steps else None  # noqa: E731
    tput = statistics.median(tputs)
    return {
        "mode": mode,
        "requests": args.requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "output_throughput": round(tput, 1),
        "throughputs": [round(t, 1) for t in tputs],
        "spread": round((max(tputs) - min(tputs)) / tput, 4),
        "step_ms": round(steps_log[len(steps_log) // 2], 3) if steps_log else None,
        "hook_ms_per_step": per_step("hook_ms") if mode not in ("plain", "plain_serial") else None,
        "plan_ms_per_step": per_step("worker_link_ms" if mode == "worker" else "planner_ms")
        if mode in ("inline", "worker")
        else None,
        "plan_cpu_ms_per_step": per_step("worker_link_cpu_ms") if mode == "worker" else None,
        "copy_ms_per_step": per_step("copy_ms") if mode in ("inline", "worker") else None,
        "score_ms_per_step": per_step("scoring_ms") if mode in SCORE_MODES else None,
        "pages_reclaimed": int(delta["pages_reclaimed"]),
        "decode_steps": int(steps),
        "_ids": ids,
    }


SWEEP_MODES = {"hooks": MODES["hooks"], "inline": MODES["inline"], "inline_reads": MODES["inline"]}


def run_sweep(model: str, sizes: list[int], args) -> list[dict]:
    """One server per sweep mode, up together; each size's load runs on each server in turn (after a warm-up)."""
    out, servers = [], {}
    for mode, extra in SWEEP_MODES.items():
        flags = default_server_args(max_total_tokens=args.max_total_tokens) + ["--decode-log-interval", "40"]
        env = {"VTOKEN_SGLANG_COUNT_HOST_READS": "1"} if mode == "inline_reads" else None
        servers[mode] = SglangServer(model, flags + extra, env=env)
    with started_together(*servers.values()):
        for s in servers.values():
            one_load(s, random_prompts(8, args.input_len, seed=99), 48)  # warm-up
        for n in sizes:
            batch = random_prompts(n, args.input_len, seed=n)
            for mode, s in servers.items():
                before, log_at = vtoken_state(s), len(s.log_text())
                _, ids = one_load(s, batch, args.output_len)
                after = vtoken_state(s)
                steps = after["decode_steps"] - before["decode_steps"]
                req_steps = sum(len(o) - 1 for o in ids)  # the first token of each comes from its prefill
                step_ms = decode_step_ms(s.log_text()[log_at:])
                rec = {"mode": mode, "requests": n, "decode_steps": steps, "request_steps": req_steps}
                rec["step_ms"] = round(step_ms[len(step_ms) // 2], 3) if step_ms else None
                hook = after["hook_ms"] - before["hook_ms"]
                rec["hook_ms_per_step"] = round(hook / steps, 4)
                rec["hook_us_per_request_step"] = round(1e3 * hook / req_steps, 3)
                if mode == "inline_reads":
                    rec["host_reads_per_step"] = after["host_reads_per_step"]  # over the server's life so far
                    rec["host_reads_quiet_max"] = after["host_reads_quiet_max"]
                    rec["host_reads_busy_max"] = after["host_reads_busy_max"]
                rec["tokens_evicted"] = after["tokens_evicted"] - before["tokens_evicted"]
                rec["_ids"] = ids
                out.append(rec)
                shown = {k: v for k, v in rec.items() if not k.startswith("_")}
                print(f"[overhead] sweep {mode} {n}: {shown}", file=sys.stderr, flush=True)
    return out


def print_sweep(runs: list[dict], args) -> None:
    print(
        f"overhead sweep: N requests x ({args.input_len} in, {args.output_len} out) at once, page 16, "
        f"--max-total-tokens {args.max_total_tokens}; inline = random, ratio 0.5, reclaim on"
    )
    hdr = f"{'N':>5}{'mode':>8}{'step_ms':>9}{'hook_ms/st':>11}{'% of step':>10}{'hook_us/req-st':>15}{'reads/st':>9}"
    print(hdr + "\n" + "-" * len(hdr))
    by = {(r["mode"], r["requests"]): r for r in runs}
    for n in sorted({r["requests"] for r in runs}):
        reads = by[("inline_reads", n)]["host_reads_per_step"]
        for mode in ("hooks", "inline"):
            r = by[(mode, n)]
            share = r["hook_ms_per_step"] / r["step_ms"] if r["step_ms"] else None
            r["hook_share_of_step"] = round(share, 5) if share is not None else None
            print(
                f"{n:>5}{mode:>8}{dash(r['step_ms'], '.2f'):>9}{r['hook_ms_per_step']:>11.3f}{dash(share, '.2%'):>10}"
                f"{r['hook_us_per_request_step']:>15.2f}{(dash(reads, '.2f') if mode == 'inline' else '-'):>9}"
            )
    sizes = sorted({r["requests"] for r in runs})
    lo, hi = by[("inline", sizes[0])], by[("inline", sizes[-1])]
    growth = hi["hook_us_per_request_step"] / lo["hook_us_per_request_step"]
    worst = max(by[("hooks", n)].get("hook_share_of_step") or 0 for n in sizes)
    same = all(by[("inline", n)]["_ids"] == by[("inline_reads", n)]["_ids"] for n in sizes)
    print(
        f"inline at {sizes[0]}: {lo['hook_ms_per_step']:.3f} ms per decode step (target <= 0.5: "
        f"{'met' if lo['hook_ms_per_step'] <= 0.5 else 'MISSED'}); per request-step at {sizes[-1]} / at {sizes[0]}: "
        f"{growth:.2f} x (target <= 1.5: {'met' if growth <= 1.5 else 'MISSED'}); hooks-only at most {worst:.2%} of "
        f"a step (target < 1%: {'met' if worst < 0.01 else 'MISSED'}); counted and uncounted inline outputs "
        f"identical: {'yes' if same else 'NO'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 x (64 in, 256 out), 3 repeats")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(ALL_MODES))
    ap.add_argument(
        "--scores",
        action="store_true",
        help="score policies at full speed: inline (random), h2o, h2o every 4th step, all with overlap on",
    )
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--sweep", type=int, nargs="*", help="batch sizes for the sweep (default 16 64 256)")
    add_model_path(ap, default=TINY)
    args = ap.parse_args(argv)
    if args.sweep is not None:
        sizes = args.sweep or [16, 64, 256]
        defaults = ap.parse_args([])
        if args.input_len == defaults.input_len and args.output_len == defaults.output_len:
            args.input_len, args.output_len = 32, 192
        if args.max_total_tokens == defaults.max_total_tokens:
            args.max_total_tokens = max(sizes) * (args.input_len + args.output_len + 16) * 3 // 2 // 16 * 16
        t0 = time.monotonic()
        runs = run_sweep(model_path(args.model_path), sizes, args)
        print_sweep(runs, args)
        return finish(t0, runs, args.json)
    if args.quick:
        args.requests, args.input_len, args.output_len, args.repeats = 16, 64, 256, 3
    if args.scores:
        args.modes = ["inline", *SCORE_MODES]
    model = model_path(args.model_path)
    t0 = time.monotonic()
    runs = run_modes(model, args.modes, args)
    by = {r["mode"]: r for r in runs}
    print(
        f"overhead: {args.requests} requests x ({args.input_len} in, {args.output_len} out), {args.repeats} measured "
        f"repeats after a warm-up, page 16, --max-total-tokens {args.max_total_tokens}, model {args.model_path}"
    )
    hdr = (
        f"{'mode':<14}{'out_tok/s':>10}{'spread':>8}{'vs plain':>9}{'step_ms':>9}{'hook_ms/st':>11}{'plan_ms/st':>11}"
        f"{'plan_cpu/st':>12}{'copy_ms/st':>11}{'score_ms/st':>12}{'reclaimed':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    base = by.get("plain")
    for r in runs:
        rel = r["output_throughput"] / base["output_throughput"] if base else None
        r["vs_plain"] = round(rel, 4) if rel is not None else None
        print(
            f"{r['mode']:<14}{r['output_throughput']:>10.1f}{r['spread']:>8.1%}{dash(rel, '.3f'):>9}"
            f"{dash(r['step_ms'], '.2f'):>9}"
            f"{dash(r['hook_ms_per_step'], '.3f'):>11}{dash(r['plan_ms_per_step'], '.3f'):>11}"
            f"{dash(r['plan_cpu_ms_per_step'], '.3f'):>12}"
            f"{dash(r['copy_ms_per_step'], '.3f'):>11}{dash(r['score_ms_per_step'], '.3f'):>12}"
            f"{r['pages_reclaimed']:>10}"
        )
    if "inline" in by and "worker" in by:
        print(f"inline and worker outputs identical: {'yes' if by['inline']['_ids'] == by['worker']['_ids'] else 'NO'}")
    if base and "hooks" in by:
        h = by["hooks"]
        loss = 1 - h["output_throughput"] / base["output_throughput"]
        direct = h["hook_ms_per_step"] / h["step_ms"] if h["step_ms"] and h["hook_ms_per_step"] is not None else None
        print(
            f"hooks only: throughput {loss:+.1%} below plain (spread {max(h['spread'], base['spread']):.1%}); time "
            "in hooks "
            f"{dash(direct, '.2%')} of a decode step; target < 1%: "
            f"{'met' if direct is not None and direct < 0.01 else 'MISSED'} "
            f"(by the direct figure)"
        )
    if "inline" in by and "h2o" in by:
        base = by["inline"]
        for mode in SCORE_MODES:
            r = by.get(mode)
            if r is None or not base["step_ms"] or not r["step_ms"]:
                continue
            # measured: the steps' ratio (two servers: read with spread); direct: random's step plus the host time
            # the score policy adds in the hooks (the forward is the same model on the same batch)
            r["step_vs_random"] = round(r["step_ms"] / base["step_ms"], 4)
            r["direct_vs_random"] = round(1 + (r["hook_ms_per_step"] - base["hook_ms_per_step"]) / base["step_ms"], 4)
            target = ""
            if mode == "h2o":
                target = f"; target <= 1.10: {'met' if r['direct_vs_random'] <= 1.10 else 'MISSED'} (direct)"
            print(
                f"{mode}: decode step {r['step_vs_random']:.3f} x random's measured, {r['direct_vs_random']:.3f} x "
                f"direct (overlap scheduler on; scoring {dash(r['score_ms_per_step'], '.3f')} ms, hooks "
                f"{r['hook_ms_per_step']:.3f} ms against {base['hook_ms_per_step']:.3f} of a {base['step_ms']:.2f} ms "
                f"step){target}"
            )
    if "worker" in by:
        w, cpu = by["worker"]["plan_ms_per_step"], by["worker"]["plan_cpu_ms_per_step"]
        print(
            f"worker: planning inside the scheduler loop {dash(w, '.3f')} ms per decode step ({dash(cpu, '.3f')} ms of "
            f"it on the CPU); target < 0.2 ms: {'met' if w is not None and w < 0.2 else 'MISSED'} (by the wall time)"
        )
    return finish(t0, runs, args.json)


if __name__ == "__main__":
    sys.exit(main())
