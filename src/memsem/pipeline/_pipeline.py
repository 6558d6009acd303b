"""The double-buffer pipeline: move tile i+1 while the caller computes tile i.

A :class:`Pipeline` iterates the tiles of a ref. The caller moves tile 0 itself (its first
``next()`` would wait for it anyway); the later tiles are moved ahead by a *mover* into
``depth`` staging slots (tile i in slot ``i % depth``) while the caller computes:

* same node (shared segment or cross-memory attach): the **native copy engine**
  (``native/memsem_pipe.c``), a thread that never needs the GIL. It waits for a tile's slot
  (released by the caller) and for the window's ready words of the tile (futex waits that
  re-check the generation, the owner's pidfd and the stop bit), copies with the same one-call
  check-and-copy as ``get`` (``memsem_plan_copy``: range, permission, lease, generation and
  version before and after, in-flight accounting) and hands the tile over through a futex word;
* other routes (tcp, rdma, mte): a Python thread doing the same with the runtime's transfers.

A tile's slot is reused only after the caller released the tile: leaving ``with tile:``,
advancing the iterator, or closing the pipeline (also when the caller raised). Any outcome of
the native engine but a plain success (a write section open, a moved generation, a closed
resolution, an expired lease, a dead owner) ends its run at that tile; the caller then moves the
tile itself through the runtime's general path, which waits, retries or raises exactly as
``get`` does, and starts a new run at the next tile. The engine's thread is joined at close (and
by the runtime's close); until it is joined, the pipeline keeps alive everything it touches
(the resolution and its mappings, the staging memory or ``out``, the lease's slot).

Where the route allows ``view()`` (same process, or a shared segment on the same node) the
pipeline hands out views of the window and moves nothing.

**Tile count.** With ``tile_bytes`` given, it is honoured and :attr:`Pipeline.explanation` (and
``stats.explanation``) says what it costs: the modelled move time of a tile against the fixed
cost of handing one over. Without it, a window published with tiles is streamed in its own
tiles; otherwise the pipeline picks the tile count (:func:`auto_tiles`): one tile (a plain
get) when the ref is too small for overlap to pay, else as many tiles as keep the hand-offs
within ``AUTO_LOSS`` of the move time (so a consumer that computes nothing loses at most that
against one get), up to ``AUTO_MAX_TILES``.

This layer works on :class:`memsem.gva.RefSpec` through :class:`memsem.core.RuntimeCore`;
``memsem.Runtime.pipeline(ref, ...)`` is the user-facing entry point.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from memsem import _args, _dtypes, native
from memsem._buffers import array_address, as_byte_array, check_dtype
from memsem._errors import MemsemError, MemsemTimeoutError, NotSupportedError, RuntimeClosedError
from memsem.gva import RefSpec
from memsem.core import ATTENTION, Lease, RuntimeCore, settle

log = logging.getLogger(__name__)

#: how often blocked waits of the caller re-check that the pipeline was not closed (seconds)
POLL_S = 0.05
#: extra time the caller waits beyond ``timeout`` so the mover's own, more precise, error wins
CALLER_GRACE_S = 0.5
#: modelled fixed cost of one tile hand-off (caller side: the wait, the Tile, the release;
#: a futex wake when the caller sleeps), seconds; measured 5-25 us on a 2-vCPU VM (more when the
#: tiles just moved evicted the interpreter's data from the caches)
TILE_COST_S = 20e-6
#: modelled cost of handing a pipeline's first run to the copy engine (waking a parked
#: worker), seconds
START_COST_S = 50e-6
#: the automatic tile count keeps the fixed costs of tiling within this fraction of the move time
AUTO_LOSS = 0.25
#: ... and tiles only when it saves at least this fraction of get-then-compute (modelled)
AUTO_MIN_GAIN = 0.1
#: most tiles the automatic choice makes
AUTO_MAX_TILES = 64
#: automatic tiles are whole multiples of this many bytes where the ref's rows allow
TILE_ALIGN = 4096
#: most workers of a runtime's copy engine (fewer on smaller machines: one per CPU)
MAX_WORKERS = 4
#: default look-ahead (staging slots)
DEFAULT_DEPTH = 2

_lib = native.lib
_ffi = native.ffi
_ATTN = ATTENTION
_WAITING = _lib.MEMSEM_PIPE_WAITING
_IDLE = _lib.MEMSEM_PIPE_IDLE
_TIMEOUT = _lib.MEMSEM_PIPE_TIMEOUT
_YOURS = _lib.MEMSEM_PIPE_YOURS
_perf = time.perf_counter
_U8 = np.dtype(np.uint8)


def _fmt_bytes(n: float) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n / s:.3g} {unit}"
    return f"{int(n)} B"


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def auto_tiles(nbytes: int, alpha: float, beta: float, *, row_bytes: int = 1, itemsize: int = 1) -> tuple[int, str]:
    """The tile size the pipeline picks for a ref of ``nbytes`` bytes on a route whose cost
    model is ``alpha + bytes / beta`` seconds, and why (a sentence).

    A pipeline pays ``START_COST_S + n x TILE_COST_S`` for ``n`` tiles and, for a consumer whose
    compute takes about as long as the move (what a pipeline is for), hides ``move x (1 - 1/n)``
    of it. The choice is the ``n`` (at most ``AUTO_MAX_TILES``) with the largest modelled saving,
    provided the saving is at least ``AUTO_MIN_GAIN`` of get-then-compute and the fixed costs stay
    within ``AUTO_LOSS`` of the move (what a consumer that computes nothing loses against one
    get); else one tile (a plain get). Tiles are whole rows (``row_bytes``), and whole multiples of
    ``TILE_ALIGN`` bytes where the rows allow.
    """
    tile, n = _auto_tiles(nbytes, alpha, beta, row_bytes, itemsize)
    return tile, _explain_auto(nbytes, tile, n, alpha, beta)


def _auto_tiles(nbytes: int, alpha: float, beta: float, row_bytes: int, itemsize: int) -> tuple[int, int]:
    move = alpha + nbytes / beta
    best, gain = 1, 0.0
    for n in range(2, AUTO_MAX_TILES + 1):
        cost = START_COST_S + n * TILE_COST_S
        if cost > AUTO_LOSS * move:
            break
        g = move * (1 - 1 / n) - cost
        if g > gain:
            best, gain = n, g
    if best == 1 or gain < AUTO_MIN_GAIN * 2 * move or nbytes < 2:
        return max(1, nbytes), 1
    # Whole rows, and whole pages where the rows allow (aligned copies and kernels).
    unit = next((u for u in (math.lcm(max(1, row_bytes), TILE_ALIGN), row_bytes, itemsize)
                 if 0 < u <= nbytes // best), 1)
    tile = -(-nbytes // best)
    tile = -(-tile // unit) * unit
    return tile, -(-nbytes // tile)


def _explain_auto(nbytes: int, tile: int, n: int, alpha: float, beta: float) -> str:
    move = alpha + nbytes / beta
    if n == 1:
        return (f"one tile (a plain get): moving {_fmt_bytes(nbytes)} takes about {_fmt_s(move)}, too "
                f"little for overlap to repay starting the copy engine ({_fmt_s(START_COST_S)}) and "
                f"handing tiles over ({_fmt_s(TILE_COST_S)} each)")
    cost = START_COST_S + n * TILE_COST_S
    return (f"{n} tiles of {_fmt_bytes(tile)} (automatic): moving {_fmt_bytes(nbytes)} takes about "
            f"{_fmt_s(move)}; with compute as long as the move the pipeline hides about "
            f"{_fmt_s(move * (1 - 1 / n))} of it for {_fmt_s(cost)} of hand-offs (a consumer that "
            "computes nothing pays those against one get)")


def _explain_given(tile_bytes: int, n_tiles: int, alpha: float, beta: float, why: str) -> str:
    if n_tiles == 1:
        return f"one tile of {_fmt_bytes(tile_bytes)} ({why}): a plain get, nothing to overlap"
    move = alpha + tile_bytes / beta
    ratio = TILE_COST_S / move
    if ratio > 0.5:
        cost = (f"each tile moves in about {_fmt_s(move)} but its hand-off costs about "
                f"{_fmt_s(TILE_COST_S)} ({ratio:.2g}x the move): the stream is bound by hand-offs; "
                "larger tiles (or tile_bytes=None for an automatic choice) would be faster")
    else:
        cost = (f"each tile moves in about {_fmt_s(move)}; its hand-off costs about "
                f"{_fmt_s(TILE_COST_S)} ({ratio:.0%} of the move)")
    return f"{n_tiles} tiles of {_fmt_bytes(tile_bytes)} ({why}): {cost}"


# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PipelineStats:
    """What one pipeline measured (all times in seconds, CLOCK_MONOTONIC).

    Attributes:
        tiles: tiles of the ref. delivered: tiles handed to the caller so far.
        tile_bytes: bytes per tile (the last may be shorter). depth: staging slots.
        mode: ``"staged"`` (copies into slots), ``"out"`` (copies into the caller's ``out``) or
            ``"view"`` (zero-copy views of the window, nothing moved).
        route: route kind used to reach the window (e.g. ``host/cma``).
        mover: who moved tiles after the first: ``"native"`` (the native copy engine),
            ``"thread"`` (a Python thread: routes the engine cannot copy on), ``"caller"`` (no
            mover: one tile, or no way to watch the owner natively) or ``"none"`` (view mode).
        explanation: why this tile count, and what a tile costs (see ``auto_tiles``).
        first_tile_s: from construction to the first tile handed to the caller.
        total_s: from construction to the release of the last tile (or to now / close).
        move_s: time spent copying (mover and caller).
        ready_wait_s: time spent waiting for the producer's ready words (mover or caller).
        caller_hold_s: time the mover waited for the caller to release a slot.
        caller_wait_s: time the caller waited in ``next()`` for data.
        compute_s: time the caller held tiles (between hand-out and release).
        overlap_ratio: fraction of ``move_s`` during which the caller was computing on another
            tile (1.0 = every copy hidden behind compute; 1.0 when nothing was moved).
        bytes_moved: bytes copied (0 in view mode).
        caller_tiles: tiles the caller moved itself: tile 0, a tile the mover had not started
            when the caller wanted it (the caller never waits for a late mover), a tile after an
            unusual outcome (a write section, a closed resolution...).
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
    mover: str = "caller"
    caller_tiles: int = 0
    explanation: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        ft = "-" if self.first_tile_s is None else f"{self.first_tile_s * 1e3:.3f} ms"
        return (f"pipeline[{self.mode} {self.route}, mover {self.mover}] {self.delivered}/{self.tiles} tiles of "
                f"{self.tile_bytes} B, depth {self.depth}: first tile {ft}, total "
                f"{self.total_s * 1e3:.1f} ms, moving {self.move_s * 1e3:.1f} ms, waiting for "
                f"producer {self.ready_wait_s * 1e3:.1f} ms, for caller {self.caller_hold_s * 1e3:.1f} ms, "
                f"caller waited {self.caller_wait_s * 1e3:.1f} ms, overlap {self.overlap_ratio:.2f}, "
                f"{self.bytes_moved} B moved ({self.caller_tiles} tiles by the caller); {self.explanation}")


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
class CopyEngine:
    """One runtime's native copy engine (``memsem_engine``): a pool of copy workers that never
    need the GIL, started on demand (at most ``max_workers``), parked between pipelines, and
    joined when the runtime closes (the engine is one of the runtime's children). Pipelines
    submit runs of their tiles to it (:class:`_NativeMover`).
    """

    def __init__(self, max_workers: int) -> None:
        e = _lib.memsem_engine_new(max_workers)
        if e == _ffi.NULL:
            raise MemoryError("memsem_engine_new failed")
        self._e = e
        self._pid = os.getpid()
        self._shut = False
        self._lock = threading.Lock()
        # Frees the struct when no mover refers to this object any more (after the workers were
        # joined); a forked child never touches its parent's engine.
        self._joined = [False]
        self._finalizer = weakref.finalize(self, _free_engine, e, self._pid, self._joined)

    @property
    def workers(self) -> int:
        """Workers started so far."""
        return _lib.memsem_engine_workers(self._e)

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers (each ends after the copy in progress) and join them, at most
        ``timeout`` s (default 5). Safe twice. Later pipelines move their tiles themselves."""
        if self._pid != os.getpid():
            return
        with self._lock:
            if self._shut:
                return
            if _lib.memsem_engine_shutdown(self._e, 5.0 if timeout is None else float(timeout)) == 0:
                self._shut = True
                self._joined[0] = True  # joined: the struct may be freed
            else:
                log.warning("a pipeline copy worker did not stop in time; the engine is kept")


def _free_engine(e: Any, pid: int, joined: list[bool]) -> None:
    if pid != os.getpid():
        return
    if not joined[0] and _lib.memsem_engine_shutdown(e, 5.0) != 0:
        return  # a worker is still in a copy: never free what it uses
    _lib.memsem_engine_free(e)


_ENGINES: "weakref.WeakKeyDictionary[RuntimeCore, CopyEngine]" = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def copy_engine(runtime: RuntimeCore) -> CopyEngine:
    """The runtime's copy engine (made on first use; closed with the runtime)."""
    eng = _ENGINES.get(runtime)
    if eng is None:
        with _ENGINES_LOCK:
            eng = _ENGINES.get(runtime)
            if eng is None:
                eng = CopyEngine(max(1, min(MAX_WORKERS, os.cpu_count() or 1)))
                _ENGINES[runtime] = eng
                runtime.children.add(eng)
    return eng


#: pipeline runs whose worker did not end within the pipeline's timeout at close: kept (with
#: everything they hold) until a later join succeeds, so no worker outlives the memory it uses
_UNJOINED: list["_NativeMover"] = []
_UNJOINED_LOCK = threading.Lock()


def _reap_unjoined() -> None:
    if _UNJOINED:
        with _UNJOINED_LOCK:
            _UNJOINED[:] = [m for m in _UNJOINED if not m._join(0.0)]


class _NativeMover:
    """One pipeline's job for the runtime's copy engine (``memsem_pipe``): the struct and
    everything a worker reads or writes for it, held until no worker uses it. Holds no
    reference to the Pipeline (an abandoned pipeline is collected and its finalizer stops and
    joins the job)."""

    kind = "native"

    def __init__(self, engine: CopyEngine, res: Any, spec: RefSpec, tile_bytes: int, n_tiles: int, n_slots: int,
                 dst: np.ndarray, slot_bytes: int, lease: Lease | None, ready: tuple[int, int, int] | None,
                 timeout: float) -> None:
        self._pid = os.getpid()
        self._engine = engine
        self.res = res
        self._dst = dst  # staging memory or the caller's out: written by a worker
        self._lease = lease
        self._unpin = None
        p = self._p = _ffi.new("memsem_pipe *")
        self._rc = _ffi.new("uint64_t[]", n_slots)
        self._tm = _ffi.new("uint64_t[]", 2 * n_slots)
        p.plan = res.plan
        p.ref_offset = spec.offset
        p.ref_nbytes = spec.nbytes
        p.tile_bytes = tile_bytes
        p.dst = array_address(dst) if dst.nbytes else 0
        p.slot_bytes = slot_bytes
        p.n_tiles = n_tiles
        p.n_slots = n_slots
        p.pidfd = -1 if (res.own_cb or res.peer.is_self) else res.peer.pidfd
        p.rc = self._rc
        p.t_move = self._tm
        p.timeout_ns = int(timeout * 1e9)
        if ready is not None:
            p.ready_base, p.window_tile_bytes, p.n_ready = ready
        if lease is not None:
            ls, lid = lease.native_args(spec)
            if ls:
                self._unpin = lease.pin_slot()
            p.lease_slot, p.lease_id = ls, lid

    def start(self, first: int, res: Any) -> bool:
        """Submit a run from tile ``first``; False when the engine takes none (shut down, or no
        worker could start): the caller then moves the tiles itself."""
        if res is not self.res:
            self.res = res
            self._p.plan = res.plan
        self._p.first = first
        return _lib.memsem_engine_submit(self._engine._e, self._p) == 0

    def wait(self, tile: int, timeout: float) -> int:
        return _lib.memsem_pipe_wait(self._p, tile, timeout)

    def interval(self, tile: int) -> tuple[float, float]:
        s = 2 * (tile % self._p.n_slots)
        return self._tm[s] / 1e9, self._tm[s + 1] / 1e9

    def release(self) -> None:
        _lib.memsem_pipe_release(self._p)

    def running(self) -> bool:
        return self._p.state != _lib.MEMSEM_PIPE_FREE

    def _join(self, timeout: float) -> bool:
        if self._pid != os.getpid():
            return True  # a forked child has no workers; it touches nothing of it
        if _lib.memsem_pipe_join(self._engine._e, self._p, timeout) != 0:
            return False
        if self._unpin is not None:
            unpin, self._unpin = self._unpin, None
            unpin()
        return True

    def join_run(self, timeout: float) -> None:
        """Join a run that ended on its own (it handed over a tile it could not finish)."""
        if not self._join(timeout):
            raise MemsemError("the pipeline copy engine did not end a run after handing over its last tile")

    def shutdown(self, timeout: float) -> bool:
        """Stop and join; True when joined. Else the job is kept until a later join."""
        if self._pid != os.getpid():
            return True
        _lib.memsem_pipe_stop(self._p)
        if self._join(timeout):
            return True
        log.warning("pipeline copy worker did not stop within %.1f s; its memory is kept until it does",
                    timeout)
        with _UNJOINED_LOCK:
            _UNJOINED.append(self)
        return False

    def counters(self) -> tuple[float, float, float, int]:
        p = self._p
        since = p.hold_since
        hold = p.hold_ns + (max(0, native.monotonic_ns() - since) if since else 0)
        return p.move_ns / 1e9, p.ready_wait_ns / 1e9, hold / 1e9, int(p.bytes_moved)


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _ThreadMover:
    """Routes the native engine cannot copy on (tcp, rdma, mte): a Python thread moves tiles
    ``first..`` with the runtime's transfers, tile i into slot ``i % n_slots`` once the caller
    released tile ``i - n_slots``."""

    kind = "thread"

    def __init__(self, pipe: "Pipeline") -> None:
        self._cond = threading.Condition()
        self.released = 0
        self.stop = False
        self.ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.move_s = self.ready_wait_s = self.hold_s = 0.0
        self.bytes_moved = 0
        self.moves: dict[int, tuple[float, float]] = {}
        self._thread: threading.Thread | None = None
        self._args = (pipe.runtime, pipe.spec, pipe.tile_bytes, pipe.n_tiles, pipe._n_slots, pipe._slots,
                      pipe._base, pipe._ready_plan if pipe.wait_ready else None, pipe.timeout, pipe._lease)
        self._stop_event = threading.Event()

    def start(self, first: int, res: Any = None) -> bool:
        self._thread = threading.Thread(target=self._run, args=(first,), daemon=True,
                                        name=f"memsem-pipeline-{self._args[1].name or hex(self._args[1].gva)}")
        self._thread.start()
        return True

    def _run(self, first: int) -> None:
        rt, spec, tb, n_tiles, n_slots, slots, out, ready_plan, timeout, lease = self._args
        try:
            for i in range(first, n_tiles):
                t0 = _perf()
                with self._cond:
                    while not self.stop and self.released < i - n_slots + 1:
                        self._cond.wait(POLL_S)
                    if self.stop:
                        return
                t1 = _perf()
                self.hold_s += t1 - t0
                if ready_plan is not None:
                    _wait_ready(rt, spec, ready_plan(i), i, timeout, self._stop_event)
                t2 = _perf()
                self.ready_wait_s += t2 - t1
                off = i * tb
                n = min(tb, spec.nbytes - off)
                dst = slots[i % n_slots, :n] if slots is not None else out[off:off + n]
                rt.transfer(spec, "get", off, dst, lease=lease)
                t3 = _perf()
                self.move_s += t3 - t2
                self.moves[i % n_slots] = (t2, t3)
                self.bytes_moved += n
                if self.stop:
                    return
                self.ready.put(i)
        except BaseException as exc:  # handed to the caller, re-raised at the tile it concerns
            if not self.stop:
                self.ready.put(_Failure(exc))

    def wait(self, tile: int, timeout: float) -> Any:
        try:
            item = self.ready.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, _Failure):
            raise item.exc
        return item

    def interval(self, tile: int) -> tuple[float, float]:
        return self.moves.get(tile % self._args[4], (0.0, 0.0))

    def release(self) -> None:
        with self._cond:
            self.released += 1
            self._cond.notify()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float) -> bool:
        with self._cond:
            self.stop = True
            self._cond.notify_all()
        self._stop_event.set()
        th = self._thread
        if th is not None and th.is_alive() and th is not threading.current_thread():
            th.join(timeout)
            if th.is_alive():
                log.warning("pipeline mover thread did not stop within %.1f s", timeout)
                return False
        return True

    def counters(self) -> tuple[float, float, float, int]:
        return self.move_s, self.ready_wait_s, self.hold_s, self.bytes_moved


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
            tile_bytes = _auto_tiles(spec.nbytes, route.alpha, route.beta, self._row_bytes, dtype.itemsize)[0]
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
            check_dtype("out", binfo.dtype_code, spec.dtype_code)  # uint8 (raw bytes) or the ref's
            self._base = flat
        else:
            self._slot_mem = runtime.staging.borrow(self._n_slots * self._slot_bytes)
            self._slots = self._slot_mem.reshape(self._n_slots, self._slot_bytes)

        self._mover: _NativeMover | _ThreadMover | None = None
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
            return _explain_auto(self.spec.nbytes, self.tile_bytes, self.n_tiles, r.alpha, r.beta)
        if why == "view":
            return "one tile: nothing moves (views of the window); pass tile_bytes= for smaller tiles"
        if why == "empty":
            return "one tile: the ref is empty"
        return _explain_given(self.tile_bytes, self.n_tiles, r.alpha, r.beta, why)

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
        _wait_ready(self.runtime, self.spec, self._ready_plan(index), index, self.timeout, None, self)
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
        _reap_unjoined()
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
            mover: Any = _NativeMover(copy_engine(self.runtime), res, self.spec, self.tile_bytes, self.n_tiles,
                                      self._n_slots, dst, slot_bytes, self._lease, ready, self.timeout)
        else:
            mover = _ThreadMover(self)
        self.runtime.children.add(self)  # the runtime closes its pipelines before it unmaps anything
        self._finalizer = weakref.finalize(self, mover.shutdown, self.timeout)
        self._mover = mover
        self._mover_kind = mover.kind
        self._restart(1, res)

    def _restart(self, first: int, res: Any) -> None:
        """Hand tiles ``first..`` to the mover; without one (the engine takes no run) the caller
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
        if mover._pid != os.getpid():
            raise RuntimeClosedError(f"pipeline over {self.spec.label} belongs to pid {mover._pid}; this "
                                     "process was forked from it and has no copy engine")
        rc = mover.wait(index, 0.0)
        if rc == _WAITING:
            rc = self._wait_native(index)
        if rc == _YOURS:  # the engine had not started this tile (late, descheduled): copy it here
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
        """The engine handed over tile ``index`` with anything but a plain success."""
        mover = self._mover
        res = mover.res
        o = settle(res, rc)
        status = o.status
        if o.ok:
            self._moves.append(mover.interval(index))
            if o.check_peer:
                res.peer_checked()  # PeerLostError when the owner died
            if o.released:  # the run ended after this tile: go on with a new one
                mover.join_run(self.timeout)
                if index + 1 < self.n_tiles:
                    self._restart(index + 1, self.runtime.resolve(self.spec))
            return
        if status == _TIMEOUT:
            w = o.value
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
        """True while this pipeline's mover (native engine or thread) runs; False once closed."""
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
        ahead = (mover._p.done if mover.kind == "native" else self._next + mover.ready.qsize()) - self._next
        return max(0, self._n_slots - self._held - max(0, ahead))

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
            self.runtime.telemetry.record_pipeline(_Summary(self))
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
        overlap = 1.0 if move_s <= 0 else min(1.0, _intersection(moves, computes) / move_s)
        return PipelineStats(
            tiles=self.n_tiles, delivered=self._next, tile_bytes=self.tile_bytes, depth=self.depth,
            mode=self.mode, route=self.route.kind,
            first_tile_s=None if self._t_first is None else self._t_first - self._t0,
            total_s=end - self._t0, move_s=move_s, ready_wait_s=self._caller_ready_s + m_ready,
            caller_hold_s=m_hold, caller_wait_s=self._caller_wait_s,
            compute_s=sum(b - a for a, b in computes), overlap_ratio=overlap,
            bytes_moved=self._caller_bytes + m_bytes, mover=self._mover_kind, caller_tiles=self._caller_tiles,
            explanation=self.explanation if explain else "")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"at tile {self._next}/{self.n_tiles}"
        return f"<Pipeline {self.mode} over {self.spec.label} tile_bytes={self.tile_bytes} depth={self.depth} {state}>"


