"""The owner's requests, by op: what each one checks, and the job that answers it.

Dispatch is a table (``Requests.table``: op -> handler); a handler checks the request at once
(its handle, range, direction) and returns nothing (answered, or no reply), or a *job*: a
generator that yields what it waits for (``READ``, ``WRITE``, ``PARK``) with that wait's
deadline, run by the server's loop (:mod:`memsem.engines.tcp._server`), which reads the
header and dispatches: each op is answered here and only here. Every copy of window bytes is
one bracket around one non-blocking call (``Grant.move``) or one native copy (``Grant.copy``);
the owner's outcome goes back as it is (OUTCOME). What an outcome means is the runtime's: the
handlers ask it only whether to wait for a commit (``waits``), to try again at once (``again``)
and what a reply cut short reports (``Grant.partial``); they never read a generation or a
status themselves.
"""
from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from memsem._errors import AccessDeniedError, MemsemError
from memsem.engines._base import RUN_DIGEST_BYTES, run_digest
from memsem.engines.tcp import _wire as W
from memsem.native import ffi as _ffi
from memsem.native import memcpy as _memcpy

if TYPE_CHECKING:
    from memsem.engines.tcp._server import Server, Session

#: what a job waits for (with a deadline)
READ, WRITE, PARK = 1, 2, 3
#: ``Server.park``'s answers: try once more at once, or wait
AGAIN, WAIT = 1, 2
_REP_SIZE, _SMALL, _DATA, _OK = W.REP.size, W.SMALL_BYTES, W.DATA, W.OK
_pack_rep = W.REP.pack_into
#: digests of runs kept per server, by (gva, generation, version, the runs' digest): the children
#: of relays of one plan ask for the same runs of the same version, computed once
DIGEST_CACHE = 64
#: bytes a DIGEST hashes in one copy bracket before it lets the loop serve the other sessions
#: (the loop's one thread is never held longer than hashing this much)
DIGEST_SLICE_BYTES = 4 << 20
#: zeros sent in place of the rest of a reply whose bytes stopped being valid mid-way
_ZEROS = memoryview(bytes(W.CHUNK_BYTES))

Job = Generator[tuple[int, float], None, None]


def _buffer(address: int, nbytes: int) -> Any:
    return _ffi.buffer(_ffi.cast("char *", address), nbytes)


