"""Leases: ttl, renew, release, views, reaping, and what the owner does on unpublish/republish.

Also the two lease cases of issue 4: a get racing unpublish (case 1) and a lease expiring during
a slowed get while the owner reclaims the window (case 2). Semantics: docs/leases.md.
"""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import memsem
from memsem.engines.host import HostEngine
from memsem.testing import ScriptedEngine
from tests._agent import Agent, pattern
from tests.conftest import SPAWN, run_children

MiB = 1 << 20


@pytest.fixture
def agent():
    with Agent(SPAWN, timeout=5.0) as a:
        yield a


def _consumer(delay: float = 0.0, timeout: float = 10.0) -> memsem.Runtime:
    """A second runtime in this process that reaches the owner's windows through the host
    engine (not loopback), optionally slowed: the consumer side of a cross-runtime transfer."""
    kw = {"engine_objects": {"host": ScriptedEngine(HostEngine(), delay=delay)}} if delay else {}
    return memsem.Runtime(timeout=timeout, engines=["host"], **kw)


# -- the lease object ---------------------------------------------------------------------------
def test_lease_lifecycle(rt):
    ref = rt.publish(np.arange(64, dtype=np.float32))
    lease = ref.lease(ttl=5.0)
    assert not lease.held and lease.remaining() == 0.0
    with lease as held:
        assert held is lease and lease.held
        assert 4.0 < lease.remaining() <= 5.0
        assert 9.0 < lease.renew(10.0) <= 10.0
        assert (ref.get(lease=lease) == np.arange(64)).all()
        with pytest.raises(memsem.MemsemError, match="already held"):
            lease.acquire()
    assert not lease.held and lease.remaining() == 0.0
    lease.release()  # safe twice
    with pytest.raises(memsem.LeaseExpiredError, match="not held"):
        lease.renew()
    with pytest.raises(ValueError, match="ttl"):
        ref.lease(ttl=0)


def test_renew_after_expiry_raises(rt):
    ref = rt.publish(np.zeros(16, np.uint8))
    lease = ref.lease(ttl=0.05).acquire()
    time.sleep(0.1)
    assert lease.remaining() < 0
    with pytest.raises(memsem.LeaseExpiredError, match="expired"):
        ref.get(lease=lease)
    with pytest.raises(memsem.LeaseExpiredError, match="expired before renew"):
        lease.renew(10.0)
    assert not lease.held  # a failed renew gives the slot back


def test_ttl_none_holds_until_release(rt):
    ref = rt.publish(np.zeros(16, np.uint8))
    with ref.lease(ttl=None) as lease:
        assert lease.remaining() > 1e6
        with pytest.raises(memsem.LeaseHeldError):
            rt.unpublish(ref, timeout=0.05)
    rt.unpublish(ref, timeout=0.05)


def test_lease_of_stale_ref_refused(rt):
    old = rt.publish(np.zeros(16, np.uint8), name="w")
    rt.publish(np.ones(16, np.uint8), name="w", replace=True)
    with pytest.raises(memsem.StaleReferenceError):
        old.lease(ttl=1.0).acquire()
    new = rt.lookup("w")
    other = rt.publish(np.zeros(8, np.uint8))
    with new.lease(ttl=1.0) as lease:
        with pytest.raises(ValueError, match="lease is for"):
            other.get(lease=lease)


def test_release_refused_while_view_lives(rt):
    a = rt.alloc(1024, np.uint8)
    a[:] = 3
    ref = rt.publish(a)
    lease = ref.lease(ttl=None).acquire()
    v = ref.view(lease=lease)
    with pytest.raises(memsem.MemsemError, match="still backs 1 view"):
        lease.release()
    assert lease.held and int(v.sum()) == 3 * 1024
    del v
    gc.collect()
    lease.release()
    assert not lease.held


def test_view_holds_a_lease_of_its_own(rt):
    a = rt.alloc(256, np.uint8)
    ref = rt.publish(a)
    v = ref.view()
    with pytest.raises(memsem.LeaseHeldError):
        rt.unpublish(ref, timeout=0.05)
    del v
    gc.collect()
    rt.unpublish(ref, timeout=1.0)


