"""Multi-turn conversations for streaming sessions, cut from ShareGPT (``tools.sharegpt``): each conversation's user
turns, in order, as the token ids a session's turn appends (the model's answer before it is the session's).

A conversation is built from the human messages of consecutive ShareGPT records (few records have 20 or more), each
cut to at most ``max_turn_tokens`` tokens of its text and wrapped in the model's chat format: the first turn opens
the user message and the assistant's answer; every later one first closes the answer the model gave (cut at the
turn's ``max_new_tokens``). Deterministic: conversation ``i`` of a call reads the records from ``start + i * stride``.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from vtoken_sglang.tools import sharegpt

FIRST = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
NEXT = "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
"""SmolLM2's (ChatML) turn formats: a later turn closes the answer before it."""


@cache
def _human_messages(path: Path) -> list[list[str]]:
    """Per ShareGPT record, its non-empty human messages."""
    records = json.loads(Path(path).read_text())
    return [[m["value"] for m in r["conversations"] if m["from"] == "human" and m["value"].strip()] for r in records]


def conversations(
    tokenizer, n: int, turns: int, max_turn_tokens: int, start: int = 0, stride: int = 50
) -> list[list[list[int]]]:
    """``n`` conversations of ``turns`` user turns each: per turn the token ids it appends (no BOS: SGLang strips a
    leading BOS from an appended turn). ``tokenizer``: the model's (Hugging Face)."""
    records = _human_messages(sharegpt.build())
    out = []
    for i in range(n):
        messages: list[str] = []
        at = start + i * stride
        while len(messages) < turns:
            messages += records[at % len(records)]
            at += 1
        turn_ids = []
        for k, text in enumerate(messages[:turns]):
            words = tokenizer.encode(text, add_special_tokens=False)[:max_turn_tokens]
            body = tokenizer.decode(words)
            turn_ids.append(tokenizer.encode((FIRST if k == 0 else NEXT).format(body), add_special_tokens=False))
        out.append(turn_ids)
    return out
