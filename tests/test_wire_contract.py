"""The consumer's contract with a peer (issue 34): the tcp consumer trusts no reply.

Against a scripted owner (tests/_scripted_owner.py: a real listening socket speaking the wire
protocol, answering as each test says), on every path a reply takes: the whole path (one
request, pipelined chunks), a ref's wire route (memsem.core.WireRoute: the native call and what
Python finishes), puts, the hello and the watch connection's replies.

* A reply is checked against its request before anything is reported done: its id and handle,
  a status that answers that op (a GET answered OK without its bytes is a violation, not an
  empty success), the bytes it must carry; a violation is ``EngineError`` named ``PROTOCOL``
  naming the owner, the destination untouched, the connection dropped.
* Every number from a peer is bounded before it is used: an OK's version, an outcome's status
  and errno, a row count, a reply's text; and a directory record's tile count.
* Every read and write of a connection ends at the caller's deadline whatever the peer's pacing
  (a reply trickled faster than the receive slice, a hello the same, an owner that stalls), as
  ``MemsemTimeoutError``, never taken for a lost connection, and no request is made again past
  the deadline.
"""
from __future__ import annotations

import socket

import numpy as np
import pytest

import memsem
from memsem import EngineError, MemsemTimeoutError, PeerLostError, native
from memsem.core import WireRoute
from memsem.engines.tcp import TcpEngine
from memsem.engines.tcp import _wire as W

from tests._scripted_owner import Request, ScriptedOwner, data_reply, ok, ops, outcome, remote_of, trickle

N = 64
ERRNO = native.lib.MEMSEM_RC_ERRNO


@pytest.fixture
def engine():
    eng = TcpEngine(timeout=0.5)
    yield eng
    eng.close()


def _get(engine, owner, n=N, fill=0xEE):
    remote = remote_of(engine, owner, 8 << 20)
    out = np.full(n, fill, np.uint8)
    return remote, out, lambda: engine.get_version(remote, 0, out, 0)


def _protocol(exc_info, owner):
    e = exc_info.value
    assert isinstance(e, EngineError) and e.name == "PROTOCOL", repr(e)
    assert owner.endpoint in str(e)


# -- a reply is checked against its request ---------------------------------------------------------
def _bad_get_replies():
    def dr(req, **kw):
        return data_reply(req, bytes(req.nbytes), 1)
    return {
        "OK without the bytes": lambda req: ok(req, 3),
        "DATA of another size": lambda req: (W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, req.nbytes - 1)
                                             + bytes(req.nbytes - 1) + ok(req)),
        "another request's id": lambda req: data_reply(Request(req.op, req.handle, req.rid + 1, 0, 0, 0, 0, b""),
                                                      bytes(req.nbytes), 1),
        "another handle": lambda req: data_reply(Request(req.op, req.handle + 7, req.rid, 0, 0, 0, 0, b""),
                                                bytes(req.nbytes), 1),
        "DENIED after the bytes": lambda req: (W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, req.nbytes)
                                               + bytes(req.nbytes)
                                               + W.REP.pack(W.DENIED, 0, req.handle, req.rid, 0, 2) + b"no"),
        "DATA twice": lambda req: (W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, req.nbytes) + bytes(req.nbytes)
                                   + W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, 0)),
        "OK carrying bytes": lambda req: (W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, req.nbytes)
                                          + bytes(req.nbytes) + W.REP.pack(W.OK, 0, req.handle, req.rid, 1, 5)
                                          + bytes(5)),
        "an EVENT": lambda req: W.REP.pack(W.EVENT, 0, req.handle, req.rid, 0, 0),
        "an unknown status": lambda req: W.REP.pack(99, 0, req.handle, req.rid, 0, 0),
        "a version past the largest": lambda req: data_reply(req, bytes(req.nbytes), W.VERSION_MAX + 1),
        "text past its bound": lambda req: W.REP.pack(W.DENIED, 0, req.handle, req.rid, 0, W.MAX_ERROR_TEXT + 1),
        "an outcome no owner sends": lambda req: outcome(req, 200, 0),
        "an errno of 2**40": lambda req: outcome(req, ERRNO, 2 ** 40),
        "an errno of 0": lambda req: outcome(req, ERRNO, 0),
        "a busy version past the largest": lambda req: outcome(req, native.lib.MEMSEM_RC_BUSY, W.VERSION_MAX + 1),
        "a version gone past the largest": lambda req: outcome(req, native.lib.MEMSEM_RC_VERSION_GONE, 2 ** 63),
    }


