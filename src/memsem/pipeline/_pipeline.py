"""The double-buffer pipeline: move tile i+1 while the caller computes tile i.

A :class:`Pipeline` iterates the tiles of a ref. The caller moves tile 0 itself (its first
``next()`` would wait for it anyway); the later tiles are moved ahead by a *mover*
(:mod:`memsem.pipeline._movers`: a native copy worker on the same node, a Python thread on other
routes) into ``depth`` staging slots (tile i in slot ``i % depth``) while the caller computes.
The caller's side of that, and why the caller never waits long for a mover that does not run:
:mod:`memsem.pipeline._handoff`. How the ref is cut into tiles: :mod:`memsem.pipeline._tiling`; what a
pipeline decides before it moves anything (kept per resolution): :mod:`memsem.pipeline._plan`.

A tile's slot is reused only after the caller released the tile: leaving ``with tile:``,
advancing the iterator, or closing the pipeline (also when the caller raised). Closing stops the
mover; until its worker has ended, what it uses stays alive (the resolution and its mappings,
the staging memory or ``out``, the lease's slot).

Where the route allows ``view()`` (same process, or a shared segment on the same node) the
pipeline hands out views of the window and moves nothing; with the automatic tiling only where a
view costs less than the copy (:func:`memsem.pipeline._tiling.prefer_view`). A double-buffered
versioned window (``slots=2``) is never viewed (its owner rewrites the slots): it is copied,
each tile of the latest version, or with ``lease=`` a pinned version (``ref.pin()``) every tile
of that version. ``Tile.version`` says which.

This layer works on :class:`memsem.gva.RefSpec` through :class:`memsem.core.RuntimeCore`;
``memsem.Runtime.pipeline(ref, ...)`` is the user-facing entry point.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from memsem import _args
from memsem._buffers import as_byte_array, check_dtype
from memsem._errors import MemsemError
from memsem.core import Lease, RuntimeCore
from memsem.gva import RefSpec
from memsem.pipeline import _tiling
from memsem.pipeline._handoff import Handoff
from memsem.pipeline._movers import reap_unjoined, wait_ready
from memsem.pipeline._plan import DEFAULT_DEPTH, MEMO_LIMIT, Plan
from memsem.pipeline._stats import PipelineStats, overlap

log = logging.getLogger(__name__)


_perf = time.perf_counter
_U8 = np.dtype(np.uint8)


# ----------------------------------------------------------------------------------------------
class Tile:
    """One tile handed out by a :class:`Pipeline`; a context manager that releases its slot.

    Attributes:
        index: tile number (0-based). offset: byte offset of the tile in the ref.
        nbytes: bytes in the tile. rows: ``(start, stop)`` rows of the ref's first dimension when
            the tile covers whole rows, else None.
        version: the window's version whose bytes the tile holds (what its copy read; see
            ``ref.version()``), or None in view mode (views show the window as it is).

    ``array`` is valid until the tile is released: after that the mover may overwrite its slot
    (accessing ``array`` of a released tile raises MemsemError). Copy what you keep.
    """

    __slots__ = ("index", "offset", "nbytes", "rows", "version", "_array", "_raw", "_pipe", "_released", "_t_out")

    def __init__(self, pipe: "Pipeline", index: int, offset: int, nbytes: int, raw: np.ndarray,
                 array: np.ndarray, rows: tuple[int, int] | None, version: int | None, t_out: float) -> None:
        self.index, self.offset, self.nbytes, self.rows, self.version = index, offset, nbytes, rows, version
        self._raw, self._array, self._pipe = raw, array, pipe
        self._released = False
        self._t_out = t_out

    @property
    def array(self) -> np.ndarray:
        """The tile's data: ``(rows, *shape[1:])`` of the ref's dtype when the tile covers whole
        rows, a 1-D array of the dtype when it starts and ends on element boundaries, else flat
        uint8. Read-only in view mode over a read-only ref."""
        a = self._array  # read first: a release by another thread clears it after setting the flag
        if a is None or self._released:
            raise MemsemError(f"tile {self.index} was released; its slot may hold another tile now")
        return a

    @property
    def raw(self) -> np.ndarray:
        """The tile's bytes as a flat uint8 array (same lifetime rule as ``array``)."""
        a = self._raw
        if a is None or self._released:
            raise MemsemError(f"tile {self.index} was released; its slot may hold another tile now")
        return a

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Hand the slot back to the mover. Safe twice; any thread."""
        if not self._released:
            self._pipe._release(self)

    def __enter__(self) -> "Tile":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._released:
            self._pipe._release(self)

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
            the ref is too small for overlap to pay; views only where they cost less than the
            copy, see ``zero_copy``).
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
            (nothing moves) and, with the automatic tiling, where a view (a lease and its
            checks) costs less than copying the ref; a double-buffered versioned window is
            copied. True: require views (NotSupportedError otherwise, also on a double-buffered
            window). False: always copy.
        out: optional destination of the ref's size (numpy array, torch tensor, buffer): tiles
            are copied straight into their place in ``out`` instead of staging slots, and ``out``
            holds the whole ref at the end. ``depth`` still bounds the look-ahead.
        lease: optional held Lease on the window, checked around every copy. A pinned lease
            (``ref.pin()``: its ``version`` set) makes every tile a copy of that version.

    Iterating yields :class:`Tile` objects. Use as ``with rt.pipeline(ref, ...) as p: for tile in
    p: ...``; ``close()`` stops the mover and releases everything (safe twice). Errors
    (StaleReferenceError, PeerLostError, MemsemTimeoutError, LeaseExpiredError...) are raised in
    the caller at the tile they concern, and stick. ``stats`` gives a :class:`PipelineStats`.

    Thread safety: one caller thread iterates; ``Tile.release`` may be called from any thread.
    """

    __slots__ = ("runtime", "spec", "depth", "timeout", "route", "wait_ready", "mode", "tile_bytes", "n_tiles",
                 "_t0", "_lease", "_version", "_plan",
                 "_n_slots", "_slot_bytes", "_base", "_slots", "_slot_mem", "_handoff", "_view",
                 "_next", "_current", "_out", "_held", "_closed", "_finished", "_failed",
                 "_t_first", "_t_end", "_caller_wait_s", "_caller_ready_s", "_caller_move_s", "_caller_bytes",
                 "_caller_tiles", "_computes", "_recorded",
                 "__weakref__")

    def __init__(self, runtime: RuntimeCore, spec: Any, *, tile_bytes: int | None = None,
                 depth: int | None = None, wait_ready: bool | None = None, timeout: float | None = None,
                 zero_copy: bool | None = None, out: Any = None, lease: Lease | None = None) -> None:
        self._t0 = _perf()
        reap_unjoined()  # earlier pipelines' memory a worker was still writing at their close
        if not isinstance(runtime, RuntimeCore):
            raise TypeError(f"runtime must be a memsem runtime, got {type(runtime).__name__}")
        if not isinstance(spec, RefSpec):
            spec = getattr(spec, "spec", spec)
            if not isinstance(spec, RefSpec):
                raise TypeError(f"spec must be a RefSpec or a ref, got {type(spec).__name__}")
        if tile_bytes is None and depth is None and wait_ready is None and timeout is None \
                and zero_copy is None and out is None and lease is None:  # the defaults: nothing to check
            depth, timeout, version = DEFAULT_DEPTH, runtime.timeout, 0
        else:
            if depth is None or (depth == DEFAULT_DEPTH and type(depth) is int):
                depth = DEFAULT_DEPTH
            else:
                depth = _args.count(depth, "depth", minimum=1, unit="staging slots")
            timeout = runtime.timeout if timeout is None else _args.timeout(timeout, "timeout", positive=True)
            if zero_copy is not None and zero_copy is not True and zero_copy is not False:
                raise TypeError(f"zero_copy must be None, True or False, got {zero_copy!r}")
            if wait_ready is not None and wait_ready is not True and wait_ready is not False:
                raise TypeError(f"wait_ready must be None, True or False, got {wait_ready!r}")
            if zero_copy and out is not None:
                raise ValueError("zero_copy=True and out= exclude each other: views move nothing into out")
            if tile_bytes is not None:
                tile_bytes = _args.count(tile_bytes, "tile_bytes", minimum=1, unit="bytes")
            version = 0
            if lease is not None:
                if lease.spec.gva != spec.gva:
                    raise ValueError(f"lease is for {lease.spec.label}, not {spec.label}")
                version = lease.version
        self.runtime = runtime
        self.spec = spec
        self.depth = depth
        self.timeout = float(timeout)
        self._lease = lease
        self._version = version
        res = runtime.resolver.resolve(spec)
        if tile_bytes is None and wait_ready is None and zero_copy is None and out is None:
            # The default tiling of a range depends on nothing but the range and its resolution:
            # decided once per resolution (a loop of small pipelines pays it once).
            key = ("pipeline", spec.offset, spec.nbytes, spec.dtype_code, spec.shape)
            memo = res.memo
            plan = memo.get(key)
            if plan is None:
                plan = Plan(spec, res, None, None, None, False)
                if len(memo) >= MEMO_LIMIT:
                    memo.clear()
                memo[key] = plan
        else:
            plan = Plan(spec, res, tile_bytes, wait_ready, zero_copy, out is not None)
        self._plan = plan
        self.route = plan.route
        self.wait_ready = plan.wait_ready
        view = plan.view
        self.mode = plan.mode
        self.tile_bytes = tile_bytes = plan.tile_bytes
        self.n_tiles = plan.n_tiles
        nbytes = spec.nbytes
        # Staging never exceeds what the ref can fill: at most one slot per tile, and a slot no
        # larger than the ref (a tile_bytes or depth far above the ref's size costs nothing).
        if depth == DEFAULT_DEPTH:
            self._n_slots, self._slot_bytes = plan.default_slots
        else:
            self._n_slots = min(depth, self.n_tiles)
            self._slot_bytes = max(1, min(tile_bytes, nbytes))

        self._base: np.ndarray | None = None
        self._slots: np.ndarray | None = None
        self._slot_mem: np.ndarray | None = None
        if view:
            arr = runtime.view_spec(spec, lease=lease)
            self._base = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
        elif out is not None:
            flat, binfo = as_byte_array(out, "out", writable=True)
            if binfo.nbytes != nbytes:
                raise ValueError(f"out holds {binfo.nbytes} bytes; the ref is {nbytes} bytes")
            check_dtype("out", binfo.dtype_code, spec.dtype_code)  # uint8 (raw bytes) or the ref's
            self._base = flat
        else:
            mem = self._slot_mem = runtime.staging.borrow(self._n_slots * self._slot_bytes)
            if self.n_tiles == 1:  # one tile, one slot, no mover: the slot is the tile's place
                self._base = mem
            else:
                self._slots = mem.reshape(self._n_slots, self._slot_bytes)
        self._view = view
        self._handoff: Handoff | None = None  # the caller's side of a mover, from tile 0 on
        self._next = 0
        self._current: Tile | None = None
        self._out = 0  # tiles handed out (the caller thread); released: len(self._computes)
        self._held: dict[int, Tile] = {}  # tiles handed out and not released (any thread pops)
        self._closed = self._finished = self._recorded = False
        self._failed: BaseException | None = None
        self._t_first: float | None = None
        self._t_end: float | None = None
        self._caller_wait_s = self._caller_ready_s = self._caller_move_s = 0.0
        self._caller_bytes = self._caller_tiles = 0
        self._computes: list[tuple[float, float]] = []

    # -- geometry --------------------------------------------------------------------------------
    @property
    def explanation(self) -> str:
        """Why this tile count, and what each tile costs (also in ``stats.explanation``)."""
        why, r = self._plan.why, self.route
        if why in ("auto", "small"):
            text = _tiling.explain_auto(self.spec.nbytes, self.tile_bytes, self.n_tiles, r.alpha, r.beta,
                                        self._plan.start_s)
            return text + ("; " + _tiling.explain_copied(self.spec.nbytes, r.alpha, r.beta) if why == "small" else "")
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
        plan = self._plan
        return _tiling.ready_words(self.spec.offset, self.spec.nbytes, self.tile_bytes, plan.window_tile_bytes,
                                   plan.n_ready, index)

    def _typed(self, raw: np.ndarray, off: int, n: int) -> tuple[np.ndarray, tuple[int, int] | None]:
        rb, dtype = self._plan.row_bytes, self._plan.dtype
        shape = self.spec.shape
        if rb == 1 and len(shape) == 1:  # uint8-like 1-D ref: the bytes are the rows
            return (raw if dtype is _U8 else raw.view(dtype)), (off, off + n)
        if len(shape) >= 1 and rb and off % rb == 0 and n % rb == 0:
            r0 = off // rb
            return raw.view(dtype).reshape((n // rb,) + tuple(shape[1:])), (r0, r0 + n // rb)
        isz = dtype.itemsize
        if off % isz == 0 and n % isz == 0:
            return raw.view(dtype), None
        return raw, None

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> "Pipeline":
        return self

    def __next__(self) -> Tile:
        if self._failed is not None:
            raise self._failed
        cur = self._current  # one read: another thread's release may clear it meanwhile
        if cur is not None:
            cur.release()
            self._current = None
        index = self._next
        if index >= self.n_tiles:
            if not self._finished:  # (``_finish``)
                self._finished = True
                if self._t_end is None:
                    self._t_end = _perf()
                self.close()
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
                raw, version = self._base[off:off + n], None
            elif index == 0:
                if self.n_tiles > 1:
                    self._start_handoff()  # its worker wakes while the caller copies tile 0
                    raw, version = self._move_here(0, off, n)
                elif self.wait_ready or self._version:
                    raw, version = self._move_here(0, off, n)
                else:  # one tile, the latest version: a get into the slot (``_move_here``'s path)
                    raw = self._base
                    if n != raw.size:  # an empty ref's slot holds one byte
                        raw = raw[:n]
                    version = self.runtime.transfers.get_range(self.spec, 0, raw, self._lease)
                    self._caller_move_s = _perf() - t0
                    self._caller_bytes = n
                    self._caller_tiles = 1
            elif self._handoff is None:
                raw, version = self._move_here(index, off, n)
            else:
                raw, version = self._handoff.tile(index, off, n)
        except BaseException as exc:
            self._failed = exc
            self.close()
            raise
        t1 = _perf()
        self._caller_wait_s += t1 - t0
        if self._t_first is None:
            self._t_first = t1
        if self._plan.flat:  # uint8-like 1-D ref: the bytes are the rows
            arr, rows = raw, (off, off + n)
        else:
            arr, rows = self._typed(raw, off, n)
        tile = Tile(self, index, off, n, raw, arr, rows, version, t1)
        self._held[index] = tile
        self._out += 1
        self._current = tile
        self._next = index + 1
        return tile

    def _caller_ready(self, index: int) -> None:
        t = _perf()
        wait_ready(self.runtime, self.spec, self._ready_plan(index), index, self.timeout, self._is_closed)
        self._caller_ready_s += _perf() - t

    def _move_here(self, index: int, off: int, n: int, dst: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """The caller moves tile ``index`` itself (into ``dst``, default its slot), through the
        runtime's general path (its waits, retries and errors are those of ``get``); returns
        where it is and the version read. (Its interval is not kept: the caller computes on no
        tile while it copies one, so it adds nothing to the overlap.)"""
        if self.wait_ready:
            self._caller_ready(index)
        if dst is None:
            slots = self._slots
            if slots is None:
                base = self._base
                dst = base if n == base.size else base[off:off + n]
            else:
                dst = slots[index % self._n_slots] if n == self._slot_bytes else slots[index % self._n_slots, :n]
        t = _perf()
        if self._version:
            version = self.runtime.transfer(self.spec, "get", off, dst, lease=self._lease, version=self._version)
        else:
            version = self.runtime.transfers.get_range(self.spec, off, dst, self._lease)
        self._caller_move_s += _perf() - t
        self._caller_bytes += n
        self._caller_tiles += 1
        return dst, version

    def _start_handoff(self) -> None:
        res = self.runtime.resolve(self.spec)
        plan = self._plan
        ready = (plan.window_tile_bytes, plan.n_ready, self._ready_plan) if self.wait_ready else None
        if not Handoff.can_watch(res, ready):
            return  # nothing native can watch the owner's liveness: the caller moves every tile
        h = Handoff(self, self.runtime, self.spec, res, tile_bytes=self.tile_bytes, n_tiles=self.n_tiles,
                    n_slots=self._n_slots, slot_bytes=self._slot_bytes, slots=self._slots,
                    out=self._base if self._slots is None else None, ready=ready, timeout=self.timeout,
                    lease=self._lease, version=self._version, route=self.route, move_here=self._move_here,
                    closed=self._is_closed)
        self.runtime.children.add(self)  # the runtime closes its pipelines before it unmaps anything
        self._handoff = h
        h.start(1, res)

    def _release(self, tile: Tile) -> None:
        t = _perf()
        # A tile may be released from any thread, once: the one pop (atomic) that finds it in
        # the held tiles releases it; no lock. Each release adds one compute interval, so their
        # count is the count of released tiles.
        if self._held.pop(tile.index, None) is None:
            return  # released by another thread meanwhile
        tile._released = True
        tile._array = tile._raw = None  # type: ignore[assignment]
        self._computes.append((tile._t_out, t))
        h = self._handoff
        if h is not None:
            h.release()
        if self._current is tile:
            self._current = None
        if tile.index == self.n_tiles - 1 and self._t_end is None:
            self._t_end = t

    @property
    def mover_running(self) -> bool:
        """True while this pipeline's mover (native worker or thread) works for it; False once
        closed (a native worker then claims no tile; it ends after the copy in progress, and the
        memory it may write is kept until it has)."""
        return not self._closed and self._handoff is not None and self._handoff.running()

    @property
    def tiles_held(self) -> int:
        """Tiles handed out and not yet released (0 or 1 with the iterator protocol)."""
        return self._out - len(self._computes)

    @property
    def free_slots(self) -> int:
        """Staging slots holding no tile the caller may still read nor one moved ahead for it
        (approximate while the mover runs)."""
        if self.mode == "view":
            return 0
        h = self._handoff
        return max(0, self._n_slots - (self._out - len(self._computes)) - (h.ahead(self._next) if h is not None else 0))

    # -- lifetime --------------------------------------------------------------------------------
    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            if self._t_end is None:
                self._t_end = _perf()
            self.close()

    def close(self) -> None:
        """Stop the mover (a native worker claims no further tile and ends after the copy in
        progress; close does not wait for it, and what it may write stays allocated until it has
        ended), release the held tile and the view (its lease goes when no tile array references
        it). Safe twice."""
        if self._closed:
            return
        self._closed = True
        cur = self._current  # one read: another thread's release may clear it meanwhile
        if cur is not None:
            cur.release()
            self._current = None
        if self._t_end is None:
            self._t_end = _perf()
        if self.mode != "out":  # a view, or the staging slot of a one-tile pipeline (given back below)
            self._base = None
        # The memory a worker may still write goes back to the pool once no worker uses it: at
        # once when its run has ended, else when a later join finds it ended (the worker stops
        # after the copy in progress; close never waits for a worker the scheduler has not run).
        h = self._handoff
        if h is not None:
            h.close(self._slot_mem)
        elif self._slot_mem is not None:
            self.runtime.staging.give_back(self._slot_mem)
        self._slot_mem = self._slots = None
        self._record()

    def _record(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        try:
            if self._handoff is None:  # the caller moved every tile (none overlapped its compute)
                move_s = self._caller_move_s
                self.runtime.telemetry.record_pipeline(
                    self._next, self._caller_bytes, move_s, self._caller_wait_s, self._caller_ready_s,
                    0.0 if move_s > 0 else 1.0, None if self._t_first is None else self._t_first - self._t0)
            else:
                move_s, ready_s, _, moved, moves, computes = self._parts()
                self.runtime.telemetry.record_pipeline(
                    self._next, moved, move_s, self._caller_wait_s, ready_s, overlap(moves, computes, move_s),
                    None if self._t_first is None else self._t_first - self._t0)
        except Exception:  # telemetry must never break the data path
            log.debug("recording pipeline telemetry failed", exc_info=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def _is_closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- measurement -----------------------------------------------------------------------------
    @property
    def mover(self) -> str:
        """Who moved tiles after the first (``PipelineStats.mover``)."""
        if self._view:
            return "none"
        return "caller" if self._handoff is None else self._handoff.kind

    def _parts(self) -> tuple[float, float, float, int, list[tuple[float, float]], list[tuple[float, float]]]:
        h = self._handoff
        m_move, m_ready, m_hold, m_bytes = (0.0, 0.0, 0.0, 0) if h is None else h.counters()
        computes = list(self._computes)  # one copy (atomic): releases append from any thread
        return (self._caller_move_s + m_move, self._caller_ready_s + m_ready, m_hold, self._caller_bytes + m_bytes,
                [] if h is None else list(h.moves), computes)

    @property
    def stats(self) -> PipelineStats:
        """A snapshot of what this pipeline measured (see :class:`PipelineStats`)."""
        now = _perf()
        end = self._t_end if self._t_end is not None else now
        move_s, ready_s, hold_s, moved, moves, computes = self._parts()
        h = self._handoff
        return PipelineStats(
            tiles=self.n_tiles, delivered=self._next, tile_bytes=self.tile_bytes, depth=self.depth,
            mode=self.mode, route=self.route.kind,
            first_tile_s=None if self._t_first is None else self._t_first - self._t0,
            total_s=end - self._t0, move_s=move_s, ready_wait_s=ready_s, caller_hold_s=hold_s,
            caller_wait_s=self._caller_wait_s, compute_s=sum(b - a for a, b in computes),
            overlap_ratio=overlap(moves, computes, move_s), bytes_moved=moved, mover=self.mover,
            caller_tiles=self._caller_tiles, late_tiles=0 if h is None else h.late_tiles,
            explanation=self.explanation)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"at tile {self._next}/{self.n_tiles}"
        return f"<Pipeline {self.mode} over {self.spec.label} tile_bytes={self.tile_bytes} depth={self.depth} {state}>"
