"""Routes: one object per way a resolution reaches a window, chosen once.

A resolution (``memsem.core._resolve``) picks its route when it is made, from where the window
lives and what the chosen engine can check (:func:`route_for`); nobody branches on the strategy
again (STYLE 15):

=====================  ======================================================================
route                  one attempt of a copy
=====================  ======================================================================
:class:`DirectRoute`   same node: one native call (``memsem_plan_copy``: memcpy or
                       cross-memory attach) with every check of the bracket
:class:`EngineRoute`   the engine moves the bytes inside the native bracket, on the window's
                       control block mapped here (mte) or on a window whose generation the
                       device enforces (rdma without readable control words)
:class:`OwnerRoute`    another node, the owner's runtime checks every request (tcp): the
                       engine's versioned calls inside the bracket; the owner's outcome is
                       translated like a local one
:class:`OneSidedRoute` another node, the engine reads the owner's control words one-sidedly
                       (rdma): a versioned read runs the seqlock over the wire
:class:`UncheckedRoute` nothing checks the generation (a third-party engine): refused
=====================  ======================================================================

Each offers :meth:`~CopyRoute.attempt` (one try; it returns an :class:`Outcome`, and the one retry
loop, ``Transfers.run``, decides what follows), :meth:`~CopyRoute.digest` (one try of a digest
of byte runs of a version, taken where the bytes are: one node, or the owner over tcp; other
routes refuse) and :meth:`~CopyRoute.ref_route` (what a ref holds
for its next plain gets and puts: a :class:`PlanRoute` on the same node, a :class:`WireRoute`
over tcp, else None). A ref's route is *valid* while its ``spec`` is the ref's and its
``token`` the runtime's; a route whose resolution was released since refuses natively (its
plan's use word is closed), and the ref asks for a new one.

Glossary (docs/architecture.md): the *keeper* of a resolution is the one-element list a ref's
route holds instead of the resolution (``[res]`` while it lives, ``[None]`` once released), so
a ref never keeps a released resolution, its owner's pidfd or its runtime alive.
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import _hot, native
from memsem._buffers import address_view
from memsem._errors import EngineError, NotSupportedError, StaleReferenceError
from memsem.engines import WATCH_HEADER, GenerationCheck, RemoteOutcome, WatchMode, run_digest
from memsem.gva import RefSpec
from memsem.gva._control_block import W_GENERATION, W_LATEST, W_NSLOTS, W_SEQ0, W_SEQ1, W_SLOT_STRIDE
from memsem.core import _translate as tr
from memsem.core._bracket import ATTENTION, Bracket, KeptBracket, Outcome, Status, engine_failure, failure, settle

if TYPE_CHECKING:
    from memsem.core._lease import Lease
    from memsem.core._resolve import Resolution

_copy = native.lib.memsem_plan_copy
_copy_buf = _hot.copy_buf
_SHIFT = native.lib.MEMSEM_RC_VERSION_SHIFT
_STATUS = native.lib.MEMSEM_RC_STATUS_MASK
_PENDING, _LOST, _SENDING = _hot.RC_WIRE_PENDING, _hot.RC_WIRE_LOST, _hot.RC_WIRE_SENDING
#: a ref's route that cannot serve now (``WireRoute``: another thread's, a closed connection, a
#: recycled handle): nothing was sent; the ref takes the whole path and a new route (every
#: attention bit: a result word no native call returns)
ROUTE_STALE = native.lib.MEMSEM_RC_ATTENTION
#: a ref's route whose connection failed under the request it sent: nothing that counts moved;
#: the whole path makes the request again within the route's deadline (another word no native
#: call returns)
ROUTE_LOST = ROUTE_STALE - 1
#: bytes of the buffer a digest of another process's private memory (cross-memory attach) reads through
DIGEST_SCRATCH_BYTES = 1 << 20


def lease_args(lease: "Lease | None", spec: RefSpec) -> tuple[int, int]:
    """The native lease arguments of a copy of ``spec`` (``(0, 0)``: no lease here)."""
    return lease.native_args(spec) if lease is not None else (0, 0)


def remote_slots(res: "Resolution") -> int:
    """Data slots of ``res``'s window as its directory record says (1, or 2 double-buffered)."""
    return 2 if res.info.extra.get("slots", 1) == 2 else 1


