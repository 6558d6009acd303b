"""Engines: replaceable executors that move bytes (see ``memsem.engines._base``).

Built in: ``loopback`` (same process), ``host`` (same node: shared segment or cross-memory
attach). Optional engines (``mte``, ``rdma``, ``tcp``) import their native bindings only when
used. Third parties add engines through the ``memsem.engines`` entry-point group.
"""
from __future__ import annotations

from importlib import metadata

from memsem.engines._base import (
    RUN_DIGEST_BYTES,
    WATCH_HEADER,
    WATCH_READY,
    Availability,
    ControlWords,
    Credential,
    Descriptor,
    DirectAccess,
    Engine,
    EngineContext,
    GenerationCheck,
    LocalRegion,
    Op,
    OpKind,
    OpState,
    RemoteOutcome,
    RemoteRegion,
    Request,
    WatchMode,
    run_digest,
)
from memsem.engines.host import HostEngine
from memsem.engines.loopback import LoopbackEngine

_BUILTIN: dict[str, str] = {
    "loopback": "memsem.engines.loopback:LoopbackEngine",
    "host": "memsem.engines.host:HostEngine",
    "mte": "memsem.engines.mte:MteEngine",
    "rdma": "memsem.engines.rdma:RdmaEngine",
    "tcp": "memsem.engines.tcp:TcpEngine",
}


def engine_names() -> list[str]:
    """Names of every known engine: built-ins plus entry points."""
    names = dict.fromkeys(_BUILTIN)
    try:
        for ep in metadata.entry_points(group="memsem.engines"):
            names.setdefault(ep.name)
    except Exception:  # broken third-party metadata must not break memsem
        pass
    return list(names)


def engine_class(name: str) -> type[Engine]:
    """Load an engine class by name (built-in or entry point).

    Raises:
        ValueError: no engine of that name.
        NotSupportedError: the engine's module cannot be imported here.
    """
    cls = _LOADED.get(name)
    if cls is not None:
        return cls
    from memsem._errors import NotSupportedError

    target = _BUILTIN.get(name)
    if target is None:
        for ep in metadata.entry_points(group="memsem.engines"):
            if ep.name == name:
                return ep.load()
        raise ValueError(f"engine {name!r} is unknown; known: {', '.join(engine_names())}")
    module, _, attr = target.partition(":")
    try:
        import importlib

        cls = _LOADED[name] = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise NotSupportedError(f"engine {name!r} cannot be imported here: {exc}") from exc
    return cls


#: built-in engine classes loaded so far, by name (an import is looked up once)
_LOADED: dict[str, type[Engine]] = {}


__all__ = [
    "RUN_DIGEST_BYTES", "run_digest",
    "WATCH_HEADER", "WATCH_READY", "Availability", "ControlWords", "Credential", "Descriptor", "DirectAccess", "Engine", "EngineContext", "GenerationCheck", "RemoteOutcome", "WatchMode", "HostEngine", "LocalRegion",
    "LoopbackEngine", "Op", "OpKind", "OpState", "RemoteRegion", "Request", "engine_class",
    "engine_names",
]
