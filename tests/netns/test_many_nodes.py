"""Many nodes: the redis directory and the tcp engine, across two network namespaces.

Layout of the namespace tests: namespace A runs redis-server (on A's veth address) and the
producer "node-a"; namespace B runs the consumer "node-b", which reaches both Redis and the
producer's TCP server over the veth link only. Different MEMSEM_NODE_ID values forbid shared
memory and cross-memory attach between them, so the route must be tcp.

They skip (saying why) only where namespaces cannot be created; MEMSEM_REQUIRE_NETNS=1 makes that
a failure. The RedisDirectory unit tests need only a redis-server on loopback.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import memsem
from lines import reader
from owner_proc import Owner
from redis_server import redis_server

HERE = os.path.dirname(os.path.abspath(__file__))
NODE = os.path.join(HERE, "_node.py")
TRAINER = os.path.join(HERE, "_trainer.py")
WEIGHTS = os.path.join(HERE, "_weights.py")
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
PY = sys.executable
TTL = 2.0

pytest.importorskip("redis", reason="the redis extra is not installed (pip install 'memsem[redis]')")


# -- helpers ---------------------------------------------------------------------------------------
def _readline(proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    line = reader(proc).readline(timeout)
    if line is None:
        proc.kill()
        raise AssertionError(f"no output within {timeout}s; stderr: {proc.stderr.read()[-3000:]}")
    if not line:
        raise AssertionError(f"process exited rc={proc.wait()}; stderr: {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def _send(proc: subprocess.Popen, obj) -> None:
    proc.stdin.write(json.dumps(obj) + "\n")
    proc.stdin.flush()


def _env(node: str, url: str, job: str, secret: str) -> dict:
    env = dict(os.environ, MEMSEM_NODE_ID=node, MEMSEM_DIRECTORY=url, MEMSEM_JOB=job,
               MEMSEM_JOB_SECRET=secret, MEMSEM_HEARTBEAT_TTL=str(TTL), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(ns, env, *args) -> subprocess.Popen:
    return ns.popen([PY, NODE, *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def cluster(netns_available, redis_binary):
    """(a, b, redis url, job, secret): namespaces joined by veth, Redis in A on A's address."""
    import netns

    with netns.veth_pair() as (a, b), redis_server(ns=a, binary=redis_binary) as srv:
        job = f"t{os.getpid()}{secrets.token_hex(3)}"
        print(f"\nmany-nodes: redis {srv.url} in {a.name}; consumer namespace {b.name}")
        yield a, b, srv.url, job, secrets.token_hex(16)


@pytest.fixture
def producer(cluster):
    a, b, url, job, secret = cluster
    p = _start(a, _env("node-a", url, job, secret), "producer")
    info = _readline(p)
    yield p, info
    if p.poll() is None:
        _send(p, {"op": "exit"})
        _finish(p)


def _consumer(cluster, scenario: str, info: dict, secret: str | None = None) -> subprocess.Popen:
    a, b, url, job, sec = cluster
    c = _start(b, _env("node-b", url, job, secret or sec), "consumer", scenario)
    _send(c, {"refs": info["refs"]})
    return c


# -- across the veth link ---------------------------------------------------------------------------
@pytest.mark.netns
def test_get_put_xcopy_pipeline_over_veth(cluster, producer):
    p, info = producer
    a, b = cluster[0], cluster[1]
    assert info["endpoint"].startswith(f"tcp://{a.addr}:"), info  # served on the veth address
    t0 = time.monotonic()
    c = _consumer(cluster, "basic", info)
    res = _readline(c, 120)
    _finish(c)
    assert res["ok"], res
    print(f"\nmany-nodes basic ({time.monotonic() - t0:.2f} s): route={res['route']} "
          f"pipeline={res['pipeline']} denied={res['denied']} forged={res['forged']}\n{res['explain']}")
    assert res["route"] == "tcp" and res["denied"] == "AccessDeniedError" and res["forged"] == "AccessDeniedError"
    assert c.returncode == 0
    # the consumer's put arrived at the owner
    _send(p, {"op": "read", "ref": info["refs"]["w"]})
    r = _readline(p)
    assert r["ok"] and r["head"] == [0.0, 2.0, 4.0, 6.0], r