class CopyRoute:
    """One way a resolution reaches its window (see the module docstring). The resolution is
    given to every call (a route holds none: no cycle between the two).

    Attributes:
        kind: what it is, for logs and ``explain`` ("direct", "engine", "owner-checked",
            "one-sided", "unchecked").
    """

    __slots__ = ()
    kind = ""

    def attempt(self, res: "Resolution", spec: RefSpec, put: bool, at: int, addr: int, n: int, keep: Any,
                lease: "Lease | None", version: int, signal_tile: int | None, deadline: float | None) -> Outcome:
        """One try of moving ``n`` bytes between ``addr`` (here; ``keep`` owns that memory) and
        byte ``at`` of ``res``'s window: what it came to (OK with the version moved, or a
        status the retry loop acts on). ``deadline`` (``time.monotonic()``): the caller's
        bound, for engines that make requests (None: their timeout from now).

        Raises:
            The memsem error of an engine's failure (translated here, once).
        """
        raise NotImplementedError

    def digest(self, res: "Resolution", spec: RefSpec, runs: Any, version: int,
               lease: "Lease | None") -> tuple[Outcome, bytes]:
        """One try of the digest (``memsem.engines.run_digest``) of the bytes of ``runs``
        (``(offset into the ref, nbytes)``, in order, concatenated) of ``version`` (0: the
        latest): ``(outcome, digest)``, the digest valid only with an OK outcome (its value:
        the version digested). No byte of the runs crosses a link.

        Raises:
            NotSupportedError: this route cannot (names it). As :meth:`attempt`.
        """
        raise NotSupportedError(f"route {self.kind!r} to {spec.label} cannot digest byte runs of a version "
                                "(one node and the owner-checked tcp route can)")

    def ref_route(self, res: "Resolution", spec: RefSpec, token: object) -> "PlanRoute | WireRoute | None":
        """What a ref holds for its next plain gets and puts of ``spec`` through ``res``
        (``token``: the runtime's), or None: the route has nothing quicker than the whole path."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


class DirectRoute(CopyRoute):
    """Same node: the CPU copies natively, every check of the bracket in the same call."""

    __slots__ = ()
    kind = "direct"

    def attempt(self, res: "Resolution", spec: RefSpec, put: bool, at: int, addr: int, n: int, keep: Any,
                lease: "Lease | None", version: int, signal_tile: int | None, deadline: float | None) -> Outcome:
        ls, lid = lease_args(lease, spec)
        return settle(res, _copy(res.plan, put, at, addr, n, version, ls, lid))

    def digest(self, res: "Resolution", spec: RefSpec, runs: Any, version: int,
               lease: "Lease | None") -> tuple[Outcome, bytes]:
        """Over the mapped window (or through a scratch buffer, by cross-memory attach) inside
        one seqlock bracket: a torn one is tried again whole by the caller's loop."""
        ls, lid = lease_args(lease, spec)
        b = Bracket(res)
        o = b.open(False, spec.offset, spec.nbytes, version, ls, lid)
        if not o.ok:
            return o, b""
        h, base, d = run_digest(), b.address, res.remote.direct
        scratch = np.empty(DIGEST_SCRATCH_BYTES if d.cma else 0, np.uint8)
        try:
            for off, n in runs:
                if d.cma:  # another process's private memory
                    for o2 in range(0, n, DIGEST_SCRATCH_BYTES):
                        k = min(DIGEST_SCRATCH_BYTES, n - o2)
                        native.vm_read(d.pid, scratch.ctypes.data, base + off + o2, k)
                        h.update(scratch.data[:k])
                elif n:
                    h.update(native.ffi.buffer(native.ffi.cast("char *", base + off), n))
        except BaseException:
            closed = b.close(failed=True)
            if closed.status in (Status.GEN_AFTER, Status.GEN_BEFORE):  # the window went under the read
                raise failure(closed, res, spec, lease=lease, version=version) from None
            raise
        return b.close(), h.digest()

    #: a ref's route here is a PlanRoute of the resolution: ``ref_route(res, spec, token)``
    #: makes one (the class itself, set below: no call in between)
    ref_route: Any = None