@pytest.mark.parametrize("case", sorted(_bad_get_replies()))
@pytest.mark.parametrize("size", [N, 3 << 20], ids=["one request", "pipelined chunks"])
def test_a_get_whose_reply_breaks_the_protocol_is_refused(engine, case, size):
    script = _bad_get_replies()[case]
    with ScriptedOwner(script) as owner:
        _, out, get = _get(engine, owner, n=size)
        with pytest.raises(EngineError) as ei:
            get()
        _protocol(ei, owner)
        if case not in ("DENIED after the bytes", "DATA twice", "OK carrying bytes", "a version past the largest"):
            assert (out == 0xEE).all()  # nothing written where the reply came before the bytes
        # the connection was dropped: the next request goes on a new one
        assert owner.connections == 1
        with pytest.raises(EngineError):
            get()
        assert owner.connections == 2


def test_a_plain_get_and_a_legitimate_errno_still_pass(engine):
    calls = []

    def script(req):
        calls.append(req)
        return data_reply(req, bytes(range(N)), 7) if len(calls) == 1 else outcome(req, ERRNO, 5)

    with ScriptedOwner(script) as owner:
        _, out, get = _get(engine, owner)
        assert get() == 7 and out.tobytes() == bytes(range(N))
        with pytest.raises(memsem.EngineError) as ei:
            get()
        assert getattr(ei.value, "status", None) == ERRNO and ei.value.value == 5  # carried, as is
        assert owner.connections == 1  # an outcome keeps the connection in step


@pytest.mark.parametrize("case", ["OK past the largest version", "DATA", "OK carrying bytes", "errno 2**40"])
def test_a_put_whose_reply_breaks_the_protocol_is_refused(engine, case):
    script = {"OK past the largest version": lambda req: ok(req, W.VERSION_MAX + 1),
              "DATA": lambda req: W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, 0),
              "OK carrying bytes": lambda req: W.REP.pack(W.OK, 0, req.handle, req.rid, 1, 3) + b"abc",
              "errno 2**40": lambda req: outcome(req, ERRNO, 2 ** 40)}[case]
    with ScriptedOwner(script) as owner:
        remote = remote_of(engine, owner, 4096)
        with pytest.raises(EngineError) as ei:
            engine.put_version(remote, 0, np.arange(N, dtype=np.uint8))
        _protocol(ei, owner)


def test_a_row_count_and_a_pin_are_bounded(engine):
    def script(req):
        if req.op == W.OP_MARK:
            return ok(req, 1000)  # more rows than the tile has
        return ok(req, W.VERSION_MAX + 1)

    with ScriptedOwner(script) as owner:
        remote = remote_of(engine, owner, 4096)
        with pytest.raises(EngineError) as ei:
            engine.add_rows(remote, 0, 3, 10)
        _protocol(ei, owner)
        with pytest.raises(EngineError) as ei:
            engine.reserve_version(remote, 0, 1.0)
        _protocol(ei, owner)


@pytest.mark.parametrize("case", ["15 bytes", "OK without the digest", "a version past the largest", "DENIED after it"])
def test_a_digest_whose_reply_breaks_the_protocol_is_refused(engine, case):
    d = bytes(range(16))
    script = {"15 bytes": lambda req: data_reply(req, d[:15], 3),
              "OK without the digest": lambda req: ok(req, 3),
              "a version past the largest": lambda req: data_reply(req, d, W.VERSION_MAX + 1),
              "DENIED after it": lambda req: (W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, 16) + d
                                              + W.REP.pack(W.DENIED, 0, req.handle, req.rid, 0, 0))}[case]
    with ScriptedOwner(script) as owner:
        remote = remote_of(engine, owner, 4096)
        with pytest.raises(EngineError) as ei:
            engine.digest_version(remote, [(0, 8), (100, 9)], 3)
        _protocol(ei, owner)


def test_a_digest_sends_its_runs_and_takes_the_owners_answer(engine):
    d = bytes(range(16))
    with ScriptedOwner(lambda req: data_reply(req, d, 3)) as owner:
        remote = remote_of(engine, owner, 4096)
        assert engine.digest_version(remote, [(0, 8), (100, 9)], 3) == (3, d)
        (req,) = ops(owner, W.OP_DIGEST)
        assert req.arg == 3 and req.body == W.RUN.pack(0, 8) + W.RUN.pack(100, 9)
        with pytest.raises(ValueError, match="outside the region"):
            engine.digest_version(remote, [(4090, 8)], 3)  # refused here, nothing sent
        assert len(ops(owner, W.OP_DIGEST)) == 1


def test_an_open_answered_with_data_is_refused(engine):
    with ScriptedOwner(lambda req: W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, 0)) as owner:
        owner.scripts_open = True
        _, out, get = _get(engine, owner)
        with pytest.raises(EngineError) as ei:
            get()
        _protocol(ei, owner)
        assert ops(owner, W.OP_GET) == []  # no request went on an unopened handle


