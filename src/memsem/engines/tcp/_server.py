"""The owner's tcp server: one event loop over non-blocking sockets (epoll), dispatch by op.

One thread serves every connection. A connection costs a socket and a small session object
(the 16-byte nonce, a 40-byte header buffer) until it authenticates; after that, one grant
per open handle. Nothing a peer does holds a thread, a copy bracket or memory past a bound of
:class:`~memsem.engines.tcp._wire.Bounds`:

* **before authentication**: the hello and a credential that verifies within ``grace_s``
  (whatever the peer sends or fails to send meanwhile); at most ``max_preauth`` such
  connections (a new one closes the oldest), so floods of unauthenticated connections never
  lock out a consumer that authenticates;
* **a request** whose first byte arrived must arrive whole within ``stall_s`` (a stall at any
  byte counts); a PUT's payload must make progress every ``stall_s``;
* **a reply** must make progress every ``send_s``. A copy bracket is held only around one
  non-blocking ``send``/``recv`` straight between the window and the socket (``Grant.move``),
  or one slice of a DIGEST's hashing (``DIGEST_SLICE_BYTES``, the other sessions served
  between two slices), never while the loop waits for the peer, so a consumer that never reads, or a partitioned
  link, never holds a window: ``unpublish`` does not wait for it at all;
* **a wait a request asks for** (an open write section) is capped at ``max_wait_s``; the
  request is parked (no bracket, no thread) until the window commits a version or the cap
  passes, and a disconnect while parked ends it at once;
* **idle** data connections are closed after ``idle_s``; TCP_USER_TIMEOUT and keepalive end
  connections to vanished peers;
* beyond ``max_connections`` a new connection is answered FULL (naming the cap), never
  silently closed.

A request in progress is a generator (its *job*, made by its handler in
:mod:`memsem.engines.tcp._requests`, dispatched by op) that yields what it waits for:
readable, writable, or parked, with the deadline of that wait. Replies leave in request order.
"""
from __future__ import annotations

import collections
import errno as _errno
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Generator
from typing import Any

from memsem._errors import MemsemError
from memsem.engines.tcp import _wire as W
from memsem.engines.tcp._requests import AGAIN, PARK, READ, WAIT, WRITE, Job, Requests
from memsem.native import ffi as _ffi

log = logging.getLogger(__name__)

_IN, _OUT, _RDHUP = select.EPOLLIN, select.EPOLLOUT, select.EPOLLRDHUP
_GONE = select.EPOLLERR | select.EPOLLHUP | select.EPOLLRDHUP
_REQ_SIZE = W.REQ.size
_unpack_req = W.REQ.unpack_from
#: the deadline sweep's period (seconds): bounds are kept to within this
SWEEP_S = 0.05
_INF = float("inf")


