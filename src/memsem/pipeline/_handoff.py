"""The hand-off: the caller's side of a pipeline's mover.

A :class:`Handoff` is made when a pipeline of more than one tile delivers its first tile. It
picks the mover (:mod:`memsem.pipeline._movers`: the native one where the resolution copies
directly, the thread one elsewhere), submits runs to it and, for each later tile the caller asks
for, gives back where the tile is and the version it holds:

* a tile the mover handed over: its slot;
* a tile the mover has not started: the caller copies it itself (the caller never waits for a
  mover that does not run);
* a tile the native worker has been copying far past its expected time (descheduled on a loaded
  machine): taken over, the caller copies it into a spare slot (the worker may still write its
  own), the worker's run ends, and the tiles after it are the caller's until that run has ended
  and for ``2**k`` tiles after the late one (``k`` take-overs so far: a machine that keeps
  descheduling the worker gets fewer runs, each a bounded wait, so the pipeline stays near
  get-then-compute); then the caller copies the tile it asks for while a new run starts at the
  next one (a run started at the caller's own tile would race it for that tile);
* any outcome of the native worker but a plain success (a write section, a moved generation, a
  closed resolution, an expired lease, a dead owner): the caller moves the tile through the
  runtime's general path, which waits, retries or raises as ``get`` does, and a new run starts
  at the next tile;
* a pool whose lock a descheduled worker holds: the submit is refused at once, the caller
  copies, and submits again at the next tile.

When it closes, the hand-off stops the run without waiting for the worker; what the worker may
still write goes back to the staging pool once its run has ended (:class:`_Joined`).
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import numpy as np

from memsem import native
from memsem._errors import MemsemError, MemsemTimeoutError, RuntimeClosedError
from memsem.core import ATTENTION, Lease, RuntimeCore, settle
from memsem.gva import RefSpec
from memsem.pipeline._movers import MAX_NATIVE_TILES, POLL_S, NativeMover, ThreadMover, mover_pool, patience_ns

#: extra time the caller waits beyond ``timeout`` so the mover's own, more precise, error wins
CALLER_GRACE_S = 0.5

_WAITING = native.lib.MEMSEM_PIPE_WAITING
_IDLE = native.lib.MEMSEM_PIPE_IDLE
_TIMEOUT = native.lib.MEMSEM_PIPE_TIMEOUT
_YOURS = native.lib.MEMSEM_PIPE_YOURS
_LATE = native.lib.MEMSEM_PIPE_LATE

#: ``move_here(index, offset, nbytes, dst)``: the caller copies tile ``index`` itself (into
#: ``dst``, None: its slot) through the general path; returns ``(where, version)``
MoveHere = Callable[[int, int, int, "np.ndarray | None"], "tuple[np.ndarray, int]"]


class _Joined:
    """What a closed hand-off leaves to do once its mover's run has ended: give the staging
    memory back to the pool and settle the worker's result for a tile taken over from it (it
    may have left a closed resolution last: ``settle`` releases it). Holds no pipeline."""

    __slots__ = ("staging", "memory", "late")

    def __init__(self, staging: Any, memory: tuple[np.ndarray | None, ...], late: int | None) -> None:
        self.staging, self.memory, self.late = staging, memory, late

    def __call__(self, mover: NativeMover | ThreadMover | None) -> None:
        if self.late is not None and isinstance(mover, NativeMover):
            settle(mover.res, mover.result(self.late))
        for mem in self.memory:
            if mem is not None:
                self.staging.give_back(mem)
        self.memory = ()


class Handoff:
    """The caller's side of one pipeline's mover (see the module docstring).

    Args:
        owner: the pipeline; only a finalizer is registered on it (an abandoned pipeline stops
            its mover), no reference is kept.
        runtime, spec: what is read. res: the resolution the first run copies through.
        tile_bytes, n_tiles, n_slots, slot_bytes: the tiling and the staging slots.
        slots: ``(n_slots, slot_bytes)`` staging memory, or None with ``out`` (the flat
            destination of the whole ref, tile i at its offset).
        ready: ``(window tile bytes, ready words, plan)`` when tiles wait for ready words
            (``plan(i)``: the window tiles of tile i), else None.
        timeout: bound of one tile's waits. lease, version: checked / read by every copy.
        route: the route (its cost model sets the patience with a worker's copy).
        move_here: the caller's own copy of a tile. closed: whether the pipeline was closed.

    Use :meth:`start` (None when no mover can watch the owner: the caller moves every tile).
    """

    __slots__ = ("runtime", "spec", "n_tiles", "n_slots", "slot_bytes", "timeout", "mover", "kind", "late_tiles",
                 "moves", "_slots", "_out", "_move_here", "_closed", "_late", "_spare", "_resubmit", "_resume_at",
                 "_counted", "_finalizer")

    def __init__(self, owner: Any, runtime: RuntimeCore, spec: RefSpec, res: Any, *, tile_bytes: int, n_tiles: int,
                 n_slots: int, slot_bytes: int, slots: np.ndarray | None, out: np.ndarray | None,
                 ready: tuple[int, int, Callable[[int], range]] | None, timeout: float, lease: Lease | None,
                 version: int, route: Any, move_here: MoveHere, closed: Callable[[], bool]) -> None:
        self.runtime, self.spec, self.n_tiles = runtime, spec, n_tiles
        self.n_slots, self.slot_bytes = n_slots, slot_bytes
        self.timeout = timeout
        self._slots, self._out, self._move_here, self._closed = slots, out, move_here, closed
        self._late: int | None = None  # a tile taken over from a late worker whose run has not ended
        self._resume_at = -1  # after a take-over: the first tile whose run may start (-1: none pending)
        self._spare: np.ndarray | None = None  # the caller's own slot for a tile taken over
        self._resubmit = False  # the pool was busy at the last submit: submit again at the next tile
        self._counted: tuple[float, float, float, int] = (0.0, 0.0, 0.0, 0)  # of a mover dropped
        self.late_tiles = 0
        #: intervals of the mover's moves of the tiles handed over (for the overlap)
        self.moves: list[tuple[float, float]] = []
        if res.direct and n_tiles <= MAX_NATIVE_TILES:
            native_ready = None
            if ready is not None:
                native_ready = (res.cb.ready_addr(0), ready[0], ready[1])
            dst = slots if slots is not None else out
            # A tile in out= has one place, which a late worker may still write: never taken over.
            patience = patience_ns(route, tile_bytes) if slots is not None else 0
            mover: Any = NativeMover(mover_pool(runtime), res, spec, tile_bytes, n_tiles, n_slots,
                                     dst.reshape(-1) if dst is not None else np.empty(0, np.uint8),
                                     slot_bytes if slots is not None else 0, lease, native_ready, timeout,
                                     version=version, patience_ns=patience)
        else:
            mover = ThreadMover(runtime, spec, tile_bytes, n_tiles, n_slots, slots, out,
                                ready[2] if ready is not None else None, timeout, lease, version)
        self.mover: NativeMover | ThreadMover | None = mover
        self.kind = mover.kind
        self._finalizer = weakref.finalize(owner, mover.shutdown, timeout)

    @staticmethod
    def can_watch(res: Any, ready: Any) -> bool:
        """False where tiles wait for ready words but nothing native can watch the owner's
        liveness (no pidfd): the caller then moves every tile itself."""
        return not (ready is not None and res.direct and not (res.own_cb or res.peer.is_self) and res.peer.pidfd < 0)

    # -- runs ------------------------------------------------------------------------------------
    def start(self, first: int, res: Any) -> None:
        """Hand tiles ``first..`` to the mover; when the pool is busy this instant, again at the
        next tile; without a mover (the pool takes no run) the caller moves them itself."""
        got = self.mover.start(first, res)
        self._resubmit = got is None
        if got is False:
            self._drop()

    def _drop(self) -> None:
        self._finalizer.detach()
        self.mover.shutdown(self.timeout)
        self._counted = self.mover.counters()
        self.mover = None
        self.kind = "caller"

    def _restart(self, first: int) -> None:
        self.start(first, self.runtime.resolve(self.spec))

    # -- tiles -----------------------------------------------------------------------------------
    def _slot(self, index: int, off: int, n: int) -> np.ndarray:
        if self._slots is not None:
            return self._slots[index % self.n_slots, :n]
        return self._out[off:off + n]

    def tile(self, index: int, off: int, n: int) -> tuple[np.ndarray, int]:
        """Tile ``index`` (``n`` bytes at ``off``): where it is and the version it holds."""
        mover = self.mover
        if mover is None:
            return self._move_here(index, off, n, None)
        if mover.kind == "thread":
            got = self._wait(index, None)
            if got != index:  # cannot happen: the mover delivers in order
                raise MemsemError(f"pipeline over {self.spec.label} delivered tile {got}, expected {index}")
            self.moves.append(mover.interval(index))
            return self._slot(index, off, n), mover.version_of(index)
        if mover.forked:
            raise RuntimeClosedError(f"pipeline over {self.spec.label} belongs to pid {mover.owner_pid}; this "
                                     "process was forked from it and has no copy workers")
        if self._resubmit:  # the pool was busy when the run was submitted
            self._restart(index)
            if self.mover is None:
                return self._move_here(index, off, n, None)
        if self._late is not None:
            if mover.running():  # the late worker's run has not ended: the caller goes on alone
                return self._move_here(index, off, n, self._away_from_late(index, n))
            self._settle_late()
        if self._resume_at >= 0:  # backing off after a take-over: no run is submitted
            if index >= self._resume_at and index + 1 < self.n_tiles:
                self._resume_at = -1
                self._restart(index + 1)  # the worker from the next tile on; this one is the caller's
            return self._move_here(index, off, n, None)
        rc = mover.wait(index, 0.0)
        if rc == _WAITING:
            rc = self._wait(index, _WAITING)
        if rc == _LATE:
            rc = mover.take_over(index)
            if rc == _LATE:  # descheduled mid-copy: the caller copies the tile where the worker does not write
                self._late = index
                self.late_tiles += 1
                self._resume_at = index + 1 + (1 << min(self.late_tiles, 30))
                return self._move_here(index, off, n, self._spare_for(n))
        if rc == _YOURS:  # the worker had not started this tile (late, descheduled): copy it here
            return self._move_here(index, off, n, None)
        if rc & ATTENTION:
            return self._native_outcome(index, off, n, rc)
        self.moves.append(mover.interval(index))
        return self._slot(index, off, n), settle(mover.res, rc).value

    def _spare_for(self, n: int) -> np.ndarray:
        if self._spare is None:
            self._spare = self.runtime.staging.borrow(self.slot_bytes)
        return self._spare[:n]

    @property
    def spare(self) -> np.ndarray | None:
        """The caller's own slot for tiles taken over (None until one was)."""
        return self._spare

    def _away_from_late(self, index: int, n: int) -> np.ndarray | None:
        """The caller's destination for tile ``index`` while a late worker may still write the
        slot of the tile it was taken over from: the spare when the slot is that one (the tile
        in the spare was released before this one was asked for), else the tile's own slot."""
        late = self._late
        if late is not None and index % self.n_slots == late % self.n_slots:
            return self._spare_for(n)
        return None

    def _settle_late(self) -> None:
        """The run a late worker held ended: join it and settle its result for the tile taken
        over (only its release of a closed resolution matters: the caller's own copy decided)."""
        mover = self.mover
        mover.join_run(self.timeout)
        settle(mover.res, mover.result(self._late))
        self._late = None

    def _wait(self, index: int, waiting: Any) -> Any:
        """Poll the mover for tile ``index`` (each poll blocks at most POLL_S) until it gives
        something other than ``waiting``; bounded by the pipeline's timeout plus a grace."""
        deadline = time.monotonic() + self.timeout + CALLER_GRACE_S
        mover = self.mover
        while True:
            got = mover.wait(index, POLL_S)
            if got != waiting:
                return got
            if self._closed():
                raise MemsemError(f"pipeline over {self.spec.label} was closed")
            if time.monotonic() >= deadline:
                raise MemsemTimeoutError(
                    f"pipeline over {self.spec.label}: tile {index} not delivered after "
                    f"{self.timeout + CALLER_GRACE_S:.2f} s", what=f"tile {index} of {self.spec.label}",
                    timeout=self.timeout)

    def _native_outcome(self, index: int, off: int, n: int, rc: int) -> tuple[np.ndarray, int]:
        """The native mover handed over tile ``index`` with anything but a plain success."""
        mover = self.mover
        res = mover.res
        o = settle(res, rc)
        status = o.status
        if o.ok:
            self.moves.append(mover.interval(index))
            if o.check_peer:
                res.peer_checked()  # PeerLostError when the owner died
            if o.released:  # the run ended after this tile: go on with a new one
                mover.join_run(self.timeout)
                if index + 1 < self.n_tiles:
                    self._restart(index + 1)
            return self._slot(index, off, n), o.value
        if status == _TIMEOUT:
            w = o.value
            self.runtime.telemetry.count_error("timeout")
            raise MemsemTimeoutError(
                f"pipeline tile {index} of {self.spec.label}: ready word of window tile {w} not "
                f"set after {self.timeout} s", what=f"tile {w} of {self.spec.label}", timeout=self.timeout)
        if status == _IDLE:
            if self._closed():
                raise MemsemError(f"pipeline over {self.spec.label} was closed")
        else:
            mover.join_run(self.timeout)
        # The general path decides: it waits (write section), re-resolves (closed resolution)
        # or raises the error of a get (stale, lease expired, peer lost...).
        got = self._move_here(index, off, n, None)
        if index + 1 < self.n_tiles:
            self._restart(index + 1)
        return got

    # -- the caller's releases, state, close -------------------------------------------------------
    def release(self) -> None:
        """The caller released its oldest held tile."""
        if self.mover is not None:
            self.mover.release()

    def running(self) -> bool:
        return self.mover is not None and self.mover.running()

    def ahead(self, delivered: int) -> int:
        """Tiles handed over beyond the ``delivered`` ones (approximate while the mover runs)."""
        return 0 if self.mover is None else max(0, self.mover.done - delivered)

    def counters(self) -> tuple[float, float, float, int]:
        """``(move_s, ready_wait_s, hold_s, bytes_moved)`` of the mover so far."""
        return self._counted if self.mover is None else self.mover.counters()

    def close(self, memory: np.ndarray | None) -> None:
        """Stop the mover without waiting for its worker; ``memory`` (the pipeline's staging
        slots) and the spare go back to the staging pool once no worker can write them."""
        done = _Joined(self.runtime.staging, (memory, self._spare), self._late)
        self._spare = None
        self._late = None
        mover = self.mover
        if mover is None:
            done(None)
            return
        self._finalizer.detach()
        mover.shutdown(self.timeout, done)
