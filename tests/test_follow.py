"""Versions that say what they are, and the follower loop (issue 22), on one node.

* Labels against the bytes under an owner committing write sections back to back, each
  version's bytes being the version: every read of "the latest" (get, get into out, a state
  dict's load and stream, on a shared segment, private memory through cross-memory attach, a
  double-buffered window) says which version it returned, and its bytes are that one.
* The follower: not yet published, versions in order and bit-exact, a republish, the owner's
  death and a new owner, a version gone under a load, a timeout, async, a followable source,
  caller mistakes raised at once. Orders are forced (gates, a child that waits to be told),
  never timed.
"""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import memsem
from memsem import MemsemTimeoutError, VersionGoneError
from tests._proc import reap, recv, spawn

N = 1 << 16


# -- labels agree with bytes ---------------------------------------------------------------------
def _versioned_owner(conn, n: int) -> None:
    """Publishes windows whose bytes are their version (a shared segment, private memory, a
    double-buffered window, state dicts of one and two slots) and commits write sections on all
    of them back to back until told to stop."""
    with memsem.Runtime(timeout=30.0) as rt:
        shm = rt.alloc(n, np.int64)
        shm[:] = 1
        refs = {"shm": rt.publish(shm, name="shm", access="r"),
                "cma": rt.publish(np.ones(n, np.int64), name="cma", access="r"),
                "slots2": rt.publish(np.ones(n, np.int64), name="slots2", slots=2)}
        sds = {f"sd{k}": rt.publish_state_dict({f"t{i}": np.ones(n // 4, np.int64) for i in range(4)},
                                               name=f"sd{k}", slots=k) for k in (1, 2)}
        conn.send("ready")
        commits = 0
        while not conn.poll():
            for r in refs.values():
                with rt.write_section(r, copy=False) as sec:
                    sec.array()[...] = sec.version
            for sd in sds.values():
                with sd.write_section(copy=False) as sec:
                    for t in sec.tensors.values():
                        t[...] = sec.version
            commits += 1
        conn.recv()
        conn.send(commits)


@pytest.mark.multiproc
def test_labels_agree_with_the_bytes_under_a_fast_writer():
    p, conn = spawn(_versioned_owner, N)
    try:
        assert recv(conn) == "ready"
        with memsem.Runtime(timeout=30.0) as rt:
            routes = {}
            for name in ("shm", "cma", "slots2"):
                ref = rt.lookup(name)
                routes[name] = rt.route(ref).kind
                out = np.empty(N, np.int64)
                seen = set()
                for i in range(1000):
                    if i >= 200 and len(seen) > 1:
                        break
                    if i >= 200:  # the writer was descheduled all along (a loaded machine): wait for its commit
                        ref.wait_version(max(seen) + 1, timeout=30)
                    pre = ref.version()
                    if i % 2:
                        v, got = ref.get(out, with_version=True)
                    else:
                        v, got = ref.get(with_version=True)
                    post = ref.version()
                    assert (got == v).all(), (name, v, np.unique(got)[:4])
                    assert pre <= v <= post, (name, pre, v, post)
                    seen.add(v)
                assert len(seen) > 1, name  # the writer was committing meanwhile
            for name in ("sd1", "sd2"):
                sd = rt.lookup_state_dict(name)
                into = sd.empty_like()
                for _ in range(50):
                    pre = sd.version()
                    v = sd.load(into)
                    assert all((t == v).all() for t in into.values()), name
                    assert pre <= v <= sd.version()
                    v2, got = sd.get(with_version=True)
                    assert all((t == v2).all() for t in got.values())
                for _ in range(5):
                    buckets = list(sd.stream(into))
                    assert len({b.version for b in buckets}) == 1
                    for b in buckets:
                        i, tensors = b
                        assert i == b.index and all((t == b.version).all() for t in tensors.values())
            assert routes["shm"] != routes["cma"], routes  # mapped segment vs cross-memory attach
        conn.send("stop")
        assert recv(conn) > 0
    finally:
        reap([p])


# -- the follower ----------------------------------------------------------------------------------
def _trainer(conn, name: str, n: int) -> None:
    """A trainer that publishes ``name`` when told, then commits one version per command
    ("commit" -> the version), republishes ("republish"), or idles until killed."""
    with memsem.Runtime(timeout=30.0) as rt:
        sd = None
        while True:
            cmd = conn.recv()
            if cmd == "publish" or cmd == "republish":
                sd = rt.publish_state_dict({"w": np.ones(n, np.float32), "step": np.ones((), np.int64)},
                                           name=name, replace=cmd == "republish")
                conn.send((sd.spec.generation, 1))
            elif cmd == "commit":
                with sd.write_section(copy=False) as sec:
                    sec.tensors["w"][...] = sec.version
                    sec.tensors["step"][...] = sec.version
                conn.send(sec.version)
            elif cmd == "exit":
                conn.send("bye")
                return


class _Misses:
    """Counts the directory reads of a name that found nothing (a lookup is waiting)."""

    def __init__(self, directory) -> None:
        self.real = directory.lookup
        self.missed = threading.Event()
        directory.lookup = self

    def __call__(self, name):
        gva = self.real(name)
        if gva is None:
            self.missed.set()
        return gva


@pytest.mark.multiproc
def test_the_follower_loop_through_publish_republish_death_and_a_new_owner():
    with memsem.Runtime(timeout=30.0) as rt:
        misses = _Misses(rt.directory)
        f = rt.follow("policy", timeout=60)
        got: list = []
        gate = threading.Semaphore(0)
        stop = threading.Event()

        def run() -> None:
            try:
                for v, t in f:
                    assert (t["w"] == v).all() and int(t["step"]) == v, (v, t["w"][0], t["step"])
                    got.append((f.generation, v))
                    gate.release()
                    if stop.is_set():
                        return
            except BaseException as exc:  # noqa: BLE001 - checked by the test
                got.append(exc)
                gate.release()

        th = threading.Thread(target=run, daemon=True)
        th.start()
        p1, c1 = spawn(_trainer, "policy", 4096)
        p2 = None
        try:
            assert misses.missed.wait(60)  # the follower is waiting for the name
            c1.send("publish")
            gen1, _ = recv(c1)
            assert gate.acquire(timeout=60) and got[-1] == (gen1, 1)
            for want in (2, 3, 4):
                c1.send("commit")
                assert recv(c1) == want
                assert gate.acquire(timeout=60) and got[-1] == (gen1, want), got
            c1.send("republish")  # a new generation: versions count from 1 again
            gen2, _ = recv(c1)
            c1.send("commit")
            assert recv(c1) == 2
            while got[-1] != (gen2, 2):
                assert gate.acquire(timeout=60), got
            assert gen2 != gen1
            assert {("look up again", "WindowRetiredError"), ("look up again", "WindowNotFoundError")} & \
                set(f.recovered), f.recovered
            p1.kill()  # the owner dies; a new one publishes the name and takes it over
            p1.join(10)
            p2, c2 = spawn(_trainer, "policy", 4096)
            c2.send("publish")
            gen3, _ = recv(c2)
            stop.set()
            c2.send("commit")
            assert recv(c2) == 2
            while not got or got[-1][0] != gen3:
                assert gate.acquire(timeout=60), got
            th.join(60)
            assert not th.is_alive()
            assert got[-1][0] == gen3 and f.loads == len(got)
            assert [v for g, v in got if g == gen1] == [1, 2, 3, 4]
            c2.send("exit")
            recv(c2)
        finally:
            stop.set()
            reap([p for p in (p1, p2) if p is not None])


def test_a_follower_times_out_naming_what_it_waited_for(rt):
    ref = rt.publish_state_dict({"w": np.ones(8, np.float32)}, name="quiet")
    f = rt.follow("quiet", timeout=0.3)
    v, t = next(f)
    assert v == 1 and (t["w"] == 1).all()
    with pytest.raises(MemsemTimeoutError, match="after 1 of window 'quiet'") as ei:
        next(f)
    assert ei.value.timeout == 0.3
    ref.update({"w": np.full(8, 2, np.float32)})
    assert next(f)[0] == 2  # the follower goes on after a timeout
    with pytest.raises(MemsemTimeoutError, match="'never'"):
        next(rt.follow("never", timeout=0.2))


def test_a_version_gone_under_a_load_is_loaded_again(rt, monkeypatch):
    """The load meets VersionGoneError once (the owner overwrote the version under it): the
    follower loads again and yields the latest, never the error."""
    sd = rt.publish_state_dict({"w": np.ones(8, np.float32)}, name="w")
    sd.update({"w": np.full(8, 2, np.float32)})
    real = memsem.StateDictRef.load
    calls = []

    def load(self, into, **kw):
        calls.append(kw)
        if len(calls) == 1:
            raise VersionGoneError("gone", wanted=1, found=2)
        return real(self, into, **kw)

    monkeypatch.setattr(memsem.StateDictRef, "load", load)
    f = rt.follow("w", timeout=10)
    v, t = next(f)
    assert v == 2 and (t["w"] == 2).all() and len(calls) == 2
    assert f.recovered == [("load again", "VersionGoneError")]


def test_following_a_tensor_window_and_a_ref(rt):
    a = np.zeros(16, np.float32)
    ref = rt.publish(a, name="t")
    into = np.empty(16, np.float32)
    f = rt.follow(ref, into=into, timeout=5)
    assert next(f) == (1, into)
    with rt.write_section(ref):
        a[:] = 5
    v, out = next(f)
    assert v == 2 and out is into and (into == 5).all()
    g = rt.follow("t", timeout=5)  # allocated once, then reused
    v, first = next(g)
    with rt.write_section(ref):
        a[:] = 6
    v2, second = next(g)
    assert v2 == v + 1 and second is first and (second == 6).all()
    with pytest.raises(TypeError, match="dtype"):
        next(rt.follow("t", into=np.empty(16, np.int32), timeout=5))


def test_the_follower_drives_async_code(rt):
    sd = rt.publish_state_dict({"w": np.ones(64, np.float32)}, name="a")
    into = sd.empty_like()

    async def follow() -> list[int]:
        out = []
        async for v, t in rt.follow("a", into=into, timeout=10):
            assert (t["w"] == v).all()
            out.append(v)
            if v < 4:
                sd.update({"w": np.full(64, v + 1, np.float32)})
            else:
                return out
        return out

    assert asyncio.run(follow()) == [1, 2, 3, 4]


class _Followable:
    """A source shaped like memsem.Relay (version, wait_version, load): one version per load."""

    def __init__(self) -> None:
        self.latest = 0
        self.cond = threading.Condition()

    def commit(self) -> None:
        with self.cond:
            self.latest += 1
            self.cond.notify_all()

    def version(self) -> int:
        return self.latest

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        with self.cond:
            if not self.cond.wait_for(lambda: self.latest >= version, timeout):
                raise MemsemTimeoutError(f"version {version}", what="version", timeout=timeout)
            return self.latest

    def load(self, into=None, *, version: int = 0, timeout: float | None = None) -> int:
        v = self.wait_version(version or 1, timeout)
        into["w"][...] = v
        return v


def test_a_followable_source_such_as_a_relay(rt):
    src = _Followable()
    into = {"w": np.zeros(4)}
    assert isinstance(src, memsem.Followable)
    f = rt.follow(src, into=into, timeout=5)
    src.commit()
    assert next(f)[0] == 1
    src.commit()
    src.commit()
    v, t = next(f)
    assert v == 3 and (t["w"] == 3).all() and f.skipped == 1
    with pytest.raises(MemsemTimeoutError):
        rt.follow(src, into=into, timeout=0.1, after=3).next()
    with pytest.raises(ValueError, match="into"):
        rt.follow(src)


def test_a_sources_own_shorter_timeout_is_not_the_steps(rt):
    """The source's first wait_version ends with a timeout of its own (a bound shorter than the
    step's: a relay's attach_timeout); the step goes on within its own deadline and yields the
    version committed after that failure; the step's own timeout names the step."""

    class Impatient(_Followable):
        def __init__(self):
            super().__init__()
            self.failed = threading.Event()

        def wait_version(self, version, timeout=None):
            if not self.failed.is_set():
                self.failed.set()
                raise MemsemTimeoutError("the trainer's name not published after 0.2 s", what="name", timeout=0.2)
            return super().wait_version(version, timeout)

    src = Impatient()
    f = rt.follow(src, into={"w": np.zeros(4)}, timeout=30)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=f.next()), daemon=True)
    t.start()
    assert src.failed.wait(30)
    src.commit()
    t.join(30)
    assert not t.is_alive() and out["r"][0] == 1 and ("wait again", "MemsemTimeoutError") in f.recovered
    src.failed.clear()
    with pytest.raises(MemsemTimeoutError) as ei:
        rt.follow(src, into={"w": np.zeros(4)}, timeout=0.2, after=1).next()
    assert ei.value.what.startswith("a version after 0 of") and "not loaded after 0.2 s" in str(ei.value)