class Session:
    """One accepted connection: its nonce, handles (grants), watches and the job in progress."""

    __slots__ = ("sock", "fd", "addr", "nonce", "kind", "authed", "handles", "subs", "hdr", "hmv", "got",
                 "hello", "born", "last", "started", "job", "want", "deadline", "why", "mask", "push",
                 "closed")

    def __init__(self, sock: socket.socket, addr: Any, now: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.addr = addr
        self.nonce = secrets.token_bytes(16)
        self.kind = W.KIND_DATA
        self.authed = False
        self.handles: dict[int, Any] = {}
        self.subs: dict[int, Any] = {}
        self.hdr = bytearray(W.REQ.size)
        self.hmv = memoryview(self.hdr)
        self.got = 0
        self.hello = True
        self.born = self.last = self.started = now
        self.job: Job | None = None
        self.want = 0
        self.deadline = _INF
        self.why = ""
        self.mask = 0
        self.push = False
        self.closed = False


class Server:
    """The event loop of one owner (see the module docstring).

    Args:
        context: the runtime's ``EngineContext`` (``serve_open``, ``timeout``).
        listener: a bound, listening socket (made non-blocking here).
        bounds: the connection bounds.
        endpoint: the advertised endpoint (messages).
    """

    def __init__(self, context: Any, listener: socket.socket, bounds: W.Bounds, endpoint: str) -> None:
        self.context = context
        self.bounds = bounds
        self.endpoint = endpoint
        self.cap = bounds.connection_cap()
        self.max_wait_s = bounds.max_wait_s if bounds.max_wait_s is not None else float(context.timeout)
        self._ls = listener
        listener.setblocking(False)
        self._ep = select.epoll()
        self._ep.register(listener.fileno(), _IN)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._ep.register(self._wake, _IN)
        #: sessions to resume or push to, flush events, None (stop): from other threads
        self._posted: collections.deque[Any] = collections.deque()
        self.sessions: dict[int, Session] = {}
        #: sessions not authenticated yet, oldest first
        self._preauth: dict[int, Session] = {}
        #: one reply buffer of the loop: small GETs are copied into it and sent from it
        self.scratch = bytearray(2 * W.REP.size + W.SMALL_BYTES)
        self.smv = memoryview(self.scratch)
        self.saddr = int(_ffi.cast("uintptr_t", _ffi.from_buffer(self.scratch)))
        #: events counted by kind (what closed a connection, refusals, parks)
        self.stats: collections.Counter[str] = collections.Counter()
        self.requests = Requests(self)
        self._ops = self.requests.table
        self._stop = False
        #: the loop's clock, read once per batch of events
        self.now = time.monotonic()
        self.thread = threading.Thread(target=self._run, name=f"memsem-tcp-server-{endpoint}", daemon=True)
        self.thread.start()

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        lfd, wfd = self._ls.fileno(), self._wake
        sessions = self.sessions
        next_sweep = time.monotonic() + SWEEP_S
        try:
            while not self._stop:
                events = self._ep.poll(SWEEP_S)
                self.now = now = time.monotonic()
                for fd, ev in events:
                    s = sessions.get(fd)
                    if s is not None:
                        try:
                            if ev == _IN and s.job is None:
                                self._read(s)  # the common case: (part of) a request
                            else:
                                self._event(s, ev)
                        except Exception as exc:  # noqa: BLE001 - one connection never ends the loop
                            self._fail(s, exc)
                    elif fd == lfd:
                        self._accept()
                    elif fd == wfd:
                        self._drain_posted()
                if now >= next_sweep:
                    next_sweep = now + SWEEP_S
                    self._sweep(now)
        except BaseException:  # noqa: BLE001
            log.exception("memsem tcp server %s: the event loop failed", self.endpoint)
        finally:
            for s in list(sessions.values()):
                self.end(s, "")
            self._ep.close()
            with self._wake_lock:
                os.close(self._wake)
                self._wake = -1

    def _event(self, s: Session, ev: int) -> None:
        if ev & _GONE:
            return self.end(s, "peer_closed")
        if s.job is None:
            if ev & _IN:
                self._read(s)
        elif (s.want == READ and ev & _IN) or (s.want == WRITE and ev & _OUT):
            self._resume(s)

    def _fail(self, s: Session, exc: BaseException) -> None:
        if not isinstance(exc, (W.Closed, OSError)):
            log.exception("memsem tcp server %s: connection from %s failed", self.endpoint, s.addr,
                          exc_info=exc)
        self.end(s, "peer_closed" if isinstance(exc, (W.Closed, OSError)) else "failed")

    def post(self, s: Session | None) -> None:
        """From any thread: resume ``s``'s parked job or push its watches (None: stop)."""
        self._posted.append(s)
        with self._wake_lock:
            if self._wake >= 0:
                try:
                    os.eventfd_write(self._wake, 1)
                except OSError:
                    pass

    def flush(self, timeout: float) -> None:
        """From another thread: return once the loop handled everything posted before (pushes
        started: small frames are in the kernel by then), at most ``timeout`` s."""
        if threading.current_thread() is self.thread or self._stop:
            return
        done = threading.Event()
        self.post(done)  # type: ignore[arg-type]
        done.wait(timeout)

    def _drain_posted(self) -> None:
        try:
            os.eventfd_read(self._wake)
        except OSError:
            pass
        while self._posted:
            s = self._posted.popleft()
            if s is None:
                self._stop = True
                return
            if isinstance(s, threading.Event):  # a flush: what was posted before it was done
                s.set()
                continue
            if s.closed:
                continue
            try:
                if s.job is not None and s.want == PARK:
                    self._resume(s)
                elif not s.subs:
                    continue  # a commit with nothing parked (a grant's commit watch outlives its wait)
                elif s.job is None:
                    self.start(s, self.requests.push(s))
                else:
                    s.push = True  # after the job in progress
            except Exception as exc:  # noqa: BLE001
                self._fail(s, exc)

    def _sweep(self, now: float) -> None:
        b = self.bounds
        for s in list(self.sessions.values()):
            if not s.authed and (s.job is None or s.want != PARK):
                d, why = s.born + b.grace_s, "grace"  # everything before authentication
            elif s.job is not None:
                d, why = s.deadline, s.why
            elif s.got:
                d, why = s.started + b.stall_s, "stall"
            elif s.kind == W.KIND_WATCH and s.subs:
                continue
            else:
                d, why = s.last + b.idle_s, "idle"
            if now < d:
                continue
            if s.job is not None and s.want == PARK:
                try:
                    self._resume(s)  # the wait ran out: the job answers
                except Exception as exc:  # noqa: BLE001
                    self._fail(s, exc)
            else:
                self.end(s, why)

    # -- connections ------------------------------------------------------------------------------
    def _accept(self) -> None:
        now = self.now
        while True:
            try:
                sock, addr = self._ls.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (_errno.EMFILE, _errno.ENFILE, _errno.ENOBUFS, _errno.ENOMEM):
                    self.stats["accept_failed"] += 1
                return
            self.stats["accepted"] += 1
            try:
                W.configure(sock, self.bounds, None)
            except OSError:
                sock.close()
                continue
            if len(self._preauth) >= self.bounds.max_preauth or len(self.sessions) >= self.cap:
                old = next(iter(self._preauth.values()), None)
                if old is not None:
                    self._refuse_full(old)
                    self.end(old, "preauth_evicted")
                elif len(self.sessions) >= self.cap:
                    self.stats["full"] += 1
                    W.send_some(sock, W.HELLO.pack(W.MAGIC, W.PROTOCOL, W.HELLO_FULL,
                                                   W.FULL_INFO.pack(self.cap, len(self.sessions))))
                    sock.close()
                    continue
            s = Session(sock, addr, now)
            if W.send_some(sock, W.HELLO.pack(W.MAGIC, W.PROTOCOL, W.HELLO_OK, s.nonce)) != W.HELLO.size:
                sock.close()
                continue
            self.sessions[s.fd] = s
            self._preauth[s.fd] = s
            s.mask = _IN | _RDHUP
            self._ep.register(s.fd, s.mask)

    def _refuse_full(self, s: Session) -> None:
        """Tell a connection closed for a newer one why (best effort: it may not read)."""
        text = (f"the owner at {self.endpoint} closed this unauthenticated connection: "
                f"{self.bounds.max_preauth} connections were waiting to authenticate").encode()
        try:
            W.send_some(s.sock, W.REP.pack(W.FULL, 0, 0, 0, self.cap, len(text)) + text)
        except OSError:
            pass

    def end(self, s: Session, why: str) -> None:
        """Close a connection and everything its session holds."""
        if s.closed:
            return
        s.closed = True
        if why:
            self.stats[f"closed_{why}"] += 1
        self.sessions.pop(s.fd, None)
        self._preauth.pop(s.fd, None)
        job, s.job = s.job, None
        if job is not None and not job.gi_running:  # a job that ends its own session runs on
            job.close()
        try:
            self._ep.unregister(s.fd)
        except (OSError, ValueError):
            pass
        try:
            s.sock.close()
        except OSError:
            pass
        for obj in [*s.subs.values(), *s.handles.values()]:
            try:
                obj.close()
            except MemsemError:
                pass
        s.subs.clear()
        s.handles.clear()

    def _arm(self, s: Session, mask: int) -> None:
        if mask != s.mask and not s.closed:
            s.mask = mask
            self._ep.modify(s.fd, mask)

    # -- requests ---------------------------------------------------------------------------------
    def _read(self, s: Session) -> None:
        """Bytes of the next request header; dispatch by op when whole (each op is answered by
        its handler in :mod:`memsem.engines.tcp._requests`, and only there)."""
        if s.hello:
            return self._hello(s)
        got = s.got
        try:
            k = s.sock.recv_into(s.hmv[got:] if got else s.hdr, _REQ_SIZE - got)
        except (BlockingIOError, InterruptedError):
            return
        if not k:
            raise W.Closed("the peer closed the connection")
        if not got:  # the request's first byte: its stall bound (header and body) counts from here
            s.started = self.now
        if got + k < _REQ_SIZE:
            s.got = got + k
            return
        s.got = 0
        op, _, handle, rid, off, n, arg, wait_ms = _unpack_req(s.hdr)
        s.last = self.now
        fn = self._ops.get(op)
        if fn is None:
            return self.end(s, "protocol")
        job = fn(s, op, handle, rid, off, n, arg, wait_ms)
        if job is not None:
            self.start(s, job)

    def _hello(self, s: Session) -> None:
        """Bytes of the consumer's hello (before any request)."""
        need = W.CHELLO.size
        k = W.recv_some(s.sock, s.hmv[s.got:need])
        if not k:
            return
        s.got += k
        if s.got < need:
            return
        s.got = 0
        magic, proto, kind = W.CHELLO.unpack_from(s.hdr)
        if magic != W.MAGIC or proto != W.PROTOCOL or kind not in (W.KIND_DATA, W.KIND_WATCH):
            return self.end(s, "protocol")
        s.hello = False
        s.kind = kind

    def start(self, s: Session, job: Job) -> None:
        s.job = job
        self._resume(s)

    def _resume(self, s: Session) -> None:
        """Run ``s``'s job until it waits (arming the socket and the deadline) or ends."""
        try:
            want, deadline = next(s.job)
        except StopIteration:
            s.job = None
            s.last = time.monotonic()
            if s.closed:
                return
            if s.push:
                s.push = False
                if s.subs:
                    return self.start(s, self.requests.push(s))
            self._arm(s, _IN | _RDHUP)
            return
        s.want = want
        s.deadline = deadline
        s.why = "stall" if want == READ else "send" if want == WRITE else "wait"
        self._arm(s, _IN | _RDHUP if want == READ else _OUT | _RDHUP if want == WRITE else _RDHUP)

    def authenticated(self, s: Session) -> None:
        """``s`` showed a credential that verifies: the grace bound no longer applies to it."""
        if not s.authed:
            s.authed = True
            self._preauth.pop(s.fd, None)

    # -- replies ----------------------------------------------------------------------------------
    def send(self, s: Session, data: Any) -> Job:
        """A job sending ``data`` whole (each wait bounded by ``send_s`` of no progress)."""
        mv = memoryview(data)
        sent = 0
        while True:
            sent += W.send_some(s.sock, mv[sent:])
            if sent >= len(mv):
                return
            yield WRITE, time.monotonic() + self.bounds.send_s

    def reply(self, s: Session, status: int, handle: int, rid: int, value: int = 0, text: str = "",
               flags: int = 0) -> Job | None:
        """Send one reply now; a job for the rest when the socket takes less."""
        body = text.encode()[:W.MAX_ERROR_TEXT]
        return self.send_now(s, W.REP.pack(status, flags, handle, rid, value, len(body)) + body)

    def send_now(self, s: Session, data: Any) -> Job | None:
        try:
            k = s.sock.send(data)
        except (BlockingIOError, InterruptedError):
            k = 0
        if k == len(data):
            return None
        return self.send(s, bytes(data[k:]))  # the rest, copied: ``data`` may be the loop's buffer

    def outcome(self, s: Session, handle: int, rid: int, o: Any) -> Job | None:
        """The owner's outcome ``o`` (its ``status`` and ``value``), carried as is (the status in
        ``flags``); an OK outcome is an OK reply with its value."""
        if o.ok:
            return self.reply(s, W.OK, handle, rid, o.value)
        return self.reply(s, W.OUTCOME, handle, rid, o.value, flags=int(o.status))

    def deny(self, s: Session, handle: int, rid: int, text: str, close: bool) -> Job | None:
        """A DENIED reply; ``close``: then end the connection (a request that cannot be skipped,
        or a peer that is not honest)."""
        self.stats["denied"] += 1
        job = self.reply(s, W.DENIED, handle, rid, 0, text)
        if not close:
            return job
        return self.then_close(s, job, "denied")

    def then_close(self, s: Session, job: Job | None, why: str) -> Job:
        if job is not None:
            yield from job
        self.end(s, why)
        return
        yield  # noqa: B901 - a generator even when nothing is left to send

    def body(self, s: Session, n: int) -> Generator[tuple[int, float], None, bytearray]:
        """Read a request's body of ``n`` (bounded) bytes within the request's stall bound."""
        body = bytearray(n)
        mv = memoryview(body)
        got = 0
        deadline = s.started + self.bounds.stall_s
        while got < n:
            got += W.recv_some(s.sock, mv[got:])
            if got < n:
                yield READ, deadline
        return body

    def park_until(self, wait_ms: int) -> float:
        return time.monotonic() + min(wait_ms / 1000.0, self.max_wait_s)

    def park(self, s: Session, g: Any, deadline: float) -> int:
        """Whether a request of ``s`` that met an open write section (BUSY) waits: 0 no (the
        wait ran out, or the window is gone: answer now), ``AGAIN`` (just subscribed to the
        commits of ``g``'s window: try once more at once, so a commit before the subscription
        is not missed), ``WAIT`` (park until a commit or ``deadline``)."""
        if time.monotonic() >= deadline:
            return 0
        if g.commit_watched:
            self.stats["parked"] += 1
            return WAIT
        try:
            g.on_commit(lambda: self.post(s))
        except MemsemError:
            return 0
        return AGAIN

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop (it closes every connection and the grants their sessions hold)."""
        self.post(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
        try:
            self._ls.close()
        except OSError:
            pass


__all__ = ["Server", "Session", "SWEEP_S"]
