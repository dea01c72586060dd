"""A small LLaMA trained here to recall needles from a long context: attention that means something.

    python -m vtoken_sglang.tools.recall_model [DIR]      # trains (or reuses) the model, prints its directory

Task (``RecallTask``; token ids of the tiny model's tokenizer, which the model ships with): a document of filler
tokens with needles ``key v1 .. vN`` at random places (distinct keys and values, from id ranges of their own), and
a question in one of two layouts; the answer is exactly the tokens shown after ``->``:

- question at the end:  ``<s> document [Q] key``            -> ``v1 .. vN``
- question first:       ``<s> [Q] key [A] document [Q]``    -> ``key v1 .. vN``

Each answer token is found by attending to where it stands in the prompt: ``v1`` is the token after the key in
the document, each next value the token after the value before it (induction). The prefill and the first decode
step compute the first two answer tokens with the whole prompt in the KV cache; the rest is decoded after a
policy's first eviction round, and is right only if the needle's tokens it attends to are still there.

Training (plain torch on transformers' LLaMA): cross-entropy on the answer tokens, plus two attention terms that
make the circuit form in minutes instead of after a long plateau: head 0 of the first layer attends to the
previous token (at every position), and head 0 of the last layer, at each answer step, to the prompt position of
the token it is about to output. The other heads are free. The served model is judged only by its answers.

Contract: ``RecallSpec`` determines the model (architecture, task, training); the same spec trains the same
weights on the same machine and torch build (seeded data and initialization, one thread); a directory stamped
with the spec's digest is reused (``tiny_model.reuse_or_build``). The build fails unless the model answers
``RecallSpec.min_accuracy`` of held-out prompts of both layouts exactly, with the full KV cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

from vtoken_sglang.tools import tiny_model

# marker tokens (the tiny tokenizer's special ids), the filler's id range, where the keys' and values' ids start
BOS, Q, A = 1, 4, 5
FILLER, KEYS_AT, VALUES_AT = (100, 1000), 1000, 1500
VOCAB = 2048  # the tiny tokenizer's
IGNORE = -100


@dataclasses.dataclass(frozen=True)
class RecallSpec:
    """Everything that determines the model's bytes. Changing a field gives a different model."""

    version: int = 2
    seed: int = 0
    context: int = 128  # prompt tokens (both layouts)
    needles: int = 6
    value_len: int = 5
    keys: int = 64  # distinct key ids (a document's keys are distinct)
    values: int = 64  # distinct value ids (a document's values are distinct)
    questions_at_end: int = 2  # training rows of that layout answer this many questions in a row
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    initializer_range: float = 0.08
    steps: int = 1000
    batch: int = 32
    lr: float = 1e-3
    attention_weight: float = 0.3  # of each attention term in the training loss
    min_accuracy: float = 0.95
    eval_prompts: int = 256

    def __post_init__(self):
        span = 1 + self.value_len
        if not (0 < self.needles <= self.keys <= VALUES_AT - KEYS_AT and self.needles * self.value_len <= self.values):
            raise ValueError(f"recall spec: {self.needles} needles need distinct keys and values within the id ranges")
        if self.values > VOCAB - VALUES_AT or self.context < 8 + (self.needles + self.questions_at_end) * (1 + span):
            raise ValueError(f"recall spec: context {self.context} or {self.values} values do not fit the task")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


# the CI-sized task and model (benchmark/quality.py --quick): half the context, fewer needles
QUICK = RecallSpec(context=64, needles=4)


def default_dir(spec: RecallSpec = RecallSpec()) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "vtoken-sglang" / f"recall-llama-{spec.digest()}"


@dataclasses.dataclass(frozen=True)
class RecallPrompt:
    ids: list[int]  # the prompt
    answer: list[int]  # the expected completion, exactly
    needle_at: int  # where the asked needle's key is in ``ids``