def test_a_watch_reply_that_breaks_the_protocol_ends_the_watch(engine):
    with ScriptedOwner(lambda req: W.REP.pack(W.DATA, 0, req.handle, req.rid, 0, 0)) as owner:
        remote = remote_of(engine, owner, 4096)
        with pytest.raises(PeerLostError, match="broke the protocol"):
            engine.watch(remote, [(0, 0, 1)], lambda changes: None, lambda why: None, timeout=5)


def test_an_engine_error_of_any_errno_is_a_memsem_error():
    for errno in (2 ** 40, -1, 0, 5):
        e = EngineError("x", errno=errno)
        assert str(errno) in str(e)


def test_a_directory_record_with_a_huge_tile_count_is_refused():
    from memsem.gva import WindowInfo

    with memsem.Runtime(engines=("loopback", "host")) as rt:
        ref = rt.publish(np.zeros(64, np.uint8), tile_bytes=16)
        rec = rt.directory.get_window(ref.spec.gva)
        for n_ready in (2 ** 40, 65):  # more ready words than any window, or than bytes
            bad = dict(rec, n_ready=n_ready)
            with pytest.raises(ValueError, match="n_ready"):
                WindowInfo.from_json(bad)
        assert WindowInfo.from_json(rec).n_ready == 4


# -- every read and write ends at the caller's deadline -------------------------------------------------
@pytest.mark.parametrize("size", [4096, 3 << 20], ids=["one request", "pipelined chunks"])
def test_a_trickled_reply_ends_at_the_deadline(engine, size):
    """A byte every 10 ms never lets a receive slice (0.1 s) pass empty: the deadline cuts it."""
    def script(req):
        return trickle(data_reply(req, bytes(req.nbytes), 1), 0.01, piece=7)

    with ScriptedOwner(script) as owner:
        _, out, get = _get(engine, owner, n=size)
        with pytest.raises(MemsemTimeoutError):
            get()
        assert len(ops(owner, W.OP_GET)) <= -(-size // W.CHUNK_BYTES)  # never made again


def test_a_trickled_hello_ends_at_the_deadline(engine):
    hello = W.HELLO.pack(W.MAGIC, W.PROTOCOL, W.HELLO_OK, bytes(16))
    with ScriptedOwner(lambda req: None, hello=trickle(hello, 0.05)) as owner:
        _, _, get = _get(engine, owner)
        with pytest.raises(MemsemTimeoutError):  # 24 bytes x 50 ms: past the 0.5 s deadline
            get()


@pytest.mark.parametrize("put", [False, True], ids=["get", "put"])
def test_a_stalled_owner_is_a_timeout_not_a_lost_connection(engine, put):
    with ScriptedOwner(lambda req: None) as owner:
        remote = remote_of(engine, owner, 4096)
        buf = np.zeros(N, np.uint8)
        with pytest.raises(MemsemTimeoutError):
            engine.put_version(remote, 0, buf) if put else engine.get_version(remote, 0, buf, 0)
        assert len(ops(owner, W.OP_PUT if put else W.OP_GET)) == 1  # not made again on a new connection
        assert owner.connections == 1


# -- the kept route ---------------------------------------------------------------------------------
class _Kept:
    """A ref's wire route (core.WireRoute) to the scripted owner: a window of this runtime lends
    its plan for the bracket; the engine's thread connection and handle are the route's."""

    def __init__(self, rt, engine, owner, n=N):
        self.ref = rt.publish(np.zeros(n, np.uint8))
        self.res = rt.resolve(self.ref.spec)
        self.remote = remote_of(engine, owner, 1 << 20)
        engine.get_version(self.remote, 0, np.zeros(n, np.uint8), 0)  # opens the connection and handle
        kr = engine.kept(self.remote, n)
        assert kr is not None
        self.route = WireRoute(self.res, self.ref.spec, rt.token, kr)

    def transfer(self, put, buf):
        return self.route.transfer(buf, put)


@pytest.fixture
def rt():
    with memsem.Runtime(engines=("loopback", "host"), timeout=5) as r:
        yield r


def _first_then(then):
    """A script answering the first GET plainly (the whole path opening the route), then ``then``."""
    seen = []

    def script(req):
        seen.append(req)
        if len(seen) == 1:
            return data_reply(req, bytes(req.nbytes), 1)
        return then(req)
    return script


@pytest.mark.parametrize("case", ["stall", "trickle"])
def test_the_kept_route_ends_at_one_deadline_and_makes_no_request_again(rt, engine, case):
    then = {"stall": lambda req: None,
            "trickle": lambda req: trickle(data_reply(req, bytes(req.nbytes), 2), 0.01)}[case]
    with ScriptedOwner(_first_then(then)) as owner:
        k = _Kept(rt, engine, owner)
        out = np.full(N, 0xEE, np.uint8)
        with pytest.raises(MemsemTimeoutError):
            k.transfer(False, out)
        assert k.route.deadline is not None
        assert len(ops(owner, W.OP_GET)) == 2  # the whole path's first, the kept one: never again
        assert owner.connections == 1
        assert (out == 0xEE).all()


def test_the_kept_route_refuses_a_get_answered_ok_without_its_bytes(rt, engine):
    with ScriptedOwner(_first_then(lambda req: ok(req, 2))) as owner:
        k = _Kept(rt, engine, owner)
        out = np.full(N, 0xEE, np.uint8)
        with pytest.raises(EngineError) as ei:
            k.transfer(False, out)
        _protocol(ei, owner)
        assert (out == 0xEE).all()


def test_the_kept_route_sends_the_rest_of_a_put_the_socket_did_not_take(rt):
    """A put larger than the socket takes within the native call's slice (the owner reads its
    payload late): the rest is sent within the deadline, exactly once, and the put completes."""
    n = W.SMALL_BYTES
    payload = (np.arange(n) % 251).astype(np.uint8)

    def script(req):
        if req.op == W.OP_GET:
            return data_reply(req, bytes(req.nbytes), 1)
        return ok(req, 4)

    engine = TcpEngine(timeout=30)
    with ScriptedOwner(script, body_after=0.3, rcvbuf=4096) as owner:
        k = _Kept(rt, engine, owner, n=n)
        k.route._requests.usable().sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        rc = k.transfer(True, payload)
        assert rc & native.lib.MEMSEM_RC_STATUS_MASK == 0, hex(rc)
        assert rc >> native.lib.MEMSEM_RC_VERSION_SHIFT == 4
        puts = ops(owner, W.OP_PUT)
        assert len(puts) == 1 and puts[0].body == payload.tobytes()
    engine.close()


# -- found by review -----------------------------------------------------------------------------
def test_a_full_reply_on_a_watch_connection_says_the_owner_is_full(engine):
    """An owner closing an unauthenticated connection for a newer one says FULL (request 0,
    handle 0): the watch reports that, not a protocol violation."""
    text = b"the owner closed this unauthenticated connection"

    def script(req):
        return W.REP.pack(W.FULL, 0, 0, 0, 4096, len(text)) + text

    with ScriptedOwner(script) as owner:
        owner.scripts_open = True
        remote = remote_of(engine, owner, 4096)
        with pytest.raises(PeerLostError, match="FULL") as ei:
            engine.watch(remote, [(0, 0, 1)], lambda changes: None, lambda why: None, timeout=5)
        assert "broke the protocol" not in str(ei.value)


def test_the_owner_is_asked_to_wait_less_than_the_caller(engine):
    """A request asks the owner to park it (an open write section) for less than what is left of
    the caller's deadline, so the owner's BUSY arrives before it (a write section that stayed
    open, on a connection still in step), never a timeout of the reply."""
    with ScriptedOwner(lambda req: data_reply(req, bytes(req.nbytes), 1)) as owner:
        remote = remote_of(engine, owner, 4096)
        engine.get_version(remote, 0, np.zeros(N, np.uint8), 0)
        kr = engine.kept(remote, N)
        assert kr is not None
        (get,) = ops(owner, W.OP_GET)
        limit = int(engine.timeout * 1000)
        assert 0 <= get.wait_ms < limit - int(W.POLL_SLICE * 1000), (get.wait_ms, limit)


def test_no_request_is_made_past_the_callers_deadline(engine):
    import time

    with ScriptedOwner(lambda req: data_reply(req, bytes(req.nbytes), 1)) as owner:
        remote = remote_of(engine, owner, 4096)
        with pytest.raises(MemsemTimeoutError):
            engine.get_version(remote, 0, np.zeros(N, np.uint8), 0, deadline=time.monotonic() - 1)
        assert ops(owner, W.OP_GET) == []


def test_a_put_through_a_read_only_ref_is_refused_before_anything_is_resolved():
    with memsem.Runtime(timeout=5) as owner, memsem.Runtime(timeout=5) as other:
        ref = owner.publish(np.zeros(16, np.float32), slots=2)
        r = other.ref(ref.to_bytes())
        owner.unpublish(ref)  # stale as well: the caller's mistake is named first
        with pytest.raises(memsem.AccessDeniedError, match="read-only"):
            r.put(np.ones(16, np.float32))
