"""The owner side of engines whose owner checks every request (``enforces_generation == "owner"``:
tcp): credentials checked at the door, grants, the seqlock bracket around the owner's own copy,
and watches of control words pushed to remote consumers.

**Opening.** A remote consumer shows a credential *token* (window gva and generation, the ref's
mint: range, access and the owner's MAC over them) and a *proof*: an HMAC under the window's
access key of the engine's per-connection challenge (a fresh nonce) and the token. The access
key never crosses the wire, and a proof sniffed on one connection is worth nothing on another.
``Server.open`` checks, before any byte moves and before anything about the window is told:
the window is served here at the token's generation and the proof matches its key (a window not
served here is refused exactly like a wrong proof: one message, the same work); then the mint's
MAC verifies under this owner's secret (a ref edited to widen its range or add write access is
refused), and it returns a :class:`Grant`.

**Grants** belong to the session (connection handle) that opened them and live until it closes
them; no cache holds them. A grant holds a claim on the window's *serving resolution* (the
owner's own memory; one per window, owned by the :class:`Server`, closed only when the window
retires), so the control block stays mapped and every copy is counted in this process's
in-flight slot. Requests must lie inside the mint's range; puts and ready marks need a writable
mint of a writable window, and a mark's tile must lie inside the minted range. Every copy runs
inside the native seqlock bracket, held only around one call that never waits for a peer
(``move``: one non-blocking send or receive), and yields the native outcome, which the engine
carries to the consumer as is.

**Watches** of a grant's control words: :mod:`memsem.core._watches`.
"""
from __future__ import annotations

import hmac
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import native
from memsem._buffers import address_view
from memsem._errors import (
    AccessDeniedError,
    MemsemError,
    MemsemTimeoutError,
    StaleReferenceError,
    VersionGoneError,
)
from memsem.engines import WATCH_HEADER
from memsem.gva import (
    Mint,
    RefSpec,
    credential_proof,
    mint_mac,
    mint_valid,
    parse_token,
)
from memsem.gva._control_block import W_LATEST
from memsem.core import _translate as tr
from memsem.core._bracket import ATTENTION, Bracket, Outcome, Status, settle, value_of
from memsem.core._resolve import Resolution
from memsem.core._wait import Wait
from memsem.core._watches import Subscription, WatchHub

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore
    from memsem.core._publish import Owned

#: how long a retire waits (at most) for its generation change to reach remote watchers' sockets
FLUSH_S = 1.0
#: owner-side wait of one request for an open write section, per slice (seconds)
BUSY_SLICE_S = 0.05
#: versions one grant (a remote consumer's session) may hold reserved at once
MAX_RESERVATIONS = 8

_ffi = native.ffi
_lib = native.lib


class Token:
    """One open bracket of a grant: ``address`` to copy from or to, ``version`` read or
    overwritten (see ``memsem.core._bracket.Bracket``)."""

    __slots__ = ("bracket", "put", "nbytes", "address", "version")

    def __init__(self, bracket: Bracket, put: bool, nbytes: int) -> None:
        self.bracket, self.put, self.nbytes = bracket, put, nbytes
        self.address = bracket.address
        self.version = bracket.version


