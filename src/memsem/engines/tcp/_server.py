"""The owner's tcp server: one event loop over non-blocking sockets (epoll), dispatch by op.

One thread serves every connection. A connection costs a socket and a small session object
(the 16-byte nonce, a 40-byte header buffer) until it authenticates; after that, one grant
per open handle. Nothing a peer does holds a thread, a copy bracket or memory past a bound of
:class:`~memsem.engines.tcp._wire.Bounds`:

* **before authentication**: the hello and a credential that verifies within ``grace_s``; at
  most ``max_preauth`` such connections (a new one closes the oldest), so floods of
  unauthenticated connections never lock out a consumer that authenticates;
* **a request** whose first byte arrived must arrive whole within ``stall_s`` (a stall at any
  byte counts); a PUT's payload must make progress every ``stall_s``;
* **a reply** must make progress every ``send_s``. A copy bracket is held only around one
  non-blocking ``send``/``recv`` straight between the window and the socket (``Grant.move``),
  never while the loop waits for the peer, so a consumer that never reads, or a partitioned
  link, never holds a window: ``unpublish`` does not wait for it at all;
* **a wait a request asks for** (an open write section) is capped at ``max_wait_s``; the
  request is parked (no bracket, no thread) until the window commits a version or the cap
  passes, and a disconnect while parked ends it at once;
* **idle** data connections are closed after ``idle_s``; TCP_USER_TIMEOUT and keepalive end
  connections to vanished peers;
* beyond ``max_connections`` a new connection is answered FULL (naming the cap), never
  silently closed.

A request in progress is a generator (its *job*) that yields what it waits for: readable,
writable, or parked, with the deadline of that wait. Replies leave in request order.
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
from collections.abc import Callable, Generator
from typing import Any

from memsem._errors import AccessDeniedError, MemsemError
from memsem.engines.tcp import _wire as W
from memsem.native import ffi as _ffi
from memsem.native import lib as _lib
from memsem.native import memcpy as _memcpy

log = logging.getLogger(__name__)

_IN, _OUT, _RDHUP = select.EPOLLIN, select.EPOLLOUT, select.EPOLLRDHUP
_GONE = select.EPOLLERR | select.EPOLLHUP | select.EPOLLRDHUP
#: what a job waits for (with a deadline)
READ, WRITE, PARK = 1, 2, 3
_AGAIN, _WAIT = 1, 2
#: native statuses the server acts on (it carries every other one as is)
_OK, _GEN_BEFORE, _GEN_AFTER, _BUSY, _TORN = (
    _lib.MEMSEM_OK, _lib.MEMSEM_RC_GEN_BEFORE, _lib.MEMSEM_RC_GEN_AFTER, _lib.MEMSEM_RC_BUSY, _lib.MEMSEM_RC_TORN)
#: the deadline sweep's period (seconds): bounds are kept to within this
SWEEP_S = 0.05
_INF = float("inf")
#: zeros sent in place of the rest of a reply whose bytes stopped being valid mid-way
_ZEROS = memoryview(bytes(W.CHUNK_BYTES))

Job = Generator[tuple[int, float], None, None]


def _buffer(address: int, nbytes: int) -> Any:
    return _ffi.buffer(_ffi.cast("char *", address), nbytes)


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
        self._posted: collections.deque[Session | None] = collections.deque()
        self.sessions: dict[int, Session] = {}
        #: sessions not authenticated yet, oldest first
        self._preauth: dict[int, Session] = {}
        #: one reply buffer of the loop: small GETs are copied into it and sent from it
        self._scratch = bytearray(2 * W.REP.size + W.SMALL_BYTES)
        self._smv = memoryview(self._scratch)
        self._saddr = int(_ffi.cast("uintptr_t", _ffi.from_buffer(self._scratch)))
        #: events counted by kind (what closed a connection, refusals, parks)
        self.stats: collections.Counter[str] = collections.Counter()
        self._ops: dict[int, Callable[..., Job | None]] = {
            W.OP_OPEN: self._open, W.OP_CLOSE: self._close_handle, W.OP_GET: self._get, W.OP_PUT: self._put,
            W.OP_MARK: self._mark, W.OP_CLEAR: self._mark, W.OP_WATCH: self._watch, W.OP_UNWATCH: self._unwatch,
            W.OP_PIN: self._pin, W.OP_UNPIN: self._unpin,
        }
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
                self._end(s, "")
            self._ep.close()
            with self._wake_lock:
                os.close(self._wake)
                self._wake = -1

    def _event(self, s: Session, ev: int) -> None:
        if ev & _GONE:
            return self._end(s, "peer_closed")
        if s.job is None:
            if ev & _IN:
                self._read(s)
        elif (s.want == READ and ev & _IN) or (s.want == WRITE and ev & _OUT):
            self._resume(s)

    def _fail(self, s: Session, exc: BaseException) -> None:
        if not isinstance(exc, (W.Closed, OSError)):
            log.exception("memsem tcp server %s: connection from %s failed", self.endpoint, s.addr,
                          exc_info=exc)
        self._end(s, "peer_closed" if isinstance(exc, (W.Closed, OSError)) else "failed")

    def post(self, s: Session | None) -> None:
        """From any thread: resume ``s``'s parked job or push its watches (None: stop)."""
        self._posted.append(s)
        with self._wake_lock:
            if self._wake >= 0:
                try:
                    os.eventfd_write(self._wake, 1)
                except OSError:
                    pass

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
            if s.closed:
                continue
            try:
                if s.job is not None and s.want == PARK:
                    self._resume(s)
                elif not s.subs:
                    continue  # a commit with nothing parked (a grant's commit watch outlives its wait)
                elif s.job is None:
                    self._start(s, self._push(s))
                else:
                    s.push = True  # after the job in progress
            except Exception as exc:  # noqa: BLE001
                self._fail(s, exc)

    def _sweep(self, now: float) -> None:
        b = self.bounds
        for s in list(self.sessions.values()):
            if s.job is not None:
                d, why = s.deadline, s.why
            elif not s.authed:
                d, why = s.born + b.grace_s, "grace"
                if s.got:
                    d = min(d, s.started + b.stall_s)
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
                self._end(s, why)

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
                    self._end(old, "preauth_evicted")
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

    def _end(self, s: Session, why: str) -> None:
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
        """Bytes of the hello or of the next request header; dispatch when whole."""
        need = W.CHELLO.size if s.hello else W.REQ.size
        try:
            k = s.sock.recv_into(s.hmv[s.got:need] if s.got else s.hdr, need)
        except (BlockingIOError, InterruptedError):
            return
        if not k:
            raise W.Closed("the peer closed the connection")
        if not s.got:
            s.started = self.now
        s.got += k
        if s.got < need:
            return
        s.got = 0
        if s.hello:
            magic, proto, kind = W.CHELLO.unpack_from(s.hdr)
            if magic != W.MAGIC or proto != W.PROTOCOL or kind not in (W.KIND_DATA, W.KIND_WATCH):
                return self._end(s, "protocol")
            s.hello = False
            s.kind = kind
            return
        op, _, handle, rid, off, n, arg, wait_ms = W.REQ.unpack_from(s.hdr)
        s.last = self.now
        if op == W.OP_GET:
            job = self._get(s, op, handle, rid, off, n, arg, wait_ms)
        else:
            fn = self._ops.get(op)
            if fn is None:
                return self._end(s, "protocol")
            job = fn(s, op, handle, rid, off, n, arg, wait_ms)
        if job is not None:
            self._start(s, job)

    def _start(self, s: Session, job: Job) -> None:
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
                    return self._start(s, self._push(s))
            self._arm(s, _IN | _RDHUP)
            return
        s.want = want
        if not s.authed:
            deadline = min(deadline, s.born + self.bounds.grace_s)
        s.deadline = deadline
        s.why = "stall" if want == READ else "send" if want == WRITE else "wait"
        self._arm(s, _IN | _RDHUP if want == READ else _OUT | _RDHUP if want == WRITE else _RDHUP)

    # -- replies ----------------------------------------------------------------------------------
    def _send(self, s: Session, data: Any) -> Job:
        """A job sending ``data`` whole (each wait bounded by ``send_s`` of no progress)."""
        mv = memoryview(data)
        sent = 0
        while True:
            sent += W.send_some(s.sock, mv[sent:])
            if sent >= len(mv):
                return
            yield WRITE, time.monotonic() + self.bounds.send_s

    def _reply(self, s: Session, status: int, handle: int, rid: int, value: int = 0, text: str = "",
               flags: int = 0) -> Job | None:
        """Send one reply now; a job for the rest when the socket takes less."""
        body = text.encode()[:W.MAX_ERROR_TEXT]
        return self._send_now(s, W.REP.pack(status, flags, handle, rid, value, len(body)) + body)

    def _send_now(self, s: Session, data: Any) -> Job | None:
        try:
            k = s.sock.send(data)
        except (BlockingIOError, InterruptedError):
            k = 0
        if k == len(data):
            return None
        return self._send(s, bytes(data[k:]))  # the rest, copied: ``data`` may be the loop's buffer

    def _outcome(self, s: Session, handle: int, rid: int, status: int, value: int) -> Job | None:
        """The owner's native outcome, carried as is (status in ``flags``, its value)."""
        return self._reply(s, W.OUTCOME, handle, rid, value, flags=status)

    def _deny(self, s: Session, handle: int, rid: int, text: str, close: bool) -> Job | None:
        """A DENIED reply; ``close``: then end the connection (a request that cannot be skipped,
        or a peer that is not honest)."""
        self.stats["denied"] += 1
        job = self._reply(s, W.DENIED, handle, rid, 0, text)
        if not close:
            return job
        return self._then_close(s, job, "denied")

    def _then_close(self, s: Session, job: Job | None, why: str) -> Job:
        if job is not None:
            yield from job
        self._end(s, why)
        return
        yield  # noqa: B901 - a generator even when nothing is left to send

    def _body(self, s: Session, n: int) -> Generator[tuple[int, float], None, bytearray]:
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

    def _park_until(self, wait_ms: int) -> float:
        return time.monotonic() + min(wait_ms / 1000.0, self.max_wait_s)

    def _park(self, s: Session, g: Any, deadline: float) -> int:
        """Whether a request of ``s`` that met an open write section (BUSY) waits: 0 no (the
        wait ran out, or the window is gone: answer now), ``_AGAIN`` (just subscribed to the
        commits of ``g``'s window: try once more at once, so a commit before the subscription
        is not missed), ``_WAIT`` (park until a commit or ``deadline``)."""
        if time.monotonic() >= deadline:
            return 0
        if g.commit_watched:
            self.stats["parked"] += 1
            return _WAIT
        try:
            g.on_commit(lambda: self.post(s))
        except MemsemError:
            return 0
        return _AGAIN

    # -- ops --------------------------------------------------------------------------------------
    def _open(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, arg: int, wait_ms: int) -> Job:
        if n > W.MAX_OPEN_BODY or n < 16:
            return self._deny(s, handle, rid, f"a credential of {n} bytes (16 to {W.MAX_OPEN_BODY})", True)
        return self._open_job(s, handle, rid, n)

    def _open_job(self, s: Session, handle: int, rid: int, n: int) -> Job:
        body = yield from self._body(s, n)
        try:
            g = self.context.serve_open(bytes(body[:n - 16]), s.nonce + W.H16.pack(handle), bytes(body[n - 16:]))
        except AccessDeniedError as exc:  # one guess per connection
            yield from self._deny(s, handle, rid, str(exc), True)
            return
        except MemsemError as exc:
            job = self._reply(s, W.ERROR, handle, rid, 0, f"{type(exc).__name__}: {exc}")
            if job is not None:
                yield from job
            return
        old = s.handles.pop(handle, None)
        if old is not None:
            old.close()
        if len(s.handles) >= W.MAX_HANDLES:
            g.close()
            job = self._reply(s, W.ERROR, handle, rid, 0, f"{W.MAX_HANDLES} credentials are open on this "
                              f"connection to {self.endpoint} already (close some)")
        else:
            s.handles[handle] = g
            if not s.authed:
                s.authed = True
                self._preauth.pop(s.fd, None)
            job = self._reply(s, W.OK, handle, rid)
        if job is not None:
            yield from job

    def _close_handle(self, s: Session, op: int, handle: int, *_: int) -> None:
        sub = s.subs.pop(handle, None)
        if sub is not None:
            sub.close()
        g = s.handles.pop(handle, None)
        if g is not None:
            g.close()

    def _grant(self, s: Session, handle: int, rid: int) -> tuple[Any, Job | None]:
        g = s.handles.get(handle)
        if g is None:
            return None, self._deny(s, handle, rid, f"handle {handle} is not open on this connection", True)
        return g, None

    def _get(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, version: int,
             wait_ms: int) -> Job | None:
        g = s.handles.get(handle)
        if g is not None and n <= W.SMALL_BYTES and g.lo <= off and off + n <= g.hi:
            # The common small get: bracket and copy in one native call into the loop's buffer,
            # one send of header, bytes and trailer.
            v = g.copy(False, off, self._saddr + W.REP.size, n, version)
            if v is not None:
                buf, size = self._scratch, W.REP.size
                W.REP.pack_into(buf, 0, W.DATA, 0, handle, rid, 0, n)
                W.REP.pack_into(buf, size + n, W.OK, 0, handle, rid, v, 0)
                return self._send_now(s, self._smv[:2 * size + n])
        g, refused = self._grant(s, handle, rid)
        if g is None:
            return refused
        try:
            g.check(False, off, n)
        except (ValueError, AccessDeniedError) as exc:
            return self._deny(s, handle, rid, str(exc), False)
        return self._get_job(s, g, handle, rid, off, n, version, self._park_until(wait_ms))

    def _get_job(self, s: Session, g: Any, handle: int, rid: int, off: int, n: int, version: int,
                 wait_until: float) -> Job:
        """A GET straight from the window: each non-blocking send is one bracket of its own, all
        of one version (the first one's); the trailer says whether the bytes are valid."""
        sock = s.sock
        head = memoryview(W.REP.pack(W.DATA, 0, handle, rid, 0, n))
        hs = done = 0
        v = version
        fixed = bool(version)

        def io(address: int, k: int) -> int:
            nonlocal hs
            if hs < len(head):
                m = sock.sendmsg([head[hs:], _buffer(address, k)])
                took = min(m, len(head) - hs)
                hs += took
                return m - took
            return sock.send(_buffer(address, k))

        def sent(address: int, k: int) -> int:
            try:
                return io(address, k)
            except (BlockingIOError, InterruptedError):
                return 0

        while hs < len(head) or done < n:
            o, k = g.move(False, off + done, n - done, v, sent)
            status, value = int(o.status), o.value
            done += k  # on the wire, valid or not
            if status == _OK:
                if hs and not fixed:
                    v, fixed = value, True  # the version every later bracket must see
                if hs < len(head) or done < n:
                    yield WRITE, time.monotonic() + self.bounds.send_s
                continue
            if not hs:  # nothing sent: a clean answer (or a wait)
                if status == _BUSY:
                    p = self._park(s, g, wait_until)
                    if p:
                        if p == _WAIT:
                            yield PARK, wait_until
                        continue
                if status == _TORN:  # a section opened under a send that took nothing
                    yield WRITE, time.monotonic() + self.bounds.send_s
                    continue
                yield from self._outcome(s, handle, rid, status, value) or ()
                return
            # Bytes of the reply are out already: zeros for the rest, then the outcome
            # (the generation moved, or the version's bytes are no longer whole: asked again).
            if status not in (_GEN_BEFORE, _GEN_AFTER):
                status, value = _TORN, 0
            else:
                status = _GEN_AFTER
            while hs < len(head) or done < n:
                if hs < len(head):
                    hs += W.send_some(sock, head[hs:])
                else:
                    done += W.send_some(sock, _ZEROS[:min(n - done, len(_ZEROS))])
                if hs < len(head) or done < n:
                    yield WRITE, time.monotonic() + self.bounds.send_s
            yield from self._outcome(s, handle, rid, status, value) or ()
            return
        yield from self._reply(s, W.OK, handle, rid, v) or ()

    def _put(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, arg: int,
             wait_ms: int) -> Job | None:
        g, refused = self._grant(s, handle, rid)
        if g is None:
            return refused
        if n > W.MAX_PUT_BYTES:
            return self._deny(s, handle, rid, f"a put request carries at most {W.MAX_PUT_BYTES} bytes, "
                              f"not {n}", True)
        try:
            g.check(True, off, n)
        except (ValueError, AccessDeniedError) as exc:
            # A consumer checks range and access itself: nothing of the payload is read.
            return self._deny(s, handle, rid, str(exc), True)
        wait_until = self._park_until(wait_ms)
        if n <= W.SMALL_BYTES:
            return self._small_put_job(s, g, handle, rid, off, n, wait_until)
        return self._put_job(s, g, handle, rid, off, n, wait_until)

    def _small_put_job(self, s: Session, g: Any, handle: int, rid: int, off: int, n: int,
                       wait_until: float) -> Job:
        """A small PUT: the payload received whole first (into the loop's buffer when it is all
        there, else into one of its own), then one native copy."""
        k = W.recv_some(s.sock, self._smv[:n]) if n else 0
        if k == n:
            v = g.copy(True, off, self._saddr, n)
            if v is not None:
                yield from self._reply(s, W.OK, handle, rid, v) or ()
                return
        buf = bytearray(n)
        buf[:k] = self._scratch[:k]
        mv = memoryview(buf)
        while k < n:
            yield READ, time.monotonic() + self.bounds.stall_s
            k += W.recv_some(s.sock, mv[k:])
        src = int(_ffi.cast("uintptr_t", _ffi.from_buffer(buf))) if n else 0
        while True:
            o, _ = g.move(True, off, n, 0, lambda address, m: _memcpy(address, src, m) or m)
            if int(o.status) == _BUSY:
                p = self._park(s, g, wait_until)
                if p:
                    if p == _WAIT:
                        yield PARK, wait_until
                    continue
            break
        if int(o.status) == _OK:
            yield from self._reply(s, W.OK, handle, rid, o.value) or ()
        else:
            yield from self._outcome(s, handle, rid, int(o.status), o.value) or ()

    def _put_job(self, s: Session, g: Any, handle: int, rid: int, off: int, n: int, wait_until: float) -> Job:
        """A large PUT straight into the window: each non-blocking receive is one bracket of its
        own, all of one version; a failure part-way reads the rest of the payload into the
        loop's buffer and answers the outcome (the consumer puts again)."""
        sock = s.sock
        done = v = 0
        fixed = False

        def recv(address: int, k: int) -> int:
            return W.recv_some(sock, _buffer(address, k))

        status = value = 0
        while done < n:
            o, k = g.move(True, off + done, n - done, v, recv)
            status, value = int(o.status), o.value
            done += k  # off the wire, valid or not
            if status == _OK:
                if k and not fixed:
                    v, fixed = value, True
                if done < n and not k:
                    yield READ, time.monotonic() + self.bounds.stall_s
                continue
            if not done and status == _BUSY:
                p = self._park(s, g, wait_until)
                if p:
                    if p == _WAIT:
                        yield PARK, wait_until
                    continue
            if done and status not in (_GEN_BEFORE, _GEN_AFTER):
                status, value = _TORN, 0
            while done < n:  # the rest of the payload, read and dropped
                k = W.recv_some(sock, self._smv[:min(n - done, len(self._smv))])
                done += k
                if done < n and not k:
                    yield READ, time.monotonic() + self.bounds.stall_s
            break
        if status == _OK:
            yield from self._reply(s, W.OK, handle, rid, v) or ()
        else:
            yield from self._outcome(s, handle, rid, status, value) or ()

    def _mark(self, s: Session, op: int, handle: int, rid: int, tile: int, n: int, arg: int, *_: int) -> Job | None:
        g, refused = self._grant(s, handle, rid)
        if g is None:
            return refused
        try:
            if op == W.OP_MARK and arg:
                o = g.add_rows(tile, arg & 0xFFFFFFFF, arg >> 32)
            else:
                o = g.set_ready(tile, op == W.OP_MARK)
        except (ValueError, AccessDeniedError) as exc:
            return self._deny(s, handle, rid, str(exc), False)
        if int(o.status) != _OK:
            return self._outcome(s, handle, rid, int(o.status), o.value)
        return self._reply(s, W.OK, handle, rid, o.value)

    def _pin(self, s: Session, op: int, handle: int, rid: int, ttl_ms: int, n: int, version: int,
             wait_ms: int) -> Job | None:
        g, refused = self._grant(s, handle, rid)
        if g is None:
            return refused
        return self._pin_job(s, g, handle, rid, version, ttl_ms / 1000.0, self._park_until(wait_ms))

    def _pin_job(self, s: Session, g: Any, handle: int, rid: int, version: int, ttl: float,
                 wait_until: float) -> Job:
        """A reservation of ``version`` for the session (the grant holds it): a write section
        overwriting the version is waited for like a GET's (parked until a commit)."""
        while True:
            try:
                o = g.reserve(version, ttl)
            except ValueError as exc:  # a version beyond the largest a window has
                yield from self._deny(s, handle, rid, str(exc), False) or ()
                return
            except MemsemError as exc:
                yield from self._reply(s, W.ERROR, handle, rid, 0, f"{type(exc).__name__}: {exc}") or ()
                return
            status, value = int(o.status), o.value
            if status == _BUSY:
                p = self._park(s, g, wait_until)
                if p:
                    if p == _WAIT:
                        yield PARK, wait_until
                    continue
            if status == _OK:
                yield from self._reply(s, W.OK, handle, rid, value) or ()
            else:
                yield from self._outcome(s, handle, rid, status, value) or ()
            return

    def _unpin(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, version: int, *_: int) -> None:
        g = s.handles.get(handle)
        if g is not None:
            g.drop_reservation(version)

    def _watch(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, *_: int) -> Job | None:
        if s.kind != W.KIND_WATCH or n > W.MAX_WATCH_TARGETS * W.TGT.size or n % W.TGT.size:
            return self._deny(s, handle, rid, "watch request refused (not a watch connection, or a "
                              "malformed target list)", True)
        return self._watch_job(s, handle, rid, n)

    def _watch_job(self, s: Session, handle: int, rid: int, n: int) -> Job:
        body = yield from self._body(s, n)
        g = s.handles.get(handle)
        if g is None:
            yield from self._deny(s, handle, rid, f"handle {handle} is not open on this connection", True)
            return
        targets = [W.TGT.unpack_from(body, i) for i in range(0, n, W.TGT.size)]
        old = s.subs.pop(handle, None)
        if old is not None:
            old.close()
        if g.closed:
            yield from self._outcome(s, handle, rid, _GEN_BEFORE, g.current()) or ()
            return
        try:
            sub = g.watch(targets, lambda: self.post(s))
        except ValueError as exc:
            yield from self._deny(s, handle, rid, str(exc), False) or ()
            return
        except MemsemError as exc:
            yield from self._reply(s, W.ERROR, handle, rid, 0, f"{type(exc).__name__}: {exc}") or ()
            return
        s.subs[handle] = sub
        sub.dirty = False  # the current values, then OK: the consumer starts in step
        yield from self._send_now(s, W.events(handle, sub.collect()) + W.REP.pack(W.OK, 0, handle, rid, 0, 0)) or ()

    def _unwatch(self, s: Session, op: int, handle: int, *_: int) -> None:
        sub = s.subs.pop(handle, None)
        if sub is not None:
            sub.close()

    def _push(self, s: Session) -> Job:
        """What changed in the words of ``s``'s subscriptions (each collect returns only what
        changed since the last one, so a slow reader costs one snapshot, never a queue)."""
        frames = []
        for handle, sub in list(s.subs.items()):
            if sub.dirty:
                sub.dirty = False
                changes = sub.collect()
                if changes:
                    frames.append(W.events(handle, changes))
        if frames:
            yield from self._send_now(s, b"".join(frames)) or ()

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
