"""Data movement: get, put, xcopy and the asynchronous forms.

Same node, the whole check-and-copy is one native call (``memsem_plan_copy``): range,
permission, lease, generation and version before and after (seqlock), in-flight accounting and
telemetry. The Python side picks the resolution's plan and reads one integer back; only an
unusual outcome (a stale ref, an open write section, a liveness re-check that is due, a closed
resolution) takes the slow path here. Other routes run the same checks around the engine's call
with the native bracket (``memsem_bracket_open`` / ``close``), so the rules are written once.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import _dtypes, _hot, native
from memsem._buffers import address_view, array_address, as_byte_array
from memsem._errors import (
    EngineError,
    MemsemError,
    MemsemTimeoutError,
    NotSupportedError,
    StaleReferenceError,
)
from memsem.engines import WATCH_HEADER, Op, OpKind, OpState
from memsem.gva import RefSpec
from memsem.gva._control import W_GENERATION, W_LATEST, W_NSLOTS, W_SEQ0, W_SEQ1, W_SLOT_STRIDE
from memsem.runtime import _translate as tr
from memsem.runtime._completion import Batch, Completion, RangeResult, State
from memsem.runtime._lease import Lease
from memsem.runtime._liveness import WAIT_SLICE_S
from memsem.runtime._resolve import Resolution, Resolver

if TYPE_CHECKING:
    from memsem.runtime._core import RuntimeCore

_copy = native.lib.memsem_plan_copy
_hot_copy = _hot.copy
_RC_BUFFER = _hot.RC_BUFFER
_DONE = State.DONE
_open = native.lib.memsem_bracket_open
_close = native.lib.memsem_bracket_close
_ffi = native.ffi
_ATTN = tr.RC_ATTENTION
_SHIFT = tr.RC_SHIFT
_UINT8 = _dtypes.code_of("uint8")
#: numpy dtypes a destination or source may have (plain numbers and bools) -> wire code
_PLAIN = _dtypes.NUMPY_CODES
#: torn reads retried at once before waiting on the sequence word
_TORN_SPINS = 3
#: back-off of one-sided version reads while a write section is open (seconds, doubling)
_ONESIDED_BACKOFF_S = (20e-6, 1e-3)
#: bytes of one xcopy batch copied at once in the calling thread (same-node ranges resolved here)
XCOPY_INLINE_BYTES = 256 << 10
#: below this many bytes in all, an xcopy batch's remaining ranges go to one worker task
XCOPY_TASK_BYTES = 4 << 20


def remote_slots(res: Resolution) -> int:
    """Data slots of ``res``'s window as its directory record says (1, or 2 double-buffered)."""
    return 2 if res.info.extra.get("slots", 1) == 2 else 1


