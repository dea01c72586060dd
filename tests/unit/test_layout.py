"""The runtime never imports the tooling: no module of ``vtoken_sglang`` outside ``vtoken_sglang/tools/`` imports
``vtoken_sglang.tools`` (read from the source with ``ast``, imports inside functions included)."""

import ast

import pytest
from conftest import REPO

PACKAGE = REPO / "vtoken_sglang"


def imported_modules(source: str, module: str) -> set[str]:
    """Every module the source of ``module`` (dotted name) imports, absolute: relative imports resolved against its
    package, and ``from pkg import name`` counted as ``pkg`` and ``pkg.name`` (``name`` may be a module)."""
    package = module.split(".")[:-1]  # a package's own ``__init__`` lies in it too
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            absolute = ".".join([*base, *([node.module] if node.module else [])])
            names.add(absolute)
            names.update(f"{absolute}.{alias.name}" for alias in node.names)
    return names


def imports_tools(source: str, module: str) -> list[str]:
    return sorted(m for m in imported_modules(source, module) if m.split(".")[:2] == ["vtoken_sglang", "tools"])


def test_runtime_packages_never_import_tools():
    runtime = [p for p in sorted(PACKAGE.rglob("*.py")) if "tools" not in p.relative_to(PACKAGE).parts]
    assert len(runtime) > 20  # the scan sees the runtime
    offenders = {}
    for path in runtime:
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if found := imports_tools(path.read_text(), module):
            offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}


@pytest.mark.parametrize(
    "source",
    [
        "import vtoken_sglang.tools.launcher",
        "from vtoken_sglang.tools import launcher",
        "from vtoken_sglang import tools",
        "from ..tools import tiny_model",
        "from .. import tools",
        "def f():\n    from ..tools.router import SglangRouter",
    ],
    ids=["import", "from-tools", "from-package", "relative", "relative-package", "in-function"],
)
def test_the_scan_sees_every_form_of_import(source):
    assert imports_tools(source, "vtoken_sglang.core.probe"), source
    assert not imports_tools("from vtoken_sglang import config\nfrom ..core import pages", "vtoken_sglang.core.probe")
