"""TCP engine (pyzmq): one-sided get/put of windows owned by another node, with no RDMA NIC.

Each runtime that owns windows runs one server thread with a ROUTER socket; consumers talk to it
from DEALER sockets (one per consumer thread and owner endpoint). The owner's *runtime* validates
every request before a byte moves (``RuntimeCore.serve_check``: access key, generation,
permission, range) and brackets the copy with the window's in-flight count and a generation
re-check (seqlock), so a request racing an unpublish gets STALE, never torn bytes reported as
valid. Engines know nothing of generations: this one only carries the credential (the
serialized RefSpec) the runtime hands to ``attach``.

Protocol (little endian; frames of one ZMQ message arrive together or not at all):

request    frame 0: ``op u8 | 0 u8 | cred_len u16 | req_id u32 | offset u64 | nbytes u64``
                    followed by the credential; PUT: frame 1 = the ``nbytes`` bytes
reply      ``status u8 | 0 u8 | 0 u16 | req_id u32 | value u64`` then, in the same frame, the
           data of a small GET (< ZERO_COPY_BYTES) or an error message (utf-8)
large GET  message 1: [reply status=MORE, data frames of CHUNK_BYTES sent zero-copy from the window's
           memory];
           message 2: [reply status=OK or STALE] sent once libzmq released the data frame and
           the owner re-checked the generation. The consumer receives each data frame straight
           into its slice of the destination (``recv_into``; sizes checked, so a truncated or
           short reply is an error) and reports success only on the final OK.

Status values: OK, MORE, STALE (value = current generation, 0 when gone), DENIED, NOT_FOUND,
RANGE, ERROR. Every request has a deadline (the runtime's timeout); waits are sliced (100 ms) and
between slices the owner's liveness (directory heartbeat) is consulted, so a dead owner gives
``PeerLostError`` once its heartbeat expired, and a silent one ``MemsemTimeoutError``. A socket
that timed out is closed (linger 0) and replaced, so no late reply is ever taken for a new one.

Environment: ``MEMSEM_TCP_HOST`` (address to bind and advertise; default: the local address
that routes to the directory's Redis host, else 127.0.0.1), ``MEMSEM_TCP_PORT`` (default: any
free port), ``MEMSEM_TCP_IO_THREADS`` (libzmq I/O threads, default 1).
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import weakref
from typing import Any

import numpy as np

from memsem import _args
from memsem._errors import (
    AccessDeniedError,
    EngineError,
    MemsemTimeoutError,
    NotSupportedError,
    PeerLostError,
    StaleReferenceError,
    WindowNotFoundError,
)
from memsem.engines._base import Availability, Descriptor, Engine, LocalRegion, RemoteRegion

log = logging.getLogger(__name__)

try:  # imported at module load: the engine registry imports this module only when asked for tcp
    import zmq
except ImportError:  # pragma: no cover - reported by probe()
    zmq = None  # type: ignore[assignment]

_REQ = struct.Struct("<BBHIQQ")
_REP = struct.Struct("<BBHIQ")
OP_GET, OP_PUT = 1, 2
OK, MORE, STALE, DENIED, NOT_FOUND, RANGE, ERROR = range(7)
_STATUS_NAMES = {OK: "OK", MORE: "MORE", STALE: "STALE", DENIED: "DENIED", NOT_FOUND: "NOT_FOUND",
                 RANGE: "RANGE", ERROR: "ERROR"}
#: GETs of at least this many bytes are sent zero-copy from the window (two-message reply)
ZERO_COPY_BYTES = 1 << 16
#: large GETs go as frames of this size (one message): 4-8 MiB frames beat one huge frame
CHUNK_BYTES = 4 << 20
#: slice of every blocking wait (seconds): the server's poll, a request's liveness re-check
POLL_SLICE = 0.1
DEFAULT_TIMEOUT = 30.0


def _has_recv_into() -> bool:
    return zmq is not None and hasattr(zmq.Socket, "recv_into")


class TcpRemote(RemoteRegion):
    """Consumer side of a window reached over TCP."""

    def __init__(self, engine: "TcpEngine", nbytes: int, endpoint: str, credential: bytes,
                 owner: tuple[int, int, str, int]) -> None:
        super().__init__(engine, nbytes)
        self.endpoint = endpoint
        self.credential = credential
        self.owner = owner  # (pid, start, node, rank)
        self.gva = struct.unpack_from("<Q", credential, 8)[0] if len(credential) >= 16 else 0


class _Pending:
    """A zero-copy GET reply that libzmq still reads from the window's memory."""

    __slots__ = ("tracker", "grant", "token", "ident", "rid", "since")

    def __init__(self, tracker: Any, grant: Any, token: Any, ident: bytes, rid: int) -> None:
        self.tracker, self.grant, self.token, self.ident, self.rid = tracker, grant, token, ident, rid
        self.since = time.monotonic()


