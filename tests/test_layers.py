"""Layers import downward only (docs/architecture.md), and engines know nothing of generations."""
from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "memsem"
ORDER = ["native", "engines", "topology", "directory", "gva", "runtime", "pipeline", "refs"]
LEAVES = {"_errors", "_dtypes", "_buffers", "_args", "_native"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "memsem" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_layers_import_downward_only():
    bad = []
    for layer in ORDER:
        for path in (SRC / layer).rglob("*.py"):
            for mod in _imports(path):
                dep = _layer(mod)
                if dep is None or dep in LEAVES or dep == layer:
                    continue
                if dep not in ORDER or ORDER.index(dep) > ORDER.index(layer):
                    bad.append(f"{path.relative_to(SRC)} imports {mod}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_engines_know_nothing_of_generations_or_leases():
    bad = []
    for path in (SRC / "engines").rglob("*.py"):
        for mod in _imports(path):
            if mod.startswith(("memsem.gva", "memsem.runtime")):
                bad.append(f"{path.name} imports {mod}")
    assert not bad, bad
