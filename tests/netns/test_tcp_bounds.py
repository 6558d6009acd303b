"""No peer can hold an owner's window, thread or memory past a bound (issue 21, classes 1-6).

An owner process (``_owner.py``, node "own-a") serves windows over tcp; this process is a
consumer on node "con-b" and, through raw sockets (``tcp_raw``), a hostile or broken peer:
half headers at every phase, stalls, floods beyond the caps, a client that never reads, waits
of 49 days, forged proofs, 500 windows, 10,000 sub-range refs, an owner killed under load.

Bounds are asserted as the owner's own counted events (``TcpEngine.server_stats``: which bound
closed a connection) and outcomes (an unpublish that succeeds while a peer stalls), never as
wall-clock limits; every wait has a timeout. The owner runs with short bounds (environment).
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
import time

import numpy as np
import pytest

import memsem
import tcp_raw as R
from memsem.engines.tcp import _wire as W
from memsem.gva import credential_token
from memsem.native import lib as _lib
from owner_proc import SECRET, Owner
from redis_server import redis_server

ENGINES = ("loopback", "host", "tcp")
MiB = 1 << 20
#: the owner's bounds in these tests (seconds)
SHORT = {"MEMSEM_TCP_GRACE_S": "1", "MEMSEM_TCP_STALL_S": "1", "MEMSEM_TCP_SEND_S": "1",
         "MEMSEM_TCP_IDLE_S": "3", "MEMSEM_TCP_MAX_WAIT_S": "1"}


@pytest.fixture(scope="module")
def redis_url(redis_binary):
    with redis_server(binary=redis_binary) as srv:
        yield srv.url


@pytest.fixture
def job():
    return f"tcpb{os.getpid()}{secrets.token_hex(3)}"


@pytest.fixture
def rt(redis_url, job, monkeypatch):
    monkeypatch.setenv("MEMSEM_NODE_ID", "con-b")
    monkeypatch.setenv("MEMSEM_JOB_SECRET", SECRET)
    monkeypatch.setenv("MEMSEM_HEARTBEAT_TTL", "2")
    r = memsem.Runtime(directory=redis_url, job=job, engines=ENGINES, timeout=10)
    yield r
    r.close()


@pytest.fixture
def owner(redis_url, job):
    o = Owner(redis_url, job, env=SHORT)
    yield o
    o.close()


def _ref(rt, hexref: str) -> memsem.TensorRef:
    return rt.ref(bytes.fromhex(hexref))


def _stats(owner) -> dict:
    return owner("tcp_stats")["tcp"]


def _until(owner, key: str | tuple[str, ...], at_least: int, timeout: float = 30) -> dict:
    """The owner's counters once ``key`` (or the sum of ``key``s) reached ``at_least`` (a
    bounded wait for an event)."""
    keys = (key,) if isinstance(key, str) else key
    deadline = time.monotonic() + timeout
    while True:
        st = _stats(owner)
        if sum(st.get(k, 0) for k in keys) >= at_least or time.monotonic() >= deadline:
            return st
        time.sleep(0.05)


# -- 1. before authentication, and every phase of a request -----------------------------------------
PHASES = {
    # phase: (what the peer sends, then stalls; the bound that must close it)
    "nothing": ("", "grace"),
    "half-hello": ("half-hello", "grace"),
    "hello-only": ("hello", "grace"),
    "half-header-before-auth": ("hello+half-header", "grace"),
    "open-half-body-before-auth": ("hello+open-half-body", "grace"),
    "authed-half-header": ("auth+half-header", "stall"),
    "authed-open-half-body": ("auth+open-half-body", "stall"),
    "authed-put-half-payload": ("auth+put-half-payload", "stall"),
    "authed-idle": ("auth", "idle"),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_stall_at_any_byte_is_closed_by_its_bound(owner, rt, phase):
    what, bound = PHASES[phase]
    w = _ref(rt, owner("publish", name="w", n=64 * 1024)["ref"])
    ep = R.endpoint_of(rt, w)
    before = _stats(owner)
    s, nonce = R.connect(ep, hello=False)
    body = R.open_body(w.spec, nonce, 1)
    if what.startswith("auth"):
        s.sendall(W.CHELLO.pack(W.MAGIC, W.PROTOCOL, W.KIND_DATA))
        assert R.open_handle(s, nonce, w.spec)[0][0] == W.OK
    if what == "half-hello":
        s.sendall(W.CHELLO.pack(W.MAGIC, W.PROTOCOL, W.KIND_DATA)[:3])
    elif what.startswith("hello"):
        s.sendall(W.CHELLO.pack(W.MAGIC, W.PROTOCOL, W.KIND_DATA))
    if what.endswith("half-header"):
        s.sendall(W.REQ.pack(W.OP_GET, 0, 1, 2, 0, 64, 0, 0)[:17])
    elif what.endswith("open-half-body"):
        s.sendall(W.REQ.pack(W.OP_OPEN, 0, 2, 2, 0, len(body), 0, 0) + body[:len(body) // 2])
    elif what.endswith("put-half-payload"):
        s.sendall(W.REQ.pack(W.OP_PUT, 0, 1, 2, 0, 32 * 1024, 0, 0) + b"\x01" * (16 * 1024))
    assert R.closed_by_peer(s), f"the owner kept a connection stalled at phase {phase!r}"
    s.close()
    after = _until(owner, f"closed_{bound}", before.get(f"closed_{bound}", 0) + 1)
    assert after.get(f"closed_{bound}", 0) == before.get(f"closed_{bound}", 0) + 1, (phase, before, after)
    assert (w.get()[:4] == np.arange(4)).all()  # honest gets go on


def test_the_stall_bound_counts_from_a_requests_first_byte(owner, rt):
    """On a connection older than ``stall_s``, a request whose header arrives whole and whose
    body follows a little later is served: the body's bound counts from the request's first
    byte, not from an older moment (the header of an earlier request, the accept)."""
    w = _ref(rt, owner("publish", name="w", n=1024)["ref"])
    ep = R.endpoint_of(rt, w)
    before = _stats(owner)
    s, nonce = R.connect(ep)
    try:
        assert R.open_handle(s, nonce, w.spec)[0][0] == W.OK
        time.sleep(1.5)  # the connection is older than stall_s (1 s) now, and not idle yet (3 s)
        body = R.open_body(w.spec, nonce, 2)
        s.sendall(W.REQ.pack(W.OP_OPEN, 0, 2, 2, 0, len(body), 0, 0))  # the header, whole
        time.sleep(0.3)  # well inside stall_s from this request's first byte
        s.sendall(body)
        s.settimeout(30)
        head, _ = R.reply(s)
        assert head[0] == W.OK and head[3] == 2, head
    finally:
        s.close()
    assert _stats(owner).get("closed_stall", 0) == before.get("closed_stall", 0)


def test_an_idle_connection_closed_by_the_owner_is_made_again(owner, rt):
    w = _ref(rt, owner("publish", name="w", n=1024)["ref"])
    assert (w.get()[:2] == [0, 1]).all()
    before = _stats(owner).get("closed_idle", 0)
    _until(owner, "closed_idle", before + 1)  # the consumer's own connection, after idle_s
    assert _stats(owner).get("closed_idle", 0) == before + 1
    for _ in range(3):  # the next requests reconnect, transparently
        assert (w.get()[:2] == [0, 1]).all()


def test_thousands_of_stalled_and_unauthenticated_connections_lock_nobody_out(redis_url, job, rt):
    """2,000 connections that connect and stall (half before the hello, half after it): honest
    gets keep working, the owner's RSS stays within 32 MiB of its start, its threads constant."""
    R.raise_nofile(2300)
    o = Owner(redis_url, job)  # default bounds: the flood is answered by its caps, not by time
    try:
        w = _ref(rt, o("publish", name="w", n=4096)["ref"])
        ep = R.endpoint_of(rt, w)
        assert (w.get()[:2] == [0, 1]).all()
        rss0 = o("rss")["rss"]
        threads0 = o("tcp_stats")["os_threads"]
        host, port = W.split_endpoint(ep)
        flood = []
        try:
            for i in range(2000):
                s = socket.create_connection((host, port), timeout=20)
                if i % 2:
                    s.sendall(W.CHELLO.pack(W.MAGIC, W.PROTOCOL, W.KIND_DATA))
                flood.append(s)
                if i % 500 == 499:
                    assert (w.get()[:2] == [0, 1]).all()
            for _ in range(5):
                out = np.empty(4096, np.int64)
                w.get(out=out)
                assert (out == np.arange(4096)).all()
            # a new consumer connection (another runtime's) authenticates in the middle of the flood
            with memsem.Runtime(directory=redis_url, job=job, engines=ENGINES, timeout=10) as rt2:
                assert (_ref(rt2, w.to_bytes().hex()).get()[:2] == [0, 1]).all()
            st = o("tcp_stats")
            rss1 = o("rss")["rss"]
        finally:
            for s in flood:
                s.close()
        print(f"\n2,000 stalled connections: owner RSS {rss0 / MiB:.1f} -> {rss1 / MiB:.1f} MiB, threads "
              f"{threads0} -> {st['os_threads']}, server {st['tcp']}")
        assert rss1 - rss0 <= 32 * MiB, (rss0, rss1)
        assert st["os_threads"] <= threads0 + 1, (threads0, st)
        assert st["tcp"]["closed_preauth_evicted"] >= 2000 - 2 * W.Bounds().max_preauth, st
    finally:
        o.close()


