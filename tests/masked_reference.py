"""An independent reference of what a vToken server's model saw: the same checkpoint in transformers, fed the
server's tokens, with an attention mask hiding from each query exactly the tokens the server's victim log
(``VTOKEN_SGLANG_VICTIM_LOG``) says were evicted before it, at their logical positions. A model with sliding
layers gets, on those layers, the mask of its window by logical position as well (transformers applies no window
of its own to a mask given whole)."""

from __future__ import annotations

import torch


def masked_greedy(
    model,
    prompt: list[int],
    output: list[int],
    events: list[tuple[int, list[int]]],
    decode_span: int | None = None,
    **inputs,
) -> list[int]:
    """The model's greedy token after each prefix of ``prompt + output`` (teacher forcing), each query at logical
    position q hiding the positions evicted on the events ``(next_position, evicted)`` with next_position <= q.
    One forward over the whole sequence gives each position the keys and values it had when it was decoded.
    Sliding layers see, from a query at q, the keys above ``q - span``: ``span`` is the model's window for the
    prompt's queries (the prefill) and ``decode_span`` (default: the window) for the decoded ones (SGLang's Triton
    decode window is one position shorter than its prefill's). ``inputs`` go to the forward as they are (an image's
    pixels, M-RoPE position ids over the whole sequence)."""
    seq = prompt + output[:-1]
    n = len(seq)
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    for next_position, evicted in events:
        visible[next_position:, evicted] = False
    mask = _additive(visible)
    window = sliding_window(model.config)
    if window is not None:
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        span = torch.where(q < len(prompt), window, decode_span or window)
        mask = {"full_attention": mask, "sliding_attention": _additive(visible & (k > q - span))}
    with torch.no_grad():
        # only the queries whose next token is compared get logits (a long prompt's would take gigabytes)
        logits = model(input_ids=torch.tensor([seq]), attention_mask=mask, logits_to_keep=len(output), **inputs).logits
    return logits[0, -len(output) :].argmax(-1).tolist()


def masked_greedy_turns(model, turns: list[tuple[list[int], list[int]]], events: list[tuple[int, list[int]]]) -> list:
    """``masked_greedy`` of every turn of one conversation at once: ``turns`` are ``(prompt, output)`` pairs, each
    prompt the conversation before its turn's answer (so each is a prefix of the last turn's ``prompt + output``);
    one forward over the last turn's sequence gives every turn's greedy tokens (full-attention models)."""
    prompt, output = turns[-1]
    seq = prompt + output[:-1]
    visible = torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
    for next_position, evicted in events:
        visible[next_position:, evicted] = False
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq]), attention_mask=_additive(visible)).logits[0]
    greedy = logits.argmax(-1).tolist()
    return [greedy[len(p) - 1 : len(p) - 1 + len(o)] for p, o in turns]


def sliding_window(config) -> int | None:
    """The window of the model's sliding layers (positions a query sees, itself included), or None."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return config.sliding_window
    return None


def _additive(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]


def load(path: str, attention: str = "eager"):
    """The checkpoint at ``path`` in transformers, float32, eager attention (the mask is applied as given), or
    ``attention="sdpa"`` (the mask is given to SDPA as it is: the same tokens, about three times faster on a
    prompt of thousands of tokens)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention).eval()
