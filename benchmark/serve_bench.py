"""What the server benchmarks (serve_capacity.py, overhead.py, sla_throughput.py, quality.py) share: the model they
serve (``--model-path``), the load (``--dataset`` and its flags; random prompts), the decode step times read from
SGLang's log, the table's empty cell, and the closing wall time and ``--json`` record."""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtoken_sglang.tools import pretrained, tiny_model  # noqa: E402

# SGLang's decode log line: #running-req and the gen throughput over the steps since the previous line
DECODE_STEP = re.compile(r"#running-req: (\d+),.*?gen throughput \(token/s\): ([0-9.]+)")


TINY = "tiny"
"""``--model-path`` name of the project's tiny random LLaMA (``vtoken_sglang.tools.tiny_model``)."""


def add_model_path(ap: argparse.ArgumentParser, default: str, extra: tuple[str, ...] = ()) -> None:
    """``--model-path`` as SGLang names it: a checkpoint directory, or the name of one the project builds (``extra``:
    names the benchmark resolves itself)."""
    names = ", ".join([*pretrained.CHECKPOINTS, TINY, *extra])
    ap.add_argument(
        "--model-path",
        default=default,
        help=f"a checkpoint directory, or one the project builds: {names} (default: {default})",
    )


def add_dataset_args(ap: argparse.ArgumentParser) -> None:
    """``--dataset`` (ShareGPT first turns through bench_serving's own loader, the default for a real checkpoint;
    random ids for the tiny model) and ShareGPT's flags as bench_serving names them. ``dataset_of`` resolves the
    default."""
    ap.add_argument(
        "--dataset",
        choices=("sharegpt", "random"),
        default=None,
        help="ShareGPT first turns through bench_serving's loader (default for a real checkpoint), or random ids",
    )
    ap.add_argument("--dataset-path", help="ShareGPT JSON (default: the repaired copy, vtoken_sglang.tools.sharegpt)")
    ap.add_argument("--sharegpt-context-len", type=int, default=1024, help="leave out longer prompt + output pairs")


SHAREGPT_DEFAULTS = {"max_total_tokens": 4096, "output_len": 128}
"""A ShareGPT load's pool and new tokens per request (bench_serving's ``--sharegpt-output-len``) unless given."""


def dataset_of(args: argparse.Namespace) -> str:
    """``--dataset`` or its default: ShareGPT for a real checkpoint, random ids for the tiny model."""
    return args.dataset or ("random" if args.model_path == TINY else "sharegpt")


def model_path(value: str) -> str:
    """The checkpoint ``--model-path`` names: built (or reused) for a project name, else the value as SGLang takes
    it (a directory, or a hub id already in the local cache: nothing is downloaded)."""
    if value == TINY:
        return str(tiny_model.build())
    if value in pretrained.CHECKPOINTS:
        return str(pretrained.build(value))
    return value


def random_prompts(n: int, length: int, vocab: int = 2000, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def decode_step_ms(log: str) -> list[float]:
    """Sorted scheduler times per decode step (ms), one per decode log line: #running-req / gen throughput."""
    return sorted(1e3 * int(n) / float(x) for n, x in DECODE_STEP.findall(log) if float(x) > 0)


def dash(value: float | int | None, fmt: str) -> str:
    """A table cell: ``-`` for a missing figure."""
    return "-" if value is None else format(value, fmt)


NUMBER_LIST = re.compile(r"\[\s*(-?[0-9.e+-]+(?:,\s*-?[0-9.e+-]+)*)\s*\]")


def write_runs_json(path: Path, runs: list[dict]) -> None:
    """``{"runs": [...]}`` without the private (``_``-prefixed) fields; a list of numbers on one line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs]}, indent=1)
    path.write_text(NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",")) + "]", text) + "\n")


def finish(t0: float, runs: list[dict], json_path: Path | None) -> int:
    """A benchmark's last lines: its wall time since ``t0`` (``time.monotonic``), then ``--json`` if asked. Returns
    the exit status 0."""
    print(f"wall {time.monotonic() - t0:.0f} s")
    if json_path:
        write_runs_json(json_path, runs)
    return 0
