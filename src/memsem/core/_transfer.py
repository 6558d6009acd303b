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
    AccessDeniedError,
    EngineError,
    MemsemError,
    NotSupportedError,
    StaleReferenceError,
)
from memsem.engines import WATCH_HEADER, RemoteOutcome
from memsem.gva import RefSpec
from memsem.gva._control_block import W_GENERATION, W_LATEST, W_NSLOTS, W_SEQ0, W_SEQ1, W_SLOT_STRIDE
from memsem.core import _translate as tr
from memsem.core._completion import Batch, Completion, State
from memsem.core._lease import Lease
from memsem.core._liveness import WAIT_SLICE_S
from memsem.core._resolve import Resolution, Resolver, remote_slots
from memsem.core._xcopy import XCopier

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore

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
        self._xcopier = XCopier(self, resolver, pool)

    def counted(self, fn: Any) -> Any:
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
                raise self.failure(status, rc, res, spec, put, lease, version)
            if not res.direct:
                return self._via_engine(res, spec, put, offset, addr, n, keep, lease, version, signal_tile)
            if lease is None:
                ls = lid = 0
            else:
                ls, lid = lease.native_args(spec)
            rc = _copy(res.plan, put, spec.offset + offset, addr, n, version, ls, lid)

    def failure(self, status: int, rc: int, res: Resolution, spec: RefSpec, put: bool,
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
        """Routes the CPU cannot copy on by itself: the engine moves the bytes inside the bracket.
        An owner-checked engine's TORN or BUSY outcome makes the transfer again, within the
        runtime's timeout (the owner waited for BUSY already, up to its cap)."""
        deadline = None
        while True:
            try:
                return self._via_engine_once(res, spec, put, offset, addr, n, keep, lease, version, signal_tile)
            except RemoteOutcome as exc:  # ADAPTER (issue 20 §1): see owner_checked_failure
                self._core.telemetry.count_error("torn" if exc.status == tr.TORN else "busy")
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._core.timeout
                if now >= deadline:
                    raise tr.busy_timeout(spec, self._core.timeout) from exc
                res = self._resolver.resolve(spec)
                if res.direct:
                    return self.transfer(spec, put, offset, addr, n, keep, lease, version, signal_tile)

    def _via_engine_once(self, res: Resolution, spec: RefSpec, put: bool, offset: int, addr: int, n: int,
                         keep: Any, lease: Lease | None, version: int, signal_tile: int | None) -> int:
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
            raise self.failure(status, rc, res, spec, put, lease, version)
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
            if isinstance(exc, (RemoteOutcome, AccessDeniedError)) and (rc & tr.RC_STATUS) != tr.GEN_AFTER:
                err = owner_checked_failure(self._core, exc, res, spec, put=put, lease=lease, version=version)
                if err is exc:
                    raise
                raise err from exc
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
                raise self.failure(status, rc, res, spec, put, lease, version)
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
        return Completion.run(self._pool, what, self.counted(fn), timeout=self._core.timeout)

    # -- xcopy (memsem.core._xcopy) -----------------------------------------------------------------
    def xcopy(self, pairs: Sequence[tuple[Any, Any]], *, lease: Lease | None = None) -> Batch:
        """Start a batch of copies (see ``memsem.core._xcopy.XCopier.xcopy``)."""
        return self._xcopier.xcopy(pairs, lease=lease)


# ADAPTER (issue 20 §1): until branch ``prim``'s one outcome -> error function replaces it.
def owner_checked_failure(core: "RuntimeCore", exc: BaseException, res: Resolution, spec: RefSpec, *,
                          put: bool = False, lease: Lease | None = None, version: int = 0,
                          kind: str = "") -> BaseException:
    """The memsem error for what an owner-checked engine (tcp) raised on ``res``'s route.

    * :class:`RemoteOutcome`: the owner's native outcome, translated exactly as the same outcome
      of a local copy (``Transfers.failure``; a generation found 0 is a window that is gone).
      TORN and BUSY are returned as they are: the caller makes the transfer again.
    * AccessDeniedError (or an EngineError) for a window on another node: an owner says nothing
      about a window to a credential it refuses, so the directory, which this runtime trusts,
      tells whether the window moved on: StaleReferenceError then, else the error itself (an
      EngineError translated as every engine failure).
    """
    kind = kind or ("put" if put else "get")
    if isinstance(exc, RemoteOutcome):
        status = exc.status
        if status in (tr.TORN, tr.BUSY):
            return exc
        if status in (tr.GEN_BEFORE, tr.GEN_AFTER) and not exc.value:
            core.resolver.drop(spec.gva, res)
            core.telemetry.count_error("stale")
            return tr.stale(spec, None, during=status == tr.GEN_AFTER)
        return core.transfers.failure(status, status | (exc.value << _SHIFT), res, spec, put, lease, version)
    if res.cb is None and isinstance(exc, (AccessDeniedError, EngineError)):
        rec = core.directory.get_window(spec.gva)
        if rec is None or int(rec.get("generation", -1)) != spec.generation:
            core.resolver.drop(spec.gva, res)
            core.telemetry.count_error("stale")
            return tr.stale(spec, None if rec is None else int(rec["generation"]))
    if isinstance(exc, AccessDeniedError):
        return exc
    return tr.engine_failure(exc, spec, res.peer, kind)


def _size_mismatch(arg: str, n: int, spec: RefSpec) -> ValueError:
    return ValueError(f"{arg} holds {n} bytes; the ref is {spec.nbytes} bytes "
                      f"({spec.shape} {_dtypes.name_of(spec.dtype_code)})")


__all__ = ["Transfers", "owner_checked_failure"]