from tests.test_primitives import BAD_VERSIONS  # noqa: E402


@pytest.mark.parametrize("bad,exc", BAD_VERSIONS)
def test_follow_refuses_bad_versions_at_the_door(rt, bad, exc):
    with pytest.raises(exc, match="after"):
        rt.follow("x", after=bad)


@pytest.mark.parametrize("kw,exc", [({"timeout": -1}, ValueError), ({"timeout": True}, TypeError),
                                    ({"after": -1}, ValueError), ({"after": 1.5}, TypeError),
                                    ({"pin": 1}, TypeError), ({"pin_ttl": 0}, ValueError)])
def test_follow_refuses_bad_arguments_at_once(rt, kw, exc):
    with pytest.raises(exc):
        rt.follow("x", **kw)


def test_follow_refuses_bad_sources_and_destinations(rt):
    with pytest.raises(TypeError, match="source"):
        rt.follow(3)
    with pytest.raises(ValueError, match="255 bytes"):
        rt.follow("x" * 300)
    rt.publish_state_dict({"w": np.ones(4, np.float32)}, name="sd")
    f = rt.follow("sd", into={"other": np.ones(4, np.float32)}, timeout=5)
    with pytest.raises(KeyError, match="'w'"):
        next(f)  # a caller mistake is raised, never retried
