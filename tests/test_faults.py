"""Faults, resource lifecycle and access control (issue 4, cases 3-6, plus keys and timeouts).

Participants are real processes (``tests._agent.Agent``, spawn) killed with SIGKILL; every wait
is bounded.
"""
from __future__ import annotations

import inspect
import os
import secrets
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import memsem
from memsem.engines.host import HostEngine
from memsem.testing import ScriptedEngine
from memsem.core._liveness import LIVENESS_INTERVAL_S
from memsem.gva import RefSpec
from memsem.native import segment_dir, segment_prefix
from memsem.core import collect
from tests._proc import Gate
from tests._agent import Agent, pattern
from tests.conftest import SPAWN

pytestmark = pytest.mark.multiproc
MiB = 1 << 20


def _spec(ref: memsem.TensorRef, **change) -> RefSpec:
    s = ref.spec
    fields = dict(gva=s.gva, generation=s.generation, key=s.key, access=s.access, offset=s.offset,
                  nbytes=s.nbytes, dtype_code=s.dtype_code, shape=s.shape, byte_offset=s.byte_offset,
                  framework=s.framework, name=s.name)
    fields.update(change)
    if "nbytes" in change and "shape" not in change:
        fields["shape"] = (change["nbytes"] // np.dtype(ref.dtype).itemsize,)
    return RefSpec(**fields)


def _segments_of(pid: int) -> set[str]:
    tag = f".{pid}-"
    return {n for n in os.listdir(segment_dir()) if n.startswith(segment_prefix()) and tag in n}


# -- case 3: the owner dies in the middle of a 256 MiB get --------------------------------------
@pytest.mark.parametrize("shared", [False, True], ids=["cma", "shm"])
def test_case3_owner_killed_during_256MiB_get(rt, shared):
    """Native path, not slowed: the owner is SIGKILLed while this process's 256 MiB copy is in
    flight (the test sees its own in-flight mark in the window's control block before it kills:
    the order is forced, not hoped for). With CMA the read fails (ESRCH); with a shared segment
    the copy may finish from the still-mapped pages. Either way the get returns intact bytes or
    raises PeerLostError, and once the owner is gone every later get raises PeerLostError (a
    copy of 256 KiB or more re-checks the owner's liveness every time)."""
    from memsem.gva._control_block import identity_of

    owner = Agent(SPAWN, timeout=5.0)
    try:
        ref = rt.ref(owner.call("publish_big", 256 * MiB, shared))
        assert rt.route(ref).kind == ("host/shm" if shared else "host/cma")
        out = np.empty(256 * MiB, np.uint8)
        ref.get(out)  # resolve and fault in ``out``
        cb = rt.resolve(ref.spec).cb
        out[:] = 0
        c = ref.get_async(out)
        deadline = time.monotonic() + 60
        while not any(identity_of(i)[0] == os.getpid() and n for i, n in cb.busy_inflight()):
            if c.done() or time.monotonic() > deadline:
                break  # the copy outran the polling: the outcome checks below still hold
            time.sleep(0)
        owner.kill()  # SIGKILL and reap: the owner is gone when this returns
        try:
            c.wait(30.0)
        except memsem.PeerLostError as exc:
            assert "dead" in str(exc)
        else:
            assert (out == 7).all(), "a get that raced the owner's death returned damaged bytes"
        with pytest.raises(memsem.PeerLostError):  # and every later access
            ref.get(out)
    finally:
        owner.kill()




@pytest.mark.parametrize("shared", [False, True], ids=["cma", "shm"])
def test_case3_owner_killed_during_slowed_get(rt, shared):
    """Deterministic: the get is held inside the engine, the owner is killed and reaped, then
    the copy proceeds. CMA: the read fails (ESRCH); shm: the copy succeeds from the mapping and
    the post-copy liveness check catches the death. Either way PeerLostError, no bytes valid."""
    owner = Agent(SPAWN, timeout=5.0)
    gate = Gate()
    try:
        refbytes = owner.call("publish_big", 256 * MiB, shared)
        with memsem.Runtime(timeout=5, engines=["host"],
                            engine_objects={"host": ScriptedEngine(HostEngine(), before=gate)}) as cons:
            ref = cons.ref(refbytes)
            c = ref.get_async()
            assert gate.entered.wait(60)
            owner.kill()
            gate.open.set()
            with pytest.raises(memsem.PeerLostError) as ei:
                c.wait(30.0)
            if not shared:
                assert isinstance(ei.value.__cause__, memsem.EngineError)  # the read itself failed
    finally:
        gate.open.set()
        owner.kill()


def test_small_get_from_dead_shm_owner_raises(rt):
    """A dead owner's shared segment stays mapped here; even small gets (below the per-copy
    liveness threshold) raise PeerLostError once the periodic liveness check runs."""
    owner = Agent(SPAWN, timeout=5.0)
    try:
        ref = rt.ref(owner.call("publish", 1, 4096, True, "r", None))
        assert (ref.get() == pattern(1, 4096)).all()
        owner.kill()
        # The liveness interval is memsem's bound for small copies: once it has passed (a
        # sleep is a lower bound of elapsed time, so load cannot break this), a get re-checks.
        time.sleep(LIVENESS_INTERVAL_S)
        with pytest.raises(memsem.PeerLostError):
            ref.get()
    finally:
        owner.kill()


# -- case 4: xcopy with a range outside the window ----------------------------------------------
def _five_ranges(ref: memsem.TensorRef, n: int):
    specs = [_spec(ref, offset=i * n, nbytes=n) for i in range(5)]
    specs[2] = _spec(ref, offset=ref.nbytes - n // 2, nbytes=n)  # runs past the window's end
    return [(memsem.TensorRef(s, ref.runtime), np.zeros(n, np.uint8)) for s in specs]


@pytest.mark.parametrize("where", ["local", "remote"])
def test_case4_xcopy_range_outside_window(rt, where):
    n = 4096
    data = pattern(41, 5 * n)
    if where == "local":
        ref = rt.publish(data)
        agent = None
    else:
        agent = Agent(SPAWN, timeout=5.0)
        ref = rt.ref(agent.call("publish", 41, 5 * n, False, "r", None))
    try:
        pairs = _five_ranges(ref, n)
        with rt.xcopy(pairs) as batch:
            results = batch.wait(10.0)
        assert [r.state for r in results] == [memsem.State.DONE, memsem.State.DONE, memsem.State.FAILED,
                                              memsem.State.DONE, memsem.State.DONE]
        assert all(r.state.final for r in results) and batch.done()
        err = results[2].error
        assert isinstance(err, ValueError) and "outside" in str(err), err
        for i in (0, 1, 3, 4):
            assert (pairs[i][1] == data[i * n:(i + 1) * n]).all()
        with pytest.raises(memsem.MemsemError, match="1 of 5 ranges failed; first, range 2"):
            batch.raise_for_errors()
        batch.close()  # safe again
    finally:
        if agent is not None:
            agent.stop()


def test_xcopy_engine_failure_and_reclaim(rt):
    """A failing engine op fails only its range (EngineError); close() reclaims a batch whose
    ranges have not all started (CANCELLED) and leaves every range final."""
    n = 1024
    data = pattern(42, 8 * n)
    ref = rt.publish(data)
    eng = ScriptedEngine(HostEngine(), delay=0.05, fail=lambda kind, off, nb: off == 2 * n)
    with memsem.Runtime(timeout=5, engines=["host"], engine_objects={"host": eng}, workers=1) as cons:
        cref = cons.ref(ref.to_bytes())
        pairs = [(cref.bytes(i * n, n), np.zeros(n, np.uint8)) for i in range(5)]
        results = cons.xcopy(pairs).wait(10.0)
        assert [r.state.name for r in results] == ["DONE", "DONE", "FAILED", "DONE", "DONE"]
        assert isinstance(results[2].error, memsem.EngineError) and "SCRIPTED" in str(results[2].error)
        batch = cons.xcopy([(cref.bytes(i * n, n), np.zeros(n, np.uint8)) for i in range(8)])
        batch.close(timeout=10.0)
        states = [r.state for r in batch.results]
        assert all(s.final for s in states) and memsem.State.CANCELLED in states, states


# -- case 5: a peer dies while another process resolves refs to it ------------------------------
def test_case5_kill_owner_while_peer_resolves(rt):
    owner = Agent(SPAWN, timeout=5.0)
    resolver = Agent(SPAWN, timeout=5.0)
    try:
        refbytes = owner.call("publish", 51, 64 * 1024, True, "r", "victim")
        resolver.send("loop_get", refbytes, 1.5)
        time.sleep(0.5)
        owner.kill()
        stop = time.monotonic() + 0.8
        while time.monotonic() < stop:  # gc races the resolver's attach of the dead segments
            collect()
        outcomes = resolver.result(30.0)
        assert resolver.proc.is_alive() and resolver.call("pid") == resolver.pid  # no crash
        allowed = {"ok", "PeerLostError", "StaleReferenceError", "WindowRetiredError", "WindowNotFoundError"}
        assert set(outcomes) <= allowed, set(outcomes) - allowed
        first_err = next(i for i, o in enumerate(outcomes) if o != "ok")
        assert outcomes[:first_err].count("ok") > 0
        assert "ok" not in outcomes[first_err:], "bytes served after the owner was seen dead"
    finally:
        owner.kill()
        resolver.stop()


# -- case 6: kill -9 leaves no segments behind --------------------------------------------------
@pytest.fixture
def private_shm(monkeypatch):
    """A segment directory of this test alone (MEMSEM_SHM_DIR, inherited by children): other
    memsem processes of this user (their Runtime starts run gc too) cannot race its listings."""
    import shutil

    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"memsem-test-{secrets.token_hex(6)}")
    os.mkdir(path, 0o700)
    monkeypatch.setenv("MEMSEM_SHM_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _gc_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memsem.cli", "gc", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))


