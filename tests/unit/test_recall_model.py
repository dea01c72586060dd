"""The recall model (a small LLaMA trained here to find needles) and the quality benchmark on it: the task's
layouts, and how ``benchmark/quality.py --model-path recall`` judges its answers (its prompts, without training the
model)."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

from vtoken_sglang.tools import recall_model as rm

sys.path.insert(0, str(REPO / "benchmark"))
import quality  # noqa: E402


def test_prompts_and_training_rows_hold_what_the_task_says():
    """Prompts are ``context`` tokens in the two layouts, the answer's tokens stand in the prompt where the needle
    is; in training rows, each token to predict stands at its attention source, earlier in the row."""
    spec = rm.RecallSpec(context=48, needles=3, keys=16, values=16, value_len=3, batch=6)
    task = rm.RecallTask(spec, 0)
    for i, p in enumerate(task.prompts(6)):
        key = p.ids[p.needle_at]
        values = p.ids[p.needle_at + 1 : p.needle_at + 1 + spec.value_len]
        assert len(p.ids) == spec.context and rm.KEYS_AT <= key < rm.KEYS_AT + spec.keys
        assert all(rm.VALUES_AT <= v < rm.VALUES_AT + spec.values for v in values)
        assert p.ids.count(key) == 2  # in the document and in the question
        if i % 2 == 0:
            assert p.ids[:4] == [rm.BOS, rm.Q, key, rm.A] and p.ids[-1] == rm.Q and p.answer == [key, *values]
        else:
            assert p.ids[-2:] == [rm.Q, key] and p.answer == values
    ids, targets, sources = task.train_batch()
    rows, cols = (targets != rm.IGNORE).nonzero(as_tuple=True)
    assert (ids[rows, sources[rows, cols]] == targets[rows, cols]).all() and (sources[rows, cols] <= cols).all()
    assert len(rows) == 3 * (1 + 3) + 3 * spec.questions_at_end * 3  # question first: key and values; at the end
    with pytest.raises(ValueError, match="do not fit"):
        rm.RecallSpec(context=30)


def test_quality_benchmark_judges_recall_answers_by_their_tokens():
    """``quality.py --model-path recall``: the prompts of the recall task, alternating layouts, each judged right
    only by its answer's exact tokens (whatever follows them)."""
    load = quality.recall_prompts(rm.QUICK, 4)
    task = rm.RecallTask(rm.QUICK, rm.QUICK.seed + 3).prompts(4)
    for i, (p, want) in enumerate(zip(load.prompts, task)):
        assert p.ids == want.ids and p.question_first == (i % 2 == 0) and p.answer_tokens == len(want.answer)
        assert p.judge([*want.answer, 7, 7]) and not p.judge([*want.answer[:-1], want.answer[-1] + 1])
