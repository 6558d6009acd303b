"""FieldRef: one named field of the RL data plane, tiled by rows (FieldSet: ``_fieldset``).

A sample batch has named fields (``prompts``, ``responses``, ``logprobs``, ``values``,
``rewards``...) that different producers fill at different times, with different dtypes and
shapes. ``rt.publish_fields(...)`` publishes one window per field, tiled by rows (``tile_rows``
rows per tile, one ready word per tile), and returns a :class:`FieldSet`: a small serializable
bundle of :class:`FieldRef` objects. A FieldRef is a TensorRef with a field name and a schema,
plus row-level producer/consumer calls (``put_rows``, ``wait_rows``, ``get_rows``). Consumers
wait for one field's tile range, iterate fields or tiles as they become ready
(``FieldSet.as_ready``, ``FieldSet.tile_events``), or stream a field through a pipeline.

This module holds one field: its schema, its ref's wire form and its row-level calls (and the
tile waits a set runs over several fields: :func:`check_tiling`, :func:`wait_tiles`);
:mod:`memsem.refs._fieldset` holds the set.
"""
from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from memsem import _args, _dtypes
from memsem._buffers import as_array, dtype_code
from memsem._errors import MemsemTimeoutError
from memsem.gva import RefSpec
from memsem.refs._tensorref import TensorRef, narrowed
from memsem.core import RuntimeCore, Wait

FIELD_MAGIC = b"MSFR"


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


