"""An independent reference of what a vToken server's model saw: the same checkpoint in transformers, fed the
server's tokens, with an attention mask hiding from each query exactly the tokens the server's victim log
(``VTOKEN_SGLANG_VICTIM_LOG``) says were evicted before it, at their logical positions."""

from __future__ import annotations

import torch


def masked_greedy(model, prompt: list[int], output: list[int], events: list[tuple[int, list[int]]]) -> list[int]:
    """The model's greedy token after each prefix of ``prompt + output`` (teacher forcing), each query at logical
    position q hiding the positions evicted on the events ``(next_position, evicted)`` with next_position <= q.
    One forward over the whole sequence gives each position the keys and values it had when it was decoded."""
    seq = prompt + output[:-1]
    visible = torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
    for next_position, evicted in events:
        visible[next_position:, evicted] = False
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        logits = model(torch.tensor([seq]), attention_mask=mask).logits[0]
    return logits[len(prompt) - 1 :].argmax(-1).tolist()


def load(path: str):
    """The checkpoint at ``path`` in transformers, float32, eager attention (the mask is applied as given)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
