"""Names (issue 22): one owner each, scoped by the job, limits checked at the door, lookups that
wait for a name and never return a retired generation, and a close that finishes whatever fails
inside it. Every variant runs on the local directory and on a real Redis server (loopback)."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import memsem
from memsem import NameHeldError, WindowNotFoundError
from memsem._args import NAME_MAX_BYTES
from tests.conftest import SPAWN

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "netns"))
from redis_server import find_redis_server, redis_server  # noqa: E402


@pytest.fixture(scope="module")
def redis_url():
    if find_redis_server() is None:
        pytest.fail("redis-server not found; run as root: sh tests/netns/install_redis.sh")
    with redis_server() as srv:
        yield srv.url


@pytest.fixture(params=["local", "redis"])
def directory(request, monkeypatch):
    """The directory URL of the test (children inherit it through the environment)."""
    url = "local" if request.param == "local" else request.getfixturevalue("redis_url")
    monkeypatch.setenv("MEMSEM_DIRECTORY", url)
    monkeypatch.setenv("MEMSEM_JOB_SECRET", "names-test-secret")  # redis seals keys with it
    return url


def _mine() -> set[str]:
    """Segment directory entries of this process (segments carry their creator's pid)."""
    shm = os.environ.get("MEMSEM_SHM_DIR", "/dev/shm")
    return {n for n in os.listdir(shm) if f".{os.getpid()}-" in n}


# -- limits ----------------------------------------------------------------------------------
#: names at the limit (accepted everywhere) and past it (refused at publish and at lookup)
AT_LIMIT = ["x" * NAME_MAX_BYTES, "é" * 127, "😀" * 63 + "abc", "n" * 127, "名" * 85, "a"]
PAST_LIMIT = ["x" * (NAME_MAX_BYTES + 1), "é" * 128, "😀" * 64, "x" * 300, "é" * 200]


@pytest.mark.parametrize("name", AT_LIMIT, ids=lambda n: f"{len(n.encode())}B")
def test_names_at_the_limit_work_everywhere(directory, name):
    """Every name publish accepts is looked up by another runtime, republished, unpublished,
    and leaves nothing behind (names of 127-255 bytes failed with ENAMETOOLONG after the window
    was created)."""
    before = _mine()
    with memsem.Runtime(timeout=10) as a, memsem.Runtime(timeout=10) as b:
        a.publish(np.arange(8, dtype=np.float32), name=name)
        assert (b.lookup(name).get() == np.arange(8)).all()
        a.publish(np.full(8, 5, np.float32), name=name, replace=True)  # republish keeps the name
        assert (b.lookup(name).get() == 5).all()
        a.unpublish(name)
        with pytest.raises(WindowNotFoundError):
            b.lookup(name)
        a.publish_state_dict({"w": np.ones(4, np.float32)}, name=name)
        assert b.lookup_state_dict(name).keys() == ("w",)
    assert _mine() - before == set()


@pytest.mark.parametrize("name", PAST_LIMIT, ids=lambda n: f"{len(n)}ch-{len(n.encode())}B")
def test_names_past_the_limit_are_refused_before_anything_exists(directory, name):
    before = _mine()
    with memsem.Runtime(timeout=10) as rt:
        arr = np.zeros(16, np.float32)
        with pytest.raises(ValueError, match=f"at most {NAME_MAX_BYTES} bytes") as ei:
            rt.publish(arr, name=name)
        assert "NAME_MAX_BYTES" in str(ei.value)
        assert _mine() - before == set(), "a refused publish created segments"
        with pytest.raises(ValueError, match=f"at most {NAME_MAX_BYTES} bytes"):
            rt.lookup(name)
        with pytest.raises(ValueError, match=f"at most {NAME_MAX_BYTES} bytes"):
            rt.lookup_state_dict(name)
        with pytest.raises(ValueError, match=f"at most {NAME_MAX_BYTES} bytes"):
            rt.publish_state_dict({"w": arr}, name=name)
        assert rt.stats().windows_published == 0
    assert _mine() - before == set()


@pytest.mark.parametrize("bad,exc", [("", ValueError), ("a\x00b", ValueError), ("tab\there", ValueError),
                                     ("\ud800", ValueError), ("del\x7f", ValueError), (3, TypeError),
                                     (b"bytes", TypeError), (None, TypeError)])
def test_malformed_names_are_refused_naming_the_argument(rt, bad, exc):
    with pytest.raises(exc, match="name"):
        rt.publish(np.zeros(4), name=bad) if bad is not None else rt.lookup(bad)
    with pytest.raises(exc, match="name"):
        rt.lookup(bad)


def test_close_finishes_whatever_fails_inside_it(monkeypatch):
    """A directory that fails (the OSError the long names met) does not stop a close: every
    window is retired and every segment released."""
    before = _mine()
    rt = memsem.Runtime(timeout=5, job=f"close-broken-{os.getpid()}")  # its records stay: a job of its own
    folder = rt.directory.path
    rt.publish(np.ones(1 << 16, np.uint8), name="a")
    rt.publish(np.ones(1 << 12, np.uint8), name="b", slots=2)
    rt.publish_state_dict({"w": np.ones(64, np.float32)}, name="sd")
    assert _mine() - before

    def broken(*args, **kwargs):
        raise OSError(errno.ENAMETOOLONG, "File name too long")

    monkeypatch.setattr(rt.directory, "remove_window", broken)
    monkeypatch.setattr(rt.directory, "release_rank", broken)
    rt.close()
    assert rt.closed
    assert _mine() - before == set(), "close left segments"
    rt.close()  # safe twice
    # the records the broken directory could not remove (the job's folder: nothing else uses it)
    assert os.path.isdir(folder)
    shutil.rmtree(folder)


# -- one owner ---------------------------------------------------------------------------------
def test_a_live_name_has_one_owner(directory):
    with memsem.Runtime(timeout=10) as a, memsem.Runtime(timeout=10) as b, memsem.Runtime(timeout=10) as c:
        ra = a.publish(np.full(4, 1, np.float32), name="policy")
        with pytest.raises(NameHeldError) as ei:
            b.publish(np.full(4, 2, np.float32), name="policy")
        e = ei.value
        assert e.name == "policy" and e.holder["pid"] == os.getpid() and e.holder["rank"] == a.rank
        assert f"rank {a.rank}" in str(e) and "replace=True" in str(e)
        assert (c.lookup("policy").get() == 1).all()
        assert b.stats().windows_published == 0
        # the owner republishes its own name
        a.publish(np.full(4, 3, np.float32), name="policy", replace=True)
        assert (c.lookup("policy").get() == 3).all()
        # b takes it over explicitly; a's window keeps working through its refs
        b.publish(np.full(4, 4, np.float32), name="policy", replace=True)
        assert (c.lookup("policy").get() == 4).all()
        assert (a.lookup("policy").get() == 4).all()
        with pytest.raises(memsem.WindowRetiredError):
            ra.get()  # (republished by a before: its first generation is retired)
        # a lost the name: its publish under it is refused now, naming b
        with pytest.raises(NameHeldError) as ei:
            a.publish(np.full(4, 5, np.float32), name="policy")
        assert ei.value.holder["rank"] == b.rank
        # a's exit leaves b's name alone
        a.close()
        assert (c.lookup("policy").get() == 4).all()
        b.close()
        with pytest.raises(WindowNotFoundError):
            c.lookup("policy")
        c.publish(np.zeros(4, np.float32), name="policy")  # free again


def _holder(conn, name: str) -> None:
    with memsem.Runtime(timeout=10) as rt:
        rt.publish(np.full(4, os.getpid(), np.int64), name=name)
        conn.send(os.getpid())
        conn.recv()  # killed while it waits here


def test_a_dead_holders_name_is_taken_over(directory):
    from tests._proc import reap, recv, spawn

    p, conn = spawn(_holder, "policy")
    try:
        pid = recv(conn)
        with memsem.Runtime(timeout=10) as rt:
            with pytest.raises(NameHeldError):
                rt.publish(np.zeros(4, np.int64), name="policy")
            p.kill()
            p.join(10)
            rt.publish(np.zeros(4, np.int64), name="policy")  # the holder is dead: taken over
            assert (rt.lookup("policy").get() == 0).all()
            assert pid != os.getpid()
    finally:
        reap([p])


def _contender(i: int, barrier, done, q) -> None:
    try:
        with memsem.Runtime(timeout=30) as rt:
            barrier.wait(60)
            try:
                rt.publish(np.full(4, os.getpid(), np.int64), name="policy")
                q.put((i, "won", os.getpid()))
            except NameHeldError as exc:
                q.put((i, "held", exc.holder.get("pid")))
            done.wait(60)  # the winner lives while the others report
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put((i, "error", repr(exc)))


@pytest.mark.multiproc
@pytest.mark.parametrize("n", [1, 2, 4])
def test_concurrent_publishers_in_several_processes(directory, n):
    """n processes publish one name at the same instant (a barrier): exactly one owns it, every
    other is told who does, and a lookup reads the winner's bytes."""
    barrier, done, q = SPAWN.Barrier(n), SPAWN.Event(), SPAWN.Queue()
    procs = [SPAWN.Process(target=_contender, args=(i, barrier, done, q), daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=120) for _ in range(n)]
        assert not [g for g in got if g[1] == "error"], got
        winners = [pid for _, what, pid in got if what == "won"]
        assert len(winners) == 1, got
        assert all(pid == winners[0] for _, what, pid in got if what == "held"), got
        with memsem.Runtime(timeout=10) as rt:
            assert (rt.lookup("policy").get() == winners[0]).all()
    finally:
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


# -- jobs ----------------------------------------------------------------------------------------
_JOB_CHILD = textwrap.dedent("""
    import os, sys, numpy as np, memsem
    with memsem.Runtime(timeout=10) as rt:
        try:
            rt.publish(np.full(4, os.getpid(), np.int64), name="policy")
            got = int(rt.lookup("policy").get()[0])
            print("won", rt.directory.job, got, flush=True)
        except memsem.NameHeldError as exc:
            print("held", rt.directory.job, exc.holder.get("pid"), flush=True)
        sys.stdin.read()  # live until the test closes stdin
""")


def _job_children(new_session: bool, n: int = 2) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("MEMSEM_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    procs = []
    out = []
    try:
        for _ in range(n):
            p = subprocess.Popen([sys.executable, "-c", _JOB_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=env, start_new_session=new_session)
            procs.append(p)
            out.append(p.stdout.readline().split())  # one at a time: the order is forced
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return out


def test_two_runs_on_one_node_never_meet_by_default():
    """Two runs started separately (each its own session: another process group) publish the
    same name with no MEMSEM_JOB: each owns it in its own job and reads its own bytes."""
    (w1, job1, v1), (w2, job2, v2) = _job_children(new_session=True)
    assert (w1, w2) == ("won", "won") and job1 != job2
    assert job1.startswith("pg") and job2.startswith("pg")
    assert v1 != v2


def test_the_processes_of_one_run_share_its_default_job():
    """Processes one command starts (one process group) share the derived job: the second
    publisher of the name is refused, naming the first."""
    (w1, job1, v1), (w2, job2, holder) = _job_children(new_session=False)
    assert (w1, w2) == ("won", "held") and job1 == job2 == f"pg{os.getpgrp()}"
    assert holder == v1


def test_an_explicit_job_is_shared_and_a_launchers_run_id_scopes_the_default(monkeypatch):
    from memsem.directory import default_job

    monkeypatch.delenv("MEMSEM_JOB")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert default_job() == f"pg{os.getpgrp()}"
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert default_job() == "slurm-4711"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's static rendezvous: not a run id
    assert default_job() == "slurm-4711"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a1b2:c3")
    assert default_job() == "torchrun-a1b2_c3"
    monkeypatch.setenv("MEMSEM_JOB", "shared")
    assert default_job() == "shared"
    with memsem.Runtime(timeout=5) as a, memsem.Runtime(timeout=5, job="other") as b:
        a.publish(np.ones(2), name="policy")
        b.publish(np.ones(2), name="policy")  # another job: another namespace
        assert a.directory.job == "shared" and b.directory.job == "other"


# -- lookup --------------------------------------------------------------------------------------
def test_a_name_that_never_appeared_says_so_with_the_job_hint(monkeypatch):
    """A lookup's or a follower's timeout on a name that never appeared names the name, the job
    and (for a job derived from the process group) MEMSEM_JOB in its own message, not only in
    a chained cause; a job that was named gets no such hint."""
    for var in ("MEMSEM_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    with memsem.Runtime(timeout=5) as rt:
        job = rt.directory.job
        with pytest.raises(memsem.MemsemTimeoutError) as info:
            rt.lookup("never", timeout=0.05)
        assert f"'never' in job '{job}'" in str(info.value) and "MEMSEM_JOB" in str(info.value)
        with pytest.raises(memsem.MemsemTimeoutError) as info:
            next(rt.follow("never", timeout=0.05))
        msg = str(info.value)
        assert msg.startswith("a version after 0 of window 'never' not loaded")
        assert "'never' in job" in msg and "not published" in msg and "MEMSEM_JOB" in msg
    with memsem.Runtime(timeout=5, job="named") as rt:
        with pytest.raises(memsem.MemsemTimeoutError) as info:
            next(rt.follow("never", timeout=0.05))
        assert "in job 'named'" in str(info.value) and "MEMSEM_JOB" not in str(info.value)


def test_lookup_waits_for_a_name_to_appear(directory):
    """A follower started before its trainer published: lookup(timeout=) waits (the order is
    forced: the publish happens only after the lookup read the directory and found nothing)."""
    import threading

    with memsem.Runtime(timeout=10) as trainer, memsem.Runtime(timeout=10) as follower:
        d = follower.directory
        real = d.lookup
        missed = threading.Event()

        def lookup(name):
            gva = real(name)
            if gva is None:
                missed.set()
            return gva

        d.lookup = lookup
        out = []
        t = threading.Thread(target=lambda: out.append(follower.lookup("late", timeout=60)))
        t.start()
        assert missed.wait(60)
        trainer.publish(np.full(4, 9, np.float32), name="late")
        t.join(60)
        assert not t.is_alive() and (out[0].get() == 9).all()
        with pytest.raises(memsem.MemsemTimeoutError, match="'never'") as ei:
            follower.lookup("never", timeout=0.2)
        assert isinstance(ei.value.__cause__, WindowNotFoundError)
        for bad in (-1, float("nan"), True, "1"):
            with pytest.raises((TypeError, ValueError), match="timeout"):
                follower.lookup("late", timeout=bad)


def test_a_lookup_racing_a_republish_never_returns_the_retired_generation(directory):
    """The directory read of a lookup is forced to return the record of the generation a
    republish retires meanwhile: the lookup checks the window itself and reads again."""
    with memsem.Runtime(timeout=10) as owner, memsem.Runtime(timeout=10) as reader:
        old = owner.publish(np.full(4, 1, np.float32), name="w")
        d = reader.directory
        real = d.window_with_key
        stale = real(old.spec.gva)
        calls = []

        def window_with_key(gva):
            calls.append(gva)
            if len(calls) == 1:
                owner.publish(np.full(4, 2, np.float32), name="w", replace=True)  # republished after the read
                return stale
            return real(gva)

        d.window_with_key = window_with_key
        ref = reader.lookup("w")
        assert len(calls) >= 2 and ref.spec.generation != old.spec.generation
        assert (ref.get() == 2).all()
