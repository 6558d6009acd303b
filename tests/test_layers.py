"""Layers import downward only (docs/architecture.md), and engines know nothing of generations."""
from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "memsem"
ORDER = ["native", "engines", "topology", "directory", "gva", "core", "pipeline", "refs", "sync"]
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
            if mod.startswith(("memsem.gva", "memsem.core")):
                bad.append(f"{path.name} imports {mod}")
    assert not bad, bad


#: modules of the runtime layer, each importing only the ones before it (docs/architecture.md)
RUNTIME_ORDER = ["_telemetry", "_completion", "_async", "_staging", "_gc", "_liveness", "_translate", "_bracket",
                 "_wait", "_routes", "_resolve", "_lease", "_remote", "_xcopy", "_transfer", "_view", "_readiness", "_versions",
                 "_sections", "_names", "_publish", "_watches", "_serve", "_runtime_core"]


def _runtime_imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import, skipping ``if TYPE_CHECKING:`` blocks (types only)."""
    out = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def test_runtime_modules_import_in_order():
    bad = []
    files = {p.stem: p for p in (SRC / "core").glob("_*.py") if p.stem != "__init__"}
    assert set(files) == set(RUNTIME_ORDER), f"core modules changed: {sorted(files)}; update RUNTIME_ORDER"
    for name in RUNTIME_ORDER:
        for mod, names in _runtime_imports(files[name]):
            parts = mod.split(".")
            if parts[:2] != ["memsem", "core"]:
                continue
            # ``from memsem.core import _translate as tr`` names the module among the names
            deps = [parts[2]] if len(parts) >= 3 else [n for n in names if n.startswith("_")]
            for dep in deps:
                if dep not in RUNTIME_ORDER or RUNTIME_ORDER.index(dep) >= RUNTIME_ORDER.index(name):
                    bad.append(f"core/{name}.py imports memsem.core.{dep}")
    assert not bad, "out-of-order imports inside core/:\n" + "\n".join(bad)


def test_one_runtime_class():
    """``memsem.Runtime`` is the runtime: a ``RuntimeCore`` plus the layers' entry points, the
    object users hold, refs and parts receive, and the default runtime is; nothing wraps it."""
    import numpy as np

    import memsem
    from memsem.core import RuntimeCore

    assert issubclass(memsem.Runtime, RuntimeCore)
    for gone in ("core", "of_core", "facade", "facade_type", "user_runtime", "_core"):
        assert not hasattr(memsem.Runtime, gone), gone
    with memsem.Runtime() as rt:
        ref = rt.publish(np.arange(4, dtype=np.float32), name="one-runtime")
        assert ref.runtime is rt
        assert memsem.TensorRef.from_bytes(ref.to_bytes()).runtime is rt  # unbound: the current one
        assert rt.owns(ref.spec) and rt.lookup("one-runtime").runtime is rt
    d = memsem.default_runtime()
    try:
        assert type(d) is memsem.Runtime and memsem.default_runtime() is d
    finally:
        d.close()


def _forwards(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``fn``'s body (past its docstring) is one call of a method of another object
    (``self.x.m(...)``) with ``fn``'s own arguments: a pass-through."""
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        fn.body[0].value, ast.Constant) else fn.body
    if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)):
        return False
    call = body[0].value.value if isinstance(body[0].value, ast.Await) else body[0].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Attribute)):
        return False
    own = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    return all(isinstance(a, ast.Name) and a.id in own for a in call.args + [k.value for k in call.keywords])


def test_runtime_forwards_nothing_to_the_core():
    """``memsem.Runtime`` only adds the entry points of the layers above core: it overrides
    none of ``RuntimeCore``'s names and none of its methods is a pass-through."""
    import memsem
    from memsem.core import RuntimeCore

    overridden = (set(vars(memsem.Runtime)) & set(dir(RuntimeCore))) - {"__doc__", "__module__", "__repr__",
                                                                         "__qualname__", "__firstlineno__",
                                                                         "__static_attributes__", "__dict__",
                                                                         "__weakref__"}
    assert not overridden, sorted(overridden)
    tree = ast.parse((SRC / "_runtime.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runtime"]
    fwd = [f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _forwards(f)]
    assert not fwd, fwd


def test_user_docs_use_only_the_documented_runtime_api():
    """The runtime's user API is what docs/api.md lists under ``memsem.Runtime`` (and the
    attributes its docstring names): README.md and docs/*.md use no other name of a runtime
    (its parts and spec-level calls are the layers' own), and never ``.core``."""
    import re

    import memsem

    root = SRC.parent.parent
    api = (root / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^### `Runtime\.(\w+)", api, re.M))
    documented |= set(re.findall(r"^\s+(\w+): ", memsem.Runtime.__doc__.split("Attributes:")[1], re.M))
    assert {"publish", "lookup", "close", "stats", "timeout", "rank", "engines", "closed"} <= documented
    internal = {"publish_spec", "get_spec", "put_spec", "lookup_spec", "unpublish_spec", "resolve", "route_of",
                "transfer", "submit", "publisher", "resolver", "transfers", "directory", "server", "telemetry"}
    assert not documented & internal, sorted(documented & internal)
    bad = []
    for path in [root / "README.md"] + sorted((root / "docs").glob("*.md")):
        if path.name == "api.md":
            continue
        text = path.read_text()
        bad += [f"{path.name}: {m.group(0)}" for m in re.finditer(r"\b(?:rt\d?|runtime)\.(\w+)", text)
                if m.group(1) not in documented]
        bad += [f"{path.name}: {m.group(0)}" for m in re.finditer(r"[\w.]+\.core\b(?!_)", text)
                if not m.group(0).startswith("memsem.")]
    assert not bad, "undocumented runtime names in the user docs:\n" + "\n".join(bad)


def _private_definitions(tree: ast.AST) -> set[str]:
    """Private names a module defines: its own functions, classes and module-level names, the
    ``self._x`` attributes and ``__slots__`` of its classes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
            names.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_")
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id.startswith("_"):
                    names.add(t.id)
                if isinstance(t, ast.Name) and t.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                    names.update(e.value for e in node.value.elts
                                 if isinstance(e, ast.Constant) and isinstance(e.value, str))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id.startswith("_"):
            names.add(node.target.id)
    return names


def test_no_module_touches_another_modules_private_names():
    """Parts are given what they use and call each other's public methods: ``x._name`` is only
    ever a private name of the module's own classes (never ``core.transfers._failure``,
    ``lease._views``, ``rt._forked``, ``batch._settle``...)."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        own = _private_definitions(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in own
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "private names of other modules:\n" + "\n".join(bad)


def test_other_layers_import_only_public_core_names():
    """Above the core (pipeline, refs, integrations, cli...), modules import ``memsem.core``'s
    public names, never its private modules."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "core":
            continue
        for mod in _imports(path):
            if mod.startswith("memsem.core._"):
                bad.append(f"{rel} imports {mod}")
    assert not bad, bad
