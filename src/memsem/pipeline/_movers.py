"""Movers: who moves a pipeline's tiles ahead of the caller.

* Same node (shared segment or cross-memory attach): :class:`NativeMover`, one pipeline's job
  for the runtime's :class:`MoverPool` (``native/memsem_pipe.c``): copy workers that never need
  the GIL. A worker waits for a tile's slot (released by the caller) and for the window's ready
  words of the tile (futex waits that re-check the generation, the owner's pidfd and the stop
  bit), copies with the same one-call check-and-copy as ``get`` (``memsem_plan_copy``: range,
  permission, lease, generation and version before and after, in-flight accounting) and hands
  the tile over through a futex word.
* Other routes (tcp, rdma, mte): :class:`ThreadMover`, a Python thread doing the same with the
  runtime's transfers.

Both move tile i into slot ``i % n_slots`` once the caller released tile ``i - n_slots``, and
say how far they got (``done``). The pool is not an *engine* (in memsem an engine is a
transport): it copies through the plan of a resolution the runtime made.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from memsem import native
from memsem._buffers import array_address
from memsem._errors import MemsemError, MemsemTimeoutError
from memsem.core import Lease, RuntimeCore
from memsem.gva import RefSpec

log = logging.getLogger(__name__)

#: how often blocked waits re-check that the pipeline was not closed (seconds)
POLL_S = 0.05
#: most workers of a runtime's mover pool (fewer on smaller machines: one per CPU)
MAX_WORKERS = 4
#: most tiles a native mover takes (the pipe's tile counters share their words with two flags)
MAX_NATIVE_TILES = (1 << 30) - 1
#: the caller takes a tile over from a worker copying it for longer than this many times the
#: route's modelled move of a tile ...
PATIENCE_FACTOR = 1.5
#: ... and at least this long (seconds)
PATIENCE_MIN_S = 100e-6

_lib = native.lib
_ffi = native.ffi
_perf = time.perf_counter


# ----------------------------------------------------------------------------------------------
class MoverPool:
    """One runtime's pool of native copy workers (``memsem_mover_pool``): workers that never
    need the GIL, started on demand (at most ``max_workers``), parked between pipelines, and
    joined when the runtime closes (the pool is one of the runtime's children). Pipelines
    submit runs of their tiles to it (:class:`NativeMover`).
    """

    def __init__(self, max_workers: int) -> None:
        pool = _lib.memsem_mover_pool_new(max_workers)
        if pool == _ffi.NULL:
            raise MemoryError("memsem_mover_pool_new failed")
        self._pool = pool
        self._pid = os.getpid()
        self._shut = False
        self._lock = threading.Lock()
        # Frees the struct when no mover refers to this object any more (after the workers were
        # joined); a forked child never touches its parent's pool.
        self._joined = [False]
        self._finalizer = weakref.finalize(self, _free_pool, pool, self._pid, self._joined)

    @property
    def workers(self) -> int:
        """Workers started so far."""
        return _lib.memsem_mover_pool_workers(self._pool)

    @property
    def shut(self) -> bool:
        """True once every worker was joined (later pipelines move their tiles themselves)."""
        return self._shut

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers (each ends after the copy in progress) and join them, at most
        ``timeout`` s (default 5). Safe twice. Later pipelines move their tiles themselves."""
        if self._pid != os.getpid():
            return
        with self._lock:
            if self._shut:
                return
            if _lib.memsem_mover_pool_shutdown(self._pool, 5.0 if timeout is None else float(timeout)) == 0:
                self._shut = True
                self._joined[0] = True  # joined: the struct may be freed
            else:
                log.warning("a pipeline copy worker did not stop in time; the mover pool is kept")
        if self._shut:
            reap_unjoined()  # every run of this pool has ended


def _free_pool(pool: Any, pid: int, joined: list[bool]) -> None:
    if pid != os.getpid():
        return
    if not joined[0] and _lib.memsem_mover_pool_shutdown(pool, 5.0) != 0:
        return  # a worker is still in a copy: never free what it uses
    _lib.memsem_mover_pool_free(pool)


_POOLS: "weakref.WeakKeyDictionary[RuntimeCore, MoverPool]" = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def mover_pool(runtime: RuntimeCore) -> MoverPool:
    """The runtime's mover pool (made on first use; closed with the runtime)."""
    pool = _POOLS.get(runtime)
    if pool is None:
        with _POOLS_LOCK:
            pool = _POOLS.get(runtime)
            if pool is None:
                pool = MoverPool(max(1, min(MAX_WORKERS, os.cpu_count() or 1)))
                _POOLS[runtime] = pool
                runtime.children.add(pool)
    return pool


#: pipeline runs whose worker had not ended when their pipeline closed (stopped, finishing the
#: copy in progress, or not yet run by the scheduler): kept, with everything they hold, until a
#: later join finds them ended, so no worker outlives the memory it uses; then their ``on_joined``
#: runs (the pipeline's staging memory goes back to the pool)
_UNJOINED: list[tuple["NativeMover", Callable[[Any], None] | None]] = []
_UNJOINED_LOCK = threading.Lock()


def reap_unjoined() -> None:
    """Join (without waiting) the runs kept by an earlier close; finish those that ended."""
    if not _UNJOINED:
        return
    ended = []
    with _UNJOINED_LOCK:
        keep = []
        for m, cb in _UNJOINED:
            (ended if m._join(0.0) else keep).append((m, cb))
        _UNJOINED[:] = keep
    for m, cb in ended:
        if cb is not None:
            try:
                cb(m)
            except Exception:  # the pipeline is gone; nothing may break the caller's next one
                log.debug("finishing a pipeline's joined run failed", exc_info=True)


# ----------------------------------------------------------------------------------------------
class NativeMover:
    """One pipeline's job for the runtime's mover pool (``memsem_pipe``): the struct and
    everything a worker reads or writes for it, held until no worker uses it. Holds no
    reference to the Pipeline (an abandoned pipeline is collected and its finalizer stops and
    joins the job)."""

    kind = "native"

    def __init__(self, pool: MoverPool, res: Any, spec: RefSpec, tile_bytes: int, n_tiles: int, n_slots: int,
                 dst: np.ndarray, slot_bytes: int, lease: Lease | None, ready: tuple[int, int, int] | None,
                 timeout: float, *, version: int = 0, patience_ns: int = 0) -> None:
        self._pid = os.getpid()
        self._patience = patience_ns
        self.pool = pool
        self.res = res
        self._dst = dst  # staging memory or the caller's out: written by a worker
        self._lease = lease
        self._unpin: Callable[[], None] | None = None
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
        p.version = version
        if ready is not None:
            p.ready_base, p.window_tile_bytes, p.n_ready = ready
        if lease is not None:
            ls, lid = lease.native_args(spec)
            if ls:
                self._unpin = lease.pin_slot()
            p.lease_slot, p.lease_id = ls, lid

    @property
    def forked(self) -> bool:
        """True in a process forked from the one that made this job (it has no workers)."""
        return self._pid != os.getpid()

    @property
    def owner_pid(self) -> int:
        return self._pid

    @property
    def done(self) -> int:
        """Tiles ``[0, done)`` were handed over."""
        return self._p.done

    def start(self, first: int, res: Any) -> bool | None:
        """Submit a run from tile ``first``: True when queued; None when the pool is busy this
        instant (its lock held: try again at a later tile; the caller moves tiles meanwhile);
        False when the pool takes none (shut down, or no worker could start): the caller then
        moves the tiles itself."""
        if res is not self.res:
            self.res = res
            self._p.plan = res.plan
        self._p.first = first
        rc = _lib.memsem_mover_pool_submit(self.pool._pool, self._p)
        return True if rc == 0 else None if rc == -errno.EAGAIN else False

    def wait(self, tile: int, timeout: float) -> int:
        """The worker's result for ``tile`` (``memsem_pipe_wait``: YOURS, LATE, WAITING, IDLE or
        the copy's outcome), waiting at most ``timeout`` s."""
        return _lib.memsem_pipe_wait(self._p, tile, timeout, self._patience)

    def take_over(self, tile: int) -> int:
        """After LATE: end the run; LATE when the tile is the caller's to copy (away from its
        slot), else the worker's result for it (it finished meanwhile)."""
        return _lib.memsem_pipe_take_over(self._p, tile)

    def result(self, tile: int) -> int:
        """What the worker handed over for ``tile`` (read once its run ended)."""
        return _lib.memsem_pipe_result(self._p, tile)

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
        if _lib.memsem_pipe_join(self.pool._pool, self._p, timeout) != 0:
            return False
        if self._unpin is not None:
            unpin, self._unpin = self._unpin, None
            unpin()
        return True

    def join_run(self, timeout: float) -> None:
        """Join a run that ended on its own (it handed over a tile it could not finish)."""
        if not self._join(timeout):
            raise MemsemError("the pipeline's copy worker did not end a run after handing over its last tile")

    def shutdown(self, timeout: float, on_joined: Callable[[Any], None] | None = None) -> bool:
        """Stop the run (the worker claims no further tile) without waiting for the worker: True
        when it had ended (``on_joined(self)`` ran), else the job is kept with everything it holds
        until a later join finds it ended (``reap_unjoined``, the next pipeline, the pool's close),
        which runs ``on_joined`` then. ``timeout`` is not waited: a stopped worker ends after the
        copy in progress, but a loaded machine may not run it for milliseconds."""
        if self._pid != os.getpid():
            return True
        _lib.memsem_pipe_stop(self._p)
        if self._join(0.0):
            if on_joined is not None:
                on_joined(self)
            return True
        with _UNJOINED_LOCK:
            _UNJOINED.append((self, on_joined))
        return False

    def counters(self) -> tuple[float, float, float, int]:
        p = self._p
        since = p.hold_since
        hold = p.hold_ns + (max(0, native.monotonic_ns() - since) if since else 0)
        return p.move_ns / 1e9, p.ready_wait_ns / 1e9, hold / 1e9, int(p.bytes_moved)


# ----------------------------------------------------------------------------------------------
class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ThreadMover:
    """Routes the native movers cannot copy on (tcp, rdma, mte): a Python thread moves tiles
    ``first..`` with the runtime's transfers, tile i into slot ``i % n_slots`` (or its place in
    ``out``) once the caller released tile ``i - n_slots``.

    Args:
        runtime, spec: what to read. tile_bytes, n_tiles: the tiling. slots: ``(n_slots,
            slot_bytes)`` staging memory, or None with ``out`` (the flat destination of the whole
            ref). n_slots: the look-ahead. ready_plan: tile index -> the window tiles whose ready
            words it waits for, or None. timeout: bound of one tile's waits. lease: checked
            around every copy, or None. version: the version every tile is read at (a pinned
            lease's), 0: the latest.
    """

    kind = "thread"

    def __init__(self, runtime: RuntimeCore, spec: RefSpec, tile_bytes: int, n_tiles: int, n_slots: int,
                 slots: np.ndarray | None, out: np.ndarray | None, ready_plan: Callable[[int], range] | None,
                 timeout: float, lease: Lease | None, version: int = 0) -> None:
        self._cond = threading.Condition()
        self.released = 0
        self.stop = False
        self.ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.move_s = self.ready_wait_s = self.hold_s = 0.0
        self.bytes_moved = 0
        self.moves: dict[int, tuple[float, float]] = {}
        self.versions: dict[int, int] = {}
        self._done = 0
        self._thread: threading.Thread | None = None
        self._args = (runtime, spec, tile_bytes, n_tiles, n_slots, slots, out, ready_plan, timeout, lease, version)
        self._stop_event = threading.Event()

    @property
    def forked(self) -> bool:
        return False  # a forked child has no thread: its waits time out with a clear error

    @property
    def done(self) -> int:
        """Tiles ``[0, done)`` were handed over (queued for the caller)."""
        return self._done

    def start(self, first: int, res: Any = None) -> bool:
        self._done = first
        spec = self._args[1]
        self._thread = threading.Thread(target=self._run, args=(first,), daemon=True,
                                        name=f"memsem-pipeline-{spec.name or hex(spec.gva)}")
        self._thread.start()
        return True

    def _run(self, first: int) -> None:
        rt, spec, tb, n_tiles, n_slots, slots, out, ready_plan, timeout, lease, version = self._args
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
                    wait_ready(rt, spec, ready_plan(i), i, timeout, self._stop_event.is_set)
                t2 = _perf()
                self.ready_wait_s += t2 - t1
                off = i * tb
                n = min(tb, spec.nbytes - off)
                dst = slots[i % n_slots, :n] if slots is not None else out[off:off + n]
                got = rt.transfer(spec, "get", off, dst, lease=lease, version=version)
                t3 = _perf()
                self.move_s += t3 - t2
                self.moves[i % n_slots] = (t2, t3)
                self.versions[i % n_slots] = got
                self.bytes_moved += n
                if self.stop:
                    return
                self.ready.put(i)
                self._done = i + 1
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

    def version_of(self, tile: int) -> int:
        """The version the copy of ``tile`` (handed over, not yet released) read."""
        return self.versions.get(tile % self._args[4], 0)

    def release(self) -> None:
        with self._cond:
            self.released += 1
            self._cond.notify()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float, on_joined: Callable[[Any], None] | None = None) -> bool:
        """Stop the thread and join it, at most ``timeout`` s; True when joined (then
        ``on_joined(self)`` ran). A thread still in a transfer keeps what it writes (``on_joined``
        never runs: the memory is left to the garbage collector)."""
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
        if on_joined is not None:
            on_joined(self)
        return True

    def counters(self) -> tuple[float, float, float, int]:
        return self.move_s, self.ready_wait_s, self.hold_s, self.bytes_moved


# ----------------------------------------------------------------------------------------------
def patience_ns(route: Any, tile_bytes: int) -> int:
    """How long (ns) the caller lets a native worker copy a tile before taking it over: a
    multiple of the route's modelled move of the tile (``alpha + bytes / beta``), at least
    ``PATIENCE_MIN_S``. A worker past it was most likely descheduled (a loaded machine): the
    caller copying the tile itself costs one tile's move, waiting for the worker a scheduler
    period (milliseconds)."""
    return int(max(PATIENCE_MIN_S, PATIENCE_FACTOR * route.cost(tile_bytes)) * 1e9)


def wait_ready(rt: RuntimeCore, spec: RefSpec, words: range, index: int, timeout: float,
               closed: Callable[[], bool]) -> None:
    """Wait for every ready word in ``words`` (window tiles), at most ``timeout`` in all, in
    slices of POLL_S so a closed pipeline stops waiting (``closed()`` true: MemsemError). The
    runtime's wait checks the owner's liveness (PeerLostError) and the generation
    (StaleReferenceError)."""
    deadline = time.monotonic() + timeout
    for w in words:
        while True:
            if closed():
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
