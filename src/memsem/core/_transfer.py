"""Data movement: get, put, xcopy and the asynchronous forms.

Same node, the whole check-and-copy is one native call (``memsem_plan_copy``): range,
permission, lease, generation and version before and after (seqlock), in-flight accounting and
telemetry. The Python side picks the resolution's plan and reads one integer back; only an
unusual outcome (a stale ref, an open write section, a liveness re-check that is due, a closed
resolution) takes the slow path here: one retry loop (``Transfers.run``) around one try per
strategy of the resolution (``Transfers._attempt``). Other routes run the same checks around the
engine's call inside the copy bracket (``memsem.core._bracket``), so the rules are written once.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import _args, _dtypes, _hot, native
from memsem._buffers import address_view, array_address, as_byte_array, check_dtype
from memsem._errors import (
    EngineError,
    NotSupportedError,
    StaleReferenceError,
)
from memsem.engines import WATCH_HEADER, RemoteOutcome
from memsem.gva import RefSpec
from memsem.gva._control_block import W_GENERATION, W_LATEST, W_NSLOTS, W_SEQ0, W_SEQ1, W_SLOT_STRIDE
from memsem.core import _translate as tr
from memsem.core._completion import Batch, Completion, State
from memsem.core._lease import Lease
from memsem.core._bracket import ATTENTION, Bracket, KeptBracket, Outcome, Status, engine_failure, failure, settle
from memsem.core._remote import RemoteWords
from memsem.core._resolve import Resolution, Resolver, Strategy, remote_slots
from memsem.core._wait import Wait, window_checks
from memsem.core._xcopy import XCopier

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore

_copy = native.lib.memsem_plan_copy
_PENDING, _LOST, _SENDING = _hot.RC_WIRE_PENDING, _hot.RC_WIRE_LOST, _hot.RC_WIRE_SENDING
_STATUS = native.lib.MEMSEM_RC_STATUS_MASK
#: a kept route that cannot serve (``KeptWire.transfer``): nothing done; keep it anew (every
#: attention bit: a result word no native call returns)
ROUTE_STALE = native.lib.MEMSEM_RC_ATTENTION
_hot_copy = _hot.copy
_RC_BUFFER = _hot.RC_BUFFER
_DONE = State.DONE
_OK = Status.OK
_ATTN = ATTENTION
_SHIFT = native.lib.MEMSEM_RC_VERSION_SHIFT
_UINT8 = _dtypes.code_of("uint8")
#: numpy dtypes a destination or source may have (plain numbers and bools) -> wire code
_PLAIN = _dtypes.NUMPY_CODES
#: torn reads retried at once before waiting on the sequence word
_TORN_SPINS = 3


def _lease_args(lease: Lease | None, spec: RefSpec) -> tuple[int, int]:
    """The native lease arguments of a copy of ``spec`` (``(0, 0)``: no lease here)."""
    return lease.native_args(spec) if lease is not None else (0, 0)


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
        #: per resolution, the header words read after its last one-sided checked copy
        #: (``_onesided_get``); they go with the resolution
        self._headers: "weakref.WeakKeyDictionary[Resolution, list[int]]" = weakref.WeakKeyDictionary()

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
        already (a kept route's request): no request and no retry goes past it (None: the
        runtime's timeout from now).
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

        def attempt(r: Resolution) -> Outcome:
            return self._attempt(r, spec, put, offset, addr, n, keep, lease, version, signal_tile, deadline)

        if res.strategy is Strategy.DIRECT:
            ls, lid = _lease_args(lease, spec)
            rc = _copy(res.plan, put, spec.offset + offset, addr, n, version, ls, lid)
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
        def attempt(r: Resolution) -> Outcome:
            return self._attempt(r, spec, put, offset, addr, n, keep, lease, version, None, deadline)

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

    def _attempt(self, res: Resolution, spec: RefSpec, put: bool, offset: int, addr: int, n: int, keep: Any,
                 lease: Lease | None, version: int, signal_tile: int | None, deadline: float | None) -> Outcome:
        """One try of a transfer through ``res``'s strategy (``Resolution.strategy``)."""
        ls, lid = _lease_args(lease, spec)
        at = spec.offset + offset
        strategy = res.strategy
        if strategy is Strategy.DIRECT:
            return settle(res, _copy(res.plan, put, at, addr, n, version, ls, lid))
        eng = res.engine
        if strategy is Strategy.UNCHECKED:
            raise NotSupportedError(f"route {res.route.kind} to {spec.label} cannot check the window's "
                                    "generation (no control block here and the engine does not enforce it)")
        remote_words = res.cb is None
        if strategy is Strategy.ONE_SIDED and not put and (version or remote_slots(res) > 1):
            return self._onesided_get(res, spec, res.remote_for(spec), at, address_view(addr, n, keep), version)
        if remote_words and strategy is Strategy.ENGINE and (version or remote_slots(res) > 1):
            raise NotSupportedError(f"route {res.route.kind} to {spec.label} cannot read versions: the owner's "
                                    "control words are not readable from here")
        owner = strategy is Strategy.OWNER_CHECKED
        b = Bracket(res)
        o = b.open(put, at, n, 0 if remote_words else version, ls, lid)
        if not o.ok:
            return o
        flat = address_view(addr, n, keep)
        moved = 0
        try:
            if lease is not None and not ls:  # held in the directory (another node): checked here
                lease.check("before the transfer")
            remote = res.remote_for(spec)
            if owner:
                moved = eng.put_version(remote, at, flat, deadline=deadline) if put else \
                    eng.get_version(remote, at, flat, version, deadline=deadline)
            elif not put:
                eng.get(remote, at, flat)
            elif signal_tile is not None and eng.can_signal(remote):
                eng.put_signal(remote, at, flat, signal_tile, spec.generation)
            else:
                eng.put(remote, at, flat)
        except RemoteOutcome as exc:
            b.close(failed=True)
            refused = Outcome.remote(exc)
            if refused.retry:
                return refused  # the owner found a write section open (or the copy torn): again
            raise self._engine_error(exc, res, spec, put, lease, version, refused) from exc
        except BaseException as exc:
            closed = b.close(failed=True)
            raise self._engine_error(exc, res, spec, put, lease, version, closed) from exc
        o = b.close()
        if o.ok:
            if lease is not None and not ls:
                lease.check("during the transfer; the bytes moved are not valid")
            if owner:
                o.value = moved
        return o

    def _engine_error(self, exc: BaseException, res: Resolution, spec: RefSpec, put: bool, lease: Lease | None,
                      version: int, o: Outcome) -> BaseException:
        """The memsem error for an engine's failure inside the bracket (``o``: the bracket's close
        after it, or the owner's refusal). On another node's window a moved generation shows up
        as an access fault (a revoked rkey) or a refusal: the directory tells which it was."""
        if o.status is Status.GEN_AFTER or isinstance(exc, RemoteOutcome):
            return engine_failure(exc, res, spec, put=put, lease=lease, version=version, closed=o)
        if isinstance(exc, StaleReferenceError):
            res.resolver.drop(spec.gva, res)
            if lease is not None and lease.expired():
                return tr.lease_expired(spec, "during the transfer and the owner reclaimed the window; the bytes "
                                              "moved are not valid")
            return exc
        if res.cb is None and isinstance(exc, EngineError):
            now = self._resolver.generation_now(spec)
            if now != spec.generation:
                res.resolver.drop(spec.gva, res)
                res.telemetry.count_error("stale")
                return tr.stale(spec, now, during=True)
        return engine_failure(exc, res, spec, put=put, lease=lease, version=version)

    def _onesided_get(self, res: Resolution, spec: RefSpec, remote: Any, at: int, flat: np.ndarray,
                      version: int) -> Outcome:
        """One try of reading ``flat.nbytes`` bytes at ``at`` of version ``version`` (0: the
        latest) of a window whose owner is on another node, through an engine that reads its
        control words one-sidedly (rdma): a seqlock over the wire. The header words
        (generation, latest version, slot sequence words) read *before* the copy are, when they
        can serve, the ones read *after* the previous copy of this resolution (kept in
        ``_headers``): then a read costs 2 round trips (copy, header), else 3 (header, copy,
        header). The copy counts only if the slot's sequence word is the same after it as
        before it; a read of the latest version from a kept header also needs the
        latest-version word unchanged after the copy. A kept header only ever leads to a copy:
        every other decision (wait, version gone) is taken on a header read in this try. Why a
        kept header is as good as a fresh one: docs/rdma.md ("A checked read in 2 round
        trips"). The outcome is what a native bracket would say (BUSY: a write section is open
        on the slot or the version is not committed; TORN; VERSION_GONE; GEN_BEFORE /
        GEN_AFTER), retried by ``run`` within the runtime's timeout.
        """
        eng = res.engine

        def header() -> list[int]:
            h = eng.read_words(remote, WATCH_HEADER, 0, W_SEQ1 + 1)
            if h[W_GENERATION] != spec.generation:
                h[W_GENERATION] = eng.read_words(remote, WATCH_HEADER, W_GENERATION, 1)[0]  # never a torn word
            return h

        h = self._headers.get(res)
        fresh = h is None
        if fresh:
            h = header()
        while True:  # at most twice: a kept header, then one read in this try
            if h[W_GENERATION] != spec.generation:
                return Outcome(Status.GEN_BEFORE, h[W_GENERATION])
            nslots = 2 if h[W_NSLOTS] == 2 else 1
            v = version or h[W_LATEST]
            slot = v % nslots if nslots > 1 else 0
            seq = h[W_SEQ0 + slot]
            if seq != v << 1:
                if not fresh:  # the kept header cannot serve this read: read the words now
                    h, fresh = header(), True
                    continue
                if version and seq >> 1 > version:
                    return Outcome(Status.VERSION_GONE, seq >> 1)
                return Outcome(Status.BUSY, seq >> 1)
            eng.get(remote, slot * (h[W_SLOT_STRIDE] if nslots > 1 else 0) + at, flat)
            after = header()
            self._headers[res] = after
            if after[W_GENERATION] != spec.generation:
                return Outcome(Status.GEN_AFTER, after[W_GENERATION])
            moved = after[W_SEQ0 + slot]
            if moved == seq and (fresh or version or after[W_LATEST] == v):
                return Outcome(Status.OK, v)
            if moved != seq:
                if version and moved >> 1 > version:
                    return Outcome(Status.VERSION_GONE, moved >> 1)
                return Outcome(Status.TORN, 0)
            # an intact copy of the version a kept header named, but a newer one is the latest:
            # the header read after the copy (in this try) decides
            h, fresh = after, True

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
            res = self._cache.get(spec.gva)
            if res is not None and res.direct and res.generation == spec.generation and res.key == spec.key:
                if lease is None:
                    rc = _hot_copy(res.addr, 0, spec.offset, out, spec.nbytes, spec.dtype_code, version)
                else:
                    rc = _hot_copy(res.addr, 0, spec.offset, out, spec.nbytes, spec.dtype_code, version,
                                   *lease.native_args(spec))
                if not rc & _ATTN:
                    return rc >> _SHIFT, out
                return self.after_hot(rc, res, spec, out, lease, version)
        return self._get(spec, out, lease, version)

    def hot_args(self, spec: RefSpec) -> tuple[Any, ...] | None:
        """What a ref keeps to make its next plain gets and puts one native call without a cache
        lookup: ``(keeper, plan address, offset, nbytes, dtype code, spec, writable, this
        runtime's ``token``, plan)`` (writable: the ref may put) when ``spec``'s cached
        resolution copies here natively (same node), else None.

        ``keeper`` is the resolution's ``[resolution]``, emptied (``[None]``) at its release, so
        a ref never keeps a released resolution, its owner's pidfd or its runtime alive; the
        plan (its native memory, about 2 KiB) stays with the ref, so a call racing the release
        reads valid memory, whose use word, closed before any release, refuses it. A mapping is
        released only by a release, so no plan a ref can reach copies through a released
        mapping."""
        res = self._cache.get(spec.gva)
        if (res is not None and res.direct and res.generation == spec.generation and res.key == spec.key
                and not res.closed):
            keeper = res.keeper
            if keeper is None:
                keeper = res.keeper = [res]
            return (keeper, res.addr, spec.offset, spec.nbytes, spec.dtype_code, spec, spec.access == "rw",
                    self._core.token, res.plan)
        return None

    def kept_wire(self, spec: RefSpec) -> "KeptWire | None":
        """What a ref keeps to make its next plain gets and puts of ``spec`` one bracket around
        one request (:class:`KeptWire`) when ``spec``'s cached resolution reaches another
        node's window through an owner-checked engine that keeps a small-request path for this
        thread (``Engine.kept``: tcp), else None. Holds what ``hot_args`` holds (the
        resolution's keeper, its plan, this runtime's token), never the resolution."""
        res = self._cache.get(spec.gva)
        if (res is None or res.direct or res.closed or res.strategy is not Strategy.OWNER_CHECKED
                or res.generation != spec.generation or res.key != spec.key):
            return None
        requests = res.engine.kept(res.remote_for(spec), spec.nbytes)
        if requests is None:
            return None
        keeper = res.keeper
        if keeper is None:
            keeper = res.keeper = [res]
        return KeptWire(keeper, spec, self._core.token, res.plan, res.addr, requests)

    def after_hot(self, rc: int, res: Resolution, spec: RefSpec, out: Any, lease: Lease | None = None,
                  version: int = 0, deadline: float | None = None) -> tuple[int, Any]:
        """A get's ``memsem._hot.copy`` result word that needs attention: the buffer's own door
        (RC_BUFFER: nothing was done) or the retry loop. ``(version, out)``. ``deadline``: see
        :meth:`transfer`."""
        if rc != _RC_BUFFER:
            flat, info = as_byte_array(out, "out", writable=True)
            return self._settle(rc, res, spec, False, 0, info.address, info.nbytes, flat, lease, version,
                                deadline), out
        return self._get(spec, out, lease, version, deadline)

    def after_hot_put(self, rc: int, res: Resolution, spec: RefSpec, src: Any, lease: Lease | None = None,
                      deadline: float | None = None) -> int:
        """A put's ``memsem._hot.copy`` result word that needs attention (as :meth:`after_hot`):
        the version overwritten."""
        if rc != _RC_BUFFER:
            flat, info = as_byte_array(src, "src", writable=False)
            return self._settle(rc, res, spec, True, 0, info.address, info.nbytes, flat, lease, 0, deadline)
        return self._put(spec, src, lease, deadline)

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
            res = self._cache.get(spec.gva)
            if res is not None and res.direct and res.generation == spec.generation and res.key == spec.key:
                if lease is None:
                    rc = _hot_copy(res.addr, 1, spec.offset, src, spec.nbytes, spec.dtype_code)
                else:
                    rc = _hot_copy(res.addr, 1, spec.offset, src, spec.nbytes, spec.dtype_code, 0,
                                   *lease.native_args(spec))
                if not rc & _ATTN:
                    return rc >> _SHIFT
                return self.after_hot_put(rc, res, spec, src, lease)
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
            res = self._cache.get(spec.gva)
            if res is not None and res.direct and res.generation == spec.generation and res.key == spec.key:
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