class TcpEngine(Engine):
    """One-sided get/put over TCP through pyzmq (see the module docstring for the protocol).

    Args:
        host: address to bind and advertise (``MEMSEM_TCP_HOST``; default derived from the
            directory's host, else 127.0.0.1).
        port: port to bind (``MEMSEM_TCP_PORT``; default any free one).
        timeout: seconds every request may take (default: the runtime's timeout).
        io_threads: libzmq I/O threads (``MEMSEM_TCP_IO_THREADS``, default 1).

    Thread safety: ``get``/``put`` may be called from several threads (each thread has its own
    sockets). The server thread starts at the first ``register`` and stops at ``close``.
    """

    name = "tcp"
    enforces_generation = "owner"

    @classmethod
    def probe(cls) -> Availability:
        if zmq is None:
            return Availability(False, "pyzmq is not installed (pip install 'memsem[tcp]')")
        return Availability(True)

    def __init__(self, *, host: str | None = None, port: int | None = None, timeout: float | None = None,
                 io_threads: int | None = None) -> None:
        super().__init__()
        avail = self.probe()
        if not avail:
            raise NotSupportedError(f"engine 'tcp' is unavailable: {avail.reason}")
        self._host = host or os.environ.get("MEMSEM_TCP_HOST") or None
        self._port = _args.count(port, "port", maximum=65535) if port is not None else \
            _env_int("MEMSEM_TCP_PORT", 0, maximum=65535)
        self.timeout = _args.timeout(timeout, "timeout", positive=True) if timeout is not None else None
        n_io = _args.count(io_threads, "io_threads", minimum=1, maximum=256) if io_threads is not None else \
            _env_int("MEMSEM_TCP_IO_THREADS", 1, minimum=1, maximum=256)
        self._ctx = zmq.Context(io_threads=max(1, n_io))
        self._rt: "weakref.ref[Any] | None" = None
        self._lock = threading.Lock()
        self._local = threading.local()
        self._sockets: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._endpoint: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._server_error: BaseException | None = None
        self._rid = 0
        self._recv_into = _has_recv_into()
        self.location_attrs: dict[str, Any] = {}

    # -- wiring -----------------------------------------------------------------------------------
    @classmethod
    def reach(cls, me, owner, descriptor, cost):  # noqa: D102 - see Engine.reach
        return ("tcp", f"owner serves TCP at {descriptor.field('endpoint', str)}", False)

    def bind(self, context: Any) -> None:
        """Called by the runtime once its directory is open: the server validates requests
        through it, and consumers ask it about owners' liveness (see ``Engine.bind``)."""
        super().bind(context)
        self._rt = weakref.ref(context)
        if self.timeout is None:
            self.timeout = float(context.timeout)

    def _runtime(self) -> Any:
        rt = self._rt() if self._rt is not None else None
        if rt is None:
            raise NotSupportedError("engine 'tcp' serves windows only from inside a Runtime "
                                    "(its runtime validates every request)")
        return rt

    @property
    def endpoint(self) -> str | None:
        """``tcp://host:port`` this runtime serves on (None before the first register)."""
        return self._endpoint

    def _advertised_host(self) -> str:
        if self._host:
            return self._host
        rt = self._rt() if self._rt is not None else None
        url = getattr(getattr(rt, "directory", None), "url", "") or ""
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
        self._start_server()
        rt = self._runtime()
        ident = rt.identity
        return Descriptor(self.name, {"endpoint": self._endpoint, "rank": rt.rank, "pid": ident.pid,
                                      "start": ident.start_time, "node": ident.node})

    def _start_server(self) -> None:
        with self._lock:
            if self._thread is not None:
                if self._server_error is not None:
                    raise EngineError(f"tcp server failed: {self._server_error}")
                return
            if self._closed:
                raise EngineError("engine 'tcp' is closed")
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            host = self._advertised_host()
            try:
                sock.bind(f"tcp://{host}:{self._port or '*'}")
            except zmq.ZMQError as exc:
                sock.close(0)
                raise EngineError(f"tcp server cannot bind {host}:{self._port or '*'}: {exc}",
                                  errno=exc.errno) from exc
            self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                            name=f"memsem-tcp-server-{self._endpoint}")
            self._thread.start()

    def _serve(self, sock: Any) -> None:
        pending: list[_Pending] = []
        last_sweep = time.monotonic()
        slice_ms = int(POLL_SLICE * 1000)
        sock.setsockopt(zmq.RCVTIMEO, slice_ms)  # blocking receive, bounded: cheaper than poll+recv
        timeout_ms = slice_ms
        try:
            while not self._stop.is_set():
                want = 1 if pending else slice_ms
                if want != timeout_ms:
                    sock.setsockopt(zmq.RCVTIMEO, want)
                    timeout_ms = want
                try:
                    ident = sock.recv()
                except zmq.Again:
                    ident = None
                if ident is not None:
                    self._handle(sock, ident, pending)
                if pending:
                    self._finish_pending(sock, pending)
                now = time.monotonic()
                if ident is None and now - last_sweep > 1.0:
                    last_sweep = now
                    rt = self._rt() if self._rt is not None else None
                    if rt is not None:
                        rt.serve_sweep()
        except BaseException as exc:  # the server must never die silently
            self._server_error = exc
            log.exception("memsem tcp server on %s failed", self._endpoint)
        finally:
            sock.close(0)
            for p in pending:  # closed with linger 0: libzmq drops the messages (term() waits)
                p.grant.leave(p.token, failed=True)

    def _handle(self, sock: Any, ident: bytes, pending: list[_Pending]) -> None:
        frames = [ident]
        while sock.getsockopt(zmq.RCVMORE):
            frames.append(sock.recv(copy=len(frames) < 2))
        if len(frames) < 2 or len(frames[1]) < _REQ.size:
            return  # not our protocol: nothing to answer
        head = frames[1]
        op, _, clen, rid, off, n = _REQ.unpack_from(head)
        cred = head[_REQ.size:_REQ.size + clen]
        put = op == OP_PUT
        rt = self._rt() if self._rt is not None else None
        try:
            if rt is None:
                raise NotSupportedError("the owner's runtime is gone")
            if op not in (OP_GET, OP_PUT):
                raise ValueError(f"unknown op {op}")
            grant = rt.serve_check(cred, put, off, n)
        except BaseException as exc:
            sock.send_multipart([ident, _error_reply(rid, exc)])
            return
        if put:
            data = frames[2] if len(frames) == 3 else None
            size = len(data) if data is not None else -1
            if size != n:
                sock.send_multipart([ident, _REP.pack(RANGE, 0, 0, rid, 0) +
                                     f"put carried {size} bytes in {len(frames) - 2} data frame(s); the "
                                     f"request said {n}: nothing written".encode()])
                return
            tok = grant.enter(True, off, n)
            if tok is None:
                sock.send_multipart([ident, _REP.pack(STALE, 0, 0, rid, grant.current())])
                return
            ok = False
            try:
                if n:
                    grant.mem[off:off + n] = np.frombuffer(data.buffer if hasattr(data, "buffer") else data, np.uint8)
                ok = True
            finally:
                ok = grant.leave(tok, failed=not ok)
            sock.send_multipart([ident, _REP.pack(OK, 0, 0, rid, n) if ok else
                                 _REP.pack(STALE, 0, 0, rid, grant.current())])
            return
        tok = grant.enter(False, off, n)
        if tok is None:
            sock.send_multipart([ident, _REP.pack(STALE, 0, 0, rid, grant.current())])
            return
        if n < ZERO_COPY_BYTES:
            data = b""
            try:
                data = grant.mem[off:off + n].tobytes()
            finally:
                ok = grant.leave(tok, failed=len(data) != n)
            sock.send_multipart([ident, _REP.pack(OK, 0, 0, rid, n) + data if ok else
                                 _REP.pack(STALE, 0, 0, rid, grant.current())])
            return
        # Large: zero-copy from the window; the bracket stays open (counted in flight, control
        # block mapped) until libzmq let go of the frame.
        try:
            sock.send(ident, zmq.SNDMORE)
            sock.send(_REP.pack(MORE, 0, 0, rid, n), zmq.SNDMORE)
            end = off + n
            trackers = []
            for o in range(off, end, CHUNK_BYTES):  # frames of CHUNK_BYTES: faster than one
                last = o + CHUNK_BYTES >= end
                trackers.append(sock.send(grant.mem[o:min(end, o + CHUNK_BYTES)], 0 if last else zmq.SNDMORE,
                                          copy=False, track=True))
            tracker = zmq.MessageTracker(*trackers)
        except BaseException:
            grant.leave(tok, failed=True)
            raise
        pending.append(_Pending(tracker, grant, tok, ident, rid))

    def _finish_pending(self, sock: Any, pending: list[_Pending]) -> None:
        keep = []
        for p in pending:
            if p.tracker.done:
                ok = p.grant.leave(p.token)
                sock.send_multipart([p.ident, _REP.pack(OK, 0, 0, p.rid, 0) if ok else
                                     _REP.pack(STALE, 0, 0, p.rid, p.grant.current())])
            else:
                keep.append(p)
        pending[:] = keep

    def deregister(self, descriptor: Descriptor) -> None:
        self._check_descriptor(descriptor)

    # -- consumer side ----------------------------------------------------------------------------
    def attach(self, descriptor: Descriptor, nbytes: int, credential: bytes = b"") -> RemoteRegion:
        self._check_descriptor(descriptor)
        d = descriptor
        if not credential:
            raise ValueError("engine 'tcp' needs the ref's credential (the owner checks it on every request)")
        if len(credential) > 0xFFFF:
            raise ValueError(f"credential of {len(credential)} bytes is too long")
        endpoint = d.field("endpoint", str)
        if not endpoint.startswith("tcp://"):
            raise ValueError(f"tcp descriptor field 'endpoint' must be a tcp:// address, got {endpoint!r}")
        return TcpRemote(self, nbytes, endpoint, bytes(credential),
                         (d.field("pid", int, 0), d.field("start", int, 0), d.field("node", str, ""),
                          d.field("rank", int, -1)))

    def _socket(self, endpoint: str) -> Any:
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = {}
        s = socks.get(endpoint)
        if s is None:
            if self._closed:
                raise EngineError("engine 'tcp' is closed")
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, int(POLL_SLICE * 1000))
            s.connect(endpoint)
            socks[endpoint] = s
            with self._lock:
                self._sockets.add(s)
        return s

    def _drop_socket(self, endpoint: str) -> None:
        s = getattr(self._local, "socks", {}).pop(endpoint, None)
        if s is not None:
            s.close(0)

    def _next_rid(self) -> int:
        with self._lock:
            self._rid = (self._rid + 1) & 0xFFFFFFFF
            return self._rid

    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        n = dst.nbytes
        self._check_range(remote, offset, n)
        self._request(remote, OP_GET, offset, n, dst)

    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        n = src.nbytes
        self._check_range(remote, offset, n)
        self._request(remote, OP_PUT, offset, n, src)

    def _request(self, remote: TcpRemote, op: int, offset: int, n: int, local: np.ndarray) -> None:
        if not isinstance(remote, TcpRemote):
            raise ValueError("remote was not attached by engine 'tcp'")
        ep = remote.endpoint
        sock = self._socket(ep)
        rid = self._next_rid()
        cred = remote.credential
        head = _REQ.pack(op, 0, len(cred), rid, offset, n) + cred
        deadline = time.monotonic() + (self.timeout or DEFAULT_TIMEOUT)
        ok = False
        try:
            if op == OP_PUT:
                sock.send(head, zmq.SNDMORE)
                tracker = sock.send(local if n >= ZERO_COPY_BYTES else local.tobytes(),
                                    copy=n < ZERO_COPY_BYTES, track=n >= ZERO_COPY_BYTES)
                status, value, rest = self._reply(sock, remote, rid, deadline, None)
                if tracker is not None:
                    tracker.wait(max(0.001, deadline - time.monotonic()))
            else:
                sock.send(head)
                status, value, rest = self._reply(sock, remote, rid, deadline, local)
            self._check_status(remote, status, value, rest, n, op)
            ok = True
        except zmq.ZMQError as exc:
            raise EngineError(f"tcp request to {ep} failed: {exc}", errno=exc.errno) from exc
        finally:
            if not ok:
                self._drop_socket(ep)  # no late reply of this request can be taken for another

    def _recv(self, sock: Any, remote: TcpRemote, deadline: float) -> bytes:
        """The next message frame; blocks in slices of POLL_SLICE (the socket's RCVTIMEO),
        checking the owner's liveness in between. PeerLostError / MemsemTimeoutError."""
        while True:
            try:
                return sock.recv()
            except zmq.Again:
                pass
            if not self._peer_alive(remote):
                raise PeerLostError(f"the owner of window gva {remote.gva:#x} at {remote.endpoint} "
                                    f"(node {remote.owner[2]!r}, pid {remote.owner[0]}) is dead: its "
                                    "heartbeat expired during the request")
            if time.monotonic() >= deadline:
                raise MemsemTimeoutError(f"tcp request to {remote.endpoint} (window gva {remote.gva:#x}) "
                                         f"not answered after {self.timeout} s",
                                         what=f"tcp reply from {remote.endpoint}", timeout=self.timeout)

    def _reply(self, sock: Any, remote: TcpRemote, rid: int, deadline: float,
               dst: np.ndarray | None) -> tuple[int, int, bytes]:
        while True:
            msg = self._recv(sock, remote, deadline)
            if len(msg) < _REP.size:
                self._drain(sock)
                continue
            status, _, _, got, value = _REP.unpack_from(msg)
            if got != rid:
                self._drain(sock)  # a late reply to an earlier request of this socket
                continue
            if status != MORE:
                if dst is not None and status == OK:
                    data = memoryview(msg)[_REP.size:]
                    if len(data) != dst.nbytes:
                        raise EngineError(f"tcp get from {remote.endpoint} returned {len(data)} bytes, "
                                          f"{dst.nbytes} were asked: not reported as done")
                    if len(data):
                        dst[...] = np.frombuffer(data, np.uint8)
                self._drain(sock)
                return status, value, msg[_REP.size:]
            # Large GET: data frame straight into the destination, then the final status.
            if dst is None or not sock.getsockopt(zmq.RCVMORE):
                self._drain(sock)
                raise EngineError(f"tcp reply from {remote.endpoint} is malformed (MORE without data)")
            size, n = 0, dst.nbytes
            while sock.getsockopt(zmq.RCVMORE):  # each frame straight into its slice of dst
                if size >= n:
                    break
                if self._recv_into:
                    got = sock.recv_into(dst[size:])  # the full frame size: truncation shows
                else:
                    frame = sock.recv(copy=False)
                    got = len(frame)
                    if size + got <= n:
                        dst[size:size + got] = np.frombuffer(frame.buffer, np.uint8)
                size += got
            self._drain(sock)
            if size != dst.nbytes:
                raise EngineError(f"tcp get from {remote.endpoint} carried {size} bytes, {dst.nbytes} "
                                  "were asked: the transfer is partial and not reported as done")
            while True:  # the final status of this request (the owner re-checked the generation)
                fin = self._recv(sock, remote, deadline)
                self._drain(sock)
                if len(fin) >= _REP.size and _REP.unpack_from(fin)[3] == rid:
                    status, _, _, _, value = _REP.unpack_from(fin)
                    if status == MORE:
                        raise EngineError("tcp reply out of order (two data messages): not reported as done")
                    return status, value, fin[_REP.size:]

    @staticmethod
    def _drain(sock: Any) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)

    def _check_status(self, remote: TcpRemote, status: int, value: int, rest: bytes, n: int, op: int) -> None:
        if status == OK:
            return
        what = f"tcp {'put' if op == OP_PUT else 'get'} of {n} bytes at {remote.endpoint}"
        msg = rest.decode(errors="replace") if rest else ""
        if status == STALE:
            raise StaleReferenceError(f"window gva {remote.gva:#x} moved to generation {value or None} at its "
                                      f"owner ({what}): no byte of it is valid", expected=None,
                                      found=value or None)
        if status == NOT_FOUND:
            raise WindowNotFoundError(f"{what}: {msg}")
        if status == DENIED:
            raise AccessDeniedError(f"{what}: {msg}")
        if status == RANGE:
            raise ValueError(f"{what}: {msg}")
        raise EngineError(f"{what} failed at the owner: {msg or _STATUS_NAMES.get(status, status)}",
                          name=_STATUS_NAMES.get(status, str(status)))

    def _peer_alive(self, remote: TcpRemote) -> bool:
        rt = self._rt() if self._rt is not None else None
        if rt is None:
            return True
        pid, start, node, rank = remote.owner
        return rt.peer_alive(pid, start, node, rank)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the server (its zero-copy replies are dropped) and close every socket. Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            try:
                s.close(0)
            except zmq.ZMQError:
                pass
        # term() returns once libzmq released every message, zero-copy frames included: only then
        # may the runtime unmap the windows' memory.
        self._ctx.term()


def _error_reply(rid: int, exc: BaseException) -> bytes:
    if isinstance(exc, WindowNotFoundError):
        status = NOT_FOUND
    elif isinstance(exc, StaleReferenceError):
        return _REP.pack(STALE, 0, 0, rid, int(getattr(exc, "found", 0) or 0)) + str(exc).encode()
    elif isinstance(exc, AccessDeniedError):
        status = DENIED
    elif isinstance(exc, ValueError):
        status = RANGE
    else:
        status = ERROR
    return _REP.pack(status, 0, 0, rid, 0) + f"{type(exc).__name__}: {exc}".encode()


__all__ = ["TcpEngine", "TcpRemote", "ZERO_COPY_BYTES"]


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