@pytest.mark.netns
def test_lease_across_nodes_blocks_unpublish(cluster, producer):
    p, info = producer
    c = _consumer(cluster, "lease", info)
    held = _readline(c)
    assert held["ok"] and held["step"] == "held", held
    _send(p, {"op": "unpublish", "name": "w", "timeout": 0.5})
    r = _readline(p)
    assert not r["ok"] and r["error"] == "LeaseHeldError", r  # the remote lease blocked it
    c.stdin.write("\n")
    c.stdin.flush()
    rel = _readline(c)
    assert rel["ok"] and rel["step"] == "released", rel
    _send(p, {"op": "unpublish", "name": "w", "timeout": 5.0})
    r = _readline(p)
    assert r["ok"], r
    c.stdin.write("\n")
    c.stdin.flush()
    st = _readline(c)
    assert st["ok"] and st["error"] in ("StaleReferenceError", "WindowRetiredError", "WindowNotFoundError"), st
    _finish(c)
    assert c.returncode == 0


@pytest.mark.netns
def test_killed_node_windows_expire(cluster):
    a, b, url, job, secret = cluster
    p = _start(a, _env("node-a", url, job, secret), "producer")
    info = _readline(p)
    c = _consumer(cluster, "kill", info)
    ready = _readline(c)
    assert ready["ok"], ready
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    c.stdin.write("\n")
    c.stdin.flush()
    gone = _readline(c, 60)
    _finish(c)
    assert "errors" in gone, gone
    print(f"\nmany-nodes kill: consumer saw {gone['errors']} after {gone['s']:.2f} s (TTL {TTL} s)")
    assert gone["ok"], gone
    # noticed by liveness (the connection ended, the heartbeat expired), never by a get timing out
    assert len(gone["errors"]) == 1 and gone["errors"][0] != "MemsemTimeoutError", gone


@pytest.mark.netns
def test_wrong_secret_cannot_read_entries(cluster, producer):
    p, info = producer
    c = _consumer(cluster, "wrong-secret", info, secret="not-the-job-secret")
    res = _readline(c)
    _finish(c)
    assert res["ok"] and res["error"] == "AccessDeniedError", res


# -- the RL data plane and ready words across the link ----------------------------------------------
@pytest.mark.netns
def test_rl_data_plane_across_nodes(cluster):
    """A producer node fills a FieldSet out of order; a trainer node consumes micro-batches through
    pipelines (ready words pushed across the link) as their rows become ready in every field. The
    next pair of micro-batches is produced only after the trainer consumed the previous pair, so
    a trainer that waited for more than the rows it needs would never get there."""
    a, b, url, job, secret = cluster
    o = Owner(url, job, ns=a, node="node-a", secret=secret)
    t = None
    try:
        fields = {"obs": [[64, 16], "float32"], "act": [[64], "int64"], "reward": [[64], "float32"]}
        names = sorted(fields)
        set_hex = o("fields", name="rollout", tile_rows=4, fields=fields)["set"]
        t = b.popen([PY, TRAINER], env=_env("node-b", url, job, secret), stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _send(t, {"set": set_hex, "micro_tiles": 2, "timeout": 60})  # micro-batch: 8 rows
        order = [1, 0, 3, 2, 5, 4, 7, 6]
        got = []
        for pair in zip(order[::2], order[1::2]):
            for mb in pair:
                for field in reversed(names):  # each micro-batch out of order, field by field
                    o("put_rows", set="rollout", field=field, start=8 * mb, stop=8 * mb + 8,
                      value=10 * mb + names.index(field))
            for expect in sorted(pair):
                r = _readline(t, 60)
                assert r.get("mb") == expect, r
                assert r["rows"] == [8 * expect, 8 * expect + 8]
                assert r["firsts"] == {n: float(10 * expect + names.index(n)) for n in names}, r
                got.append(r["mb"])
        done = _readline(t, 60)
        assert done.get("done") and done["route"] == "tcp", done
        assert got == list(range(8))
        _finish(t)
        assert t.returncode == 0
    finally:
        if t is not None and t.poll() is None:
            t.kill()
            t.wait(5)
        o.close()


@pytest.mark.netns
def test_versioned_weight_sync_from_a_trainer_node_to_two_rollout_nodes(netns_available, redis_binary):
    """Three nodes on one subnet (a bridge): the trainer publishes a state dict (double-buffered,
    a 0-d tensor included) and writes K versions; two rollouts on two other nodes look it up by
    name, follow every version (version waits across the link) and load each bit-exact (sha256
    against the trainer's). Lockstep: version k + 1 is written once both loaded version k."""
    import netns

    last = 5
    with netns.star(3) as (tn, r1, r2), redis_server(ns=tn, binary=redis_binary) as srv:
        job = f"v{os.getpid()}{secrets.token_hex(3)}"
        secret = secrets.token_hex(8)
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        trainer = tn.popen([PY, WEIGHTS, "trainer"], env=_env("node-t", srv.url, job, secret), **pipes)
        procs = [trainer]
        try:
            first = _readline(trainer, 60)
            assert first["ready"] and first["version"] == 1, first
            assert first["endpoint"].startswith(f"tcp://{tn.addr}:"), first
            shas = {1: first["sha"]}
            rollouts = [r.popen([PY, WEIGHTS, "rollout", str(last)], env=_env(f"node-r{i}", srv.url, job, secret),
                                **pipes) for i, r in enumerate((r1, r2), 1)]
            procs += rollouts
            for step in range(1, last):
                _send(trainer, {"step": step})
                w = _readline(trainer, 60)
                assert w["version"] == step + 1, w
                shas[w["version"]] = w["sha"]
                for r in rollouts:
                    got = _readline(r, 90)
                    assert got.get("version") == w["version"], got
                    assert got["sha"] == shas[w["version"]], (got, shas)  # bit-exact, that version
            assert len(set(shas.values())) == last  # every version changed every byte's hash
            for r in rollouts:
                done = _readline(r, 60)
                assert done.get("done") and done["route"] == "tcp", done
                _finish(r)
                assert r.returncode == 0
            _send(trainer, {"exit": True})
            _finish(trainer)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)


