"""Conversations in bounded memory: concurrent multi-turn chats on SGLang's streaming sessions, with and without
vToken, against plain multi-turn chat (the whole history re-sent each turn). Not part of the tests.

    .venv/bin/python benchmark/sessions.py [--model-path smollm2] [--sessions 8] [--turns 30] [--turn-tokens 48]
        [--new-tokens 16] [--policy h2o] [--budget 128] [--pool 16384] [--fit-pool 4096] [--json PATH]

The load: ``--sessions`` conversations at once, each of ``--turns`` user turns cut from ShareGPT
(``tools.chat_turns``: at most ``--turn-tokens`` tokens of a user message each, in SmolLM2's chat format), each turn
answered with ``--new-tokens`` greedy tokens. Turn k of every conversation is sent together, after every turn k-1
has been answered (the conversations advance in step). Runs, on a pool of ``--pool`` tokens that holds them all:

- ``plain_session``: plain SGLang (no vToken), ``--enable-streaming-session``: each conversation one session;
- ``plain_chat``: plain SGLang, no sessions: each turn sends the conversation so far (the radix cache holds the
  histories and matches them);
- ``vtoken_session``: vToken (``--policy`` at ``--budget`` tokens, sinks ``SINKS``, recent ``RECENT``), one session
  per conversation: each session's row parked between turns at its budget;
- ``vtoken_chat`` (not run by default): vToken without sessions, the history re-sent: a turn that evicted is not
  in the radix tree, so the next prefills its history again.

Per turn k (the mean over the conversations): time to first token (SGLang's ``first_token_latency``), tokens
prefilled (prompt less cached), and the pool's tokens in use once every turn k is answered, per conversation (from
``/metrics``; plain chat's are the radix cache's, evictable). ``--fit-pool``: from those, how many conversations a
pool of that many tokens holds at turn k (its tokens over the tokens per conversation; a chat's histories are a
cache and are re-prefilled when evicted, so it has no such bound).
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from serve_bench import add_model_path, finish, model_path  # noqa: E402

from vtoken_sglang.tools.chat_turns import conversations  # noqa: E402
from vtoken_sglang.tools.launcher import SglangServer, default_server_args  # noqa: E402
from vtoken_sglang.tools.session_client import Session  # noqa: E402

SINKS, RECENT = 4, 32
RUNS = ("plain_session", "plain_chat", "vtoken_session", "vtoken_chat")
USED = re.compile(r"^sglang:num_used_tokens\{[^}]*\} ([0-9.e+]+)$", re.M)


def flags(run: str, args) -> list[str]:
    out = default_server_args(args.pool) + ["--enable-metrics", "--decode-log-interval", "1"]
    if run.endswith("session"):
        out.append("--enable-streaming-session")
    if run.startswith("vtoken"):
        out += ["--enable-vtoken", "--vtoken-policy", args.policy, "--vtoken-budget", str(args.budget)]
        out += ["--vtoken-sinks", str(SINKS), "--vtoken-recent", str(RECENT)]
    return out


def used_tokens(server: SglangServer) -> float:
    """The pool's tokens in use (SGLang's gauge)."""
    found = USED.findall(server.get_text("/metrics"))
    return float(found[0]) if found else float("nan")


def run_load(run: str, model: str, dialogues: list[list[list[int]]], args) -> dict:
    """One run: every conversation's turns, in step; per turn the means and the pool's use."""
    with SglangServer(model, flags(run, args)) as server:
        chats = [Session(server, f"c{i}", streaming=run.endswith("session")) for i in range(len(dialogues))]
        per_turn = []
        t0 = time.monotonic()
        for k in range(args.turns):
            threads = [threading.Thread(target=c.turn, args=(d[k], args.new_tokens)) for c, d in zip(chats, dialogues)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            metas = [c.meta[k] for c in chats]
            per_turn.append(
                {
                    "turn": k + 1,
                    "conversation_tokens": sum(len(c.history) for c in chats) / len(chats),
                    "ttft_s": sum(m.get("first_token_latency", float("nan")) for m in metas) / len(metas),
                    "prefilled": sum(m["prompt_tokens"] - m["cached_tokens"] for m in metas) / len(metas),
                    "used_per_conversation": used_tokens(server) / len(chats),
                }
            )
        wall = time.monotonic() - t0
        for c in chats:
            c.close()
        outputs = [[o for _, o in c.turns] for c in chats]
    return {"run": run, "per_turn": per_turn, "wall_s": wall, "outputs": outputs}


def table(runs: list[dict], fit_pool: int, every: int) -> str:
    lines = [
        "| turn | conversation | " + " | ".join(f"{r['run']}: TTFT ms / prefilled / KV" for r in runs) + " | fit "
        f"{fit_pool}: " + " / ".join(r["run"] for r in runs if r["run"].endswith("session")) + " |",
        "|---" * (3 + len(runs)) + "|",
    ]
    n = len(runs[0]["per_turn"])
    for k in [0, *range(every - 1, n, every)] if n > 1 else [0]:
        cells = []
        for r in runs:
            t = r["per_turn"][k]
            cells.append(f"{1000 * t['ttft_s']:.0f} / {t['prefilled']:.0f} / {t['used_per_conversation']:.0f}")
        fits = [
            str(int(fit_pool // max(r["per_turn"][k]["used_per_conversation"], 1)))
            for r in runs
            if r["run"].endswith("session")
        ]
        conv = runs[0]["per_turn"][k]["conversation_tokens"]
        lines.append(f"| {k + 1} | {conv:.0f} | " + " | ".join(cells) + " | " + " / ".join(fits) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_path(ap, "smollm2")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--turn-tokens", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--pool", type=int, default=16384)
    ap.add_argument("--fit-pool", type=int, default=4096)
    ap.add_argument("--runs", nargs="+", default=list(RUNS[:3]), choices=RUNS)
    ap.add_argument("--every", type=int, default=5, help="table rows: turn 1 and every N-th")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    model = model_path(args.model_path)
    from transformers import AutoTokenizer

    dialogues = conversations(AutoTokenizer.from_pretrained(model), args.sessions, args.turns, args.turn_tokens)
    runs = []
    for run in args.runs:
        runs.append(run_load(run, model, dialogues, args))
        last = runs[-1]["per_turn"][-1]
        print(f"{run}: {runs[-1]['wall_s']:.0f} s, last turn {last}", flush=True)
    print(table(runs, args.fit_pool, args.every))
    for r in runs:
        r["config"] = {k: v for k, v in vars(args).items() if k != "json"} | {"model": model}
    return finish(t0, runs, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