class WireReader:
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
        r = WireReader(data, "FieldRef")
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
            check_tiling(self, self._core())
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
                so_far = core.readiness.add_rows(self.spec, t, rows, b - a)
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
        check_tiling(self, self._core())
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
        rt, a, b, wait = self._tiles_to_wait(start, stop, timeout)
        wait_tiles(self, rt, a, b, wait)

    async def wait_tiles_async(self, start: int = 0, stop: int | None = None, timeout: float | None = None) -> None:
        """``wait_tiles`` for asyncio: each tile's ready word is awaited through the runtime's
        native word waiter (the event loop never blocks, nothing polls), all within one deadline.
        Arguments are checked before the first await. Cancelling the awaiting task ends the wait.

        Raises:
            As ``wait_tiles``.
        """
        rt, a, b, wait = self._tiles_to_wait(start, stop, timeout)
        await wait_tiles_async(self, rt, a, b, wait)

    def _tiles_to_wait(self, start: int, stop: int | None, timeout: float | None) -> tuple[RuntimeCore, int, int, Wait]:
        rt = self._core()
        given = _args.timeout_or(timeout, rt.timeout)
        n = self.n_tiles
        start = _args.count(start, "start", maximum=n, unit="tiles")
        stop = n if stop is None else _args.count(stop, "stop", maximum=n, unit="tiles")
        if start > stop:
            raise ValueError(f"tiles [{start}, {stop}) of field {self.field!r}: start > stop")
        check_tiling(self, rt)
        return rt, start, stop, tiles_wait(rt, given)

    def wait_rows(self, start: int = 0, stop: int | None = None, timeout: float | None = None) -> None:
        """Block until every tile holding rows ``[start, stop)`` is ready (see ``wait_tiles``).

        Readiness is per tile (``schema.tile_rows`` rows), not per row: a range that ends inside
        a tile waits for that whole tile (with 64-row tiles, rows ``[0, 100)`` wait for tiles 0
        and 1, rows 0-127). ``timeout``: seconds (default the runtime's ``timeout``, 30 s unless
        set).

        Raises:
            As ``wait_tiles`` (its timeout names the tile, and the rows it holds).
        """
        rt, a, b, wait = self._rows_to_wait(start, stop, timeout)
        if a < b:
            wait_tiles(self, rt, a, b, wait)

    async def wait_rows_async(self, start: int = 0, stop: int | None = None, timeout: float | None = None) -> None:
        """``wait_rows`` for asyncio (see ``wait_tiles_async``).

        Raises:
            As ``wait_tiles``.
        """
        rt, a, b, wait = self._rows_to_wait(start, stop, timeout)
        if a < b:
            await wait_tiles_async(self, rt, a, b, wait)

    def _rows_to_wait(self, start: int, stop: int | None, timeout: float | None) -> tuple[RuntimeCore, int, int, Wait]:
        sc = self.schema
        start, stop = _check_rows(sc, start, stop)
        rt = self._core()
        given = _args.timeout_or(timeout, rt.timeout)
        r = sc.tiles_of_rows(start, stop)
        if len(r):
            check_tiling(self, rt)
        return rt, r.start, r.stop, tiles_wait(rt, given)

    def rows_ready(self, start: int = 0, stop: int | None = None) -> bool:
        """Whether every tile holding rows ``[start, stop)`` is ready now (no wait)."""
        sc = self.schema
        start, stop = _check_rows(sc, start, stop)
        rt = self._core()
        check_tiling(self, rt)
        return all(rt.is_ready(self.spec, t) for t in sc.tiles_of_rows(start, stop))

    def get_rows(self, start: int = 0, stop: int | None = None, *, wait: bool = True,
                 timeout: float | None = None, out: Any = None) -> np.ndarray:
        """Copy rows ``[start, stop)`` here (shape ``(stop - start, *shape[1:])``, the field's
        dtype), first waiting for the whole tiles that hold them when ``wait`` (at most
        ``timeout`` s, default the runtime's ``timeout``, 30 s unless set; see ``wait_rows``).
        Blocking.

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


# -- tile waits (one field, or a set's fields under one deadline) --------------------------------------
def check_tiling(ref: FieldRef, rt: RuntimeCore) -> None:
    """The ready words ``ref`` waits on or marks must be the window's own: a FieldRef whose
    ``tile_rows`` disagrees with the window's tiling (a corrupted or hand-built one) would wait
    for too few tiles and read rows that are not ready. Raises ValueError."""
    info = rt.resolve(ref.spec).info
    n = ref.n_tiles
    if info.n_ready != max(1, n) or (n > 1 and info.tile_bytes != ref.tile_bytes):
        raise ValueError(f"field {ref.field!r}: tile_rows={ref.tile_rows} gives {n} tiles of "
                         f"{ref.tile_bytes} B, but {ref.spec.label} has {info.n_ready} ready words "
                         f"of {info.tile_bytes} B")


def tiles_wait(rt: RuntimeCore, timeout: float) -> Wait:
    """The deadline of a wait for tiles (one or several fields' ``wait_tiles``)."""
    return Wait("tiles of fields", timeout, telemetry=rt.telemetry, state="not ready")


def wait_tiles(ref: FieldRef, rt: RuntimeCore, start: int, stop: int, wait: Wait) -> None:
    """Wait for tiles ``[start, stop)`` of ``ref``, each a word wait within ``wait``'s deadline.

    Raises:
        MemsemTimeoutError: names the field, the window, the first tile not ready and the
        timeout. As ``wait_tile``.
    """
    for t in range(start, stop):
        try:
            rt.wait_tile(ref.spec, t, wait.left())
        except MemsemTimeoutError as exc:
            raise _tile_timeout(ref, t, start, stop, wait) from exc


async def wait_tiles_async(ref: FieldRef, rt: RuntimeCore, start: int, stop: int, wait: Wait) -> None:
    """``wait_tiles`` for asyncio: each tile awaited on the runtime's native word waiter."""
    for t in range(start, stop):
        try:
            await rt.wait_tile_async(ref.spec, t, wait.left())
        except MemsemTimeoutError as exc:
            raise _tile_timeout(ref, t, start, stop, wait) from exc


def _tile_timeout(ref: FieldRef, t: int, start: int, stop: int, wait: Wait) -> MemsemTimeoutError:
    a, b = ref.schema.rows_of_tile(t)
    return MemsemTimeoutError(
        f"field {ref.field!r} ({ref.spec.label}): tile {t} (rows [{a}, {b})) not ready "
        f"after {wait.timeout:g} s (waiting for tiles [{start}, {stop}))",
        what=f"tile {t} of field {ref.field!r}", timeout=wait.timeout)


__all__ = ["FIELD_MAGIC", "FieldRef", "FieldSchema", "RowsWritten", "WireReader", "check_tiling", "tiles_wait",
           "wait_tiles", "wait_tiles_async"]