def test_the_connection_cap_answers_with_an_error_naming_the_owner_and_the_cap(redis_url, job, rt):
    o = Owner(redis_url, job, env={"MEMSEM_TCP_MAX_CONNECTIONS": "6", "MEMSEM_TCP_MAX_PREAUTH": "6"})
    try:
        w = _ref(rt, o("publish", name="w", n=1024)["ref"])
        ep = R.endpoint_of(rt, w)
        held = []
        for _ in range(6):  # six authenticated connections: the cap
            s, nonce = R.connect(ep)
            assert R.open_handle(s, nonce, w.spec)[0][0] == W.OK
            held.append(s)
        with memsem.Runtime(directory=redis_url, job=job, engines=ENGINES, timeout=10) as rt2:
            with pytest.raises(memsem.EngineError, match=r"maximum of 6 connections") as ei:
                _ref(rt2, w.to_bytes().hex()).get()
            assert f"pid {o.pid}" in str(ei.value) and not isinstance(ei.value, memsem.PeerLostError)
            host, port = W.split_endpoint(ep)
            raw = socket.create_connection((host, port), timeout=20)
            magic, _, status, info = W.HELLO.unpack(R.recv_exact(raw, W.HELLO.size))
            assert status == W.HELLO_FULL and W.FULL_INFO.unpack(info)[0] == 6
            raw.close()
            held.pop().close()
            r2 = _ref(rt2, w.to_bytes().hex())
            deadline = time.monotonic() + 30
            while True:  # the owner notices the closed connection, then admits the next
                try:
                    assert (r2.get()[:2] == [0, 1]).all()
                    break
                except memsem.EngineError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        assert o("tcp_stats")["tcp"]["full"] >= 2
    finally:
        for s in held:
            s.close()
        o.close()


