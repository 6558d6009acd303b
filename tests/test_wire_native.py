"""memsem._hot.wire, the native call of a kept wire route's request (memsem.core.KeptWire over
tcp), against a scripted owner: the other end of a socketpair, whose replies are packed with the
wire's own structs (memsem.engines.tcp._wire), so the C side's reading of the reply header is
checked against the Python definition of the protocol.

Each case says what the call must leave behind: the request on the wire (or nothing), the bytes
in the buffer, and the bracket open (the caller finishes or undoes it) or closed.
"""
from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memsem
from memsem import _hot, native
from memsem.core import Status
from memsem.core._bracket import KeptBracket
from memsem.engines.tcp import _wire as W

SHIFT = native.lib.MEMSEM_RC_VERSION_SHIFT
STATUS = native.lib.MEMSEM_RC_STATUS_MASK
N = 64
RID = 7


@pytest.fixture
def rt():
    with memsem.Runtime(engines=("loopback", "host"), timeout=5) as r:
        yield r


@pytest.fixture
def pair():
    a, z = socket.socketpair()
    yield a, z
    a.close()
    z.close()


def _window(rt, access="rw"):
    a = np.zeros(N, np.uint8)
    if access == "r":
        a.flags.writeable = False
    ref = rt.publish(a, access=access)
    res = rt.resolve(ref.spec)
    return ref, res, KeptBracket(res.plan)


def _head(put, n=N, rid=RID):
    return W.REQ.pack(W.OP_PUT if put else W.OP_GET, 0, 1, rid, 0, n, 0, 1000)


def _call(b, res, sock, put, buf, head=None, rbuf=None, slice_ms=20, code=3):
    rbuf = bytearray(2 * W.REP.size + N) if rbuf is None else rbuf
    rc = _hot.wire(b.address, res.addr, sock.fileno(), put, 0, buf, N, code, head or _head(put), RID, rbuf,
                   slice_ms)
    return rc, rbuf


def _data_reply(payload, version, rid=RID):
    return (W.REP.pack(W.DATA, 0, 1, rid, 0, len(payload)) + payload
            + W.REP.pack(W.OK, 0, 1, rid, version, 0))


def test_a_plain_get_reply_is_copied_and_closes_the_bracket(rt, pair):
    a, z = pair
    _, res, b = _window(rt)
    payload = bytes(range(N))
    z.sendall(_data_reply(payload, 41))  # the owner's reply waits in the socket
    out = np.zeros(N, np.uint8)
    rc, _ = _call(b, res, a, False, out)
    assert rc & STATUS == 0 and rc >> SHIFT == 41  # the owner's version, not the bracket's
    assert out.tobytes() == payload
    assert z.recv(100) == _head(False)  # exactly the request
    assert b.close(1) & STATUS == native.lib.MEMSEM_RC_ERRNO  # closed already: not open


def test_a_plain_put_sends_the_bytes_after_the_header(rt, pair):
    a, z = pair
    _, res, b = _window(rt)
    z.sendall(W.REP.pack(W.OK, 0, 1, RID, 9, 0))
    src = np.arange(N, dtype=np.uint8)
    rc, _ = _call(b, res, a, True, src)
    assert rc & STATUS == 0 and rc >> SHIFT == 9
    got = b""
    while len(got) < W.REQ.size + N:
        got += z.recv(4096)
    assert got == _head(True) + src.tobytes()


@pytest.mark.parametrize("case", ["half", "nothing", "other rid", "outcome", "short data", "other handle",
                                  "version past the largest", "OK carrying bytes"])
def test_a_reply_that_is_not_plain_is_left_pending_with_what_arrived(rt, pair, case):
    """What the call cannot finish whole it leaves to the Python reader: the bytes received so
    far in the buffer, the bracket open, the destination untouched."""
    a, z = pair
    _, res, b = _window(rt)
    payload = bytes(range(N))
    reply = {"half": _data_reply(payload, 3)[:40], "nothing": b"", "other rid": _data_reply(payload, 3, rid=RID + 1),
             "outcome": W.REP.pack(W.OUTCOME, Status.BUSY.value, 1, RID, 5, 0),
             "short data": W.REP.pack(W.DATA, 0, 1, RID, 0, N - 1) + payload[:N - 1]
             + W.REP.pack(W.OK, 0, 1, RID, 3, 0),
             "other handle": (W.REP.pack(W.DATA, 0, 2, RID, 0, N) + payload + W.REP.pack(W.OK, 0, 2, RID, 3, 0)),
             "version past the largest": _data_reply(payload, W.VERSION_MAX + 1),
             "OK carrying bytes": W.REP.pack(W.DATA, 0, 1, RID, 0, N) + payload + W.REP.pack(W.OK, 0, 1, RID, 3, 1)
             }[case]
    if reply:
        z.sendall(reply)
    out = np.full(N, 0xEE, np.uint8)
    rc, rbuf = _call(b, res, a, False, out)
    assert rc & STATUS == _hot.RC_WIRE_PENDING
    assert rc >> SHIFT == len(reply) and bytes(rbuf[:len(reply)]) == reply
    assert (out == 0xEE).all()
    assert z.recv(100) == _head(False)
    o = b.undo([res])  # the bracket was open: undone now
    assert o is not None and o.status is Status.ERRNO


