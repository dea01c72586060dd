"""ShareGPT from its registry package: the cut JSON repaired into whole conversations, read by bench_serving's own
loader (``vtoken_sglang.tools.sharegpt``, ``bench_load.sharegpt_requests``)."""

import json

from vtoken_sglang.tools import sharegpt
from vtoken_sglang.tools.bench_load import sharegpt_load, sharegpt_requests
from vtoken_sglang.tools.pretrained import build as build_pretrained

RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": 'x ] , { "y": 1 }'}, {"from": "gpt", "value": "ok"}]},
    {"id": "b", "conversations": []},
    {"id": "c", "conversations": [{"from": "human", "value": "[nested]"}]},
]


def _listed(records: list[dict]) -> tuple[str, list[int]]:
    """``records`` as a JSON list, one per line, and the offset just past each record."""
    text, ends = "[\n", []
    for i, r in enumerate(records):
        text += ("" if i == 0 else ",\n") + json.dumps(r)
        ends.append(len(text))
    return text + "\n]\n", ends


def test_whole_records_keeps_exactly_the_records_before_any_cut():
    text, ends = _listed(RECORDS)
    for cut in range(1, len(text) + 1):
        whole = sum(end <= cut for end in ends)
        assert sharegpt.whole_records(text[:cut]) == RECORDS[:whole], cut
    assert sharegpt.whole_records(text) == RECORDS


def test_repaired_file_is_valid_json_with_every_whole_conversation():
    path = sharegpt.build()
    records = json.loads(path.read_text(encoding="utf-8"))
    assert len(records) == sharegpt.CONVERSATIONS
    assert all(isinstance(r.get("conversations"), list) for r in records)
    assert sharegpt.build() == path  # cached: the second call finds the same build


def test_bench_serving_reads_the_repaired_file_and_the_benchmarks_send_its_requests():
    smollm2 = build_pretrained("smollm2")
    a = sharegpt_requests(smollm2, 16, output_len=32, context_len=1024)
    assert len(a) == 16 and all(r.output_len == 32 and 0 < r.prompt_len <= 1024 - 32 for r in a)
    assert len({r.prompt for r in a}) == 16
    flags = sharegpt_load(16, 32, 1024, sharegpt.build())
    for flag in ("--dataset-name", "sharegpt", "--dataset-path", str(sharegpt.build()), "--sharegpt-output-len"):
        assert flag in flags
