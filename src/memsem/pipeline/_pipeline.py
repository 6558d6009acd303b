"""The double-buffer pipeline: move tile i+1 while the caller computes tile i.

A :class:`Pipeline` iterates the tiles of a ref. A background thread (the *mover*) waits for a
free staging slot, waits for the tile's ready words where the window has them, and copies the
tile into the slot (numpy/native copies release the GIL, so the copy runs while the caller
computes). The caller gets :class:`Tile` objects; a tile's slot is handed back to the mover only
when the caller released it: leaving ``with tile:``, advancing the iterator, or closing the
pipeline (also when the caller raised). Where the route allows ``view()`` (same process, or a
shared segment on the same node) the pipeline hands out views of the window and moves nothing.

This layer works on :class:`memsem.gva.RefSpec` through :class:`memsem.runtime.RuntimeCore`;
``memsem.Runtime.pipeline(ref, ...)`` is the user-facing entry point.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from memsem import _args, _dtypes
from memsem._buffers import as_byte_array
from memsem._errors import MemsemError, MemsemTimeoutError, NotSupportedError
from memsem.gva import RefSpec
from memsem.runtime import Lease, RuntimeCore

log = logging.getLogger(__name__)

#: how often blocked waits re-check that the pipeline was not closed (seconds)
POLL_S = 0.05
#: extra time the caller waits beyond ``timeout`` so the mover's own, more precise, error wins
CALLER_GRACE_S = 0.5


# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PipelineStats:
    """What one pipeline measured (all times in seconds, from ``time.perf_counter``).

    Attributes:
        tiles: tiles of the ref. delivered: tiles handed to the caller so far.
        tile_bytes: bytes per tile (the last may be shorter). depth: staging slots.
        mode: ``"staged"`` (copies into slots), ``"out"`` (copies into the caller's ``out``) or
            ``"view"`` (zero-copy views of the window, nothing moved).
        route: route kind used to reach the window (e.g. ``host/cma``).
        first_tile_s: from construction to the first tile handed to the caller.
        total_s: from construction to the release of the last tile (or to now / close).
        move_s: time the mover spent copying.
        ready_wait_s: time spent waiting for the producer's ready words (mover, or the caller in
            view mode).
        caller_hold_s: time the mover waited for the caller to release a slot.
        caller_wait_s: time the caller waited in ``next()`` for data.
        compute_s: time the caller held tiles (between hand-out and release).
        overlap_ratio: fraction of ``move_s`` during which the caller was computing on another
            tile (1.0 = every copy hidden behind compute; 1.0 when nothing was moved).
        bytes_moved: bytes copied by the mover (0 in view mode).
    """

    tiles: int
    delivered: int
    tile_bytes: int
    depth: int
    mode: str
    route: str
    first_tile_s: float | None
    total_s: float
    move_s: float
    ready_wait_s: float
    caller_hold_s: float
    caller_wait_s: float
    compute_s: float
    overlap_ratio: float
    bytes_moved: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        ft = "-" if self.first_tile_s is None else f"{self.first_tile_s * 1e3:.3f} ms"
        return (f"pipeline[{self.mode} {self.route}] {self.delivered}/{self.tiles} tiles of "
                f"{self.tile_bytes} B, depth {self.depth}: first tile {ft}, total "
                f"{self.total_s * 1e3:.1f} ms, moving {self.move_s * 1e3:.1f} ms, waiting for "
                f"producer {self.ready_wait_s * 1e3:.1f} ms, for caller {self.caller_hold_s * 1e3:.1f} ms, "
                f"caller waited {self.caller_wait_s * 1e3:.1f} ms, overlap {self.overlap_ratio:.2f}, "
                f"{self.bytes_moved} B moved")


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Shared:
    """State shared by the caller and the mover thread (holds no reference to the Pipeline, so an
    abandoned pipeline is collected and its finalizer stops the mover)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.move_s = 0.0
        self.ready_wait_s = 0.0
        self.hold_s = 0.0
        self.hold_since = 0.0  # perf_counter when the mover began waiting for a slot, 0 if not
        self.bytes_moved = 0
        self.moves: list[tuple[float, float]] = []