class EngineRoute(CopyRoute):
    """The engine moves the bytes inside the bracket on the resolution's plan."""

    __slots__ = ()
    kind = "engine"

    def attempt(self, res: "Resolution", spec: RefSpec, put: bool, at: int, addr: int, n: int, keep: Any,
                lease: "Lease | None", version: int, signal_tile: int | None, deadline: float | None) -> Outcome:
        if res.cb is None and (version or remote_slots(res) > 1):
            raise NotSupportedError(f"route {res.route.kind} to {spec.label} cannot read versions: the owner's "
                                    "control words are not readable from here")
        return self.bracketed(res, spec, put, at, addr, n, keep, lease, version, signal_tile, deadline)

    def bracketed(self, res: "Resolution", spec: RefSpec, put: bool, at: int, addr: int, n: int, keep: Any,
                  lease: "Lease | None", version: int, signal_tile: int | None, deadline: float | None) -> Outcome:
        """The bracket around :meth:`move` (a lease held in the directory, on another node, is
        checked here before and after)."""
        ls, lid = lease_args(lease, spec)
        b = Bracket(res)
        o = b.open(put, at, n, 0 if res.cb is None else version, ls, lid)
        if not o.ok:
            return o
        flat = address_view(addr, n, keep)
        try:
            if lease is not None and not ls:  # held in the directory (another node): checked here
                lease.check("before the transfer")
            moved = self.move(res, res.remote_for(spec), put, at, flat, version, signal_tile, spec, deadline)
        except RemoteOutcome as exc:
            b.close(failed=True)
            refused = Outcome.remote(exc)
            if refused.retry:
                return refused  # the owner found a write section open (or the copy torn): again
            raise engine_error(exc, res, spec, put, lease, version, refused) from exc
        except BaseException as exc:
            closed = b.close(failed=True)
            raise engine_error(exc, res, spec, put, lease, version, closed) from exc
        o = b.close()
        if o.ok:
            if lease is not None and not ls:
                lease.check("during the transfer; the bytes moved are not valid")
            if moved is not None:
                o.value = moved
            if o.value > res.seen:
                res.seen = o.value
        return o

    def move(self, res: "Resolution", remote: Any, put: bool, at: int, flat: np.ndarray, version: int,
             signal_tile: int | None, spec: RefSpec, deadline: float | None) -> int | None:
        """The engine's call inside the bracket: the version it moved, or None (the bracket's)."""
        eng = res.engine
        if not put:
            eng.get(remote, at, flat)
        elif signal_tile is not None and eng.can_signal(remote):
            eng.put_signal(remote, at, flat, signal_tile, spec.generation)
        else:
            eng.put(remote, at, flat)
        return None


class OwnerRoute(EngineRoute):
    """Another node; the owner's runtime checks every request (key, generation, version,
    permission, its seqlock): the engine's versioned calls, inside the bracket here."""

    __slots__ = ()
    kind = "owner-checked"

    def attempt(self, res: "Resolution", spec: RefSpec, put: bool, at: int, addr: int, n: int, keep: Any,
                lease: "Lease | None", version: int, signal_tile: int | None, deadline: float | None) -> Outcome:
        return self.bracketed(res, spec, put, at, addr, n, keep, lease, version, signal_tile, deadline)

    def move(self, res: "Resolution", remote: Any, put: bool, at: int, flat: np.ndarray, version: int,
             signal_tile: int | None, spec: RefSpec, deadline: float | None) -> int | None:
        eng = res.engine
        kw = {} if deadline is None else {"deadline": deadline}  # engines of before deadline= take none
        if put:
            return eng.put_version(remote, at, flat, **kw)
        return eng.get_version(remote, at, flat, version, **kw)

    def digest(self, res: "Resolution", spec: RefSpec, runs: Any, version: int,
               lease: "Lease | None") -> tuple[Outcome, bytes]:
        """The owner's digest (``Engine.digest_version``: a DIGEST request, bracketed there)."""
        try:
            v, d = res.engine.digest_version(res.remote_for(spec), [(spec.offset + o, n) for o, n in runs], version)
        except RemoteOutcome as exc:
            refused = Outcome.remote(exc)
            if refused.retry:
                return refused, b""  # a write section open at the owner: again
            raise engine_error(exc, res, spec, False, lease, version, refused) from exc
        return Outcome(Status.OK, v), d

    def ref_route(self, res: "Resolution", spec: RefSpec, token: object) -> "WireRoute | None":
        requests = res.engine.kept(res.remote_for(spec), spec.nbytes)
        return None if requests is None else WireRoute(res, spec, token, requests)