class _Summary:
    """What the runtime's telemetry keeps of a closed pipeline (``record_pipeline``): the
    figures of its stats without building them."""

    __slots__ = ("delivered", "bytes_moved", "move_s", "caller_wait_s", "ready_wait_s", "overlap_ratio",
                 "first_tile_s")

    def __init__(self, p: Pipeline) -> None:
        m_move, m_ready, _, m_bytes = p._counted if p._mover is None else p._mover.counters()
        self.delivered = p._next
        self.bytes_moved = p._caller_bytes + m_bytes
        self.move_s = move_s = p._caller_move_s + m_move
        self.caller_wait_s = p._caller_wait_s
        self.ready_wait_s = p._caller_ready_s + m_ready
        with p._held_lock:
            computes = list(p._computes)
        self.overlap_ratio = 1.0 if move_s <= 0 else min(1.0, _intersection(p._moves, computes) / move_s)
        self.first_tile_s = None if p._t_first is None else p._t_first - p._t0


# ----------------------------------------------------------------------------------------------
def _ready_words(ref_offset: int, ref_nbytes: int, tile_bytes: int, window_tile_bytes: int, n_ready: int,
                 index: int) -> range:
    """Window tiles (ready words) that pipeline tile ``index`` of a ref overlaps (the native
    engine computes the same)."""
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
                stop: threading.Event | None, pipe: Pipeline | None = None) -> None:
    """Wait for every ready word in ``words`` (window tiles), at most ``timeout`` in all, in
    slices of POLL_S so a closed pipeline stops waiting. The runtime's wait checks the owner's
    liveness (PeerLostError) and the generation (StaleReferenceError)."""
    deadline = time.monotonic() + timeout
    for w in words:
        while True:
            if (stop is not None and stop.is_set()) or (pipe is not None and pipe._closed):
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
