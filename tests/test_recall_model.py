"""The recall model (a small LLaMA trained here to find needles) and the quality benchmark on it: the task's
layouts, and ``benchmark/quality.py --quick`` in real SGLang (the quick model trained, or reused, on the way)."""

from __future__ import annotations

import json

import pytest
from conftest import PY, run_all

from vtoken_sglang import recall_model as rm


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


@pytest.mark.server
def test_quality_quick_mode_in_real_sglang(tmp_path):
    """The quick recall model answers >= 95% exactly with the full KV cache (policy none) in real SGLang; random
    and h2o at ratio 0.5 evict on a pool too small for Naive-Evict to run every request at once, and give the same
    tokens with reclaim off (Naive-Evict) and on (vToken: pages reclaimed, every request at once and none retracted,
    the prompts' tree pages copied out after making room by evicting the tree pages released before) for every
    request Naive-Evict did not retract (a retracted request is prefilled again whole and trimmed anew); the
    benchmark writes its table and JSON."""
    out = tmp_path / "quality.json"
    (run,) = run_all([[PY, "benchmark/quality.py", "--quick", "--json", str(out)]], timeout=1500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "accuracy" in run.stdout and "mean_pg" in run.stdout
    runs = {(r["policy"], r["budget_ratio"], r["mode"]): r for r in json.loads(out.read_text())["runs"]}
    full = runs["none", 1.0, "vtoken"]
    assert full["accuracy"] >= 0.95 and full["tokens_evicted"] == 0, full
    for policy in ("random", "h2o"):
        naive, vtoken = runs[policy, 0.5, "naive"], runs[policy, 0.5, "vtoken"]
        # Naive-Evict's evictions may differ in number: a retracted request is prefilled and trimmed again
        assert vtoken["identical_to_naive"] and naive["tokens_evicted"] > 0 and vtoken["tokens_evicted"] > 0, policy
        assert vtoken["retracted"] == 0 and vtoken["compared"] == 16 - naive["retracted"] >= 8, (naive, vtoken)
        assert vtoken["pages_reclaimed"] > 0 and naive["pages_reclaimed"] == 0, policy
        assert vtoken["max_running_requests"] == 16 >= naive["max_running_requests"], policy
        assert vtoken["cow_copies"] > 0 and vtoken["cow_room_pages"] > 0 and naive["cow_copies"] == 0, vtoken
