"""FieldRef and FieldSet: the RL data plane.

A sample batch has named fields (``prompts``, ``responses``, ``logprobs``, ``values``,
``rewards``...) that different producers fill at different times, with different dtypes and
shapes. ``rt.publish_fields(...)`` publishes one window per field, tiled by rows (``tile_rows``
rows per tile, one ready word per tile), and returns a :class:`FieldSet`: a small serializable
bundle of :class:`FieldRef` objects. A FieldRef is a TensorRef with a field name and a schema,
plus row-level producer/consumer calls (``put_rows``, ``wait_rows``, ``get_rows``). Consumers
wait for one field's tile range, iterate fields or tiles as they become ready
(``FieldSet.as_ready``, ``FieldSet.tile_events``), or stream a field through a pipeline.
"""
from __future__ import annotations

import dataclasses
import secrets
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from memsem import _args, _dtypes
from memsem._buffers import as_array, buffer_info, dtype_code
from memsem._errors import MemsemError, MemsemTimeoutError
from memsem.gva import RefSpec
from memsem.refs._tensorref import TensorRef, as_core, narrowed
from memsem.core import RuntimeCore

FIELD_MAGIC = b"MSFR"
SET_MAGIC = b"MSFS"
SET_VERSION = 1
#: how long tile_events blocks on one pending ready word before re-scanning the others (s)
EVENT_SLICE_S = 0.005