class OneSidedRoute(EngineRoute):
    """Another node, the engine reads the owner's control words one-sidedly (rdma): versioned
    reads run the seqlock over the wire; puts and unversioned reads are the bracket's.

    The header words (generation, latest version, slot sequence words) read *before* a copy
    are, when they can serve, the ones read *after* the previous copy through this route: then
    a read costs 2 round trips (copy, header), else 3 (header, copy, header). Why a kept header
    is as good as a fresh one: docs/rdma.md ("A checked read in 2 round trips").
    """

    __slots__ = ("_header",)
    kind = "one-sided"

    def __init__(self) -> None:
        #: the header words read after the last checked copy (None: none yet); a route serves
        #: one resolution
        self._header: list[int] | None = None

    def attempt(self, res: "Resolution", spec: RefSpec, put: bool, at: int, addr: int, n: int, keep: Any,
                lease: "Lease | None", version: int, signal_tile: int | None, deadline: float | None) -> Outcome:
        if not put and (version or remote_slots(res) > 1):
            return self.checked_get(res, spec, at, address_view(addr, n, keep), version)
        return self.bracketed(res, spec, put, at, addr, n, keep, lease, version, signal_tile, deadline)

    def checked_get(self, res: "Resolution", spec: RefSpec, at: int, flat: np.ndarray, version: int) -> Outcome:
        """One try of reading ``flat.nbytes`` bytes at ``at`` of version ``version`` (0: the
        latest): the copy counts only if the slot's sequence word is the same after it as
        before it; a read of the latest version from a kept header also needs the
        latest-version word unchanged after the copy. A kept header only ever leads to a copy:
        every other decision (wait, version gone) is taken on a header read in this try. The
        outcome is what a native bracket would say (BUSY, TORN, VERSION_GONE, GEN_BEFORE /
        GEN_AFTER), retried by the retry loop within its timeout."""
        eng = res.engine
        remote = res.remote_for(spec)

        def header() -> list[int]:
            h = eng.read_words(remote, WATCH_HEADER, 0, W_SEQ1 + 1)
            if h[W_GENERATION] != spec.generation:
                h[W_GENERATION] = eng.read_words(remote, WATCH_HEADER, W_GENERATION, 1)[0]  # never a torn word
            return h

        h = self._header
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
            stride = h[W_SLOT_STRIDE] if nslots > 1 else 0
            if stride and not flat.nbytes <= stride <= remote.nbytes // 2:  # a number read from the peer
                raise EngineError(f"{spec.label}: the owner's slot stride {stride} does not fit its region of "
                                  f"{remote.nbytes} bytes", name="PROTOCOL")
            eng.get(remote, slot * stride + at, flat)
            after = header()
            self._header = after
            if after[W_GENERATION] != spec.generation:
                return Outcome(Status.GEN_AFTER, after[W_GENERATION])
            moved = after[W_SEQ0 + slot]
            if moved == seq and (fresh or version or after[W_LATEST] == v):
                if v > res.seen:
                    res.seen = v
                return Outcome(Status.OK, v)
            if moved != seq:
                if version and moved >> 1 > version:
                    return Outcome(Status.VERSION_GONE, moved >> 1)
                return Outcome(Status.TORN, 0)
            # an intact copy of the version a kept header named, but a newer one is the latest:
            # the header read after the copy (in this try) decides
            h, fresh = after, True


