"""FieldSet: a batch of named fields (the RL data plane), each a tiled window (:mod:`memsem.refs._fields`).

``rt.publish_fields(...)`` publishes one window per field and returns a :class:`FieldSet`: a
small serializable bundle of :class:`FieldRef` objects. Consumers wait for fields, or iterate
fields or tiles as they become ready (``FieldSet.as_ready``, ``FieldSet.tile_events``).
"""
from __future__ import annotations

import secrets
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from memsem import _args
from memsem._buffers import buffer_info
from memsem._errors import MemsemError, MemsemTimeoutError
from memsem.core import RuntimeCore
from memsem.refs._fields import (
    FieldRef,
    FieldSchema,
    WireReader,
    check_tiling,
    tiles_wait,
    wait_tiles,
    wait_tiles_async,
)
from memsem.refs._tensorref import as_core

SET_MAGIC = b"MSFS"
SET_VERSION = 1
#: how long tile_events blocks on one pending ready word before re-scanning the others (s)
EVENT_SLICE_S = 0.005


class FieldSet(Mapping[str, FieldRef]):
    """A batch of named fields, each a tiled window; a read-only mapping ``name -> FieldRef``.

    Build one with ``rt.publish_fields(...)`` (the owner), or ``FieldSet.from_bytes(data)`` /
    unpickling (anyone). ``to_bytes()`` gives a compact wire form carrying every field's ref.

    Attributes:
        name: the set's name (window names are ``"<name>/<field>"``).
        schema: ``{field: FieldSchema}``.
    """

    def __init__(self, name: str, refs: Iterable[FieldRef], runtime: RuntimeCore | None = None,
                 local: dict[str, np.ndarray] | None = None) -> None:
        self.name = name
        self._refs: dict[str, FieldRef] = {}
        for r in refs:
            if not isinstance(r, FieldRef):
                raise TypeError(f"refs must be FieldRefs, got {type(r).__name__}")
            if r.field in self._refs:
                raise ValueError(f"field {r.field!r} appears twice")
            self._refs[r.field] = r if runtime is None else r.bind(runtime)
        self._rt = as_core(runtime)
        self._local = dict(local or {})

    # -- publish ---------------------------------------------------------------------------------
    @classmethod
    def publish(cls, runtime: RuntimeCore, fields: Mapping[str, Any], *,
                tile_rows: int | Mapping[str, int] | None = None, name: str | None = None,
                access: str = "rw", replace: bool = False) -> "FieldSet":
        """Publish ``fields`` as one window each, with one ready word per ``tile_rows`` rows.

        Args:
            runtime: the owner's runtime.
            fields: ``{name: value}``; a value is either existing memory (a C-contiguous numpy
                array or CPU tensor with at least one dimension, published in place) or a schema
                ``(shape, dtype)`` / ``{"shape": ..., "dtype": ...}`` for which a zero-filled
                shared-segment array is allocated (``FieldSet.local(name)`` gives it to the owner;
                same-node consumers can ``view()`` it).
            tile_rows: rows per tile, one int for every field or ``{field: rows}``; default (None)
                the whole field is one tile.
            name: the set's name (default a random ``fields-xxxxxxxx``); window names are
                ``"<name>/<field>"``, so two sets in one runtime need different names.
            access: "rw" (default: producers put rows) or "r".
            replace: take the fields' names over (``memsem.Runtime.publish``'s ``replace``):
                needed to publish a set of the same name again, also from the same runtime
                (each step's batch under one name); the old set's refs become stale.

        Raises:
            ValueError / TypeError: empty fields, bad names, 0-d values, bad tile_rows.
            NameHeldError: a field's window name is held (this runtime included), not ``replace``.
        """
        runtime = as_core(runtime)
        if runtime is None:
            raise TypeError("runtime must be a memsem.Runtime, got None")
        if not isinstance(fields, Mapping) or not fields:
            raise ValueError("fields must be a non-empty mapping of field name to array or (shape, dtype)")
        set_name = name if name is not None else f"fields-{secrets.token_hex(4)}"
        if not isinstance(set_name, str) or not set_name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        refs: list[FieldRef] = []
        local: dict[str, np.ndarray] = {}
        try:
            for fname, value in fields.items():
                if not isinstance(fname, str) or not fname or "/" in fname:
                    raise ValueError(f"field names must be non-empty str without '/', got {fname!r}")
                if isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], np.ndarray):
                    shape, dtype = value
                    obj = runtime.alloc(shape, dtype)
                elif isinstance(value, Mapping):
                    obj = runtime.alloc(value["shape"], value.get("dtype", np.float32))
                else:
                    obj = value
                info = buffer_info(obj, f"fields[{fname!r}]")
                if not info.shape:
                    raise ValueError(f"field {fname!r} must have at least one dimension (rows), got shape ()")
                tr = tile_rows.get(fname) if isinstance(tile_rows, Mapping) else tile_rows
                if tr is None:  # default: the whole field is one tile
                    tr = max(1, info.shape[0])
                else:
                    tr = _args.count(tr, f"tile_rows for field {fname!r}", minimum=1,
                                     maximum=(1 << 32) - 1, unit="rows")
                sc = FieldSchema(fname, info.dtype_code, tuple(info.shape), tr)
                tiling = {"tile_bytes": sc.tile_bytes} if sc.tile_bytes else {"tiles": 1}
                spec = runtime.publish_spec(obj, name=f"{set_name}/{fname}", access=access, replace=replace,
                                            **tiling)
                refs.append(FieldRef(spec, runtime, field=fname, tile_rows=tr))
                if isinstance(obj, np.ndarray):
                    local[fname] = obj
        except BaseException:
            for r in refs:
                try:
                    runtime.unpublish_spec(r.spec)
                except MemsemError:
                    pass
            raise
        return cls(set_name, refs, runtime, local)

    def unpublish(self, *, timeout: float | None = None) -> None:
        """Owner: unpublish every field (see ``Runtime.unpublish``). Fields already gone are
        skipped."""
        rt = self._core()
        errors = []
        for r in self._refs.values():
            try:
                rt.unpublish_spec(r.spec, timeout=timeout)
            except MemsemError as exc:
                if type(exc).__name__ != "WindowNotFoundError":
                    errors.append(exc)
        if errors:
            raise errors[0]

    def local(self, field: str) -> np.ndarray:
        """Owner: the array backing ``field`` in this process (to write in place, then
        ``self[field].mark_rows(...)``)."""
        try:
            return self._local[field]
        except KeyError:
            raise KeyError(f"field {field!r} has no local array here (only the publisher holds them)") from None

    # -- mapping ---------------------------------------------------------------------------------
    def __getitem__(self, field: str) -> FieldRef:
        try:
            return self._refs[field]
        except KeyError:
            raise KeyError(f"no field {field!r} in field set {self.name!r} (fields: {', '.join(self._refs)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self._refs)

    @property
    def schema(self) -> dict[str, FieldSchema]:
        return {k: r.schema for k, r in self._refs.items()}

    @property
    def runtime(self) -> Any:
        """The ``memsem.Runtime`` this set works through."""
        return next(iter(self._refs.values())).runtime

    def _core(self) -> RuntimeCore:
        return next(iter(self._refs.values()))._core()

    def bind(self, runtime: RuntimeCore) -> "FieldSet":
        return FieldSet(self.name, self._refs.values(), runtime)

    # -- waiting ---------------------------------------------------------------------------------
    def wait(self, field: str | None = None, *, rows: tuple[int, int] | None = None,
             timeout: float | None = None) -> None:
        """Block until ``field``'s rows ``rows`` (default: all of them) are ready; with
        ``field=None``, until every field is complete. ``timeout`` bounds the whole wait."""
        rt = self._core()
        given = _args.timeout_or(timeout, rt.timeout)
        if field is None:
            if rows is not None:
                raise ValueError("rows= needs field=")
            wait = tiles_wait(rt, given)  # one deadline for every field
            for r in self._refs.values():
                check_tiling(r, rt)
            for r in self._refs.values():
                wait_tiles(r, rt, 0, r.n_tiles, wait)
            return
        r = self[field]
        if rows is None:
            r.wait_tiles(timeout=given)
        else:
            if not isinstance(rows, tuple) or len(rows) != 2:
                raise TypeError(f"rows must be a (start, stop) tuple, got {rows!r}")
            r.wait_rows(rows[0], rows[1], given)

    async def wait_async(self, field: str | None = None, *, rows: tuple[int, int] | None = None,
                         timeout: float | None = None) -> None:
        """``wait`` for asyncio: every tile's ready word is awaited through the runtime's native
        word waiter (the event loop never blocks, nothing polls), all within one deadline.
        Arguments are checked before the first await. Cancelling the awaiting task ends the wait.

        Raises:
            As ``wait``: MemsemTimeoutError naming the field and the first tile not ready,
            PeerLostError, StaleReferenceError, TypeError / ValueError.
        """
        rt = self._core()
        given = _args.timeout_or(timeout, rt.timeout)
        if field is None:
            if rows is not None:
                raise ValueError("rows= needs field=")
            wait = tiles_wait(rt, given)
            for r in self._refs.values():
                check_tiling(r, rt)
            for r in self._refs.values():
                await wait_tiles_async(r, rt, 0, r.n_tiles, wait)
            return
        r = self[field]
        if rows is None:
            await r.wait_tiles_async(timeout=given)
        else:
            if not isinstance(rows, tuple) or len(rows) != 2:
                raise TypeError(f"rows must be a (start, stop) tuple, got {rows!r}")
            await r.wait_rows_async(rows[0], rows[1], given)

    def tile_events(self, fields: Iterable[str] | None = None, *,
                    timeout: float | None = None) -> Iterator[tuple[FieldRef, int]]:
        """Yield ``(field_ref, tile)`` once for every tile of ``fields`` (default all), in the
        order they become ready (tiles already ready first). ``timeout`` bounds the time from the
        start to the last event.

        Raises:
            MemsemTimeoutError: not every tile became ready in time (names what is missing).
            PeerLostError: a field's owner died.
        """
        if isinstance(fields, str):
            raise TypeError(f"fields must be an iterable of field names, not a str ({fields!r}); "
                            "pass [name]")
        refs = [self[f] for f in (self.fields if fields is None else fields)]
        rt = self._core()
        timeout = _args.timeout_or(timeout, rt.timeout)  # checked now, not at the first next()
        for r in refs:
            check_tiling(r, rt)
        return self._tile_events(rt, refs, timeout)

    def _tile_events(self, rt: RuntimeCore, refs: list[FieldRef],
                     timeout: float) -> Iterator[tuple[FieldRef, int]]:
        deadline = time.monotonic() + timeout
        pending = [set(range(r.n_tiles)) for r in refs]
        turn = 0
        while any(pending):
            progressed = False
            for r, pend in zip(refs, pending):
                if not pend:
                    continue
                for t in sorted(pend.intersection(r.ready_tiles())):
                    pend.discard(t)
                    progressed = True
                    yield r, t
            if progressed:
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(f"{r.field} tiles {sorted(p)[:8]}{'...' if len(p) > 8 else ''}"
                                    for r, p in zip(refs, pending) if p)
                raise MemsemTimeoutError(f"field set {self.name!r}: not ready after {timeout} s: {missing}",
                                         what=f"fields of {self.name!r}", timeout=timeout)
            waiting = [i for i, p in enumerate(pending) if p]
            i = waiting[turn % len(waiting)]
            turn += 1
            try:
                rt.wait_tile(refs[i].spec, min(pending[i]), min(EVENT_SLICE_S, left))
            except MemsemTimeoutError:
                pass

    def as_ready(self, fields: Iterable[str] | None = None, *,
                 timeout: float | None = None) -> Iterator[FieldRef]:
        """Yield each of ``fields`` (default all) once it is complete (every tile ready), in the
        order they complete. ``timeout`` bounds the whole iteration (MemsemTimeoutError)."""
        if isinstance(fields, str):
            raise TypeError(f"fields must be an iterable of field names, not a str ({fields!r}); "
                            "pass [name]")
        names = list(self.fields if fields is None else fields)
        events = self.tile_events(names, timeout=timeout)  # validates now
        return self._as_ready(events, {n: self[n].n_tiles for n in names})

    def _as_ready(self, events: Iterator[tuple[FieldRef, int]], left: dict[str, int]) -> Iterator[FieldRef]:
        for name, n in left.items():
            if n == 0:  # a field of 0 rows is complete from the start
                yield self[name]
        for r, _ in events:
            left[r.field] -= 1
            if left[r.field] == 0:
                yield r

    # -- serialization ---------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Wire form: ``"MSFS" | version u8 | name_len u8 | name | n u16 | n x (len u32 |
        FieldRef bytes)``. Carries every field's access key: treat it like a capability."""
        nm = self.name.encode()[:255]
        parts = [SET_MAGIC, struct.pack("<BB", SET_VERSION, len(nm)), nm, struct.pack("<H", len(self._refs))]
        for r in self._refs.values():
            b = r.to_bytes()
            parts.append(struct.pack("<I", len(b)))
            parts.append(b)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, runtime: RuntimeCore | None = None) -> "FieldSet":
        """Rebuild a FieldSet (bound to ``runtime`` or, lazily, the current/default runtime).

        Raises:
            ValueError: ``data`` is not a serialized FieldSet.
        """
        r = WireReader(data, "FieldSet")
        if r.take(4, "magic") != SET_MAGIC:
            raise ValueError(f"data is not a serialized FieldSet (got {len(r.data)} bytes starting "
                             f"{r.data[:4]!r})")
        version = r.u8("version")
        if version != SET_VERSION:
            raise ValueError(f"serialized FieldSet version {version}; this memsem reads {SET_VERSION}")
        name = r.text(r.u8("name length"), "name")
        n = r.u16("field count")
        if n == 0:
            raise ValueError("serialized FieldSet: field count is 0 (a FieldSet has at least one field)")
        refs = []
        for i in range(n):
            ln = r.u32(f"length of field {i}")
            body = r.take(ln, f"field {i}")
            try:
                refs.append(FieldRef.from_bytes(body, runtime))
            except ValueError as exc:
                raise ValueError(f"serialized FieldSet: field {i}: {exc}") from None
        if r.at != len(r.data):
            raise ValueError(f"serialized FieldSet has {len(r.data)} bytes, its contents end at {r.at}")
        try:
            return cls(name, refs, runtime)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"serialized FieldSet: {exc}") from None

    def __reduce__(self) -> tuple[Any, ...]:
        return (FieldSet.from_bytes, (self.to_bytes(),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FieldSet) and other.name == self.name and other._refs == self._refs

    def __hash__(self) -> int:
        return hash((self.name, tuple(self._refs.values())))

    def __repr__(self) -> str:
        inner = "; ".join(str(s) for s in self.schema.values())
        return f"FieldSet({self.name!r}: {inner})"


__all__ = ["FieldSet"]
