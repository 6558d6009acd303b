"""TCP engine: one-sided get/put of windows owned by another node, on plain sockets.

memsem's own request/response protocol, checked by the owner. The owner's *runtime* validates
every credential and request (``EngineContext.serve_open`` and the grant it returns: access key,
generation, the ref's minted range and access, permission) and brackets every copy with the
window's seqlock; this engine only moves bytes and carries the credential, whose secret it never
sends. Standard library sockets, one thread per connection on the owner, blocking I/O (large
payloads go straight between the socket and the window or the caller's buffer, no copy in
Python); measured against asyncio streams and pyzmq in docs/many-nodes.md.

Connections: a consumer thread has one *data* connection per owner endpoint; a consumer runtime
has one *watch* connection per owner endpoint (ready words and version words pushed by the
owner). Little endian throughout::

    on connect   owner -> consumer   HELLO   "MSTC" | protocol u16 | 0 u16 | nonce 16 B
                 consumer -> owner   HELLO   "MSTC" | protocol u16 | kind u16 (0 data, 1 watch)
    request      op u8 | 0 u8 | handle u16 | req_id u32 | offset u64 | nbytes u64 | arg u64 |
                 wait_ms u32 | 0 u32                                   (40 bytes), then a body:
                 OPEN: token | proof (nbytes of it); PUT: nbytes of data; WATCH: targets
    reply        status u8 | flags u8 | handle u16 | req_id u32 | value u64 | nbytes u64 (24 B),
                 then nbytes of data (DATA) or of an error message (UTF-8)
    GET          reply DATA + the bytes + a trailer reply (OK: value = version read; TORN: a
                 write section opened meanwhile, ask again; STALE: the generation moved)
    EVENT        owner -> consumer on a watch connection: value = n entries of
                 kind u8 | 0 u24 | index u32 | value u64

Ops: OPEN (handle: the consumer's number for a credential on this connection; the body is the
credential's token and its proof for the challenge ``nonce | handle``), CLOSE, GET (arg: the
version asked for, 0 the latest; wait_ms: how long the owner may wait for an open write
section), PUT, MARK / CLEAR (offset: tile), WATCH / UNWATCH (watch connections). Statuses: OK,
DATA, STALE (value: the current generation, or with flag VERSION the current version), DENIED,
NOT_FOUND, RANGE, ERROR, TORN, BUSY, EVENT.

**At the door.** The owner reads a request's fixed header, checks its handle (opened on this
connection with a valid proof), range and direction, and only then reads its body: a PUT whose
handle, range or access fails is answered and the connection closed without reading a byte of
its payload; bodies of OPEN and WATCH are bounded; a wrong proof closes the connection. A
request never makes the owner buffer its payload: a PUT is received straight into the window
inside the bracket, a GET sent straight from it.

**Pipelining.** Transfers larger than ``CHUNK_BYTES`` are split into chunks with up to
``PIPELINE_DEPTH`` requests in flight on the connection (replies come in order); every chunk is
its own bracket at the owner, all must report the same version (else the transfer is made
again), and a failure drops the connection, so no late reply is taken for a later request.

**Bounds.** Every wait has a deadline (the runtime's timeout); a blocked receive wakes every
``POLL_SLICE`` seconds to check it and the owner's liveness (``PeerLostError`` once its
heartbeat expired, ``MemsemTimeoutError`` for a silent live one). TCP keepalive
(``KEEPALIVE_IDLE``/``_INTERVAL``/``_COUNT``) ends a connection to a node that vanished;
``MAX_CONNECTIONS`` per owner, ``MAX_HANDLES`` per connection, ``MAX_PUT_BYTES`` per request.

Environment: ``MEMSEM_TCP_HOST`` (address to bind and advertise; default: the local address
that routes to the directory's Redis host, else 127.0.0.1), ``MEMSEM_TCP_PORT`` (default: any
free port).
"""
from __future__ import annotations

import errno as _errno
import logging
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from memsem import _args
from memsem._errors import (
    AccessDeniedError,
    EngineError,
    MemsemError,
    MemsemTimeoutError,
    NotSupportedError,
    PeerLostError,
    StaleReferenceError,
    WindowNotFoundError,
)
from memsem.engines._base import (
    Availability,
    Credential,
    Descriptor,
    Engine,
    GenerationCheck,
    LocalRegion,
    RemoteRegion,
    WatchMode,
)
from memsem.native import ffi as _ffi

log = logging.getLogger(__name__)

MAGIC = b"MSTC"
PROTOCOL = 1
KIND_DATA, KIND_WATCH = 0, 1
_HELLO = struct.Struct("<4sHH16s")
_CHELLO = struct.Struct("<4sHH")
_REQ = struct.Struct("<BBHIQQQI4x")
_REP = struct.Struct("<BBHIQQ")
_TGT = struct.Struct("<B3xII")
_EVT = struct.Struct("<B3xIQ")
_H16 = struct.Struct("<H")
OP_OPEN, OP_CLOSE, OP_GET, OP_PUT, OP_MARK, OP_CLEAR, OP_WATCH, OP_UNWATCH = range(1, 9)
OK, DATA, STALE, DENIED, NOT_FOUND, RANGE, ERROR, TORN, BUSY, EVENT = range(10)
_STATUS_NAMES = {OK: "OK", DATA: "DATA", STALE: "STALE", DENIED: "DENIED", NOT_FOUND: "NOT_FOUND",
                 RANGE: "RANGE", ERROR: "ERROR", TORN: "TORN", BUSY: "BUSY", EVENT: "EVENT"}
#: reply flag: a STALE reply's value (and the request's arg) are versions, not generations
FLAG_VERSION = 1

#: transfers larger than this go as chunks of this size, pipelined
CHUNK_BYTES = 1 << 20
#: requests in flight per connection in a pipelined transfer
PIPELINE_DEPTH = 8
#: GETs of at most this many bytes are answered with one send (copied inside the bracket)
SMALL_BYTES = 1 << 16
#: bytes one PUT request may carry (the owner closes the connection beyond)
MAX_PUT_BYTES = 64 << 20
#: bodies of OPEN and WATCH, and the text of an error reply
MAX_OPEN_BODY = 512
MAX_WATCH_TARGETS = 16
MAX_ERROR_TEXT = 4096
#: handles (opened credentials) per connection, connections per owner
MAX_HANDLES = 4096
MAX_CONNECTIONS = 1024
#: entries per EVENT frame (more changes go in more frames)
MAX_EVENTS = 4096
#: slice of every blocking receive (seconds): deadlines and the owner's liveness are checked
POLL_SLICE = 0.1
#: the owner's bound on a consumer's hello
HANDSHAKE_TIMEOUT = 10.0
#: TCP keepalive of every connection: a node that vanished is noticed within
#: IDLE + INTERVAL x COUNT seconds (about 4 s)
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 1, 1, 3
DEFAULT_TIMEOUT = 30.0
#: owner side: the largest body discarded to keep a connection in sync after a refused PUT
#: from a legitimate consumer (a stale ref); bigger ones close the connection
DISCARD_BYTES = 8 << 20


class _Closed(Exception):
    """The connection must end (peer gone, protocol violation, shutdown)."""


class _ConnectionLost(EngineError):
    """A consumer's connection failed under a request (made again once on a new connection)."""


