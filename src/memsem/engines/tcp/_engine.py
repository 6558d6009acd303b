"""The tcp engine: wiring, the owner's server, and the consumer's calls with their one error
boundary (every failure that leaves the engine is a memsem error)."""
from __future__ import annotations

import errno as _errno
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from memsem import _args
from memsem._errors import EngineError, MemsemError, MemsemTimeoutError, NotSupportedError, PeerLostError
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
from memsem.engines.tcp import _wire as W
from memsem.engines.tcp._client import Connection, KeptRequests, Lost, WatchConnection, WatchHandle
from memsem.engines.tcp._server import Server

#: connections one request may try (a connection that failed under it is replaced; requests
#: are idempotent): an owner that resets them all is unreachable (PeerLostError)
ATTEMPTS = 3
#: pause before the next attempt (seconds)
RETRY_PAUSE_S = (0.0, 0.02, 0.1)


def owner_wait_ms(left_s: float, most_ms: int) -> int:
    """The ``wait_ms`` a request asks the owner for (how long it may park a request that meets an
    open write section), given ``left_s`` seconds left before the caller's deadline: that less
    two receive slices (the owner's BUSY answer then arrives before the deadline: the caller
    hears "a write section stayed open", on a connection still in step), at most ``most_ms``."""
    return max(0, min(most_ms, 0xFFFFFFFF, int(left_s * 1000) - 2 * int(W.POLL_SLICE * 1000)))


class TcpRemote(RemoteRegion):
    """Consumer side of a window reached over TCP: the owner's endpoint and the credential."""

    def __init__(self, engine: "TcpEngine", nbytes: int, endpoint: str, credential: Credential,
                 owner: tuple[int, int, str, int], gva: int) -> None:
        super().__init__(engine, nbytes)
        self.endpoint = endpoint
        self.host, self.port = W.split_endpoint(endpoint)
        self.credential = credential
        self.owner = owner  # (pid, start, node, rank)
        self.gva = gva
        self.watches: "weakref.WeakSet[WatchHandle]" = weakref.WeakSet()

    def label(self) -> str:
        pid, _, node, _ = self.owner
        return f"the owner of window gva {self.gva:#x} at {self.endpoint} (node {node!r}, pid {pid})"