@pytest.mark.parametrize("reaper", ["runtime_start", "memsem_gc"])
def test_case6_kill9_owner_and_consumer_leave_no_segments(private_shm, reaper):
    rt = memsem.Runtime(timeout=10)
    assert segment_dir() == private_shm
    live = Agent(SPAWN, timeout=5.0)
    owner = Agent(SPAWN, timeout=5.0)
    consumer = Agent(SPAWN, timeout=5.0)
    try:
        live_ref = live.call("publish", 60, 4096, True, "r", "live")
        shm_ref = owner.call("publish", 61, 4096, True, "rw", "o-shm")
        owner.call("publish", 62, 4096, False, "rw", "o-private")
        consumer.call("publish", 63, 4096, True, "r", "c-own")  # consumers own segments too
        lid = consumer.call("lease", shm_ref, None)
        consumer.call("view", shm_ref, lid)
        mine = rt.publish(rt.alloc(4096, np.uint8))
        dead = {owner.pid: _segments_of(owner.pid), consumer.pid: _segments_of(consumer.pid)}
        assert all(dead.values()), dead
        keep = _segments_of(live.pid) | _segments_of(os.getpid())
        assert _segments_of(live.pid)
        owner.kill()
        consumer.kill()

        dry = _gc_cli("--dry-run")
        assert dry.returncode == 0, dry.stderr
        for pid, names in dead.items():
            for name in names:
                line = next((ln for ln in dry.stdout.splitlines() if name in ln), None)
                assert line is not None, f"{name} not listed:\n{dry.stdout}"
                assert line.startswith("would remove") and f"dead process {pid}" in line
            assert _segments_of(pid) == names  # dry run removed nothing
        assert "rank" in dry.stdout  # the dead participants' directory records are listed too

        if reaper == "runtime_start":
            memsem.Runtime(timeout=5).close()
        else:
            out = _gc_cli()
            assert out.returncode == 0 and "removed" in out.stdout, out.stderr
        for pid in dead:
            assert _segments_of(pid) == set(), f"segments of dead pid {pid} left behind"
        assert keep <= _segments_of(live.pid) | _segments_of(os.getpid()), "a live process lost a segment"
        assert rt.ref(live_ref).get().tobytes() == pattern(60, 4096).tobytes()
        assert (mine.get() == 0).all()
    finally:
        for a in (owner, consumer):
            a.kill()
        live.stop()
        rt.close()