def test_unauthenticated_connections_at_the_cap_make_room_for_a_consumer(redis_url, job, rt):
    o = Owner(redis_url, job, env={"MEMSEM_TCP_MAX_CONNECTIONS": "6", "MEMSEM_TCP_MAX_PREAUTH": "6"})
    try:
        w = _ref(rt, o("publish", name="w", n=1024)["ref"])
        ep = R.endpoint_of(rt, w)
        rt.resolver.drop(w.spec.gva)
        idle = [R.connect(ep)[0] for _ in range(6)]  # six that never authenticate: the cap
        assert (w.get()[:2] == [0, 1]).all()  # the oldest is closed for it, saying why
        head, text = R.reply(idle[0])
        assert head[0] == W.FULL and b"waiting to authenticate" in text
        assert R.closed_by_peer(idle[0])
        assert o("tcp_stats")["tcp"]["closed_preauth_evicted"] == 1
        for s in idle:
            s.close()
    finally:
        o.close()


# -- 2. the send side: no copy bracket waits for a peer ----------------------------------------------
@pytest.mark.parametrize("how", ["never-reads", "reads-a-little", "put-stalls"])
def test_a_peer_that_stops_never_blocks_unpublish(owner, rt, how):
    n = 16 * MiB
    w = _ref(rt, owner("publish", name="w", n=n // 8)["ref"])
    ep = R.endpoint_of(rt, w)
    before = _stats(owner)
    s, nonce = R.connect(ep)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    assert R.open_handle(s, nonce, w.spec)[0][0] == W.OK
    if how == "put-stalls":
        s.sendall(W.REQ.pack(W.OP_PUT, 0, 1, 2, 0, n, 0, 0) + b"\x07" * MiB)
    else:
        s.sendall(W.REQ.pack(W.OP_GET, 0, 1, 2, 0, n, 0, 1000))
        if how == "reads-a-little":
            R.recv_exact(s, 256 * 1024)
    time.sleep(0.2)  # let the owner start (not a bound: the outcome below holds whenever)
    owner("unpublish", name="w", timeout=5.0)  # raises in the owner (the test fails) if blocked
    bound = "stall" if how == "put-stalls" else "send"
    after = _until(owner, f"closed_{bound}", before.get(f"closed_{bound}", 0) + 1)
    assert after.get(f"closed_{bound}", 0) == before.get(f"closed_{bound}", 0) + 1, (before, after)
    s.close()
    with pytest.raises(memsem.StaleReferenceError):
        w.get()


# -- 3. waits a client asks for ------------------------------------------------------------------------
def test_a_49_day_wait_is_capped_and_a_disconnect_while_waiting_is_noticed(owner, rt, redis_url, job):
    w = _ref(rt, owner("publish", name="w", n=1024)["ref"])
    ep = R.endpoint_of(rt, w)
    owner("hold_section", name="w")
    try:
        base = _stats(owner)
        s, nonce = R.connect(ep)
        assert R.open_handle(s, nonce, w.spec)[0][0] == W.OK
        for version in (0, 2):  # the latest, and the version the section is writing
            s.sendall(W.REQ.pack(W.OP_GET, 0, 1, 2, 0, 64, version, 0xFFFFFFFF))
            head, _ = R.reply(s)
            assert head[0] == W.OUTCOME and head[1] == _lib.MEMSEM_RC_BUSY, head  # after max_wait_s
        s.sendall(W.REQ.pack(W.OP_PUT, 0, 1, 3, 0, 8, 0, 0xFFFFFFFF) + b"\x00" * 8)
        head, _ = R.reply(s)
        assert head[0] == W.OUTCOME and head[1] == _lib.MEMSEM_RC_BUSY, head
        s.sendall(W.REQ.pack(W.OP_GET, 0, 1, 4, 0, 64, (1 << 64) - 1, 0xFFFFFFFF))
        head, _ = R.reply(s)  # refused at once: no version that large exists
        assert head[0] == W.OUTCOME and head[1] in (_lib.MEMSEM_RC_VERSION_RANGE, _lib.MEMSEM_RC_BUSY), head
        s.close()
        # (the owner sees that close in its own time: counted before the next part begins)
        _until(owner, "closed_peer_closed", base.get("closed_peer_closed", 0) + 1)
        # parked, then gone: the owner notices the disconnect while it waits
        before = _stats(owner)
        s, nonce = R.connect(ep)
        assert R.open_handle(s, nonce, w.spec)[0][0] == W.OK
        s.sendall(W.REQ.pack(W.OP_GET, 0, 1, 2, 0, 64, 0, 0xFFFFFFFF))
        st = _until(owner, "parked", before.get("parked", 0) + 1)
        assert st["parked"] > before.get("parked", 0)
        s.close()
        st = _until(owner, "closed_peer_closed", before.get("closed_peer_closed", 0) + 1)
        assert st["closed_peer_closed"] == before.get("closed_peer_closed", 0) + 1
        assert st["connections"] == before["connections"], (before, st)
        with memsem.Runtime(directory=redis_url, job=job, engines=ENGINES, timeout=2.5) as rt2:
            with pytest.raises(memsem.MemsemTimeoutError, match="write section"):
                _ref(rt2, w.to_bytes().hex()).get()  # the owner's waits capped, the consumer's timeout
    finally:
        owner("release_section")
    assert (w.get()[:2] == [0, 1]).all()  # the parked wait of a consumer ends with the section


def test_a_parked_request_is_answered_when_the_section_commits(redis_url, job, rt):
    o = Owner(redis_url, job, env={"MEMSEM_TCP_MAX_WAIT_S": "60"})
    try:
        w = _ref(rt, o("publish", name="w", n=1024)["ref"])
        o("hold_section", name="w")
        got: list = []
        t = threading.Thread(target=lambda: got.append(w.get()))
        t.start()
        before = o("tcp_stats")["tcp"].get("parked", 0)
        deadline = time.monotonic() + 30
        while o("tcp_stats")["tcp"].get("parked", 0) == before and time.monotonic() < deadline:
            time.sleep(0.02)
        o("release_section")
        t.join(30)
        assert not t.is_alive() and len(got) == 1 and (got[0][:2] == [0, 1]).all()
    finally:
        o.close()


# -- 4. server state tied to sessions ------------------------------------------------------------------
def test_500_live_windows_three_rounds_never_stale(owner, rt):
    refs = [_ref(rt, h) for h in owner("publish_many", n=500)["refs"]]
    for _ in range(3):
        for i, r in enumerate(refs):
            assert int(r.get()[0]) == i
    assert rt.stats().as_dict()["errors"].get("stale", 0) == 0


def test_10000_owner_minted_sub_ranges_from_one_thread(owner, rt):
    n = 10_000
    owner("publish", name="w", n=n)
    refs = [_ref(rt, h) for h in owner("bytes_many", name="w", n=n, nbytes=8, timeout=120)["refs"]]
    assert len({r.spec.mint for r in refs}) == n
    for i, r in enumerate(refs):
        assert int(r.get().view(np.int64)[0]) == i
    eng = rt.engine("tcp")
    conns = [c for c in list(eng._conns) if not c.closed]
    assert conns and all(len(c.handles) <= W.CLIENT_HANDLES for c in conns)


# -- 5. nothing about a window before the proof ----------------------------------------------------------
def test_a_refused_proof_says_nothing_about_the_window(owner, rt):
    w = _ref(rt, owner("publish", name="w", n=1024)["ref"])
    ep = R.endpoint_of(rt, w)
    spec = w.spec
    import dataclasses

    tok = credential_token(spec)
    stale_tok = credential_token(dataclasses.replace(spec, generation=spec.generation + 7))
    unowned_tok = credential_token(dataclasses.replace(spec, gva=spec.gva + (1 << 40)))
    answers = []
    for token in (tok, stale_tok, unowned_tok, b"\x00" * len(tok)):
        s, nonce = R.connect(ep)
        head, text = R.open_handle(s, nonce, spec, token=token, proof=secrets.token_bytes(16))
        answers.append((head, text))
        assert R.closed_by_peer(s)
        s.close()
    assert all(a == answers[0] for a in answers), answers  # one refusal, whatever was wrong
    head, text = answers[0]
    assert head[0] == W.DENIED and head[4] == 0 and b"credential refused" in text
    assert str(spec.generation).encode() not in text.replace(b"gva", b"")
    assert (w.get()[:2] == [0, 1]).all()


def test_ready_marks_are_bounded_by_the_minted_range(owner, rt):
    tb = 8192
    owner("publish", name="w", n=8 * tb // 8, tile_bytes=tb)
    tile2 = _ref(rt, owner("bytes", name="w", offset=2 * tb, nbytes=tb)["ref"])
    tile2.mark_ready(2)
    whole = _ref(rt, owner("bytes", name="w", offset=0, nbytes=8 * tb)["ref"])
    whole.wait_tile(2, timeout=20)
    for tile, fn in ((7, tile2.mark_ready), (5, lambda t: rt.readiness.clear(tile2.spec, t)), (3, tile2.mark_ready)):
        with pytest.raises(memsem.AccessDeniedError, match="minted for bytes"):
            fn(tile)
    assert owner("ready_words", name="w")["words"][7] == 0
    whole.mark_ready(7)
    whole.wait_tile(7, timeout=20)


# -- 6. every failure that leaves the engine is a memsem error ------------------------------------------
@pytest.mark.parametrize("reconnecting", [False, True])
def test_an_owner_killed_under_load_is_peer_lost(redis_url, job, rt, reconnecting):
    """Threads getting 4 MiB in a loop (``reconnecting``: the owner closes idle connections
    after 0.2 s and the threads pause between gets, so some are connecting again when it dies);
    the owner holds 12,000 files (its death takes longer) and is killed: every failure is
    PeerLostError."""
    R.raise_nofile(13000)
    env = {"MEMSEM_TCP_IDLE_S": "0.2"} if reconnecting else {}
    o = Owner(redis_url, job, env=env)
    errors: list[BaseException] = []
    stop = threading.Event()
    try:
        w = _ref(rt, o("publish", name="w", n=(4 * MiB) // 8)["ref"])
        assert o("hold_fds", n=12000)["held"] > 1000
        started = threading.Barrier(4)

        def loop() -> None:
            out = np.empty((4 * MiB) // 8, np.int64)
            started.wait(30)
            while not stop.is_set():
                try:
                    w.get(out=out)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return
                if reconnecting:
                    time.sleep(0.25)

        ts = [threading.Thread(target=loop) for _ in range(3)]
        for t in ts:
            t.start()
        started.wait(30)
        time.sleep(0.5)
        os.kill(o.pid, signal.SIGKILL)
        o.p.wait(10)
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts)
    finally:
        stop.set()
        o.close()
    assert len(errors) == 3, errors
    assert all(isinstance(e, memsem.PeerLostError) for e in errors), [repr(e) for e in errors]


# -- across namespaces: a slow link, and a link taken down mid-transfer ---------------------------------
_CONSUMER = r"""
import json, sys, numpy as np, memsem
rt = memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=float(sys.argv[1]))
ref = rt.ref(bytes.fromhex(sys.stdin.readline().strip()))
out = np.empty(ref.spec.nbytes, np.uint8)
for round in range(int(sys.argv[2])):
    print(json.dumps({"started": round}), flush=True)
    try:
        ref.get(out=out)
    except memsem.MemsemError as exc:
        print(json.dumps({"error": type(exc).__name__, "msg": str(exc)[:300]}), flush=True)
        break
    print(json.dumps({"done": round, "sum": int(out.view(np.int64).sum())}), flush=True)
rt.close()
"""


@pytest.mark.netns
def test_a_slow_link_is_served_and_a_partition_never_blocks_unpublish(netns_available):
    """Owner and consumer on a bridge; the owner's egress is rate-limited (tc tbf): a 16 MiB get
    that takes seconds makes progress within the send bound and arrives whole. Then the
    consumer's bridge port is detached in the middle of the next get (a silent partition:
    both links stay up, nothing arrives): the owner unpublishes the window at once (no copy
    bracket waits for the peer), TCP_USER_TIMEOUT ends the owner's connection, and the
    consumer's get ends in a memsem error."""
    import json
    import subprocess
    import sys

    import netns
    from lines import reader

    with netns.star(2) as (a, b):
        _, _, pid, k = a.name.split("-")
        hub = f"{netns.PREFIX}-h-{pid}-{k}"  # the bridge's namespace (netns.star)
        a.run(["tc", "qdisc", "add", "dev", "veth0", "root", "tbf", "rate", "40mbit", "burst", "64kb",
               "latency", "500ms"])
        job = f"tcpp{os.getpid()}{secrets.token_hex(3)}"
        o = Owner("local", job, ns=a, env={"MEMSEM_TCP_HOST": a.addr, "MEMSEM_TCP_SEND_S": "2",
                                             "MEMSEM_TCP_USER_TIMEOUT_S": "2"})
        c = None
        try:
            n = 16 * MiB
            hexref = o("publish", name="w", n=n // 8)["ref"]
            env = dict(os.environ, MEMSEM_NODE_ID="con-b", MEMSEM_DIRECTORY="local", MEMSEM_JOB=job,
                       MEMSEM_JOB_SECRET=SECRET, MEMSEM_TCP_USER_TIMEOUT_S="2",
                       PYTHONPATH=os.pathsep.join(sys.path))
            c = b.popen([sys.executable, "-c", _CONSUMER, "10", "2"], env=env, stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
            c.stdin.write(hexref + "\n")
            c.stdin.flush()
            lines = reader(c)
            t0 = time.monotonic()

            def line() -> dict:
                got = lines.readline(90)
                assert got, f"consumer silent or gone (rc {c.poll()})"
                print(f"[{time.monotonic() - t0:.1f} s] consumer: {got.strip()}")
                return json.loads(got)

            assert line() == {"started": 0}
            first = line()
            assert first.get("done") == 0 and first["sum"] == (n // 8) * (n // 8 - 1) // 2, first
            before = o("tcp_stats")["tcp"]
            assert before.get("closed_send", 0) == 0, before  # slow, but never stalled past the bound
            assert line() == {"started": 1}
            time.sleep(1.0)  # mid-transfer at this rate (the outcome below holds whenever it lands)
            subprocess.run(["ip", "-n", hub, "link", "set", "p1", "nomaster"], check=True, timeout=20)
            o("unpublish", name="w", timeout=5.0)  # fails the test (in the owner) if anything held it
            print(f"[{time.monotonic() - t0:.1f} s] owner: unpublished")
            keys = ("closed_peer_closed", "closed_send")
            st = _until(o, keys, sum(before.get(k, 0) for k in keys) + 1, timeout=60)
            assert sum(st.get(k, 0) - before.get(k, 0) for k in keys) == 1, (before, st)
            print(f"[{time.monotonic() - t0:.1f} s] owner: connection closed {st}")
            end = line()
            assert end.get("error") in ("PeerLostError", "MemsemTimeoutError"), end
        finally:
            if c is not None:
                try:
                    c.wait(30)  # the consumer closes its runtime after its last line
                except subprocess.TimeoutExpired:
                    c.kill()
                    c.wait(10)
            o.close()
            from memsem.testing.plugin import _remove_job_dir

            _remove_job_dir(job)  # a consumer killed above leaves its rank record