class TcpEngine(Engine):
    """One-sided get/put over TCP on plain sockets (protocol: :mod:`memsem.engines.tcp._wire`).

    Args:
        host: address to bind and advertise (``MEMSEM_TCP_HOST``; default derived from the
            directory's host, else 127.0.0.1).
        port: port to bind (``MEMSEM_TCP_PORT``; default any free one).
        timeout: seconds every request may take (default: the runtime's timeout).
        bounds: the owner's connection bounds (default :meth:`Bounds.from_env`).

    Thread safety: ``get``/``put`` may be called from several threads (each thread has its own
    connection per owner). The server starts at the first ``register`` and stops at ``close``.
    """

    name = "tcp"
    enforces_generation = GenerationCheck.OWNER
    versions = True
    reserves = True

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True)

    def __init__(self, *, host: str | None = None, port: int | None = None, timeout: float | None = None,
                 bounds: W.Bounds | None = None) -> None:
        super().__init__()
        self._host = host or os.environ.get("MEMSEM_TCP_HOST") or None
        if port is not None:
            self._port = _args.count(port, "port", maximum=65535)
        else:
            self._port = W.env_number("MEMSEM_TCP_PORT", int) or 0
            _args.count(self._port, "MEMSEM_TCP_PORT", maximum=65535)
        self.timeout = _args.timeout(timeout, "timeout", positive=True) if timeout is not None else None
        #: what a request asks the owner to wait at most (the whole timeout; the owner caps it)
        self._wait_ms = int((self.timeout or W.DEFAULT_TIMEOUT) * 1000)
        self.bounds = bounds if bounds is not None else W.Bounds.from_env()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._conns: "weakref.WeakSet[Connection]" = weakref.WeakSet()
        self._watch_conns: dict[str, WatchConnection] = {}
        self._endpoint: str | None = None
        self._server: Server | None = None
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
        self._wait_ms = min(0xFFFFFFFF, int(self.timeout * 1000))

    @property
    def endpoint(self) -> str | None:
        """``tcp://host:port`` this runtime serves on (None before the first register)."""
        return self._endpoint

    def server_stats(self) -> dict[str, int]:
        """The owner's server counters (connections accepted, and closed by which bound:
        ``closed_grace``, ``closed_stall``, ``closed_send``, ``closed_idle``, ``closed_preauth_evicted``; 
        ``full``, ``denied``, ``parked``, ``digests`` computed and ``digests_cached`` answered
        from the server's cache, ``digest_slices`` hashed between two turns of the loop...) and ``connections`` now; empty before the first
        register."""
        srv = self._server
        if srv is None:
            return {}
        return dict(srv.stats, connections=len(srv.sessions))

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
            if self._server is not None:
                return
            if self._closed:
                raise EngineError("engine 'tcp' is closed")
            host = self._advertised_host()
            try:
                ls = socket.create_server((host, self._port), backlog=1024, reuse_port=False)
            except OSError as exc:
                raise EngineError(f"tcp server cannot bind {host}:{self._port or '*'}: {exc}",
                                  errno=exc.errno) from exc
            self._endpoint = f"tcp://{host}:{ls.getsockname()[1]}"
            self._server = Server(self.context, ls, self.bounds, self._endpoint)

    def deregister(self, descriptor: Descriptor) -> None:
        self._check_descriptor(descriptor)

    # -- consumer side: regions -------------------------------------------------------------------
    def attach(self, descriptor: Descriptor, nbytes: int, credential: Any = b"") -> RemoteRegion:
        self._check_descriptor(descriptor)
        d = descriptor
        endpoint = d.field("endpoint", str)
        if not endpoint.startswith("tcp://"):
            raise ValueError(f"tcp descriptor field 'endpoint' must be a tcp:// address, got {endpoint!r}")
        owner = (d.field("pid", int, 0), d.field("start", int, 0), d.field("node", str, ""), d.field("rank", int, -1))
        W.split_endpoint(endpoint)
        if not isinstance(credential, Credential):
            raise ValueError("engine 'tcp' needs the ref's Credential (the owner checks it on every request)")
        if len(credential.token) + 16 > W.MAX_OPEN_BODY:
            raise ValueError(f"credential token of {len(credential.token)} bytes is too long")
        gva = struct.unpack_from("<Q", credential.token, 4)[0] if len(credential.token) >= 12 else 0
        return TcpRemote(self, nbytes, endpoint, credential, owner, gva)

    def detach(self, remote: RemoteRegion) -> None:
        if isinstance(remote, TcpRemote):
            for w in list(remote.watches):
                w.close()
            conns = getattr(self._local, "conns", None)  # this thread's connection recycles now;
            c = conns.get(remote.endpoint) if conns else None  # others by their LRU bound
            if c is not None:
                c.forget(remote.credential.token)

    # -- consumer side: requests ------------------------------------------------------------------
    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        """``get_version`` of the latest version."""
        self.get_version(remote, offset, dst, 0)

    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        """``put_version``."""
        self.put_version(remote, offset, src)

    def get_version(self, remote: RemoteRegion, offset: int, dst: np.ndarray, version: int, *,
                    deadline: float | None = None) -> int:
        """Copy ``dst.nbytes`` bytes at ``offset`` here; returns the version the owner read
        (``version`` 0 asks for the latest, else exactly that one). Blocking, bounded by
        ``deadline`` (``time.monotonic()``; None: the engine's timeout from now), retries on
        new connections included.

        Raises:
            RemoteOutcome: the owner's native outcome (the runtime translates it).
            AccessDeniedError: the owner refused the credential or the request.
            PeerLostError: the owner is dead or unreachable. MemsemTimeoutError, EngineError.
        """
        n = dst.nbytes
        if offset < 0 or offset + n > remote.nbytes:
            self._check_range(remote, offset, n)
        mv = memoryview(dst).cast("B") if dst.ndim != 1 or dst.dtype != np.uint8 else memoryview(dst)
        return self._call(remote, Connection.transfer, False, offset, mv, version, deadline=deadline)

    def put_version(self, remote: RemoteRegion, offset: int, src: np.ndarray, *,
                    deadline: float | None = None) -> int:
        """Copy ``src`` to ``offset``; returns (at remote completion) the version overwritten.
        Bounded and raises as ``get_version``."""
        n = src.nbytes
        self._check_range(remote, offset, n)
        mv = memoryview(src).cast("B") if src.ndim != 1 or src.dtype != np.uint8 else memoryview(src)
        return self._call(remote, Connection.transfer, True, offset, mv, 0, deadline=deadline)

    def reserve_version(self, remote: RemoteRegion, version: int, ttl: float) -> int:
        """A reservation of ``version`` (0: the latest) at the owner for ``ttl`` s at most (see
        ``Engine.reserve_version``), held by this thread's connection's session: it ends with
        ``drop_reservation``, the ttl, or that connection. Raises as ``get``."""
        ttl_ms = max(1, min(0xFFFFFFFF, int(ttl * 1000)))
        return self._call(remote, Connection.pin, version, ttl_ms)

    def digest_version(self, remote: RemoteRegion, runs: Sequence[tuple[int, int]], version: int) -> tuple[int, bytes]:
        """The owner's digest of ``runs`` of ``version`` (see ``Engine.digest_version``): one
        DIGEST request on this thread's connection (a reservation it holds keeps the version).
        Raises as ``get``; ValueError: a run outside the region, or more than
        ``MAX_DIGEST_RUNS`` runs."""
        if not 0 < len(runs) <= W.MAX_DIGEST_RUNS:
            raise ValueError(f"runs must hold 1 to {W.MAX_DIGEST_RUNS} runs, got {len(runs)}")
        for off, n in runs:
            self._check_range(remote, off, n)
        body = b"".join(W.RUN.pack(off, n) for off, n in runs)
        return self._call(remote, Connection.digest, body, version)

    def drop_reservation(self, remote: RemoteRegion, version: int) -> None:
        """Give a reservation back (the owner's writer may overwrite the version from now)."""
        self._call(remote, Connection.unpin, version)

    def set_ready(self, remote: RemoteRegion, tile: int, ready: bool) -> None:
        """Mark (or clear) tile ``tile`` at the owner, which checks it like a put (the tile must
        lie inside the ref's minted range). Raises as ``get``."""
        self._call(remote, Connection.request, W.OP_MARK if ready else W.OP_CLEAR, tile, "ready mark")

    def add_rows(self, remote: RemoteRegion, tile: int, rows: int, total: int) -> int:
        """Count ``rows`` of tile ``tile``'s ``total`` at the owner (a MARK carrying the count:
        the owner's runtime counts for every producer and marks the tile once complete);
        returns the rows written so far. Raises as ``get``."""
        return self._call(remote, Connection.count_rows, tile, rows, total)

    def kept(self, remote: RemoteRegion, nbytes: int) -> KeptRequests | None:
        """This thread's connection to ``remote``'s owner and its handle for ``remote``'s
        credential, for a ref's next gets and puts of ``nbytes`` (at most ``SMALL_BYTES``;
        see :class:`KeptRequests`); None when either is not open now (the whole path opens
        them) or ``nbytes`` is larger."""
        if not isinstance(remote, TcpRemote) or nbytes > W.SMALL_BYTES or self._closed:
            return None
        conns = getattr(self._local, "conns", None)
        c = conns.get(remote.endpoint) if conns else None
        if c is None or c.closed:
            return None
        h = c.handles.get(remote.credential.token)
        if h is None:
            return None
        timeout = self.timeout or W.DEFAULT_TIMEOUT
        return KeptRequests(c, remote.credential.token, h, owner_wait_ms(timeout, self._wait_ms), timeout)

    def _call(self, remote: RemoteRegion, fn: Callable[..., Any], *args: Any, deadline: float | None = None) -> Any:
        """``fn(connection, handle, deadline, wait_ms, *args)`` on this thread's connection to
        the owner, the engine's one error boundary. A connection that failed under it is dropped
        (no late reply is ever taken for a later request) and the request made again on a new
        one, up to ``ATTEMPTS`` connections within the deadline; requests are idempotent (a put
        writes the same bytes again). An owner that refuses connections, is dead, or resets
        every one is ``PeerLostError``. ``deadline`` (``time.monotonic()``): the caller's bound of
        every attempt (None: the engine's timeout from now); no request is made again past it."""
        if not isinstance(remote, TcpRemote):
            raise ValueError("remote was not attached by engine 'tcp'")
        if deadline is None:
            deadline = time.monotonic() + (self.timeout or W.DEFAULT_TIMEOUT)
        elif time.monotonic() >= deadline:
            self.waited(remote, deadline)  # past the caller's deadline already: no request at all
        wait_ms = owner_wait_ms(deadline - time.monotonic(), self._wait_ms)
        failures: list[Lost] = []
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(RETRY_PAUSE_S[attempt])
                self.waited(remote, deadline)
                wait_ms = owner_wait_ms(deadline - time.monotonic(), self._wait_ms)
            c = None
            keep = False
            try:
                conns = getattr(self._local, "conns", None)
                c = conns.get(remote.endpoint) if conns else None
                if c is None or c.closed:
                    c = self._conn(remote, deadline)
                token = remote.credential.token
                h = c.handles.get(token)
                if h is None:
                    h = c.handle(remote.credential, deadline)
                else:
                    c.handles.move_to_end(token)  # least recently used first
                out = fn(c, h, deadline, wait_ms, *args)
                keep = True
                return out
            except Lost as exc:
                failures.append(exc)
            except MemsemError as exc:
                keep = getattr(exc, "status", None) is not None  # an outcome: the connection is in step
                raise
            finally:
                if c is not None and not keep:
                    self._drop(c)
        raise self._lost(remote, failures)

    def _conn(self, remote: TcpRemote, deadline: float) -> Connection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        c = conns.get(remote.endpoint)
        if c is None or c.closed:
            if self._closed:
                raise EngineError("engine 'tcp' is closed")
            c = conns[remote.endpoint] = Connection(self, remote, W.KIND_DATA, deadline)
            self._conns.add(c)
        return c

    def _drop(self, c: Connection) -> None:
        c.close()
        conns = getattr(self._local, "conns", None)
        if conns is not None and conns.get(c.endpoint) is c:
            del conns[c.endpoint]

    def open_socket(self, remote: TcpRemote, deadline: float) -> socket.socket:
        """A connected socket to the owner (for the engine's connections).

        Raises:
            PeerLostError: refused or unreachable (nothing listens there: the owner is gone).
            Lost: any other failure (made again by ``_call``). MemsemTimeoutError.
        """
        left = deadline - time.monotonic()
        if left <= 0:
            self.waited(remote, deadline)
        try:
            return socket.create_connection((remote.host, remote.port), timeout=min(max(left, 0.05), 10.0))
        except OSError as exc:
            if exc.errno in (_errno.ECONNREFUSED, _errno.EHOSTUNREACH, _errno.ENETUNREACH) \
                    or not self._peer_alive(remote):
                raise PeerLostError(f"{remote.label()} is unreachable: {exc}") from exc
            raise Lost(f"connecting failed: {exc}", exc.errno) from exc

    # -- consumer side: watches -------------------------------------------------------------------
    def can_watch(self, remote: RemoteRegion) -> WatchMode:
        return WatchMode.PUSH if isinstance(remote, TcpRemote) else WatchMode.NONE

    def watch(self, remote: RemoteRegion, targets: Sequence[tuple[int, int, int]],
              on_update: Callable[[list[tuple[int, int, int]]], None], on_lost: Callable[[str], None],
              timeout: float) -> WatchHandle:
        """See ``Engine.watch``: the owner pushes the words' values, then every change."""
        if not isinstance(remote, TcpRemote):
            raise ValueError("remote was not attached by engine 'tcp'")
        if not 0 < len(targets) <= W.MAX_WATCH_TARGETS:
            raise ValueError(f"a watch names 1 to {W.MAX_WATCH_TARGETS} targets, got {len(targets)}")
        deadline = time.monotonic() + _args.timeout(timeout, "timeout")
        try:
            wc = self._watch_conn(remote, deadline)
            h = wc.open(remote.credential, deadline)
            wc.subs[h] = (lambda changes: on_update([(k, i, v) for k, i, v in changes]), on_lost)
            body = b"".join(W.TGT.pack(k, i, cnt) for k, i, cnt in targets)
            try:
                wc.request_body(W.OP_WATCH, h, body, deadline, "watch")
            except BaseException:
                wc.subs.pop(h, None)
                raise
        except Lost as exc:
            raise self._lost(remote, [exc]) from exc
        handle = WatchHandle(wc, remote.credential.token, h)
        remote.watches.add(handle)
        return handle

    def _watch_conn(self, remote: TcpRemote, deadline: float) -> WatchConnection:
        with self._lock:
            if self._closed:
                raise EngineError("engine 'tcp' is closed")
            wc = self._watch_conns.get(remote.endpoint)
            if wc is not None and wc.lost is None and not wc.closed:
                return wc
        wc = WatchConnection(self, remote, deadline)
        with self._lock:
            old = self._watch_conns.get(remote.endpoint)
            if old is not None and old.lost is None and not old.closed:
                wc.close()
                return old
            self._watch_conns[remote.endpoint] = wc
        return wc

    def forget_watch(self, wc: WatchConnection) -> None:
        """A watch connection ended: the next watch makes a new one."""
        with self._lock:
            if self._watch_conns.get(wc.endpoint) is wc:
                del self._watch_conns[wc.endpoint]

    # -- errors and liveness ----------------------------------------------------------------------
    def waited(self, remote: TcpRemote, deadline: float) -> None:
        """A receive or send slice of a connection passed with nothing: the owner's liveness,
        then the deadline (raises PeerLostError, MemsemTimeoutError, or EngineError once closed)."""
        if not self._peer_alive(remote):
            raise PeerLostError(f"{remote.label()} is dead: its heartbeat expired during the request")
        if time.monotonic() >= deadline:
            t = self.timeout or W.DEFAULT_TIMEOUT
            raise MemsemTimeoutError(f"tcp request to {remote.endpoint} (window gva {remote.gva:#x}) "
                                     f"not answered after {t} s", what=f"tcp reply from {remote.endpoint}",
                                     timeout=t)
        if self._closed:
            raise EngineError("engine 'tcp' was closed during the request")

    def _lost(self, remote: TcpRemote, failures: list[Lost]) -> PeerLostError:
        why = "; ".join(str(f) for f in failures) or "no connection"
        if not self._peer_alive(remote):
            return PeerLostError(f"{remote.label()} is dead ({why})")
        return PeerLostError(f"{remote.label()} is unreachable: {len(failures)} connection(s) failed "
                             f"under the request ({why})")

    def full_error(self, remote: TcpRemote, cap: int, count: int) -> EngineError:
        """The error of an owner that answered FULL: it names the owner and its cap."""
        return EngineError(f"{remote.label()} refused the connection: it serves its maximum of {cap} "
                           f"connections ({count} open; MEMSEM_TCP_MAX_CONNECTIONS on the owner)", name="FULL")

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
        """Stop the server (it closes every connection it serves) and close every connection
        of this side. Safe twice."""
        if self._closed:
            return
        self._closed = True
        srv = self._server
        if srv is not None:
            srv.close()
        with self._lock:
            watches = list(self._watch_conns.values())
            self._watch_conns.clear()
        for w in watches:
            w.close()
        for c in list(self._conns):
            c.close()


__all__ = ["ATTEMPTS", "TcpEngine", "TcpRemote"]