# -- access control -----------------------------------------------------------------------------
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached"])
def test_wrong_key_moves_no_byte(rt, cached):
    owner = Agent(SPAWN, timeout=5.0)
    try:
        ref = rt.ref(owner.call("publish", 70, 4096, True, "rw", None))
        if cached:  # this runtime already resolved the window with the genuine key
            assert (ref.get() == pattern(70, 4096)).all()
        forged = memsem.TensorRef(_spec(ref, key=secrets.token_bytes(16)), rt)
        out = np.full(4096, 0x55, np.uint8)
        with pytest.raises(memsem.AccessDeniedError, match="wrong access key"):
            forged.get(out)
        assert (out == 0x55).all()
        with pytest.raises(memsem.AccessDeniedError):
            forged.put(np.zeros(4096, np.uint8))
        with pytest.raises(memsem.AccessDeniedError):
            forged.lease(ttl=1.0).acquire()
        with pytest.raises(memsem.AccessDeniedError):
            forged.view()
        assert (ref.get() == pattern(70, 4096)).all()  # the window is untouched
        stale = memsem.TensorRef(_spec(ref, generation=ref.generation + 1), rt)
        with pytest.raises(memsem.StaleReferenceError):
            stale.get()
    finally:
        owner.kill()


def test_write_needs_rw(rt):
    ro = rt.publish(np.zeros(64, np.uint8), access="r")
    with pytest.raises(memsem.AccessDeniedError, match="read-only"):
        ro.put(np.ones(64, np.uint8))
    forged_rw = memsem.TensorRef(_spec(ro, access="rw"), rt)  # flipping the flag does not help
    with pytest.raises(memsem.AccessDeniedError, match="published read-only"):
        forged_rw.put(np.ones(64, np.uint8))
    assert (ro.get() == 0).all()
    ro_arr = np.zeros(8, np.uint8)
    ro_arr.flags.writeable = False
    with pytest.raises(memsem.AccessDeniedError):
        rt.publish(ro_arr, access="rw")


