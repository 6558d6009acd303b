"""Leases: a consumer's time-bounded, renewable claim on a window."""
from __future__ import annotations

import math
import os
import random
import threading
from typing import TYPE_CHECKING, Any, Callable

from memsem import _args, native
from memsem._errors import (
    LeaseExpiredError,
    MemsemError,
    RuntimeClosedError,
    WindowRetiredError,
)
from memsem.engines import RemoteOutcome
from memsem.gva import ControlBlock, RefSpec, WindowState, lease_slots as _lease
from memsem.core import _translate as tr
from memsem.core._bracket import Outcome, failure
from memsem.core._resolve import Resolution

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore

#: the longest finite ttl (seconds): expiries are 64-bit nanosecond clock values
MAX_TTL = _args.MAX_TTL_S
#: the ttl asked for a reservation at another node's owner held "until released" (the owner
#: caps every reservation at its own timeout)
MAX_RESERVATION_S = 3600.0
_FOREVER_NS = 1 << 62
#: a lease slot that is always free: the native check of a released lease fails on it
_NEVER = native.ffi.new("uint64_t[6]")
_NEVER_ADDR = int(native.ffi.cast("uintptr_t", _NEVER))


class Lease:
    """A consumer's time-bounded, renewable claim on a window.

    While unexpired, the owner cannot unpublish or reuse the window (it waits, then fails with
    ``LeaseHeldError``; a forced close warns). Transfers made with the lease check it before and
    after the copy: expiry at any point raises ``LeaseExpiredError``. ``release`` refuses while
    views taken under this lease are alive. A lease of a dead process is reaped by the owner.

    Args:
        runtime: the consumer's runtime.
        spec: the ref whose window is leased.
        ttl: seconds until expiry unless renewed, or None (until released).
        version: for a double-buffered versioned window, the version this lease keeps readable
            (the owner does not overwrite its slot while the lease lasts); 0 pins none.

    Thread safety: any thread may use a lease; a lease belongs to the process that acquired it
    (in a forked child it raises ``RuntimeClosedError``).
    """

    def __init__(self, runtime: "RuntimeCore", spec: RefSpec, ttl: float | None, *, version: int = 0,
                 reserve: bool = False) -> None:
        self.ttl = _args.ttl(ttl)
        self.runtime = runtime
        self.spec = spec
        self.version = _args.version(version, "version")
        #: pin the latest version when ``version`` is 0 (``pin``): at another node's owner, a
        #: reservation of its latest (``version`` then says which)
        self.reserve = bool(reserve)
        self._slot = -1
        self._id = 0
        self._slot_addr = 0  # native address of the lease slot (the hot path checks it natively)
        self._cb: ControlBlock | None = None
        self._views = 0
        self._remote = ""  # lease held in the directory (window on another node): its member id
        #: a version reserved at the owner (window on another node, engine that ``reserves``):
        #: (engine, remote region) it was reserved through
        self._reserved: tuple[Any, Any] | None = None
        self._exp = 0  # its expiry, monotonic ns of this process (conservative: never later than the owner's)
        self._pid = 0
        self._lock = threading.RLock()  # RLock: a view's finalizer may run inside a held section

    @property
    def held(self) -> bool:
        return self._id != 0

    def _ttl_ns(self, ttl: float | None) -> int:
        return _FOREVER_NS if ttl is None else int(ttl * 1e9)

    def _check_process(self) -> None:
        if self._pid and self._pid != os.getpid():
            raise RuntimeClosedError(f"this lease on {self.spec.label} was acquired by pid {self._pid}; "
                                     "a forked child cannot use its parent's leases")

    def acquire(self) -> "Lease":
        """Claim the lease.

        Raises:
            WindowRetiredError: the window is gone, closing, or of another generation.
            PeerLostError: the owner is dead. AccessDeniedError: wrong key.
            MemsemError: no free lease slot. RuntimeClosedError: the runtime is closed.
        """
        if self.held:
            raise MemsemError("lease already held; renew() it instead")
        return acquire_on(self, self.runtime.resolver.resolve(self.spec))

    def _acquire_reserved(self, res: Resolution) -> "Lease":
        """A version of a window of another node held at its owner (``Engine.reserve_version``:
        the owner's own lease pinning it, held by this thread's session with the owner; the
        owner caps its ttl at its timeout). ``version`` 0 reserves the owner's latest one."""
        if not res.peer.alive():
            raise res.peer.lost(self.spec.label)
        eng, remote = res.engine, res.remote_for(self.spec)
        ttl = self.ttl if self.ttl is not None else MAX_RESERVATION_S
        t0 = native.monotonic_ns()  # the owner's expiry counts from later: ours is conservative
        try:
            v = eng.reserve_version(remote, self.version, ttl)
        except RemoteOutcome as exc:
            raise tr.chain(failure(Outcome.remote(exc), res, self.spec, version=self.version), exc)
        self.version = v
        self._reserved = (eng, remote)
        self._exp, self._id = t0 + self._ttl_ns(ttl), 1
        self._pid = os.getpid()
        self.runtime.leases.add(self)
        return self

    def _acquire_remote(self, res: Resolution) -> "Lease":
        """A lease on a window of another node, held in the directory (redis: a sorted set the
        owner reads, atomically with marking the window closing, before it unpublishes)."""
        rt = self.runtime
        if not rt.directory.holds_leases:
            from memsem._errors import NotSupportedError

            raise NotSupportedError(f"leases across nodes need a directory that holds them (redis://); "
                                    f"{rt.directory.url} does not (route {res.route.kind})")
        if not res.peer.alive():
            raise res.peer.lost(self.spec.label)
        t0 = native.monotonic_ns()  # the owner's expiry counts from later: ours is conservative
        me = rt.identity
        member = rt.directory.acquire_lease(self.spec.gva, self.spec.generation,
                                            {"node": me.node, "pid": me.pid, "rank": rt.rank}, self.ttl)
        self._remote, self._exp, self._id = member, t0 + self._ttl_ns(self.ttl), 1
        self._pid = os.getpid()
        rt.leases.add(self)
        return self

    def renew(self, ttl: float | None = None) -> float:
        """Extend to ``ttl`` (default: the original ttl) from now; returns seconds until the new
        expiry (``math.inf`` when held until released).

        Raises:
            LeaseExpiredError: it already expired or was reclaimed (the slot is freed).
        """
        self._check_process()
        if not self.held:
            raise LeaseExpiredError(f"lease on {self.spec.label} is not held")
        ttl = self.ttl if ttl is None else _args.ttl(ttl)
        if self._reserved is not None:
            t0 = native.monotonic_ns()
            eng, remote = self._reserved
            if self._exp <= t0:
                self.release()
                raise LeaseExpiredError(f"lease on {self.spec.label} expired before renew()")
            try:
                eng.reserve_version(remote, self.version, ttl if ttl is not None else MAX_RESERVATION_S)
            except (RemoteOutcome, MemsemError) as exc:
                self.release()
                raise LeaseExpiredError(f"lease on {self.spec.label} was lost at its owner: {exc}") from exc
            self._exp = t0 + self._ttl_ns(ttl if ttl is not None else MAX_RESERVATION_S)
        elif self._remote:
            t0 = native.monotonic_ns()
            d = self.runtime.directory
            if self._exp <= t0 or not d.renew_lease(self.spec.gva, self._remote, ttl):
                d.release_lease(self.spec.gva, self._remote)
                self._forget()
                raise LeaseExpiredError(f"lease on {self.spec.label} expired before renew()")
            self._exp = t0 + self._ttl_ns(ttl)
        else:
            exp = _lease.renew(self._cb, self._slot, self._id, self._ttl_ns(ttl))
            if not exp:
                _lease.release(self._cb, self._slot, self._id)  # free the slot now (no-op if reclaimed)
                self._forget()
                raise LeaseExpiredError(f"lease on {self.spec.label} expired before renew()")
        return math.inf if ttl is None else self.remaining()

    def remaining(self) -> float:
        """Seconds until expiry: ``math.inf`` when held until released, <= 0 when expired or
        released. Never blocks."""
        if not self.held:
            return 0.0
        if self.ttl is None:
            return math.inf
        exp = self._exp if self._remote or self._reserved else _lease.expiry_of(self._cb, self._slot, self._id)
        return (exp - native.monotonic_ns()) / 1e9 if exp else 0.0

    def check(self, when: str) -> None:
        """Raise LeaseExpiredError unless the lease is held and unexpired now."""
        if not self.held:
            raise LeaseExpiredError(f"lease on {self.spec.label} is not held ({when})")
        if self.expired():
            self.runtime.telemetry.count_error("lease_expired")
            raise tr.lease_expired(self.spec, when)

    def native_args(self, spec: RefSpec) -> tuple[int, int]:
        """``(slot address, lease id)`` for ``memsem_plan_copy``: a released lease gives a slot
        that never holds its id, so the native check fails it in its turn (after range and
        permission); (0, 0) for a lease held in the directory (checked in Python). Raises
        ValueError for a lease of another window."""
        if self.spec.gva != spec.gva:
            raise ValueError(f"lease is for {self.spec.label}, not {spec.label}")
        if self._pid != os.getpid():
            self._check_process()
        if not self._id:
            return _NEVER_ADDR, 1
        return self._slot_addr, self._id

    def pin_slot(self) -> "Callable[[], None] | None":
        """Keep the mapping of this lease's slot (``native_args``' address) mapped, also past a
        ``release``, for a native thread that checks it; returns the unpin call (None for a
        lease held in the directory or not held: nothing is mapped for it)."""
        cb = self._cb
        if cb is None:
            return None
        cb.pin()
        return cb.unpin

    def add_view(self) -> None:
        """(The runtime's) a zero-copy view taken under this lease now lives: ``release`` is
        refused until ``drop_view``."""
        with self._lock:
            self._views += 1

    def drop_view(self) -> None:
        """(The runtime's) a view taken under this lease was collected."""
        with self._lock:
            self._views = max(0, self._views - 1)

    def release(self, *, force: bool = False) -> None:
        """Give the lease back. Safe twice. Raises MemsemError while views taken under it live,
        unless ``force`` (the runtime's close: the views keep their mappings, not the lease)."""
        with self._lock:
            if force:
                self._views = 0
            if self._views:
                raise MemsemError(f"lease on {self.spec.label} still backs {self._views} view(s); "
                                  "drop them before release()")
            if self._pid and self._pid != os.getpid():
                return  # a forked child never frees its parent's lease
            if self._reserved is not None:
                eng, remote = self._reserved
                try:
                    eng.drop_reservation(remote, self.version)
                except (MemsemError, RemoteOutcome):
                    pass  # ends with its ttl, or with the session that holds it
            elif self._remote:
                try:
                    self.runtime.directory.release_lease(self.spec.gva, self._remote)
                except MemsemError:
                    pass  # expires on its own
            elif self.held:
                _lease.release(self._cb, self._slot, self._id)
            self._forget()

    def _forget(self) -> None:
        cb, self._cb = self._cb, None
        self._id = 0
        self._slot_addr = 0
        self._remote = ""
        self._reserved = None
        self.runtime.leases.discard(self)
        if cb is not None:
            cb.unpin()

    def expired(self) -> bool:
        """True when the lease is not held or its expiry has passed (never blocks)."""
        if not self.held:
            return True
        exp = self._exp if self._remote or self._reserved else _lease.expiry_of(self._cb, self._slot, self._id)
        return exp == 0 or exp <= native.monotonic_ns()

    def __enter__(self) -> "Lease":
        if not self.held:
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        if not self.held:
            return f"<Lease {self.spec.label} released>"
        left = self.remaining()
        when = "held until released" if left == math.inf else f"held, {left:.3f} s left"
        return f"<Lease {self.spec.label} {when}>"