@pytest.mark.parametrize("moment", ["before the request", "after the request"])
def test_a_connection_that_fails_is_lost_with_its_errno(rt, pair, moment):
    a, z = pair
    _, res, b = _window(rt)
    if moment == "before the request":
        z.close()  # the send fails: EPIPE
    else:
        z.shutdown(socket.SHUT_WR)  # the request goes, the reply never comes: end of stream
    out = np.zeros(N, np.uint8)
    rc, _ = _call(b, res, a, False, out)
    assert rc & STATUS == _hot.RC_WIRE_LOST
    assert rc >> SHIFT == (32 if moment == "before the request" else 0)  # EPIPE, or closed by the peer
    assert b.undo([res]) is not None


@pytest.mark.parametrize("what", ["read-only destination", "wrong size", "other dtype", "not a buffer"])
def test_the_door_refuses_before_anything_is_sent(rt, pair, what):
    a, z = pair
    _, res, b = _window(rt)
    out = {"read-only destination": np.zeros(N, np.uint8), "wrong size": np.zeros(N - 1, np.uint8),
           "other dtype": np.zeros(N // 4, np.float32), "not a buffer": [0] * N}[what]
    if what == "read-only destination":
        out.flags.writeable = False
    rc, _ = _call(b, res, a, False, out, code=6 if what == "other dtype" else 3)
    assert rc == _hot.RC_BUFFER
    z.setblocking(False)
    with pytest.raises(BlockingIOError):
        z.recv(100)  # nothing was sent
    assert b.close(1) & STATUS == native.lib.MEMSEM_RC_ERRNO  # and no bracket open


def test_the_brackets_refusal_sends_nothing(rt, pair):
    a, z = pair
    _, res, b = _window(rt, access="r")
    rc, _ = _call(b, res, a, True, np.zeros(N, np.uint8))
    assert rc & STATUS == native.lib.MEMSEM_RC_READONLY
    z.setblocking(False)
    with pytest.raises(BlockingIOError):
        z.recv(100)


def test_the_call_checks_its_arguments(rt, pair):
    a, _ = pair
    _, res, b = _window(rt)
    with pytest.raises(ValueError, match="rbuf"):
        _call(b, res, a, False, np.zeros(N, np.uint8), rbuf=bytearray(10))
    with pytest.raises(TypeError, match="12 arguments"):
        _hot.wire(b.address)
    with pytest.raises(ValueError, match="not valid"):
        _hot.wire(0, res.addr, a.fileno(), 0, 0, np.zeros(N, np.uint8), N, 3, _head(False), RID,
                  bytearray(200), 10)


def test_one_slice_bounds_the_whole_call_however_the_reply_trickles(rt, pair):
    """A reply that trickles in (a byte every 5 ms: at least 0.56 s for the whole of it) is not
    waited for past one slice in all: the call hands back what arrived, the bracket open."""
    import threading
    import time

    a, z = pair
    _, res, b = _window(rt)
    reply = _data_reply(bytes(range(N)), 3)
    stop = threading.Event()

    def trickle():
        for i in range(len(reply)):
            if stop.is_set():
                return
            z.send(reply[i:i + 1])
            time.sleep(0.005)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        rc, rbuf = _call(b, res, a, False, np.zeros(N, np.uint8), slice_ms=50)
    finally:
        stop.set()
        t.join(10)
    assert rc & STATUS == _hot.RC_WIRE_PENDING
    got = rc >> SHIFT
    assert got < len(reply) and bytes(rbuf[:got]) == reply[:got]
    assert b.undo([res]) is not None


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 40))
def test_the_one_reader_reads_what_the_wire_packs(status, flags, handle, rid, value, nbytes, at):
    """The reply layout is read in one place (native/memsem_hot.c, ``reply_header``, which the
    kept route's native call uses too): it agrees with the protocol's definition in _wire."""
    buf = bytes(at) + W.REP.pack(status, flags, handle, rid, value, nbytes) + bytes(3)
    assert _hot.reply_header(buf, at) == (status, flags, handle, rid, value, nbytes)
    with pytest.raises(ValueError):
        _hot.reply_header(buf, len(buf) - W.REP.size + 1)