def test_segments_0600_directory_0700(rt):
    ref = rt.publish(rt.alloc(4096, np.uint8))
    res = rt.resolve(ref.spec)
    for name in (res.info.control, res.info.descriptors["host"].fields["segment"]):
        mode = stat.S_IMODE(os.stat(os.path.join(segment_dir(), name)).st_mode)
        assert mode == 0o600, (name, oct(mode))
    mode = stat.S_IMODE(os.stat(rt.directory.path).st_mode)
    assert mode == 0o700, oct(mode)


# -- every blocking call has a timeout ----------------------------------------------------------
def test_blocking_calls_take_a_timeout():
    from memsem.pipeline import Pipeline

    for fn in (memsem.Completion.wait, memsem.Batch.wait, memsem.Batch.close, memsem.Runtime.unpublish,
               memsem.core.RuntimeCore.wait_tile, memsem.Runtime.close, memsem.TensorRef.wait_tile, Pipeline.__init__):
        assert "timeout" in inspect.signature(fn).parameters, fn.__qualname__
    assert issubclass(memsem.MemsemTimeoutError, TimeoutError)


def test_blocking_calls_time_out(rt):
    """Every blocking call ends at its timeout with an error naming what it waited for. The
    operations waited on are held (a gate in the engine), so the timeouts surely expire; no
    duration is asserted (a loaded machine may stretch any of them)."""
    data = pattern(80, 4096)
    ref = rt.publish(data, tiles=4)
    gate = Gate()
    with memsem.Runtime(timeout=5, engines=["host"],
                        engine_objects={"host": ScriptedEngine(HostEngine(), before=gate)}) as cons:
        cref = cons.ref(ref.to_bytes())
        c = cref.get_async()
        with pytest.raises(TimeoutError) as ei:
            c.wait(0.05)
        assert ei.value.what.startswith("get of") and ei.value.timeout == 0.05
        batch = cons.xcopy([(cref.bytes(0, 1024), np.zeros(1024, np.uint8))])
        with pytest.raises(memsem.MemsemTimeoutError, match="not final"):
            batch.wait(0.05)
        gate.open.set()
        c.wait(30.0)
        batch.close(30.0)
    with pytest.raises(memsem.MemsemTimeoutError, match="tile 1") as ei:
        ref.wait_tile(1, timeout=0.1)
    assert ei.value.timeout == 0.1
    lease = ref.lease(ttl=None).acquire()
    with pytest.raises(memsem.LeaseHeldError):
        rt.unpublish(ref, timeout=0.1)
    lease.release()


def test_gc_dry_run_lists_nothing_of_live_processes(private_shm):
    with memsem.Runtime(timeout=10) as rt:
        rt.publish(rt.alloc(64, np.uint8))
        mine = _segments_of(os.getpid())
        assert mine
        out = _gc_cli("--dry-run")
        assert out.returncode == 0
        assert out.stdout.strip().splitlines() == ["0 item(s) would be removed (dry run), 0 skipped"]
        assert _segments_of(os.getpid()) == mine
