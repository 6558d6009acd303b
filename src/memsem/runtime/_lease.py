"""Leases: a consumer's time-bounded, renewable claim on a window."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from memsem import native
from memsem._errors import (
    LeaseExpiredError,
    MemsemError,
    NotSupportedError,
    PeerLostError,
    StaleReferenceError,
)
from memsem.gva import (
    ControlBlock,
    RefSpec,
    lease as _lease,
)
from memsem.runtime._state import _Resolved

if TYPE_CHECKING:
    from memsem.runtime._runtime import RuntimeCore


class Lease:
    """A consumer's time-bounded, renewable claim on a window (see DESIGN.md, Lease).

    While unexpired, the owner cannot unpublish or reuse the window. Transfers made with the lease
    check it before and after the copy: expiry at any point raises LeaseExpiredError.
    ``release`` refuses while views taken under this lease are alive.
    """

    def __init__(self, runtime: "RuntimeCore", spec: RefSpec, ttl: float | None) -> None:
        _check_ttl(ttl)
        self.runtime = runtime
        self.spec = spec
        self.ttl = ttl
        self._slot = -1
        self._id = 0
        self._cb: ControlBlock | None = None
        self._views = 0
        self._remote = ""  # lease held in the directory (window on another node): its member id
        self._exp = 0  # its expiry, monotonic ns of this process (conservative: never later than the owner's)
        self._lock = threading.RLock()  # RLock: a view's finalizer may run inside a held section

    @property
    def held(self) -> bool:
        return self._id != 0

    def _ttl_ns(self, ttl: float | None) -> int:
        return (1 << 62) if ttl is None else int(ttl * 1e9)

    def acquire(self) -> "Lease":
        """Claim the lease. Raises StaleReferenceError (window gone or closing), PeerLostError,
        AccessDeniedError (wrong key), MemsemError (no free lease slot)."""
        if self.held:
            raise MemsemError("lease already held; renew() it instead")
        res = self.runtime._resolve(self.spec)
        if res.cb is None:
            return self._acquire_remote(res)
        if not res.own_cb and not res.owner.alive():  # a cached resolution may outlive its owner
            raise PeerLostError(f"the owner of {self.spec.label} (pid {res.owner.pid}) is dead: no lease")
        me = self.runtime.identity
        try:
            slot, lid = _lease.acquire(res.cb, me.pid, me.start_time, self._ttl_ns(self.ttl))
        except _lease.WindowClosing:
            raise StaleReferenceError(f"{self.spec.label} is closing or closed: no new leases",
                                      window=self.spec.name) from None
        except _lease.LeaseSlotsFull:
            raise MemsemError(f"{self.spec.label}: all {res.cb.n_lease} lease slots are held") from None
        if res.cb.generation != self.spec.generation:
            _lease.release(res.cb, slot, lid)
            raise self.runtime._stale(self.spec, res.cb.generation)
        res.cb.pin()  # the lease reads its slot until released, whatever happens to the cache
        self._cb, self._slot, self._id = res.cb, slot, lid
        self.runtime._leases.add(self)
        return self

    def _acquire_remote(self, res: "_Resolved") -> "Lease":
        """A lease on a window of another node, held in the directory (redis: a sorted set the
        owner reads, atomically with marking the window closing, before it unpublishes)."""
        rt = self.runtime
        acquire = getattr(rt.directory, "acquire_lease", None)
        if acquire is None:
            raise NotSupportedError(f"leases across nodes need a directory that holds them (redis://); "
                                    f"{rt.directory.url} does not (route {res.route.kind})")
        if not res.owner.alive():
            raise PeerLostError(f"the owner of {self.spec.label} (pid {res.owner.pid} on {res.owner.node}) "
                                "is dead: no lease")
        t0 = native.monotonic_ns()  # the owner's expiry counts from later: ours is conservative
        me = rt.identity
        member = acquire(self.spec.gva, self.spec.generation, {"node": me.node, "pid": me.pid, "rank": rt.rank},
                         self.ttl)
        self._remote, self._exp, self._id = member, t0 + self._ttl_ns(self.ttl), 1
        rt._leases.add(self)
        return self

    def renew(self, ttl: float | None = None) -> float:
        """Extend to ``ttl`` (default: the original ttl) from now; returns the new expiry as
        seconds from now. Raises LeaseExpiredError if it already expired or was reclaimed."""
        if not self.held:
            raise LeaseExpiredError(f"lease on {self.spec.label} is not held")
        ttl = self.ttl if ttl is None else _check_ttl(ttl)
        if self._remote:
            t0 = native.monotonic_ns()
            d = self.runtime.directory
            if self._exp <= t0 or not d.renew_lease(self.spec.gva, self._remote, ttl):
                d.release_lease(self.spec.gva, self._remote)
                self._forget()
                raise LeaseExpiredError(f"lease on {self.spec.label} expired before renew()")
            self._exp = t0 + self._ttl_ns(ttl)
            return (self._exp - native.monotonic_ns()) / 1e9
        exp = _lease.renew(self._cb, self._slot, self._id, self._ttl_ns(ttl))
        if not exp:
            _lease.release(self._cb, self._slot, self._id)  # free the slot now (no-op if reclaimed)
            self._forget()
            raise LeaseExpiredError(f"lease on {self.spec.label} expired before renew()")
        return (exp - native.monotonic_ns()) / 1e9

    def remaining(self) -> float:
        """Seconds until expiry (<= 0 when expired or released)."""
        if not self.held:
            return 0.0
        exp = self._exp if self._remote else _lease.expiry_of(self._cb, self._slot, self._id)
        return (exp - native.monotonic_ns()) / 1e9 if exp else 0.0

    def check(self, when: str) -> None:
        """Raise LeaseExpiredError unless the lease is held and unexpired now."""
        if not self.held:
            raise LeaseExpiredError(f"lease on {self.spec.label} is not held ({when})")
        if self.expired():
            self.runtime.telemetry.count_error("lease_expired")
            raise LeaseExpiredError(f"lease on {self.spec.label} expired {when}")

    def release(self) -> None:
        """Give the lease back. Safe twice. Raises MemsemError while views taken under it live."""
        with self._lock:
            if self._views:
                raise MemsemError(f"lease on {self.spec.label} still backs {self._views} view(s); "
                                  "drop them before release()")
            if self._remote:
                self.runtime.directory.release_lease(self.spec.gva, self._remote)
            elif self.held:
                _lease.release(self._cb, self._slot, self._id)
            self._forget()

    def _forget(self) -> None:
        cb, self._cb = self._cb, None
        self._id = 0
        self._remote = ""
        self.runtime._leases.discard(self)
        if cb is not None:
            cb.unpin()

    def expired(self) -> bool:
        """True when the lease is not held or its expiry has passed (never blocks)."""
        if not self.held:
            return True
        exp = self._exp if self._remote else _lease.expiry_of(self._cb, self._slot, self._id)
        return exp == 0 or exp <= native.monotonic_ns()

    def __enter__(self) -> "Lease":
        if not self.held:
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Lease {self.spec.label} {'held' if self.held else 'released'} {self.remaining():.3f}s left>"


#: the longest finite ttl (seconds): expiries are 64-bit nanosecond clock values
MAX_TTL = 1e9


def _check_ttl(ttl: object) -> float | None:
    """``ttl`` is None (until released) or a finite number of seconds in (0, MAX_TTL]."""
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TypeError(f"ttl must be a number of seconds or None, got {ttl!r}")
    if not (0 < float(ttl) <= MAX_TTL):
        raise ValueError(f"ttl must be > 0 and <= {MAX_TTL:g} seconds, or None (until released), got {ttl!r}")
    return float(ttl)