class Grant:
    """A checked credential of one remote consumer's session for one window generation of
    this runtime: it lives as long as the session (the connection's handle) that opened it.

    Attributes:
        gva, generation: the window. nbytes: its size. writable: the mint and the window allow
        puts (and ready marks). lo, hi: the minted byte range (requests must lie inside it).
        n_ready, tile_bytes: ready words of the window. spec: the owner's ref (labels).
    """

    __slots__ = ("gva", "generation", "nbytes", "writable", "lo", "hi", "n_ready", "tile_bytes", "spec",
                 "_res", "_server", "_closed", "_commits", "_reservations")

    def __init__(self, server: "Server", res: Resolution, owned: "Owned", mint: Mint) -> None:
        self._server = server
        self._res = res
        self.spec = owned.spec()
        self.gva, self.generation = owned.info.gva, owned.generation
        self.nbytes = res.nbytes
        self.lo, self.hi = mint.offset, mint.offset + mint.nbytes
        self.writable = mint.access == "rw" and owned.info.access == "rw"
        self.n_ready = owned.cb.n_ready
        self.tile_bytes = owned.info.tile_bytes
        self._closed = False
        self._commits: Subscription | None = None
        #: versions held for the session (``reserve``): version -> the owner's pinned lease
        self._reservations: dict[int, Any] = {}

    @property
    def closed(self) -> bool:
        return self._closed or self._res.closed

    def current(self) -> int:
        """The window's generation now (0 when its control block is gone)."""
        cb = self._res.cb
        return 0 if cb is None or cb.closed else cb.generation

    def check(self, put: bool, offset: int, nbytes: int) -> None:
        """A request's range and direction against the mint.

        Raises:
            ValueError: the range is not inside the minted range. AccessDeniedError: a put
            through a read-only mint or to a read-only window.
        """
        if offset < self.lo or nbytes < 0 or offset + nbytes > self.hi:
            raise ValueError(f"range [{offset}, {offset + nbytes}) lies outside the range "
                             f"[{self.lo}, {self.hi}) minted for this ref of window gva {self.gva:#x}")
        if put and not self.writable:
            raise AccessDeniedError(f"write to window gva {self.gva:#x}: the ref was minted read-only "
                                    "or the window was published read-only")

    def check_tile(self, tile: int) -> None:
        """A ready mark's tile against the mint, like a put's range: the tile's bytes must lie
        inside the minted range, and the mint and the window must be writable.

        Raises:
            AccessDeniedError: read-only, or the tile lies (partly) outside the minted range.
            ValueError: the window has no such tile.
        """
        if not self.writable:
            raise AccessDeniedError(f"ready mark on window gva {self.gva:#x}: the ref was minted read-only "
                                    "or the window was published read-only; readiness is the producer's to set")
        if not 0 <= tile < self.n_ready:
            raise ValueError(f"tile {tile} of window gva {self.gva:#x}: it has {self.n_ready} tiles")
        lo = tile * self.tile_bytes
        hi = min(lo + self.tile_bytes, self.nbytes)
        if lo < self.lo or hi > self.hi:
            raise AccessDeniedError(f"ready mark of tile {tile} (bytes [{lo}, {hi})) of window gva "
                                    f"{self.gva:#x}: the ref was minted for bytes [{self.lo}, {self.hi}) only")

    def open_bracket(self, put: bool, offset: int, nbytes: int, version: int = 0,
                     wait_s: float = 0.0) -> tuple[Token | None, Outcome]:
        """Open the seqlock bracket for one copy (counted in flight): ``(token, outcome)``, the
        token None unless the outcome is OK. An open write section (or a version not committed
        yet) is waited for, at most ``wait_s`` seconds (then the outcome is BUSY); every other
        outcome is returned at once, for the caller to answer with (the owner's native outcome
        is what an owner-checked engine carries back to its consumer)."""
        res = self._res
        wait: Wait | None = None
        while True:
            b = Bracket(res)
            o = b.open(put, offset, nbytes, version)
            if o.ok:
                return Token(b, put, nbytes), o
            if o.status not in (Status.BUSY, Status.TORN):
                return None, o
            if wait is None:
                wait = Wait(f"{self.spec.label}: a write section", wait_s, telemetry=self._server.core.telemetry,
                            state="stayed open")
            if not wait.nap(lambda sl: res.wait_sequence(version, sl)):
                return None, o

    def close_bracket(self, token: Token, failed: bool = False) -> Outcome:
        """Close the bracket: OK (the bytes moved are one version's), TORN (a write section
        opened meanwhile: do it again), GEN_AFTER (the generation moved: no byte is valid)..."""
        return token.bracket.close(failed)

    def enter(self, put: bool, offset: int, nbytes: int, version: int = 0, wait_s: float = 0.0) -> Token:
        """``open_bracket``, raising for every outcome but OK.

        Raises:
            StaleReferenceError: the generation moved (``found`` = the current one) or the
                version asked for was overwritten. MemsemTimeoutError: still busy after
                ``wait_s``. ValueError / AccessDeniedError: range or permission (natively).
        """
        tok, o = self.open_bracket(put, offset, nbytes, version, wait_s)
        if tok is not None:
            return tok
        raise self.refusal(o, version, offset, nbytes, wait_s)

    def refusal(self, o: Outcome, version: int = 0, offset: int = 0, nbytes: int = 0,
                wait_s: float = 0.0) -> BaseException:
        """The memsem error of a bracket outcome on the owner's side (messages name the
        owner's window; the owner's resolution is never dropped for a remote consumer)."""
        st = o.status
        if st in (Status.GEN_BEFORE, Status.GEN_AFTER, Status.CLOSED):
            return tr.stale(self.spec, o.value if st is not Status.CLOSED else (self.current() or None),
                            during=st is Status.GEN_AFTER)
        if st is Status.VERSION_GONE:
            return tr.version_gone(self.spec, version, o.value)
        if st is Status.RANGE:
            return tr.out_of_range(self.spec, offset, offset + nbytes, self.nbytes)
        if st is Status.READONLY:
            return tr.read_only(self.spec)
        if st is Status.VERSION_RANGE:
            return tr.version_range(version)
        if st in (Status.BUSY, Status.TORN):
            return tr.busy_timeout(self.spec, wait_s)
        return MemsemError(f"{self.spec.label}: unexpected native status {st.name}")

    def leave(self, token: Token, failed: bool = False) -> bool:
        """Close the bracket. True when the bytes moved are valid; False when a write section
        opened meanwhile (torn: do it again).

        Raises:
            StaleReferenceError: the generation moved meanwhile (no byte moved is valid).
        """
        o = self.close_bracket(token, failed)
        if o.ok:
            return True
        if o.status is Status.TORN or failed and o.status is not Status.GEN_AFTER:
            return False
        raise self.refusal(o)

    def copy(self, put: bool, offset: int, address: int, nbytes: int, version: int = 0) -> int | None:
        """The whole bracket and copy in one native call, between the window and ``address``
        (memory of this process): returns the version moved, or None when anything but a plain
        success happened (nothing moved that counts: take ``enter``/``leave``, which waits or
        raises). Small requests take this path."""
        res = self._res
        rc = _lib.memsem_plan_copy(res.plan, 1 if put else 0, offset, address, nbytes, version, 0, 0)
        if not rc & ATTENTION:
            return value_of(rc)
        o = settle(res, rc)
        return o.value if o.ok else None

    def view(self, token: Token) -> np.ndarray:
        """Flat uint8 array over the bytes of an open bracket (valid until ``leave``)."""
        return address_view(token.address, token.nbytes, self._res)

    def move(self, put: bool, offset: int, nbytes: int, version: int,
             io: Callable[[int, int], int]) -> tuple[Outcome, int]:
        """One seqlock bracket around ``io(address, nbytes)``, a call that moves at most
        ``nbytes`` bytes at ``address`` (the window's bytes at ``offset`` in the slot of
        ``version``, 0 the latest) and returns how many it moved without waiting (one
        non-blocking send or receive). The bracket is held only during that call, so it never
        depends on a remote peer's progress.

        Returns ``(outcome, moved)``: the bracket's outcome (OK: ``value`` is the version moved;
        else the native status and its value, which an owner-checked engine carries to its
        consumer as is) and the bytes ``io`` moved (valid only when the outcome is OK). A closed
        serving resolution (the window was retired) is GEN_BEFORE with the generation found.

        Raises:
            Whatever ``io`` raises (the bracket is closed as failed first).
        """
        b = Bracket(self._res)
        o = b.open(put, offset, nbytes, version)
        if not o.ok:
            if o.status is Status.CLOSED:
                o = Outcome(Status.GEN_BEFORE, self.current())
            return o, 0
        moved = 0
        failed = True
        try:
            moved = io(b.address, nbytes)
            failed = False
        finally:
            o = b.close(failed, moved)  # counted: what moved, not what the socket was offered
        return o, moved

    def partial(self, o: Outcome) -> Outcome:
        """What the consumer is told when a reply's bytes went out in part before the brackets
        around them failed with ``o``: the generation moved (GEN_AFTER), else the bytes are not
        one version's (TORN: asked again)."""
        if o.status in (Status.GEN_BEFORE, Status.GEN_AFTER):
            return Outcome(Status.GEN_AFTER, o.value)
        return Outcome(Status.TORN, 0)

    def gone(self) -> Outcome:
        """The outcome of a request on a grant whose window was retired (GEN_BEFORE, with the
        generation now)."""
        return Outcome(Status.GEN_BEFORE, self.current())

    def set_ready(self, tile: int, ready: bool) -> Outcome:
        """Mark (or clear) tile ``tile`` for this grant's generation, as the owner's own
        ``mark_ready`` / ``clear_ready`` would (waking local waiters and watchers). Returns the
        outcome: OK, or GEN_BEFORE with the generation found (0: gone).

        Raises:
            AccessDeniedError / ValueError: as :meth:`check_tile`.
        """
        self.check_tile(tile)
        cur = self.current()
        if cur != self.generation:
            return Outcome(Status.GEN_BEFORE, cur)
        core = self._server.core
        try:
            if ready:
                core.readiness.mark(self.spec, tile)
            else:
                core.readiness.clear(self.spec, tile)
        except StaleReferenceError as exc:  # retired between the check and the mark
            return Outcome(Status.GEN_BEFORE, exc.found or 0)
        return Outcome(Status.OK, 0)

    def add_rows(self, tile: int, rows: int, total: int) -> Outcome:
        """Count ``rows`` of tile ``tile``'s ``total`` written by the remote producer, as the
        owner's own ``Readiness.add_rows`` would (the tile is marked once complete). Returns OK
        (value: the rows written so far), or GEN_BEFORE with the generation found.

        Raises:
            AccessDeniedError / ValueError: as :meth:`check_tile`; rows written twice.
        """
        self.check_tile(tile)
        cur = self.current()
        if cur != self.generation:
            return Outcome(Status.GEN_BEFORE, cur)
        try:
            return Outcome(Status.OK, self._server.core.readiness.add_rows(self.spec, tile, rows, total))
        except StaleReferenceError as exc:
            return Outcome(Status.GEN_BEFORE, exc.found or 0)
        except ValueError:  # rows counted twice: the word was left as it was
            return Outcome(Status.RANGE, 0)

    @property
    def commit_watched(self) -> bool:
        """``on_commit`` was called (and the grant is open)."""
        return self._commits is not None

    def on_commit(self, notify: Callable[[], None]) -> None:
        """Call ``notify()`` (from the hub's thread; it must not block) whenever a version of
        the window is committed or its generation moves, until the grant closes: what a
        request parked on an open write section waits for.

        Raises:
            StaleReferenceError: the window is gone. MemsemError: too many subscriptions.
        """
        if self._commits is None:
            self._commits = self._server.hub.subscribe(self, [(WATCH_HEADER, W_LATEST, 1)], notify)
        else:
            self._commits.notify = notify

    def watch(self, targets: Sequence[tuple[int, int, int]], notify: Callable[[], None]) -> "Subscription":
        """Subscribe to control words of this window (see the module docstring). ``notify()``
        is called (from the hub's thread; it must not block) when some of them changed; the
        subscriber then calls ``Subscription.collect``.

        Raises:
            ValueError: a target names a word that cannot be watched. StaleReferenceError: the
            window is gone. MemsemError: too many subscriptions.
        """
        return self._server.hub.subscribe(self, targets, notify)

    def pin_control(self) -> Any:
        """The control block, pinned for a subscription (unpinned by its close)."""
        cb = self._res.cb
        if cb is None or self._res.closed:
            raise tr.stale(self.spec, None)
        try:
            cb.pin()
        except ValueError:
            raise tr.stale(self.spec, None) from None
        return cb

    # -- reservations: versions held for the session ----------------------------------------------
    def reserve(self, version: int, ttl: float) -> Outcome:
        """Hold ``version`` (0: the latest committed one) of the window for this grant's
        session: a lease of this runtime pinning it (``Versions.pin_now``), so the owner's write
        sections do not overwrite it until ``drop_reservation``, ``ttl`` seconds (capped by the
        runtime's timeout: a remote consumer never holds the writer longer), or the session's
        end (``close``). A reservation of a version held already is renewed. Never waits.

        Returns:
            OK (value: the version held), BUSY (a write section is overwriting it: ask again
            after a commit), VERSION_GONE (value: the version found), GEN_BEFORE (value: the
            generation found; 0: gone).

        Raises:
            MemsemError: ``MAX_RESERVATIONS`` versions are held already.
        """
        core = self._server.core
        cur = self.current()
        if self.closed or cur != self.generation:
            return Outcome(Status.GEN_BEFORE, cur)
        ttl = min(max(float(ttl), 1e-3), core.timeout)
        held = self._reservations.get(version) if version else None
        if held is not None and held.held:
            try:
                held.renew(ttl)
                return Outcome(Status.OK, version)
            except MemsemError:
                self._reservations.pop(version, None)
        if len(self._reservations) >= MAX_RESERVATIONS:
            for v in [v for v, le in self._reservations.items() if not le.held or le.expired()]:
                self._reservations.pop(v).release()
            if len(self._reservations) >= MAX_RESERVATIONS:
                raise MemsemError(f"{self.spec.label}: {MAX_RESERVATIONS} versions are reserved on this "
                                  "connection already (drop some)")
        try:
            lease = core.versions.pin_now(self.spec, version, ttl)
        except VersionGoneError as exc:
            return Outcome(Status.VERSION_GONE, exc.found or 0)
        except StaleReferenceError as exc:
            return Outcome(Status.GEN_BEFORE, exc.found or 0)
        if lease is None:
            return Outcome(Status.BUSY, 0)
        old = self._reservations.pop(lease.version, None)
        if old is not None:
            old.release()
        self._reservations[lease.version] = lease
        return Outcome(Status.OK, lease.version)

    def drop_reservation(self, version: int) -> None:
        """Give back the reservation of ``version`` (a no-op when none is held)."""
        lease = self._reservations.pop(version, None)
        if lease is not None:
            lease.release()

    def close(self) -> None:
        """Drop the grant's reservations and its claim on the serving resolution (safe twice)."""
        if not self._closed:
            self._closed = True
            for lease in self._reservations.values():
                lease.release(force=True)
            self._reservations.clear()
            if self._commits is not None:
                self._commits.close()
                self._commits = None
            self._res.leave()


