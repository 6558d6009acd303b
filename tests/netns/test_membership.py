"""Membership: a directory outage is a bounded delay, never a death (docs/many-nodes.md,
"Membership").

Redis is stopped (SIGSTOP) and continued (SIGCONT) for 3x the heartbeat TTL while owners and
consumers run: every live participant keeps working through it (its data path never waits for
the stopped server), re-claims its rank with the same incarnation afterwards and writes its
records again; consumers re-check instead of remembering "dead"; a participant that really died
is still reported (PeerLostError); a restart at the same rank is told from a stall by the
incarnation. Bounds are counted (re-claims, records written again, checks made, outcomes of
gets by phase) or stated in TTLs, never asserted in wall-clock time; every wait has a timeout.

The directory-level tests and the one-node process test need only redis-server on loopback; the
process test's second variant runs the nodes in network namespaces (tests/netns/netns.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest

import memsem
from lines import reader
from redis_server import redis_server

pytest.importorskip("redis", reason="the redis extra is not installed (pip install 'memsem[redis]')")

from memsem.core._liveness import Peers  # noqa: E402
from memsem.directory import MemberState  # noqa: E402
from memsem.directory.redis import RedisDirectory  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MEMBER = os.path.join(HERE, "_member.py")
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
PY = sys.executable
REC = {"pid": 4242, "start": 7, "node": "node-x"}  # the owner's rank record (another node's process)


@pytest.fixture(scope="module")
def srv(redis_binary):
    with redis_server(binary=redis_binary) as s:
        yield s


@contextlib.contextmanager
def stopped(server):
    """Redis stopped (SIGSTOP) for the block; continued (SIGCONT) however it ends."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def until(pred, timeout: float, what: str):
    """``pred()``'s first truthy value, polled; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)


def _dir(url: str, job: str, ttl: float) -> RedisDirectory:
    return RedisDirectory(url, job=job, secret="membership", ttl=ttl)


def _winrec(gva: int, rank: int) -> dict:
    return {"gva": gva, "generation": 5, "nbytes": 8, "name": "w", "access": "rw", "key_digest": "d",
            "rank": rank, "owner_pid": 4242, "owner_start": 7, "node": "node-x", "control": "", "n_ready": 0,
            "tile_bytes": 0, "descriptors": {}, "dtype_code": 0, "shape": [8]}


# -- the directory and the consumer's view of its owners ------------------------------------------
def test_an_outage_of_three_ttls_is_a_delay(srv):
    """Redis stopped for 3 TTLs: the consumer's liveness checks keep saying "alive" without one
    call to the stopped server from the checking thread; afterwards the owner re-claims its rank
    with the same incarnation and writes its window, name and entry again, the consumer's lease
    stays counted throughout, and the consumer's own rank is re-claimed too."""
    ttl = 1.0
    job = f"m{secrets.token_hex(4)}"
    owner, cons = _dir(srv.url, job, ttl), _dir(srv.url, job, ttl)
    try:
        r = owner.claim_rank(REC)
        rc = cons.claim_rank({"pid": 4343, "start": 8, "node": "node-y"})
        gva = (r << 44) | 0x10000
        owner.put_window(gva, "w", _winrec(gva, r), key=b"k" * 16)
        owner.put_entry("rdma/qp.1", {"qpn": 7})
        cons.acquire_lease(gva, 5, {"node": "node-y", "pid": 4343, "rank": rc}, None)
        peer = Peers(cons).get(4242, 7, "node-x", r)
        assert peer.alive() and peer.incarnation[0] == owner.incarnation
        readers = []  # threads that read rank records from the server
        read = cons._read_ranks
        cons._read_ranks = lambda ranks: (readers.append(threading.current_thread()), read(ranks))[1]
        checks = 0
        with stopped(srv):
            end = time.monotonic() + 3 * ttl
            while time.monotonic() < end:
                assert peer.alive(), peer.why
                checks += 1
                time.sleep(0.01)
        assert checks > 0 and threading.current_thread() not in readers  # never waited for the server
        assert owner.lease_holders(gva) == [] or [p for p, _ in owner.lease_holders(gva)] == [4343]
        until(lambda: owner.reclaims >= 1 and owner.restored >= 3 and cons.reclaims >= 1, 20 * ttl,
              "owner and consumer re-claim their ranks, the owner writes its 3 records again")
        while cons.member(r).state is not MemberState.PRESENT:  # bounded by the wait above's outcome
            assert peer.alive(), peer.why
            time.sleep(0.02)
        assert peer.alive() and not peer.dead and peer.incarnation[0] == owner.incarnation
        assert owner.rank_record(r)["incarnation"] == owner.incarnation and not owner.lost_rank
        assert cons.get_window(gva) == _winrec(gva, r) and cons.lookup("w") == gva
        assert cons.get_entry("rdma/qp.1") == {"qpn": 7}
        assert [p for p, _ in owner.lease_holders(gva)] == [4343]  # the lease survived the outage
    finally:
        owner.close()
        cons.close()


