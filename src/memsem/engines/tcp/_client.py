"""The consumer side of the tcp engine: connections to owners, their handles, pipelined
transfers, and the watch connection whose reader applies the owner's pushed words.

Every byte a consumer receives goes through one buffered reader (:meth:`Connection.frame` /
:meth:`Connection.read_into`) built on the wire's ``read_exact``, and every byte it sends
through ``write_all``: both carry the request's deadline, checked (with the owner's liveness)
at every receive/send slice, whatever byte the owner stalls at.

A connection's handles (one per credential opened on it) are recycled: at most
``CLIENT_HANDLES`` stay open; the least recently used one is closed (a CLOSE sent ahead of the
next request) and its number reused, so a thread may touch any number of refs.
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memsem import _hot
from memsem._errors import AccessDeniedError, EngineError, MemsemError, PeerLostError
from memsem.engines._base import RUN_DIGEST_BYTES, Credential, RemoteOutcome
from memsem.engines.tcp import _wire as W
from memsem.native import lib as _lib

if TYPE_CHECKING:
    from memsem.engines.tcp._engine import TcpEngine, TcpRemote

log = logging.getLogger(__name__)

_INF = float("inf")
#: the receive buffer of a connection: a small GET's reply (header, bytes, trailer) fits whole
RECV_BYTES = 2 * W.REP.size + W.SMALL_BYTES
_REP_SIZE, _SMALL, _DATA, _OK = W.REP.size, W.SMALL_BYTES, W.DATA, W.OK
_pack_req = W.REQ.pack
#: the one reader of the reply layout (native/memsem_hot.c, shared with the kept route's call)
_unpack_rep = _hot.reply_header
_get_ident = threading.get_ident
_OP_GET, _OP_PUT = W.OP_GET, W.OP_PUT
#: the op :meth:`Connection.reply` is given for the trailer after a GET's bytes (OK or OUTCOME)
TRAILER = -1
_OP_NAMES = {W.OP_OPEN: "open", W.OP_GET: "get", TRAILER: "get", W.OP_PUT: "put", W.OP_MARK: "ready mark",
             W.OP_CLEAR: "ready mark", W.OP_PIN: "pin", W.OP_WATCH: "watch", W.OP_SYNC: "watch",
             W.OP_DIGEST: "digest"}
_ERRNO = _lib.MEMSEM_RC_ERRNO
#: outcome statuses whose value is a version (an open section's, the version found)
_VERSIONED = frozenset({_lib.MEMSEM_RC_BUSY, _lib.MEMSEM_RC_VERSION_GONE})
_U64 = (1 << 64) - 1
_wire = _hot.wire
_SHIFT = _lib.MEMSEM_RC_VERSION_SHIFT
#: how long the native call of a kept request waits for its reply before Python waits on
_SLICE_MS = int(W.POLL_SLICE * 1000)
#: the native call's results that leave a request in flight (:meth:`KeptRequests.call`)
RC_WIRE_PENDING, RC_WIRE_LOST, RC_WIRE_SENDING = _hot.RC_WIRE_PENDING, _hot.RC_WIRE_LOST, _hot.RC_WIRE_SENDING
_STATUS = _lib.MEMSEM_RC_STATUS_MASK


class Lost(Exception):
    """A connection failed under a request (reset, closed, refused during the hello): private
    to the engine, which makes the request again on a new connection or raises PeerLostError."""

    def __init__(self, why: str, errno: int | None = None) -> None:
        super().__init__(why)
        self.errno = errno


class Connection:
    """One connection of a consumer to an owner: the owner's nonce, this side's handles for the
    credentials opened on it, and the buffered receive path.

    Raises (constructor): PeerLostError (refused: nothing listens), Lost (the connection failed
    before the owner's hello), EngineError (FULL: the owner serves its maximum of connections;
    not the memsem protocol), MemsemTimeoutError.
    """

    def __init__(self, engine: "TcpEngine", remote: "TcpRemote", kind: int, deadline: float) -> None:
        self.engine = engine
        self.remote = remote
        self.endpoint = remote.endpoint
        self.closed = False
        self.handles: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._free: list[int] = []
        self._next_handle = 0
        self._closing: list[bytes] = []  # CLOSE frames sent ahead of the next request
        self._rid = 0
        self._buf = bytearray(RECV_BYTES)
        self._mv = memoryview(self._buf)
        self._lo = self._hi = 0
        #: between slices of a send, and of a receive: the deadline and the owner's liveness
        self._waited = self._recv_waited = lambda d: engine.waited(remote, d)
        self.sock = engine.open_socket(remote, deadline)
        try:
            W.configure(self.sock, engine.bounds, W.POLL_SLICE)
            magic, proto, status, nonce = W.HELLO.unpack(self.take(W.HELLO.size, deadline))
            if magic != W.MAGIC or proto != W.PROTOCOL:
                raise EngineError(f"{self.endpoint} does not speak memsem tcp protocol {W.PROTOCOL} "
                                  f"(hello {magic!r}, protocol {proto})")
            if status == W.HELLO_FULL:
                cap, count = W.FULL_INFO.unpack(nonce)
                raise engine.full_error(remote, cap, count)
            self.nonce = nonce
            self.send(W.CHELLO.pack(W.MAGIC, W.PROTOCOL, kind), deadline)
        except BaseException:
            self.close()
            raise

    # -- receiving: the one path ------------------------------------------------------------------
    def _fill(self, need: int, deadline: float) -> None:
        """At least ``need`` (<= the buffer) bytes buffered (and whatever else has arrived)."""
        have = self._hi - self._lo
        if have >= need:
            return
        if self._lo:
            self._buf[:have] = self._buf[self._lo:self._hi]
            self._lo, self._hi = 0, have
        self._hi += self._recv(self._mv[have:], deadline, need - have)

    def _recv(self, mv: memoryview, deadline: float, at_least: int | None = None) -> int:
        try:
            return W.read_exact(self.sock, mv, deadline, self._recv_waited, at_least)
        except W.Closed:
            raise Lost("the owner closed the connection") from None
        except MemsemError:  # the deadline (a TimeoutError, so an OSError too) or a dead owner:
            raise            # never taken for a lost connection
        except OSError as exc:
            raise Lost(f"the connection failed: {exc}", exc.errno) from exc

    def take(self, n: int, deadline: float) -> bytes:
        """The next ``n`` (<= the buffer) bytes."""
        self._fill(n, deadline)
        out = bytes(self._mv[self._lo:self._lo + n])
        self._lo += n
        return out

    def frame(self, deadline: float) -> tuple[int, int, int, int, int, int]:
        """The next reply header ``(status, flags, handle, rid, value, nbytes)``, unchecked: the
        one place a consumer reads the reply layout (:meth:`reply` checks it against its
        request; the watch reader checks events)."""
        if self._hi - self._lo < _REP_SIZE:
            self._fill(_REP_SIZE, deadline)
        out = _unpack_rep(self._buf, self._lo)
        self._lo += _REP_SIZE
        return out

    def violation(self, what: str, why: str) -> EngineError:
        """The error of a reply that breaks the protocol (the connection is out of step: the
        caller drops it)."""
        return EngineError(f"tcp {what} at {self.endpoint}: the owner broke the protocol ({why}); the "
                           "connection is dropped", name="PROTOCOL")

    def reply(self, rid: int, handle: int, op: int, deadline: float) -> tuple[int, int, int, int]:
        """The next reply header ``(status, flags, value, nbytes)``, checked against its request
        (``rid`` on ``handle``, of op ``op``; ``TRAILER``: the trailer after a GET's bytes):
        its id and handle, a status that answers that op, and the bytes it may carry (none
        after OK and OUTCOME, at most ``MAX_ERROR_TEXT`` of text). FULL (the owner refused the
        connection) answers any request.

        Raises:
            EngineError: a reply that breaks the protocol (``name`` "PROTOCOL"). Lost,
            MemsemTimeoutError, PeerLostError: as the receive.
        """
        return self.check(self.frame(deadline), rid, handle, op)

    def check(self, header: tuple[int, int, int, int, int, int], rid: int, handle: int,
              op: int) -> tuple[int, int, int, int]:
        """``header`` (from :meth:`frame`) checked against its request, as :meth:`reply` says."""
        status, flags, h, got, value, nbytes = header
        what = _OP_NAMES.get(op, "request")
        if status == W.FULL:
            if nbytes > W.MAX_ERROR_TEXT:
                raise self.violation(what, f"a FULL reply carries {nbytes} bytes of text")
            return status, flags, value, nbytes
        if got != rid or h != handle:
            raise self.violation(what, f"a reply to request {got} on handle {h} came for request {rid} on "
                                       f"handle {handle}")
        if status == W.DATA:
            if op != W.OP_GET and op != W.OP_DIGEST:
                raise self.violation(what, "DATA answers only a GET or a DIGEST")
        elif status == W.OK or status == W.OUTCOME:
            if nbytes:
                raise self.violation(what, f"{W.STATUS_NAMES[status]} carries {nbytes} bytes")
        elif status == W.DENIED or status == W.ERROR:
            if op == TRAILER:
                raise self.violation(what, f"{W.STATUS_NAMES[status]} after a GET's bytes")
            if nbytes > W.MAX_ERROR_TEXT:
                raise self.violation(what, f"a reply carries {nbytes} bytes of text")
        else:
            raise self.violation(what, f"status {status} ({W.STATUS_NAMES.get(status, 'unknown')}) answers a "
                                       "request")
        return status, flags, value, nbytes

    def read_into(self, mv: memoryview, deadline: float) -> None:
        """Fill ``mv`` exactly: buffered bytes first, then straight from the socket."""
        n = len(mv)
        k = min(n, self._hi - self._lo)
        if k:
            mv[:k] = self._mv[self._lo:self._lo + k]
            self._lo += k
        if k < n:  # the rest straight into ``mv``: bigger than the buffer, or not all here yet
            if n - k <= RECV_BYTES // 2:
                self._fill(n - k, deadline)
                mv[k:] = self._mv[:n - k]
                self._lo = n - k
            else:
                self._recv(mv[k:], deadline)

    def text(self, nbytes: int, deadline: float) -> str:
        b = bytearray(nbytes)  # bounded by ``reply``
        self.read_into(memoryview(b), deadline)
        return b.decode(errors="replace")

    def answer(self, status: int, flags: int, value: int, nbytes: int, deadline: float, what: str,
               limit: int = W.VERSION_MAX) -> int:
        """A reply other than DATA (from :meth:`reply`): its value when OK (at most ``limit``:
        a version, a row count), else the error it means (raised): the owner's native outcome
        as :class:`RemoteOutcome` (its status one an owner may send, an errno in range), a
        refusal as AccessDeniedError."""
        if status == W.OK:
            if value > limit:
                raise self.violation(what, f"OK names {value}, more than {limit}")
            return value
        if status == W.OUTCOME:
            if flags not in W.OWNER_OUTCOMES:
                raise self.violation(what, f"an outcome of status {flags}, which no owner sends")
            if flags == _ERRNO and not 0 < value <= W.ERRNO_MAX:
                raise self.violation(what, f"an errno outcome of {value} (1 to {W.ERRNO_MAX})")
            if flags in _VERSIONED and value > W.VERSION_MAX:  # its value is a version
                raise self.violation(what, f"an outcome {flags} naming version {value}, more than {W.VERSION_MAX}")
            raise RemoteOutcome(f"tcp {what} at {self.endpoint}: the owner's outcome {flags} (value {value})",
                                status=flags, value=value)
        text = self.text(nbytes, deadline) if nbytes else ""
        if status == W.DENIED:
            raise AccessDeniedError(f"tcp {what} at {self.endpoint}: {text}")
        if status == W.FULL:
            raise EngineError(f"tcp {what} at {self.endpoint}: {text}", name="FULL")
        raise EngineError(f"tcp {what} at {self.endpoint} failed at the owner: "
                          f"{text or W.STATUS_NAMES.get(status, status)}", name=W.STATUS_NAMES.get(status))

    def result(self, rid: int, h: int, put: bool, mv: memoryview, deadline: float) -> int:
        """The reply to the GET or PUT ``rid`` on handle ``h`` of ``len(mv)`` bytes: a GET's
        DATA of exactly those bytes (into ``mv``) and its trailer, a PUT's OK. Returns the
        version moved.

        Raises:
            RemoteOutcome: the owner's outcome (the connection stays in step). EngineError: a
            reply that breaks the protocol (a GET answered OK without its bytes, DATA of another
            size...) or a refusal; AccessDeniedError; as :meth:`reply`.
        """
        op = _OP_PUT if put else _OP_GET
        status, flags, value, nbytes = self.reply(rid, h, op, deadline)
        if status == _DATA:
            if nbytes != len(mv):
                raise self.violation("get", f"DATA of {nbytes} bytes answers a GET of {len(mv)}")
            self.read_into(mv, deadline)
            status, flags, value, nbytes = self.reply(rid, h, TRAILER, deadline)
        elif status == _OK and not put:
            raise self.violation("get", "a GET answered OK without its bytes")
        return self.answer(status, flags, value, nbytes, deadline, "put" if put else "get")

    # -- sending ----------------------------------------------------------------------------------
    def send(self, data: Any, deadline: float) -> None:
        try:
            if self._closing:
                closes, self._closing = b"".join(self._closing), []
                W.write_all(self.sock, closes, deadline, self._waited)
            W.write_all(self.sock, data, deadline, self._waited)
        except MemsemError:  # the deadline or a dead owner: never taken for a lost connection
            raise
        except OSError as exc:
            raise Lost(f"the connection failed: {exc}", exc.errno) from exc

    def next_rid(self) -> int:
        self._rid = (self._rid + 1) & 0xFFFFFFFF
        return self._rid

    # -- handles ----------------------------------------------------------------------------------
    def new_handle(self) -> int:
        """A free handle number; past ``CLIENT_HANDLES`` open ones, the least recently used is
        closed (its CLOSE goes ahead of the next request) and its number reused."""
        if len(self.handles) >= W.CLIENT_HANDLES:
            _, old = self.handles.popitem(last=False)
            self._closing.append(W.REQ.pack(W.OP_CLOSE, 0, old, 0, 0, 0, 0, 0))
            self._free.append(old)
        if self._free:
            return self._free.pop()
        self._next_handle += 1
        return self._next_handle

    def forget(self, token: bytes) -> int | None:
        """Close the handle of ``token`` (with the next request); its number is reused."""
        h = self.handles.pop(token, None)
        if h is not None:
            self._closing.append(W.REQ.pack(W.OP_CLOSE, 0, h, 0, 0, 0, 0, 0))
            self._free.append(h)
        return h

    def handle(self, cred: Credential, deadline: float) -> int:
        """This connection's handle for ``cred`` (opened now if need be)."""
        h = self.handles.get(cred.token)
        if h is not None:
            self.handles.move_to_end(cred.token)
            return h
        h = self.new_handle()
        body = cred.token + cred.prove(self.nonce + W.H16.pack(h))
        rid = self.next_rid()
        try:
            self.send(W.REQ.pack(W.OP_OPEN, 0, h, rid, 0, len(body), 0, 0) + body, deadline)
            status, flags, value, nbytes = self.reply(rid, h, W.OP_OPEN, deadline)
            self.answer(status, flags, value, nbytes, deadline, "open", limit=_U64)
        except BaseException:
            self._free.append(h)
            raise
        self.handles[cred.token] = h
        return h

    # -- requests ---------------------------------------------------------------------------------
    def request(self, h: int, deadline: float, wait_ms: int, op: int, arg: int, what: str) -> int:
        """One request without a body or data (MARK, CLEAR: ``arg`` the tile): its OK value."""
        rid = self.next_rid()
        self.send(W.REQ.pack(op, 0, h, rid, arg, 0, 0, 0), deadline)
        status, flags, value, nbytes = self.reply(rid, h, op, deadline)
        return self.answer(status, flags, value, nbytes, deadline, what, limit=_U64)

    def count_rows(self, h: int, deadline: float, wait_ms: int, tile: int, rows: int, total: int) -> int:
        """A MARK of ``rows`` of tile ``tile``'s ``total`` (arg: ``rows | total << 32``): the rows
        the owner counts as written so far (at most ``total``)."""
        rid = self.next_rid()
        self.send(W.REQ.pack(W.OP_MARK, 0, h, rid, tile, 0, rows | total << 32, 0), deadline)
        status, flags, value, nbytes = self.reply(rid, h, W.OP_MARK, deadline)
        return self.answer(status, flags, value, nbytes, deadline, "row count", limit=total)

    def pin(self, h: int, deadline: float, wait_ms: int, version: int, ttl_ms: int) -> int:
        """A reservation of ``version`` (0: the latest) held by this connection's session for
        ``ttl_ms`` at most: the version the owner holds."""
        rid = self.next_rid()
        self.send(W.REQ.pack(W.OP_PIN, 0, h, rid, ttl_ms, 0, version, wait_ms), deadline)
        status, flags, value, nbytes = self.reply(rid, h, W.OP_PIN, deadline)
        return self.answer(status, flags, value, nbytes, deadline, "pin")

    def digest(self, h: int, deadline: float, wait_ms: int, body: bytes, version: int) -> tuple[int, bytes]:
        """A DIGEST of the runs ``body`` lists (``W.RUN`` each) of ``version`` (0: the latest):
        ``(the version digested, its RUN_DIGEST_BYTES bytes)``. Raises as :meth:`result`."""
        rid = self.next_rid()
        self.send(W.REQ.pack(W.OP_DIGEST, 0, h, rid, 0, len(body), version, wait_ms) + body, deadline)
        status, flags, value, nbytes = self.reply(rid, h, W.OP_DIGEST, deadline)
        if status == _DATA:
            if nbytes != RUN_DIGEST_BYTES:
                raise self.violation("digest", f"DATA of {nbytes} bytes answers a DIGEST ({RUN_DIGEST_BYTES})")
            out = bytearray(RUN_DIGEST_BYTES)
            self.read_into(memoryview(out), deadline)
            status, flags, value, nbytes = self.reply(rid, h, TRAILER, deadline)
            return self.answer(status, flags, value, nbytes, deadline, "digest"), bytes(out)
        if status == _OK:
            raise self.violation("digest", "a DIGEST answered OK without its digest")
        self.answer(status, flags, value, nbytes, deadline, "digest")  # raises
        raise self.violation("digest", f"status {status} answers a DIGEST")

    def unpin(self, h: int, deadline: float, wait_ms: int, version: int) -> None:
        """Give a reservation back (no reply: sent now, not with the next request)."""
        self.send(W.REQ.pack(W.OP_UNPIN, 0, h, 0, 0, 0, version, 0), deadline)

    def transfer(self, h: int, deadline: float, wait_ms: int, put: bool, offset: int, mv: memoryview,
                 version: int) -> int:
        """Move ``len(mv)`` bytes at ``offset``: one request (at most ``SMALL_BYTES``: one send of
        the request and a put's bytes), or chunks of ``CHUNK_BYTES`` with up to
        ``PIPELINE_DEPTH`` in flight. Returns the version moved (the same for every chunk).

        Raises:
            RemoteOutcome: the owner's outcome of a chunk (TORN: chunks of two versions). The
                replies of every request sent are read first, so the connection stays in step.
            AccessDeniedError, EngineError, Lost, MemsemTimeoutError, PeerLostError.
        """
        n = len(mv)
        op = W.OP_PUT if put else W.OP_GET
        if n <= _SMALL:  # one request (the common case)
            rid = self.next_rid()
            head = _pack_req(op, 0, h, rid, offset, n, version, wait_ms)
            self.send(head + mv if put else head, deadline)
            return self.result(rid, h, put, mv, deadline)
        if n <= W.CHUNK_BYTES:
            chunks = [(0, n)]
        else:
            chunks = [(o, min(W.CHUNK_BYTES, n - o)) for o in range(0, n, W.CHUNK_BYTES)]
        rids: list[int] = []

        def send(i: int) -> None:
            o, k = chunks[i]
            rid = self.next_rid()
            rids.append(rid)
            head = W.REQ.pack(op, 0, h, rid, offset + o, k, version, wait_ms)
            if not put:
                self.send(head, deadline)
            elif k <= W.SMALL_BYTES:
                self.send(head + mv[o:o + k], deadline)
            else:
                self.send(head, deadline)
                self.send(mv[o:o + k], deadline)

        for i in range(min(W.PIPELINE_DEPTH, len(chunks))):
            send(i)
        seen = None
        failed: RemoteOutcome | None = None
        what = "put" if put else "get"
        i = 0
        while i < len(rids):
            o, k = chunks[i]
            try:
                v = self.result(rids[i], h, put, mv[o:o + k], deadline)
            except RemoteOutcome as exc:
                failed = failed or exc
            else:
                if seen is None:
                    seen = v
                elif v != seen and failed is None:  # chunks of two versions: not one version's bytes
                    failed = RemoteOutcome(f"tcp {what} at {self.endpoint}: chunks of versions {seen} and {v}",
                                           status=W.TORN_STATUS)
            if failed is None and i + W.PIPELINE_DEPTH < len(chunks):
                send(i + W.PIPELINE_DEPTH)
            i += 1
        if failed is not None:
            raise failed
        return seen or 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            sock = getattr(self, "sock", None)
            if sock is not None:
                try:  # wakes a receive or send of another thread at once (a runtime's close
                    sock.shutdown(socket.SHUT_RDWR)  # past its deadline), then the close
                except OSError:
                    pass
                try:
                    sock.close()
                except OSError:
                    pass


class WatchConnection(Connection):
    """A consumer runtime's watch connection to one owner: a reader thread applies the owner's
    EVENT frames to the subscriptions and hands replies to the requests waiting for them."""

    def __init__(self, engine: "TcpEngine", remote: "TcpRemote", deadline: float) -> None:
        super().__init__(engine, remote, W.KIND_WATCH, deadline)
        self.send_lock = threading.Lock()
        self.subs: dict[int, tuple[Callable[..., None], Callable[[str], None]]] = {}
        self.pending: dict[int, list[Any]] = {}
        self.lost: str | None = None
        self._lock = threading.Lock()
        self._recv_waited = self._idle  # only the reader thread receives from here on
        self.thread = threading.Thread(target=self._read, name=f"memsem-tcp-watch-{remote.endpoint}", daemon=True)
        self.thread.start()

    def request_body(self, op: int, handle: int, body: bytes, deadline: float, what: str) -> int:
        """Send a request and wait (bounded) for its reply; its OK value (else raises)."""
        with self._lock:
            if self.lost is not None:
                raise PeerLostError(f"watch connection to {self.endpoint} was lost: {self.lost}")
            rid = self.next_rid()
            slot: list[Any] = [threading.Event(), None, handle, op]
            self.pending[rid] = slot
        # A request that ends early (its deadline) stays pending: its late reply is read and
        # dropped by the reader (a reply to no request breaks the protocol).
        try:
            with self.send_lock:
                self.send(W.REQ.pack(op, 0, handle, rid, 0, len(body), 0, 0) + body, deadline)
        except BaseException:  # part of the request may be on the stream: the connection ends
            self.pending.pop(rid, None)
            self.shutdown()
            raise
        while not slot[0].wait(W.POLL_SLICE):
            self._waited(deadline)
        if isinstance(slot[1], BaseException):
            raise slot[1]
        return slot[1]

    def post(self, op: int, handle: int) -> None:
        """Send a request whose reply nobody waits for (UNWATCH, CLOSE); best effort."""
        with self._lock:
            if self.lost is not None:
                return
        try:
            with self.send_lock:
                self.send(W.REQ.pack(op, 0, handle, 0, 0, 0, 0, 0),
                          time.monotonic() + (self.engine.timeout or W.DEFAULT_TIMEOUT))
        except (Lost, MemsemError):
            pass

    def open(self, cred: Credential, deadline: float) -> int:
        """The handle of ``cred`` on this connection (opened now if need be)."""
        with self._lock:
            h = self.handles.get(cred.token)
            if h is not None:
                return h
            h = self.new_handle()
        body = cred.token + cred.prove(self.nonce + W.H16.pack(h))
        try:
            self.request_body(W.OP_OPEN, h, body, deadline, "watch")
        except BaseException:
            with self._lock:
                self._free.append(h)
            raise
        with self._lock:
            self.handles[cred.token] = h
        return h

    def _idle(self, deadline: float) -> None:
        """Between receive slices of the reader: it waits for the owner as long as the
        connection lives (the owner pushes when it has something; keepalive and
        TCP_USER_TIMEOUT end a dead link)."""
        if self.closed:
            raise W.Closed("closed")

    def _read(self) -> None:
        reason = "closed"
        try:
            while not self.closed:
                status, flags, handle, rid, value, nbytes = self.frame(_INF)
                if status == W.FULL:  # the owner closed this connection (it serves its maximum)
                    if nbytes > W.MAX_ERROR_TEXT:
                        raise self.violation("watch", f"a FULL reply carries {nbytes} bytes of text")
                    raise EngineError(f"the owner at {self.endpoint} closed the watch connection: "
                                      f"{self.text(nbytes, _INF)}", name="FULL")
                if status == W.EVENT:
                    if value > W.MAX_EVENTS or nbytes != value * W.EVT.size:
                        raise EngineError(f"EVENT frame from {self.endpoint} is malformed ({value} entries, "
                                          f"{nbytes} bytes)")
                    body = bytearray(nbytes)
                    self.read_into(memoryview(body), _INF)
                    changes = [W.EVT.unpack_from(body, i * W.EVT.size) for i in range(value)]
                    sub = self.subs.get(handle)
                    if sub is not None:
                        sub[0](changes)
                    continue
                slot = self.pending.get(rid)
                if slot is None:
                    raise self.violation("watch", f"a reply to request {rid}, which is not pending")
                # a violation ends the connection, and with it every pending request (_end)
                status, flags, value, nbytes = self.check((status, flags, handle, rid, value, nbytes), rid,
                                                          slot[2], slot[3])
                try:
                    out: Any = self.answer(status, flags, value, nbytes, _INF, "watch", limit=_U64)
                except (RemoteOutcome, AccessDeniedError, EngineError) as exc:
                    if getattr(exc, "name", None) == "PROTOCOL":
                        raise
                    out = exc
                del self.pending[rid]
                slot[1] = out
                slot[0].set()
        except BaseException as exc:  # noqa: BLE001 - ends every subscription of the connection
            reason = "closed" if isinstance(exc, W.Closed) else f"{type(exc).__name__}: {exc}"
        finally:
            self._end(reason)

    def _end(self, reason: str) -> None:
        with self._lock:
            if self.lost is None:
                self.lost = reason
            subs = list(self.subs.values())
            self.subs.clear()
            pending = list(self.pending.values())
            self.pending.clear()
        err = PeerLostError(f"watch connection to {self.endpoint} was lost: {reason}")
        for slot in pending:
            slot[1] = err
            slot[0].set()
        if not self.closed:
            for _, on_lost in subs:
                try:
                    on_lost(reason)
                except Exception:  # noqa: BLE001 - one subscriber must not keep others uninformed
                    log.exception("memsem tcp watch: on_lost failed")
        self.engine.forget_watch(self)
        super().close()

    def shutdown(self) -> None:
        """End the stream both ways (the reader thread then ends the connection, telling every
        subscriber and pending request)."""
        sock = getattr(self, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.shutdown()
        t = getattr(self, "thread", None)
        if t is not None and t is not threading.current_thread():
            t.join(2.0)
        super().close()


class WatchHandle:
    """A subscription made by ``TcpEngine.watch`` (``close()`` ends it; safe twice)."""

    def __init__(self, wc: WatchConnection, token: bytes, handle: int) -> None:
        self.wc, self.token, self.handle = wc, token, handle
        self.closed = False

    def sync(self, timeout: float) -> None:
        """Return once every word change the owner made before this call reached it is applied
        here (SYNC: the owner sends what it has not sent yet, then OK; the reader thread
        applies EVENT frames in order, before it hands over the reply). Blocks at most
        ``timeout`` s.

        Raises:
            PeerLostError: the watch connection is lost. MemsemTimeoutError: no reply in time.
        """
        if self.closed:
            return
        self.wc.request_body(W.OP_SYNC, self.handle, b"", time.monotonic() + timeout, "watch")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        wc = self.wc
        with wc._lock:
            wc.subs.pop(self.handle, None)
            if wc.handles.get(self.token) == self.handle:
                del wc.handles[self.token]
            else:
                return
        wc.post(W.OP_CLOSE, self.handle)  # ends the owner's subscription and grant; then reused
        with wc._lock:
            wc._free.append(self.handle)


class KeptRequests:
    """One thread's connection to an owner and its handle for one credential, kept by a ref for
    its next small gets and puts (``TcpEngine.kept``): :meth:`call` is one native call for the
    request and its reply, without the engine's lookups of connection and handle; what it
    does not finish, :meth:`finish` does through ``Connection.result`` (the one reader of the
    connection), within the same deadline.

    It serves only while it is what the engine itself would use (:meth:`usable`): the thread
    that made it, the connection open and in step (no bytes buffered, no CLOSE queued), and
    the handle still this credential's (handles are recycled). The connection is held weakly:
    the engine owns it (and closes it at its close). A connection that fails under a request
    is closed here, so the engine's whole path (``TcpEngine._call``) opens a new one and makes
    the request again within the caller's deadline, with its retries and its error boundary.
    """

    __slots__ = ("timeout", "_conn", "_token", "_handle", "_tid", "_wait_ms", "_head")

    def __init__(self, conn: Connection, token: bytes, handle: int, wait_ms: int, timeout: float) -> None:
        self._conn = weakref.ref(conn)
        self._token = token
        self._handle = handle
        self._tid = threading.get_ident()
        self._wait_ms = wait_ms
        #: seconds a request may take (the engine's timeout): what a caller's deadline adds
        self.timeout = timeout
        self._head = b""

    def usable(self) -> Connection | None:
        """The connection, when a request may go through it now from this thread; else None."""
        c = self._conn()
        if (c is None or c.closed or c._closing or c._lo != c._hi or _get_ident() != self._tid
                or c.handles.get(self._token) != self._handle):
            return None
        c.handles.move_to_end(self._token)  # least recently used first, as on the whole path
        return c

    def call(self, c: Connection, bracket: int, plan: int, put: bool, offset: int, buf: Any, nbytes: int,
             code: int) -> int:
        """The request of ``nbytes`` of the latest version at ``offset`` on ``c`` (from
        :meth:`usable`), with the copy bracket at address ``bracket`` on the plan at address
        ``plan`` around it: one native call (``memsem._hot.wire``: the buffer's door, the
        bracket's open, the request, the receives of its reply for one slice, the bracket's
        close after a plain reply). Returns its result word: done, ``RC_BUFFER`` or the
        bracket's refusal (nothing done), ``RC_WIRE_PENDING`` (bracket open, request sent) or
        ``RC_WIRE_SENDING`` (bracket open, part of the request sent): :meth:`finish`;
        ``RC_WIRE_LOST`` (the connection failed or was closed: :meth:`drop` it and undo the
        bracket, open or not)."""
        fd = c.sock.fileno()  # -1 once closed (the socket's own fd, read now, as its methods do)
        if fd < 0:
            return RC_WIRE_LOST
        rid = c._rid = (c._rid + 1) & 0xFFFFFFFF
        head = self._head = _pack_req(_OP_PUT if put else _OP_GET, 0, self._handle, rid, offset, nbytes, 0,
                                      self._wait_ms)
        return _wire(bracket, plan, fd, put, offset, buf, nbytes, code, head, rid, c._buf, _SLICE_MS)

    def finish(self, c: Connection, rc: int, put: bool, mv: memoryview, deadline: float) -> int | None:
        """The rest of :meth:`call`'s request after ``RC_WIRE_SENDING`` (the bytes of the request
        not sent yet) or ``RC_WIRE_PENDING`` (the bytes of the reply received so far are in the
        connection's buffer), and its reply, through ``Connection.result`` within ``deadline``
        (``time.monotonic()``: the caller's, taken before the native call): the version moved,
        or None when the connection failed under it (it is closed now; nothing moved that
        counts).

        Raises:
            RemoteOutcome: the owner's outcome (the connection stays in step). Anything else
                ``Connection.result`` raises (MemsemTimeoutError at the deadline, a protocol
                violation...: the connection is closed first).
        """
        try:
            if rc & _STATUS == RC_WIRE_SENDING:
                c._lo = c._hi = 0
                rest = memoryview(self._head + mv if put else self._head)[rc >> _SHIFT:]
                c.send(rest, deadline)
            else:
                c._lo, c._hi = 0, rc >> _SHIFT
            return c.result(c._rid, self._handle, put, mv, deadline)
        except Lost:
            c.close()
            return None
        except RemoteOutcome:
            raise
        except BaseException:
            c.close()
            raise

    @staticmethod
    def drop(c: Connection) -> None:
        """Close ``c`` after ``RC_WIRE_LOST`` (the engine's whole path opens a new one)."""
        c.close()


__all__ = ["Connection", "KeptRequests", "Lost", "RC_WIRE_LOST", "RC_WIRE_PENDING", "RC_WIRE_SENDING", "RECV_BYTES", "WatchConnection",
           "WatchHandle"]