def acquire_on(lease: Lease, res: Resolution) -> Lease:
    """``lease.acquire()`` through ``res``, the caller's resolution of the lease's ref (a view
    or a pin resolves once); the caller holds it (``res.enter()``) or has just made it.
    Returns ``lease``. Raises as ``Lease.acquire``."""
    if lease.held:
        raise MemsemError("lease already held; renew() it instead")
    if res.cb is None:
        if (lease.version or lease.reserve) and res.engine.reserves:
            return lease._acquire_reserved(res)
        return lease._acquire_remote(res)
    if not res.own_cb and not res.peer.alive_recently():  # a cached resolution may outlive its owner
        raise res.peer.lost(lease.spec.label)
    me = lease.runtime.identity
    cb = res.cb
    try:
        cb.pin()  # the lease reads its slot until released, whatever happens to the resolution
    except ValueError:  # that resolution was dropped meanwhile (its mappings closing): a fresh one
        fresh = lease.runtime.resolver.resolve(lease.spec)
        if fresh is res:
            raise
        return acquire_on(lease, fresh)
    try:
        try:
            slot, lid = _lease.acquire(cb, me.pid, me.start_time, lease._ttl_ns(lease.ttl), lease.version)
        except _lease.WindowClosing:
            raise WindowRetiredError(f"{lease.spec.label} is closing or closed: no new leases",
                                     window=lease.spec.name, generation=lease.spec.generation) from None
        except _lease.LeaseSlotsFull:
            raise MemsemError(f"{lease.spec.label}: all {cb.n_lease} lease slots are held") from None
        if cb.generation != lease.spec.generation:
            _lease.release(cb, slot, lid)
            raise tr.stale(lease.spec, cb.generation)
    except BaseException:
        cb.unpin()
        raise
    lease._cb, lease._slot, lease._id = cb, slot, lid
    lease._slot_addr = cb.lease_slot_addr(slot)
    lease._pid = os.getpid()
    lease.runtime.leases.add(lease)
    return lease


