"""Long-document Q&A: many questions about one long document, run as a batch that shares the document prefix.

    python python/long_doc_qa.py --url http://127.0.0.1:30000 [--doc-words 1200] [--questions 6]
    python python/long_doc_qa.py --launch

The document is synthetic and seeded (the same text every run). Long contexts with short answers are where
KV eviction pays off. Prints one JSON object per question.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import sglang as sgl

WORDS = (
    "page token cache memory request layer attention window budget kernel stream copy plan slot table "
    "value key query batch decode prefill schedule policy sink recent heavy score compact reclaim free"
).split()


def make_document(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    sentences, count = [], 0
    while count < words:
        n = rng.randint(6, 16)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
        count += n
    return " ".join(sentences)


@sgl.function
def doc_qa(s, document: str, question: str, max_tokens: int):
    s += "Read the document and answer the question.\n\nDocument:\n" + document + "\n\n"
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=max_tokens, temperature=0, stop="\n")


def run(url: str, doc_words: int = 1200, questions: int = 6, max_tokens: int = 32) -> list[dict]:
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    document = make_document(doc_words)
    qs = [f"What does the document say about {WORDS[i % len(WORDS)]}?" for i in range(questions)]
    states = doc_qa.run_batch([{"document": document, "question": q, "max_tokens": max_tokens} for q in qs])
    return [{"question": q, "answer": st["answer"]} for q, st in zip(qs, states)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="URL of a running SGLang server")
    where.add_argument("--launch", action="store_true", help="start a local vToken server on the tiny model")
    ap.add_argument("--doc-words", type=int, default=1200)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    if args.url:
        results = run(args.url, args.doc_words, args.questions, args.max_tokens)
    else:
        from vtoken_sglang.tools.launcher import SglangServer, default_server_args
        from vtoken_sglang.tools.tiny_model import build

        with SglangServer(str(build()), default_server_args() + ["--enable-vtoken"]) as server:
            results = run(server.url, args.doc_words, args.questions, args.max_tokens)
    json.dump(results, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
