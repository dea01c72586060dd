"""Command lines for ``python -m sglang.bench_serving`` loads against a running server (tests and benchmarks)."""

from __future__ import annotations

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
