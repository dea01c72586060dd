"""patches/manifest.json lists every hook the plugin registers, its fingerprints match the installed sglang, and
a changed upstream symbol is caught by the check (and by a real launcher: ``server/test_launcher_refusals``)."""

import importlib.util
import inspect
import sys

import pytest

from vtoken_sglang.integration import plugin
from vtoken_sglang.integration.startup import manifest


def test_manifest_lists_exactly_the_registered_hooks():
    hooks = {**plugin.OPTION_HOOKS, **plugin._serving_hooks()}
    listed = {e.target: e.hook for e in manifest.entries()}
    assert listed == {target: kind.lower() for target, (kind, _fn) in hooks.items()}
    for e in manifest.entries():
        assert e.target in e.fingerprints, f"{e.target} must fingerprint its own source"


PACKAGE = "vtoken_sglang.integration."


def test_architecture_doc_describes_the_code():
    """docs/architecture.md lists every registered hook with its kind and function, and every integration module."""
    from conftest import REPO

    doc = (REPO / "docs/architecture.md").read_text()
    rows = {
        tuple(c.strip(" `") for c in line.strip("|").split("|"))
        for line in doc.splitlines()
        if line.startswith("| `") and line.count("|") == 4
    }
    hooks = {**plugin.OPTION_HOOKS, **plugin._serving_hooks()}
    expected = {
        (t.removeprefix("sglang.srt."), kind.lower(), f"{fn.__module__.removeprefix(PACKAGE)}.{fn.__name__}")
        for t, (kind, fn) in hooks.items()
    }
    assert expected <= rows, expected - rows
    root = REPO / "vtoken_sglang/integration"
    modules = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"`{m}`" not in doc] == []


def test_fingerprints_match_installed_sglang():
    assert manifest.drifted(manifest.entries()) == []
    manifest.check()


def test_changed_upstream_symbol_is_caught(tmp_path):
    """Fingerprint a modified copy of sglang/srt/server_args.py: the check names the changed symbol only."""
    import sglang.srt.server_args as upstream

    source = inspect.getsource(upstream)
    anchor = "        attrs = [attr.name for attr in record_fields(cls) if hasattr(args, attr.name)]\n"
    assert anchor in source
    path = tmp_path / "server_args_modified.py"
    path.write_text(source.replace(anchor, anchor + "        attrs = sorted(attrs)\n"))
    spec = importlib.util.spec_from_file_location("vtoken_test_server_args_modified", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)

    def resolver(symbol: str):
        prefix = "sglang.srt.server_args."
        if symbol.startswith(prefix):
            obj = module
            for part in symbol[len(prefix) :].split("."):
                obj = getattr(obj, part) if not isinstance(obj, type) else obj.__dict__.get(part, getattr(obj, part))
            return obj
        return manifest.resolve(symbol)

    problems = manifest.drifted(manifest.entries(), resolver)
    assert len(problems) == 1 and problems[0].startswith("sglang.srt.server_args.ServerArgs.from_cli_args ")
    with pytest.raises(manifest.PatchDriftError, match=r"ServerArgs\.from_cli_args .*changed upstream"):
        manifest.check(resolver=resolver)
