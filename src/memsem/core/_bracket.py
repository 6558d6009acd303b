"""The copy bracket, as one object: the Python side of the window's seqlock, written once.

Every copy of a window's bytes runs inside the window's seqlock bracket, implemented once in C
(``native/memsem_native.c``): ``memsem_plan_copy`` opens it, copies and closes it in one call
(the same-node hot path); ``memsem_bracket_open`` / ``memsem_bracket_close`` put it around a
copy made elsewhere (an engine's get or put, a gather of many ranges, the owner's side of a tcp
request). Both return one result word: a status, flags and a value. This module is the only
Python code that reads that word:

* :class:`Outcome` is what a call came to: its :class:`Status`, its value (the version moved,
  the generation or version found, an errno) and whether the owner's liveness is due.
* :func:`settle` decodes a result word. The ``LAST_OUT`` flag (this call was the last one out of a
  resolution that was closed meanwhile) releases the resolution here, and nowhere else.
* :class:`Bracket` is one open bracket (a ``struct memsem_bracket``): ``open`` gives the
  address of the range in the version's slot and the version, ``close`` re-checks.
* :func:`failure` turns a failed outcome into the memsem error, with its side effects (a
  resolution whose generation moved is dropped, the error is counted): the one translation of
  native outcomes, also of the owner's native outcome an owner-checked engine carries back
  (``engines.RemoteOutcome``).

Retrying (an open write section, a closed resolution, a liveness check that is due) is the
caller's loop around these, bounded by the one wait (``memsem.core._wait``).
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from memsem import native
from memsem._errors import AccessDeniedError, EngineError, MemsemError
from memsem.engines import RemoteOutcome
from memsem.gva import RefSpec
from memsem.core import _translate as tr

if TYPE_CHECKING:
    from memsem.core._lease import Lease
    from memsem.core._resolve import Resolution

_lib = native.lib
_ffi = native.ffi
_STATUS = _lib.MEMSEM_RC_STATUS_MASK
_SHIFT = _lib.MEMSEM_RC_VERSION_SHIFT
_LAST_OUT = _lib.MEMSEM_RC_LAST_OUT
_CHECK_PEER = _lib.MEMSEM_RC_CHECK_PEER
_FLAGS = (1 << _SHIFT) - 1
#: any status or flag of a result word: the slow path (a plain success is the version << 16)
ATTENTION = _lib.MEMSEM_RC_ATTENTION
#: the largest version a window has (native ``MEMSEM_VERSION_MAX``, 2**48 - 1)
VERSION_MAX = _lib.MEMSEM_VERSION_MAX


class Status(enum.IntEnum):
    """The status of a native check-and-copy or bracket call (``MEMSEM_RC_*`` of
    ``native/memsem_native.h``)."""

    OK = _lib.MEMSEM_OK
    #: the resolution was closed: resolve again (nothing moved)
    CLOSED = _lib.MEMSEM_RC_CLOSED
    #: the generation moved before the copy (nothing moved); value: the generation found
    GEN_BEFORE = _lib.MEMSEM_RC_GEN_BEFORE
    #: the generation moved during the copy (the bytes moved are not valid)
    GEN_AFTER = _lib.MEMSEM_RC_GEN_AFTER
    #: a write section is open on the slot, or the version asked for is not committed yet
    BUSY = _lib.MEMSEM_RC_BUSY
    #: the slot's sequence moved during the copy: the bytes are not one version (retry)
    TORN = _lib.MEMSEM_RC_TORN
    #: the version asked for was overwritten; value: the version the slot holds
    VERSION_GONE = _lib.MEMSEM_RC_VERSION_GONE
    LEASE_BEFORE = _lib.MEMSEM_RC_LEASE_BEFORE
    LEASE_DURING = _lib.MEMSEM_RC_LEASE_DURING
    #: the range lies outside the window
    RANGE = _lib.MEMSEM_RC_RANGE
    #: a put to a read-only window (or to one whose owner writes it)
    READONLY = _lib.MEMSEM_RC_READONLY
    #: the copy itself failed; value: the errno
    ERRNO = _lib.MEMSEM_RC_ERRNO
    #: a put while the owner's liveness is due: check it, then retry (nothing moved)
    CHECK_FIRST = _lib.MEMSEM_RC_CHECK_FIRST
    #: (memsem._hot.copy) the local buffer needs the Python door first (nothing done)
    BUFFER = _lib.MEMSEM_RC_BUFFER
    #: the version asked for is beyond VERSION_MAX (nothing moved)
    VERSION_RANGE = _lib.MEMSEM_RC_VERSION_RANGE


_ST = {int(s): s for s in Status}
#: statuses after which the same call may succeed when made again (the caller's loop decides how)
RETRY = frozenset({Status.CLOSED, Status.BUSY, Status.TORN, Status.CHECK_FIRST})


class Outcome:
    """What one native call came to.

    Attributes:
        status: the :class:`Status` (or, for the pipeline's native movers, their own status
            code, an int). value: for OK the version whose bytes were read or overwritten; GEN_*
            the generation found; BUSY / VERSION_GONE the version the slot holds; ERRNO the
            errno. check_peer: the owner's liveness is due for a re-check. released: this call
            was the last one out of a closed resolution, which ``settle`` released.
    """

    __slots__ = ("status", "value", "check_peer", "released")

    def __init__(self, status: "Status | int", value: int, check_peer: bool = False, released: bool = False) -> None:
        self.status = status
        self.value = value
        self.check_peer = check_peer
        self.released = released

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def retry(self) -> bool:
        """The same call may succeed when made again (see ``RETRY``)."""
        return self.status in RETRY

    @property
    def waits(self) -> bool:
        """The call may succeed once the window commits a version (a write section is open, or
        the version asked for is not committed): wait for a commit, then make it again."""
        return self.status is Status.BUSY

    @property
    def again(self) -> bool:
        """The copy saw two versions (torn; nothing moved counts): make it again at once."""
        return self.status is Status.TORN

    @classmethod
    def remote(cls, exc: RemoteOutcome) -> "Outcome":
        """The owner's native outcome carried back by an owner-checked engine."""
        return cls(_ST.get(exc.status, Status.ERRNO), exc.value)

    def __repr__(self) -> str:
        name = getattr(self.status, "name", self.status)
        return f"<Outcome {name} {self.value}{' check_peer' if self.check_peer else ''}>"