class Transfers:
    """The data path of one runtime (get/put/xcopy); see the module docstring."""

    def __init__(self, core: "RuntimeCore", resolver: Resolver, pool: cf.ThreadPoolExecutor) -> None:
        self._core = core
        self._resolver = resolver
        self._cache = resolver.cache
        self._pool = pool
        #: tasks of the pool running right now (close waits for them within its deadline)
        self._running = 0
        self._idle = threading.Condition()

    def _counted(self, fn: Any) -> Any:
        """``fn`` wrapped so that the runtime's close can wait for it while it runs."""
        def run(*args: Any) -> Any:
            with self._idle:
                self._running += 1
            try:
                return fn(*args)
            finally:
                with self._idle:
                    self._running -= 1
                    if not self._running:
                        self._idle.notify_all()
        return run

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no task of the pool runs; False when some still do."""
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout)

    # -- the one transfer -------------------------------------------------------------------------
    def transfer(self, spec: RefSpec, put: bool, offset: int, addr: int, n: int, keep: Any,
                 lease: Lease | None = None, version: int = 0, signal_tile: int | None = None) -> int:
        """Move ``n`` bytes between ``addr`` (here; ``keep`` owns that memory) and the window at
        ``spec.offset + offset``. Blocking; remote completion. Returns the version whose bytes
        were read or overwritten.

        ``version`` 0 reads the latest committed version, else exactly that one.
        ``signal_tile`` (puts): where the route's engine can signal tiles (mte
        ``aclshmemx_putmem_signal``) the tile's signal word is set after the data.
        """
        if offset < 0 or n < 0 or offset + n > spec.nbytes:
            raise tr.out_of_range(spec, offset, offset + n, spec.nbytes, "the ref")
        if put and not spec.writable:
            raise tr.read_only_ref(spec)
        res = self._cache.get(spec.gva)
        if res is None or res.generation != spec.generation or res.key != spec.key:
            res = self._resolver.resolve(spec)
        if lease is not None and lease.spec.gva != spec.gva:
            if put and not res.writable:
                raise tr.read_only(spec)  # the window's permission is checked first, as always
            raise ValueError(f"lease is for {lease.spec.label}, not {spec.label}")
        if res.direct:
            if lease is None:
                ls = lid = 0
            else:
                ls, lid = lease.native_args(spec)
                if not ls:  # held in the directory (another node): checked here
                    lease.check("before the transfer")
            rc = _copy(res.plan, put, spec.offset + offset, addr, n, version, ls, lid)
            if rc & _ATTN:
                return self._slow(rc, res, spec, put, offset, addr, n, keep, lease, version, signal_tile)
            return rc >> _SHIFT
        return self._via_engine(res, spec, put, offset, addr, n, keep, lease, version, signal_tile)

    def _slow(self, rc: int, res: Resolution, spec: RefSpec, put: bool, offset: int, addr: int, n: int,
              keep: Any, lease: Lease | None, version: int, signal_tile: int | None) -> int:
        """Everything but a plain success of the native copy: retries, waits and errors."""
        deadline = None
        torn = 0
        while True:
            if rc & tr.RC_LAST_OUT:
                res.release()
            status = rc & tr.RC_STATUS
            if status == tr.OK:
                if rc & tr.RC_CHECK_PEER:
                    res.peer_checked()
                return rc >> _SHIFT
            if status == tr.CLOSED:
                res = self._resolver.resolve(spec)  # raises RuntimeClosedError when closed
            elif status == tr.CHECK_FIRST:
                res.peer_checked()  # PeerLostError when the owner died: nothing was written
            elif status in (tr.BUSY, tr.TORN):
                self._core.telemetry.count_error("torn" if status == tr.TORN else "busy")
                if deadline is None:
                    deadline = time.monotonic() + self._core.timeout
                torn += 1
                if torn > _TORN_SPINS:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise tr.busy_timeout(spec, self._core.timeout)
                    self._wait_sequence(res, version, min(WAIT_SLICE_S, left))
                    if not res.own_cb and not res.peer.alive():
                        raise res.peer.lost(spec.label)
            else:
                raise self._failure(status, rc, res, spec, put, lease, version)
            if not res.direct:
                return self._via_engine(res, spec, put, offset, addr, n, keep, lease, version, signal_tile)
            if lease is None:
                ls = lid = 0
            else:
                ls, lid = lease.native_args(spec)
            rc = _copy(res.plan, put, spec.offset + offset, addr, n, version, ls, lid)

    def _failure(self, status: int, rc: int, res: Resolution, spec: RefSpec, put: bool,
                 lease: Lease | None, version: int) -> BaseException:
        """The error for a native status. Never touches the control block: the resolution may be
        released by now; what the native side saw comes back in ``rc``'s value bits."""
        found = rc >> _SHIFT
        if status in (tr.GEN_BEFORE, tr.GEN_AFTER):
            self._resolver.drop(spec.gva, res)
            self._core.telemetry.count_error("stale")
            if status == tr.GEN_AFTER and lease is not None and lease.expired():
                self._core.telemetry.count_error("lease_expired")
                return tr.lease_expired(spec, "during the transfer and the owner reclaimed the window; "
                                              "the bytes moved are not valid")
            return tr.stale(spec, found, during=status == tr.GEN_AFTER)
        if status == tr.VERSION_GONE:
            self._core.telemetry.count_error("stale")
            return tr.version_gone(spec, version, found)
        if status in (tr.LEASE_BEFORE, tr.LEASE_DURING):
            self._core.telemetry.count_error("lease_expired")
            if lease is not None and not lease.held:
                return tr.lease_expired(spec, "before the transfer (not held)")
            return tr.lease_expired(spec, "before the transfer" if status == tr.LEASE_BEFORE
                                    else "during the transfer; the bytes moved are not valid")
        if status == tr.RANGE:
            return tr.out_of_range(spec, spec.offset, spec.offset + spec.nbytes, res.nbytes)
        if status == tr.READONLY:
            return tr.read_only(spec)
        if status == tr.ERRNO:
            exc = EngineError(f"{'put' if put else 'get'} on {spec.label}", errno=found)
            err = tr.engine_failure(exc, spec, res.peer, "put" if put else "get")
            if not isinstance(err, EngineError):
                self._core.telemetry.count_error("peer_lost")
            return tr.chain(err, exc)
        return MemsemError(f"{spec.label}: unexpected native status {status}")  # pragma: no cover

    def _wait_sequence(self, res: Resolution, version: int, slice_s: float) -> None:
        """Sleep on the slot sequence word a write section will move (``Resolution.wait_sequence``);
        with no word to wait on, sleep the slice (no control block) or not at all (closed)."""
        if not res.wait_sequence(version, slice_s):
            time.sleep(slice_s if res.cb is None else 0)

    def _via_engine(self, res: Resolution, spec: RefSpec, put: bool, offset: int, addr: int, n: int,
                    keep: Any, lease: Lease | None, version: int, signal_tile: int | None) -> int:
        """Routes the CPU cannot copy on by itself: the engine moves the bytes inside the bracket."""
        eng = res.engine
        if res.cb is None and not eng.enforces_generation:
            raise NotSupportedError(f"route {res.route.kind} to {spec.label} cannot check the window's "
                                    "generation (no control block here and the engine does not enforce it)")
        ls, lid = lease.native_args(spec) if lease is not None else (0, 0)
        at = spec.offset + offset
        flat = address_view(addr, n, keep)
        deadline = None
        # Engines whose owner checks versions get the version asked for and say which they moved.
        owner_versions = eng.versions and res.cb is None
        # Engines that read the owner's control words one-sidedly: versioned reads check the
        # slot's sequence word around the copy here (a seqlock over the wire).
        onesided = (not put and res.cb is None and not eng.versions and (version or remote_slots(res) > 1)
                    and eng.can_watch(res.remote) == "read")
        while True:
            st = _ffi.new("uint64_t[5]")
            rc = _open(res.plan, put, at, n, 0 if (owner_versions or onesided) else version, ls, lid, st)
            if rc == tr.OK:
                if lease is not None and not ls:  # held in the directory: checked here, in turn
                    try:
                        lease.check("before the transfer")
                    except BaseException:
                        rc = _close(res.plan, put, n, ls, lid, st, 1)
                        if rc & tr.RC_LAST_OUT:
                            res.release()
                        raise
                break
            if rc & tr.RC_LAST_OUT:
                res.release()
            status = rc & tr.RC_STATUS
            if status == tr.CLOSED:
                res = self._resolver.resolve(spec)
                if res.direct:
                    return self.transfer(spec, put, offset, addr, n, keep, lease, version, signal_tile)
                continue
            if status == tr.CHECK_FIRST:
                res.peer_checked()
                continue
            if status in (tr.BUSY, tr.TORN):
                if deadline is None:
                    deadline = time.monotonic() + self._core.timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    raise tr.busy_timeout(spec, self._core.timeout)
                self._wait_sequence(res, version, min(WAIT_SLICE_S, left))
                continue
            raise self._failure(status, rc, res, spec, put, lease, version)
        moved = 0
        try:
            remote = res.remote_for(spec)
            if owner_versions:
                moved = eng.put(remote, at, flat) if put else eng.get(remote, at, flat, version=version)
            elif onesided:
                moved = self._onesided_get(res, spec, remote, at, flat, version)
            elif not put:
                eng.get(remote, at, flat)
            elif signal_tile is not None and eng.can_signal(remote):
                eng.put_signal(remote, at, flat, signal_tile, spec.generation)
            else:
                eng.put(remote, at, flat)
        except BaseException as exc:
            rc = _close(res.plan, put, n, ls, lid, st, 1)
            if rc & tr.RC_LAST_OUT:
                res.release()
            if isinstance(exc, MemsemError):
                if (rc & tr.RC_STATUS) == tr.GEN_AFTER:
                    self._resolver.drop(spec.gva, res)
                    raise tr.stale(spec, rc >> _SHIFT, during=True) from exc
                if isinstance(exc, StaleReferenceError):
                    self._resolver.drop(spec.gva, res)
                    if lease is not None and lease.expired():
                        raise tr.lease_expired(spec, "during the transfer and the owner reclaimed the "
                                                     "window; the bytes moved are not valid") from exc
                    raise
                if res.cb is None and isinstance(exc, EngineError):
                    # Device- or owner-enforced routes: a moved generation shows up as an access
                    # fault; the directory tells which it was.
                    rec = self._core.directory.get_window(spec.gva)
                    if rec is None or int(rec.get("generation", -1)) != spec.generation:
                        self._resolver.drop(spec.gva, res)
                        raise tr.stale(spec, None if rec is None else int(rec["generation"]),
                                       during=True) from exc
                raise tr.chain(tr.engine_failure(exc, spec, res.peer, "put" if put else "get"), exc)
            raise
        rc = _close(res.plan, put, n, ls, lid, st, 0)
        if rc & _ATTN:
            if rc & tr.RC_LAST_OUT:
                res.release()
            status = rc & tr.RC_STATUS
            if status != tr.OK:
                if status == tr.TORN:
                    # The owner opened a write section during the copy: do it again.
                    return self._via_engine(res, spec, put, offset, addr, n, keep, lease, version, signal_tile)
                raise self._failure(status, rc, res, spec, put, lease, version)
            if rc & tr.RC_CHECK_PEER:
                res.peer_checked()
        if lease is not None and not ls:
            lease.check("during the transfer; the bytes moved are not valid")
        return moved if (owner_versions or onesided) else rc >> _SHIFT

    def _onesided_get(self, res: Resolution, spec: RefSpec, remote: Any, at: int, flat: np.ndarray,
                      version: int) -> int:
        """Read ``flat.nbytes`` bytes at ``at`` of version ``version`` (0: the latest) of a window
        whose owner is on another node, through an engine that reads its control words
        one-sidedly (rdma): read the header words (generation, latest version, slot sequence
        words), copy from the version's slot, read the header again; the copy counts only if
        the slot's sequence word did not move (a write section overlapped: copy again).
        Returns the version read. Bounded by the runtime's timeout.

        Raises:
            StaleReferenceError: the generation moved, or ``version`` is gone (overwritten).
            MemsemTimeoutError: a write section stayed open, or ``version`` was not committed,
                for the runtime's timeout.
        """
        core = self._core
        eng = res.engine
        deadline = time.monotonic() + core.timeout
        pause = _ONESIDED_BACKOFF_S[0]

        def header(during: bool) -> list[int]:
            h = eng.read_words(remote, WATCH_HEADER, 0, W_SEQ1 + 1)
            if h[W_GENERATION] != spec.generation:
                g = eng.read_words(remote, WATCH_HEADER, W_GENERATION, 1)[0]  # confirm: never a torn word
                if g != spec.generation:
                    core.telemetry.count_error("stale")
                    raise tr.stale(spec, g, during=during)
                h[W_GENERATION] = g
            return h

        while True:
            h = header(False)
            nslots = 2 if h[W_NSLOTS] == 2 else 1
            v = version or h[W_LATEST]
            slot = v % nslots if nslots > 1 else 0
            seq = h[W_SEQ0 + slot]
            if seq == v << 1:
                eng.get(remote, slot * (h[W_SLOT_STRIDE] if nslots > 1 else 0) + at, flat)
                after = header(True)[W_SEQ0 + slot]
                if after == seq:
                    return v
                core.telemetry.count_error("torn")
                if version and after >> 1 > version:
                    raise tr.version_gone(spec, version, after >> 1)
            elif version and seq >> 1 > version:
                raise tr.version_gone(spec, version, seq >> 1)
            else:  # a write section is open on the slot, or the version is not committed yet
                now = time.monotonic()
                if now >= deadline:
                    raise tr.busy_timeout(spec, core.timeout)
                time.sleep(min(pause, deadline - now))
                pause = min(2 * pause, _ONESIDED_BACKOFF_S[1])
                continue
            if time.monotonic() >= deadline:
                raise tr.busy_timeout(spec, core.timeout)

    # -- get / put --------------------------------------------------------------------------------
    # The common case is one C call (memsem._hot.copy): the buffer's door checks (plain dtype,
    # C-contiguous, writable, exact size; for a put the ref's dtype or uint8) through the buffer
    # protocol, then memsem_plan_copy with every window check. Whatever that call does not take
    # (torch tensors, DLPack, a wrong size or dtype...) it hands back untouched (RC_BUFFER) and
    # the Python door below accepts it or raises the error that names the argument.
    def get(self, spec: RefSpec, out: Any = None, lease: Lease | None = None, version: int = 0) -> Any:
        """Blocking get of the whole ref into ``out`` (or a new array of ``spec.shape`` and the
        ref's dtype); returns it (``out``'s own object when given)."""
        if out is not None and (lease is None or lease.spec.gva == spec.gva):
            res = self._cache.get(spec.gva)
            if res is not None and res.direct and res.generation == spec.generation and res.key == spec.key:
                if lease is None:
                    rc = _hot_copy(res.addr, 0, spec.offset, out, spec.nbytes, -1, version)
                else:
                    rc = _hot_copy(res.addr, 0, spec.offset, out, spec.nbytes, -1, version,
                                   *lease.native_args(spec))
                if not rc & _ATTN:
                    return out
                if rc != _RC_BUFFER:
                    flat, info = as_byte_array(out, "out", writable=True)
                    self._slow(rc, res, spec, False, 0, info.address, info.nbytes, flat, lease, version, None)
                    return out
        return self._get(spec, out, lease, version)

    def _get(self, spec: RefSpec, out: Any, lease: Lease | None, version: int) -> Any:
        if out is None:
            out = np.empty(spec.shape, _dtypes.numpy_dtype(spec.dtype_code))
            n = out.nbytes
            self.transfer(spec, False, 0, array_address(out) if n else 0, n, out, lease, version)
            return out
        flat, info = as_byte_array(out, "out", writable=True)
        if info.nbytes != spec.nbytes:
            raise _size_mismatch("out", info.nbytes, spec)
        self.transfer(spec, False, 0, info.address, info.nbytes, flat, lease, version)
        return out

    def put(self, spec: RefSpec, src: Any, lease: Lease | None = None) -> int:
        """Blocking put of ``src`` (exactly the ref's bytes, same dtype or uint8) into the window;
        returns the version overwritten."""
        if spec.access == "rw" and (lease is None or lease.spec.gva == spec.gva):
            res = self._cache.get(spec.gva)
            if res is not None and res.direct and res.generation == spec.generation and res.key == spec.key:
                if lease is None:
                    rc = _hot_copy(res.addr, 1, spec.offset, src, spec.nbytes, spec.dtype_code)
                else:
                    rc = _hot_copy(res.addr, 1, spec.offset, src, spec.nbytes, spec.dtype_code, 0,
                                   *lease.native_args(spec))
                if not rc & _ATTN:
                    return rc >> _SHIFT
                if rc != _RC_BUFFER:
                    flat, info = as_byte_array(src, "src", writable=False)
                    return self._slow(rc, res, spec, True, 0, info.address, info.nbytes, flat, lease, 0, None)
        return self._put(spec, src, lease)

    def _put(self, spec: RefSpec, src: Any, lease: Lease | None) -> int:
        flat, info = as_byte_array(src, "src", writable=False)
        n, code = info.nbytes, info.dtype_code
        if n != spec.nbytes:
            raise _size_mismatch("src", n, spec)
        if code != spec.dtype_code and spec.dtype_code != _UINT8 and code != _UINT8:
            raise TypeError(f"src dtype {_dtypes.name_of(code)} differs from the ref's "
                            f"{_dtypes.name_of(spec.dtype_code)}; view it as uint8 to copy raw bytes")
        return self.transfer(spec, True, 0, info.address, n, flat, lease)

    def get_range(self, spec: RefSpec, offset: int, buf: np.ndarray, lease: Lease | None = None) -> int:
        """Blocking get of ``buf.nbytes`` bytes from ``offset`` bytes into the ref into the flat
        uint8 array ``buf`` (pipeline tiles); the hot path's one C call when it can. Returns the
        version read."""
        n = buf.nbytes
        if (lease is None or lease.spec.gva == spec.gva) and 0 <= offset and offset + n <= spec.nbytes:
            res = self._cache.get(spec.gva)
            if res is not None and res.direct and res.generation == spec.generation and res.key == spec.key:
                if lease is None:
                    rc = _hot_copy(res.addr, 0, spec.offset + offset, buf, n, -1)
                else:
                    rc = _hot_copy(res.addr, 0, spec.offset + offset, buf, n, -1, 0, *lease.native_args(spec))
                if not rc & _ATTN:
                    return rc >> _SHIFT
                if rc != _RC_BUFFER:
                    return self._slow(rc, res, spec, False, offset, array_address(buf) if n else 0, n, buf,
                                      lease, 0, None)
        return self.transfer_array(spec, False, offset, buf, lease=lease)

    def transfer_array(self, spec: RefSpec, put: bool, offset: int, local: np.ndarray, *,
                       lease: Lease | None = None, version: int = 0, signal_tile: int | None = None) -> int:
        """``transfer`` with a flat uint8 numpy array as the local side (pipelines, tiles)."""
        n = local.nbytes
        return self.transfer(spec, put, offset, array_address(local) if n else 0, n, local, lease,
                             version, signal_tile)

    def submit(self, what: str, fn: Any) -> Completion:
        self._core.check_open()
        return Completion.run(self._pool, what, self._counted(fn), timeout=self._core.timeout)

    # -- xcopy ------------------------------------------------------------------------------------
    def xcopy(self, pairs: Sequence[tuple[Any, Any]], *, lease: Lease | None = None) -> Batch:
        """Start a batch of copies (see ``memsem.Runtime.xcopy``). Ranges fail independently;
        the Batch gives every range a final state.

        Same-node ranges between a local buffer and a window already resolved here are done at
        once, in this thread, one native call each (``XCOPY_INLINE_BYTES`` per batch at most:
        a copy that small costs less than handing it to a worker); a range whose native outcome
        is anything but a plain success (a write section open, a stale ref, a closed
        resolution...) and every other range goes to the runtime's workers, in at most one task
        per worker. Ranges to or from a window whose engine posts batches to hardware
        (``Engine.batches``) go to it as one batch."""
        core = self._core
        core.check_open()
        results = []
        jobs = []
        lat: list[int] = []
        inline_left = XCOPY_INLINE_BYTES
        cache = self._cache
        now = time.perf_counter_ns
        for i, pair in enumerate(pairs):
            try:
                src, dst = pair
            except (TypeError, ValueError):
                raise TypeError(f"pairs[{i}] must be a (src, dst) pair, got {pair!r}") from None
            if isinstance(src, RefSpec):
                spec, buf, put = src, (None if isinstance(dst, RefSpec) else dst), 0
            elif isinstance(dst, RefSpec):
                spec, buf, put = dst, src, 1
            else:
                raise TypeError(f"pairs[{i}]: at least one side of each pair must be a ref")
            r = RangeResult(i, spec.nbytes)
            results.append(r)
            # The inline lane (see the docstring): settled before the Batch exists.
            if buf is not None and spec.nbytes <= inline_left and (not put or spec.access == "rw"):
                res = cache.get(spec.gva)
                if res is not None and res.direct and res.generation == spec.generation and res.key == spec.key:
                    t0 = now()
                    if lease is None:
                        rc = _hot_copy(res.addr, put, spec.offset, buf, spec.nbytes, -1)
                        out = True if not rc & _ATTN else self._inline_outcome(rc, res)
                    else:
                        out = self._inline(res, spec, put, buf, lease)
                    if out is not None:
                        inline_left -= spec.nbytes
                        if out is True:
                            r.state = _DONE
                            lat.append(now() - t0)
                        else:
                            r.state, r.error = State.FAILED, out
                        continue
            jobs.append((r, src, dst))
        core.telemetry.record_latencies("xcopy", lat)
        batch = Batch(results, timeout=core.timeout)
        grouped: dict[int, list[tuple[RangeResult, Any, Any]]] = {}
        single = []
        for job in jobs:
            eng_res = self._batchable(job[1], job[2])
            if eng_res is not None:
                grouped.setdefault(id(eng_res), []).append(job)
            else:
                single.append(job)

        def run(chunk: list[tuple[RangeResult, Any, Any]]) -> None:
            for r, src, dst in chunk:
                if not batch._start(r):
                    continue  # cancelled before it started
                if core.closed:  # closing: what has not started ends CANCELLED
                    batch._settle(r, State.CANCELLED)
                    continue
                try:
                    self._copy_one(src, dst, lease)
                except BaseException as exc:
                    batch._settle(r, State.FAILED, exc)
                else:
                    batch._settle(r, State.DONE)

        def run_group(group: list[tuple[RangeResult, Any, Any]]) -> None:
            self._copy_batch(group, batch, lease)

        for chunk in _chunks(single, self._pool._max_workers):
            self._queue(batch, [j[0] for j in chunk], run, chunk)
        for group in grouped.values():
            self._queue(batch, [g[0] for g in group], run_group, group)
        return batch

    def _inline(self, res: Resolution, spec: RefSpec, put: int, buf: Any, lease: Lease) -> Any:
        """One xcopy range under ``lease`` done now, natively (see ``_inline_outcome``)."""
        if lease.spec.gva != spec.gva:
            rc = _hot_copy(res.addr, put, spec.offset, buf, spec.nbytes, -1)
        else:
            ls, lid = lease.native_args(spec)
            if not ls:
                return None
            rc = _hot_copy(res.addr, put, spec.offset, buf, spec.nbytes, -1, 0, ls, lid)
        return True if not rc & _ATTN else self._inline_outcome(rc, res)

    @staticmethod
    def _inline_outcome(rc: int, res: Resolution) -> Any:
        """What an xcopy range done inline came to: True for a success, its error when the owner
        was found dead after a read, None when it must go to a worker (the buffer needs the
        Python door, or any other native outcome: the worker does it all again, with the waits
        and errors of the general path)."""
        if rc == _RC_BUFFER:
            return None
        if rc & tr.RC_LAST_OUT:
            res.release()
        if rc & tr.RC_STATUS:
            return None
        if rc & tr.RC_CHECK_PEER:
            try:
                res.peer_checked()
            except MemsemError as exc:
                return exc
        return True

    def _queue(self, batch: Batch, ranges: list[RangeResult], fn: Any, *args: Any) -> None:
        fut = self._pool.submit(self._counted(fn), *args)

        def dropped(f: cf.Future, ranges: list[RangeResult] = ranges) -> None:
            if f.cancelled():  # dropped by the pool (runtime closing) before it ran
                for r in ranges:
                    batch._settle(r, State.CANCELLED)

        fut.add_done_callback(dropped)
        batch._futures.append(fut)

    def _batchable(self, src: Any, dst: Any) -> Resolution | None:
        """The resolution when one side is a ref reached through a batching engine (not a
        direct route) and the other a local buffer."""
        if isinstance(src, RefSpec) == isinstance(dst, RefSpec):
            return None
        spec = src if isinstance(src, RefSpec) else dst
        try:
            res = self._resolver.resolve(spec)
        except (MemsemError, ValueError, TypeError):
            return None  # reported by the range itself
        if res.cb is None and not res.engine.versions and remote_slots(res) > 1:
            return None  # a double-buffered window on another node: each range picks its slot
        return res if res.engine.batches and not res.direct else None

    def _copy_batch(self, group: list[tuple[RangeResult, Any, Any]], batch: Batch, lease: Lease | None) -> None:
        """Hand ranges of one window to its engine's ``submit`` as one batch, each range in its
        own bracket."""
        ops: list[tuple[RangeResult, RefSpec, Op, Any]] = []
        for r, src, dst in group:
            if not batch._start(r):
                continue
            try:
                spec, local, put = (src, dst, False) if isinstance(src, RefSpec) else (dst, src, True)
                flat, info = as_byte_array(local, "dst" if not put else "src", writable=not put)
                if info.nbytes != spec.nbytes:
                    raise ValueError(f"xcopy sizes differ: ref {spec.nbytes} bytes, buffer {info.nbytes} bytes")
                if put and not spec.writable:
                    raise tr.read_only_ref(spec)
                res = self._resolver.resolve(spec)
                if lease is not None and lease.spec.gva == spec.gva:
                    lease.check("before the transfer")
                st = _ffi.new("uint64_t[5]")
                rc = _open(res.plan, put, spec.offset, spec.nbytes, 0, 0, 0, st)
                if (rc & tr.RC_STATUS) == tr.CHECK_FIRST:
                    res.peer_checked()  # PeerLostError when the owner died
                    rc = _open(res.plan, put, spec.offset, spec.nbytes, 0, 0, 0, st)
                if rc != tr.OK:
                    if rc & tr.RC_LAST_OUT:
                        res.release()
                    raise self._failure(rc & tr.RC_STATUS, rc, res, spec, put, None, 0)
                op = Op(OpKind.PUT if put else OpKind.GET, res.remote, spec.offset, flat)
                ops.append((r, spec, op, (res, st, put)))
            except BaseException as exc:
                batch._settle(r, State.FAILED, exc)
        if not ops:
            return
        eng = ops[0][3][0].engine
        req = eng.submit([o[2] for o in ops])
        try:
            req.wait(self._core.timeout)
        except MemsemTimeoutError as exc:
            for r, spec, op, (res, st, put) in ops:
                batch._settle(r, State.FAILED, exc)
            # The hardware still owns the buffers: close the brackets when the ops end.
            self._pool.submit(_close_late, req, [o[3] for o in ops], self._core.timeout)
            return
        for r, spec, op, (res, st, put) in ops:
            rc = _close(res.plan, put, spec.nbytes, 0, 0, st, 0 if op.state == OpState.DONE else 1)
            if rc & tr.RC_LAST_OUT:
                res.release()
            if op.state == OpState.DONE and not (rc & tr.RC_STATUS):
                if lease is not None and lease.spec.gva == spec.gva and lease.expired():
                    batch._settle(r, State.FAILED, tr.lease_expired(spec, "during the transfer"))
                else:
                    batch._settle(r, State.DONE)
            elif op.state == OpState.DONE:
                batch._settle(r, State.FAILED, self._failure(rc & tr.RC_STATUS, rc, res, spec, put, None, 0))
            else:
                err = op.error or MemsemError(f"xcopy range {r.index}: engine op ended {op.state.name}")
                if isinstance(err, MemsemError) and not isinstance(err, EngineError):
                    batch._settle(r, State.FAILED, err)
                else:
                    batch._settle(r, State.FAILED, tr.chain(tr.engine_failure(err, spec, res.peer, "xcopy"), err))

    def _copy_one(self, src: Any, dst: Any, lease: Lease | None) -> None:
        t0 = time.perf_counter_ns()

        def lease_for(spec: RefSpec) -> Lease | None:
            # The lease is checked for the ranges of its own window only.
            return lease if lease is not None and lease.spec.gva == spec.gva else None

        if isinstance(src, RefSpec) and isinstance(dst, RefSpec):
            if src.nbytes != dst.nbytes:
                raise ValueError(f"xcopy sizes differ: src {src.nbytes} bytes, dst {dst.nbytes} bytes")
            if not dst.writable:
                raise tr.read_only_ref(dst, "xcopy")
            rs = self._resolver.resolve(src)
            if rs.route.zero_copy and rs.direct and not rs.remote.direct.cma:
                self._copy_mapped(rs, src, dst, lease_for(src), lease_for(dst))
            else:
                bounce = np.empty(src.nbytes, np.uint8)
                self.transfer_array(src, False, 0, bounce, lease=lease_for(src))
                self.transfer_array(dst, True, 0, bounce, lease=lease_for(dst))
                self._core.telemetry.bounce_bytes += src.nbytes
        elif isinstance(src, RefSpec):
            flat, info = as_byte_array(dst, "dst", writable=True)
            if info.nbytes != src.nbytes:
                raise ValueError(f"xcopy sizes differ: src ref {src.nbytes} bytes, dst {info.nbytes} bytes")
            self.transfer(src, False, 0, info.address, info.nbytes, flat, lease_for(src))
        else:
            flat, info = as_byte_array(src, "src", writable=False)
            if info.nbytes != dst.nbytes:
                raise ValueError(f"xcopy sizes differ: src {info.nbytes} bytes, dst ref {dst.nbytes} bytes")
            self.transfer(dst, True, 0, info.address, info.nbytes, flat, lease_for(dst))
        self._core.telemetry.record_latency("xcopy", time.perf_counter_ns() - t0)

    def _copy_mapped(self, rs: Resolution, src: RefSpec, dst: RefSpec, src_lease: Lease | None,
                     dst_lease: Lease | None) -> None:
        """Ref to ref with the source mapped here: one copy straight from its memory, inside the
        source's bracket (the bytes put count only if the source did not move meanwhile)."""
        if src_lease is not None:
            src_lease.check("before the transfer")
        ls, lid = src_lease.native_args(src) if src_lease is not None else (0, 0)
        st = _ffi.new("uint64_t[5]")
        rc = _open(rs.plan, 0, src.offset, src.nbytes, 0, ls, lid, st)
        if rc != tr.OK:
            if rc & tr.RC_LAST_OUT:
                rs.release()
            status = rc & tr.RC_STATUS
            if status in (tr.BUSY, tr.CLOSED):  # take the general path (waits, re-resolves)
                bounce = np.empty(src.nbytes, np.uint8)
                self.transfer_array(src, False, 0, bounce, lease=src_lease)
                self.transfer_array(dst, True, 0, bounce, lease=dst_lease)
                self._core.telemetry.bounce_bytes += src.nbytes
                return
            raise self._failure(status, rc, rs, src, False, src_lease, 0)
        failed = True
        try:
            self.transfer(dst, True, 0, int(st[4]), src.nbytes, rs.remote, dst_lease)
            failed = False
        finally:
            rc = _close(rs.plan, 0, src.nbytes, ls, lid, st, 1 if failed else 0)
            if rc & tr.RC_LAST_OUT:
                rs.release()
        if rc & tr.RC_STATUS:
            raise self._failure(rc & tr.RC_STATUS, rc, rs, src, False, src_lease, 0)


