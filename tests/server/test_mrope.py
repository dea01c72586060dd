"""M-RoPE under eviction (real SGLang on CPU, a tiny random Qwen2-VL with a vision tower of one block): decode
positions from each request's logical length (plus its ``mrope_position_delta`` with an image), not its live one.

One server, streaming (4 sinks, 8 recent, a budget of 24) with relocation and late fences (conftest): two text-only
prompts (one over budget, one that stays under it) and a prompt with one 56x56 image (4 image tokens, 3D positions:
its delta is not 0) that goes over budget, its image tokens evictable like any token. The reference is the same
checkpoint in transformers, fed the server's tokens (the image's pixels too), with the evicted positions hidden from
each later query (``masked_reference``) and M-RoPE position ids computed over the whole sequence by transformers."""

import base64
import io

import pytest
import torch
from conftest import STRICT, greedy_with_victims, on_servers
from masked_reference import masked_greedy

from vtoken_sglang.tools import launcher, tiny_families

pytestmark = pytest.mark.server

SINKS, RECENT, BUDGET = 4, 8, 24
NEW_TOKENS = (24, 8, 24)  # text over budget, text under budget, image over budget
IMAGE_TEXT = "Reclaim moves live tokens out of sparse pages. " * 3
IMAGE_PROMPT = "The <|vision_start|><|image_pad|><|vision_end|> shows a page. " + IMAGE_TEXT


def image():
    from PIL import Image

    g = torch.Generator().manual_seed(1)
    return Image.fromarray((torch.rand(56, 56, 3, generator=g) * 255).to(torch.uint8).numpy())


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def mrope_run(tmp_path_factory):
    """{path, prompts (the server's token ids, the image's expanded), outputs, events, meta, vtoken metrics, log}."""
    from transformers import AutoProcessor

    path = str(tiny_families.build("qwen2_vl"))
    log = tmp_path_factory.mktemp("victims") / "qwen2_vl.jsonl"
    flags = ["--enable-vtoken", "--vtoken-policy", "streaming", "--vtoken-budget", str(BUDGET)]
    flags += ["--vtoken-sinks", str(SINKS), "--vtoken-recent", str(RECENT)]
    env = {**STRICT, "VTOKEN_SGLANG_VICTIM_LOG": str(log)}
    server = launcher.SglangServer(path, launcher.default_server_args(4096) + flags, env=env)
    processor = AutoProcessor.from_pretrained(path)
    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (40, 12)]
    # the server expands the one image token to the image's; the reference is the processor's expansion
    expanded = processor(text=[IMAGE_PROMPT], images=[image()], return_tensors="pt")["input_ids"][0].tolist()

    def run(name, s):
        ids = [*texts, processor.tokenizer(IMAGE_PROMPT)["input_ids"]]
        got = greedy_with_victims(s, name, ids, NEW_TOKENS, log, image_data=[None, None, data_url(image())])
        return {**got, "path": path, "prompts": [*texts, expanded]}

    return on_servers({"qwen2_vl": server}, run)["qwen2_vl"]


def reference_greedy(model, processor, prompt, output, events, with_image: bool) -> list[int]:
    """``masked_greedy`` with transformers' own M-RoPE position ids over ``prompt + output`` (and the image)."""
    model.model.rope_deltas = None  # transformers keeps the last forward's deltas here
    if not with_image:
        return masked_greedy(model, prompt, output, events)
    enc = processor(text=[IMAGE_PROMPT], images=[image()], return_tensors="pt")
    seq = torch.tensor([prompt + output[:-1]])
    kinds = enc["mm_token_type_ids"]
    kinds = torch.cat([kinds, torch.zeros(1, seq.shape[1] - kinds.shape[1], dtype=kinds.dtype)], 1)
    positions, _ = model.model.get_rope_index(seq, mm_token_type_ids=kinds, image_grid_thw=enc["image_grid_thw"])
    return masked_greedy(
        model,
        prompt,
        output,
        events,
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
        position_ids=positions,
    )


def test_mrope_decode_positions_are_logical(mrope_run):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    r = mrope_run
    m = r["vtoken"]
    assert "integrity check failed" not in r["log"] and m["position_mismatches"] == 0, r["log"][-3000:]
    assert m["tokens_evicted"] > 0 and m["tokens_moved"] > 0 and m["pages_reclaimed"] > 0, m  # relocation ran
    assert [m["prompt_tokens"] for m in r["meta"]] == [len(p) for p in r["prompts"]], (
        "the server expanded the image differently"
    )
    assert [e != [] for e in r["events"]] == [True, False, True], [len(e) for e in r["events"]]
    model = Qwen2VLForConditionalGeneration.from_pretrained(r["path"], dtype=torch.float32, attn_implementation="eager")
    processor = AutoProcessor.from_pretrained(r["path"])
    image_positions = {j for j, t in enumerate(r["prompts"][2]) if t == model.config.image_token_id}
    assert len(image_positions) == 4 and image_positions & {p for _, gone in r["events"][2] for p in gone}
    changed = 0
    for i, (prompt, output, events) in enumerate(zip(r["prompts"], r["outputs"], r["events"])):
        assert len(output) == NEW_TOKENS[i]
        want = reference_greedy(model.eval(), processor, prompt, output, events, with_image=i == 2)
        assert output == want, f"request {i} ({len(prompt)} prompt tokens): server {output} vs transformers {want}"
        if events:
            changed += reference_greedy(model, processor, prompt, output, [], with_image=i == 2) != output
    assert changed, "eviction changed no output: the masked reference would not see a wrong mask"
