"""Data movement: get, put, xcopy and the asynchronous forms.

Every copy goes through the route its resolution chose once (``memsem.core._routes``): same
node, the whole check-and-copy is one native call (``memsem_plan_copy``: range, permission,
lease, generation and version before and after, in-flight accounting and telemetry); other
routes run the same checks around the engine's call inside the copy bracket
(``memsem.core._bracket``). Whatever a route's attempt comes to, the one retry loop
(``Transfers.run``) decides what follows: a stale ref, an open write section, a liveness
re-check that is due, a closed resolution. A ref holds its route (``Transfers.ref_route``) for
its next plain gets and puts; what that route does not finish comes back here once
(``Transfers.after_route``).
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import _args, _dtypes, _hot, native
from memsem._buffers import array_address, as_byte_array, check_dtype
from memsem._errors import NotSupportedError
from memsem.gva import RefSpec
from memsem.core import _translate as tr
from memsem.core._completion import Batch, Completion
from memsem.core._lease import Lease
from memsem.core._bracket import ATTENTION, Outcome, Status, failure, settle
from memsem.core._remote import RemoteWords
from memsem.core._resolve import Resolution, Resolver
from memsem.core._routes import ROUTE_LOST, ROUTE_STALE, PlanRoute, WireRoute, lease_args
from memsem.core._wait import Wait, window_checks
from memsem.core._xcopy import XCopier

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore

_copy = native.lib.memsem_plan_copy
_hot_copy = _hot.copy
_RC_BUFFER = _hot.RC_BUFFER
_OK = Status.OK
_ATTN = ATTENTION
_SHIFT = native.lib.MEMSEM_RC_VERSION_SHIFT
#: torn reads retried at once before waiting on the sequence word
_TORN_SPINS = 3


class Transfers:
    """The data path of one runtime (get/put/xcopy); see the module docstring."""

    def __init__(self, core: "RuntimeCore", resolver: Resolver, pool: cf.ThreadPoolExecutor,
                 mirrors: RemoteWords, workers: int) -> None:
        self._core = core
        self._resolver = resolver
        #: the mirrors of remote windows' control words (a retry sleeps on their words)
        self._mirrors = mirrors
        self._cache = resolver.cache
        self._pool = pool
        #: tasks of the pool running right now (close waits for them within its deadline)
        self._running = 0
        self._idle = threading.Condition()
        self._xcopier = XCopier(core, self, resolver, pool, workers)

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
                 lease: Lease | None = None, version: int = 0, signal_tile: int | None = None,
                 deadline: float | None = None) -> int:
        """Move ``n`` bytes between ``addr`` (here; ``keep`` owns that memory) and the window at
        ``spec.offset + offset``. Blocking; remote completion. Returns the version whose bytes
        were read or overwritten.

        ``version`` 0 reads the latest committed version, else exactly that one (callers pass
        it through ``_args.version``). ``signal_tile`` (puts): where the route's engine can
        signal tiles (mte ``aclshmemx_putmem_signal``) the tile's signal word is set after the
        data. ``deadline`` (``time.monotonic()``): the caller's, when a part of the call ran
        already (a ref's wire route sent a request): no request and no retry goes past it (None: the
        runtime's timeout from now).
        """
        if offset < 0 or n < 0 or offset + n > spec.nbytes:
            raise tr.out_of_range(spec, offset, offset + n, spec.nbytes, "the ref")
        if put and not spec.writable:
            raise tr.read_only_ref(spec)
        res = self.cached(spec)
        if res is None:
            res = self._resolver.resolve(spec)
        if lease is not None and lease.spec.gva != spec.gva:
            if put and not res.writable:
                raise tr.read_only(spec)  # the window's permission is checked first, as always
            raise ValueError(f"lease is for {lease.spec.label}, not {spec.label}")
        at = spec.offset + offset

        def attempt(r: Resolution) -> Outcome:
            return r.strategy.attempt(r, spec, put, at, addr, n, keep, lease, version, signal_tile, deadline)

        if res.direct:
            ls, lid = lease_args(lease, spec)
            rc = _copy(res.plan, put, at, addr, n, version, ls, lid)
            if not rc & _ATTN:
                return rc >> _SHIFT
            return self.run(spec, res, attempt, put=put, lease=lease, version=version, first=settle(res, rc),
                            deadline=deadline)
        return self.run(spec, res, attempt, put=put, lease=lease, version=version, deadline=deadline)

    def run(self, spec: RefSpec, res: Resolution, attempt: Callable[[Resolution], Outcome], *, put: bool = False,
            lease: Lease | None = None, version: int = 0, first: Outcome | None = None,
            deadline: float | None = None) -> int:
        """The one retry loop of a copy: ``attempt(resolution)`` tries it once and says what it
        came to (``first``: what a try made already came to); returns the version moved.

        Retried, within one wait armed at the first retry (so no retry outlives the runtime's
        timeout): a closed resolution (resolved again), a liveness check that is due (done:
        ``PeerLostError`` when the owner died), an open write section or a version not yet
        committed (asleep on the word its close will move), a torn copy (made again, after
        ``_TORN_SPINS`` immediate tries asleep like a write section). ``deadline``: the
        caller's (``time.monotonic()``), which the wait never outlasts. Every other outcome is
        its memsem error (``_bracket.failure``).

        Raises:
            MemsemTimeoutError: still busy or torn when the runtime's timeout ran out.
            StaleReferenceError, LeaseExpiredError, PeerLostError, AccessDeniedError, ...
        """
        wait: Wait | None = None
        spins = 0
        o = first
        while True:
            if o is None:
                o = attempt(res)
            if o.status is _OK:
                if o.check_peer:
                    res.peer_checked()
                if o.value > res.seen:  # a version label never older than these bytes
                    res.seen = o.value
                return o.value
            st = o.status
            if not o.retry:
                raise failure(o, res, spec, put=put, lease=lease, version=version)
            if wait is None:
                wait = self._busy_wait(spec, res, version, deadline)
            if st is Status.CLOSED:
                res = self._resolver.resolve(spec)  # raises RuntimeClosedError when closed
                wait.rechecking(self._busy_checks(res, spec))
                wait.check()
            elif st is Status.CHECK_FIRST:
                res.peer_checked()  # PeerLostError when the owner died: nothing was written
                wait.check()
            else:
                self._core.telemetry.count_error("torn" if st is Status.TORN else "busy")
                spins += 1
                if spins <= _TORN_SPINS:
                    wait.check()
                else:
                    self._sleep_busy(wait, res, spec, version)
            o = None

    def _settle(self, rc: int, res: Resolution, spec: RefSpec, put: bool, offset: int, addr: int, n: int,
                keep: Any, lease: Lease | None, version: int, deadline: float | None = None) -> int:
        """A hot-path result word that needs attention (``memsem._hot.copy``): the retry loop."""
        at = spec.offset + offset

        def attempt(r: Resolution) -> Outcome:
            return r.strategy.attempt(r, spec, put, at, addr, n, keep, lease, version, None, deadline)

        return self.run(spec, res, attempt, put=put, lease=lease, version=version, first=settle(res, rc),
                        deadline=deadline)

    def _busy_wait(self, spec: RefSpec, res: Resolution, version: int, deadline: float | None) -> Wait:
        also = f" (or version {version} was not committed)" if version else ""
        t = self._core.timeout
        if deadline is not None:
            t = min(t, max(0.0, deadline - time.monotonic()))
        return Wait(f"{spec.label}: a write section", t, telemetry=self._core.telemetry,
                    state=f"stayed open{also}; no bytes were returned, still", recheck=self._busy_checks(res, spec))

    def _busy_checks(self, res: Resolution, spec: RefSpec) -> Callable[[], None]:
        # the generation and liveness re-checks of a retry's sleep (a remote window's generation
        # is checked by its next try: the owner or the engine says it)
        return window_checks(res, spec, res.cb if res.cb is not None and not res.cb.closed else None)

    def _sleep_busy(self, wait: Wait, res: Resolution, spec: RefSpec, version: int) -> None:
        """One slice asleep on the word an open write section's close (or the commit of the
        version asked for) will move: the slot's sequence word mapped here, or the mirror of a
        remote window's latest-version word (pushed by its owner, or read one-sidedly)."""
        if res.cb is not None:
            wait.sleep(lambda s: res.wait_sequence(version, s))
            return
        try:
            m = self._mirrors.control(res, spec)
        except NotSupportedError:
            wait.pause()  # the route cannot watch the owner's words: nothing to wait on
            return
        wait.sleep_word(m.latest_addr, native.load_acquire(m.latest_addr), m)

    # -- get / put --------------------------------------------------------------------------------
    # The common case is one C call (memsem._hot.copy): the buffer's door checks (plain dtype,
    # C-contiguous, writable, exact size; for a put the ref's dtype or uint8) through the buffer
    # protocol, then memsem_plan_copy with every window check. Whatever that call does not take
    # (torch tensors, DLPack, a wrong size or dtype...) it hands back untouched (RC_BUFFER) and
    # the Python door below accepts it or raises the error that names the argument.
    def get(self, spec: RefSpec, out: Any = None, lease: Lease | None = None, version: int = 0,
            deadline: float | None = None) -> Any:
        """Blocking get of the whole ref into ``out`` (or a new array of ``spec.shape`` and the
        ref's dtype); returns it (``out``'s own object when given). ``deadline``: see
        :meth:`transfer`."""
        if deadline is not None:
            return self._get(spec, out, lease, version, deadline)[1]
        return self.get_versioned(spec, out, lease, version)[1]

    def get_versioned(self, spec: RefSpec, out: Any = None, lease: Lease | None = None,
                      version: int = 0) -> tuple[int, Any]:
        """``get`` that also says which version's bytes it returned: ``(version, out)``. The
        version is the copy bracket's (the slot's sequence word around the copy, here or at the
        owner), so it always agrees with the bytes, whatever the route.

        ``out`` must have the ref's dtype, or be uint8 (raw bytes; a uint8 ref takes any out):
        a dtype mismatch is a TypeError, never a reinterpretation."""
        if version.__class__ is not int or version:  # 0 is the common case: the door for the rest
            version = _args.version(version, "version")
        if out is not None and (lease is None or lease.spec.gva == spec.gva):
            res = self.cached(spec)
            if res is not None and res.direct:
                if lease is None:
                    rc = _hot_copy(res.addr, 0, spec.offset, out, spec.nbytes, spec.dtype_code, version)
                else:
                    rc = _hot_copy(res.addr, 0, spec.offset, out, spec.nbytes, spec.dtype_code, version,
                                   *lease.native_args(spec))
                if not rc & _ATTN:
                    return rc >> _SHIFT, out
                return self.after_copy(rc, res, spec, False, out, lease, version), out
        return self._get(spec, out, lease, version)

    def cached(self, spec: RefSpec) -> Resolution | None:
        """The cached resolution that serves ``spec`` as it is (its generation and key), else None
        (the whole path resolves it): the one cache-hit check of the data path."""
        res = self._cache.get(spec.gva)
        if res is not None and res.generation == spec.generation and res.key == spec.key:
            return res
        return None

    def ref_route(self, spec: RefSpec) -> PlanRoute | WireRoute | None:
        """The route a ref holds for its next plain gets and puts of ``spec``
        (``Route.ref_route`` of its cached, unreleased resolution), or None: the whole path."""
        res = self.cached(spec)
        if res is None or res.closed:
            return None
        return res.strategy.ref_route(res, spec, self._core.token)

    def after_route(self, spec: RefSpec, route: PlanRoute | WireRoute | None, rc: int, put: bool,
                    buf: Any) -> PlanRoute | WireRoute | None:
        """The plain get (``put`` False: into ``buf``) or put (from ``buf``) of ``spec`` that a
        ref's route did not finish (``rc``: its result word, which needs attention), or that
        it had no route for (``route`` None): the whole path, from the route's outcome when
        there is one, within the route's deadline when it sent a request. Returns the route
        the ref holds next (the same one when only the buffer needed the Python door, else a
        new one).

        Raises:
            What the get or put raises.
        """
        if route is None and (not put or spec.access == "rw"):  # the first plain get or put here:
            res = self._resolver.resolve(spec)                     # resolve, then take the route
            route = res.strategy.ref_route(res, spec, self._core.token)
            if route is not None and (route.writable or not put):
                rc = route.put(buf) if put else route.get(buf)
                if not rc & _ATTN:
                    return route
            else:
                route = None
        res = None if route is None or rc == ROUTE_STALE or rc == ROUTE_LOST else route.keeper[0]
        # the deadline of the route's own call, when it sent a request (another thread's route
        # sends none: ROUTE_STALE)
        deadline = None if route is None or rc == ROUTE_STALE else route.deadline
        if res is None:
            if put:
                self.put(spec, buf, None, deadline)
            else:
                self.get(spec, buf, None, 0, deadline)
        else:
            self.after_copy(rc, res, spec, put, buf, None, 0, deadline)
        if res is not None and rc == _RC_BUFFER:
            return route  # not a plain buffer: its door; the route stays
        return self.ref_route(spec)

    def after_copy(self, rc: int, res: Resolution, spec: RefSpec, put: bool, buf: Any, lease: Lease | None = None,
                   version: int = 0, deadline: float | None = None) -> int:
        """A plain get's (into ``buf``) or put's (from ``buf``) native result word ``rc`` on
        ``res`` that needs attention (``memsem._hot.copy``, a ref's route): the buffer's own door
        (``RC_BUFFER``: nothing was done), else the retry loop from that outcome. Returns the
        version moved. ``deadline``: see :meth:`transfer`."""
        if rc == _RC_BUFFER:
            return self._put(spec, buf, lease, deadline) if put else self._get(spec, buf, lease, version, deadline)[0]
        flat, info = as_byte_array(buf, "src" if put else "out", writable=not put)
        return self._settle(rc, res, spec, put, 0, info.address, info.nbytes, flat, lease, version, deadline)

    def _get(self, spec: RefSpec, out: Any, lease: Lease | None, version: int,
             deadline: float | None = None) -> tuple[int, Any]:
        if out is None:
            out = np.empty(spec.shape, _dtypes.numpy_dtype(spec.dtype_code))
            n = out.nbytes
            return self.transfer(spec, False, 0, array_address(out) if n else 0, n, out, lease, version,
                                 deadline=deadline), out
        flat, info = as_byte_array(out, "out", writable=True)
        if info.nbytes != spec.nbytes:
            raise _size_mismatch("out", info.nbytes, spec)
        check_dtype("out", info.dtype_code, spec.dtype_code)
        return self.transfer(spec, False, 0, info.address, info.nbytes, flat, lease, version,
                             deadline=deadline), out

    def put(self, spec: RefSpec, src: Any, lease: Lease | None = None, deadline: float | None = None) -> int:
        """Blocking put of ``src`` (exactly the ref's bytes, same dtype or uint8) into the window;
        returns the version overwritten. ``deadline``: see :meth:`transfer`."""
        if deadline is not None:
            return self._put(spec, src, lease, deadline)
        if spec.access == "rw" and (lease is None or lease.spec.gva == spec.gva):
            res = self.cached(spec)
            if res is not None and res.direct:
                if lease is None:
                    rc = _hot_copy(res.addr, 1, spec.offset, src, spec.nbytes, spec.dtype_code)
                else:
                    rc = _hot_copy(res.addr, 1, spec.offset, src, spec.nbytes, spec.dtype_code, 0,
                                   *lease.native_args(spec))
                if not rc & _ATTN:
                    return rc >> _SHIFT
                return self.after_copy(rc, res, spec, True, src, lease)
        return self._put(spec, src, lease)

    def _put(self, spec: RefSpec, src: Any, lease: Lease | None, deadline: float | None = None) -> int:
        flat, info = as_byte_array(src, "src", writable=False)
        n, code = info.nbytes, info.dtype_code
        if n != spec.nbytes:
            raise _size_mismatch("src", n, spec)
        check_dtype("src", code, spec.dtype_code)
        return self.transfer(spec, True, 0, info.address, n, flat, lease, deadline=deadline)

    def get_range(self, spec: RefSpec, offset: int, buf: np.ndarray, lease: Lease | None = None) -> int:
        """Blocking get of ``buf.nbytes`` bytes from ``offset`` bytes into the ref into the flat
        uint8 array ``buf`` (pipeline tiles); the hot path's one C call when it can. Returns the
        version read."""
        n = buf.nbytes
        if (lease is None or lease.spec.gva == spec.gva) and 0 <= offset and offset + n <= spec.nbytes:
            res = self.cached(spec)
            if res is not None and res.direct:
                if lease is None:
                    rc = _hot_copy(res.addr, 0, spec.offset + offset, buf, n, -1)
                else:
                    rc = _hot_copy(res.addr, 0, spec.offset + offset, buf, n, -1, 0, *lease.native_args(spec))
                if not rc & _ATTN:
                    return rc >> _SHIFT
                if rc != _RC_BUFFER:
                    return self._settle(rc, res, spec, False, offset, array_address(buf) if n else 0, n, buf,
                                        lease, 0)
        return self.transfer_array(spec, False, offset, buf, lease=lease)

    def transfer_array(self, spec: RefSpec, put: bool, offset: int, local: np.ndarray, *,
                       lease: Lease | None = None, version: int = 0, signal_tile: int | None = None) -> int:
        """``transfer`` with a flat uint8 numpy array as the local side (pipelines, tiles)."""
        if version.__class__ is not int or version:
            version = _args.version(version, "version")
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


def _size_mismatch(arg: str, n: int, spec: RefSpec) -> ValueError:
    return ValueError(f"{arg} holds {n} bytes; the ref is {spec.nbytes} bytes "
                      f"({spec.shape} {_dtypes.name_of(spec.dtype_code)})")


__all__ = ["Transfers"]