_pin_latest = native.lib.memsem_pin_latest
_LIVE = int(WindowState.LIVE)


def pin_latest(lease: Lease, res: Resolution) -> tuple[bool | None, int, int] | None:
    """One try of pinning the latest version of ``res``'s window (a control block here) with
    ``lease`` (not held, ``version`` 0): one native call (``memsem_pin_latest``: generation,
    latest version, lease slot, writer intent and sequence checks). Returns ``(held, version,
    seq)``: ``held`` True when ``lease`` now pins ``version``; False when a writer is
    overwriting or writing it (nothing held: wait for the commit, then try again; ``seq`` is
    its slot's sequence word); None when the generation moved (nothing held). None instead of
    the tuple: no lease slot was free, or the resolution is being dropped; the general path
    (``Lease.acquire``) reclaims or resolves again.

    Raises:
        WindowRetiredError: the window is closing. PeerLostError: its owner died.
    """
    cb = res.cb
    spec = lease.spec
    if not res.own_cb and not res.peer.alive_recently():  # a cached resolution may outlive its owner
        raise res.peer.lost(spec.label)
    try:
        cb.pin()  # the lease reads its slot until released, whatever happens to the resolution
    except ValueError:
        return None
    me = lease.runtime.identity
    lid = random.getrandbits(63) | 1  # tells leases of one slot apart (ABA); not a secret
    out = native.ffi.new("uint64_t[2]")
    slot = _pin_latest(cb.base, spec.generation, cb.n_slots, cb.lease_slot_addr(0), cb.n_lease,
                       _lease.claim_mark(me.pid), me.pid, me.start_time,
                       native.monotonic_ns() + lease._ttl_ns(lease.ttl), lid, _LIVE, out, out + 1)
    if slot < 0:
        cb.unpin()
        if slot == -2:
            raise WindowRetiredError(f"{spec.label} is closing or closed: no new leases",
                                     window=spec.name, generation=spec.generation)
        if slot == -1:
            return None
        return (None if slot == -3 else False), int(out[0]), int(out[1])
    lease.version = int(out[0])
    lease._cb, lease._slot, lease._id = cb, slot, lid
    lease._slot_addr = cb.lease_slot_addr(slot)
    lease._pid = os.getpid()
    lease.runtime.leases.add(lease)
    return True, lease.version, int(out[1])
