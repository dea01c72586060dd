"""Multi-turn chat with ``fork``: one shared conversation, several branches that expand it, then a summary.

    python python/multi_turn_fork.py --url http://127.0.0.1:30000        # against a running server
    python python/multi_turn_fork.py --launch                           # starts a local vToken server (tiny model)

The branches share the conversation's prefix through SGLang's radix cache (the pages vToken must never move);
``--nested N`` forks each branch again into N examples, which share the branch's prefix too. Prints one JSON object:
the first answer, each branch's text (and its examples), the summary.
"""

from __future__ import annotations

import argparse
import json
import sys

import sglang as sgl


@sgl.function
def brainstorm(s, topic: str, branches: int, max_tokens: int, nested: int = 0):
    s += sgl.system(f"You are a concise assistant. The topic is {topic}.")
    s += sgl.user(f"Give one idea about {topic}.")
    s += sgl.assistant(sgl.gen("idea", max_tokens=max_tokens, temperature=0))
    forks = s.fork(branches)
    examples = []
    for i, f in enumerate(forks):
        f += sgl.user(f"Expand idea {i + 1} in one sentence.")
        f += sgl.assistant(sgl.gen("detail", max_tokens=max_tokens, temperature=0))
        if nested:
            inner = f.fork(nested)
            for k, g in enumerate(inner):
                g += sgl.user(f"Give example {k + 1} of it.")
                g += sgl.assistant(sgl.gen("example", max_tokens=max_tokens, temperature=0))
            inner.join()
            examples.append([g["example"] for g in inner])
    forks.join()
    s["details"] = [f["detail"] for f in forks]
    s["examples"] = examples
    s += sgl.user("Summarize the ideas in one line.")
    s += sgl.assistant(sgl.gen("summary", max_tokens=max_tokens, temperature=0))


def run(url: str, topics: list[str], branches: int = 3, max_tokens: int = 24, nested: int = 0) -> list[dict]:
    args = [{"topic": t, "branches": branches, "max_tokens": max_tokens, "nested": nested} for t in topics]
    states = brainstorm.run_batch(args, backend=sgl.RuntimeEndpoint(url))
    out = []
    for t, st in zip(topics, states):
        out.append({"topic": t, "idea": st["idea"], "details": st["details"], "summary": st["summary"]})
        if nested:
            out[-1]["examples"] = st["examples"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="URL of a running SGLang server")
    where.add_argument("--launch", action="store_true", help="start a local vToken server on the tiny model")
    ap.add_argument("--topics", nargs="+", default=["memory pages", "token eviction"])
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--nested", type=int, default=0, help="fork each branch again into this many examples")
    args = ap.parse_args(argv)
    if args.url:
        results = run(args.url, args.topics, args.branches, args.max_tokens, args.nested)
    else:
        from vtoken_sglang.tools.launcher import SglangServer, default_server_args
        from vtoken_sglang.tools.tiny_model import build

        with SglangServer(str(build()), default_server_args() + ["--enable-vtoken"]) as server:
            results = run(server.url, args.topics, args.branches, args.max_tokens, args.nested)
    json.dump(results, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