def settle(res: "Resolution", rc: int) -> Outcome:
    """Decode the result word ``rc`` of a native call on ``res``'s plan. When the call left a
    closed resolution last, the resolution is released here (the one place that happens)."""
    last = bool(rc & _LAST_OUT)
    if last:
        res.release()
    st = rc & _STATUS
    return Outcome(_ST.get(st, st), rc >> _SHIFT, bool(rc & _CHECK_PEER), last)


class Bracket:
    """One seqlock bracket on a resolution's plan around a copy made outside
    ``memsem_plan_copy``::

        b = Bracket(res)
        o = b.open(put, offset, nbytes, version, lease_slot, lease_id)
        if o.ok:
            ... copy nbytes at b.address ...   (counted in flight until close)
            o = b.close()                       # OK (o.value: the version), TORN, GEN_AFTER...

    A failed open leaves nothing open. ``close`` after a failed copy (``failed=True``) only undoes
    the bracket and says whether the generation moved meanwhile (which explains most failures).
    Not thread safe: one bracket per copy.
    """

    __slots__ = ("_res", "_c")

    def __init__(self, res: "Resolution") -> None:
        self._res = res
        self._c = _ffi.new("memsem_bracket *")

    def open(self, put: bool, offset: int, nbytes: int, version: int = 0, lease_slot: int = 0,
             lease_id: int = 0) -> Outcome:
        """Every check of a copy before it: plan open, range, version range, permission, lease,
        generation, the version's slot sequence. ``version`` 0: the latest committed one."""
        return settle(self._res, _lib.memsem_bracket_open(self._c, self._res.plan, 1 if put else 0, offset, nbytes,
                                                          version, lease_slot, lease_id))

    @property
    def address(self) -> int:
        """Address of the range in the version's slot (valid from a successful open to close)."""
        return int(self._c.address)

    @property
    def version(self) -> int:
        """The version whose bytes the range holds (from a successful open)."""
        return int(self._c.version)

    @property
    def is_open(self) -> bool:
        return bool(self._c.is_open)

    def close(self, failed: bool = False, moved: int | None = None) -> Outcome:
        """Every check after the copy: generation, the slot's sequence (torn?), lease, telemetry.
        ``moved``: the bytes the copy moved when it moved less than it opened (a non-blocking
        send or receive): what the telemetry counts (default: every byte opened)."""
        if moved is not None and 0 <= moved < self._c.nbytes:
            self._c.nbytes = moved
        return settle(self._res, _lib.memsem_bracket_close(self._c, 1 if failed else 0))


class KeptBracket:
    """The bracket of a kept route (``memsem.core._routes.WireRoute``): one native bracket
    reused copy after copy (a route is kept for one thread: one copy at a time) on a plan the
    route holds without its resolution (``keeper[0]``, None once released; ``plan`` is held
    here so its memory outlives the resolution's release). The native call of the route's
    request (``memsem._hot.wire``, given :attr:`address`) opens it, with every check of
    :meth:`Bracket.open`; :meth:`close` and :meth:`undo` end it where that call left it open.
    Both return native result words, as ``memsem._hot.copy`` does, which the route's caller
    settles through the whole path when they need attention.
    """

    __slots__ = ("_plan", "_c", "_address")

    def __init__(self, plan: Any) -> None:
        self._plan = plan
        self._c = _ffi.new("memsem_bracket *")
        self._address = int(_ffi.cast("uintptr_t", self._c))

    @property
    def address(self) -> int:
        """Address of the native bracket (for a native call that opens and closes it:
        ``memsem._hot.wire``)."""
        return self._address

    def close(self, version: int) -> int:
        """Every check after a copy of ``version``'s bytes (the version the owner moved): the
        result word with ``version`` in its value bits, or a status (the copy does not count)."""
        rc = _lib.memsem_bracket_close(self._c, 0)
        if rc & _STATUS:
            return rc
        return (rc & _FLAGS) | version << _SHIFT

    def undo(self, keeper: list[Any]) -> Outcome | None:
        """Close after a failed copy: what the close found (a moved generation explains most
        failures), settled on the resolution still kept (None: released since). A bracket
        that is not open is left as it is (the native close refuses it: EBADF)."""
        rc = _lib.memsem_bracket_close(self._c, 1)
        res = keeper[0]
        return settle(res, rc) if res is not None else None