def _chunks(jobs: list[tuple[RangeResult, Any, Any]], workers: int) -> list[list[tuple[RangeResult, Any, Any]]]:
    """Split xcopy ranges into at most ``workers`` tasks of about equal bytes (one task when
    they hold less than ``XCOPY_TASK_BYTES`` in all): a task per range would cost a hand-off
    to a worker thread per range."""
    if not jobs:
        return []
    total = sum(j[0].nbytes for j in jobs)
    n = 1 if total < XCOPY_TASK_BYTES else max(1, min(workers, len(jobs)))
    if n == 1:
        return [jobs]
    out: list[list[tuple[RangeResult, Any, Any]]] = [[]]
    share = total / n
    acc = 0
    for j in jobs:
        if out[-1] and acc >= share * len(out) and len(out) < n:
            out.append([])
        out[-1].append(j)
        acc += j[0].nbytes
    return out


def _size_mismatch(arg: str, n: int, spec: RefSpec) -> ValueError:
    return ValueError(f"{arg} holds {n} bytes; the ref is {spec.nbytes} bytes "
                      f"({spec.shape} {_dtypes.name_of(spec.dtype_code)})")


def _close_late(req: Any, brackets: list[tuple[Resolution, Any, bool]], timeout: float) -> None:
    """Close the brackets of a batch that timed out once its ops end (bounded waits)."""
    for _ in range(100):
        try:
            req.wait(timeout)
            break
        except MemsemTimeoutError:
            continue
    for res, st, put in brackets:
        rc = _close(res.plan, put, 0, 0, 0, st, 1)
        if rc & tr.RC_LAST_OUT:
            res.release()


__all__ = ["Transfers"]