def test_gone_is_rechecked_and_a_restart_is_told_from_a_stall_by_the_incarnation(srv):
    """An owner whose heartbeat stops (a stalled process) is lost once its record expired while
    the directory answered: PeerLostError, but not final; when it re-claims its rank with its
    incarnation it is alive again. A new runtime of the very same process at the same rank has a
    new incarnation: the owner known before is dead for good; so is one whose rank another
    process holds."""
    ttl = 1.0
    job = f"m{secrets.token_hex(4)}"
    owner, cons = _dir(srv.url, job, ttl), _dir(srv.url, job, ttl)
    again = None
    try:
        r = owner.claim_rank(REC)
        inc = owner.incarnation
        peer = Peers(cons).get(4242, 7, "node-x", r)
        assert peer.alive()
        owner._stop.set()  # its heartbeat stops
        owner._thread.join(5)
        until(lambda: not peer.alive(), 20 * ttl, "the stalled owner is lost")
        assert not peer.dead and "expired" in peer.why and cons.member(r).state is MemberState.GONE
        err = peer.lost("window w")
        assert isinstance(err, memsem.PeerLostError) and "is lost" in str(err), err
        owner.heartbeat(r)  # the stalled process resumes: same incarnation
        assert owner.reclaims == 1
        until(peer.alive, 20 * ttl, "the owner that re-claimed its rank is alive again")
        assert peer.incarnation[0] == inc and not peer.dead
        # a restart: the same process identity, a new runtime at the same rank
        owner.release_rank(r)
        again = _dir(srv.url, job, ttl)
        assert again.claim_rank(REC) == r and again.incarnation > inc
        until(lambda: not peer.alive(), 20 * ttl, "the restarted owner's old incarnation is dead")
        assert peer.dead and "restarted" in peer.why and f"incarnation {again.incarnation}" in peer.why, peer.why
        assert not peer.alive()  # final
        # another process at the rank
        other = Peers(cons).get(5555, 9, "node-x", r)
        assert not other.alive() and other.dead and "another process" in other.why, other.why
    finally:
        owner.close()
        cons.close()
        if again is not None:
            again.close()


def test_a_lapsed_rank_stays_reserved_and_a_taken_one_is_lost_for_good(srv):
    import redis

    ttl = 1.0
    job = f"m{secrets.token_hex(4)}"
    raw = redis.Redis.from_url(srv.url)
    a = _dir(srv.url, job, ttl)
    dirs = [a]
    try:
        r = a.claim_rank(REC)
        a._stop.set()  # beats driven by hand below
        a._thread.join(5)
        raw.delete(f"memsem:{job}:rank:{r}")  # its record expired while it lived
        b = _dir(srv.url, job, ttl)
        dirs.append(b)
        assert b.claim_rank({"pid": 1, "start": 1, "node": "n-b"}) != r  # reserved for its holder
        a.heartbeat(r)
        assert a.reclaims == 1 and a.rank_record(r)["token"] == a._token and not a.lost_rank
        # the reservation lapsed as well (an outage longer than RESERVE_TTLS): a new runtime takes it
        raw.delete(f"memsem:{job}:rank:{r}", f"memsem:{job}:hold:{r}")
        c = _dir(srv.url, job, ttl)
        dirs.append(c)
        assert c.claim_rank({"pid": 2, "start": 2, "node": "n-c"}) == r
        a.heartbeat(r)
        assert a.lost_rank and a.reclaims == 1
        gva = (r << 44) | 0x20000
        with pytest.raises(memsem.PeerLostError, match="took it"):
            a.put_window(gva, "", _winrec(gva, r))
        assert c.rank_record(r)["pid"] == 2  # the new holder's record untouched
    finally:
        raw.close()
        for d in dirs:
            d.close()