def _configure(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, v in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                   ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)
    _rcvtimeo(sock, POLL_SLICE)


def _rcvtimeo(sock: socket.socket, seconds: float) -> None:
    """A blocking socket whose receives return EAGAIN after ``seconds`` (cheaper than Python's
    socket timeouts, which poll before every receive)."""
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


class TcpRemote(RemoteRegion):
    """Consumer side of a window reached over TCP: the owner's endpoint and the credential."""

    def __init__(self, engine: "TcpEngine", nbytes: int, endpoint: str, credential: Credential,
                 owner: tuple[int, int, str, int], gva: int) -> None:
        super().__init__(engine, nbytes)
        self.endpoint = endpoint
        self.host, self.port = _split_endpoint(endpoint)
        self.credential = credential
        self.owner = owner  # (pid, start, node, rank)
        self.gva = gva
        self.watches: "weakref.WeakSet[_WatchHandle]" = weakref.WeakSet()


# -- consumer side: connections ---------------------------------------------------------------------
class _Conn:
    """One connection of a consumer to an owner: the owner's nonce, this side's handles for
    the credentials opened on it, and a small receive buffer."""

    def __init__(self, engine: "TcpEngine", remote: TcpRemote, kind: int, deadline: float) -> None:
        self.engine = engine
        self.endpoint = remote.endpoint
        self.closed = False
        self.handles: dict[bytes, int] = {}
        self._next_handle = 0
        self._rid = 0
        self._buf = bytearray(SMALL_BYTES + 2 * _REP.size)
        self._mv = memoryview(self._buf)
        self._lo = self._hi = 0
        left = max(0.05, deadline - time.monotonic())
        try:
            sock = socket.create_connection((remote.host, remote.port), timeout=min(left, 10.0))
        except OSError as exc:
            raise engine._unreachable(remote, exc) from exc
        self.sock = sock
        try:
            sock.settimeout(None)
            _configure(sock)
            hello = bytearray(_HELLO.size)
            self.recv_into(memoryview(hello), remote, deadline)
            magic, proto, _, nonce = _HELLO.unpack(hello)
            if magic != MAGIC or proto != PROTOCOL:
                raise EngineError(f"{remote.endpoint} does not speak memsem tcp protocol {PROTOCOL} "
                                  f"(hello {bytes(hello[:8])!r})")
            self.nonce = nonce
            sock.sendall(_CHELLO.pack(MAGIC, PROTOCOL, kind))
        except BaseException:
            self.close()
            raise

    def next_rid(self) -> int:
        self._rid = (self._rid + 1) & 0xFFFFFFFF
        return self._rid

    def new_handle(self) -> int:
        if len(self.handles) >= MAX_HANDLES:
            raise EngineError(f"{len(self.handles)} credentials are open on the connection to {self.endpoint}")
        self._next_handle = (self._next_handle + 1) & 0xFFFF
        return self._next_handle

    def challenge(self, handle: int) -> bytes:
        return self.nonce + _H16.pack(handle)

    # -- receiving --------------------------------------------------------------------------------
    def recv_into(self, mv: memoryview, remote: TcpRemote, deadline: float) -> None:
        """Fill ``mv`` exactly (buffered bytes first), waiting at most until ``deadline``."""
        n = len(mv)
        got = 0
        if self._hi > self._lo:
            k = min(n, self._hi - self._lo)
            mv[:k] = self._mv[self._lo:self._lo + k]
            self._lo += k
            got = k
        sock = self.sock
        while got < n:
            try:
                k = sock.recv_into(mv[got:])
            except BlockingIOError:
                self.engine._waited(remote, deadline)
                continue
            except InterruptedError:
                continue
            except OSError as exc:
                raise self.engine._broken(remote, exc) from exc
            if not k:
                raise self.engine._broken(remote, None)
            got += k

    def reply(self, remote: TcpRemote, deadline: float, rid: int) -> tuple[int, int, int, int]:
        """The next reply header ``(status, flags, value, nbytes)``; it must answer ``rid``."""
        if self._hi - self._lo < _REP.size:
            if self._lo:
                rest = self._hi - self._lo
                self._buf[:rest] = self._buf[self._lo:self._hi]
                self._lo, self._hi = 0, rest
            while self._hi < _REP.size:
                try:
                    k = self.sock.recv_into(self._mv[self._hi:])
                except BlockingIOError:
                    self.engine._waited(remote, deadline)
                    continue
                except InterruptedError:
                    continue
                except OSError as exc:
                    raise self.engine._broken(remote, exc) from exc
                if not k:
                    raise self.engine._broken(remote, None)
                self._hi += k
        status, flags, _, got, value, nbytes = _REP.unpack_from(self._buf, self._lo)
        self._lo += _REP.size
        if got != rid:
            raise EngineError(f"tcp reply from {self.endpoint} answers request {got}, not {rid}: "
                              "the connection is out of step")
        return status, flags, value, nbytes

    def small_get(self, engine: "TcpEngine", remote: TcpRemote, h: int, offset: int, dst: np.ndarray, n: int,
                  version: int) -> int | None:
        """One small GET and its reply read in one go into the buffer: the version read, or
        None after a torn read (the caller asks again); errors raise. A reply other than
        DATA + OK is left in the buffer for the general path's reader."""
        self._rid = rid = (self._rid + 1) & 0xFFFFFFFF
        sock = self.sock
        deadline = time.monotonic() + (engine.timeout or DEFAULT_TIMEOUT)
        try:
            sock.sendall(_REQ.pack(OP_GET, 0, h, rid, offset, n, version, engine._wait_ms))
        except OSError as exc:
            self.close()
            raise engine._broken(remote, exc) from exc
        need = 2 * _REP.size + n
        buf = self._mv
        got = 0
        while True:
            try:
                k = sock.recv_into(buf[got:need])
            except BlockingIOError:
                try:
                    engine._waited(remote, deadline)
                except BaseException:
                    self.close()
                    raise
                continue
            except InterruptedError:
                continue
            except OSError as exc:
                self.close()
                raise engine._broken(remote, exc) from exc
            if not k:
                self.close()
                raise engine._broken(remote, None)
            got += k
            if got >= _REP.size:
                status, _, _, r, _, nb = _REP.unpack_from(self._buf, 0)
                if status != DATA or r != rid or nb != n:
                    self._lo, self._hi = 0, got  # not data: the general reader takes it from here
                    break
                if got == need:
                    status, flags, _, r, value, _ = _REP.unpack_from(self._buf, _REP.size + n)
                    if status == OK and r == rid:
                        memoryview(dst)[:] = buf[_REP.size:_REP.size + n]
                        return value
                    self._lo, self._hi = _REP.size + n, need  # the trailer says why not
                    break
        ok = False
        try:
            status, flags, value, nbytes = self.reply(remote, deadline, rid)
            if status == DATA:
                raise EngineError(f"tcp get from {remote.endpoint} answered {nbytes} bytes, {n} were asked")
            if status == OK:  # a trailer after the data already copied: impossible, but read right
                raise EngineError(f"tcp reply from {remote.endpoint} is out of step")
            if status == TORN:
                ok = True
                return None
            text = self.text(nbytes, remote, deadline) if nbytes else ""
            ok = True
        finally:
            if not ok:
                self.close()
        raise engine._error(remote, status, flags, value, text, "get", n, version)

    def text(self, nbytes: int, remote: TcpRemote, deadline: float) -> str:
        if nbytes > MAX_ERROR_TEXT:
            raise EngineError(f"tcp reply from {self.endpoint} carries {nbytes} bytes of error text")
        b = bytearray(nbytes)
        self.recv_into(memoryview(b), remote, deadline)
        return b.decode(errors="replace")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            sock = getattr(self, "sock", None)
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass


