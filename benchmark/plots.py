"""The benchmark figures, drawn from the JSON files the benchmarks write (matplotlib, Agg backend, PNG).

    .venv/bin/python benchmark/plots.py [--results DIR] [--out DIR]

Inputs, under ``--results`` (default benchmark/results), each written by the command in benchmark/README.md:
    reclaim_sim.json                          reclaim_sim.py --json (memory scenario with page_live_hist, frontier)
    sla_throughput_quick.json                 sla_throughput.py --model-path tiny --quick --json
    serve_capacity_shared_prefix_quick.json   serve_capacity.py --model-path tiny --shared-prefix --quick --json
    quality.json                              quality.py --model-path recall --json (every policy and ratio)
    quality_smollm2_passkey_1k.json           quality.py --task passkey --context 1000 --prompts 12 --json
    quality_smollm2_prose_1k.json             quality.py --task prose --prompts 12 --json
    serve_capacity_sharegpt_2048.json         serve_capacity.py (ShareGPT, 48 requests, pool 2048, four policies)
Outputs, under ``--out`` (default: the results folder), one line printed per file written:
    page_utilization.png     live tokens per allocated page at the end, Naive-Evict vs vToken (random policy by
                             default), one panel per eviction ratio
    retained_pages.png       resident pages per request by policy and eviction ratio: Naive-Evict, vToken, lower bound
    capacity_frontier.png    requests that fit vs page budget (the frontier runs), Naive-Evict vs vToken
    throughput_latency.png   output throughput vs p95 end-to-end latency per mode, points labelled by request rate,
                             the SLA latency as a vertical line
    shared_prefix_pages.png  pages held (mean and peak) per sharing degree: Naive-Evict, vToken without and with
                             copy-on-write
    quality_pages.png        recall accuracy against KV pages held per request, a curve per policy over its
                             budget ratios (vToken), Naive-Evict's points beside them, the full KV cache as a star
    quality_pages_smollm2.png  the same for SmolLM2's pass keys
    quality_pages_smollm2_prose.png  the same for SmolLM2's names copied out of prose
    sharegpt_frontier.png    ShareGPT: most running and pages retained per request, per policy (plain SGLang,
                             Naive-Evict, vToken), and h2o's running requests and pages in use over the decode steps
``--policy`` picks the policy of page_utilization.png (default random). Every number drawn comes from the JSON files.
A missing input file stops the script with a one-line error (exit 1) before anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RECLAIM = "reclaim_sim.json"
SLA = "sla_throughput_quick.json"
SHARED = "serve_capacity_shared_prefix_quick.json"
QUALITY = "quality.json"
QUALITY_REAL = "quality_smollm2_passkey_1k.json"
QUALITY_PROSE = "quality_smollm2_prose_1k.json"
SHAREGPT = "serve_capacity_sharegpt_2048.json"
PRODUCERS = {
    RECLAIM: "benchmark/reclaim_sim.py --json",
    SLA: "benchmark/sla_throughput.py --model-path tiny --quick --json",
    SHARED: "benchmark/serve_capacity.py --model-path tiny --shared-prefix --quick --json",
    QUALITY: "benchmark/quality.py --model-path recall --json",
    QUALITY_REAL: "benchmark/quality.py --task passkey --context 1000 --prompts 12 --json",
    QUALITY_PROSE: "benchmark/quality.py --task prose --prompts 12 --json",
    SHAREGPT: "benchmark/serve_capacity.py --requests 48 --max-total-tokens 2048 --score-every 1 --policies random "
    "h2o scissorhands streaming --json",
}
LABEL = {
    "plain": "plain SGLang",
    "naive": "Naive-Evict",
    "vtoken": "vToken",
    "no-cow": "vToken, no copy-on-write",
    "cow": "vToken + copy-on-write",
}
COLOR = {
    "plain": "tab:gray",
    "naive": "tab:orange",
    "vtoken": "tab:blue",
    "no-cow": "tab:cyan",
    "cow": "tab:blue",
    "lower_bound": "0.75",
}
DPI = 120
RATE_LABEL = {
    "plain": ((6, -3), "left"),
    "naive": ((0, -12), "center"),
    "vtoken": ((-4, 6), "right"),
}  # offset (points), align


class InputError(RuntimeError):
    """An input file is missing or lacks what a figure needs (the message is the one line printed)."""


def load(results: Path, name: str) -> dict:
    path = results / name
    if not path.is_file():
        raise InputError(f"plots: missing input {path} (written by: .venv/bin/python {PRODUCERS[name]} {path})")
    return json.loads(path.read_text())


def runs_of(data: dict, **match: object) -> list[dict]:
    """The records of ``data['runs']`` whose fields equal ``match``."""
    return [r for r in data["runs"] if all(r.get(k) == v for k, v in match.items())]


def ordered(values: Iterable) -> list:
    """Distinct values in first-seen order (the order the benchmark ran them)."""
    return list(dict.fromkeys(values))


def save(fig: Figure, out: Path, name: str) -> Path:
    path = out / name
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return path


def sim_caption(data: dict) -> str:
    s = data["setting"]
    page = data["runs"][0]["page_size"]
    return (
        f"reclaim_sim (simulator on the vToken core): {s['requests']} requests x {s['context']} tokens,\n"
        f"decode {s['decode']}, page {page}, theta {s['theta']}"
    )


def page_utilization(data: dict, out: Path, policy: str) -> Path:
    memory = runs_of(data, scenario="memory", policy=policy)
    if not memory:
        raise InputError(f"plots: {RECLAIM} has no memory run for policy {policy!r}")
    if any("page_live_hist" not in r for r in memory):
        raise InputError(
            f"plots: the memory runs in {RECLAIM} have no page_live_hist; re-run .venv/bin/python {PRODUCERS[RECLAIM]}"
        )
    ratios = ordered(r["evict_ratio"] for r in memory)
    fig, axes = plt.subplots(1, len(ratios), figsize=(4.6 * len(ratios), 4.0), sharey=True, squeeze=False)
    for ax, ratio in zip(axes[0], ratios):
        width = 0.4
        for k, mode in enumerate(("naive", "vtoken")):
            (rec,) = runs_of(data, scenario="memory", policy=policy, evict_ratio=ratio, mode=mode)
            hist = rec["page_live_hist"]
            pages = sum(hist)
            util = sum(i * c for i, c in enumerate(hist)) / max(pages * rec["page_size"], 1)
            xs = [i + (k - 0.5) * width for i in range(len(hist))]
            ax.bar(
                xs, hist, width=width, color=COLOR[mode], label=f"{LABEL[mode]}: {pages} pages, utilization {util:.0%}"
            )
        ax.set_title(f"evict ratio {ratio:g}")
        ax.set_xlabel(f"live tokens in the page (of {memory[0]['page_size']})")
        ax.set_xticks(range(0, memory[0]["page_size"] + 1, 2))
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("allocated pages at the end")
    fig.suptitle(f"Live tokens per allocated page, policy {policy}\n{sim_caption(data)}", fontsize=10)
    fig.tight_layout()
    return save(fig, out, "page_utilization.png")


def retained_pages(data: dict, out: Path) -> Path:
    memory = runs_of(data, scenario="memory")
    policies = ordered(r["policy"] for r in memory)
    ratios = ordered(r["evict_ratio"] for r in memory)
    fig, axes = plt.subplots(1, len(ratios), figsize=(4.8 * len(ratios), 4.2), sharey=True, squeeze=False)
    series: list[tuple[str, str, Callable[[dict], float]]] = [
        ("naive", LABEL["naive"], lambda r: r["pages"]),
        ("vtoken", LABEL["vtoken"], lambda r: r["pages"]),
        ("lower_bound", "lower bound sum(ceil(live / P))", lambda r: r["lower_bound_pages"]),
    ]
    width = 0.27
    for ax, ratio in zip(axes[0], ratios):
        for k, (key, label, value) in enumerate(series):
            mode = "vtoken" if key == "lower_bound" else key
            xs, ys = [], []
            for i, policy in enumerate(policies):
                recs = runs_of(data, scenario="memory", policy=policy, evict_ratio=ratio, mode=mode)
                if recs:
                    xs.append(i + (k - 1) * width)
                    ys.append(value(recs[0]) / recs[0]["requests"])
            ax.bar(
                xs,
                ys,
                width=width,
                color=COLOR[key],
                label=label,
                hatch="//" if key == "lower_bound" else None,
                edgecolor="0.4" if key == "lower_bound" else None,
            )
        ax.set_title(f"evict ratio {ratio:g}")
        ax.set_xticks(range(len(policies)), policies, rotation=30)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("resident pages per request at the end")
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"Retained pages by policy\n{sim_caption(data)}", fontsize=10)
    fig.tight_layout()
    return save(fig, out, "retained_pages.png")


def capacity_frontier(data: dict, out: Path) -> Path:
    frontier = runs_of(data, scenario="frontier")
    if not frontier:
        raise InputError(f"plots: {RECLAIM} has no frontier runs")
    policies = ordered(r["policy"] for r in frontier)
    fig, axes = plt.subplots(1, len(policies), figsize=(4.8 * len(policies), 4.0), sharey=True, squeeze=False)
    for ax, policy in zip(axes[0], policies):
        ratio = None
        for mode in ("naive", "vtoken"):
            recs = sorted(runs_of(data, scenario="frontier", policy=policy, mode=mode), key=lambda r: r["page_budget"])
            xs = [r["page_budget"] for r in recs]
            ys = [r["capacity"] for r in recs]
            ratio = recs[0]["evict_ratio"]
            ax.plot(xs, ys, marker="o", color=COLOR[mode], label=LABEL[mode])
            for x, y in zip(xs, ys):
                ax.annotate(str(y), (x, y), textcoords="offset points", xytext=(-4, 6), ha="right", fontsize=8)
            if mode == "naive":
                ideal = [y / (1 - ratio) for y in ys]
                ax.plot(xs, ideal, linestyle=":", color=COLOR["vtoken"], label=f"ideal: Naive-Evict x 1/(1-{ratio:g})")
        ax.set_title(f"{policy}, evict ratio {ratio:g}")
        ax.set_xlabel("page budget (pages)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("concurrent requests that run to the end")
    axes[0][0].set_ylim(bottom=0)  # shared: after every panel is drawn
    fig.suptitle(
        f"Capacity frontier (chunked prefill {data['setting']['chunk']}, then decode)\n{sim_caption(data)}", fontsize=10
    )
    fig.tight_layout()
    return save(fig, out, "capacity_frontier.png")


def load_words(run: dict) -> str:
    """An SLA run's load in words: ShareGPT first turns, or random ids of one length (records without ``dataset``
    are random ids)."""
    if run.get("dataset") == "sharegpt":
        return f"ShareGPT first turns ({run['output_len']} out)"
    return f"requests x ({run['input_len']} in, {run['output_len']} out)"


def throughput_latency(data: dict, out: Path) -> Path:
    runs = data["runs"]
    policies = ordered(r["policy"] for r in runs if r["mode"] != "plain")
    styles = ["-", "--", "-.", ":"]
    fig, ax = plt.subplots(figsize=(7.2, 5.6), layout="constrained")
    for r in runs:
        style = styles[policies.index(r["policy"]) % len(styles)] if r["policy"] in policies else "-"
        name = LABEL.get(r["mode"], r["mode"]) + ("" if r["mode"] == "plain" else f" ({r['policy']})")
        xs = [p["p95_latency_s"] for p in r["points"]]
        ys = [p["output_throughput"] for p in r["points"]]
        ax.plot(
            xs,
            ys,
            marker="o",
            linestyle=style,
            color=COLOR.get(r["mode"]),
            label=f"{name}: SLA throughput {r['sla_throughput']:.0f} tok/s",
        )
        offset, align = RATE_LABEL.get(r["mode"], ((4, 5), "left"))
        for p in r["points"]:
            ax.annotate(
                f"r={p['rate']:g}",
                (p["p95_latency_s"], p["output_throughput"]),
                textcoords="offset points",
                xytext=offset,
                ha=align,
                fontsize=7,
                color=COLOR.get(r["mode"]),
            )
    slas = []
    for policy in policies:
        naive = next(r for r in runs if r["mode"] == "naive" and r["policy"] == policy)
        slas.append(naive["sla_latency_s"])
        ax.axvline(
            naive["sla_latency_s"],
            color="tab:red",
            linestyle=styles[policies.index(policy) % len(styles)],
            linewidth=1,
            label=f"SLA ({policy}): p95 <= {naive['sla_latency_s']:.2f} s "
            f"(1.05 x Naive-Evict at rate {naive['saturation_rate']:g})",
        )
    right = 1.06 * max(slas + [p["p95_latency_s"] for r in runs for p in r["points"]])
    if slas:
        ax.axvspan(min(slas), right, color="tab:red", alpha=0.06)
    ax.set_xlim(right=right)
    first = runs[0]
    ax.set_xlabel("p95 end-to-end latency (s)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title(
        f"Throughput vs latency, real SGLang servers (CPU)\n{first['requests']} {load_words(first)} per rate, "
        f"--max-total-tokens {first['max_total_tokens']}; "
        "r = request rate (req/s)",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    fig.legend(fontsize=7, loc="outside lower center", ncols=2)
    return save(fig, out, "throughput_latency.png")


def shared_prefix_pages(data: dict, out: Path) -> Path:
    runs = data["runs"]
    modes = ordered(r["mode"] for r in runs)
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.0), sharey=True)
    for ax, field, title in (
        (axes[0], "mean_held_pages", "mean over the load's steps"),
        (axes[1], "peak_held_pages", "peak"),
    ):
        for mode in modes:
            recs = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["degree"])
            ax.plot(
                [r["degree"] for r in recs],
                [r[field] for r in recs],
                marker="o",
                color=COLOR.get(mode),
                linestyle="--" if mode == "no-cow" else "-",
                label=LABEL.get(mode, mode),
            )
        ax.set_xscale("log", base=2)
        degrees = ordered(r["degree"] for r in runs)
        ax.set_xticks(degrees, [str(d) for d in degrees])
        ax.set_xlabel("sharing degree (requests per system prompt)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("KV pages held")
    axes[0].set_ylim(bottom=0)  # shared: after both panels are drawn
    axes[0].legend(fontsize=8)
    r = runs[0]
    fig.suptitle(
        f"Shared-prefix pages held, real SGLang servers (CPU, tiny model)\n{r['requests']} requests, system prompt "
        f"{r['system_len']} + question {r['question_len']} ids, {r['output_len']} out, {r['policy']} "
        f"budget ratio {r['budget_ratio']:g}",
        fontsize=9,
    )
    fig.tight_layout()
    return save(fig, out, "shared_prefix_pages.png")


SERVE_MODES = ("plain", "naive", "vtoken")
BAR = 0.38  # bar width in sharegpt_frontier


def sharegpt_frontier(data: dict, out: Path, policy: str = "h2o") -> Path:
    """Top: per policy, most running (Naive-Evict and vToken bars, vToken's ideal as a tick, plain SGLang as a line)
    and the pages a running request retains. Bottom: ``policy`` (both modes) and plain SGLang over the decode steps:
    running requests, and pages in use with the live tokens (in pages) dashed."""
    fig, axes = plt.subplots(2, 2, figsize=(12.0, 8.0))
    policies = ordered(r["policy"] for r in data["runs"] if r["mode"] == "vtoken")
    xs = range(len(policies))
    plain = runs_of(data, mode="plain")[:1]
    for ax, field, what in (
        (axes[0][0], "max_running_requests", "most running requests"),
        (axes[0][1], "pages_per_request", "pages in use per running request"),
    ):
        for k, mode in enumerate(("naive", "vtoken")):
            ys = [runs_of(data, mode=mode, policy=p)[0][field] for p in policies]
            at = [x + (k - 0.5) * BAR for x in xs]
            ax.bar(at, ys, BAR, color=COLOR[mode], label=LABEL[mode])
            for x, y in zip(at, ys):
                ax.annotate(f"{y:g}", (x, y), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)
        if field == "max_running_requests":
            ideal = [runs_of(data, mode="vtoken", policy=p)[0]["ideal_running"] for p in policies]
            ax.scatter([x + 0.5 * BAR for x in xs], ideal, marker="_", s=300, color="k", label="vToken's ideal")
        for r in plain:
            ax.axhline(r[field], color=COLOR["plain"], linestyle="--", label=LABEL["plain"])
        ax.set_xticks(list(xs), policies)
        ax.set_ylabel(what)
        ax.set_ylim(0, 1.3 * max(r[field] or 0 for r in data["runs"]))
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    steps = {m: (runs_of(data, mode=m, policy=policy) or runs_of(data, mode=m))[0] for m in SERVE_MODES}
    ax_run, ax_pages = axes[1]
    for mode, r in steps.items():
        series, page = r["series"], r["page_size"]
        ax_run.plot(series["running"], color=COLOR[mode], label=LABEL[mode], linewidth=1)
        ax_pages.plot([t / page for t in series["held_tokens"]], color=COLOR[mode], linewidth=1, label=LABEL[mode])
        if series.get("live"):
            live = [t / page for t in series["live"]]
            ax_pages.plot(live, color=COLOR[mode], linestyle="--", linewidth=1, label=f"{LABEL[mode]}: live / page")
    r = steps["vtoken"]
    ax_pages.axhline(r["max_total_tokens"] / r["page_size"], color="k", linewidth=0.8, label="the pool")
    for ax, what in ((ax_run, "running requests"), (ax_pages, "KV pages in use")):
        ax.set_ylim(bottom=0)
        ax.set_xlabel("decode step")
        ax.set_ylabel(what)
        ax.set_title(f"{policy}, pool {r['max_total_tokens']} tokens, over the load", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    budget = f"budget {r['budget']} tokens" if r.get("budget") else f"budget ratio {r['budget_ratio']:g}"
    fig.suptitle(
        f"ShareGPT on real SGLang servers (CPU): {r['requests']} first turns (mean {r['mean_prompt_len']:.0f} in, "
        f"{r['output_len']} out) sent at once, page {r['page_size']}, {budget}",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, out, "sharegpt_frontier.png")


def quality_pages(data: dict, out: Path, name: str) -> Path:
    runs = data["runs"]
    fig, ax = plt.subplots(figsize=(8.4, 4.6))
    per_request = lambda r: r["mean_held_pages"] / r["prompts"]  # noqa: E731
    for k, policy in enumerate(p for p in ordered(r["policy"] for r in runs) if p != "none"):
        color = f"C{k}"
        vtoken = sorted(runs_of(data, policy=policy, mode="vtoken"), key=lambda r: r["budget_ratio"])
        naive = runs_of(data, policy=policy, mode="naive")
        ax.plot([per_request(r) for r in vtoken], [r["accuracy"] for r in vtoken], "o-", color=color, label=policy)
        ax.plot([per_request(r) for r in naive], [r["accuracy"] for r in naive], "o", color=color, mfc="none")
        for r in vtoken:
            ax.annotate(
                f"{r['budget_ratio']:g}",
                (per_request(r), r["accuracy"]),
                (4, 4),
                textcoords="offset points",
                fontsize=7,
            )
    for r in runs_of(data, policy="none"):
        ax.plot([per_request(r)], [r["accuracy"]], "*", color="k", markersize=12, label="full KV cache")
    ax.plot([], [], "o", color="0.4", mfc="none", label="Naive-Evict (hollow)")
    ax.set_xlabel("KV pages held per request (mean over decode steps)")
    ax.set_ylabel("exact answers")
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: never on a point
    r = runs[0]
    task, model = r.get("task", "recall"), r.get("model", "recall model")
    fig.suptitle(
        f"{task} accuracy against KV pages held, real SGLang servers (CPU, {model})\n{r['prompts']} prompts of "
        f"about {r['context']} tokens, page 16; labels: budget ratio; filled: vToken, hollow: Naive-Evict",
        fontsize=9,
    )
    fig.tight_layout()
    return save(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder with the benchmark JSON files")
    ap.add_argument("--out", type=Path, default=None, help="folder for the PNG files (default: --results)")
    ap.add_argument("--policy", default="random", help="policy drawn in page_utilization.png")
    args = ap.parse_args(argv)
    out = args.out or args.results
    try:
        inputs = (RECLAIM, SLA, SHARED, QUALITY, QUALITY_REAL, QUALITY_PROSE, SHAREGPT)
        reclaim, sla, shared, quality, quality_real, quality_prose, sharegpt = (
            load(args.results, name) for name in inputs
        )
        out.mkdir(parents=True, exist_ok=True)
        page_utilization(reclaim, out, args.policy)
        retained_pages(reclaim, out)
        capacity_frontier(reclaim, out)
        throughput_latency(sla, out)
        shared_prefix_pages(shared, out)
        quality_pages(quality, out, "quality_pages.png")
        quality_pages(quality_real, out, "quality_pages_smollm2.png")
        quality_pages(quality_prose, out, "quality_pages_smollm2_prose.png")
        sharegpt_frontier(sharegpt, out)
    except InputError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
