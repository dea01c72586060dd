"""Multi-turn chat with ``fork``: one shared conversation, several branches that expand it, then a summary.

    python python/multi_turn_fork.py --url http://127.0.0.1:30000        # against a running server
    python python/multi_turn_fork.py --launch                           # starts a local vToken server (tiny model)

The branches share the conversation's prefix through SGLang's radix cache (the pages vToken must never move).
Prints one JSON object: the first answer, each branch's text, the summary.
"""

from __future__ import annotations

import argparse
import json
import sys

import sglang as sgl


@sgl.function
def brainstorm(s, topic: str, branches: int, max_tokens: int):
    s += sgl.system(f"You are a concise assistant. The topic is {topic}.")
    s += sgl.user(f"Give one idea about {topic}.")
    s += sgl.assistant(sgl.gen("idea", max_tokens=max_tokens, temperature=0))
    forks = s.fork(branches)
    for i, f in enumerate(forks):
        f += sgl.user(f"Expand idea {i + 1} in one sentence.")
        f += sgl.assistant(sgl.gen("detail", max_tokens=max_tokens, temperature=0))
    forks.join()
    s["details"] = [f["detail"] for f in forks]
    s += sgl.user("Summarize the ideas in one line.")
    s += sgl.assistant(sgl.gen("summary", max_tokens=max_tokens, temperature=0))


def run(url: str, topics: list[str], branches: int = 3, max_tokens: int = 24) -> list[dict]:
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    states = brainstorm.run_batch([{"topic": t, "branches": branches, "max_tokens": max_tokens} for t in topics])
    return [
        {"topic": t, "idea": st["idea"], "details": st["details"], "summary": st["summary"]}
        for t, st in zip(topics, states)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="URL of a running SGLang server")
    where.add_argument("--launch", action="store_true", help="start a local vToken server on the tiny model")
    ap.add_argument("--topics", nargs="+", default=["memory pages", "token eviction"])
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    if args.url:
        results = run(args.url, args.topics, args.branches, args.max_tokens)
    else:
        from vtoken_sglang.tools.launcher import SglangServer, default_server_args
        from vtoken_sglang.tools.tiny_model import build

        with SglangServer(str(build()), default_server_args() + ["--enable-vtoken"]) as server:
            results = run(server.url, args.topics, args.branches, args.max_tokens)
    json.dump(results, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