# -- the owner and other processes' leases ------------------------------------------------------
def test_unpublish_waits_then_names_holders(rt, agent):
    ref = rt.publish(pattern(1, 4096), name="held")
    lid = agent.call("lease", ref.to_bytes(), 30.0)
    t0 = time.monotonic()
    with pytest.raises(memsem.LeaseHeldError) as ei:
        rt.unpublish(ref, timeout=0.3)
    waited = time.monotonic() - t0
    assert waited >= 0.3  # it waited its whole timeout (a lower bound: load cannot break it)
    assert [p for p, _ in ei.value.holders] == [agent.pid]
    assert f"pid {agent.pid}" in str(ei.value) and "'held'" in str(ei.value)
    # The window stays published and usable, also for the holder.
    assert (ref.get() == pattern(1, 4096)).all()
    assert agent.call("get", ref.to_bytes(), lid) == pattern(1, 4096).tobytes()
    # Republish is refused the same way.
    rt.timeout = 0.1
    with pytest.raises(memsem.LeaseHeldError):
        rt.publish(pattern(2, 4096), name="held", replace=True)
    agent.call("release", lid)
    rt.unpublish(ref, timeout=1.0)
    with pytest.raises(memsem.StaleReferenceError):
        agent.call("get", ref.to_bytes())


def test_unpublish_proceeds_when_lease_expires(rt, agent):
    ref = rt.publish(pattern(3, 4096))
    lid = agent.call("lease", ref.to_bytes(), 0.4)
    cb = rt.publisher.owned[ref.spec.gva].cb
    [(_, _, _, expiry_ns, _)] = cb.unexpired_leases(0)
    rt.unpublish(ref, timeout=30.0)
    # Order, not duration: unpublish returned only once the lease had expired.
    assert memsem.native.monotonic_ns() >= expiry_ns
    with pytest.raises(memsem.LeaseExpiredError):
        agent.call("renew", lid)


def test_dead_consumer_leases_reaped(rt):
    ref = rt.publish(pattern(4, 4096))
    a = Agent(SPAWN, timeout=5.0)
    try:
        a.call("lease", ref.to_bytes(), None)
        with pytest.raises(memsem.LeaseHeldError):
            rt.unpublish(ref, timeout=0.05)
    finally:
        a.kill()
    rt.unpublish(ref, timeout=30.0)  # a lease held until released: only reaping lets this pass
    # The slot is free for new leases of a republished window.
    ref2 = rt.publish(pattern(5, 4096))
    with ref2.lease(ttl=1.0):
        pass


def test_lease_slot_reclaimed_after_expiry(rt):
    ref = rt.publish(np.zeros(16, np.uint8))
    res = rt.resolve(ref.spec)
    leases = [ref.lease(ttl=1.0).acquire() for _ in range(res.cb.n_lease)]
    with pytest.raises(memsem.MemsemError, match="lease slots are held"):
        ref.lease(ttl=1.0).acquire()
    time.sleep(1.1)
    with ref.lease(ttl=1.0):  # an expired slot is reclaimed
        pass
    for lease in leases:
        lease.release()


def test_lease_outlives_its_resolution(rt):
    """A lease keeps its control block mapped when the consumer's cache drops the resolution
    (republish seen through a new ref): renew/remaining read valid memory and report expiry."""
    with _consumer() as cons:
        ref = rt.publish(pattern(6, 4096), name="w")
        lease = cons.ref(ref.to_bytes()).lease(ttl=0.05).acquire()
        time.sleep(0.1)
        ref2 = rt.publish(pattern(7, 4096), name="w", replace=True)
        assert (cons.ref(ref2.to_bytes()).get() == pattern(7, 4096)).all()  # re-resolves
        assert lease.remaining() < 0
        with pytest.raises(memsem.LeaseExpiredError):
            lease.renew()
        lease.release()


def _view_after_close(refbytes: bytes) -> int:
    import gc as _gc

    rt = memsem.Runtime(timeout=5)
    v = rt.ref(refbytes).view()
    rt.close()  # releases the view's lease; the mapping stays while the view lives
    s = int(v.sum())
    del v
    _gc.collect()
    return s


def _own_view_after_close() -> int:
    rt = memsem.Runtime(timeout=5)
    ref = rt.publish(np.full(1 << 16, 2, np.uint8))  # the only reference is the window's
    v = ref.view()
    rt.close()
    return int(v.sum())


def test_views_outlive_runtime_close(rt):
    a = rt.alloc(1 << 16, np.uint8)
    a[:] = 1
    ref = rt.publish(a)
    assert run_children(_view_after_close, [(ref.to_bytes(),)], timeout=60) == [1 << 16]
    assert run_children(_own_view_after_close, [()], timeout=60) == [2 << 16]