class _WatchConn(_Conn):
    """A consumer runtime's watch connection to one owner: a reader thread applies the owner's
    EVENT frames to the subscriptions and hands replies to the requests waiting for them."""

    def __init__(self, engine: "TcpEngine", remote: TcpRemote, deadline: float) -> None:
        super().__init__(engine, remote, KIND_WATCH, deadline)
        self.send_lock = threading.Lock()
        self.subs: dict[int, tuple[Callable[..., None], Callable[[str], None]]] = {}
        self.pending: dict[int, list[Any]] = {}
        self.lost: str | None = None
        self.remote = remote
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, name=f"memsem-tcp-watch-{remote.endpoint}", daemon=True)
        self.thread.start()

    def request(self, op: int, handle: int, body: bytes, deadline: float) -> tuple[int, int, int, str]:
        """Send a request and wait (bounded) for its reply ``(status, flags, value, text)``."""
        with self._lock:
            if self.lost is not None:
                raise PeerLostError(f"watch connection to {self.endpoint} was lost: {self.lost}")
            rid = self.next_rid()
            slot: list[Any] = [threading.Event(), None]
            self.pending[rid] = slot
        try:
            with self.send_lock:
                self.sock.sendall(_REQ.pack(op, 0, handle, rid, 0, len(body), 0, 0) + body)
        except OSError as exc:
            self.pending.pop(rid, None)
            raise self.engine._broken(self.remote, exc) from exc
        while not slot[0].wait(POLL_SLICE):
            try:
                self.engine._waited(self.remote, deadline)
            except BaseException:
                self.pending.pop(rid, None)
                raise
        if isinstance(slot[1], BaseException):
            raise slot[1]
        return slot[1]

    def post(self, op: int, handle: int) -> None:
        """Send a request whose reply nobody waits for (UNWATCH, CLOSE); best effort."""
        with self._lock:
            if self.lost is not None:
                return
            rid = self.next_rid()
        try:
            with self.send_lock:
                self.sock.sendall(_REQ.pack(op, 0, handle, rid, 0, 0, 0, 0))
        except OSError:
            pass

    def _read(self) -> None:
        hdr = memoryview(bytearray(_REP.size))
        reason = "closed"
        far = float("inf")
        try:
            while not self.closed:
                try:
                    self._recv_idle(hdr, far)
                except _Closed:
                    break
                status, flags, handle, rid, value, nbytes = _REP.unpack(hdr)
                if status == EVENT:
                    if value > MAX_EVENTS or nbytes != value * _EVT.size:
                        raise EngineError(f"EVENT frame from {self.endpoint} is malformed ({value} entries, "
                                          f"{nbytes} bytes)")
                    body = bytearray(nbytes)
                    self._recv_idle(memoryview(body), far)
                    changes = [_EVT.unpack_from(body, i * _EVT.size) for i in range(value)]
                    sub = self.subs.get(handle)
                    if sub is not None:
                        sub[0](changes)
                    continue
                text = ""
                if nbytes:
                    if nbytes > MAX_ERROR_TEXT:
                        raise EngineError(f"reply from {self.endpoint} carries {nbytes} bytes of text")
                    b = bytearray(nbytes)
                    self._recv_idle(memoryview(b), far)
                    text = b.decode(errors="replace")
                slot = self.pending.pop(rid, None)
                if slot is not None:
                    slot[1] = (status, flags, value, text)
                    slot[0].set()
        except BaseException as exc:  # noqa: BLE001 - ends every subscription of the connection
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self._end(reason)

    def _recv_idle(self, mv: memoryview, deadline: float) -> None:
        """``recv_into`` that waits for the owner indefinitely (the owner pushes when it has
        something; keepalive ends a dead link) and stops when the connection is closed."""
        got = 0
        n = len(mv)
        while got < n:
            if self.closed:
                raise _Closed()
            try:
                k = self.sock.recv_into(mv[got:])
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                raise EngineError(f"watch connection to {self.endpoint} failed: {exc}") from exc
            if not k:
                raise EngineError(f"the owner at {self.endpoint} closed the watch connection")
            got += k

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
        self.engine._forget_watch(self)
        super().close()

    def close(self) -> None:
        self.closed = True
        sock = getattr(self, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        t = getattr(self, "thread", None)
        if t is not None and t is not threading.current_thread():
            t.join(2.0)
        super().close()


class _WatchHandle:
    """A subscription made by ``TcpEngine.watch`` (``close()`` ends it; safe twice)."""

    def __init__(self, wc: _WatchConn, handle: int) -> None:
        self.wc, self.handle = wc, handle
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        wc = self.wc
        wc.subs.pop(self.handle, None)
        wc.post(OP_UNWATCH, self.handle)


# -- owner side: one accepted connection -------------------------------------------------------------
class _Peer:
    """One connection accepted by the owner's server."""

    def __init__(self, engine: "TcpEngine", sock: socket.socket, addr: Any) -> None:
        self.engine = engine
        self.sock = sock
        self.addr = addr
        self.nonce = secrets.token_bytes(16)
        self.kind = KIND_DATA
        self.handles: dict[int, Any] = {}
        self.subs: dict[int, Any] = {}
        self.send_lock = threading.Lock()
        self.wake = threading.Event()
        self.closed = False
        self.thread = threading.Thread(target=engine._serve_peer, args=(self,), daemon=True,
                                       name=f"memsem-tcp-peer-{addr}")
        self.writer: threading.Thread | None = None
        #: reply buffer of small GETs (header, data, trailer) and receive buffer of small PUTs
        self.buf = bytearray(2 * _REP.size + SMALL_BYTES)
        self.mv = memoryview(self.buf)
        self.addr = int(_ffi.cast("uintptr_t", _ffi.from_buffer(self.buf)))

    def shutdown(self) -> None:
        self.closed = True
        self.wake.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class TcpEngine(Engine):
    """One-sided get/put over TCP on plain sockets (see the module docstring for the protocol).

    Args:
        host: address to bind and advertise (``MEMSEM_TCP_HOST``; default derived from the
            directory's host, else 127.0.0.1).
        port: port to bind (``MEMSEM_TCP_PORT``; default any free one).
        timeout: seconds every request may take (default: the runtime's timeout).

    Thread safety: ``get``/``put`` may be called from several threads (each thread has its own
    connection per owner). The server starts at the first ``register`` and stops at ``close``.
    """

    name = "tcp"
    enforces_generation = GenerationCheck.OWNER
    versions = True

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True)

    def __init__(self, *, host: str | None = None, port: int | None = None, timeout: float | None = None) -> None:
        super().__init__()
        self._host = host or os.environ.get("MEMSEM_TCP_HOST") or None
        self._port = _args.count(port, "port", maximum=65535) if port is not None else \
            _env_int("MEMSEM_TCP_PORT", 0, maximum=65535)
        self.timeout = _args.timeout(timeout, "timeout", positive=True) if timeout is not None else None
        self._lock = threading.Lock()
        self._local = threading.local()
        self._conns: "weakref.WeakSet[_Conn]" = weakref.WeakSet()
        self._watch_conns: dict[str, _WatchConn] = {}
        self._endpoint: str | None = None
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._peers: set[_Peer] = set()
        self._stop = threading.Event()
        self._last_sweep = time.monotonic()
        self._wait_ms = 0
        self.location_attrs: dict[str, Any] = {}

    # -- wiring -----------------------------------------------------------------------------------
    @classmethod
    def reach(cls, me, owner, descriptor, cost):  # noqa: D102 - see Engine.reach
        return ("tcp", f"owner serves TCP at {descriptor.field('endpoint', str)}", False)

    def bind(self, context: Any) -> None:
        """Called by the runtime once its directory is open: the server checks requests
        through it, and consumers ask it about owners' liveness (see ``Engine.bind``)."""
        super().bind(context)
        if self.timeout is None:
            self.timeout = float(context.timeout)
        self._wait_ms = int(self.timeout * 1000)

    @property
    def endpoint(self) -> str | None:
        """``tcp://host:port`` this runtime serves on (None before the first register)."""
        return self._endpoint

    def _advertised_host(self) -> str:
        if self._host:
            return self._host
        directory = getattr(self.context, "directory", None)
        hint = directory.advertise_host() if hasattr(directory, "advertise_host") else None
        if hint:  # the directory knows the address other nodes reach (ray: the node's address)
            return hint
        url = getattr(directory, "url", "") or ""
        if url.startswith(("redis://", "rediss://")):
            hostport = url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
            host = hostport.rsplit(":", 1)[0].strip("[]") if ":" in hostport else hostport
            try:
                # The local address that routes to the directory: peers reach the directory too.
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((host, 9))
                    return s.getsockname()[0]
            except OSError:
                pass
        return "127.0.0.1"

    # -- owner side -------------------------------------------------------------------------------
    def register(self, region: LocalRegion) -> Descriptor:
        ctx = self.context
        if ctx is None:
            raise NotSupportedError("engine 'tcp' serves windows only from inside a Runtime "
                                    "(its runtime checks every request)")
        self._start_server()
        ident = ctx.identity
        return Descriptor(self.name, {"endpoint": self._endpoint, "rank": ctx.rank, "pid": ident.pid,
                                      "start": ident.start_time, "node": ident.node})

    def _start_server(self) -> None:
        with self._lock:
            if self._accept_thread is not None:
                return
            if self._closed:
                raise EngineError("engine 'tcp' is closed")
            host = self._advertised_host()
            try:
                ls = socket.create_server((host, self._port), backlog=128, reuse_port=False)
            except OSError as exc:
                raise EngineError(f"tcp server cannot bind {host}:{self._port or '*'}: {exc}",
                                  errno=exc.errno) from exc
            self._listener = ls
            self._endpoint = f"tcp://{host}:{ls.getsockname()[1]}"
            self._accept_thread = threading.Thread(target=self._accept, args=(ls,), daemon=True,
                                                   name=f"memsem-tcp-server-{self._endpoint}")
            self._accept_thread.start()

    def _accept(self, ls: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = ls.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.01)  # EMFILE and the like: do not spin
                continue
            with self._lock:
                if self._stop.is_set() or len(self._peers) >= MAX_CONNECTIONS:
                    sock.close()
                    continue
                peer = _Peer(self, sock, addr)
                self._peers.add(peer)
            peer.thread.start()

    def _serve_peer(self, peer: _Peer) -> None:
        sock = peer.sock
        try:
            sock.settimeout(None)
            _configure(sock)
            sock.sendall(_HELLO.pack(MAGIC, PROTOCOL, 0, peer.nonce))
            hello = memoryview(bytearray(_CHELLO.size))
            self._srecv(peer, hello, time.monotonic() + HANDSHAKE_TIMEOUT)
            magic, proto, kind = _CHELLO.unpack(hello)
            if magic != MAGIC or proto != PROTOCOL or kind not in (KIND_DATA, KIND_WATCH):
                return
            peer.kind = kind
            if kind == KIND_WATCH:
                peer.writer = threading.Thread(target=self._push, args=(peer,), daemon=True,
                                               name=f"memsem-tcp-push-{peer.addr}")
                peer.writer.start()
            hdr = memoryview(bytearray(_REQ.size))
            handles, buf, mv, out = peer.handles, peer.buf, peer.mv, peer.addr + _REP.size
            unpack, pack_into, size = _REQ.unpack, _REP.pack_into, _REP.size
            while not peer.closed:
                try:
                    k = sock.recv_into(hdr)
                except (BlockingIOError, InterruptedError):
                    k = 0
                if k != _REQ.size:
                    if k == 0 and (peer.closed or self._stop.is_set()):
                        break
                    self._srecv(peer, hdr[k:], None)
                req = unpack(hdr)
                op, _, handle, rid, off, n, arg = req[:7]
                if op == OP_GET and n <= SMALL_BYTES:
                    # The common small get: checked, bracketed and copied natively, one send.
                    g = handles.get(handle)
                    if g is not None and g.lo <= off and off + n <= g.hi:
                        v = g.copy(False, off, out, n, arg)
                        if v is not None:
                            pack_into(buf, 0, DATA, 0, handle, rid, 0, n)
                            pack_into(buf, size + n, OK, 0, handle, rid, v, 0)
                            with peer.send_lock:
                                sock.sendall(mv[:2 * size + n])
                            continue
                self._request(peer, *req)
        except (_Closed, OSError):
            pass
        except BaseException:  # noqa: BLE001 - one broken connection must not end the server
            log.exception("memsem tcp server: connection from %s failed", peer.addr)
        finally:
            peer.shutdown()
            if peer.writer is not None and peer.writer is not threading.current_thread():
                peer.writer.join(5.0)
            for sub in list(peer.subs.values()):
                try:
                    sub.close()
                except MemsemError:
                    pass
            peer.subs.clear()
            peer.handles.clear()
            try:
                sock.close()
            except OSError:
                pass
            with self._lock:
                self._peers.discard(peer)

    def _srecv(self, peer: _Peer, mv: memoryview, deadline: float | None) -> None:
        """Fill ``mv`` from a consumer. ``deadline`` None: wait for the next request as long as
        the connection lives (a stall inside a request is bounded by the runtime's timeout)."""
        got, n = 0, len(mv)
        sock = peer.sock
        stall = None
        while got < n:
            try:
                k = sock.recv_into(mv[got:])
            except (BlockingIOError, InterruptedError):
                if peer.closed or self._stop.is_set():
                    raise _Closed() from None
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise _Closed() from None
                if got and deadline is None:
                    stall = stall or now + (self.timeout or DEFAULT_TIMEOUT)
                    if now >= stall:
                        raise _Closed() from None
                continue
            if not k:
                raise _Closed()
            got += k

    def _send(self, peer: _Peer, data: Any) -> None:
        with peer.send_lock:
            peer.sock.sendall(data)

    def _reply(self, peer: _Peer, status: int, handle: int, rid: int, value: int = 0, text: str = "",
               flags: int = 0) -> None:
        body = text.encode()[:MAX_ERROR_TEXT]
        self._send(peer, _REP.pack(status, flags, handle, rid, value, len(body)) + body)

    def _refuse(self, peer: _Peer, handle: int, rid: int, exc: BaseException, grant: Any = None) -> None:
        status, flags, value = _status_of(exc, grant)
        self._reply(peer, status, handle, rid, value, f"{type(exc).__name__}: {exc}", flags)

    def _request(self, peer: _Peer, op: int, flags: int, handle: int, rid: int, off: int, n: int, arg: int,
                 wait_ms: int) -> None:
        ctx = self.context
        if ctx is None:
            raise _Closed()
        now = time.monotonic()
        if now - self._last_sweep > 1.0:
            self._last_sweep = now
            ctx.serve_sweep()
        if op == OP_GET:
            g = peer.handles.get(handle)
            if g is None:
                return self._reply(peer, DENIED, handle, rid, 0, f"handle {handle} is not open on this connection")
            self._get(peer, g, handle, rid, off, n, arg, wait_ms / 1000.0)
        elif op == OP_PUT:
            g = peer.handles.get(handle)
            if g is None or n > MAX_PUT_BYTES:
                # Nothing of the payload is read: the connection ends here.
                self._reply(peer, DENIED if g is None else RANGE, handle, rid, 0,
                            f"handle {handle} is not open on this connection" if g is None else
                            f"a put request carries at most {MAX_PUT_BYTES} bytes, not {n}")
                raise _Closed()
            self._put(peer, g, handle, rid, off, n, wait_ms / 1000.0)
        elif op == OP_OPEN:
            if n > MAX_OPEN_BODY:
                self._reply(peer, DENIED, handle, rid, 0, f"credential of {n} bytes (at most {MAX_OPEN_BODY})")
                raise _Closed()
            body = memoryview(bytearray(n))
            self._srecv(peer, body, time.monotonic() + (self.timeout or DEFAULT_TIMEOUT))
            if n < 16:
                self._reply(peer, DENIED, handle, rid, 0, "credential without a proof")
                raise _Closed()
            try:
                g = ctx.serve_open(bytes(body[:n - 16]), peer.nonce + _H16.pack(handle), bytes(body[n - 16:]))
            except AccessDeniedError as exc:  # one guess per connection
                self._refuse(peer, handle, rid, exc)
                raise _Closed() from None
            except MemsemError as exc:
                return self._refuse(peer, handle, rid, exc)
            if handle not in peer.handles and len(peer.handles) >= MAX_HANDLES:
                return self._reply(peer, ERROR, handle, rid, 0, f"{MAX_HANDLES} credentials are open on "
                                   "this connection already")
            peer.handles[handle] = g
            self._reply(peer, OK, handle, rid, g.generation)
        elif op in (OP_MARK, OP_CLEAR):
            g = peer.handles.get(handle)
            if g is None:
                return self._reply(peer, DENIED, handle, rid, 0, f"handle {handle} is not open on this connection")
            try:
                g.set_ready(off, op == OP_MARK)
            except (MemsemError, ValueError, TypeError) as exc:
                return self._refuse(peer, handle, rid, exc, g)
            self._reply(peer, OK, handle, rid)
        elif op == OP_WATCH:
            g = peer.handles.get(handle)
            if peer.kind != KIND_WATCH or n > MAX_WATCH_TARGETS * _TGT.size or n % _TGT.size:
                self._reply(peer, DENIED, handle, rid, 0, "watch request refused (not a watch connection, "
                            "or a malformed target list)")
                raise _Closed()
            body = memoryview(bytearray(n))
            self._srecv(peer, body, time.monotonic() + (self.timeout or DEFAULT_TIMEOUT))
            if g is None:
                return self._reply(peer, DENIED, handle, rid, 0, f"handle {handle} is not open on this connection")
            targets = [_TGT.unpack_from(body, i) for i in range(0, n, _TGT.size)]
            old = peer.subs.pop(handle, None)
            if old is not None:
                old.close()
            try:
                sub = g.watch(targets, peer.wake.set)
            except (MemsemError, ValueError) as exc:
                return self._refuse(peer, handle, rid, exc, g)
            peer.subs[handle] = sub
            with peer.send_lock:  # the current values, then OK: the consumer starts in step
                sub.dirty = False
                peer.sock.sendall(b"".join(_events(handle, sub.collect())) +
                                  _REP.pack(OK, 0, handle, rid, 0, 0))
        elif op == OP_UNWATCH:
            sub = peer.subs.pop(handle, None)
            if sub is not None:
                sub.close()
        elif op == OP_CLOSE:
            peer.handles.pop(handle, None)
            sub = peer.subs.pop(handle, None)
            if sub is not None:
                sub.close()
        else:
            raise _Closed()

    def _get(self, peer: _Peer, g: Any, handle: int, rid: int, off: int, n: int, version: int, wait_s: float) -> None:
        try:
            g.check(False, off, n)
        except (MemsemError, ValueError) as exc:
            return self._refuse(peer, handle, rid, exc, g)
        if n <= SMALL_BYTES:
            # One native call (bracket and copy) into the reply buffer, one send.
            v = g.copy(False, off, peer.addr + _REP.size, n, version)
            if v is not None:
                _REP.pack_into(peer.buf, 0, DATA, 0, handle, rid, 0, n)
                _REP.pack_into(peer.buf, _REP.size + n, OK, 0, handle, rid, v, 0)
                with peer.send_lock:
                    peer.sock.sendall(peer.mv[:2 * _REP.size + n])
                return
        try:
            tok = g.enter(False, off, n, version, wait_s)
        except (MemsemError, ValueError) as exc:
            return self._refuse(peer, handle, rid, exc, g)
        if n <= SMALL_BYTES:
            try:
                data = g.view(tok).tobytes()
            except BaseException:
                g.leave(tok, failed=True)
                raise
            try:
                ok = g.leave(tok)
            except MemsemError as exc:
                return self._refuse(peer, handle, rid, exc, g)
            if not ok:
                return self._reply(peer, TORN, handle, rid)
            return self._send(peer, b"".join((_REP.pack(DATA, 0, handle, rid, 0, n), data,
                                              _REP.pack(OK, 0, handle, rid, tok.version, 0))))
        # Large: straight from the window's memory, inside the bracket.
        sent = False
        try:
            with peer.send_lock:
                peer.sock.sendall(_REP.pack(DATA, 0, handle, rid, 0, n))
                peer.sock.sendall(memoryview(g.view(tok)))
            sent = True
        finally:
            try:
                ok = g.leave(tok, failed=not sent)
            except MemsemError as exc:
                if sent:
                    self._refuse(peer, handle, rid, exc, g)
                ok = None
        if ok is not None:
            self._reply(peer, OK if ok else TORN, handle, rid, tok.version if ok else 0)

    def _put(self, peer: _Peer, g: Any, handle: int, rid: int, off: int, n: int, wait_s: float) -> None:
        try:
            g.check(True, off, n)
        except (MemsemError, ValueError) as exc:
            # A legitimate consumer checks range and access itself: no payload is read.
            self._refuse(peer, handle, rid, exc, g)
            raise _Closed() from None
        if n <= SMALL_BYTES:
            # Checked: receive into the connection's own bounded buffer, then one native call.
            self._srecv(peer, peer.mv[:n], time.monotonic() + (self.timeout or DEFAULT_TIMEOUT))
            v = g.copy(True, off, peer.addr, n)
            if v is not None:
                return self._reply(peer, OK, handle, rid, v)
            try:
                tok = g.enter(True, off, n, 0, wait_s)
            except (MemsemError, ValueError) as exc:
                return self._refuse(peer, handle, rid, exc, g)
            ok = False
            try:
                g.view(tok)[:] = np.frombuffer(peer.buf, np.uint8, n)
                ok = True
            finally:
                try:
                    ok = g.leave(tok, failed=not ok)
                except MemsemError as exc:
                    return self._refuse(peer, handle, rid, exc, g)
            return self._reply(peer, OK if ok else TORN, handle, rid, tok.version if ok else 0)
        try:
            tok = g.enter(True, off, n, 0, wait_s)
        except (MemsemError, ValueError) as exc:
            self._refuse(peer, handle, rid, exc, g)
            if n > DISCARD_BYTES:
                raise _Closed() from None
            self._discard(peer, n)
            return
        received = False
        try:
            self._srecv(peer, memoryview(g.view(tok)), time.monotonic() + (self.timeout or DEFAULT_TIMEOUT))
            received = True
        finally:
            try:
                ok = g.leave(tok, failed=not received)
            except MemsemError as exc:
                if received:
                    self._refuse(peer, handle, rid, exc, g)
                ok = None
        if ok is not None:
            self._reply(peer, OK if ok else TORN, handle, rid, tok.version if ok else 0)

    def _discard(self, peer: _Peer, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 18)))
        deadline = time.monotonic() + (self.timeout or DEFAULT_TIMEOUT)
        while n:
            k = min(n, len(scratch))
            self._srecv(peer, scratch[:k], deadline)
            n -= k

    def _push(self, peer: _Peer) -> None:
        """Writer of a watch connection: sends what changed in the words of its subscriptions
        (each collect returns only what changed since the last one)."""
        try:
            while not peer.closed:
                peer.wake.wait()
                peer.wake.clear()
                for handle, sub in list(peer.subs.items()):
                    if not sub.dirty:
                        continue
                    sub.dirty = False
                    with peer.send_lock:
                        frames = _events(handle, sub.collect())
                        if frames:
                            peer.sock.sendall(b"".join(frames))
        except OSError:
            pass
        except BaseException:  # noqa: BLE001
            log.exception("memsem tcp server: pushing to %s failed", peer.addr)
        finally:
            peer.shutdown()

    def deregister(self, descriptor: Descriptor) -> None:
        self._check_descriptor(descriptor)

    # -- consumer side ----------------------------------------------------------------------------
    def attach(self, descriptor: Descriptor, nbytes: int, credential: Any = b"") -> RemoteRegion:
        self._check_descriptor(descriptor)
        d = descriptor
        endpoint = d.field("endpoint", str)
        if not endpoint.startswith("tcp://"):
            raise ValueError(f"tcp descriptor field 'endpoint' must be a tcp:// address, got {endpoint!r}")
        owner = (d.field("pid", int, 0), d.field("start", int, 0), d.field("node", str, ""), d.field("rank", int, -1))
        _split_endpoint(endpoint)
        if not isinstance(credential, Credential):
            raise ValueError("engine 'tcp' needs the ref's Credential (the owner checks it on every request)")
        if len(credential.token) + 16 > MAX_OPEN_BODY:
            raise ValueError(f"credential token of {len(credential.token)} bytes is too long")
        gva = struct.unpack_from("<Q", credential.token, 4)[0] if len(credential.token) >= 12 else 0
        return TcpRemote(self, nbytes, endpoint, credential, owner, gva)

    def detach(self, remote: RemoteRegion) -> None:
        if isinstance(remote, TcpRemote):
            for w in list(remote.watches):
                w.close()

    def _conn(self, remote: TcpRemote, deadline: float) -> _Conn:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        c = conns.get(remote.endpoint)
        if c is None or c.closed:
            if self._closed:
                raise EngineError("engine 'tcp' is closed")
            c = conns[remote.endpoint] = _Conn(self, remote, KIND_DATA, deadline)
            self._conns.add(c)
        return c

    def _drop(self, c: _Conn) -> None:
        c.close()
        conns = getattr(self._local, "conns", None)
        if conns is not None and conns.get(c.endpoint) is c:
            del conns[c.endpoint]

    def _handle(self, c: _Conn, remote: TcpRemote, deadline: float) -> int:
        """This connection's handle for ``remote``'s credential (opened now if need be)."""
        cred = remote.credential
        h = c.handles.get(cred.token)
        if h is not None:
            return h
        h = c.new_handle()
        body = cred.token + cred.prove(c.challenge(h))
        rid = c.next_rid()
        try:
            c.sock.sendall(_REQ.pack(OP_OPEN, 0, h, rid, 0, len(body), 0, 0) + body)
        except OSError as exc:
            raise self._broken(remote, exc) from exc
        status, flags, value, nbytes = c.reply(remote, deadline, rid)
        text = c.text(nbytes, remote, deadline) if nbytes else ""
        if status != OK:
            raise self._error(remote, status, flags, value, text, "open", 0)
        c.handles[cred.token] = h
        return h

    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        self.get_version(remote, offset, dst, 0)

    def get_version(self, remote: RemoteRegion, offset: int, dst: np.ndarray, version: int) -> int:
        """Copy ``dst.nbytes`` bytes at ``offset`` here; returns the version the owner read
        (``version`` 0 asks for the latest, else exactly that one)."""
        n = dst.nbytes
        if 0 < n <= SMALL_BYTES and type(remote) is TcpRemote and 0 <= offset <= remote.nbytes - n:
            # The common small get on an open connection, in as few steps as Python allows;
            # anything unusual continues on the general path.
            conns = getattr(self._local, "conns", None)
            c = conns.get(remote.endpoint) if conns else None
            if c is not None and not c.closed and c._lo == c._hi:
                h = c.handles.get(remote.credential.token)
                if h is not None:
                    got = c.small_get(self, remote, h, offset, dst, n, version)
                    if got is not None:
                        return got
        self._check_range(remote, offset, n)
        return self._transfer(remote, False, offset, dst, version)

    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        self.put_version(remote, offset, src)

    def put_version(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> int:
        """Copy ``src`` to ``offset``; returns (at remote completion) the version overwritten."""
        n = src.nbytes
        self._check_range(remote, offset, n)
        return self._transfer(remote, True, offset, src, 0)

    def _transfer(self, remote: RemoteRegion, put: bool, offset: int, local: np.ndarray, version: int) -> int:
        if not isinstance(remote, TcpRemote):
            raise ValueError("remote was not attached by engine 'tcp'")
        timeout = self.timeout or DEFAULT_TIMEOUT
        deadline = time.monotonic() + timeout
        mv = memoryview(local).cast("B") if local.ndim != 1 or local.dtype != np.uint8 else memoryview(local)
        while True:
            got = self._on_conn(remote, deadline, lambda c, h: self._run(c, remote, h, put, offset, mv, version,
                                                                         deadline))
            if got is not None:
                return got
            if time.monotonic() >= deadline:  # torn again and again: a writer never let go
                raise MemsemTimeoutError(f"tcp {'put' if put else 'get'} of {len(mv)} bytes at {remote.endpoint}: "
                                         f"write sections kept tearing it for {timeout} s",
                                         what=f"tcp transfer at {remote.endpoint}", timeout=timeout)

    def _on_conn(self, remote: TcpRemote, deadline: float, fn: Callable[[_Conn, int], Any]) -> Any:
        """``fn(connection, handle)`` on this thread's connection to the owner. A connection
        that failed under it is dropped (no late reply is ever taken for a later request) and
        the request made once more on a new one: an owner that died refuses the connection
        (``PeerLostError``); requests are idempotent (a put writes the same bytes again)."""
        for attempt in (0, 1):
            c = self._conn(remote, deadline)
            ok = False
            try:
                out = fn(c, self._handle(c, remote, deadline))
                ok = True
                return out
            except _ConnectionLost:
                if attempt:
                    raise
            finally:
                if not ok:
                    self._drop(c)
        raise AssertionError("unreachable")  # pragma: no cover

    def _run(self, c: _Conn, remote: TcpRemote, h: int, put: bool, offset: int, mv: memoryview, version: int,
             deadline: float) -> int | None:
        """The chunks of one transfer, pipelined; the version moved, or None when a chunk was
        torn or chunks saw different versions (the caller does it again)."""
        n = len(mv)
        op = OP_PUT if put else OP_GET
        if n <= SMALL_BYTES:
            return self._one(c, remote, h, op, offset, mv, version, deadline)
        chunks = [(o, min(CHUNK_BYTES, n - o)) for o in range(0, n, CHUNK_BYTES)] or [(0, 0)]
        sock = c.sock
        wait_ms = lambda: max(0, min(0xFFFFFFFF, int((deadline - time.monotonic()) * 1000)))  # noqa: E731
        rids = []

        def send(i: int) -> None:
            o, k = chunks[i]
            rid = c.next_rid()
            rids.append(rid)
            head = _REQ.pack(op, 0, h, rid, offset + o, k, version, wait_ms())
            try:
                if put and k <= SMALL_BYTES:
                    sock.sendall(head + mv[o:o + k])
                elif put:
                    sock.sendall(head)
                    sock.sendall(mv[o:o + k])
                else:
                    sock.sendall(head)
            except OSError as exc:
                raise self._broken(remote, exc) from exc

        for i in range(min(PIPELINE_DEPTH, len(chunks))):
            send(i)
        seen = None
        torn = False
        for i, (o, k) in enumerate(chunks):
            rid = rids[i]
            status, flags, value, nbytes = c.reply(remote, deadline, rid)
            if not put and status == DATA:
                if nbytes != k:
                    raise EngineError(f"tcp get from {remote.endpoint} answered {nbytes} bytes, {k} were asked")
                c.recv_into(mv[o:o + k], remote, deadline)
                status, flags, value, nbytes = c.reply(remote, deadline, rid)
            if status == TORN:
                torn = True
            elif status != OK:
                text = c.text(nbytes, remote, deadline) if nbytes else ""
                raise self._error(remote, status, flags, value, text, "put" if put else "get", n, version)
            elif seen is None:
                seen = value
            elif value != seen:
                torn = True  # chunks of two versions: not one version's bytes
            if i + PIPELINE_DEPTH < len(chunks):
                send(i + PIPELINE_DEPTH)
        return None if torn else (seen or 0)

    def _one(self, c: _Conn, remote: TcpRemote, h: int, op: int, offset: int, mv: memoryview, version: int,
             deadline: float) -> int | None:
        """One small request and its reply (the common case, kept short)."""
        n = len(mv)
        rid = c.next_rid()
        head = _REQ.pack(op, 0, h, rid, offset, n, version, max(0, min(0xFFFFFFFF, int((deadline - time.monotonic()) * 1000))))
        try:
            c.sock.sendall(head + mv if op == OP_PUT else head)
        except OSError as exc:
            raise self._broken(remote, exc) from exc
        status, flags, value, nbytes = c.reply(remote, deadline, rid)
        if status == DATA and op == OP_GET:
            if nbytes != n:
                raise EngineError(f"tcp get from {remote.endpoint} answered {nbytes} bytes, {n} were asked")
            c.recv_into(mv, remote, deadline)
            status, flags, value, nbytes = c.reply(remote, deadline, rid)
        if status == OK:
            return value
        if status == TORN:
            return None
        text = c.text(nbytes, remote, deadline) if nbytes else ""
        raise self._error(remote, status, flags, value, text, "put" if op == OP_PUT else "get", n, version)

    def set_ready(self, remote: RemoteRegion, tile: int, ready: bool) -> None:
        if not isinstance(remote, TcpRemote):
            raise ValueError("remote was not attached by engine 'tcp'")
        deadline = time.monotonic() + (self.timeout or DEFAULT_TIMEOUT)

        def mark(c: _Conn, h: int) -> tuple[int, int, int, str]:
            rid = c.next_rid()
            try:
                c.sock.sendall(_REQ.pack(OP_MARK if ready else OP_CLEAR, 0, h, rid, tile, 0, 0, 0))
            except OSError as exc:
                raise self._broken(remote, exc) from exc
            status, flags, value, nbytes = c.reply(remote, deadline, rid)
            return status, flags, value, c.text(nbytes, remote, deadline) if nbytes else ""

        status, flags, value, text = self._on_conn(remote, deadline, mark)
        if status != OK:
            raise self._error(remote, status, flags, value, text, "ready mark", 0)

    # -- consumer side: watches -------------------------------------------------------------------
    def can_watch(self, remote: RemoteRegion) -> WatchMode:
        return WatchMode.PUSH if isinstance(remote, TcpRemote) else WatchMode.NONE

    def watch(self, remote: RemoteRegion, targets: Sequence[tuple[int, int, int]],
              on_update: Callable[[list[tuple[int, int, int]]], None], on_lost: Callable[[str], None],
              timeout: float) -> _WatchHandle:
        """See ``Engine.watch``: the owner pushes the words' values, then every change."""
        if not isinstance(remote, TcpRemote):
            raise ValueError("remote was not attached by engine 'tcp'")
        if not 0 < len(targets) <= MAX_WATCH_TARGETS:
            raise ValueError(f"a watch names 1 to {MAX_WATCH_TARGETS} targets, got {len(targets)}")
        deadline = time.monotonic() + _args.timeout(timeout, "timeout")
        wc = self._watch_conn(remote, deadline)
        cred = remote.credential
        with wc._lock:
            h = wc.handles.get(cred.token)
            fresh = h is None
            if fresh:
                h = wc.new_handle()
        if fresh:
            status, flags, value, text = wc.request(OP_OPEN, h, cred.token + cred.prove(wc.challenge(h)), deadline)
            if status != OK:
                raise self._error(remote, status, flags, value, text, "watch", 0)
            wc.handles[cred.token] = h
        wc.subs[h] = (lambda changes: on_update([(k, i, v) for k, i, v in changes]), on_lost)
        body = b"".join(_TGT.pack(k, i, cnt) for k, i, cnt in targets)
        try:
            status, flags, value, text = wc.request(OP_WATCH, h, body, deadline)
        except BaseException:
            wc.subs.pop(h, None)
            raise
        if status != OK:
            wc.subs.pop(h, None)
            raise self._error(remote, status, flags, value, text, "watch", 0)
        handle = _WatchHandle(wc, h)
        remote.watches.add(handle)
        return handle

    def _watch_conn(self, remote: TcpRemote, deadline: float) -> _WatchConn:
        with self._lock:
            if self._closed:
                raise EngineError("engine 'tcp' is closed")
            wc = self._watch_conns.get(remote.endpoint)
            if wc is not None and wc.lost is None and not wc.closed:
                return wc
        wc = _WatchConn(self, remote, deadline)
        with self._lock:
            old = self._watch_conns.get(remote.endpoint)
            if old is not None and old.lost is None and not old.closed:
                wc.close()
                return old
            self._watch_conns[remote.endpoint] = wc
        return wc

    def _forget_watch(self, wc: _WatchConn) -> None:
        with self._lock:
            if self._watch_conns.get(wc.endpoint) is wc:
                del self._watch_conns[wc.endpoint]

    # -- errors and liveness ----------------------------------------------------------------------
    def _waited(self, remote: TcpRemote, deadline: float) -> None:
        """A receive slice passed with nothing: the owner's liveness, then the deadline."""
        if not self._peer_alive(remote):
            raise PeerLostError(f"the owner of window gva {remote.gva:#x} at {remote.endpoint} "
                                f"(node {remote.owner[2]!r}, pid {remote.owner[0]}) is dead: its "
                                "heartbeat expired during the request")
        if time.monotonic() >= deadline:
            t = self.timeout or DEFAULT_TIMEOUT
            raise MemsemTimeoutError(f"tcp request to {remote.endpoint} (window gva {remote.gva:#x}) "
                                     f"not answered after {t} s", what=f"tcp reply from {remote.endpoint}",
                                     timeout=t)
        if self._closed:
            raise EngineError("engine 'tcp' was closed during the request")

    def _broken(self, remote: TcpRemote, exc: OSError | None) -> MemsemError:
        """The connection failed mid-request: a dead owner is PeerLostError, else EngineError."""
        why = "closed the connection" if exc is None else f"connection failed: {exc}"
        if not self._peer_alive(remote):
            return PeerLostError(f"the owner of window gva {remote.gva:#x} at {remote.endpoint} is dead ({why})")
        return _ConnectionLost(f"tcp request to {remote.endpoint} failed: the owner {why}",
                               errno=None if exc is None else exc.errno)

    def _unreachable(self, remote: TcpRemote, exc: OSError) -> MemsemError:
        if not self._peer_alive(remote) or exc.errno in (_errno.ECONNREFUSED, _errno.EHOSTUNREACH,
                                                         _errno.ENETUNREACH):
            return PeerLostError(f"the owner of window gva {remote.gva:#x} at {remote.endpoint} "
                                 f"(node {remote.owner[2]!r}, pid {remote.owner[0]}) is unreachable: {exc}")
        return EngineError(f"cannot connect to {remote.endpoint}: {exc}", errno=exc.errno)

    def _error(self, remote: TcpRemote, status: int, flags: int, value: int, text: str, what: str, n: int,
               version: int = 0) -> BaseException:
        where = f"tcp {what} of {n} bytes at {remote.endpoint}" if n else f"tcp {what} at {remote.endpoint}"
        if status == STALE:
            if flags & FLAG_VERSION:
                return StaleReferenceError(f"window gva {remote.gva:#x}: version {version} is gone at its owner "
                                           f"(it holds version {value} now; {where})", expected=version,
                                           found=value)
            return StaleReferenceError(f"window gva {remote.gva:#x} moved to generation {value or None} at its "
                                       f"owner ({where}): no byte of it is valid", expected=None,
                                       found=value or None)
        if status == NOT_FOUND:
            return WindowNotFoundError(f"{where}: {text}")
        if status == DENIED:
            return AccessDeniedError(f"{where}: {text}")
        if status == RANGE:
            return ValueError(f"{where}: {text}")
        if status == BUSY:
            t = self.timeout or DEFAULT_TIMEOUT
            return MemsemTimeoutError(f"{where}: {text}", what=f"write section at {remote.endpoint}", timeout=t)
        return EngineError(f"{where} failed at the owner: {text or _STATUS_NAMES.get(status, status)}",
                           name=_STATUS_NAMES.get(status, str(status)))

    def _peer_alive(self, remote: TcpRemote) -> bool:
        ctx = self.context
        if ctx is None:
            return True
        pid, start, node, rank = remote.owner
        try:
            return ctx.peer_alive(pid, start, node, rank)
        except MemsemError:
            return True

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the server (waiting, bounded, for its connections' threads) and close every
        connection. Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        ls = self._listener
        if ls is not None:
            try:
                ls.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            ls.close()
        with self._lock:
            peers = list(self._peers)
            watches = list(self._watch_conns.values())
            self._watch_conns.clear()
        for p in peers:
            p.shutdown()
        deadline = time.monotonic() + 5.0
        t = self._accept_thread
        if t is not None and t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))
        for p in peers:
            if p.thread is not threading.current_thread():
                p.thread.join(max(0.0, deadline - time.monotonic()))
        for w in watches:
            w.close()
        for c in list(self._conns):
            c.close()