class RecallTask:
    """Seeded prompts of the task (``prompts``) and training rows (``train_batch``), drawn as whole tensors."""

    def __init__(self, spec: RecallSpec, seed: int):
        self.spec = spec
        self.gen = torch.Generator().manual_seed(seed)

    def _documents(self, rows: int, length: int):
        """``rows`` documents of ``length`` tokens, each holding ``spec.needles`` needles at random, disjoint places:
        ``(docs [rows, length], needles [rows, n, 1 + value_len], at [rows, n, 1 + value_len])`` (``at``: where each
        needle token stands in its document)."""
        n, span, g = self.spec.needles, 1 + self.spec.value_len, self.gen
        keys = torch.rand(rows, self.spec.keys, generator=g).argsort(1)[:, :n] + KEYS_AT
        values = torch.rand(rows, self.spec.values, generator=g).argsort(1)[:, : n * (span - 1)] + VALUES_AT
        needles = torch.cat([keys[:, :, None], values.view(rows, n, span - 1)], 2)
        docs = torch.randint(FILLER[0], FILLER[1], (rows, length), generator=g)
        free = length - n * span
        gaps = torch.rand(rows, free + 1, generator=g).argsort(1)[:, :n].sort(1).values
        at = (gaps + torch.arange(n) * span)[:, :, None] + torch.arange(span)
        docs.scatter_(1, at.view(rows, -1), needles.view(rows, -1))
        return docs, needles, at

    def _pick(self, rows: int, k: int):
        """``[rows, k]`` distinct needle indices per row."""
        return torch.rand(rows, self.spec.needles, generator=self.gen).argsort(1)[:, :k]

    def _question_first(self, rows: int):
        """Sequences ``<s> [Q] key [A] doc [Q] key v1..vN``, where their answer starts (``spec.context``), and
        where each answer token stands in the prompt."""
        s, head = self.spec, 4
        docs, needles, at = self._documents(rows, s.context - head - 1)
        pick = self._pick(rows, 1)[:, :, None].expand(-1, -1, 1 + s.value_len)
        asked, asked_at = needles.gather(1, pick)[:, 0], at.gather(1, pick)[:, 0] + head
        marks = torch.tensor([BOS, Q]).expand(rows, 2)
        seq = torch.cat([marks, asked[:, :1], torch.full((rows, 1), A), docs, torch.full((rows, 1), Q), asked], 1)
        source = torch.cat([torch.full((rows, 1), 2), asked_at[:, 1:]], 1)  # the key: the question's copy
        return seq, s.context, source

    def _questions_at_end(self, rows: int, questions: int, total: int):
        """Sequences ``<s> doc ([Q] key v1..vN) x questions`` of ``total`` tokens, with where each block's ``v1``
        is and the prompt positions of the answer tokens."""
        span = 1 + self.spec.value_len
        length = total - 1 - questions * (1 + span)
        docs, needles, at = self._documents(rows, length)
        pick = self._pick(rows, questions)[:, :, None].expand(-1, -1, span)
        asked, asked_at = needles.gather(1, pick), at.gather(1, pick) + 1
        blocks = torch.cat([torch.full((rows, questions, 1), Q), asked], 2).view(rows, -1)
        seq = torch.cat([torch.full((rows, 1), BOS), docs, blocks], 1)
        starts = 1 + length + torch.arange(questions) * (1 + span) + 2  # each block's v1
        return seq, starts, asked_at[:, :, 1:]

    def train_batch(self):
        """``(input_ids, targets, sources)``, each ``[batch, T]``: at position ``i`` the token to predict after it and
        where that token stands earlier in the row (``IGNORE`` at positions that predict nothing). Half the rows ask
        one question first, half ``spec.questions_at_end`` questions at the end."""
        s, half = self.spec, self.spec.batch // 2
        first, start, first_src = self._question_first(half)
        end, starts, end_src = self._questions_at_end(s.batch - half, s.questions_at_end, first.shape[1])
        seq = torch.cat([first, end])
        targets = torch.full_like(seq, IGNORE)
        sources = torch.full_like(seq, IGNORE)
        targets[:half, start:] = first[:, start:]
        sources[:half, start:] = first_src
        cols = (starts[:, None] + torch.arange(s.value_len)).view(-1)
        targets[half:, cols] = end[:, cols]
        sources[half:, cols] = end_src.reshape(s.batch - half, -1)
        # position i predicts token i + 1
        return seq[:, :-1], targets[:, 1:], sources[:, 1:]

    def prompts(self, count: int) -> list[RecallPrompt]:
        """``count`` prompts of ``spec.context`` tokens asking one question each, alternating the layouts
        (question first at even indices)."""
        first, start, _ = self._question_first(count)
        end, starts, _ = self._questions_at_end(count, 1, self.spec.context + self.spec.value_len)
        out = []
        for i in range(count):
            if i % 2 == 0:
                ids, answer = first[i, :start].tolist(), first[i, start:].tolist()
            else:
                ids, answer = end[i, : int(starts[0])].tolist(), end[i, int(starts[0]) :].tolist()
            key = answer[0] if i % 2 == 0 else ids[-1]
            out.append(RecallPrompt(ids, answer, ids.index(key, 3 if i % 2 == 0 else 0)))
        return out