class Server:
    """Mints, credentials, serving resolutions and watches of one runtime (the owner side of
    owner-checked engines).

    Grants belong to the sessions that opened them (no cache: a grant lives until its
    session closes it). Each window served has one *serving resolution* of the owner's own
    memory, owned here and never cached (no cache bound or eviction closes it under a grant):
    made at the first grant of the window, closed when the window retires (``evict``).
    """

    def __init__(self, core: "RuntimeCore") -> None:
        self.core = core
        #: gva -> the serving resolution of the window's live generation
        self._serving: dict[int, Resolution] = {}
        self._lock = threading.Lock()
        #: the key a proof is checked against when the window named is not served here, so
        #: that an unowned GVA costs and answers exactly what a wrong proof does
        self._decoy = secrets.token_bytes(16)
        self.hub = WatchHub()

    # -- mints ------------------------------------------------------------------------------------
    def mint(self, spec: RefSpec) -> RefSpec:
        """``spec`` minted by this owner for exactly its own range and access (a narrower
        capability to hand out). A ref of a window this runtime does not own (or of another
        generation) is returned as is."""
        owned = self.core.publisher.owned.get(spec.gva)
        if owned is None or owned.generation != spec.generation or owned.retiring:
            return spec
        access = "rw" if spec.writable and owned.info.access == "rw" else "r"
        mac = mint_mac(self.core.publisher.mint_secret, spec.gva, spec.generation, spec.offset, spec.nbytes, access)
        m = Mint(spec.offset, spec.nbytes, access, mac)
        return RefSpec(spec.gva, spec.generation, spec.key, access, spec.offset, spec.nbytes, spec.dtype_code,
                       spec.shape, spec.byte_offset, spec.framework, spec.name, m)

    # -- opening ----------------------------------------------------------------------------------
    def open(self, token: bytes, challenge: bytes, proof: bytes) -> Grant:
        """Check a remote consumer's credential (see the module docstring) and return a new
        grant for its session (the caller closes it).

        Nothing about the window is told before the proof verifies: a malformed token, a
        window not served here (never published, unpublished, retiring, another generation)
        and a wrong proof are one refusal, with one message. After the proof: a ref without a
        mint, or whose mint's MAC does not verify (an edited ref), is refused by name.

        Raises:
            AccessDeniedError: refused (the engine closes the connection).
            RuntimeClosedError / MemsemError: the runtime is closing, or cannot serve the window.
        """
        core = self.core
        try:
            gva, gen, mint = parse_token(token)
        except ValueError:
            gva, gen, mint = -1, -1, None
        owned = core.publisher.owned.get(gva)
        live = owned is not None and not owned.retiring and owned.generation == gen
        key = owned.key if live else self._decoy
        good = hmac.compare_digest(credential_proof(key, challenge, bytes(token)), bytes(proof))
        if not (live and good):
            raise AccessDeniedError(REFUSED)
        spec = owned.spec()
        if mint is None:
            raise AccessDeniedError(f"the ref to {spec.label} carries no mint (built by hand, or by an older "
                                    "memsem): ask its owner for a ref (publish, lookup)")
        if not mint_valid(core.publisher.mint_secret, gva, gen, mint):
            raise AccessDeniedError(f"the ref to {spec.label} was altered: its minted range/access "
                                    f"[{mint.offset}, {mint.offset + mint.nbytes}) {mint.access!r} does "
                                    "not verify under the owner's MAC")
        with self._lock:
            res = self._serving.get(gva)
            if res is not None and (res.closed or res.generation != gen):
                del self._serving[gva]
                res.close()
                res = None
            if res is None:
                # the owner's own memory, whatever the route preference; owned here, not cached
                res = self._serving[gva] = core.resolver.resolve_direct(spec)
            if not res.enter():  # the grant's claim
                raise AccessDeniedError(REFUSED)
            return Grant(self, res, owned, mint)

    # -- lifetime ---------------------------------------------------------------------------------
    def evict(self, gva: int) -> None:
        """Window ``gva`` is retired: close its serving resolution (grants still held by
        sessions answer GEN_BEFORE from then on) and tell its watchers."""
        with self._lock:
            res = self._serving.pop(gva, None)
        if res is not None:
            res.close()
        # remote watchers learn of the retire before it returns (a wait of theirs on an old
        # mark then raises StaleReferenceError, as on this node)
        self.hub.changed(gva, flush_s=FLUSH_S)

    def close(self) -> None:
        self.hub.close()
        with self._lock:
            all_, self._serving = list(self._serving.values()), {}
        for r in all_:
            r.close()


#: the one refusal of a credential before its proof verified (whatever was wrong)
REFUSED = ("credential refused: its proof does not verify for a window this owner serves (wrong "
           "access key, a proof replayed from another connection, or no such window here)")

__all__ = ["REFUSED", "Grant", "MemsemTimeoutError", "Server", "Subscription", "Token", "WatchHub"]