# -- case 1: a get without a lease racing unpublish --------------------------------------------
def test_case1_slow_get_racing_unpublish(rt):
    """Case 1, deterministic: a 16 MiB get is held inside the engine (provably in flight);
    unpublish waits for that copy to drain, and the get ends with StaleReferenceError (no bytes
    returned). The test checks the order (unpublish returned only after the copy was let go),
    never a duration."""
    data = pattern(11, 16 * MiB)
    ref = rt.publish(data)
    entered, opened = threading.Event(), threading.Event()

    def hold(kind: str, off: int, n: int) -> None:
        entered.set()
        opened.wait(60)

    with memsem.Runtime(timeout=10, engines=["host"],
                        engine_objects={"host": ScriptedEngine(HostEngine(), before=hold)}) as cons:
        c = cons.ref(ref.to_bytes()).get_async()
        assert entered.wait(60)
        opener = threading.Timer(0.2, opened.set)
        opener.start()
        rt.unpublish(ref, timeout=30.0)
        assert opened.is_set(), "unpublish returned while the copy was still in flight"
        data[:] = 0xEE  # the owner reuses its memory as soon as unpublish returns
        with pytest.raises(memsem.StaleReferenceError, match="no byte of it is valid"):
            c.wait(30.0)
        opener.join()


def test_case1_native_get_racing_unpublish(rt):
    """Case 1, racing for real: 16 MiB native guarded copies (cross-memory attach, GIL
    released) against unpublish + overwrite. Every get either returns exactly the bytes of its
    generation or raises StaleReferenceError; never garbage reported as success."""
    outcomes = {"ok": 0, "stale": 0}
    with _consumer() as cons:
        for k in range(12):
            data = pattern(100 + k, 16 * MiB)
            ref = rt.publish(data, name="race")
            cref = cons.ref(ref.to_bytes())
            c = cref.get_async()
            time.sleep(0.0005 * (k % 6))
            rt.unpublish("race", timeout=5.0)
            data[:] = 0xEE
            try:
                got = c.wait(10.0)
            except memsem.StaleReferenceError:
                outcomes["stale"] += 1
            else:
                assert (got == pattern(100 + k, 16 * MiB)).all(), "torn or reused bytes returned as valid"
                outcomes["ok"] += 1
    assert sum(outcomes.values()) == 12


def test_case1_cross_process(rt, agent):
    """Case 1 across processes: the consumer process gets 16 MiB while the owner unpublishes
    and overwrites; the consumer sees its bytes or StaleReferenceError."""
    data = pattern(12, 16 * MiB)
    ref = rt.publish(data)
    agent.send("get", ref.to_bytes())
    time.sleep(0.002)
    rt.unpublish(ref, timeout=5.0)
    data[:] = 0xEE
    try:
        got = agent.result(30.0)
    except memsem.StaleReferenceError:
        pass
    else:
        assert got == pattern(12, 16 * MiB).tobytes()


# -- case 2: the lease expires during a slowed get ----------------------------------------------
@pytest.mark.parametrize("reclaim", ["unpublish", "republish"])
def test_case2_lease_expires_during_slow_get(rt, reclaim):
    data = pattern(21, 4 * MiB)
    ref = rt.publish(data, name="w")
    with _consumer(delay=0.3) as cons:
        cref = cons.ref(ref.to_bytes())
        lease = cref.lease(ttl=0.1).acquire()
        out = np.zeros(4 * MiB, np.uint8)
        c = cons.submit("slow get", lambda: cref.get(out, lease=lease))
        t0 = time.monotonic()
        if reclaim == "unpublish":
            rt.unpublish("w", timeout=5.0)  # waits out the lease (0.1 s), then the copy
        else:
            rt.publish(pattern(22, 4 * MiB), name="w", replace=True)
        data[:] = 0xEE
        reclaimed = time.monotonic() - t0
        with pytest.raises(memsem.LeaseExpiredError, match="expired during the transfer"):
            c.wait(5.0)
        assert reclaimed >= 0.09
        with pytest.raises(memsem.LeaseExpiredError):
            lease.renew()