class Requests:
    """The handlers of one server's requests (see the module docstring).

    Args:
        srv: the server: its bounds, context (``serve_open``), loop buffer, replies and waits.
    """

    def __init__(self, srv: "Server") -> None:
        self.srv = srv
        #: op -> handler(session, op, handle, rid, offset, nbytes, arg, wait_ms)
        self.table: dict[int, Callable[..., Job | None]] = {
            W.OP_OPEN: self.open, W.OP_CLOSE: self.close_handle, W.OP_GET: self.get, W.OP_PUT: self.put,
            W.OP_MARK: self.mark, W.OP_CLEAR: self.mark, W.OP_WATCH: self.watch, W.OP_UNWATCH: self.unwatch,
            W.OP_PIN: self.pin, W.OP_UNPIN: self.unpin, W.OP_SYNC: self.sync,
            W.OP_DIGEST: self.digest,
        }
        self._digests: collections.OrderedDict[tuple, bytes] = collections.OrderedDict()

    def _parked(self, s: Session, g: Any, wait_until: float) -> Generator[tuple[int, float], None, bool]:
        """A BUSY answer (a write section is open): park the job until the section ends or
        ``wait_until`` (``Server.park``); True when the request is to be tried again, False
        when its wait is over (the caller answers BUSY)."""
        p = self.srv.park(s, g, wait_until)
        if p == WAIT:
            yield PARK, wait_until
        return bool(p)

    # -- ops --------------------------------------------------------------------------------------
    def open(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, arg: int, wait_ms: int) -> Job:
        if n > W.MAX_OPEN_BODY or n < 16:
            return self.srv.deny(s, handle, rid, f"a credential of {n} bytes (16 to {W.MAX_OPEN_BODY})", True)
        return self._open_job(s, handle, rid, n)

    def _open_job(self, s: Session, handle: int, rid: int, n: int) -> Job:
        body = yield from self.srv.body(s, n)
        try:
            g = self.srv.context.serve_open(bytes(body[:n - 16]), s.nonce + W.H16.pack(handle), bytes(body[n - 16:]))
        except AccessDeniedError as exc:  # one guess per connection
            yield from self.srv.deny(s, handle, rid, str(exc), True)
            return
        except MemsemError as exc:
            job = self.srv.reply(s, W.ERROR, handle, rid, 0, f"{type(exc).__name__}: {exc}")
            if job is not None:
                yield from job
            return
        old = s.handles.pop(handle, None)
        if old is not None:
            old.close()
        if len(s.handles) >= W.MAX_HANDLES:
            g.close()
            job = self.srv.reply(s, W.ERROR, handle, rid, 0, f"{W.MAX_HANDLES} credentials are open on this "
                              f"connection to {self.srv.endpoint} already (close some)")
        else:
            s.handles[handle] = g
            self.srv.authenticated(s)
            job = self.srv.reply(s, W.OK, handle, rid)
        if job is not None:
            yield from job

    def close_handle(self, s: Session, op: int, handle: int, *_: int) -> None:
        sub = s.subs.pop(handle, None)
        if sub is not None:
            sub.close()
        g = s.handles.pop(handle, None)
        if g is not None:
            g.close()

    def _grant(self, s: Session, handle: int, rid: int) -> tuple[Any, Job | None]:
        g = s.handles.get(handle)
        if g is None:
            return None, self.srv.deny(s, handle, rid, f"handle {handle} is not open on this connection", True)
        return g, None

    def get(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, version: int,
             wait_ms: int) -> Job | None:
        """GET. The common small one is one native copy (bracket and copy) into the loop's reply
        buffer and one send of header, bytes and trailer; anything unusual is a job."""
        g = s.handles.get(handle)
        if g is not None and n <= _SMALL and g.lo <= off and off + n <= g.hi:
            srv = self.srv
            v = g.copy(False, off, srv.saddr + _REP_SIZE, n, version)
            if v is not None:
                buf = srv.scratch
                _pack_rep(buf, 0, _DATA, 0, handle, rid, 0, n)
                _pack_rep(buf, _REP_SIZE + n, _OK, 0, handle, rid, v, 0)
                return srv.send_now(s, srv.smv[:2 * _REP_SIZE + n])
        g, refused = self._grant(s, handle, rid)
        if g is None:
            return refused
        try:
            g.check(False, off, n)
        except (ValueError, AccessDeniedError) as exc:
            return self.srv.deny(s, handle, rid, str(exc), False)
        return self._get_job(s, g, handle, rid, off, n, version, self.srv.park_until(wait_ms))

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
            done += k  # on the wire, valid or not
            if o.ok:
                if hs and not fixed:
                    v, fixed = o.value, True  # the version every later bracket must see
                if hs < len(head) or done < n:
                    yield WRITE, time.monotonic() + self.srv.bounds.send_s
                continue
            if not hs:  # nothing sent: a clean answer (or a wait)
                if o.waits and (yield from self._parked(s, g, wait_until)):
                    continue
                if o.again:  # a section opened under a send that took nothing
                    yield WRITE, time.monotonic() + self.srv.bounds.send_s
                    continue
                yield from self.srv.outcome(s, handle, rid, o) or ()
                return
            # Bytes of the reply are out already: zeros for the rest, then what the runtime says
            # such a reply reports (the generation moved, or the bytes are not one version's).
            o = g.partial(o)
            while hs < len(head) or done < n:
                if hs < len(head):
                    hs += W.send_some(sock, head[hs:])
                else:
                    done += W.send_some(sock, _ZEROS[:min(n - done, len(_ZEROS))])
                if hs < len(head) or done < n:
                    yield WRITE, time.monotonic() + self.srv.bounds.send_s
            yield from self.srv.outcome(s, handle, rid, o) or ()
            return
        yield from self.srv.reply(s, W.OK, handle, rid, v) or ()

    def put(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, arg: int,
             wait_ms: int) -> Job | None:
        g, refused = self._grant(s, handle, rid)
        if g is None:
            return refused
        if n > W.MAX_PUT_BYTES:
            return self.srv.deny(s, handle, rid, f"a put request carries at most {W.MAX_PUT_BYTES} bytes, "
                              f"not {n}", True)
        try:
            g.check(True, off, n)
        except (ValueError, AccessDeniedError) as exc:
            # A consumer checks range and access itself: nothing of the payload is read.
            return self.srv.deny(s, handle, rid, str(exc), True)
        wait_until = self.srv.park_until(wait_ms)
        if n <= W.SMALL_BYTES:
            return self._small_put_job(s, g, handle, rid, off, n, wait_until)
        return self._put_job(s, g, handle, rid, off, n, wait_until)

    def _small_put_job(self, s: Session, g: Any, handle: int, rid: int, off: int, n: int,
                       wait_until: float) -> Job:
        """A small PUT: the payload received whole first (into the loop's buffer when it is all
        there, else into one of its own), then one native copy."""
        k = W.recv_some(s.sock, self.srv.smv[:n]) if n else 0
        if k == n:
            v = g.copy(True, off, self.srv.saddr, n)
            if v is not None:
                yield from self.srv.reply(s, W.OK, handle, rid, v) or ()
                return
        buf = bytearray(n)
        buf[:k] = self.srv.scratch[:k]
        mv = memoryview(buf)
        while k < n:
            yield READ, time.monotonic() + self.srv.bounds.stall_s
            k += W.recv_some(s.sock, mv[k:])
        src = int(_ffi.cast("uintptr_t", _ffi.from_buffer(buf))) if n else 0
        while True:
            o, _ = g.move(True, off, n, 0, lambda address, m: _memcpy(address, src, m) or m)
            if o.waits and (yield from self._parked(s, g, wait_until)):
                continue
            break
        yield from self.srv.outcome(s, handle, rid, o) or ()

    def _put_job(self, s: Session, g: Any, handle: int, rid: int, off: int, n: int, wait_until: float) -> Job:
        """A large PUT straight into the window: each non-blocking receive is one bracket of its
        own, all of one version; a failure part-way reads the rest of the payload into the
        loop's buffer and answers the outcome (the consumer puts again)."""
        sock = s.sock
        done = v = 0
        fixed = False

        def recv(address: int, k: int) -> int:
            return W.recv_some(sock, _buffer(address, k))

        failed = None
        while done < n:
            o, k = g.move(True, off + done, n - done, v, recv)
            done += k  # off the wire, valid or not
            if o.ok:
                if k and not fixed:
                    v, fixed = o.value, True
                if done < n and not k:
                    yield READ, time.monotonic() + self.srv.bounds.stall_s
                continue
            if not done and o.waits and (yield from self._parked(s, g, wait_until)):
                continue
            failed = g.partial(o) if done else o
            while done < n:  # the rest of the payload, read and dropped
                k = W.recv_some(sock, self.srv.smv[:min(n - done, len(self.srv.smv))])
                done += k
                if done < n and not k:
                    yield READ, time.monotonic() + self.srv.bounds.stall_s
            break
        if failed is None:
            yield from self.srv.reply(s, W.OK, handle, rid, v) or ()
        else:
            yield from self.srv.outcome(s, handle, rid, failed) or ()

    def mark(self, s: Session, op: int, handle: int, rid: int, tile: int, n: int, arg: int, *_: int) -> Job | None:
        """MARK / CLEAR of a tile's ready word; a MARK with ``arg`` (rows << 32 | rows per tile)
        counts rows of a tile written in part (the write that completes the tile marks it)."""
        g, refused = self._grant(s, handle, rid)
        if g is None:
            return refused
        try:
            if op == W.OP_MARK and arg:
                o = g.add_rows(tile, arg & 0xFFFFFFFF, arg >> 32)
            else:
                o = g.set_ready(tile, op == W.OP_MARK)
        except (ValueError, AccessDeniedError) as exc:
            return self.srv.deny(s, handle, rid, str(exc), False)
        return self.srv.outcome(s, handle, rid, o)

    def pin(self, s: Session, op: int, handle: int, rid: int, ttl_ms: int, n: int, version: int,
            wait_ms: int) -> Job | None:
        """PIN: a reservation of ``version`` held at the owner for the session."""
        g, refused = self._grant(s, handle, rid)
        if g is None:
            return refused
        return self._pin_job(s, g, handle, rid, version, ttl_ms / 1000.0, self.srv.park_until(wait_ms))

    def _pin_job(self, s: Session, g: Any, handle: int, rid: int, version: int, ttl: float,
                 wait_until: float) -> Job:
        """A reservation of ``version`` for the session (the grant holds it): a write section
        overwriting the version is waited for like a GET's (parked until a commit)."""
        while True:
            try:
                o = g.reserve(version, ttl)
            except ValueError as exc:  # a version beyond the largest a window has
                yield from self.srv.deny(s, handle, rid, str(exc), False) or ()
                return
            except MemsemError as exc:
                yield from self.srv.reply(s, W.ERROR, handle, rid, 0, f"{type(exc).__name__}: {exc}") or ()
                return
            if o.waits and (yield from self._parked(s, g, wait_until)):
                continue
            yield from self.srv.outcome(s, handle, rid, o) or ()
            return

    def digest(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, version: int,
               wait_ms: int) -> Job | None:
        """DIGEST: ``run_digest`` of the runs the body lists (``RUN``: offset, nbytes) of one
        version (``version``, 0 the latest), read in slices of ``DIGEST_SLICE_BYTES``, each in
        a bracket of that version, the loop serving the other sessions between two; the reply
        is DATA of ``RUN_DIGEST_BYTES`` bytes and its trailer (OK with the version), so
        only the digest crosses the link. A malformed body is refused before it is read."""
        if n % W.RUN.size or not 0 < n <= W.MAX_DIGEST_RUNS * W.RUN.size:
            return self.srv.deny(s, handle, rid, f"a digest request of {n} bytes (1 to {W.MAX_DIGEST_RUNS} runs "
                                                 f"of {W.RUN.size} bytes)", True)
        return self._digest_job(s, handle, rid, n, version, self.srv.park_until(wait_ms))

    def _digest_job(self, s: Session, handle: int, rid: int, n: int, version: int, wait_until: float) -> Job:
        body = yield from self.srv.body(s, n)
        g, refused = self._grant(s, handle, rid)
        if g is None:
            yield from refused or ()
            return
        runs = [W.RUN.unpack_from(body, i) for i in range(0, n, W.RUN.size)]
        try:
            for off, k in runs:
                g.check(False, off, k)
        except (ValueError, AccessDeniedError) as exc:
            yield from self.srv.deny(s, handle, rid, str(exc), False) or ()
            return
        key = (g.gva, g.generation, version, hashlib.blake2b(body, digest_size=16).digest())
        known = self._digests.get(key) if version else None
        if known is not None:  # a version's bytes never change, so neither does their digest
            o, _ = g.move(False, runs[0][0], 0, version, lambda address, m: 0)
            if not o.ok:  # answered as the window answers now (the version gone, the generation moved)
                yield from self.srv.outcome(s, handle, rid, o) or ()
                return
            self.srv.stats["digests_cached"] += 1
            yield from self.srv.send_now(s, W.REP.pack(W.DATA, 0, handle, rid, 0, RUN_DIGEST_BYTES) + known
                                         + W.REP.pack(W.OK, 0, handle, rid, version, 0)) or ()
            return
        while True:
            h, v = run_digest(), version
            o = None

            def feed(address: int, m: int, h: Any = h) -> int:
                h.update(_buffer(address, m))
                return m

            for off, k in runs:
                done = 0
                while done < k:
                    o, m = g.move(False, off + done, min(k - done, DIGEST_SLICE_BYTES), v, feed)
                    if not o.ok:
                        break
                    v, done = o.value, done + m
                    self.srv.stats["digest_slices"] += 1
                    # each slice is its own bracket of version v: between two, the other sessions
                    # are served (the socket is writable at once unless the peer stopped reading)
                    yield WRITE, time.monotonic() + self.srv.bounds.send_s
                if o is not None and not o.ok:
                    break
            if o is not None and not o.ok and o.waits and (yield from self._parked(s, g, wait_until)):
                continue  # an open write section: the whole digest again after its commit
            break
        if o is not None and not o.ok:
            yield from self.srv.outcome(s, handle, rid, o) or ()
            return
        if not v:  # only empty runs: the latest version, read with an empty bracket
            o, _ = g.move(False, runs[0][0], 0, version, lambda address, m: 0)
            if not o.ok:
                yield from self.srv.outcome(s, handle, rid, o) or ()
                return
            v = o.value
        d = h.digest()
        self.srv.stats["digests"] += 1
        self._digests[key[:2] + (v,) + key[3:]] = d
        while len(self._digests) > DIGEST_CACHE:
            self._digests.popitem(last=False)
        yield from self.srv.send_now(s, W.REP.pack(W.DATA, 0, handle, rid, 0, RUN_DIGEST_BYTES) + d
                                     + W.REP.pack(W.OK, 0, handle, rid, v, 0)) or ()

    def unpin(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, version: int, *_: int) -> None:
        """UNPIN: drop the session's reservation of ``version`` (no reply)."""
        g = s.handles.get(handle)
        if g is not None:
            g.drop_reservation(version)

    def watch(self, s: Session, op: int, handle: int, rid: int, off: int, n: int, *_: int) -> Job | None:
        if s.kind != W.KIND_WATCH or n > W.MAX_WATCH_TARGETS * W.TGT.size or n % W.TGT.size:
            return self.srv.deny(s, handle, rid, "watch request refused (not a watch connection, or a "
                              "malformed target list)", True)
        return self._watch_job(s, handle, rid, n)

    def _watch_job(self, s: Session, handle: int, rid: int, n: int) -> Job:
        body = yield from self.srv.body(s, n)
        g = s.handles.get(handle)
        if g is None:
            yield from self.srv.deny(s, handle, rid, f"handle {handle} is not open on this connection", True)
            return
        targets = [W.TGT.unpack_from(body, i) for i in range(0, n, W.TGT.size)]
        old = s.subs.pop(handle, None)
        if old is not None:
            old.close()
        if g.closed:
            yield from self.srv.outcome(s, handle, rid, g.gone()) or ()
            return
        try:
            sub = g.watch(targets, lambda: self.srv.post(s))
        except ValueError as exc:
            yield from self.srv.deny(s, handle, rid, str(exc), False) or ()
            return
        except MemsemError as exc:
            yield from self.srv.reply(s, W.ERROR, handle, rid, 0, f"{type(exc).__name__}: {exc}") or ()
            return
        s.subs[handle] = sub
        sub.flush = self.srv.flush
        sub.dirty = False  # the current values, then OK: the consumer starts in step
        yield from self.srv.send_now(s, W.events(handle, sub.collect()) + W.REP.pack(W.OK, 0, handle, rid, 0, 0)) or ()

    def sync(self, s: Session, op: int, handle: int, rid: int, *_: int) -> Job | None:
        """SYNC: what changed in the words of the handle's subscription since they were last
        sent, then OK. This loop ran every request the consumer sent before (on any of its
        connections) whose reply it had when it sent SYNC, so its own MARK / CLEAR are in the
        words collected here: after OK its mirror holds them (or anything later)."""
        if s.kind != W.KIND_WATCH:
            return self.srv.deny(s, handle, rid, "sync request refused (not a watch connection)", True)
        sub = s.subs.get(handle)
        changes = sub.collect() if sub is not None else []
        return self.srv.send_now(s, W.events(handle, changes) + W.REP.pack(W.OK, 0, handle, rid, 0, 0))

    def unwatch(self, s: Session, op: int, handle: int, *_: int) -> None:
        sub = s.subs.pop(handle, None)
        if sub is not None:
            sub.close()

    def push(self, s: Session) -> Job:
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
            yield from self.srv.send_now(s, b"".join(frames)) or ()


__all__ = ["AGAIN", "PARK", "READ", "Requests", "WAIT", "WRITE"]
