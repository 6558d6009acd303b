"""Generate docs/api.md from the public docstrings: `python docs/gen_api.py > docs/api.md`."""
from __future__ import annotations

import importlib
import inspect

SECTIONS = [
    ("memsem", ["Runtime", "TensorRef", "Lease", "Completion", "Batch", "RangeResult", "State", "Stats",
                "default_runtime"]),
    ("memsem.refs._fields", ["FieldSet", "FieldRef"]),
    ("memsem.pipeline", ["Pipeline", "Tile"]),
    ("memsem.engines", ["Engine", "Descriptor", "LocalRegion", "RemoteRegion", "DirectAccess", "Availability",
                        "Op", "OpKind", "OpState", "Request", "LoopbackEngine", "HostEngine"]),
    ("memsem.engines.mock", ["ScriptedEngine"]),
    ("memsem.topology", ["Location", "Route", "choose_route"]),
    ("memsem", ["MemsemError", "StaleReferenceError", "WindowNotFoundError", "LeaseExpiredError",
                "LeaseHeldError", "PeerLostError", "AccessDeniedError", "NotSupportedError", "EngineError",
                "MemsemTimeoutError", "OutOfMemoryError"]),
]


def _sig(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def main() -> None:
    print("# API reference\n\nGenerated from the docstrings by `docs/gen_api.py`.\n")
    for modname, names in SECTIONS:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for name in names:
            obj = getattr(mod, name, None)
            if obj is None:
                continue
            print(f"## `{modname}.{name}`\n")
            if inspect.isclass(obj):
                print(f"```python\nclass {name}{_sig(obj)}\n```\n")
            elif callable(obj):
                print(f"```python\ndef {name}{_sig(obj)}\n```\n")
            print(inspect.cleandoc(obj.__doc__ or "(no docstring)") + "\n")
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                for mname, m in sorted(vars(obj).items()):
                    if mname.startswith("_") or not (callable(m) or isinstance(m, property)):
                        continue
                    doc = inspect.getdoc(m)
                    if not doc:
                        continue
                    sig = _sig(m) if callable(m) else ""
                    print(f"### `{name}.{mname}{sig}`\n\n{doc}\n")


if __name__ == "__main__":
    main()
