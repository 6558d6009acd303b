"""Versions across nodes (issue 22): pins held at the owner through the tcp route (reservations),
labels that agree with the bytes, stream, and a follower that keeps up with a trainer that
commits every step. One machine, two node ids (no namespaces needed: every route is tcp), a
real redis-server on loopback; the same across two namespaces is in test_follow_netns.py."""
from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

import memsem
from owner_proc import SECRET, Owner
from redis_server import redis_server

ENGINES = ("loopback", "host", "tcp")


@pytest.fixture(scope="module")
def redis_url(redis_binary):
    with redis_server(binary=redis_binary) as srv:
        yield srv.url


@pytest.fixture
def job():
    return f"fol{os.getpid()}{secrets.token_hex(3)}"


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
    r = memsem.Runtime(directory=redis_url, job=job, engines=ENGINES, timeout=20)
    yield r
    r.close()


def test_a_pin_across_nodes_is_held_at_the_owner(owner, rt):
    """pin() of another node's window is a reservation at its owner: the owner's writer writes
    the other slot, and is refused the pinned one until the pin is released."""
    owner("publish_versioned", name="w", n=4096, slots=2)
    ref = rt.lookup("w")
    assert rt.route(ref).kind == "tcp"
    lease = ref.pin(ttl=30)
    assert lease.version == 1 and lease.held
    assert owner("commit", name="w", wait=5)["version"] == 2  # the other slot: free
    refused = owner("commit", name="w", wait=0.3)
    assert refused["error"] == "LeaseHeldError", refused  # v3 would overwrite pinned v1
    v, got = ref.get(version=1, lease=lease, with_version=True)
    assert v == 1 and (got == 1).all()
    lease.renew(30)
    lease.release()
    assert owner("commit", name="w", wait=5)["version"] == 3
    assert (ref.get() == 3).all()
    with pytest.raises(memsem.VersionGoneError) as ei:
        ref.pin(1)
    assert ei.value.wanted == 1 and ei.value.found == 3
    from tests.test_primitives import BAD_VERSIONS

    for bad, exc in BAD_VERSIONS:  # the door holds across nodes too
        with pytest.raises(exc, match="version"):
            ref.pin(bad)
        with pytest.raises(exc, match="version"):
            rt.lease(ref, version=bad)
        with pytest.raises(exc, match="version"):
            ref.get(version=bad)


def _pin_and_wait(conn, url: str, job: str, hexref: str) -> None:
    os.environ.update(MEMSEM_NODE_ID="con-c", MEMSEM_JOB_SECRET=SECRET, MEMSEM_HEARTBEAT_TTL="2")
    with memsem.Runtime(directory=url, job=job, engines=ENGINES, timeout=20) as rt:
        lease = rt.ref(bytes.fromhex(hexref)).pin(ttl=600)
        conn.send(lease.version)
        conn.recv()  # SIGKILLed while it holds the pin


def test_a_pin_ends_with_the_consumers_session(owner, redis_url, job):
    """A consumer killed while it holds a pin (ttl 600 s) holds the owner's writer no longer
    than its connection: the owner's write section goes on."""
    from tests._proc import reap, recv, spawn

    hexref = owner("publish_versioned", name="w", n=4096, slots=2)["ref"]
    p, conn = spawn(_pin_and_wait, redis_url, job, hexref)
    try:
        assert recv(conn) == 1
        assert owner("commit", name="w", wait=5)["version"] == 2
        assert owner("commit", name="w", wait=0.3)["error"] == "LeaseHeldError"
        p.kill()
        p.join(10)
        assert owner("commit", name="w", wait=20)["version"] == 3
    finally:
        reap([p])


@pytest.mark.parametrize("slots", [1, 2])
def test_labels_agree_with_the_bytes_over_tcp_under_a_fast_writer(owner, rt, slots):
    """The owner commits write sections back to back, each version's bytes being the version:
    every get of the latest says which version it returned, and its bytes are that one (the
    mirrored latest-version word lags; the label comes from the owner's bracket)."""
    owner("publish_versioned", name="w", n=1 << 16, slots=slots)
    ref = rt.lookup("w")
    out = np.empty(1 << 16, np.int64)
    owner("versioned_writer", name="w", seconds=120)
    seen = set()
    try:
        for _ in range(60):
            pre = ref.version()
            v, got = ref.get(out, with_version=True)
            assert (got == v).all(), (v, np.unique(got)[:4])
            assert v >= pre
            seen.add(v)
    finally:
        sections = owner("writer_stop")["sections"]
    assert sections > 0 and len(seen) > 1


