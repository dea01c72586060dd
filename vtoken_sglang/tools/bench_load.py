"""Command lines for ``python -m sglang.bench_serving`` loads against a running server (tests and benchmarks)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path


def bench_serving_command(
    url: str,
    model: str,
    output_file: Path | str,
    *load: str,
    rate: float | str = "inf",
    seed: int = 1,
    progress: bool = False,
) -> list[str]:
    """``python -m sglang.bench_serving`` against the server at ``url``, with ``model``'s own tokenizer, its summary
    appended to ``output_file`` as a JSON line. ``load``: the dataset flags (``random_ids_load``, or another
    dataset's)."""
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url]
    cmd += ["--model", model, "--tokenizer", model, "--request-rate", str(rate), "--seed", str(seed)]
    return cmd + ([] if progress else ["--disable-tqdm"]) + [*load, "--output-file", str(output_file)]


def random_ids_load(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.5) -> list[str]:
    """bench_serving's ``random-ids`` dataset: random token ids, lengths drawn in ``[ratio x len, len]``."""
    return [
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        str(num_prompts),
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        str(range_ratio),
    ]


def sharegpt_load(num_prompts: int, output_len: int, context_len: int | None, dataset_path: Path | str) -> list[str]:
    """bench_serving's ``sharegpt`` dataset from ``dataset_path`` (``vtoken_sglang.tools.sharegpt.build()``): first
    turns, ``output_len`` new tokens each, pairs longer than ``context_len`` tokens left out."""
    flags = ["--dataset-name", "sharegpt", "--dataset-path", str(dataset_path), "--num-prompts", str(num_prompts)]
    flags += ["--sharegpt-output-len", str(output_len)]
    return flags + (["--sharegpt-context-len", str(context_len)] if context_len else [])


@dataclasses.dataclass(frozen=True)
class ShareGPTRequest:
    prompt: str  # the conversation's first turn, as bench_serving sends it
    prompt_len: int  # its tokens under the model's tokenizer
    output_len: int


def sharegpt_requests(
    tokenizer_path: str,
    num_prompts: int,
    output_len: int,
    context_len: int | None = None,
    seed: int = 1,
    dataset_path: Path | str | None = None,
) -> list[ShareGPTRequest]:
    """The requests ``sharegpt_load`` with ``--seed seed`` makes bench_serving send: its own ShareGPT loader over
    the same file, after the same seeding, so a benchmark that sends them itself (and keeps each output's token
    ids) runs bench_serving's load."""
    import contextlib
    import io
    import random

    import numpy as np
    from sglang.benchmark.datasets.sharegpt import sample_sharegpt_requests
    from transformers import AutoTokenizer

    from vtoken_sglang.tools import sharegpt

    path = str(dataset_path or sharegpt.build())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    random.seed(seed)
    np.random.seed(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # the loader prints its token totals
        rows = sample_sharegpt_requests(
            path, num_prompts, tokenizer, fixed_output_len=output_len, context_len=context_len
        )
    return [ShareGPTRequest(r.prompt, r.prompt_len, r.output_len) for r in rows]
