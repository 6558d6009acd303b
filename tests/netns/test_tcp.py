"""The tcp engine and remote ready words on one machine, with two node ids (no namespaces needed).

An owner process (``_owner.py``, node "own-a") publishes windows; this test process is the
consumer (node "con-b"): different node ids forbid shared memory and cross-memory attach, so
every route is tcp. The directory is a real redis-server on loopback.

What the owner must refuse is tested with the protocol itself (raw sockets): a PUT of 512 MiB
on a handle that was never opened (the owner's RSS must not grow: nothing is read), bodies
over their bounds, a proof replayed on another connection, refs edited to widen their range or
add write access; and a recording proxy shows the access key never crosses the wire.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import threading
import time

import numpy as np
import pytest

import memsem
from memsem.core import WireRoute
from memsem.engines.tcp import _wire as W
import tcp_raw as R
from lines import reader
from owner_proc import SECRET, Owner
from redis_server import redis_server

ENGINES = ("loopback", "host", "tcp")
MiB = 1 << 20


@pytest.fixture(scope="module")
def redis_url(redis_binary):
    with redis_server(binary=redis_binary) as srv:
        yield srv.url


@pytest.fixture
def job():
    return f"tcp{os.getpid()}{secrets.token_hex(3)}"


@pytest.fixture
def owner(redis_url, job):
    o = Owner(redis_url, job)
    yield o
    o.close()


@pytest.fixture
def rt(redis_url, job, monkeypatch):
    monkeypatch.setenv("MEMSEM_NODE_ID", "con-b")
    monkeypatch.setenv("MEMSEM_JOB_SECRET", SECRET)
    monkeypatch.setenv("MEMSEM_HEARTBEAT_TTL", "2")
    r = memsem.Runtime(directory=redis_url, job=job, engines=ENGINES, timeout=10)
    yield r
    r.close()


def _ref(rt, hexref: str) -> memsem.TensorRef:
    return rt.ref(bytes.fromhex(hexref))


# -- data ----------------------------------------------------------------------------------------------
def test_get_put_small_and_pipelined_large(owner, rt):
    w = _ref(rt, owner("publish", name="w", n=(12 * MiB) // 8 + 3)["ref"])  # not a multiple of a chunk
    assert rt.route(w).kind == "tcp"
    n = w.shape[0]
    a = w.get()
    assert (a == np.arange(n)).all()
    small = w.bytes(8, 64)  # a consumer's sub-range keeps the mint it was cut from
    assert (small.get().view(np.int64) == np.arange(1, 9)).all()
    assert (w.tile(2, 4096).get().view(np.int64) == np.arange(1024, 1536)).all()
    w.put(a[::-1].copy())
    assert owner("read", name="w")["head"][:2] == [n - 1, n - 2]
    small.put(np.arange(100, 108, dtype=np.int64).view(np.uint8))
    assert owner("read", name="w")["head"][:3] == [n - 1, 100, 101]
    out = np.empty(n, np.int64)
    batch = rt.xcopy([(w, out)])
    batch.wait(30)
    assert out[1] == 100 and out[-1] == 0


def test_bytes_an_owner_counts_as_served_are_the_bytes_that_moved(owner, rt):
    """The owner sends a GET straight from the window, one non-blocking send per bracket: a
    send the socket takes only in part (always, for 32 MiB pipelined in 1 MiB chunks) counts
    what it moved, so the owner's served bytes equal what the consumer loaded."""
    n = 32 * MiB
    w = _ref(rt, owner("publish", name="big", n=n // 8)["ref"])
    before = owner("stats")["stats"]["bytes_by_route"].get("loopback", 0)
    for _ in range(3):
        assert w.get()[-1] == n // 8 - 1
    served = owner("stats")["stats"]["bytes_by_route"].get("loopback", 0) - before
    assert served == rt.stats().bytes_by_route["tcp"] == 3 * n


def test_owner_minted_sub_range_is_all_a_consumer_gets(owner, rt):
    owner("publish", name="w", n=1024)
    narrow = _ref(rt, owner("bytes", name="w", offset=64, nbytes=16)["ref"])
    assert narrow.spec.mint.offset == 64 and narrow.spec.mint.nbytes == 16
    assert (narrow.get().view(np.int64) == [8, 9]).all()
    s = narrow.spec
    with pytest.raises(ValueError, match="outside its minted range"):  # a consistent ref never claims more
        dataclasses.replace(s, nbytes=32, shape=(32,))
    # Edit the wire form: the ref's range and its mint together, 0..8192 (the whole window).
    wide = dataclasses.replace(s, offset=0, nbytes=8192, shape=(8192,),
                               mint=dataclasses.replace(s.mint, offset=0, nbytes=8192))
    with pytest.raises(memsem.AccessDeniedError, match="altered"):
        rt.ref(wide.to_bytes()).get()
    assert (narrow.get().view(np.int64) == [8, 9]).all()  # the genuine one still works


def test_write_access_cannot_be_added_to_a_ref(owner, rt):
    ro = _ref(rt, owner("publish", name="ro", n=64, access="r")["ref"])
    assert ro.access == "r" and ro.spec.mint.access == "r"
    s = ro.spec
    with pytest.raises(ValueError, match="wider than its minted access"):
        dataclasses.replace(s, access="rw")
    forged = dataclasses.replace(s, access="rw", mint=dataclasses.replace(s.mint, access="rw"))
    with pytest.raises(memsem.AccessDeniedError):
        rt.ref(forged.to_bytes()).put(np.zeros(64, np.int64))
    no_mint = dataclasses.replace(s, mint=None)
    with pytest.raises(memsem.AccessDeniedError, match="no mint"):
        rt.ref(no_mint.to_bytes()).get()
    assert owner("read", name="ro")["head"][:3] == [0, 1, 2]


def test_stale_after_unpublish_and_republish(owner, rt):
    w = _ref(rt, owner("publish", name="w", n=4096)["ref"])
    w.get()
    owner("republish", name="w")
    with pytest.raises(memsem.StaleReferenceError):
        w.get()
    with pytest.raises(memsem.StaleReferenceError):
        w.put(np.zeros(4096, np.int64))
    w2 = rt.lookup("w")  # the directory's whole-window mint, sealed for the job secret
    assert w2.spec.mint is not None and (w2.get()[:3] == [0, 1, 2]).all()


def test_versions_across_nodes_never_torn(owner, rt):
    """The owner rewrites the window in write sections as fast as it can; every get returns the
    bytes of exactly one version (every element equal) and says which."""
    n = (2 * MiB) // 8
    w = _ref(rt, owner("publish", name="w", n=n, kind="zeros")["ref"])
    owner("writer", name="w", seconds=3.0)
    out = np.empty(n, np.int64)
    versions = []
    for _ in range(40):
        v = rt.transfer(w.spec, "get", 0, out.view(np.uint8))
        assert (out == out[0]).all(), "torn read returned as valid"
        versions.append((v, int(out[0])))
    sections = owner("writer_stop")["sections"]
    assert sections > 0
    assert all(v >= 1 for v, _ in versions) and versions == sorted(versions)
    for v, value in versions:  # section k writes value k and commits version k + 1
        assert value == v - 1, versions
    # a version wait through the one runtime function, across nodes
    from memsem.gva._control_block import W_LATEST

    latest = owner("write", name="w", value=-5)["version"]
    got = rt.readiness.wait_word(w.spec, W_LATEST, lambda x: x >= latest, timeout=20)
    assert got >= latest and (w.get() == -5).all()


# -- at the door ---------------------------------------------------------------------------------------
_connect, _recv, _closed_by_peer, _open_body, _endpoint = R.connect, R.recv_exact, R.closed_by_peer, R.open_body, \
    R.endpoint_of


def test_oversize_put_on_an_unopened_handle_is_not_read(owner, rt):
    w = _ref(rt, owner("publish", name="w", n=1024)["ref"])
    ep = _endpoint(rt, w)
    before = owner("rss")["rss"]
    s, _ = _connect(ep)
    s.sendall(W.REQ.pack(W.OP_PUT, 0, 7, 1, 0, 512 * MiB, 0, 0))
    junk = b"\xaa" * MiB
    sent = 0
    try:
        s.settimeout(20)
        while sent < 512 * MiB:
            s.sendall(junk)
            sent += len(junk)
    except OSError:
        pass
    after = owner("rss")["rss"]
    s.close()
    assert sent < 512 * MiB, "the owner kept reading a payload it had refused"
    assert after - before < 32 * MiB, (before, after)
    assert (w.get()[:4] == np.arange(4)).all()  # the owner serves on


def test_put_refused_by_range_or_access_closes_without_reading(owner, rt):
    ro = _ref(rt, owner("publish", name="ro", n=1024, access="r")["ref"])
    s, nonce = _connect(_endpoint(rt, ro))
    body = _open_body(ro.spec, nonce, 1)
    s.sendall(W.REQ.pack(W.OP_OPEN, 0, 1, 1, 0, len(body), 0, 0) + body)
    st = W.REP.unpack(_recv(s, W.REP.size))
    assert st[0] == W.OK, st
    s.sendall(W.REQ.pack(W.OP_PUT, 0, 1, 2, 0, 8192, 0, 0))  # read-only: refused before the payload
    st = W.REP.unpack(_recv(s, W.REP.size))
    assert st[0] == W.DENIED
    _recv(s, st[5])
    assert _closed_by_peer(s)
    s.close()
    w = _ref(rt, owner("publish", name="w", n=1024)["ref"])
    s, nonce = _connect(_endpoint(rt, w))
    body = _open_body(w.spec, nonce, 1)
    s.sendall(W.REQ.pack(W.OP_OPEN, 0, 1, 1, 0, len(body), 0, 0) + body)
    assert W.REP.unpack(_recv(s, W.REP.size))[0] == W.OK
    s.sendall(W.REQ.pack(W.OP_PUT, 0, 1, 2, 4096, 8192, 0, 0))  # past the minted range
    st = W.REP.unpack(_recv(s, W.REP.size))
    assert st[0] == W.DENIED
    _recv(s, st[5])
    assert _closed_by_peer(s)
    s.close()
    assert owner("read", name="w")["head"][:2] == [0, 1]


@pytest.mark.parametrize("what", ["open-body", "hello", "op", "watch-on-data", "sync-on-data"])
def test_malformed_requests_close_the_connection(owner, rt, what):
    w = _ref(rt, owner("publish", name="w", n=64)["ref"])
    ep = _endpoint(rt, w)
    if what == "hello":
        host, port = W.split_endpoint(ep)
        s = socket.create_connection((host, port), timeout=20)
        _recv(s, W.HELLO.size)
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    else:
        s, _ = _connect(ep)
        if what == "open-body":
            s.sendall(W.REQ.pack(W.OP_OPEN, 0, 1, 1, 0, 1 << 30, 0, 0))
        elif what == "op":
            s.sendall(W.REQ.pack(200, 0, 1, 1, 0, 0, 0, 0))
        elif what == "sync-on-data":
            s.sendall(W.REQ.pack(W.OP_SYNC, 0, 1, 1, 0, 0, 0, 0))
        else:
            s.sendall(W.REQ.pack(W.OP_WATCH, 0, 1, 1, 0, 12, 0, 0))
    assert _closed_by_peer(s)
    s.close()
    assert (w.get()[:2] == [0, 1]).all()


def test_a_proof_replayed_on_another_connection_is_refused(owner, rt):
    w = _ref(rt, owner("publish", name="w", n=64)["ref"])
    ep = _endpoint(rt, w)
    s1, nonce1 = _connect(ep)
    body = _open_body(w.spec, nonce1, 1)
    s1.sendall(W.REQ.pack(W.OP_OPEN, 0, 1, 1, 0, len(body), 0, 0) + body)
    assert W.REP.unpack(_recv(s1, W.REP.size))[0] == W.OK
    s1.sendall(W.REQ.pack(W.OP_GET, 0, 1, 2, 0, 16, 0, 1000))
    assert W.REP.unpack(_recv(s1, W.REP.size))[0] == W.DATA
    # What a sniffer saw on connection 1, sent again on connection 2:
    s2, nonce2 = _connect(ep)
    assert nonce2 != nonce1
    s2.sendall(W.REQ.pack(W.OP_OPEN, 0, 1, 1, 0, len(body), 0, 0) + body)
    st = W.REP.unpack(_recv(s2, W.REP.size))
    assert st[0] == W.DENIED
    assert "proof" in _recv(s2, st[5]).decode()
    assert _closed_by_peer(s2)
    s1.close()
    s2.close()


class _Recorder:
    """A TCP proxy that records every byte in both directions."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.addr = self.ls.getsockname()
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.threads = []
        self.socks = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            self.socks += [c, u]
            for a, b in ((c, u), (u, c)):
                t = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                t.start()
                self.threads.append(t)

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                d = a.recv(1 << 16)
                if not d:
                    break
                with self.lock:
                    self.seen += d
                b.sendall(d)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.ls.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass
        for t in self.threads:
            t.join(5)


def test_the_access_key_never_crosses_the_wire(owner, rt, monkeypatch, redis_url, job):
    hexref = owner("publish", name="w", n=4096, tile_bytes=8192)["ref"]
    probe = _ref(rt, hexref)
    real = W.split_endpoint(_endpoint(rt, probe))
    rt.resolver.drop(probe.spec.gva)
    rec = _Recorder(real)
    try:
        monkeypatch.setattr(W, "split_endpoint", lambda ep: rec.addr)
        with memsem.Runtime(directory=redis_url, job=job, engines=ENGINES, timeout=10) as rt2:
            w = _ref(rt2, hexref)
            w.get()
            w.put(np.arange(4096, dtype=np.int64))
            owner("mark", name="w", tiles=[0, 2])
            w.wait_tile(2, timeout=20)
            assert w.ready_tiles()[:2] == [0, 2]
        key = w.spec.key
        with rec.lock:
            seen = bytes(rec.seen)
        assert len(seen) > 4096 * 8  # the traffic was recorded (data went through the proxy)
        assert key not in seen and key.hex().encode() not in seen
    finally:
        rec.close()


# -- ready words across nodes ----------------------------------------------------------------------------
def test_remote_ready_words(owner, rt):
    w = _ref(rt, owner("publish", name="w", n=8 * 1024, tile_bytes=8192)["ref"])  # 8 tiles
    assert w.ready_tiles() == [] and not w.is_ready(3)
    with pytest.raises(memsem.MemsemTimeoutError, match="tile 3"):
        w.wait_tile(3, timeout=0.2)
    owner("mark", name="w", tiles=[5, 3])
    w.wait_tile(3, timeout=20)
    w.wait_tile(5, timeout=20)
    assert w.is_ready(3) and set(w.ready_tiles()) >= {3, 5}
    owner("clear", name="w", tiles=[3])
    deadline = time.monotonic() + 20
    while w.is_ready(3) and time.monotonic() < deadline:
        time.sleep(0.01)  # the clear is pushed like a mark: a snapshot shows it once it arrived
    assert not w.is_ready(3)
    # the consumer marks too (a producer on this node, the window there): checked like a put
    w.mark_ready(6)
    owner_view = _ref(rt, owner("bytes", name="w", offset=0, nbytes=8192 * 8)["ref"])
    assert owner_view.spec.gva == w.spec.gva
    w.wait_tile(6, timeout=20)
    ro = _ref(rt, owner("publish", name="ro", n=1024, access="r", tile_bytes=1024)["ref"])
    with pytest.raises(memsem.AccessDeniedError):
        ro.mark_ready(0)


@pytest.mark.parametrize("how", ["clear", "mark", "rows"])
def test_a_consumer_reads_its_own_ready_word_writes(owner, rt, how):
    """A consumer that writes a ready word at the owner (clear_ready, mark_ready, rows that
    complete a tile) reads its own write at once: never the word as it was before. The owner's
    pushes are held meanwhile (its watch hub tells no subscriber), so the consumer's mirror
    can only learn of the write by catching up itself: a clear followed by a wait that saw
    the cleared mark is how a trainer overwrote a bucket a rollout was still reading."""
    fs = memsem.FieldSet.from_bytes(bytes.fromhex(owner(
        "fields", name="batch", tile_rows=4, fields={"obs": [[16, 2], "float32"]})["set"]), rt)
    obs = fs["obs"]
    assert rt.route(obs).kind == "tcp"
    owner("put_rows", set="batch", field="obs", start=0, stop=4, value=1.0)
    obs.wait_tiles(0, 1, timeout=20)  # the mirror holds tile 0's mark (pushed)
    assert owner("hold_pushes")["held"] >= 1
    try:
        if how == "clear":
            rt.readiness.clear(obs.spec, 0)
            assert not obs.is_ready(0)
            with pytest.raises(memsem.MemsemTimeoutError, match="tile 0"):
                obs.wait_tiles(0, 1, timeout=0.2)
        elif how == "mark":
            obs.mark_rows(4, 8)
            assert obs.is_ready(1)
            obs.wait_tiles(1, 2, timeout=0.2)
        else:  # two writes of half a tile each: the second completes tile 2 at the owner
            obs.put_rows(8, np.full((2, 2), 3.0, np.float32))
            assert not obs.is_ready(2)
            obs.put_rows(10, np.full((2, 2), 4.0, np.float32))
            obs.wait_rows(8, 12, timeout=0.2)
            assert obs.get_rows(8, 12, timeout=20).tolist() == [[3.0] * 2] * 2 + [[4.0] * 2] * 2
    finally:
        owner("release_pushes")


def test_old_marks_never_satisfy_a_new_generation(owner, rt):
    old = _ref(rt, owner("publish", name="w", n=4096, tile_bytes=8192)["ref"])
    owner("mark", name="w", tiles=[0, 1, 2, 3])
    old.wait_tile(3, timeout=20)
    new = _ref(rt, owner("republish", name="w", tile_bytes=8192)["ref"])  # same control block reused
    with pytest.raises(memsem.MemsemTimeoutError):
        new.wait_tile(0, timeout=0.3)  # the old generation's marks are still in the words
    assert new.ready_tiles() == []
    # This node knows of the new generation now (it resolved it; before that, its mirror of the
    # owner's words may not have received the republish yet: a push, not a round trip).
    with pytest.raises(memsem.StaleReferenceError):
        old.wait_tile(0, timeout=20)
    owner("mark", name="w", tiles=[0])
    new.wait_tile(0, timeout=20)


def test_remote_pipeline_moves_tile_0_when_it_is_marked(owner, rt):
    """The owner marks tile i+1 only after the consumer holds tile i: a pipeline that waited
    for the whole window would wait forever (here: its timeout)."""
    n_tiles, tb = 6, 1 << 16
    w = _ref(rt, owner("publish", name="w", n=n_tiles * tb // 8, tile_bytes=tb)["ref"])
    owner("mark", name="w", tiles=[0])
    got = []
    with rt.pipeline(w, tile_bytes=tb, depth=2, wait_ready=True, timeout=30) as pipe:
        for tile in pipe:
            with tile:
                got.append(tile.index)
                arr = tile.array.view(np.int64)
                assert arr[0] == tile.index * tb // 8
            if tile.index + 1 < n_tiles:
                owner("mark", name="w", tiles=[tile.index + 1])
    assert got == list(range(n_tiles))


def test_fieldset_across_nodes_rows_out_of_order(owner, rt):
    fs = memsem.FieldSet.from_bytes(bytes.fromhex(owner(
        "fields", name="batch", tile_rows=4,
        fields={"obs": [[16, 3], "float32"], "reward": [[16], "float64"]})["set"]), rt)
    obs, reward = fs["obs"], fs["reward"]
    assert rt.route(obs).kind == "tcp"
    owner("put_rows", set="batch", field="obs", start=8, stop=12, value=2.0)
    obs.wait_rows(8, 12, timeout=20)
    assert (obs.get_rows(8, 12, timeout=20) == 2.0).all()
    with pytest.raises(memsem.MemsemTimeoutError):
        obs.wait_rows(0, 4, timeout=0.2)
    order = []

    def produce():
        for start, v in ((12, 3.0), (0, 1.0), (4, 5.0)):
            owner("put_rows", set="batch", field="obs", start=start, stop=start + 4, value=v)

    t = threading.Thread(target=produce)
    t.start()
    try:
        with obs.pipeline(timeout=30) as pipe:
            for tile in pipe:
                with tile:
                    order.append((tile.rows, float(tile.array[0, 0])))
    finally:
        t.join(60)
    assert order == [((0, 4), 1.0), ((4, 8), 5.0), ((8, 12), 2.0), ((12, 16), 3.0)]
    # the consumer writes rows of another field (remote puts, remote marks)
    reward.put_rows(0, np.arange(16, dtype=np.float64))
    done = list(fs.as_ready(["reward"], timeout=20))
    assert [f.name for f in done] == ["reward"]
    assert owner("read_field", set="batch", field="reward")["sum"] == float(sum(range(16)))


def test_owner_killed_during_a_wait_is_peer_lost(redis_url, job, rt):
    o = Owner(redis_url, job)
    try:
        w = _ref(rt, o("publish", name="w", n=4096, tile_bytes=8192)["ref"])
        assert w.ready_tiles() == []
        errors: list[BaseException] = []
        started = threading.Event()

        def wait():
            started.set()
            try:
                w.wait_tile(1, timeout=60)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        started.wait(10)
        os.kill(o.pid, signal.SIGKILL)
        o.p.wait(10)
        t.join(90)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], memsem.PeerLostError), errors
        with pytest.raises((memsem.PeerLostError, memsem.StaleReferenceError)):
            w.get()
    finally:
        o.close()


# -- an owner whose runtime prefers tcp (its own windows route through tcp too) ------------------------
_PREFER_OWNER = r"""
import sys, numpy as np, memsem
n = int(sys.argv[1])
with memsem.Runtime(engines=("loopback", "host", "tcp"), prefer="tcp", timeout=10) as rt:
    keep = [np.arange(n, dtype=np.uint8), rt.alloc(n, np.uint8)]
    keep[1][:] = np.arange(n, dtype=np.uint8)[::-1]
    print(" ".join(rt.publish(a, access="rw").to_bytes().hex() for a in keep), flush=True)
    sys.stdin.readline()
    print(int(keep[0][0]), int(keep[1][0]), flush=True)
"""


@pytest.mark.parametrize("n", [64, 3 * MiB + 5])
def test_an_owner_preferring_tcp_serves_its_windows_from_its_own_memory(n, tmp_path):
    """``prefer="tcp"`` on the owner makes its own resolution of its windows a tcp one; what
    serves other processes must still copy through the owner's own memory (it once copied
    through the route's plan, which maps nothing: the owner died of SIGSEGV on the first get)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", _PREFER_OWNER, str(n)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = reader(p).readline(120)  # bounded: an owner that hangs fails the test, never stalls it
        assert line, f"the owner did not start (rc {p.poll()})"
        hexes = line.split()
        with memsem.Runtime(engines=ENGINES, prefer="tcp", timeout=10) as rt:
            for k, h in enumerate(hexes):
                ref = _ref(rt, h)
                assert rt.route(ref).kind == "tcp"
                want = np.arange(n, dtype=np.uint8) if k == 0 else np.arange(n, dtype=np.uint8)[::-1]
                out = np.empty(n, np.uint8)
                for _ in range(3):
                    ref.get(out=out)
                    assert np.array_equal(out, want)
                ref.bytes(0, 1).put(np.array([200 + k], np.uint8))
                assert int(ref.bytes(0, 1).get()[0]) == 200 + k
        p.stdin.write("\n")
        p.stdin.flush()
        assert (reader(p).readline(60) or "").split() == ["200", "201"]  # the puts landed in the owner's memory
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_a_process_reads_its_own_window_through_tcp_when_it_prefers_tcp():
    with memsem.Runtime(engines=ENGINES, prefer="tcp", timeout=10) as rt:
        a = np.arange(2 * MiB, dtype=np.uint8)
        ref = rt.publish(a, access="rw")
        assert rt.route(ref).kind == "tcp"
        assert np.array_equal(ref.get(), a)
        ref.bytes(5, 3).put(np.array([9, 9, 9], np.uint8))
        assert a[5:8].tolist() == [9, 9, 9]


# -- the kept route: a ref's next plain small get or put is one bracket around one request ------------
def _conn(rt, ref):
    """This thread's data connection to the owner of ``ref`` (the engine's own)."""
    remote = rt.resolve(ref.spec).remote_for(ref.spec)
    return rt.engine("tcp")._local.conns[remote.endpoint], remote.credential.token


def test_the_kept_route_serves_small_gets_and_puts_each_counted(owner, rt):
    w = _ref(rt, owner("publish", name="k", n=8)["ref"])  # 64 bytes
    out = np.empty(8, np.int64)
    w.get(out=out)
    assert isinstance(w._route, WireRoute)  # kept (the whole path ran once)
    conn, _ = _conn(rt, w)
    before = rt.stats().bytes_by_route["tcp"]
    for i in range(40):
        w.put(np.full(8, i, np.int64))
        w.get(out=out)
        assert (out == i).all()
        raw = np.empty(64, np.uint8)  # raw bytes into uint8 take the kept route too
        w.get(out=raw)
        assert (raw.view(np.int64) == i).all()
    assert owner("read", name="k")["head"] == [39] * 8
    assert rt.stats().bytes_by_route["tcp"] - before == 40 * 3 * 64  # every bracket counted
    assert _conn(rt, w)[0] is conn  # one connection throughout
    assert _idle(rt, w)


def test_the_kept_route_never_reads_through_a_recycled_handle(owner, rt):
    """Handles are recycled: after the kept handle is closed, another window's OPEN takes its
    number; the kept route must notice and never return that window's bytes."""
    a = _ref(rt, owner("publish", name="ha", n=8, kind="full", value=1)["ref"])
    b = _ref(rt, owner("publish", name="hb", n=8, kind="full", value=2)["ref"])
    out = np.empty(8, np.int64)
    a.get(out=out)
    conn, token = _conn(rt, a)
    h = conn.handles[token]
    conn.forget(token)  # closed with the next request; its number is free again
    b.get(out=out)
    assert (out == 2).all() and conn.handles[_conn(rt, b)[1]] == h  # b took a's number
    a.get(out=out)
    assert (out == 1).all()


def _swallow_then_hang_up(conn) -> tuple[threading.Thread, threading.Event]:
    """Put a loopback peer of this test under ``conn``'s fd (dup2: the socket object, its fd
    number and the kept route stay; the owner's connection closes) that reads the next request
    and hangs up without a reply: the request provably left, and the reply never comes. (A
    SHUT_RD of the real connection hoped for an order: a reply that arrived before the
    consumer's receive is still read on Linux, and the same connection served the get.)"""
    with socket.create_server(("127.0.0.1", 0)) as lst:
        ours = socket.create_connection(lst.getsockname(), timeout=30)
        peer, _ = lst.accept()
    os.dup2(ours.fileno(), conn.sock.fileno())
    ours.close()
    got = threading.Event()

    def swallow() -> None:
        with peer:
            peer.settimeout(60)
            if peer.recv(W.REQ.size):  # the request left the consumer
                got.set()
            peer.shutdown(socket.SHUT_RDWR)

    t = threading.Thread(target=swallow)
    t.start()
    return t, got


@pytest.mark.parametrize("how", [socket.SHUT_WR, "no-reply", "close"])
def test_the_kept_route_after_its_connection_failed(owner, rt, how):
    """The connection fails under the kept route before the request leaves (SHUT_WR), after
    it left (the peer read the request and hung up: the reply never comes), or is closed: the
    get is made again on a new connection, with the right bytes, and the route is kept anew."""
    w = _ref(rt, owner("publish", name="f", n=8)["ref"])
    out = np.empty(8, np.int64)
    w.get(out=out)
    conn, _ = _conn(rt, w)
    swallower = None
    if how == "close":
        conn.close()
    elif how == "no-reply":
        swallower, request_left = _swallow_then_hang_up(conn)
    else:
        conn.sock.shutdown(how)
    out[:] = -1
    w.get(out=out)
    if swallower is not None:
        swallower.join(30)
        assert not swallower.is_alive() and request_left.is_set()  # the order this case needs
    assert (out == np.arange(8)).all()
    fresh, _ = _conn(rt, w)
    assert fresh is not conn and conn.closed
    w.get(out=out)
    assert (out == np.arange(8)).all() and _conn(rt, w)[0] is fresh
    assert _idle(rt, w)


def test_the_kept_route_is_one_threads(owner, rt):
    """A route is kept for the thread that made it (connections are per thread): another
    thread's gets and puts take their own connection, and both keep returning right bytes."""
    w = _ref(rt, owner("publish", name="t", n=8, kind="full", value=0)["ref"])
    errors, seen = [], set()
    turn = [threading.Event(), threading.Event()]

    def run(k):
        out = np.empty(8, np.int64)
        try:
            for i in range(20):
                assert turn[k].wait(30)
                turn[k].clear()
                w.put(np.full(8, 2 * i + k, np.int64))
                w.get(out=out)
                assert (out == 2 * i + k).all(), (k, i, out)
                seen.add(id(_conn(rt, w)[0]))
                turn[1 - k].set()  # the other thread's turn: the ref alternates threads
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            turn[1 - k].set()

    ts = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in ts:
        t.start()
    turn[0].set()
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert len(seen) == 2  # each thread its own connection
    assert owner("read", name="t")["head"] == [39] * 8


def test_the_kept_route_refuses_what_the_whole_path_refuses(owner, rt):
    r = _ref(rt, owner("publish", name="ro", n=8, access="r")["ref"])
    out = np.empty(8, np.int64)
    r.get(out=out)
    assert isinstance(r._route, WireRoute)
    with pytest.raises(memsem.AccessDeniedError):
        r.put(np.zeros(8, np.int64))
    assert owner("read", name="ro")["head"] == list(range(8))
    with pytest.raises(TypeError, match="out"):
        r.get(out=np.empty(16, np.float32))  # same size, another dtype: never reinterpreted
    with pytest.raises(ValueError, match="out"):
        r.get(out=np.empty(7, np.int64))
    r.get(out=out)
    assert (out == np.arange(8)).all() and _idle(rt, r)


def test_the_kept_route_after_republish_is_stale(owner, rt):
    w = _ref(rt, owner("publish", name="s", n=8)["ref"])
    out = np.empty(8, np.int64)
    w.get(out=out)
    assert isinstance(w._route, WireRoute)
    owner("unpublish", name="s")
    owner("republish", name="s")
    out[:] = -1
    with pytest.raises(memsem.StaleReferenceError):
        w.get(out=out)
    with pytest.raises(memsem.StaleReferenceError):
        w.put(np.zeros(8, np.int64))


def _idle(rt, ref):
    """The resolution of ``ref`` has no copy in flight: its use word holds the cache's claim
    alone (a bracket left open would hold it)."""
    return rt.resolve(ref.spec).use.holders == 1


@pytest.mark.parametrize("slots", [1, 2])
def test_a_version_label_is_never_older_than_bytes_returned(owner, rt, slots):
    """Over tcp a window's version words reach the consumer as pushes, its bytes as replies:
    with the pushes held back (the order forced), a get returns version 2's bytes while the
    mirror still says 1. ``version()`` never reports a version older than bytes this process
    already returned (issue 37), on the whole path and a ref's wire route alike."""
    w = _ref(rt, owner("publish_versioned", name="v", n=8, slots=slots)["ref"])
    assert w.version() == 1  # subscribed: the mirror holds the owner's words
    assert owner("hold_pushes")["held"] >= 1
    try:
        for expect in (2, 3):
            assert owner("commit", name="v")["version"] == expect
            v, got = w.get(with_version=True)  # the whole path
            assert v == expect and (got == expect).all()
            assert w.version() >= v
            out = np.empty(8, np.int64)
            w.get(out=out)
            w.get(out=out)  # a ref's wire route
            assert isinstance(w._route, WireRoute) and (out == expect).all()
            assert w.version() >= expect
    finally:
        owner("release_pushes")


def test_the_kept_route_waits_out_an_open_write_section(redis_url, job, rt):
    """The owner answers BUSY while a write section is open (it parks a request 0.2 s at most
    here): the kept get (on the thread that kept the route) takes the retry loop from that
    outcome (asleep on the window's word) within its own deadline, and returns the committed
    version's bytes."""
    owner = Owner(redis_url, job, env={"MEMSEM_TCP_MAX_WAIT_S": "0.2"})
    try:
        _kept_route_waits_out_a_section(owner, rt)
    finally:
        owner.close()


def _kept_route_waits_out_a_section(owner, rt):
    w = _ref(rt, owner("publish_versioned", name="v", n=8)["ref"])
    kept, go, got, errors = threading.Event(), threading.Event(), [], []

    def reader():
        out = np.empty(8, np.int64)
        try:
            w.get(out=out)
            w.get(out=out)
            got.append(isinstance(w._route, WireRoute))  # this thread keeps the route
            kept.set()
            assert go.wait(30)
            got.append(w.get(out=np.empty(8, np.int64)).copy())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            kept.set()

    t = threading.Thread(target=reader)
    t.start()
    assert kept.wait(30) and not errors and got == [True]
    owner("hold_section", name="v")
    busy0 = rt.stats().errors["busy"]
    go.set()
    for _ in range(600):  # the get met the open section (counted), then the section closes
        if rt.stats().errors["busy"] > busy0:
            break
        time.sleep(0.05)
    assert rt.stats().errors["busy"] > busy0
    owner("release_section", name="v")
    t.join(30)
    assert not errors, errors
    assert (got[1] == 1).all()  # hold_section wrote nothing: the next version holds 1s
    assert _idle(rt, w)


@pytest.mark.parametrize("put", [False, True])
def test_an_interrupt_as_the_kept_call_returns_leaves_nothing_open(owner, rt, monkeypatch, put):
    """An exception raised as the native call returns (a signal handled then: KeyboardInterrupt)
    leaves what moved unknown: the bracket is closed, the connection dropped (its reply may be
    half read), and the next get reads the right bytes on a new connection."""
    from memsem.engines.tcp import _client

    w = _ref(rt, owner("publish", name="i", n=8)["ref"])
    out = np.empty(8, np.int64)
    w.get(out=out)
    conn, _ = _conn(rt, w)
    real = _client._wire

    def interrupted(*args):
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(_client, "_wire", interrupted)
    with pytest.raises(KeyboardInterrupt):
        w.put(np.arange(8, dtype=np.int64) * 3) if put else w.get(out=out)
    monkeypatch.setattr(_client, "_wire", real)
    assert conn.closed and _idle(rt, w)
    out[:] = -1
    w.get(out=out)
    assert (out == (np.arange(8) * (3 if put else 1))).all()
    assert _conn(rt, w)[0] is not conn and _idle(rt, w)