def test_stream_and_load_across_nodes(owner, rt):
    """stream() pins its version at the owner (it raised NotSupportedError across nodes): every
    bucket holds the version it says, under a writer committing every step."""
    owner("publish_versioned", name="sd", n=1 << 15, tensors=8, state_dict=True)
    sd = rt.lookup_state_dict("sd")
    into = sd.empty_like()
    owner("versioned_writer", name="sd", seconds=120)
    try:
        for _ in range(3):
            versions = set()
            for bucket in sd.stream(into, timeout=20):
                versions.add(bucket.version)
                for t in bucket.tensors.values():
                    assert (t == bucket.version).all()
            assert len(versions) == 1
            v = sd.load(into)
            assert all((t == v).all() for t in into.values())
    finally:
        owner("writer_stop")


def test_a_follower_over_tcp_keeps_up_with_a_trainer_committing_every_step(owner, rt):
    """Full state-dict loads over tcp against a trainer committing back to back: every load
    completes (pinned at the owner) and is bit-exact; none times out (issue 22: 11 of ~50
    loads succeeded in a 10 s run before)."""
    owner("publish_versioned", name="policy", n=1 << 17, tensors=8, state_dict=True)
    owner("versioned_writer", name="policy", seconds=300)
    try:
        f = rt.follow("policy", timeout=30)
        versions = []
        for v, tensors in f:
            assert all((t == v).all() for t in tensors.values()), v
            versions.append(v)
            if len(versions) == 25:
                break
        assert versions == sorted(versions) and len(set(versions)) == 25
        assert f.loads == 25 and f.ref is not None and rt.route(f.ref).kind == "tcp"
    finally:
        sections = owner("writer_stop")["sections"]
    assert sections >= versions[-1] - versions[0]  # the trainer committed every version meanwhile


@pytest.mark.parametrize("kind", ["arange", "torch_empty"])
def test_zero_size_windows_over_tcp(redis_url, job, rt, kind):
    owner = Owner(redis_url, job, ttl=60)  # (importing torch in the owner may stall it past a short ttl)
    try:
        _zero_size_over_tcp(owner, rt, kind)
    finally:
        owner.close()


def _zero_size_over_tcp(owner, rt, kind):
    w = rt.lookup(owner("publish", name="e", n=0, kind=kind, dtype="float32") and "e")
    assert rt.route(w).kind == "tcp"
    assert w.get().shape == (0,)
    v, got = w.get(np.empty(0, np.float32), with_version=True)
    assert v == 1 and got.shape == (0,)
    w.put(np.empty(0, np.float32))
    (r,) = rt.xcopy([(w, np.empty(0, np.float32))]).wait(10)
    assert r.state.name == "DONE", r
    assert sum(t.array.size for t in rt.pipeline(w)) == 0
    with w.pin() as lease:
        assert lease.version == 1


def test_producers_on_another_node_complete_a_tile_in_parts(owner, rt):
    """Two producers of another node each write half of a tile: the owner counts their rows
    and marks the tile once both halves are in."""
    fsb = owner("fields", name="fs", fields={"lp": [[128, 4], "float32"]}, tile_rows=64)["set"]
    with memsem.Runtime(directory=rt.directory.url, job=rt.directory.job, engines=ENGINES,
                        timeout=20) as other:
        fa = memsem.FieldSet.from_bytes(bytes.fromhex(fsb), rt)["lp"]
        fb = memsem.FieldSet.from_bytes(bytes.fromhex(fsb), other)["lp"]
        assert rt.route(fa).kind == "tcp"
        first = fa.put_rows(0, np.full((32, 4), 1, np.float32))
        assert list(first) == [] and first.partial == {0: (32, 64)}
        assert owner("ready_words", set="fs", field="lp")["words"][0] != owner(
            "ready_words", set="fs", field="lp")["generation"]
        second = fb.put_rows(32, np.full((32, 4), 2, np.float32))
        assert list(second) == [0]
        fa.wait_rows(0, 64, timeout=20)
        words = owner("ready_words", set="fs", field="lp")
        assert words["words"][0] == words["generation"]
        assert fb.put_rows(64, np.ones((40, 4), np.float32)).partial == {1: (40, 64)}
        with pytest.raises(ValueError, match="written twice"):
            fa.put_rows(80, np.ones((30, 4), np.float32))  # rows 80..104 written again