def _events(handle: int, changes: list[tuple[int, int, int]]) -> list[bytes]:
    """EVENT frames carrying ``changes`` (at most MAX_EVENTS entries each)."""
    out = []
    for i in range(0, len(changes), MAX_EVENTS):
        part = changes[i:i + MAX_EVENTS]
        out.append(_REP.pack(EVENT, 0, handle, 0, len(part), len(part) * _EVT.size)
                   + b"".join(_EVT.pack(k, idx, v) for k, idx, v in part))
    return out


def _status_of(exc: BaseException, grant: Any) -> tuple[int, int, int]:
    """``(status, flags, value)`` of a refusal."""
    if isinstance(exc, WindowNotFoundError):
        return NOT_FOUND, 0, 0
    if isinstance(exc, StaleReferenceError):
        version = grant is not None and exc.expected is not None and exc.expected != grant.generation
        return STALE, FLAG_VERSION if version else 0, int(exc.found or 0)
    if isinstance(exc, AccessDeniedError):
        return DENIED, 0, 0
    if isinstance(exc, MemsemTimeoutError):
        return BUSY, 0, 0
    if isinstance(exc, (ValueError, TypeError)):
        return RANGE, 0, 0
    return ERROR, 0, 0


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    rest = endpoint[len("tcp://"):] if endpoint.startswith("tcp://") else endpoint
    host, sep, port = rest.rpartition(":")
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not sep or not host or not 0 < p < 65536:
        raise ValueError(f"tcp descriptor field 'endpoint' must be tcp://host:port, got {endpoint!r}")
    return host.strip("[]"), p


def _env_int(name: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
    """An integer setting from the environment (``default`` when unset or empty)."""
    raw = os.environ.get(name, "") or ""
    if not raw:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an int, got {raw!r}") from None
    return _args.count(v, name, minimum=minimum, maximum=maximum)


__all__ = ["CHUNK_BYTES", "MAX_PUT_BYTES", "PIPELINE_DEPTH", "TcpEngine", "TcpRemote"]