_WAITER = r"""
import json, sys, memsem
rt = memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=10)
ref = rt.ref(bytes.fromhex(sys.stdin.readline().strip()))
assert rt.route(ref).kind == "tcp" and ref.ready_tiles() == []
print(json.dumps({"waiting": True}), flush=True)
try:
    ref.wait_tile(1, timeout=120)
    print(json.dumps({"error": None}), flush=True)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "msg": str(exc)}), flush=True)
rt.close()
"""


@pytest.mark.netns
@pytest.mark.parametrize("how", ["killed", "partitioned"])
def test_a_remote_wait_ends_peer_lost_when_the_owner_is_gone(netns_available, redis_binary, how):
    """A consumer waits (timeout 120 s) for a tile of a window on another node; the owner is
    SIGKILLed, or its link goes down. The wait ends with PeerLostError, bounded by the library
    (a closed connection at once; a vanished node by TCP keepalive, about 4 s, or the heartbeat
    TTL), never by the caller's timeout."""
    import netns

    with netns.veth_pair() as (a, b), redis_server(ns=b, binary=redis_binary) as srv:
        job = f"w{os.getpid()}{secrets.token_hex(3)}"
        secret = secrets.token_hex(8)
        o = Owner(srv.url, job, ns=a, node="node-a", secret=secret)
        w = None
        try:
            ref = o("publish", name="w", n=4096, tile_bytes=8192)["ref"]
            w = b.popen([PY, "-c", _WAITER], env=_env("node-b", srv.url, job, secret), stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            w.stdin.write(ref + "\n")
            w.stdin.flush()
            assert _readline(w, 60)["waiting"]
            t0 = time.monotonic()
            if how == "killed":
                os.kill(o.pid, signal.SIGKILL)
            else:
                a.run(["ip", "link", "set", "veth0", "down"])
            r = _readline(w, 150)
            print(f"\nremote wait, owner {how}: {r} after {time.monotonic() - t0:.2f} s")
            assert r["error"] == "PeerLostError", r
            _finish(w)
        finally:
            if w is not None and w.poll() is None:
                w.kill()
                w.wait(5)
            if o.p.poll() is None:
                o.p.kill()
            o.close()


# -- RedisDirectory on loopback ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_url(redis_binary):
    with redis_server(binary=redis_binary) as srv:
        yield srv.url


def _dir(url, job, secret="s", ttl=2.0):
    from memsem.directory.redis import RedisDirectory

    return RedisDirectory(url, job=job, secret=secret, ttl=ttl)


def _winrec(gva, gen=5):
    return {"gva": gva, "generation": gen, "nbytes": 8, "name": "x", "access": "rw", "key_digest": "d",
            "rank": 0, "owner_pid": 1, "owner_start": 1, "node": "n", "control": "", "n_ready": 0,
            "tile_bytes": 0, "descriptors": {}, "dtype_code": 0, "shape": [8]}


def test_redis_directory_roundtrip_and_ranks(redis_url):
    job = f"u{secrets.token_hex(4)}"
    with _dir(redis_url, job) as d1, _dir(redis_url, job) as d2:
        r1 = d1.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        r2 = d2.claim_rank({"pid": 3, "start": 4, "node": "n2"})
        assert r1 != r2 and set(d1.ranks()) == {r1, r2}
        assert d2.owner_alive(r1, 1, 2, "n1") and not d2.owner_alive(r1, 9, 2, "n1")
        d1.put_window(0x10000, "x", _winrec(0x10000), key=b"k" * 16)
        assert d2.get_window(0x10000)["generation"] == 5
        assert d2.lookup("x") == 0x10000
        assert d2.window_with_key(0x10000) == (_winrec(0x10000), b"k" * 16)
        d1.put_entry("rdma/qp.1", {"qpn": 7})
        assert d2.get_entry("rdma/qp.1") == {"qpn": 7} and "rdma/qp.1" in d2.entries("rdma/")
        d1.remove_window(0x10000, "x")
        assert d2.get_window(0x10000) is None and d2.lookup("x") is None


def test_redis_directory_forgery_rejected(redis_url):
    import redis

    job = f"u{secrets.token_hex(4)}"
    with _dir(redis_url, job, secret="right") as d:
        d.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        d.put_window(0x20000, "f", _winrec(0x20000), key=b"K" * 16)
        raw = redis.Redis.from_url(redis_url)
        key = f"memsem:{job}:w:{0x20000:016x}"
        stored = raw.get(key)
        assert b"KKKK" not in stored and (b"K" * 16).hex().encode() not in stored  # key sealed
        # a process without the secret: cannot verify, cannot unseal
        with _dir(redis_url, job, secret="wrong") as other:
            with pytest.raises(memsem.AccessDeniedError):
                other.get_window(0x20000)
            with pytest.raises(memsem.AccessDeniedError):
                other.window_with_key(0x20000)
        # forging: change the endpoint / generation without re-signing
        val = json.loads(stored)
        val["v"]["generation"] = 6
        raw.set(key, json.dumps(val))
        with pytest.raises(memsem.AccessDeniedError, match="HMAC"):
            d.get_window(0x20000)
        # an unsigned entry written by someone without the secret
        raw.set(f"memsem:{job}:w:{0x30000:016x}", json.dumps({"v": _winrec(0x30000)}))
        with pytest.raises(memsem.AccessDeniedError):
            d.get_window(0x30000)
        assert all(w["gva"] != 0x30000 for w in d.windows())  # listings skip it
        # a valid entry moved under another key fails too (the key name is signed)
        raw.set(f"memsem:{job}:w:{0x40000:016x}", stored)
        with pytest.raises(memsem.AccessDeniedError):
            d.get_window(0x40000)
        raw.close()


def test_redis_directory_ttl_expiry_and_leases(redis_url):
    job = f"u{secrets.token_hex(4)}"
    owner = _dir(redis_url, job, ttl=1.0)
    cons = _dir(redis_url, job, ttl=1.0)
    try:
        r = owner.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        rc = cons.claim_rank({"pid": 3, "start": 4, "node": "n2"})
        owner.put_window(0x50000, "", _winrec(0x50000, gen=9))
        time.sleep(1.5)  # heartbeats keep it alive past the TTL
        assert cons.get_window(0x50000) is not None and cons.owner_alive(r, 1, 2, "n1")
        with pytest.raises(memsem.StaleReferenceError):
            cons.acquire_lease(0x50000, 8, {"node": "n2", "pid": 3, "rank": rc}, 5.0)
        m = cons.acquire_lease(0x50000, 9, {"node": "n2", "pid": 3, "rank": rc}, 5.0)
        holders = owner.lease_holders(0x50000, closing=True)
        assert len(holders) == 1 and holders[0][0] == 3 and 4.0 < holders[0][1] <= 5.0
        with pytest.raises(memsem.StaleReferenceError, match="closing"):
            cons.acquire_lease(0x50000, 9, {"node": "n2", "pid": 3, "rank": rc}, 5.0)
        owner.reopen_window(0x50000)
        assert cons.renew_lease(0x50000, m, 0.2)
        time.sleep(0.3)
        assert not cons.renew_lease(0x50000, m, 1.0)  # expired: lost
        assert owner.lease_holders(0x50000) == []
        # a holder whose node died (rank expired) does not block the owner
        m2 = cons.acquire_lease(0x50000, 9, {"node": "n2", "pid": 3, "rank": rc}, None)
        cons.close()  # heartbeat stops: rank expires after the TTL
        time.sleep(1.3)
        assert owner.lease_holders(0x50000) == [] and m2
        # the owner dies: its rank and windows expire
        owner._stop.set()
        owner._thread.join(2)
        time.sleep(1.3)
        with _dir(redis_url, job) as third:
            assert third.get_window(0x50000) is None and not third.owner_alive(r, 1, 2, "n1")
    finally:
        owner.close()
        cons.close()


def test_tcp_engine_on_loopback_two_node_ids(redis_url, tmp_path):
    """Same machine, two node ids, loopback: route tcp, get/put/stale (no namespaces needed)."""
    job = f"u{secrets.token_hex(4)}"
    code = (
        "import sys, numpy as np; from memsem import Runtime\n"
        "rt = Runtime(engines=('loopback','host','tcp'))\n"
        "r = rt.publish(np.arange(100000, dtype=np.int64), name='v')\n"
        "print(r.to_bytes().hex(), flush=True); sys.stdin.readline()\n"
        "rt.unpublish(r); print('unpublished', flush=True); sys.stdin.readline(); rt.close()\n")
    env = _env("loop-a", redis_url, job, "sec")
    p = subprocess.Popen([PY, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = (reader(p).readline(120) or "").strip()  # bounded: a hung owner fails, never stalls
        assert line, f"the owner did not start (rc {p.poll()})"
        old = {k: os.environ.get(k) for k in ("MEMSEM_NODE_ID", "MEMSEM_JOB_SECRET", "MEMSEM_HEARTBEAT_TTL")}
        os.environ.update(MEMSEM_NODE_ID="loop-b", MEMSEM_JOB_SECRET="sec", MEMSEM_HEARTBEAT_TTL=str(TTL))
        try:
            with memsem.Runtime(directory=redis_url, job=job, engines=("loopback", "host", "tcp"), timeout=10) as rt:
                ref = rt.ref(bytes.fromhex(line))
                assert rt.route(ref).kind == "tcp"
                assert (ref.get() == np.arange(100000)).all()
                ref.put(np.arange(100000)[::-1].copy())
                assert (ref.get()[:3] == [99999, 99998, 99997]).all()
                p.stdin.write("\n")
                p.stdin.flush()
                assert (reader(p).readline(60) or "").strip() == "unpublished"
                with pytest.raises(memsem.StaleReferenceError):
                    ref.get()
                with pytest.raises(memsem.StaleReferenceError):
                    ref.put(np.zeros(100000, np.int64))
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)


# -- versions followed by name over the redis directory ----------------------------------------------
def _redis_follower(conn, url, job, secret, versions):
    import os


    import memsem

    os.environ["MEMSEM_JOB_SECRET"] = secret
    with memsem.Runtime(directory=url, job=job, timeout=30.0) as rt:
        sd = rt.lookup_state_dict("policy")  # found by name through redis (key sealed for the job)
        local = sd.empty_like("numpy")
        seen = []
        v = sd.load(local)
        seen.append((v, float(local["w"][0])))
        conn.send("following")
        while v < versions:
            v = sd.wait_version(v + 1, timeout=60)
            got = sd.load(local, version=v)
            seen.append((got, float(local["w"][0])))
            conn.send(("loaded", got))
        conn.send(("done", seen))


def test_versions_followed_by_name_over_redis(redis_url, monkeypatch):
    """A rollout process finds the state dict by name in the redis directory and follows every
    version the trainer commits (it is never sent a ref)."""
    from tests._proc import recv, reap, spawn

    job = f"v{secrets.token_hex(4)}"
    secret = secrets.token_hex(16)
    monkeypatch.setenv("MEMSEM_JOB_SECRET", secret)
    with memsem.Runtime(directory=redis_url, job=job, timeout=30.0) as rt:
        model = {"w": np.zeros(1024, np.float32), "b": np.zeros(3, np.float32)}
        sd = rt.publish_state_dict(model, name="policy", slots=2)
        p, conn = spawn(_redis_follower, redis_url, job, secret, 4)
        try:
            assert recv(conn, 60) == "following"
            for v in range(2, 5):
                model["w"][:] = v
                assert sd.update(model) == v
                assert recv(conn, 60) == ("loaded", v)  # lockstep: each version is seen
            kind, seen = recv(conn, 60)
            assert kind == "done" and seen == [(1, 0.0), (2, 2.0), (3, 3.0), (4, 4.0)]
        finally:
            reap([p])
