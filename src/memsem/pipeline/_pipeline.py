"""The double-buffer pipeline: move tile i+1 while the caller computes tile i.

A :class:`Pipeline` iterates the tiles of a ref. The caller moves tile 0 itself (its first
``next()`` would wait for it anyway); the later tiles are moved ahead by a *mover*
(:mod:`memsem.pipeline._movers`: a native copy worker on the same node, a Python thread on other
routes) into ``depth`` staging slots (tile i in slot ``i % depth``) while the caller computes.

A tile's slot is reused only after the caller released the tile: leaving ``with tile:``,
advancing the iterator, or closing the pipeline (also when the caller raised). Any outcome of
the native mover but a plain success (a write section open, a moved generation, a closed
resolution, an expired lease, a dead owner) ends its run at that tile; the caller then moves the
tile itself through the runtime's general path, which waits, retries or raises exactly as
``get`` does, and starts a new run at the next tile. The mover's worker is joined at close (and
by the runtime's close); until it is joined, the pipeline keeps alive everything it touches
(the resolution and its mappings, the staging memory or ``out``, the lease's slot).

Where the route allows ``view()`` (same process, or a shared segment on the same node) the
pipeline hands out views of the window and moves nothing.

How the ref is cut into tiles, and why: :mod:`memsem.pipeline._tiling`.

This layer works on :class:`memsem.gva.RefSpec` through :class:`memsem.core.RuntimeCore`;
``memsem.Runtime.pipeline(ref, ...)`` is the user-facing entry point.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from typing import Any

import numpy as np

from memsem import _args, _dtypes, native
from memsem._buffers import as_byte_array
from memsem._errors import MemsemError, MemsemTimeoutError, NotSupportedError, RuntimeClosedError
from memsem.core import Lease, RuntimeCore
from memsem.core import _translate as tr
from memsem.gva import RefSpec
from memsem.pipeline import _tiling
from memsem.pipeline._movers import POLL_S, NativeMover, ThreadMover, mover_pool, reap_unjoined, wait_ready
from memsem.pipeline._stats import PipelineStats, Summary, overlap

log = logging.getLogger(__name__)

#: extra time the caller waits beyond ``timeout`` so the mover's own, more precise, error wins
CALLER_GRACE_S = 0.5
#: default look-ahead (staging slots)
DEFAULT_DEPTH = 2

_STATUS = tr.RC_STATUS
_ATTN = tr.RC_ATTENTION
_SHIFT = tr.RC_SHIFT
_WAITING = native.lib.MEMSEM_PIPE_WAITING
_IDLE = native.lib.MEMSEM_PIPE_IDLE
_TIMEOUT = native.lib.MEMSEM_PIPE_TIMEOUT
_YOURS = native.lib.MEMSEM_PIPE_YOURS
_perf = time.perf_counter
_U8 = np.dtype(np.uint8)


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

    __slots__ = ("index", "offset", "nbytes", "rows", "_array", "_raw", "_pipe", "_released", "_t_out")

    def __init__(self, pipe: "Pipeline", index: int, offset: int, nbytes: int, raw: np.ndarray,
                 array: np.ndarray, rows: tuple[int, int] | None, t_out: float) -> None:
        self.index, self.offset, self.nbytes, self.rows = index, offset, nbytes, rows
        self._raw, self._array, self._pipe = raw, array, pipe
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
        """Hand the slot back to the mover. Safe twice; any thread."""
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
        tile_bytes: bytes per tile (the last tile may be shorter), honoured as given (see
            ``explanation`` for what it costs). None: the window's ready-word tile size when it
            was published with tiles, else an automatic choice (``auto_tiles``: one tile when
            the ref is too small for overlap to pay).
        depth: staging slots (>= 1; 2 = double buffer; None: ``DEFAULT_DEPTH``). The mover runs
            at most ``depth`` tiles ahead of the tiles the caller released. Staging memory
            (``depth * tile_bytes``, at most one slot per tile and no slot larger than the ref)
            comes from the runtime's pool (page aligned, faulted in once); no per-tile allocation.
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
    p: ...``; ``close()`` stops the mover and releases everything (safe twice). Errors
    (StaleReferenceError, PeerLostError, MemsemTimeoutError, LeaseExpiredError...) are raised in
    the caller at the tile they concern, and stick. ``stats`` gives a :class:`PipelineStats`.

    Thread safety: one caller thread iterates; ``Tile.release`` may be called from any thread.
    """

    __slots__ = ("runtime", "spec", "depth", "timeout", "route", "wait_ready", "mode", "tile_bytes", "n_tiles",
                 "_t0", "_lease", "_window_tile_bytes", "_n_ready", "_dtype", "_row_bytes", "_why",
                 "_n_slots", "_slot_bytes", "_base", "_slots", "_slot_mem", "_out", "_mover", "_mover_kind",
                 "_next", "_current", "_held", "_held_lock", "_closed", "_finished", "_failed", "_t_first",
                 "_t_end", "_caller_wait_s", "_caller_ready_s", "_caller_move_s", "_caller_bytes", "_caller_tiles", "_counted", "_moves",
                 "_computes", "_recorded", "_finalizer", "__weakref__")

    def __init__(self, runtime: RuntimeCore, spec: Any, *, tile_bytes: int | None = None,
                 depth: int | None = None, wait_ready: bool | None = None, timeout: float | None = None,
                 zero_copy: bool | None = None, out: Any = None, lease: Lease | None = None) -> None:
        self._t0 = _perf()
        if not isinstance(runtime, RuntimeCore):
            runtime = getattr(runtime, "core", runtime)  # a memsem.Runtime holds its core
            if not isinstance(runtime, RuntimeCore):
                raise TypeError(f"runtime must be a memsem runtime, got {type(runtime).__name__}")
        if not isinstance(spec, RefSpec):
            spec = getattr(spec, "spec", spec)
            if not isinstance(spec, RefSpec):
                raise TypeError(f"spec must be a RefSpec or a ref, got {type(spec).__name__}")
        depth = DEFAULT_DEPTH if depth is None or (type(depth) is int and depth >= 1) and depth == DEFAULT_DEPTH \
            else _args.count(depth, "depth", minimum=1, unit="staging slots")
        timeout = runtime.timeout if timeout is None else _args.timeout(timeout, "timeout", positive=True)
        if zero_copy is not None and not isinstance(zero_copy, bool):
            raise TypeError(f"zero_copy must be None, True or False, got {zero_copy!r}")
        if wait_ready is not None and not isinstance(wait_ready, bool):
            raise TypeError(f"wait_ready must be None, True or False, got {wait_ready!r}")
        if zero_copy and out is not None:
            raise ValueError("zero_copy=True and out= exclude each other: views move nothing into out")
        if tile_bytes is not None:
            tile_bytes = _args.count(tile_bytes, "tile_bytes", minimum=1, unit="bytes")
        if lease is not None and lease.spec.gva != spec.gva:
            raise ValueError(f"lease is for {lease.spec.label}, not {spec.label}")
        self.runtime = runtime
        self.spec = spec
        self.depth = int(depth)
        self.timeout = float(timeout)
        self._lease = lease
        res = runtime.resolve(spec)
        route = self.route = res.route
        info = res.info
        has_ready = info.n_ready > 0 and info.tile_bytes > 0
        if wait_ready is None:
            wait_ready = has_ready
        elif wait_ready and not has_ready:
            raise ValueError(f"wait_ready=True but {spec.label} was published without tiles "
                             "(no ready words); publish with tile_bytes= or tiles=")
        self.wait_ready = bool(wait_ready)
        self._window_tile_bytes = info.tile_bytes
        self._n_ready = info.n_ready

        dtype = self._dtype = _dtypes.numpy_dtype(spec.dtype_code)
        shape = spec.shape
        self._row_bytes = math.prod(shape[1:]) * dtype.itemsize if len(shape) >= 1 else dtype.itemsize

        if zero_copy is None:
            zero_copy = out is None and route.zero_copy
        elif zero_copy and not route.zero_copy:
            raise NotSupportedError(f"zero_copy=True but route {route.kind} to {spec.label} cannot "
                                    f"map the window ({route.reason})")
        self.mode = "view" if zero_copy else ("out" if out is not None else "staged")

        why = "auto"
        if tile_bytes is not None:
            why = "tile_bytes given"
        elif has_ready:
            tile_bytes, why = info.tile_bytes, "the window's own tiles"
        elif self.mode == "view" or spec.nbytes == 0:
            tile_bytes, why = max(1, spec.nbytes), "view" if spec.nbytes else "empty"
        else:
            tile_bytes = _tiling.choose_tiles(spec.nbytes, route.alpha, route.beta, self._row_bytes, dtype.itemsize)[0]
        self.tile_bytes = int(tile_bytes)
        self.n_tiles = -(-spec.nbytes // self.tile_bytes) if spec.nbytes else 1
        self._why = why
        # Staging never exceeds what the ref can fill: at most one slot per tile, and a slot no
        # larger than the ref (a tile_bytes or depth far above the ref's size costs nothing).
        self._n_slots = min(self.depth, max(1, self.n_tiles))
        self._slot_bytes = max(1, min(self.tile_bytes, spec.nbytes))

        self._base: np.ndarray | None = None
        self._slots: np.ndarray | None = None
        self._slot_mem: np.ndarray | None = None
        self._out = out
        if self.mode == "view":
            arr = runtime.view_spec(spec, lease=lease)
            self._base = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
        elif self.mode == "out":
            flat, binfo = as_byte_array(out, "out", writable=True)
            if binfo.nbytes != spec.nbytes:
                raise ValueError(f"out holds {binfo.nbytes} bytes; the ref is {spec.nbytes} bytes")
            self._base = flat
        else:
            self._slot_mem = runtime.staging.borrow(self._n_slots * self._slot_bytes)
            self._slots = self._slot_mem.reshape(self._n_slots, self._slot_bytes)

        self._mover: NativeMover | ThreadMover | None = None
        self._mover_kind = "none" if self.mode == "view" else "caller"
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
        self._caller_ready_s = 0.0
        self._caller_move_s = 0.0
        self._caller_bytes = 0
        self._caller_tiles = 0
        self._counted: tuple[float, float, float, int] = (0.0, 0.0, 0.0, 0)  # of a mover dropped
        self._moves: list[tuple[float, float]] = []
        self._computes: list[tuple[float, float]] = []
        self._recorded = False
        self._finalizer: weakref.finalize | None = None

    # -- geometry --------------------------------------------------------------------------------
    @property
    def explanation(self) -> str:
        """Why this tile count, and what each tile costs (also in ``stats.explanation``)."""
        why, r = self._why, self.route
        if why == "auto":
            return _tiling.explain_auto(self.spec.nbytes, self.tile_bytes, self.n_tiles, r.alpha, r.beta)
        if why == "view":
            return "one tile: nothing moves (views of the window); pass tile_bytes= for smaller tiles"
        if why == "empty":
            return "one tile: the ref is empty"
        return _tiling.explain_given(self.tile_bytes, self.n_tiles, r.alpha, r.beta, why)

    def __len__(self) -> int:
        return self.n_tiles

    def tile_range(self, index: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of tile ``index`` within the ref."""
        index = _args.index(index, "index", self.n_tiles, of=f"the tiles of {self.spec.label}")
        off = index * self.tile_bytes
        return off, min(self.tile_bytes, self.spec.nbytes - off)

    def _ready_plan(self, index: int) -> range:
        """Window tiles (ready words) that pipeline tile ``index`` overlaps."""
        return _tiling.ready_words(self.spec.offset, self.spec.nbytes, self.tile_bytes, self._window_tile_bytes,
                            self._n_ready, index)

    def _typed(self, raw: np.ndarray, off: int, n: int) -> tuple[np.ndarray, tuple[int, int] | None]:
        rb = self._row_bytes
        shape = self.spec.shape
        if rb == 1 and len(shape) == 1:  # uint8-like 1-D ref: the bytes are the rows
            return (raw if self._dtype is _U8 else raw.view(self._dtype)), (off, off + n)
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
        index = self._next
        if index >= self.n_tiles:
            self._finish()
            raise StopIteration
        if self._closed:
            raise MemsemError(f"pipeline over {self.spec.label} is closed (tile {index} of "
                              f"{self.n_tiles} not delivered)")
        t0 = _perf()
        off = index * self.tile_bytes
        n = min(self.tile_bytes, self.spec.nbytes - off)
        try:
            if self.mode == "view":
                if self.wait_ready:
                    self._caller_ready(index)
                raw = self._base[off:off + n]
            else:
                if index == 0:
                    self._move_here(0, off, n)
                    if self.n_tiles > 1:
                        self._start_mover()
                elif self._mover is None:
                    self._move_here(index, off, n)
                else:
                    self._from_mover(index, off, n)
                raw = self._slots[index % self._n_slots, :n] if self._slots is not None else self._base[off:off + n]
        except BaseException as exc:
            self._failed = exc
            self.close()
            raise
        t1 = _perf()
        self._caller_wait_s += t1 - t0
        if self._t_first is None:
            self._t_first = t1
        arr, rows = self._typed(raw, off, n)
        tile = Tile(self, index, off, n, raw, arr, rows, t1)
        with self._held_lock:
            self._held += 1
        self._current = tile
        self._next = index + 1
        return tile

    def _caller_ready(self, index: int) -> None:
        t = _perf()
        wait_ready(self.runtime, self.spec, self._ready_plan(index), index, self.timeout, self._is_closed)
        self._caller_ready_s += _perf() - t

    def _move_here(self, index: int, off: int, n: int) -> None:
        """The caller moves tile ``index`` itself, through the runtime's general path (its waits,
        retries and errors are those of ``get``)."""
        if self.wait_ready:
            self._caller_ready(index)
        dst = self._slots[index % self._n_slots, :n] if self._slots is not None else self._base[off:off + n]
        t = _perf()
        self.runtime.transfers.get_range(self.spec, off, dst, self._lease)
        t1 = _perf()
        self._caller_move_s += t1 - t
        self._caller_bytes += n
        self._caller_tiles += 1
        self._moves.append((t, t1))

    def _start_mover(self) -> None:
        reap_unjoined()
        res = self.runtime.resolve(self.spec)
        if res.direct:
            ready = None
            if self.wait_ready:
                if not (res.own_cb or res.peer.is_self) and res.peer.pidfd < 0:
                    self._mover_kind = "caller"  # nothing native can watch the owner's liveness
                    return
                ready = (res.cb.ready_addr(0), self._window_tile_bytes, self._n_ready)
            dst = self._slot_mem if self._slot_mem is not None else self._base
            slot_bytes = self._slot_bytes if self._slot_mem is not None else 0
            mover: Any = NativeMover(mover_pool(self.runtime), res, self.spec, self.tile_bytes, self.n_tiles,
                                     self._n_slots, dst, slot_bytes, self._lease, ready, self.timeout)
        else:
            mover = ThreadMover(self.runtime, self.spec, self.tile_bytes, self.n_tiles, self._n_slots, self._slots,
                                self._base, self._ready_plan if self.wait_ready else None, self.timeout,
                                self._lease)
        self.runtime.children.add(self)  # the runtime closes its pipelines before it unmaps anything
        self._finalizer = weakref.finalize(self, mover.shutdown, self.timeout)
        self._mover = mover
        self._mover_kind = mover.kind
        self._restart(1, res)

    def _restart(self, first: int, res: Any) -> None:
        """Hand tiles ``first..`` to the mover; without one (the pool takes no run) the caller
        moves them itself."""
        if not self._mover.start(first, res):
            self._finalizer.detach()
            self._mover.shutdown(self.timeout)
            self._counted = self._mover.counters()
            self._mover = None
            self._mover_kind = "caller"

    def _from_mover(self, index: int, off: int, n: int) -> None:
        mover = self._mover
        if mover.kind == "thread":
            got = self._wait_thread(index)
            if got != index:  # cannot happen: the mover delivers in order
                raise MemsemError(f"pipeline over {self.spec.label} delivered tile {got}, expected {index}")
            self._moves.append(mover.interval(index))
            return
        if mover.forked:
            raise RuntimeClosedError(f"pipeline over {self.spec.label} belongs to pid {mover.owner_pid}; this "
                                     "process was forked from it and has no copy workers")
        rc = mover.wait(index, 0.0)
        if rc == _WAITING:
            rc = self._wait_native(index)
        if rc == _YOURS:  # the worker had not started this tile (late, descheduled): copy it here
            self._move_here(index, off, n)
            return
        if rc & _ATTN:
            self._native_outcome(index, off, n, rc)
            return
        self._moves.append(mover.interval(index))

    def _wait_native(self, index: int) -> int:
        return self._wait_mover(index, lambda: self._mover.wait(index, POLL_S), _WAITING)

    def _wait_mover(self, index: int, poll: Any, waiting: Any) -> Any:
        """Poll the mover for tile ``index`` (``poll()`` blocks at most POLL_S) until it gives
        something other than ``waiting``; bounded by the pipeline's timeout plus a grace."""
        deadline = time.monotonic() + self.timeout + CALLER_GRACE_S
        while True:
            got = poll()
            if got != waiting:
                return got
            if self._closed:
                raise MemsemError(f"pipeline over {self.spec.label} was closed")
            if time.monotonic() >= deadline:
                raise MemsemTimeoutError(
                    f"pipeline over {self.spec.label}: tile {index} not delivered after "
                    f"{self.timeout + CALLER_GRACE_S:.2f} s", what=f"tile {index} of {self.spec.label}",
                    timeout=self.timeout)

    def _native_outcome(self, index: int, off: int, n: int, rc: int) -> None:
        """The native mover handed over tile ``index`` with anything but a plain success."""
        mover = self._mover
        res = mover.res
        status = rc & _STATUS
        if rc & tr.RC_LAST_OUT:
            res.release()
        if status == tr.OK:
            self._moves.append(mover.interval(index))
            if rc & tr.RC_CHECK_PEER:
                res.peer_checked()  # PeerLostError when the owner died
            if rc & tr.RC_LAST_OUT:  # the run ended after this tile: go on with a new one
                mover.join_run(self.timeout)
                if index + 1 < self.n_tiles:
                    self._restart(index + 1, self.runtime.resolve(self.spec))
            return
        if status == _TIMEOUT:
            w = rc >> _SHIFT
            self.runtime.telemetry.count_error("timeout")
            raise MemsemTimeoutError(
                f"pipeline tile {index} of {self.spec.label}: ready word of window tile {w} not "
                f"set after {self.timeout} s", what=f"tile {w} of {self.spec.label}", timeout=self.timeout)
        if status == _IDLE:
            if self._closed:
                raise MemsemError(f"pipeline over {self.spec.label} was closed")
        else:
            mover.join_run(self.timeout)
        # The general path decides: it waits (write section), re-resolves (closed resolution)
        # or raises the error of a get (stale, lease expired, peer lost...).
        self._move_here(index, off, n)
        if index + 1 < self.n_tiles:
            self._restart(index + 1, self.runtime.resolve(self.spec))

    def _wait_thread(self, index: int) -> int:
        return self._wait_mover(index, lambda: self._mover.wait(index, POLL_S), None)

    def _release(self, tile: Tile) -> None:
        t = _perf()
        with self._held_lock:
            self._held -= 1
            self._computes.append((tile._t_out, t))
        mover = self._mover
        if mover is not None:
            mover.release()
        if self._current is tile:
            self._current = None
        if tile.index == self.n_tiles - 1 and self._t_end is None:
            self._t_end = t

    @property
    def mover_running(self) -> bool:
        """True while this pipeline's mover (native worker or thread) runs; False once closed."""
        return self._mover is not None and self._mover.running()

    @property
    def tiles_held(self) -> int:
        """Tiles handed out and not yet released (0 or 1 with the iterator protocol)."""
        return self._held

    @property
    def free_slots(self) -> int:
        """Staging slots holding no tile the caller may still read nor one moved ahead for it
        (approximate while the mover runs)."""
        if self.mode == "view":
            return 0
        mover = self._mover
        if mover is None:
            return self._n_slots - self._held
        return max(0, self._n_slots - self._held - max(0, mover.done - self._next))

    # -- lifetime --------------------------------------------------------------------------------
    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            if self._t_end is None:
                self._t_end = _perf()
            self.close()

    def close(self) -> None:
        """Stop the mover and join it (bounded by ``timeout``: it ends after the copy in
        progress), release the held tile and the view (its lease goes when no tile array
        references it). Safe twice."""
        if self._closed:
            return
        self._closed = True
        if self._current is not None:
            self._current.release()
            self._current = None
        if self._t_end is None:
            self._t_end = _perf()
        mover = self._mover
        joined = True
        if mover is not None:
            fin = self._finalizer
            if fin is not None:
                fin.detach()
            joined = mover.shutdown(self.timeout)
        self._base = None if self.mode == "view" else self._base
        if self._slot_mem is not None and joined:
            self.runtime.staging.give_back(self._slot_mem)  # a stuck mover keeps its slots
            self._slot_mem = None
        self._record()

    def _record(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        try:
            self.runtime.telemetry.record_pipeline(self._summary())
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
        return self._stats(explain=True)

    def _stats(self, *, explain: bool) -> PipelineStats:
        now = _perf()
        end = self._t_end if self._t_end is not None else now
        with self._held_lock:
            computes = list(self._computes)
        moves = list(self._moves)
        m_move, m_ready, m_hold, m_bytes = self._counted if self._mover is None else self._mover.counters()
        move_s = self._caller_move_s + m_move
        return PipelineStats(
            tiles=self.n_tiles, delivered=self._next, tile_bytes=self.tile_bytes, depth=self.depth,
            mode=self.mode, route=self.route.kind,
            first_tile_s=None if self._t_first is None else self._t_first - self._t0,
            total_s=end - self._t0, move_s=move_s, ready_wait_s=self._caller_ready_s + m_ready,
            caller_hold_s=m_hold, caller_wait_s=self._caller_wait_s,
            compute_s=sum(b - a for a, b in computes), overlap_ratio=overlap(moves, computes, move_s),
            bytes_moved=self._caller_bytes + m_bytes, mover=self._mover_kind, caller_tiles=self._caller_tiles,
            explanation=self.explanation if explain else "")

    def _summary(self) -> Summary:
        m_move, m_ready, _, m_bytes = self._counted if self._mover is None else self._mover.counters()
        move_s = self._caller_move_s + m_move
        with self._held_lock:
            computes = list(self._computes)
        return Summary(self._next, self._caller_bytes + m_bytes, move_s, self._caller_wait_s,
                       self._caller_ready_s + m_ready, overlap(self._moves, computes, move_s),
                       None if self._t_first is None else self._t_first - self._t0)

    def _is_closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"at tile {self._next}/{self.n_tiles}"
        return f"<Pipeline {self.mode} over {self.spec.label} tile_bytes={self.tile_bytes} depth={self.depth} {state}>"