def failure(o: Outcome, res: "Resolution", spec: RefSpec, *, put: bool = False, lease: "Lease | None" = None,
            version: int = 0) -> BaseException:
    """The memsem error of the failed outcome ``o`` of a copy of ``spec`` through ``res``: the one
    translation of native (and owners') outcomes. A moved generation drops ``res`` from its
    resolver; every error is counted in the runtime's telemetry. Never touches the control
    block (the resolution may be released by now: what the native side saw is in ``o``)."""
    st, found = o.status, o.value
    count = res.telemetry.count_error
    if st in (Status.GEN_BEFORE, Status.GEN_AFTER):
        res.resolver.drop(spec.gva, res)
        count("stale")
        if st is Status.GEN_AFTER and lease is not None and lease.expired():
            count("lease_expired")
            return tr.lease_expired(spec, "during the transfer and the owner reclaimed the window; "
                                          "the bytes moved are not valid")
        return tr.stale(spec, found or None, during=st is Status.GEN_AFTER)
    if st is Status.VERSION_GONE:
        count("stale")
        return tr.version_gone(spec, version, found)
    if st in (Status.LEASE_BEFORE, Status.LEASE_DURING):
        count("lease_expired")
        if lease is not None and not lease.held:
            return tr.lease_expired(spec, "before the transfer (not held)")
        return tr.lease_expired(spec, "before the transfer" if st is Status.LEASE_BEFORE
                                else "during the transfer; the bytes moved are not valid")
    if st is Status.RANGE:
        return tr.out_of_range(spec, spec.offset, spec.offset + spec.nbytes, res.nbytes)
    if st is Status.READONLY:
        return tr.read_only(spec)
    if st is Status.VERSION_RANGE:
        return tr.version_range(version)
    if st is Status.BUSY:
        return tr.busy_timeout(spec, res.timeout)
    if st is Status.ERRNO:
        exc = EngineError(f"{'put' if put else 'get'} on {spec.label}", errno=found)
        err = tr.engine_failure(exc, spec, res.peer, "put" if put else "get")
        if not isinstance(err, EngineError):
            count("peer_lost")
        return tr.chain(err, exc)
    return MemsemError(f"{spec.label}: unexpected native status {getattr(st, 'name', st)}")  # pragma: no cover


def engine_failure(exc: BaseException, res: "Resolution", spec: RefSpec, *, put: bool, lease: "Lease | None",
                   version: int, closed: Outcome | None = None) -> BaseException:
    """The memsem error for an engine's failure inside a bracket: ``closed`` is the bracket's
    close after the failure (a moved generation explains the failure), ``exc`` the engine's
    error (an owner's refusal is translated like a native outcome; a dead owner is
    PeerLostError; anything else stays an EngineError chained to its cause)."""
    if closed is not None and closed.status is Status.GEN_AFTER:
        return tr.chain(failure(closed, res, spec, put=put, lease=lease, version=version), exc)
    if isinstance(exc, RemoteOutcome):
        return tr.chain(failure(Outcome.remote(exc), res, spec, put=put, lease=lease, version=version), exc)
    if isinstance(exc, AccessDeniedError) and res.cb is None:
        # An owner says nothing about a window to a credential it refuses (a stale ref's proof
        # fails like a forged one): the directory, which this runtime trusts, tells which it was.
        now = res.resolver.generation_now(spec)
        if now != spec.generation:
            res.resolver.drop(spec.gva, res)
            res.telemetry.count_error("stale")
            return tr.chain(tr.stale(spec, now), exc)
    if isinstance(exc, MemsemError) and not isinstance(exc, EngineError):
        return exc
    kind = "put" if put else "get"
    err = tr.engine_failure(exc, spec, res.peer, kind)
    if not isinstance(err, EngineError):
        res.telemetry.count_error("peer_lost")
    return tr.chain(err, exc)


def attention(rc: int) -> bool:
    """Whether a hot-path result word needs the slow path (anything but a plain success)."""
    return bool(rc & ATTENTION)


def value_of(rc: int) -> int:
    """The value of a plain success: the version read or overwritten."""
    return rc >> _SHIFT


__all__ = ["ATTENTION", "Bracket", "KeptBracket", "Outcome", "RETRY", "Status", "VERSION_MAX", "attention", "engine_failure",
           "failure", "settle", "value_of"]