# -- claiming a slot: the claim mark -----------------------------------------------------------------
def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_slot_being_claimed_is_neither_stolen_nor_reaped_nor_counted(rt):
    """The moment between a claimer's CAS and its stores: the slot still holds the previous
    holder's words (a dead pid, an expired expiry). A second claimer, the owner's scan and the
    reaper must all leave it alone while its claimer lives; a dead claimer's mark is reclaimed.
    (Before the claim mark, a second claimer took such a slot and the first one's fresh lease
    read as expired: LeaseExpiredError at view() under load.)"""
    import os

    from memsem import native
    from memsem.gva import _lease_slots as L

    ref = rt.publish(np.zeros(64, np.uint8))
    cb = rt.publisher.owned[ref.gva].cb
    a = cb.lease_slot_addr(0)
    dead = _dead_pid()
    # the previous holder of slot 0: dead, expired, released-but-not-cleared words
    native.store_release(a, dead)
    native.store_release(a + 8, 12345)
    native.store_release(a + 16, 1)
    native.store_release(a + 32, 0)
    # a live claimer (this process) is between its CAS and its stores
    native.store_release(a + 24, L.claim_mark(os.getpid()))
    slot, lid = L.acquire(cb, os.getpid(), native.ProcessIdentity.current().start_time, 10**9)
    assert slot != 0, "a slot being claimed was taken by a second claimer"
    assert native.load_acquire(a + 24) == L.claim_mark(os.getpid())
    assert all(s != 0 for s, *_ in cb.unexpired_leases(0)), "the scan counted a claim as a lease"
    assert all(s != 0 for s, *_ in cb.lease_slots())
    L._reap(cb, 0, dead, 12345)
    assert native.load_acquire(a + 24) == L.claim_mark(os.getpid()), "the reaper freed a slot being claimed"
    L.release(cb, slot, lid)
    # the claimer died between its CAS and its stores: its mark is reclaimed once no slot is
    # free (a claim takes a free slot first)
    native.store_release(a + 24, L.claim_mark(dead))
    me = native.ProcessIdentity.current().start_time
    others = [L.acquire(cb, os.getpid(), me, 10**9) for _ in range(cb.n_lease - 1)]
    assert sorted(s for s, _ in others) == list(range(1, cb.n_lease))
    slot2, lid2 = L.acquire(cb, os.getpid(), me, 10**9)
    assert slot2 == 0 and native.load_acquire(a + 24) == lid2 and lid2 & 1
    for s, lid in [(slot2, lid2), *others]:
        L.release(cb, s, lid)


def _lease_hammer(ref_bytes: bytes, rounds: int, out) -> None:
    import memsem as m

    lost: list[str] = []
    try:
        with m.Runtime(timeout=30) as r:
            ref = r.ref(ref_bytes)
            for _ in range(rounds):
                lease = ref.lease(ttl=None).acquire()
                try:
                    lease.check("right after acquire")
                    v = ref.view(lease=lease)
                    lease.check("after view")
                    del v
                except m.MemsemError as exc:
                    lost.append(f"{type(exc).__name__}: {exc}")
                finally:
                    lease.release()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        lost.append(f"{type(exc).__name__}: {exc}")
    out.put(lost[:3] + ([f"... {len(lost)} in all"] if len(lost) > 3 else []))


@pytest.mark.multiproc
def test_concurrent_claimers_never_lose_a_fresh_lease(rt):
    """Four processes take, check and release leases on one window as fast as they can (the
    4-PE MTE scenario views every window from every PE at once): no lease is ever found
    expired while its holder holds it."""
    import multiprocessing as mp

    ref = rt.publish(rt.alloc(4096, np.uint8))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_lease_hammer, args=(ref.to_bytes(), 1500, q)) for _ in range(4)]
    for p in procs:
        p.start()
    try:
        lost = [q.get(timeout=240) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert lost == [[], [], [], []], f"leases lost by their holders: {lost}"


def test_a_claim_on_a_window_not_live_is_undone(rt):
    """A lease claimed while the owner marks the window CLOSING: the claimer reads the state
    after publishing its lease id (the Dekker half of the protocol), frees the slot again and
    fails; the slot is left free (id word 0), on the one-call path and on the reclaim path."""
    import os

    from memsem import native
    from memsem.gva import _lease_slots as L
    from memsem.gva._control_block import W_STATE, WindowState

    ref = rt.publish(np.zeros(64, np.uint8))
    cb = rt.publisher.owned[ref.gva].cb
    me = native.ProcessIdentity.current().start_time
    cb.set_word(W_STATE, WindowState.CLOSING)
    try:
        with pytest.raises(L.WindowClosing):
            L.acquire(cb, os.getpid(), me, 10**9)
        assert all(native.load_acquire(cb.lease_slot_addr(s) + L.L_ID) == 0 for s in range(cb.n_lease))
    finally:
        cb.set_word(W_STATE, WindowState.LIVE)
    held = [L.acquire(cb, os.getpid(), me, 10**9) for _ in range(cb.n_lease)]  # every slot taken
    s0, id0 = held[0]
    native.store_release(cb.lease_slot_addr(s0) + L.L_EXPIRY, 1)  # slot s0's lease expired
    cb.set_word(W_STATE, WindowState.CLOSING)
    try:
        with pytest.raises(L.WindowClosing):
            L.acquire(cb, os.getpid(), me, 10**9)  # reclaims s0, then sees CLOSING
        assert native.load_acquire(cb.lease_slot_addr(s0) + L.L_ID) == 0
    finally:
        cb.set_word(W_STATE, WindowState.LIVE)
    for s, lid in held[1:]:
        L.release(cb, s, lid)