@dataclasses.dataclass(frozen=True)
class FieldSchema:
    """Shape, dtype and tiling of one field.

    Attributes:
        name: field name. dtype_code: wire dtype code (``dtype`` gives the numpy dtype).
        shape: element shape; the first dimension is rows (samples). tile_rows: rows per tile
            (the last tile may hold fewer).
    """

    name: str
    dtype_code: int
    shape: tuple[int, ...]
    tile_rows: int

    @property
    def dtype(self) -> np.dtype:
        return _dtypes.numpy_dtype(self.dtype_code)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one sample)."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    @property
    def tile_bytes(self) -> int:
        return self.tile_rows * self.row_bytes

    @property
    def n_tiles(self) -> int:
        """Tiles of rows (0 for a field of 0 rows: nothing to wait for)."""
        return -(-self.rows // self.tile_rows)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def rows_of_tile(self, tile: int) -> tuple[int, int]:
        """``(start, stop)`` rows of tile ``tile``."""
        if not isinstance(tile, (int, np.integer)) or not 0 <= tile < self.n_tiles:
            raise ValueError(f"tile must be an int in [0, {self.n_tiles}) for field {self.name!r}, got {tile!r}")
        start = int(tile) * self.tile_rows
        return start, min(start + self.tile_rows, self.rows)

    def tiles_of_rows(self, start: int, stop: int) -> range:
        """Tiles that rows ``[start, stop)`` touch."""
        if stop <= start:
            return range(0)
        return range(start // self.tile_rows, (stop - 1) // self.tile_rows + 1)

    def __str__(self) -> str:
        return (f"{self.name}: {self.shape} {_dtypes.name_of(self.dtype_code)}, "
                f"{self.tile_rows} rows/tile ({self.n_tiles} tiles of {self.tile_bytes} B)")


class RowsWritten(list):
    """What ``FieldRef.put_rows`` came to: the tiles it marked ready (this list), and
    ``partial``: ``{tile: (rows written so far, rows of the tile)}`` of the tiles it wrote rows
    of without completing them (other producers' rows complete them)."""

    def __init__(self, tiles: Iterable[int] = ()) -> None:
        super().__init__(tiles)
        self.partial: dict[int, tuple[int, int]] = {}

    def __repr__(self) -> str:
        return f"RowsWritten(marked={list(self)}, partial={self.partial})"


def _check_rows(schema: FieldSchema, start: int, stop: int | None, argname: str = "rows") -> tuple[int, int]:
    stop = schema.rows if stop is None else stop
    for v in (start, stop):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{argname} bounds must be ints, got {start!r}, {stop!r}")
    if not 0 <= start <= stop <= schema.rows:
        raise ValueError(f"{argname} [{start}, {stop}) lie outside field {schema.name!r} of {schema.rows} rows")
    return int(start), int(stop)


class _Reader:
    """Bounds-checked reads of a wire form: every short or malformed read is a ValueError that
    names the field (never struct.error / IndexError / UnicodeDecodeError)."""

    def __init__(self, data: Any, what: str) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        self.data = bytes(data)
        self.what = what
        self.at = 0

    def take(self, n: int, field: str) -> bytes:
        if self.at + n > len(self.data):
            raise ValueError(f"serialized {self.what} is truncated: {field} needs {n} bytes at offset "
                             f"{self.at}, {len(self.data) - self.at} left")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def _int(self, fmt: str, field: str) -> int:
        st = struct.Struct(fmt)
        return st.unpack(self.take(st.size, field))[0]

    def u8(self, field: str) -> int:
        return self._int("<B", field)

    def u16(self, field: str) -> int:
        return self._int("<H", field)

    def u32(self, field: str) -> int:
        return self._int("<I", field)

    def text(self, n: int, field: str) -> str:
        raw = self.take(n, field)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise ValueError(f"serialized {self.what}: {field} is not UTF-8 ({raw[:16]!r})") from None

    def ref(self, n: int, field: str) -> RefSpec:
        return RefSpec.from_bytes(self.take(n, field))


# ----------------------------------------------------------------------------------------------
class FieldRef(TensorRef):
    """A TensorRef to one named field of a :class:`FieldSet`, tiled by rows.

    Attributes:
        name: the field name (``spec.name`` is the window's name, ``"<set>/<field>"``).
        schema: :class:`FieldSchema` (shape, dtype, rows per tile).

    Serializes (``to_bytes``, pickle) with its name and tiling; ``spec.to_bytes()`` gives the
    plain TensorRef form.
    """

    __slots__ = ("field", "tile_rows")

    def __init__(self, spec: RefSpec, runtime: RuntimeCore | None = None, *, field: str, tile_rows: int) -> None:
        super().__init__(spec, runtime)
        if not isinstance(field, str) or not field:
            raise ValueError(f"field must be a non-empty str, got {field!r}")
        tile_rows = _args.count(tile_rows, "tile_rows", minimum=1, maximum=(1 << 32) - 1, unit="rows")
        if not spec.shape:
            raise ValueError(f"field {field!r} must have at least one dimension (rows)")
        self.field = field
        self.tile_rows = int(tile_rows)

    # -- identity --------------------------------------------------------------------------------
    @property
    def name(self) -> str:  # type: ignore[override]
        """The field's name."""
        return self.field

    @property
    def window_name(self) -> str:
        return self.spec.name

    @property
    def schema(self) -> FieldSchema:
        return FieldSchema(self.field, self.spec.dtype_code, self.spec.shape, self.tile_rows)

    @property
    def rows(self) -> int:
        return self.spec.shape[0]

    @property
    def tile_bytes(self) -> int:  # type: ignore[override]
        """Bytes per tile (``tile_rows`` rows)."""
        return self.schema.tile_bytes

    @property
    def n_tiles(self) -> int:
        return self.schema.n_tiles

    def bind(self, runtime: RuntimeCore) -> "FieldRef":
        return FieldRef(self.spec, runtime, field=self.field, tile_rows=self.tile_rows)

    def bytes(self, offset: int, nbytes: int) -> TensorRef:
        """A plain uint8 TensorRef to a byte range of the field (see ``TensorRef.bytes``)."""
        return TensorRef(self.spec, self._rt).bytes(offset, nbytes)

    def rows_ref(self, start: int, stop: int) -> TensorRef:
        """A TensorRef to rows ``[start, stop)`` (dtype and trailing shape of the field)."""
        sc = self.schema
        start, stop = _check_rows(sc, start, stop)
        s = self.spec
        return TensorRef(narrowed(self._rt, s.sub(s.offset + start * sc.row_bytes, (stop - start) * sc.row_bytes,
                                                  s.dtype_code, (stop - start,) + s.shape[1:],
                                                  framework=s.framework)), self._rt)

    # -- serialization ---------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Wire form: ``"MSFR" | tile_rows u32 | name_len u8 | name | RefSpec bytes``. Carries the
        access key: treat it like a capability."""
        f = self.field.encode()
        return FIELD_MAGIC + struct.pack("<IB", self.tile_rows, len(f)) + f + self.spec.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, runtime: RuntimeCore | None = None) -> "FieldRef":
        """Rebuild a FieldRef from ``to_bytes`` output.

        Raises:
            ValueError: ``data`` is not a serialized FieldRef.
        """
        r = _Reader(data, "FieldRef")
        if r.take(4, "magic") != FIELD_MAGIC:
            raise ValueError(f"data is not a serialized FieldRef (got {len(r.data)} bytes starting "
                             f"{r.data[:4]!r})")
        tile_rows = r.u32("tile_rows")
        field = r.text(r.u8("field name length"), "field name")
        spec = r.ref(len(r.data) - r.at, "ref")
        try:
            return cls(spec, runtime, field=field, tile_rows=tile_rows)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"serialized FieldRef: {exc}") from None

    def __reduce__(self) -> tuple[Any, ...]:
        return (FieldRef.from_bytes, (self.to_bytes(),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FieldRef) and other.spec == self.spec and other.field == self.field

    def __hash__(self) -> int:
        return hash((self.spec, self.field))

    def __repr__(self) -> str:
        return (f"FieldRef({self.field!r}, shape={self.shape}, dtype={_dtypes.name_of(self.spec.dtype_code)}, "
                f"tile_rows={self.tile_rows}, {self.spec.label}, gen={self.spec.generation})")

    # -- producer --------------------------------------------------------------------------------
    def put_rows(self, start: int, data: Any, *, mark: bool = True) -> "RowsWritten":
        """Write ``data`` (``k`` rows: shape ``(k, *shape[1:])``, the field's dtype) at row
        ``start``, then count them towards readiness: a tile lying wholly inside ``[start,
        start + k)`` is marked ready; the rows of a tile written in part are counted (at the
        window's owner, for every producer), and the write whose rows complete a tile marks it,
        so disjoint writers (two producers each writing half of a tile) complete it. Blocking;
        the bytes are visible at the window before any mark. Each row is written once per
        generation (a row counted twice is a ValueError, the tile left as it was).

        Returns:
            :class:`RowsWritten`: the tiles this write marked ready (a list), and ``partial``:
            ``{tile: (rows written so far, rows of the tile)}`` of the tiles it counted rows of
            without completing them (a write that completes nothing says so: an empty list and
            a non-empty ``partial``).

        Raises:
            ValueError / TypeError: wrong shape, dtype or range; rows counted twice.
            AccessDeniedError: read-only. NotSupportedError: a partial tile on a route that
            cannot count at the owner (write whole tiles, or ``mark_rows`` once complete).
        """
        sc = self.schema
        if isinstance(data, np.ndarray):
            arr = data
            dtype_code(arr.dtype, "data")  # object/structured/str... refused, naming data
        elif isinstance(data, (list, tuple)):
            arr = np.asarray(data)
        else:  # torch, DLPack, buffer objects: their own checks (conj/neg/sparse/... refused)
            arr = as_array(data, "data")
        if arr.shape[1:] != sc.shape[1:] or arr.ndim != len(sc.shape):
            raise ValueError(f"data must have shape (k, {', '.join(map(str, sc.shape[1:]))}) for field "
                             f"{self.field!r}, got {arr.shape}")
        if arr.dtype != sc.dtype:
            raise TypeError(f"data dtype {arr.dtype} differs from field {self.field!r}'s {sc.dtype}")
        if not isinstance(mark, bool):
            raise TypeError(f"mark must be True or False, got {mark!r}")
        start, stop = _check_rows(sc, start, start + arr.shape[0])
        if mark:
            self._check_tiling(self._core())
        if stop > start:
            self.rows_ref(start, stop).put(np.ascontiguousarray(arr))
        done = RowsWritten()
        if mark:
            core = self._core()
            for t in sc.tiles_of_rows(start, stop):
                a, b = sc.rows_of_tile(t)
                if start <= a and b <= stop:
                    core.mark_ready(self.spec, t)
                    done.append(t)
                    continue
                rows = min(b, stop) - max(a, start)
                so_far = core.add_rows(self.spec, t, rows, b - a)
                if so_far == b - a:
                    done.append(t)
                else:
                    done.partial[t] = (so_far, b - a)
        return done

    def mark_rows(self, start: int, stop: int) -> list[int]:
        """Mark ready the tiles lying wholly inside rows ``[start, stop)`` (for data written in
        place by the owner); returns them."""
        sc = self.schema
        start, stop = _check_rows(sc, start, stop)
        self._check_tiling(self._core())
        done = []
        for t in sc.tiles_of_rows(start, stop):
            a, b = sc.rows_of_tile(t)
            if start <= a and b <= stop:
                self._core().mark_ready(self.spec, t)
                done.append(t)
        return done

    # -- consumer --------------------------------------------------------------------------------
    def wait_tiles(self, start: int = 0, stop: int | None = None, timeout: float | None = None) -> None:
        """Block until tiles ``[start, stop)`` (default: all) are ready; ``timeout`` (seconds,
        finite, default the runtime's) bounds the whole wait.

        Raises:
            MemsemTimeoutError: names the field, the window, the first tile not ready and the
                ``timeout`` given. PeerLostError: the owner died. StaleReferenceError: the
                generation moved. TypeError / ValueError: bad tile range or timeout (NaN, inf,
                negative, bool).
        """
        rt = self._core()
        given = _args.timeout_or(timeout, rt.timeout)
        n = self.n_tiles
        start = _args.count(start, "start", maximum=n, unit="tiles")
        stop = n if stop is None else _args.count(stop, "stop", maximum=n, unit="tiles")
        if start > stop:
            raise ValueError(f"tiles [{start}, {stop}) of field {self.field!r}: start > stop")
        self._check_tiling(rt)
        self._wait_tiles(rt, start, stop, time.monotonic() + given, given)

    def _wait_tiles(self, rt: RuntimeCore, start: int, stop: int, deadline: float, given: float) -> None:
        for t in range(start, stop):
            try:
                rt.wait_tile(self.spec, t, max(0.0, deadline - time.monotonic()))
            except MemsemTimeoutError as exc:
                a, b = self.schema.rows_of_tile(t)
                raise MemsemTimeoutError(
                    f"field {self.field!r} ({self.spec.label}): tile {t} (rows [{a}, {b})) not ready "
                    f"after {given} s (waiting for tiles [{start}, {stop}))",
                    what=f"tile {t} of field {self.field!r}", timeout=given) from exc

    def _check_tiling(self, rt: RuntimeCore) -> None:
        """The ready words this FieldRef waits on or marks must be the window's own: a FieldRef
        whose ``tile_rows`` disagrees with the window's tiling (a corrupted or hand-built one)
        would wait for too few tiles and read rows that are not ready."""
        info = rt.resolve(self.spec).info
        n = self.n_tiles
        if info.n_ready != max(1, n) or (n > 1 and info.tile_bytes != self.tile_bytes):
            raise ValueError(f"field {self.field!r}: tile_rows={self.tile_rows} gives {n} tiles of "
                             f"{self.tile_bytes} B, but {self.spec.label} has {info.n_ready} ready words "
                             f"of {info.tile_bytes} B")

    def wait_rows(self, start: int = 0, stop: int | None = None, timeout: float | None = None) -> None:
        """Block until every tile holding rows ``[start, stop)`` is ready (see ``wait_tiles``)."""
        sc = self.schema
        start, stop = _check_rows(sc, start, stop)
        rt = self._core()
        given = _args.timeout_or(timeout, rt.timeout)
        r = sc.tiles_of_rows(start, stop)
        if len(r):
            self._check_tiling(rt)
            self._wait_tiles(rt, r.start, r.stop, time.monotonic() + given, given)

    def rows_ready(self, start: int = 0, stop: int | None = None) -> bool:
        """Whether every tile holding rows ``[start, stop)`` is ready now (no wait)."""
        sc = self.schema
        start, stop = _check_rows(sc, start, stop)
        rt = self._core()
        self._check_tiling(rt)
        return all(rt.is_ready(self.spec, t) for t in sc.tiles_of_rows(start, stop))

    def get_rows(self, start: int = 0, stop: int | None = None, *, wait: bool = True,
                 timeout: float | None = None, out: Any = None) -> np.ndarray:
        """Copy rows ``[start, stop)`` here (shape ``(stop - start, *shape[1:])``, the field's
        dtype), first waiting for their tiles when ``wait`` (at most ``timeout`` s, see
        ``wait_tiles``). Blocking.

        Raises:
            As ``wait_tiles`` and ``TensorRef.get`` (``out`` must hold exactly the rows' bytes).
        """
        sc = self.schema
        start, stop = _check_rows(sc, start, stop)
        if not isinstance(wait, bool):
            raise TypeError(f"wait must be True or False, got {wait!r}")
        if not wait and timeout is not None:
            _args.timeout(timeout)
        if wait:
            self.wait_rows(start, stop, timeout)
        return self.rows_ref(start, stop).get(out, framework="numpy" if out is None else None)

    def pipeline(self, *, tiles_per_step: int = 1, depth: int = 2, timeout: float | None = None,
                 zero_copy: bool | None = None, out: Any = None):
        """A :class:`memsem.pipeline.Pipeline` over this field whose tiles are ``tiles_per_step``
        field tiles (whole rows: ``tile.array`` has shape ``(rows, *shape[1:])`` and
        ``tile.rows`` gives the row range); it waits for each tile's ready words."""
        from memsem.pipeline import Pipeline

        tiles_per_step = _args.count(tiles_per_step, "tiles_per_step", minimum=1, unit="tiles")
        rt = self._core()
        tb = max(1, self.tile_bytes * tiles_per_step)
        return Pipeline(rt, self.spec, tile_bytes=tb, depth=depth, timeout=timeout,
                        zero_copy=zero_copy, out=out)


# ----------------------------------------------------------------------------------------------
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
                access: str = "rw") -> "FieldSet":
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

        Raises:
            ValueError / TypeError: empty fields, bad names, 0-d values, bad tile_rows.
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
                    obj = runtime.alloc_array(shape, dtype)
                elif isinstance(value, Mapping):
                    obj = runtime.alloc_array(value["shape"], value.get("dtype", np.float32))
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
                spec = runtime.publish_spec(obj, name=f"{set_name}/{fname}", access=access, **tiling)
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
            deadline = time.monotonic() + given
            for r in self._refs.values():
                r._check_tiling(rt)
            for r in self._refs.values():
                r._wait_tiles(rt, 0, r.n_tiles, deadline, given)
            return
        r = self[field]
        if rows is None:
            r.wait_tiles(timeout=given)
        else:
            if not isinstance(rows, tuple) or len(rows) != 2:
                raise TypeError(f"rows must be a (start, stop) tuple, got {rows!r}")
            r.wait_rows(rows[0], rows[1], given)

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
            r._check_tiling(rt)
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
        r = _Reader(data, "FieldSet")
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


__all__ = ["FieldRef", "FieldSchema", "FieldSet"]