class UncheckedRoute(CopyRoute):
    """Another node, and nothing checks the window's generation: every copy is refused."""

    __slots__ = ()
    kind = "unchecked"

    def attempt(self, res: "Resolution", spec: RefSpec, put: bool, at: int, addr: int, n: int, keep: Any,
                lease: "Lease | None", version: int, signal_tile: int | None, deadline: float | None) -> Outcome:
        raise NotSupportedError(f"route {res.route.kind} to {spec.label} cannot check the window's "
                                "generation (no control block here and the engine does not enforce it)")


_DIRECT, _ENGINE = DirectRoute(), EngineRoute()
_OWNER, _UNCHECKED = OwnerRoute(), UncheckedRoute()


def route_for(res: "Resolution") -> CopyRoute:
    """The route of a resolution being made: from where the window lives (a mapped control
    block, a direct mapping) and what its engine checks."""
    eng = res.engine
    if res.direct:
        return _DIRECT
    if res.cb is not None:
        return _ENGINE
    if eng.enforces_generation == GenerationCheck.OWNER and eng.versions:
        return _OWNER
    if eng.enforces_generation == GenerationCheck.DEVICE:
        return OneSidedRoute() if eng.can_watch(res.remote) == WatchMode.READ else _ENGINE
    return _UNCHECKED


def engine_error(exc: BaseException, res: "Resolution", spec: RefSpec, put: bool, lease: "Lease | None",
                 version: int, o: Outcome | None) -> BaseException:
    """The memsem error for an engine's failure inside the bracket (``o``: the bracket's close
    after it, or the owner's refusal). On another node's window a moved generation shows up as
    an access fault (a revoked rkey) or a refusal: the directory tells which it was."""
    if o is not None and (o.status is Status.GEN_AFTER or isinstance(exc, RemoteOutcome)):
        return engine_failure(exc, res, spec, put=put, lease=lease, version=version, closed=o)
    if isinstance(exc, StaleReferenceError):
        res.resolver.drop(spec.gva, res)
        if lease is not None and lease.expired():
            return tr.lease_expired(spec, "during the transfer and the owner reclaimed the window; the bytes "
                                          "moved are not valid")
        return exc
    if res.cb is None and isinstance(exc, EngineError) and res.info.extra.get("listed", True):
        # (an unlisted window has no record to ask: its owner's liveness decides, below)
        now = res.resolver.generation_now(spec)
        if now != spec.generation:
            res.resolver.drop(spec.gva, res)
            res.telemetry.count_error("stale")
            return tr.stale(spec, now, during=True)
    return engine_failure(exc, res, spec, put=put, lease=lease, version=version)


# -- what a ref holds ---------------------------------------------------------------------------------
class PlanRoute:
    """A ref's same-node route: its plain get (``get(buf)``) or put (``put(buf)``) is one native
    call (``memsem._hot.copy_buf`` bound to the resolution's plan, the ref's range and dtype:
    the buffer's door, then ``memsem_plan_copy`` with every window check), without the cache
    lookup or the spec. Both return the native result word: without attention bits, done (the
    version moved in the high bits); else the ref hands it to ``Transfers.after_route``.

    Holds the resolution's keeper (never the resolution) and the plan itself (its native
    memory, about 2 KiB), so a call racing the resolution's release reads valid memory whose
    use word, closed before any release, refuses it.

    Attributes:
        keeper: ``[resolution]``, ``[None]`` once released. spec: the ref's spec it serves.
        token: the runtime's token it was made by. writable: the ref may put. deadline: always
            None (no request is made: nothing to carry to the whole path).
    """

    __slots__ = ("keeper", "spec", "token", "writable", "get", "put", "_plan")
    deadline = None

    def __init__(self, res: "Resolution", spec: RefSpec, token: object) -> None:
        self.keeper = res.keeper
        self.spec = spec
        self.token = token
        self.writable = spec.access == "rw"
        self._plan = res.plan
        self.get = functools.partial(_copy_buf, res.addr, 0, spec.offset, spec.nbytes, spec.dtype_code)
        self.put = functools.partial(_copy_buf, res.addr, 1, spec.offset, spec.nbytes, spec.dtype_code)


