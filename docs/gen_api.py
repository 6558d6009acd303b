"""Generate docs/api.md from the code: `python docs/gen_api.py > docs/api.md`.

Only public names are documented: the ``__all__`` of each public module below (never a private
module path such as ``memsem.refs._fields``). ``tests/test_docs.py`` checks that docs/api.md is
what this script prints.
"""
from __future__ import annotations

import importlib
import inspect
import re

#: public modules, in the order the reference shows them; each documents its ``__all__`` (or
#: the names given)
MODULES: list[tuple[str, list[str] | None]] = [
    ("memsem", None),
    ("memsem.sync", None),
    ("memsem.pipeline", None),
    ("memsem.engines", None),
    ("memsem.testing", ["ScriptedEngine"]),
    ("memsem.topology", None),
    ("memsem.metrics", None),
]
#: members a class inherits that belong to its documented API (``memsem.Runtime`` is a
#: ``memsem.core.RuntimeCore`` plus the layers' entry points: of the core's calls, these are the
#: user's; its parts and spec-level calls are the layers' own, see docs/architecture.md)
INHERITED: dict[str, tuple[str, ...]] = {
    "Runtime": ("alloc", "close", "engine", "lease", "lease_holders", "stats", "write_section"),
}
#: names not worth a section of their own (constants, re-exports documented elsewhere)
SKIP = {"__version__", "MemsemError"}


def _sig(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r"<([\w.]+) object at 0x[0-9a-f]+>", r"<\1>", sig)  # stable across runs


def _doc(obj: object) -> str:
    return inspect.cleandoc(obj.__doc__ or "(no docstring)")


def main() -> None:
    print("# API reference\n")
    print("Generated from the code by `docs/gen_api.py` (public names only: each public module's\n"
          "`__all__`). Errors are listed last.\n")
    seen: set[int] = set()
    errors = []
    for modname, names in MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:  # an optional extra is missing: say so, do not hide it
            print(f"## `{modname}`\n\n(not importable here: {exc})\n")
            continue
        for name in names if names is not None else list(getattr(mod, "__all__", [])):
            obj = getattr(mod, name, None)
            if obj is None or name in SKIP or id(obj) in seen:
                continue
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                errors.append((modname, name, obj))
                continue
            if not (inspect.isclass(obj) or callable(obj)):
                continue
            seen.add(id(obj))
            print(f"## `{modname}.{name}`\n")
            kind = "class" if inspect.isclass(obj) else "def"
            print(f"```python\n{kind} {name}{_sig(obj)}\n```\n")
            print(_doc(obj) + "\n")
            if inspect.isclass(obj):
                members = dict(vars(obj))
                members.update((n, inspect.getattr_static(obj, n)) for n in INHERITED.get(name, ()))
                for mname, m in sorted(members.items()):
                    if mname.startswith("_") and mname not in ("__enter__", "__await__", "__aiter__"):
                        continue
                    if not (callable(m) or isinstance(m, (property, classmethod, staticmethod))):
                        continue
                    doc = inspect.getdoc(m.__func__ if isinstance(m, (classmethod, staticmethod)) else m)
                    if not doc:
                        continue
                    sig = _sig(m) if callable(m) else ""
                    print(f"### `{name}.{mname}{sig}`\n\n{doc}\n")
    print("## Errors\n")
    for modname, name, obj in [("memsem", "MemsemError", importlib.import_module("memsem").MemsemError)] + errors:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        print(f"### `{modname}.{name}({bases})`\n\n{_doc(obj)}\n")


if __name__ == "__main__":
    main()
