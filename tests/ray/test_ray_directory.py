"""The ``ray`` directory on a Ray cluster of three nodes on this machine (tests/ray/cluster.py).

Chosen by itself inside a Ray job; windows found by name across nodes with nothing set (no
Redis, no secret, tcp enabled by default); the directory's own semantics (ranks, sealed keys,
forgery with a hand-set secret, leases, names with one owner, entry watches); the actor
restarted (a directory outage: ranks re-claimed with their incarnation, records written
again); the actor leaving once its job holds nothing; and a node removed mid-run: its
participants reported dead within the liveness bound, the others going on.

Bounds are the library's: a removed node's owner is PeerLostError (never the runtime's
timeout of 120 s), its records expire (the TTL), GONE after the re-claim grace.
"""
from __future__ import annotations

import os
import secrets
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import memsem  # noqa: E402
from cluster import node_id, placed  # noqa: E402
from conftest import TTL  # noqa: E402
from memsem.directory import MemberState, choose_url  # noqa: E402
from memsem.directory.ray import ACTOR_NAMESPACE, RayDirectory  # noqa: E402

LONG = 120.0  # runtimes' timeout: a wait that ends at it is a failure of the liveness bound


def _until(pred, what: str, timeout: float = 60.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s")


@ray.remote(num_cpus=0)
class Owner:
    """A memsem runtime in a Ray actor, as a job's worker would hold one (defaults only)."""

    def __init__(self) -> None:
        self.rt = memsem.Runtime(timeout=LONG)
        self.refs: dict[str, object] = {}
        self.leases: list[object] = []

    def where(self) -> dict:
        d = self.rt.directory
        return {"node": os.environ.get("MEMSEM_NODE_ID"), "rank": self.rt.rank, "job": d.job,
                "url": d.url, "engines": sorted(self.rt.engines)}

    def publish(self, name: str, n: int, fill: int = 0) -> bytes:
        arr = np.arange(n, dtype=np.int64) + fill
        self.refs[name] = self.rt.publish(arr, name=name, access="rw")
        return self.refs[name].to_bytes()

    def lease(self, name: str) -> None:
        self.leases.append(self.rt.lease(self.rt.lookup(name), ttl=None).acquire())

    def close(self) -> None:
        self.rt.close()


@ray.remote(num_cpus=0)
def read_by_name(name: str) -> dict:
    with memsem.Runtime(timeout=LONG) as rt:
        ref = rt.lookup(name)
        data = ref.get()
        return {"node": os.environ.get("MEMSEM_NODE_ID"), "route": rt.route(ref).kind, "sum": int(data.sum()),
                "url": rt.directory.url, "job": rt.directory.job}


@ray.remote(num_cpus=0)
def write_by_name(name: str, value: int) -> str:
    with memsem.Runtime(timeout=LONG) as rt:
        ref = rt.lookup(name)
        ref.put(np.full(ref.shape, value, dtype=np.int64))
        return rt.route(ref).kind


def _rec(gva: int, gen: int = 5) -> dict:
    return {"gva": gva, "generation": gen, "nbytes": 8, "name": "x", "access": "rw", "key_digest": "d",
            "rank": 0, "owner_pid": 1, "owner_start": 1, "node": "n", "control": "", "n_ready": 0,
            "tile_bytes": 0, "descriptors": {}, "dtype_code": 0, "shape": [8]}


def _dir(**kw) -> RayDirectory:
    kw.setdefault("job", f"u{secrets.token_hex(4)}")
    kw.setdefault("ttl", TTL)
    return RayDirectory(**kw)


# -- chosen inside a Ray job; found across nodes with nothing set ---------------------------------
def test_chosen_inside_a_ray_job_and_windows_found_across_nodes(cluster):
    assert choose_url(None) == ("ray", "this process runs inside a Ray job")
    owner = Owner.options(**placed("w1")).remote()
    try:
        info = ray.get(owner.where.remote(), timeout=LONG)
        assert info["node"] == node_id("w1") and info["url"] == "ray" and "tcp" in info["engines"]
        ray.get(owner.publish.remote("weights", 1000), timeout=LONG)
        got = ray.get(read_by_name.options(**placed("w2")).remote("weights"), timeout=LONG)
        # another node, the same job (the Ray job's), the key unsealed with the job's own secret
        assert got == {"node": node_id("w2"), "route": "tcp", "sum": 499500, "url": "ray", "job": info["job"]}
        assert info["job"] == f"ray-{ray.get_runtime_context().get_job_id()}"
        assert ray.get(write_by_name.options(**placed("w2")).remote("weights", 7), timeout=LONG) == "tcp"
        with memsem.Runtime(timeout=LONG) as rt:  # the driver, on the head: a third node
            ref = rt.lookup("weights")
            assert rt.route(ref).kind == "tcp" and (ref.get() == 7).all()
            assert rt.directory.job == info["job"]
    finally:
        ray.get(owner.close.remote(), timeout=LONG)
        ray.kill(owner)


# -- the directory's own semantics --------------------------------------------------------------
def test_ranks_windows_sealed_keys_entries(cluster):
    job = f"u{secrets.token_hex(4)}"
    with _dir(job=job) as d1, _dir(job=job) as d2:
        r1 = d1.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        r2 = d2.claim_rank({"pid": 3, "start": 4, "node": "n2"})
        assert r1 != r2 and set(d1.ranks()) == {r1, r2}
        assert d1.incarnation != d2.incarnation
        assert d2.owner_alive(r1, 1, 2, "n1") and d2.owner_alive(r1, 9, 2, "n1") is False
        d1.put_window(0x10000, "x", _rec(0x10000), key=b"k" * 16)
        assert d2.get_window(0x10000)["generation"] == 5
        assert d2.lookup("x") == 0x10000 and d2.name_record("x")["rank"] == r1
        assert d2.window_with_key(0x10000) == (_rec(0x10000), b"k" * 16)
        raw = d1._call("get", d1._k("w", f"{0x10000:016x}"))
        assert (b"k" * 16).hex() not in raw and "kkkk" not in raw  # sealed, also in the actor
        d1.put_entry("rdma/qp.1", {"qpn": 7})
        assert d2.get_entry("rdma/qp.1") == {"qpn": 7} and list(d2.entries("rdma/")) == ["rdma/qp.1"]
        d1.remove_window(0x10000, "x")
        assert d2.get_window(0x10000) is None and d2.lookup("x") is None
        d1.release_rank(r1)
        assert set(d2.ranks()) == {r2}


def test_forgery_rejected_with_a_hand_set_secret(cluster):
    job = f"u{secrets.token_hex(4)}"
    with _dir(job=job, secret="right") as d:
        d.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        d.put_window(0x20000, "f", _rec(0x20000), key=b"K" * 16)
        wkey = d._k("w", f"{0x20000:016x}")
        with _dir(job=job, secret="wrong") as other:  # a Ray user without the secret
            with pytest.raises(memsem.AccessDeniedError):
                other.window_with_key(0x20000)
        with _dir(job=job) as member:  # the job's own secret (the actor's) is not the hand-set one
            with pytest.raises(memsem.AccessDeniedError):
                member.get_window(0x20000)
        stored = d._call("get", wkey)
        import json

        val = json.loads(stored)
        val["v"]["generation"] = 6
        d._call("put", {wkey: json.dumps(val)}, None, [])
        with pytest.raises(memsem.AccessDeniedError, match="HMAC"):
            d.get_window(0x20000)
        d._call("put", {d._k("w", f"{0x40000:016x}"): stored}, None, [])  # moved: the key name is signed
        with pytest.raises(memsem.AccessDeniedError):
            d.get_window(0x40000)
        assert all(w["gva"] != 0x40000 for w in d.windows())  # listings skip it


def test_leases_closing_and_expiry(cluster):
    job = f"u{secrets.token_hex(4)}"
    owner, cons = _dir(job=job), _dir(job=job)
    try:
        owner.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        rc = cons.claim_rank({"pid": 3, "start": 4, "node": "n2"})
        owner.put_window(0x50000, "", _rec(0x50000, gen=9))
        with pytest.raises(memsem.WindowRetiredError):
            cons.acquire_lease(0x50000, 8, {"node": "n2", "pid": 3, "rank": rc}, 5.0)
        m = cons.acquire_lease(0x50000, 9, {"node": "n2", "pid": 3, "rank": rc}, 5.0)
        holders = owner.lease_holders(0x50000, closing=True)
        assert len(holders) == 1 and holders[0][0] == 3 and 0 < holders[0][1] <= 5.0
        with pytest.raises(memsem.WindowRetiredError, match="closing"):
            cons.acquire_lease(0x50000, 9, {"node": "n2", "pid": 3, "rank": rc}, 5.0)
        owner.reopen_window(0x50000)
        assert cons.renew_lease(0x50000, m, 0.2)
        time.sleep(0.5)  # past the lease's 0.2 s on the actor's clock
        assert not cons.renew_lease(0x50000, m, 1.0)  # expired: lost
        assert owner.lease_holders(0x50000) == []
        # a holder whose runtime is gone (its rank expires) does not block the owner
        cons.acquire_lease(0x50000, 9, {"node": "n2", "pid": 3, "rank": rc}, None)
        cons.close()  # heartbeat stops: the rank expires after the TTL, GONE after the grace
        _until(lambda: owner.lease_holders(0x50000) == [], "the gone holder's lease reaped")
    finally:
        owner.close()
        cons.close()


def test_names_have_one_live_owner(cluster):
    job = f"u{secrets.token_hex(4)}"
    with _dir(job=job) as a, _dir(job=job) as b:
        ra = a.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        rb = b.claim_rank({"pid": 3, "start": 4, "node": "n2"})
        assert a.claim_name("policy", 0x1000, {"pid": 1, "start": 2, "node": "n1", "rank": ra}) is None
        held = b.claim_name("policy", 0x2000, {"pid": 3, "start": 4, "node": "n2", "rank": rb})
        assert held is not None and held["pid"] == 1 and held["rank"] == ra and b.lookup("policy") == 0x1000
        assert b.claim_name("policy", 0x2000, {"pid": 3, "start": 4, "node": "n2", "rank": rb}, replace=True) is None
        assert a.lookup("policy") == 0x2000
        a.remove_window(0x1000, "policy")  # a's window no longer holds the name: b's stays
        assert a.lookup("policy") == 0x2000
        b.release_rank(rb)  # b's runtime closed: its name may be taken
        assert a.claim_name("policy", 0x3000, {"pid": 1, "start": 2, "node": "n1", "rank": ra}) is None
        assert b.lookup("policy") == 0x3000


def test_a_name_has_one_owner_across_nodes(cluster):
    """Runtimes of two nodes: a name a live runtime of w1 holds is NameHeldError for the driver
    (naming the holder) unless replace=True; the replaced owner's unpublish leaves the successor's
    name; lookup(name, timeout=) waits for a name published later on another node; a closed
    runtime's name is taken over."""
    owner = Owner.options(**placed("w1")).remote()
    try:
        ray.get(owner.publish.remote("policy", 16, 1), timeout=LONG)
        where = ray.get(owner.where.remote(), timeout=LONG)
        with memsem.Runtime(timeout=LONG) as rt:
            with pytest.raises(memsem.NameHeldError) as held:
                rt.publish(np.zeros(16, dtype=np.int64), name="policy")
            assert held.value.holder["node"] == node_id("w1") and held.value.holder["rank"] == where["rank"]
            assert int(rt.lookup("policy").get().sum()) == int((np.arange(16) + 1).sum())
            mine = rt.publish(np.full(16, 3, dtype=np.int64), name="policy", replace=True)
            assert rt.lookup("policy").spec.gva == mine.spec.gva
            ray.get(owner.close.remote(), timeout=LONG)  # the replaced owner leaves: the name stays
            assert rt.lookup("policy").spec.gva == mine.spec.gva
            # a name published later, on another node, is waited for
            later = Owner.options(**placed("w2")).remote()
            try:
                pending = later.publish.remote("later", 8, 4)
                ref = rt.lookup("later", timeout=LONG)
                ray.get(pending, timeout=LONG)
                assert int(ref.get().sum()) == int((np.arange(8) + 4).sum()) and rt.route(ref).kind == "tcp"
                ray.get(later.close.remote(), timeout=LONG)  # closed: its name is free again
                taken = rt.publish(np.zeros(8, dtype=np.int64), name="later")
                assert rt.lookup("later").spec.gva == taken.spec.gva
            finally:
                ray.kill(later)
    finally:
        ray.kill(owner)


def test_entry_watch_wakes_on_put_and_on_wake(cluster):
    import threading

    with _dir() as d:
        d.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        with d.watch_entries("qp/") as w:
            assert w.wait(0.2) is False  # nothing put: the timeout
            d.put_entry("other/1", {"x": 1})
            assert w.wait(0.2) is False  # another prefix
            d.put_entry("qp/7", {"qpn": 7})
            assert w.wait(LONG) is True
            t = threading.Timer(0.2, w.wake)
            t.start()
            assert w.wait(LONG) is True  # woken from another thread, not by the timeout
            t.join()


# -- a directory outage: the actor restarted -------------------------------------------------------
def test_actor_restart_is_an_outage_not_a_death(cluster):
    job = f"u{secrets.token_hex(4)}"
    with _dir(job=job) as owner, _dir(job=job) as reader:
        r = owner.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        inc = owner.incarnation
        owner.put_window(0x60000, "kept", _rec(0x60000), key=b"s" * 16)
        actor = ray.get_actor(owner.actor_name, namespace=ACTOR_NAMESPACE)
        before = ray.get(actor.call.remote("ping"), timeout=LONG)
        ray.kill(actor, no_restart=False)  # Ray restarts it (max_restarts=-1): its memory is gone
        _until(lambda: _restarted(owner, before), "the actor restarted")
        # the owner's heartbeat re-claims its rank with the same incarnation and writes its
        # records again; the job's secret survived the restart (a constructor argument)
        _until(lambda: owner.reclaims >= 1 and reader.get_window(0x60000) is not None, "rank re-claimed")
        assert owner.incarnation == inc and reader.rank_record(r)["incarnation"] == inc
        assert reader.window_with_key(0x60000) == (_rec(0x60000), b"s" * 16)
        assert reader.lookup("kept") == 0x60000 and owner.restored >= 2
        assert reader.member(r).state is MemberState.PRESENT and not owner.lost_rank
        # a new runtime never gets an incarnation a live one has (the counter was raised)
        with _dir(job=job) as third:
            third.claim_rank({"pid": 5, "start": 6, "node": "n3"})
            assert third.incarnation > inc


def _restarted(d: RayDirectory, before: float) -> bool:
    try:
        return d._call("ping") < before
    except memsem.PeerLostError:
        return False


def test_actor_leaves_once_its_job_holds_nothing(cluster):
    scope = f"idle-{secrets.token_hex(4)}"
    d = _dir(scope=scope, ttl=0.5, idle_s=1.0)
    try:
        r = d.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        d.put_window(0x70000, "", _rec(0x70000))
        d.remove_window(0x70000, "")
        d.release_rank(r)
    finally:
        d.close()
    name = d.actor_name

    def gone() -> bool:
        try:
            ray.get_actor(name, namespace=ACTOR_NAMESPACE)
            return False
        except ValueError:
            return True

    _until(gone, "the idle actor left", timeout=90)
    with _dir(scope=scope, ttl=0.5) as again:  # a later runtime of the job makes a new one
        again.claim_rank({"pid": 1, "start": 2, "node": "n1"})
        again.put_entry("e/1", {"a": 1})
        assert again.get_entry("e/1") == {"a": 1}


# -- a node removed mid-run ---------------------------------------------------------------------
def test_a_node_removed_mid_run(cluster):
    """Node 'gone' holds an owner (window 'a') that also leases the driver's window 'c'; w1
    holds an owner of window 'b'. Removing 'gone': its owner is PeerLostError for every reader
    (never the 120 s timeout), its rank GONE, its records expire, its lease no longer blocks
    the driver's unpublish; 'b' is read and written as before, from the driver and from w2."""
    cluster.add("gone", 1)
    doomed = Owner.options(**placed("gone")).remote()
    keeper = Owner.options(**placed("w1")).remote()
    with memsem.Runtime(timeout=LONG) as rt:
        d = rt.directory
        c = rt.publish(np.arange(64, dtype=np.int64), name="c", access="r")
        ray.get(doomed.publish.remote("a", 256, 1), timeout=LONG)
        ray.get(keeper.publish.remote("b", 256, 2), timeout=LONG)
        ray.get(doomed.lease.remote("c"), timeout=LONG)
        rank_gone = ray.get(doomed.where.remote(), timeout=LONG)["rank"]
        a, b = rt.lookup("a"), rt.lookup("b")
        assert int(a.get().sum()) == int((np.arange(256) + 1).sum()) and rt.route(a).kind == "tcp"
        assert [h[0] for h in rt.lease_holders(c)] != []  # the doomed node's lease, held in the directory
        assert d.member(rank_gone).state is MemberState.PRESENT

        cluster.remove("gone")

        # Every read of 'a' now still succeeds (the owner's process has not noticed its raylet's
        # death yet), or fails on its connection (EngineError: the owner is not known dead yet,
        # its heartbeat has not expired), until it is PeerLostError: never the runtime's
        # timeout, never wrong bytes.
        seen = []

        def lost() -> bool:
            try:
                assert int(a.get().sum()) == int((np.arange(256) + 1).sum())
                seen.append("ok")
                return False
            except memsem.PeerLostError:
                return True
            except memsem.MemsemTimeoutError:
                raise
            except memsem.EngineError as exc:
                seen.append(type(exc).__name__)
                return False

        _until(lost, "the removed node's owner reported lost", timeout=LONG, every=0.2)
        _until(lambda: d.member(rank_gone).state is MemberState.GONE, "its rank GONE", timeout=LONG)
        assert "expired" in d.member(rank_gone).detail
        _until(lambda: d.get_window(a.spec.gva) is None, "its window record expired", timeout=LONG)
        assert d.lookup("a") is None and rank_gone not in d.ranks()
        with pytest.raises(memsem.MemsemError):
            a.get()
        # the others go on: the dead node's lease does not hold the driver's window
        assert rt.lease_holders(c) == []
        rt.unpublish(c, timeout=LONG)
        assert int(b.get().sum()) == int((np.arange(256) + 2).sum())
        b.put(np.full(256, 5, dtype=np.int64))
        got = ray.get(read_by_name.options(**placed("w2")).remote("b"), timeout=LONG)
        assert got["route"] == "tcp" and got["sum"] == 5 * 256
    ray.get(keeper.close.remote(), timeout=LONG)
    ray.kill(keeper)
