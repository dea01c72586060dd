"""The patches manifest: every upstream SGLang symbol vToken hooks, pinned by a fingerprint of its source.

``patches/manifest.json`` (shipped as ``vtoken_sglang.patches``) lists, for each hook target, the symbols whose
source the hook relies on and the SHA-256 of that source in sglang 0.5.23. ``check`` recomputes them from the
installed sglang; an upgrade that changes any of them fails loudly, naming the symbol. Developers regenerate the
fingerprints only after re-reading the changed upstream code:
``python -m vtoken_sglang.integration.startup.manifest --update``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.resources
import inspect
import json
import os
import pkgutil
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANIFEST_PACKAGE = "vtoken_sglang.patches"
MANIFEST_NAME = "manifest.json"


class PatchDriftError(RuntimeError):
    """An upstream symbol that vToken hooks is missing or its source changed."""


@dataclasses.dataclass(frozen=True)
class PatchEntry:
    target: str  # dotted path the hook is registered on
    hook: str  # before | after | around | replace
    purpose: str
    fingerprints: dict[str, str]  # dotted symbol -> sha256 of its normalized source


def normalize_source(source: str) -> str:
    """Dedent and strip trailing whitespace, so indentation of the enclosing class does not matter."""
    return "\n".join(line.rstrip() for line in textwrap.dedent(source).strip().splitlines()) + "\n"


def fingerprint(source: str) -> str:
    return hashlib.sha256(normalize_source(source).encode()).hexdigest()


def resolve(symbol: str) -> Any:
    """Import ``a.b.C.meth`` and return the undecorated object (hook wrappers are looked through)."""
    obj = pkgutil.resolve_name(symbol)
    return inspect.unwrap(obj) if callable(obj) else obj


def source_of(symbol: str, resolver: Callable[[str], Any] = resolve) -> str:
    obj = resolver(symbol)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return inspect.getsource(obj)


ENV_OVERRIDE = "VTOKEN_SGLANG_MANIFEST"  # another manifest file (tests of the drift check; porting to a new sglang)


def manifest_path() -> Path:
    if os.environ.get(ENV_OVERRIDE):
        return Path(os.environ[ENV_OVERRIDE])
    return Path(str(importlib.resources.files(MANIFEST_PACKAGE) / MANIFEST_NAME))


def load(path: Path | None = None) -> dict[str, Any]:
    return json.loads((path or manifest_path()).read_text())


def entries(data: dict[str, Any] | None = None) -> list[PatchEntry]:
    data = data if data is not None else load()
    return [PatchEntry(e["target"], e["hook"], e["purpose"], dict(e["fingerprints"])) for e in data["patches"]]


def drifted(entry_list: list[PatchEntry], resolver: Callable[[str], Any] = resolve) -> list[str]:
    """Human-readable lines, one per symbol that is missing or whose fingerprint differs; empty when all match."""
    problems = []
    for entry in entry_list:
        for symbol, expected in entry.fingerprints.items():
            try:
                actual = fingerprint(source_of(symbol, resolver))
            except Exception as err:  # missing module/attribute, or no source
                problems.append(
                    f"{symbol} (hooked by vToken at {entry.target}) cannot be read: {type(err).__name__}: {err}"
                )
                continue
            if actual != expected:
                problems.append(
                    f"{symbol} (hooked by vToken at {entry.target}) changed upstream: "
                    f"fingerprint {actual[:12]} != pinned {expected[:12]}"
                )
    return problems


def check(targets: set[str] | None = None, resolver: Callable[[str], Any] = resolve) -> None:
    """Raise ``PatchDriftError`` naming the first drifted symbol; ``targets`` limits the check to those hooks."""
    data = load()
    selected = [e for e in entries(data) if targets is None or e.target in targets]
    if targets is not None:
        missing = targets - {e.target for e in selected}
        if missing:
            raise PatchDriftError(f"hook target {sorted(missing)[0]} is not listed in patches/{MANIFEST_NAME}")
    problems = drifted(selected, resolver)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PatchDriftError(f"vToken was built against sglang {data['sglang_version']}: {problems[0]}{more}")


def update(path: Path | None = None) -> list[str]:
    """Recompute every fingerprint from the installed sglang and write the manifest back. Returns changed symbols."""
    path = path or manifest_path()
    data = load(path)
    changed = []
    for raw in data["patches"]:
        for symbol in raw["fingerprints"]:
            new = fingerprint(source_of(symbol))
            if raw["fingerprints"][symbol] != new:
                changed.append(symbol)
                raw["fingerprints"][symbol] = new
    path.write_text(json.dumps(data, indent=2) + "\n")
    return changed


def main(argv: list[str]) -> int:
    if argv == ["--update"]:
        for symbol in update():
            print(f"updated {symbol}")
        return 0
    problems = drifted(entries())
    for line in problems:
        print(line)
    print(f"{len(entries())} hook targets checked, {len(problems)} drifted")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