# ----------------------------------------------------------------------------------------------
class Tile:
    """One tile handed out by a :class:`Pipeline`; a context manager that releases its slot.

    Attributes:
        index: tile number (0-based). offset: byte offset of the tile in the ref.
        nbytes: bytes in the tile. rows: ``(start, stop)`` rows of the ref's first dimension when
            the tile covers whole rows, else None.

    ``array`` is valid until the tile is released: after that the mover may overwrite its slot
    (accessing ``array`` of a released tile raises MemsemError). Copy what you keep.
    """

    __slots__ = ("index", "offset", "nbytes", "rows", "_array", "_raw", "_pipe", "_slot", "_released",
                 "_t_out")

    def __init__(self, pipe: "Pipeline", index: int, offset: int, nbytes: int, raw: np.ndarray,
                 array: np.ndarray, rows: tuple[int, int] | None, slot: int, t_out: float) -> None:
        self.index, self.offset, self.nbytes, self.rows = index, offset, nbytes, rows
        self._raw, self._array, self._pipe, self._slot = raw, array, pipe, slot
        self._released = False
        self._t_out = t_out

    @property
    def array(self) -> np.ndarray:
        """The tile's data: ``(rows, *shape[1:])`` of the ref's dtype when the tile covers whole
        rows, a 1-D array of the dtype when it starts and ends on element boundaries, else flat
        uint8. Read-only in view mode over a read-only ref."""
        if self._released:
            raise MemsemError(f"tile {self.index} was released; its slot may hold another tile now")
        return self._array

    @property
    def raw(self) -> np.ndarray:
        """The tile's bytes as a flat uint8 array (same lifetime rule as ``array``)."""
        if self._released:
            raise MemsemError(f"tile {self.index} was released; its slot may hold another tile now")
        return self._raw

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Hand the slot back to the mover. Safe twice."""
        if self._released:
            return
        self._released = True
        self._array = self._raw = None  # type: ignore[assignment]
        self._pipe._release(self)

    def __enter__(self) -> "Tile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Tile {self.index} bytes [{self.offset}, {self.offset + self.nbytes}) {state}>"


# ----------------------------------------------------------------------------------------------
class Pipeline:
    """Iterate the tiles of a ref with ``depth`` staging slots: tile i+1.. move while the caller
    computes tile i.

    Args:
        runtime: the consumer's runtime.
        spec: the ref (a RefSpec, or anything with a ``.spec`` RefSpec such as a TensorRef).
        tile_bytes: bytes per tile; default the window's ready-word tile size. The last tile may
            be shorter.
        depth: staging slots (>= 1; 2 = double buffer). The mover runs at most ``depth`` tiles
            ahead of the tiles the caller released. Staging memory (``depth * tile_bytes``, at
            most one slot per tile and no slot larger than the ref) is allocated once; no
            per-tile allocation.
        wait_ready: wait for the window's ready words of each tile before moving it. Default:
            True when the window was published with tiles. The window's tiles need not match
            ``tile_bytes``: a pipeline tile waits for every window tile it overlaps.
        timeout: bound in seconds of every wait for one tile (ready words, data): finite and > 0;
            default the runtime's timeout.
        zero_copy: None (default): hand out views of the window where the route allows it
            (nothing moves); True: require views (NotSupportedError otherwise); False: always copy.
        out: optional destination of the ref's size (numpy array, torch tensor, buffer): tiles
            are copied straight into their place in ``out`` instead of staging slots, and ``out``
            holds the whole ref at the end. ``depth`` still bounds the look-ahead.
        lease: optional held Lease on the window, checked around every copy.

    Iterating yields :class:`Tile` objects. Use as ``with rt.pipeline(ref, ...) as p: for tile in
    p: ...``; ``close()`` stops the mover and releases everything (safe twice). Errors of the mover
    (StaleReferenceError, PeerLostError, MemsemTimeoutError, ...) are re-raised in the caller at
    the tile they concern. ``stats`` gives a :class:`PipelineStats`.

    Thread safety: one caller thread iterates; ``Tile.release`` may be called from any thread.
    """

    def __init__(self, runtime: RuntimeCore, spec: Any, *, tile_bytes: int | None = None, depth: int = 2,
                 wait_ready: bool | None = None, timeout: float | None = None,
                 zero_copy: bool | None = None, out: Any = None, lease: Lease | None = None) -> None:
        self._t0 = time.perf_counter()
        runtime = getattr(runtime, "core", runtime)  # a memsem.Runtime holds its core
        if not isinstance(runtime, RuntimeCore):
            raise TypeError(f"runtime must be a memsem runtime, got {type(runtime).__name__}")
        spec = getattr(spec, "spec", spec)
        if not isinstance(spec, RefSpec):
            raise TypeError(f"spec must be a RefSpec or a ref, got {type(spec).__name__}")
        depth = _args.count(depth, "depth", minimum=1, unit="staging slots")
        timeout = runtime.timeout if timeout is None else _args.timeout(timeout, "timeout", positive=True)
        if zero_copy is not None and not isinstance(zero_copy, bool):
            raise TypeError(f"zero_copy must be None, True or False, got {zero_copy!r}")
        if wait_ready is not None and not isinstance(wait_ready, bool):
            raise TypeError(f"wait_ready must be None, True or False, got {wait_ready!r}")
        if zero_copy and out is not None:
            raise ValueError("zero_copy=True and out= exclude each other: views move nothing into out")
        self.runtime = runtime
        self.spec = spec
        self.depth = int(depth)
        self.timeout = float(timeout)
        self._lease = lease
        res = runtime.resolve(spec)
        self.route = res.route
        info = res.info
        if tile_bytes is None:
            if not info.tile_bytes:
                raise ValueError(f"{spec.label} was published without tiles: pass tile_bytes=")
            tile_bytes = info.tile_bytes
        self.tile_bytes = _args.count(tile_bytes, "tile_bytes", minimum=1, unit="bytes")
        self.n_tiles = -(-spec.nbytes // self.tile_bytes)
        # Staging never exceeds what the ref can fill: at most one slot per tile, and a slot no
        # larger than the ref (a tile_bytes or depth far above the ref's size costs nothing).
        self._n_slots = min(self.depth, max(1, self.n_tiles))
        self._slot_bytes = max(1, min(self.tile_bytes, spec.nbytes))
        has_ready = info.n_ready > 0 and info.tile_bytes > 0
        if wait_ready is None:
            wait_ready = has_ready
        elif wait_ready and not has_ready:
            raise ValueError(f"wait_ready=True but {spec.label} was published without tiles "
                             "(no ready words); publish with tile_bytes= or tiles=")
        self.wait_ready = bool(wait_ready)
        self._window_tile_bytes = info.tile_bytes
        self._n_ready = info.n_ready
        if lease is not None and lease.spec.gva != spec.gva:
            raise ValueError(f"lease is for {lease.spec.label}, not {spec.label}")

        # element view of tiles
        self._dtype = _dtypes.numpy_dtype(spec.dtype_code)
        self._row_bytes = (int(np.prod(spec.shape[1:], dtype=np.int64)) * self._dtype.itemsize
                           if len(spec.shape) >= 1 else self._dtype.itemsize)

        if zero_copy is None:
            zero_copy = out is None and res.route.zero_copy
        elif zero_copy and not res.route.zero_copy:
            raise NotSupportedError(f"zero_copy=True but route {res.route.kind} to {spec.label} cannot "
                                    f"map the window ({res.route.reason})")
        self.mode = "view" if zero_copy else ("out" if out is not None else "staged")

        self._sh = _Shared()
        self._base: np.ndarray | None = None
        self._slots: np.ndarray | None = None
        self._slot_mem: np.ndarray | None = None
        self._out = out
        self._thread: threading.Thread | None = None
        if self.mode == "view":
            arr = runtime.view_spec(spec, lease=lease)
            self._base = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
        elif self.mode == "out":
            flat, binfo = as_byte_array(out, "out", writable=True)
            if binfo.nbytes != spec.nbytes:
                raise ValueError(f"out holds {binfo.nbytes} bytes; the ref is {spec.nbytes} bytes")
            self._base = flat
        else:
            # Pooled per runtime: page-aligned and already faulted in (see StagingPool).
            self._slot_mem = runtime.staging.borrow(self._n_slots * self._slot_bytes)
            self._slots = self._slot_mem.reshape(self._n_slots, self._slot_bytes)
        # Tile 0 is moved by the caller's first next() (it would wait for it anyway, and it saves
        # the thread start and one hand-off from the first-tile latency): slot 0 is the caller's.
        for s in range(0 if self.mode == "view" else 1, self._n_slots):
            self._sh.free.put(s)

        self._next = 0
        self._current: Tile | None = None
        self._held = 0
        self._held_lock = threading.Lock()
        self._closed = False
        self._finished = False
        self._failed: BaseException | None = None
        self._t_first: float | None = None
        self._t_end: float | None = None
        self._caller_wait_s = 0.0
        self._ready_wait_caller_s = 0.0
        self._computes: list[tuple[float, float]] = []
        self._recorded = False
        self._own_move = (0.0, 0, (0.0, 0.0))  # the caller's move of tile 0: seconds, bytes, interval
        self._mover_args: tuple | None = None
        if self.mode != "view" and self.n_tiles > 1:
            # Started by the first next(), right after the caller moved tile 0 (so tile 0 does not
            # share the CPU and memory bus with the mover's tile 1 on small machines).
            self._mover_args = (
                runtime, spec, self.tile_bytes, 1, self.n_tiles, self._slots, self._base, self._sh,
                functools.partial(_ready_words, spec.offset, spec.nbytes, self.tile_bytes,
                                  self._window_tile_bytes, self._n_ready) if self.wait_ready else None,
                self.timeout, lease)
        self._finalizer = weakref.finalize(self, self._sh.stop.set)
        runtime.children.add(self)  # the runtime closes its pipelines before it unmaps anything

    # -- geometry --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n_tiles

    def tile_range(self, index: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of tile ``index`` within the ref."""
        index = _args.index(index, "index", self.n_tiles, of=f"the tiles of {self.spec.label}")
        off = index * self.tile_bytes
        return off, min(self.tile_bytes, self.spec.nbytes - off)

    def _ready_plan(self, index: int) -> range:
        """Window tiles (ready words) that pipeline tile ``index`` overlaps."""
        return _ready_words(self.spec.offset, self.spec.nbytes, self.tile_bytes, self._window_tile_bytes,
                            self._n_ready, index)

    def _typed(self, raw: np.ndarray, off: int, n: int) -> tuple[np.ndarray, tuple[int, int] | None]:
        rb = self._row_bytes
        shape = self.spec.shape
        if len(shape) >= 1 and rb and off % rb == 0 and n % rb == 0:
            r0 = off // rb
            return raw.view(self._dtype).reshape((n // rb,) + tuple(shape[1:])), (r0, r0 + n // rb)
        isz = self._dtype.itemsize
        if off % isz == 0 and n % isz == 0:
            return raw.view(self._dtype), None
        return raw, None

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> "Pipeline":
        return self

    def __next__(self) -> Tile:
        if self._failed is not None:
            raise self._failed
        if self._current is not None:
            self._current.release()
            self._current = None
        if self._next >= self.n_tiles:
            self._finish()
            raise StopIteration
        if self._closed:
            raise MemsemError(f"pipeline over {self.spec.label} is closed (tile {self._next} of "
                              f"{self.n_tiles} not delivered)")
        index = self._next
        t0 = time.perf_counter()
        try:
            if self.mode == "view":
                slot = self._take_slot_view(index)
                off, n = self.tile_range(index)
                raw = self._base[off:off + n]
            else:
                if index == 0:
                    slot = 0
                    off, n = self.tile_range(0)
                    self._move_first(off, n)
                    self._start_mover()
                else:
                    _, slot, _ = self._wait_item(index)
                    off, n = self.tile_range(index)
                raw = self._slots[slot, :n] if self.mode == "staged" else self._base[off:off + n]
        except BaseException as exc:
            self._failed = exc
            self.close()
            raise
        t1 = time.perf_counter()
        self._caller_wait_s += t1 - t0
        if self._t_first is None:
            self._t_first = t1
        arr, rows = self._typed(raw, off, n)
        tile = Tile(self, index, off, n, raw, arr, rows, slot, t1)
        with self._held_lock:
            self._held += 1
        self._current = tile
        self._next = index + 1
        return tile

    def _take_slot_view(self, index: int) -> int:
        if self.wait_ready:
            t = time.perf_counter()
            _wait_ready(self.runtime, self.spec, self._ready_plan(index), index, self.timeout, self._sh.stop)
            self._ready_wait_caller_s += time.perf_counter() - t
        return -1

    def _start_mover(self) -> None:
        if self._mover_args is not None and self._thread is None and not self._closed:
            spec = self.spec
            self._thread = threading.Thread(target=_mover, args=self._mover_args, daemon=True,
                                            name=f"memsem-pipeline-{spec.name or hex(spec.gva)}")
            self._mover_args = None
            self._thread.start()

    def _move_first(self, off: int, n: int) -> None:
        if self.wait_ready:
            t = time.perf_counter()
            _wait_ready(self.runtime, self.spec, self._ready_plan(0), 0, self.timeout, self._sh.stop)
            self._ready_wait_caller_s += time.perf_counter() - t
        dst = self._slots[0, :n] if self.mode == "staged" else self._base[off:off + n]
        t = time.perf_counter()
        self.runtime.transfer(self.spec, "get", off, dst, lease=self._lease)
        t1 = time.perf_counter()
        self._own_move = (t1 - t, n, (t, t1))

    def _wait_item(self, index: int) -> tuple[int, int, float]:
        try:
            item = self._sh.ready.get(timeout=self.timeout + CALLER_GRACE_S)
        except queue.Empty:
            raise MemsemTimeoutError(
                f"pipeline over {self.spec.label}: tile {index} not delivered after "
                f"{self.timeout + CALLER_GRACE_S:.2f} s", what=f"tile {index} of {self.spec.label}",
                timeout=self.timeout) from None
        if isinstance(item, _Failure):
            raise item.exc
        if item[0] != index:  # cannot happen: the mover delivers in order
            raise MemsemError(f"pipeline over {self.spec.label} delivered tile {item[0]}, expected {index}")
        return item

    def _release(self, tile: Tile) -> None:
        t = time.perf_counter()
        with self._held_lock:
            self._held -= 1
            self._computes.append((tile._t_out, t))
        if tile._slot >= 0:
            self._sh.free.put(tile._slot)
        if self._current is tile:
            self._current = None
        if tile.index == self.n_tiles - 1 and self._t_end is None:
            self._t_end = t

    @property
    def tiles_held(self) -> int:
        """Tiles handed out and not yet released (0 or 1 with the iterator protocol)."""
        return self._held

    @property
    def free_slots(self) -> int:
        """Staging slots not holding a tile the caller may still read (approximate while the
        mover runs)."""
        return self._sh.free.qsize()

    # -- lifetime --------------------------------------------------------------------------------
    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            if self._t_end is None:
                self._t_end = time.perf_counter()
            self.close()

    def close(self) -> None:
        """Stop the mover (waiting for a copy in progress, bounded by ``timeout``), release the
        held tile and the view (its lease goes when no tile array references it). Safe twice."""
        if self._closed:
            return
        self._closed = True
        if self._current is not None:
            self._current.release()
            self._current = None
        if self._t_end is None:
            self._t_end = time.perf_counter()
        self._sh.stop.set()
        th = self._thread
        if th is not None and th.is_alive() and th is not threading.current_thread():
            th.join(self.timeout)
            if th.is_alive():
                log.warning("pipeline mover over %s did not stop within %.1f s", self.spec.label, self.timeout)
        self._base = None if self.mode == "view" else self._base
        if self._slot_mem is not None and (th is None or not th.is_alive()):
            self.runtime.staging.give_back(self._slot_mem)  # a stuck mover keeps its slots
            self._slot_mem = None
        self._record()

    def _record(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        if True:
            try:
                self.runtime.telemetry.record_pipeline(self.stats)
            except Exception:  # telemetry must never break the data path
                log.debug("recording pipeline telemetry failed", exc_info=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- measurement -----------------------------------------------------------------------------
    @property
    def stats(self) -> PipelineStats:
        """A snapshot of what this pipeline measured (see :class:`PipelineStats`)."""
        sh = self._sh
        now = time.perf_counter()
        end = self._t_end if self._t_end is not None else now
        with self._held_lock:
            computes = list(self._computes)
        own_s, own_n, own_iv = self._own_move
        moves = list(sh.moves) + ([own_iv] if own_n else [])
        move_s = sh.move_s + own_s
        overlap = 1.0 if move_s <= 0 else min(1.0, _intersection(moves, computes) / move_s)
        return PipelineStats(
            tiles=self.n_tiles, delivered=self._next, tile_bytes=self.tile_bytes, depth=self.depth,
            mode=self.mode, route=self.route.kind,
            first_tile_s=None if self._t_first is None else self._t_first - self._t0,
            total_s=end - self._t0, move_s=move_s,
            ready_wait_s=sh.ready_wait_s + self._ready_wait_caller_s,
            caller_hold_s=sh.hold_s + ((end - sh.hold_since) if sh.hold_since else 0.0),
            caller_wait_s=self._caller_wait_s, compute_s=sum(b - a for a, b in computes),
            overlap_ratio=overlap, bytes_moved=sh.bytes_moved + own_n)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"at tile {self._next}/{self.n_tiles}"
        return f"<Pipeline {self.mode} over {self.spec.label} tile_bytes={self.tile_bytes} depth={self.depth} {state}>"


# ----------------------------------------------------------------------------------------------
def _ready_words(ref_offset: int, ref_nbytes: int, tile_bytes: int, window_tile_bytes: int, n_ready: int,
                 index: int) -> range:
    """Window tiles (ready words) that pipeline tile ``index`` of a ref overlaps."""
    off = index * tile_bytes
    n = min(tile_bytes, ref_nbytes - off)
    start = ref_offset + off
    first = start // window_tile_bytes
    last = (start + max(n, 1) - 1) // window_tile_bytes
    return range(first, min(last, n_ready - 1) + 1)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two lists of disjoint, sorted intervals."""
    a = sorted(a)
    b = sorted(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _wait_ready(rt: RuntimeCore, spec: RefSpec, words: range, index: int, timeout: float,
                stop: threading.Event) -> None:
    """Wait for every ready word in ``words`` (window tiles), at most ``timeout`` in all, in
    slices of POLL_S so a closed pipeline stops waiting. The runtime's wait checks the owner's
    liveness (PeerLostError) and the generation (StaleReferenceError)."""
    deadline = time.monotonic() + timeout
    for w in words:
        while True:
            if stop.is_set():
                raise MemsemError(f"pipeline over {spec.label} was closed")
            left = deadline - time.monotonic()
            try:
                rt.wait_tile(spec, w, timeout=max(0.0, min(POLL_S, left)))
                break
            except MemsemTimeoutError:
                if time.monotonic() >= deadline:
                    raise MemsemTimeoutError(
                        f"pipeline tile {index} of {spec.label}: ready word of window tile {w} not "
                        f"set after {timeout} s", what=f"tile {w} of {spec.label}", timeout=timeout) from None


def _mover(rt: RuntimeCore, spec: RefSpec, tile_bytes: int, start: int, n_tiles: int,
           slots: np.ndarray | None, out: np.ndarray | None, sh: _Shared, ready_plan: Any, timeout: float,
           lease: Lease | None) -> None:
    """Background thread: for tiles ``start..n_tiles-1``, take a free slot, wait for the ready
    words, copy, hand over."""
    perf = time.perf_counter
    try:
        for i in range(start, n_tiles):
            t0 = perf()
            try:
                slot = sh.free.get_nowait()
            except queue.Empty:
                sh.hold_since = t0
                while True:
                    if sh.stop.is_set():
                        return
                    try:
                        slot = sh.free.get(timeout=POLL_S)
                        break
                    except queue.Empty:
                        continue
            t1 = perf()
            sh.hold_s += t1 - t0
            sh.hold_since = 0.0
            if ready_plan is not None:
                _wait_ready(rt, spec, ready_plan(i), i, timeout, sh.stop)
            t2 = perf()
            sh.ready_wait_s += t2 - t1
            off = i * tile_bytes
            n = min(tile_bytes, spec.nbytes - off)
            dst = slots[slot, :n] if slots is not None else out[off:off + n]
            rt.transfer(spec, "get", off, dst, lease=lease)
            t3 = perf()
            sh.move_s += t3 - t2
            sh.moves.append((t2, t3))
            sh.bytes_moved += n
            if sh.stop.is_set():
                return
            sh.ready.put((i, slot, t3))
    except BaseException as exc:  # handed to the caller, re-raised at the tile it concerns
        if not sh.stop.is_set():
            sh.ready.put(_Failure(exc))