DirectRoute.ref_route = staticmethod(PlanRoute)


class WireRoute:
    """A ref's route to another node's window through an owner-checked engine (tcp): its plain
    get or put is the copy bracket on the resolution's plan (opened and closed natively:
    range, permission, liveness due, in-flight count, telemetry) around one small request on
    the engine's path for this thread (``Engine.kept``), without the cache lookup, the retry
    loop or the engine's lookups. The owner checks the request as any other (generation,
    key, version, seqlock).

    ``get(buf)`` / ``put(buf)`` return a result word as :class:`PlanRoute`'s do:
    :data:`ROUTE_STALE` when nothing was sent and the route cannot serve (another thread, a
    closed connection, a recycled handle), :data:`ROUTE_LOST` when the connection failed under
    the request, or a status of the bracket or of the owner's outcome that asks for the retry
    loop (nothing that counts was done). An owner's refusal or
    an engine failure under the request is raised as the whole path raises it.

    Attributes:
        as :class:`PlanRoute`; deadline: the ``time.monotonic()`` bound of the last call that
        sent a request (None: none did): what the whole path keeps to when it makes that
        request again.
    """

    __slots__ = ("keeper", "spec", "token", "writable", "deadline", "_bracket", "_plan_address", "_at", "_n",
                 "_code", "_requests")

    def __init__(self, res: "Resolution", spec: RefSpec, token: object, requests: Any) -> None:
        self.keeper = res.keeper
        self.spec = spec
        self.token = token
        self.writable = spec.access == "rw"
        self.deadline: float | None = None
        self._bracket = KeptBracket(res.plan)
        self._plan_address = res.addr
        self._at = spec.offset
        self._n = spec.nbytes
        self._code = spec.dtype_code
        self._requests = requests

    def put(self, buf: Any) -> int:
        """Put the ref's bytes from ``buf``; see the class docstring for the result word."""
        return self.transfer(buf, True)

    def transfer(self, buf: Any, put: bool = False) -> int:
        """Get the ref's bytes into ``buf`` (``put`` False; also :meth:`get`) or put them from
        it; see the class docstring for the result word.

        Raises:
            What the whole path raises for the owner's refusal or an engine failure.
        """
        kr = self._requests
        c = kr.usable()
        if c is None:  # nothing sent (the deadline of the thread that uses the route stays)
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
            if not st:  # done (flags aside): a version label never older than these bytes
                res = self.keeper[0]
                if res is not None and rc >> _SHIFT > res.seen:
                    res.seen = rc >> _SHIFT
            return rc  # done, or nothing done (the door, the bracket's refusal or close)
        if st == _LOST:  # the connection failed under the request: the whole path makes it again
            kr.drop(c)
            b.undo(self.keeper)
            return ROUTE_LOST
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
                return ROUTE_LOST
            if refused.retry:  # a write section open, a torn copy...: the retry loop, from this outcome
                return exc.status | exc.value << _SHIFT
            raise engine_error(exc, res, self.spec, put, None, 0, refused) from exc
        except BaseException as exc:
            closed = b.undo(self.keeper)
            res = self.keeper[0]
            if res is None or closed is None:
                raise
            raise engine_error(exc, res, self.spec, put, None, 0, closed) from exc
        if v is None:  # the connection failed under the request: the whole path makes it again
            b.undo(self.keeper)
            return ROUTE_LOST
        rc = b.close(v)
        res = self.keeper[0]
        if not rc & _STATUS and res is not None and v > res.seen:
            res.seen = v  # a version label never older than these bytes (Versions.latest)
        return rc

    get = transfer  # a get is the call itself (no frame of its own on the warm path)


__all__ = ["ATTENTION", "ROUTE_LOST", "DirectRoute", "EngineRoute", "OneSidedRoute", "OwnerRoute", "PlanRoute", "ROUTE_STALE",
           "CopyRoute", "UncheckedRoute", "WireRoute", "engine_error", "lease_args", "remote_slots", "route_for"]