# -- processes: owners and consumers through a stall of 3 TTLs ---------------------------------
TTL = 2.0


class Proc:
    """A _member.py process and its JSON line channel."""

    def __init__(self, role: str, node: str, url: str, job: str, ns=None) -> None:
        env = dict(os.environ, MEMSEM_NODE_ID=node, MEMSEM_DIRECTORY=url, MEMSEM_JOB=job,
                   MEMSEM_JOB_SECRET="membership-test", MEMSEM_HEARTBEAT_TTL=str(TTL), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
        kw = dict(env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cmd = [PY, MEMBER, role]
        self.p = ns.popen(cmd, **kw) if ns is not None else subprocess.Popen(cmd, **kw)
        self.role, self.node = role, node

    def line(self, timeout: float = 60.0) -> dict:
        got = reader(self.p).readline(timeout)
        if not got:
            if got is None:
                self.p.kill()
            raise AssertionError(f"{self.role} {self.node}: no line (rc={self.p.wait(10)}); stderr: "
                                 f"{self.p.stderr.read()[-3000:]}")
        return json.loads(got)

    def send(self, obj: dict) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def __call__(self, op: str, timeout: float = 60.0, **kw) -> dict:
        self.send({"op": op, **kw})
        r = self.line(timeout)
        assert r.get("ok"), r
        return r

    def close(self) -> int | None:
        if self.p.poll() is None:
            try:
                self("exit", timeout=30)
                self.p.wait(30)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(5)
        return self.p.returncode


def _ok(counts: dict, phase: str, name: str) -> int:
    return counts.get(phase, {}).get(name, {}).get("ok", 0)


@pytest.mark.parametrize("where", ["one-node", "netns"])
def test_a_redis_stall_of_three_ttls_is_survived_by_every_live_participant(request, redis_binary, where):
    """Owner and doomed owner on node A, consumers on node B (tcp) and on node A (shared memory),
    all through the redis directory, which is stopped for 3 TTLs. Counted: every consumer's gets
    of the live owner's window go on while Redis is stopped and after it continues, with no
    error in any phase; the owner and the consumers re-claim their ranks; the consumers' leases
    stay counted; a new consumer resolves the live window right after the outage. The doomed
    owner, SIGKILLed while Redis is stopped, is reported: its consumers' gets raise
    PeerLostError and the directory's view says lost (not yet final). A new process then takes
    its rank (its reservation removed): the consumers' verdict on the old owner becomes final,
    naming the other process and its incarnation."""
    if where == "netns":
        request.getfixturevalue("netns_available")
        import netns

        nodes = netns.veth_pair()
    else:
        nodes = contextlib.nullcontext((None, None))
    with nodes as (a, b), redis_server(ns=a, binary=redis_binary) as server:
        job = f"s{os.getpid()}{secrets.token_hex(3)}"
        procs: list[Proc] = []

        def start(role: str, node: str, ns) -> Proc:
            p = Proc(role, node, server.url, job, ns)
            procs.append(p)
            return p

        try:
            owner = start("owner", "node-a", a)
            live = owner.line()
            doomed = start("owner", "node-a", a)
            dead = doomed.line()
            refs = {"live": live["ref"], "doomed": dead["ref"]}
            cons = [start("consumer", "node-b", b), start("consumer", "node-a", a)]
            for c in cons:
                c.send({"refs": refs})
            routes = [c.line()["routes"] for c in cons]
            assert routes[0] == {"live": "tcp", "doomed": "tcp"} and routes[1]["live"].startswith("host"), routes

            def each_ok(phase: str, names=("live",), n: int = 3) -> bool:
                reps = [c("report") for c in cons]
                return all(_ok(r["counts"], phase, k) >= n for r in reps for k in names)

            until(lambda: each_ok("before", ("live", "doomed")), 60, "gets before the stall")
            with stopped(server):
                t0 = time.monotonic()
                for c in cons:
                    c("phase", name="pause")
                until(lambda: each_ok("pause"), 60, "gets while redis is stopped")
                os.kill(doomed.p.pid, signal.SIGKILL)  # a participant that really dies, meanwhile
                doomed.p.wait(10)
                time.sleep(max(0.0, 3 * TTL - (time.monotonic() - t0)))  # the stall lasts 3 TTLs
            for c in cons:
                c("phase", name="after")
            st = until(lambda: (s := owner("stats"))["reclaims"] >= 1 and s, 20 * TTL, "the owner re-claims")
            assert st["incarnation"] == live["incarnation"] and st["rank"] == live["rank"] and not st["lost_rank"]
            # a new consumer once the owner re-claimed (its records expired in the stall; on a loaded
            # machine its heartbeat may come after the stall's end, so the order is forced here)
            fresh = cons[0]("fresh", timeout=120)["fresh"]
            assert fresh["live"] == "ok", fresh
            assert fresh["doomed"] in ("WindowNotFoundError", "PeerLostError"), fresh
            until(lambda: each_ok("after"), 60, "gets after the stall")

            def doomed_lost() -> list | None:
                reps = [c("report") for c in cons]
                ok = all(not r["verdicts"]["doomed"]["alive"] for r in reps)
                return reps if ok else None

            reps = until(doomed_lost, 20 * TTL, "the dead owner is reported lost")
            for r in reps:
                assert r["verdicts"]["live"]["alive"] and not r["verdicts"]["live"]["dead"], r["verdicts"]
                assert r["reclaims"] >= 1 and not r["lost_rank"], r
                for phase in ("before", "pause", "after"):
                    assert set(r["counts"][phase]["live"]) == {"ok"}, (phase, r["counts"], r["last"])
                after = set(r["counts"]["after"]["doomed"])
                assert after <= {"PeerLostError", "StaleReferenceError", "WindowNotFoundError"}, r["counts"]
                assert "PeerLostError" in set(r["counts"]["pause"].get("doomed", {})) | after, r["counts"]
            assert reps[0]["verdicts"]["doomed"]["why"], reps[0]["verdicts"]  # remote: the directory's reason
            holders = owner("holders")["holders"]
            assert sorted(holders) == sorted(c.p.pid for c in cons), holders  # leases outlived the stall
            # a restart: a new process takes the dead owner's rank (its reservation removed, as
            # it lapses after RESERVE_TTLS): the old owner's verdict becomes final
            server.command("DEL", f"memsem:{job}:hold:{dead['rank']}")
            until(lambda: server.command("EXISTS", f"memsem:{job}:rank:{dead['rank']}") == b":0\r\n", 20 * TTL,
                  "the dead owner's rank record expired")
            reborn = start("owner", "node-a", a)
            born = reborn.line()
            assert born["rank"] == dead["rank"] and born["incarnation"] > dead["incarnation"], (born, dead)
            final = until(lambda: (v := cons[0]("report")["verdicts"]["doomed"])["dead"] and v, 20 * TTL,
                          "the restarted rank's old owner is dead for good")
            assert "another process" in final["why"] and f"incarnation {born['incarnation']}" in final["why"], final
            assert final["incarnation"] == dead["incarnation"]  # the incarnation it knew
            for c in cons:
                assert c.close() == 0
        finally:
            for p in procs:
                if p.p.poll() is None:
                    p.close()