class KeptWire:
    """A ref's kept route to another node's window through an owner-checked engine
    (``Transfers.kept_wire``): a plain get or put of the whole ref is the copy bracket on the
    resolution's plan (opened and closed natively: range, permission, liveness due, in-flight
    count, telemetry) around one small request on the engine's kept path
    (``Engine.kept``), without the cache lookup, the retry loop or the engine's lookups.
    The owner checks the request as any other (generation, key, version, seqlock).

    :meth:`transfer` returns a result word as ``memsem._hot.copy`` does: without attention
    bits, done (the version moved in the high bits); ``RC_BUFFER``, nothing done and the
    route stays (the buffer needs the Python door); :data:`ROUTE_STALE`, nothing done and the
    route must be kept anew (another thread, a closed connection, a recycled handle); a status
    of the bracket (its refusal, or its close after the copy) or the owner's outcome that asks
    for the retry loop (a write section open, a torn copy): nothing that counts was done, and
    the retry loop starts from that outcome. An owner's refusal or an
    engine failure under the request is raised as the whole path raises it.
    """

    __slots__ = ("keeper", "spec", "token", "writable", "deadline", "_bracket", "_plan_address", "_at", "_n",
                 "_code", "_requests")

    def __init__(self, keeper: list[Any], spec: RefSpec, token: object, plan: Any, plan_address: int,
                 requests: Any) -> None:
        self.keeper = keeper
        self.spec = spec
        self.token = token
        self.writable = spec.access == "rw"
        #: the deadline (``time.monotonic()``) of the last :meth:`transfer` that sent a request
        #: (None: none did): what the whole path keeps to when it makes that request again
        self.deadline: float | None = None
        self._bracket = KeptBracket(plan)
        self._plan_address = plan_address
        self._at = spec.offset
        self._n = spec.nbytes
        self._code = spec.dtype_code
        self._requests = requests

    def transfer(self, transfers: "Transfers", put: bool, buf: Any) -> int:
        """Get the ref's bytes into ``buf`` (``put`` False) or put them from it; see the class
        docstring for the result word.

        Raises:
            What the whole path raises for the owner's refusal or an engine failure.
        """
        kr = self._requests
        c = kr.usable()
        if c is None:
            self.deadline = None
            return ROUTE_STALE
        deadline = self.deadline = time.monotonic() + kr.timeout  # the caller's, for every step
        b = self._bracket
        try:
            rc = kr.call(c, b.address, self._plan_address, put, self._at, buf, self._n, self._code)
        except BaseException:  # e.g. an interrupt as the call returns: what moved is unknown
            kr.drop(c)
            b.undo(self.keeper)  # closes the bracket if it is open (else refused, harmlessly)
            raise
        st = rc & _STATUS
        if st != _PENDING and st != _LOST and st != _SENDING:
            return rc  # done, or nothing done (the door, the bracket's refusal or close)
        if st == _LOST:  # the connection failed under the request: the whole path makes it again
            kr.drop(c)
            b.undo(self.keeper)
            return ROUTE_STALE
        mv = memoryview(buf)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        try:
            v = kr.finish(c, rc, put, mv, deadline)
        except RemoteOutcome as exc:
            b.undo(self.keeper)
            refused = Outcome.remote(exc)
            res = self.keeper[0]
            if res is None:
                return ROUTE_STALE
            if refused.retry:  # a write section open, a torn copy...: the retry loop, from this outcome
                return exc.status | exc.value << _SHIFT
            raise transfers._engine_error(exc, res, self.spec, put, None, 0, refused) from exc
        except BaseException as exc:
            closed = b.undo(self.keeper)
            res = self.keeper[0]
            if res is None or closed is None:
                raise
            raise transfers._engine_error(exc, res, self.spec, put, None, 0, closed) from exc
        if v is None:  # the connection failed under the request: the whole path makes it again
            b.undo(self.keeper)
            return ROUTE_STALE
        return b.close(v)


def _size_mismatch(arg: str, n: int, spec: RefSpec) -> ValueError:
    return ValueError(f"{arg} holds {n} bytes; the ref is {spec.nbytes} bytes "
                      f"({spec.shape} {_dtypes.name_of(spec.dtype_code)})")


__all__ = ["KeptWire", "ROUTE_STALE", "Transfers"]