def config(spec: RecallSpec) -> dict:
    """The model's transformers config (LLaMA; float32, as trained: the accuracy checked is the served model's)."""
    tiny = tiny_model._config(tiny_model.TinyModelSpec(), VOCAB)
    return {
        **tiny,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "max_position_embeddings": 4 * spec.context,
        "initializer_range": spec.initializer_range,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def attention_loss(attentions, targets, sources):
    """The two attention terms: first layer's head 0 on the previous token, last layer's head 0 on ``sources``."""
    first, last = attentions[0][:, 0], attentions[-1][:, 0]
    t = first.shape[-1]
    prev = first[:, torch.arange(1, t), torch.arange(t - 1)]
    rows, cols = (targets != IGNORE).nonzero(as_tuple=True)
    on_source = last[rows, cols, sources[rows, cols]]
    return -(prev + 1e-6).log().mean(), -(on_source + 1e-6).log().mean()


def train(spec: RecallSpec, progress: bool = True):
    """The trained transformers model (float32, eager attention)."""
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM._from_config(LlamaConfig(**config(spec)), attn_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(spec.steps // 20, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / spec.steps, 1.0))))
    )
    task = RecallTask(spec, spec.seed + 1)
    bar = tqdm(range(spec.steps), desc="recall model", disable=not progress, mininterval=2.0)
    for _ in bar:
        ids, targets, sources = task.train_batch()
        out = model.model(input_ids=ids, output_attentions=True)
        keep = targets != IGNORE
        answer = torch.nn.functional.cross_entropy(model.lm_head(out.last_hidden_state[keep]), targets[keep])
        prev, copy = attention_loss(out.attentions, targets, sources)
        loss = answer + spec.attention_weight * (prev + copy)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(answer=f"{answer.item():.3f}", attention=f"{(prev + copy).item():.3f}", refresh=False)
    return model.eval()


def accuracy(model, prompts: list[RecallPrompt]) -> float:
    """Share of ``prompts`` whose greedy answer is exactly right, full KV cache. One teacher-forced forward per
    prompt: greedy decoding reproduces the answer iff every answer token is the argmax after its prefix."""
    right = 0
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p.ids + p.answer])).logits[0, len(p.ids) - 1 : -1]
            right += logits.argmax(-1).tolist() == p.answer
    return right / len(prompts)


def build(out_dir: str | os.PathLike | None = None, spec: RecallSpec = RecallSpec()) -> Path:
    """A directory holding the trained model and its tokenizer, trained unless an identical build is there."""
    out = Path(out_dir) if out_dir is not None else default_dir(spec)
    stamp = {"spec": dataclasses.asdict(spec), "digest": spec.digest()}
    return tiny_model.reuse_or_build(out, stamp, lambda tmp: _write(spec, tmp))


def _write(spec: RecallSpec, tmp: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights whatever the machine's core count
    try:
        model = train(spec)
    finally:
        torch.set_num_threads(threads)
    acc = accuracy(model, RecallTask(spec, spec.seed + 2).prompts(spec.eval_prompts))
    if acc < spec.min_accuracy:
        raise RuntimeError(f"recall model: {acc:.1%} exact answers with the full KV cache, < {spec.min_accuracy:.0%}")
    tokenizer_dir = tiny_model.build()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, tmp / name)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "recall_eval.json").write_text(json.dumps({"full_kv_accuracy": acc, "prompts": spec.eval_prompts}))


def main(argv: list[str] | None = None) -> int:
    return tiny_model.build_cli(__doc__, build, argv)


if __name__ == "__main__":
    sys.exit(main())
