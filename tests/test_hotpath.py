"""The hot path's entry (memsem._hot.copy): one C call for a plain buffer, the Python door for
everything else, the same outcome either way.

The C entry makes the door checks of the common case (plain dtype in native byte order,
C-contiguous, writable for a get, exact size, a put's dtype) through the buffer protocol; a
buffer it does not take comes back as RC_BUFFER with nothing done, and the door accepts or
refuses it with the error naming the argument. These tests hold both halves to the same rules.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import weakref

import numpy as np
import pytest

import memsem
from memsem import AccessDeniedError, LeaseExpiredError, StaleReferenceError, _dtypes, _hot
from memsem.core import PlanRoute
from memsem import native
from memsem.core import Status

from tests._agent import Agent, pattern
from tests._proc import recv, reap, spawn

SPAWN = mp.get_context("spawn")

PLAIN = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
         "float16", "float32", "float64", "complex64", "complex128"]


def _shm_owner(conn, nbytes):
    with memsem.Runtime() as rt:
        a = rt.alloc(nbytes, np.uint8)
        a[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
        ref = rt.publish(a, access="rw", name="hot/shm")
        conn.send(ref.to_bytes())
        recv(conn, 120)


@pytest.fixture
def rt():
    with memsem.Runtime() as r:
        yield r


@pytest.mark.parametrize("name", PLAIN)
def test_every_plain_dtype_goes_through_one_call(rt, name):
    dt = _dtypes.numpy_dtype(_dtypes.code_of(name))
    src = (np.arange(32) % 2).astype(dt) if name == "bool" else np.arange(32).astype(dt)
    ref = rt.publish(src.copy(), access="rw")
    res = rt.resolve(ref.spec)
    out = np.zeros_like(src)
    rc = _hot.copy(res.addr, 0, ref.spec.offset, out, ref.nbytes, -1)
    assert rc & native.lib.MEMSEM_RC_STATUS_MASK == Status.OK
    np.testing.assert_array_equal(out, src)
    new = src[::-1].copy()
    rc = _hot.copy(res.addr, 1, ref.spec.offset, new, ref.nbytes, ref.spec.dtype_code)
    assert rc & native.lib.MEMSEM_RC_STATUS_MASK == Status.OK
    np.testing.assert_array_equal(ref.get(), new)


def _refused_for_get():
    a = np.zeros(64, np.uint8)
    ro = a.copy()
    ro.flags.writeable = False
    return {
        "read-only array": ro,
        "bytes": bytes(64),
        "strided": np.zeros(128, np.uint8)[::2],
        "wrong size": np.zeros(63, np.uint8),
        "object dtype": np.empty(8, object),
        "datetime": np.zeros(8, "M8[s]"),
        "structured": np.zeros(8, [("a", "<i4"), ("b", "<i4")]),
        "big endian": np.zeros(16, ">i4"),
        "list": [0] * 64,
        "bfloat16": np.zeros(32, _dtypes.numpy_dtype(_dtypes.code_of("bfloat16"))),
    }


@pytest.mark.parametrize("what", list(_refused_for_get()))
def test_buffers_the_call_does_not_take_come_back_untouched(rt, what):
    """RC_BUFFER, nothing moved; the door then decides (and names the argument when it refuses)."""
    buf = _refused_for_get()[what]
    ref = rt.publish(np.arange(64, dtype=np.uint8), access="rw")
    res = rt.resolve(ref.spec)
    ops = rt.stats().ops_by_route
    assert _hot.copy(res.addr, 0, ref.spec.offset, buf, ref.nbytes, -1) == _hot.RC_BUFFER
    assert rt.stats().ops_by_route == ops  # nothing counted: nothing was done
    if what == "bfloat16":  # a plain dtype numpy cannot export: the door takes it
        ref.get(buf)
        assert buf.view(np.uint8).tolist() == list(range(64))
        return
    with pytest.raises((TypeError, ValueError), match="out"):
        ref.get(buf)
    assert ref.get().tolist() == list(range(64))  # the window is untouched


def test_torch_and_dlpack_buffers_take_the_door(rt):
    torch = pytest.importorskip("torch")
    ref = rt.publish(np.arange(16, dtype=np.float32), access="rw")
    res = rt.resolve(ref.spec)
    t = torch.zeros(16)
    assert _hot.copy(res.addr, 0, ref.spec.offset, t, ref.nbytes, -1) == _hot.RC_BUFFER
    ref.get(t)
    assert t.tolist() == list(range(16))
    ref.put(torch.full((16,), 2.0))
    assert ref.get().tolist() == [2.0] * 16
    ref.get(np.empty(16, np.float32))  # the ref keeps its native route...
    kept = ref._route
    ref.put(torch.full((16,), 3.0))
    for _ in range(2):  # ...and a tensor the call does not take goes through the door, route kept
        t = torch.zeros(16)
        assert ref.get(t) is t and t.tolist() == [3.0] * 16 and ref._route is kept
    with pytest.raises(ValueError, match="holds 8 bytes"):
        ref.get(torch.zeros(2))  # the door's own errors, through the kept route too
    with pytest.raises(ValueError, match="conjugate"):
        ref.bytes(0, 16).bind(rt).get(torch.zeros(2, dtype=torch.complex64).conj())


def test_put_dtype_rule_is_the_doors(rt):
    ref = rt.publish(np.zeros(16, np.float32), access="rw")
    ref.put(np.ones(16, np.float32))
    ref.put(np.full(16, 2.0, np.float32).view(np.uint8))  # raw bytes of any ref: allowed
    assert ref.get().tolist() == [2.0] * 16
    with pytest.raises(TypeError, match="src dtype int32 differs"):
        ref.put(np.ones(16, np.int32))
    raw = rt.publish(np.zeros(64, np.uint8), access="rw")
    raw.put(np.arange(16, dtype=np.int32))  # into a uint8 ref: any plain dtype's bytes
    assert raw.get().view(np.int32).tolist() == list(range(16))
    with pytest.raises(ValueError, match="src holds 32 bytes"):
        ref.put(np.zeros(8, np.float32))
    ro = rt.publish(np.zeros(16, np.float32), access="r")
    with pytest.raises(AccessDeniedError):
        ro.put(np.ones(16, np.float32))


@pytest.mark.multiproc
def test_shared_segment_outcomes_through_the_call():
    """Across processes (host/shm): a copy above GIL_BYTES (the GIL released around it), a lease
    checked natively (held, released, of another window), a stale ref after the owner left."""
    n = 4 * _hot.GIL_BYTES
    p, conn = spawn(_shm_owner, n)
    try:
        with memsem.Runtime() as rt:
            ref = rt.ref(recv(conn))
            assert ref.route().kind == "host/shm"
            out = np.empty(n, np.uint8)
            ref.get(out)
            np.testing.assert_array_equal(out, np.arange(n, dtype=np.uint64).astype(np.uint8))
            small = ref.bytes(0, 64)
            buf = np.empty(64, np.uint8)
            with small.lease(10) as ls:
                small.get(buf, lease=ls)
            with pytest.raises(LeaseExpiredError):
                small.get(buf, lease=ls)  # released: fails natively after range and permission
            other = rt.publish(np.zeros(8, np.uint8))
            with other.lease(5) as lo:
                with pytest.raises(ValueError, match="lease is for"):
                    small.get(buf, lease=lo)
            conn.send("exit")
            p.join(30)
            with pytest.raises((StaleReferenceError, memsem.PeerLostError)):
                small.get(buf)
    finally:
        reap([p])


# -- xcopy: ranges done at once in the caller, the rest by workers ----------------------------------
def test_xcopy_small_ranges_are_done_at_once(rt):
    """Same-node ranges of a resolved window end DONE before xcopy returns (inline lane), each
    counted in the xcopy latency histogram; a put range may carry any plain dtype's bytes."""
    a = rt.alloc(64 * 64, np.uint8)
    a[:] = np.arange(a.nbytes, dtype=np.uint64).astype(np.uint8)
    ref = rt.publish(a, access="rw")
    ref.get()  # resolved here
    tiles = [ref.bytes(i * 64, 64) for i in range(64)]
    outs = [np.zeros(64, np.uint8) for _ in range(64)]
    before = rt.stats().latency_us.get("xcopy", {}).get("n", 0)
    batch = rt.xcopy(list(zip(tiles, outs)))
    assert batch.done() and all(r.state == memsem.State.DONE for r in batch.results)
    assert rt.stats().latency_us["xcopy"]["n"] == before + 64
    np.testing.assert_array_equal(np.concatenate(outs), a)
    batch = rt.xcopy([(np.full(16, i, np.float32), tiles[i]) for i in range(4)])
    assert batch.wait(10) and not batch.errors
    assert a[:256].view(np.float32).tolist() == [float(i) for i in range(4) for _ in range(16)]


def test_xcopy_inline_range_that_cannot_finish_goes_to_a_worker(rt):
    """A write section is open: xcopy still returns at once (never waits in the caller); the
    range ends DONE once the section closes, with the new bytes. A stale range ends FAILED."""
    a = rt.alloc(4096, np.uint8)
    ref = rt.publish(a, access="rw", name="hot/ws")
    ref.get()
    out = np.zeros(4096, np.uint8)
    ws = rt.write_section(ref)
    ws.__enter__()
    try:
        a[:] = 9
        batch = rt.xcopy([(ref, out)])
        assert not batch.done() and batch.results[0].state != memsem.State.DONE
    finally:
        ws.__exit__(None, None, None)
    batch.wait(20)
    assert batch.results[0].state == memsem.State.DONE and (out == 9).all()
    old = rt.publish(np.zeros(64, np.uint8), name="hot/old")
    old.get()
    rt.unpublish(old, timeout=5)
    batch = rt.xcopy([(old, np.zeros(64, np.uint8)), (ref, out)])
    batch.wait(20)
    assert isinstance(batch.errors[0], StaleReferenceError)
    assert batch.results[1].state == memsem.State.DONE


# -- a ref's own memo of its native route (TensorRef._route) ------------------------------------------
def test_a_refs_plain_gets_skip_the_cache_and_still_see_every_change(rt):
    """After one plain get a ref's next ones are one native call on the resolution it kept; a
    resolution dropped since (the cache's bound), a retired window, a closed runtime are each
    seen at the next get, never bytes of a window that is gone."""
    a = rt.alloc(64, np.uint8)
    a[:] = 1
    ref = rt.publish(a, access="rw")
    out = np.zeros(64, np.uint8)
    ref.get(out)
    kept = ref._route
    res = rt.resolver.cache[ref.spec.gva]
    assert kept is not None and kept.keeper[0] is res and isinstance(kept, PlanRoute)
    a[:] = 2
    assert (ref.get(out) == 2).all() and ref._route is kept  # served by the kept resolution
    rt.resolver.drop(ref.spec.gva)  # as the cache's bound does
    assert res.closed and kept.keeper == [None]  # released: the ref's route no longer holds it
    a[:] = 3
    assert (ref.get(out) == 3).all()  # the closed plan refused; resolved again
    assert (ref.get(out) == 3).all() and ref._route is not None and ref._route.keeper[0] is not res
    assert ref._route.keeper[0] is rt.resolver.cache[ref.spec.gva]
    busy = rt.resolver.cache[ref.spec.gva]
    assert busy.enter()  # a copy running through it: closed by the drop, released only after
    rt.resolver.drop(ref.spec.gva)
    assert busy.closed and ref._route.keeper[0] is busy
    assert (ref.get(out) == 3).all()  # refused natively (closed), settled through it
    busy.leave()
    assert ref._route.keeper == [None] or ref._route.keeper[0] is not busy
    ref.put(np.full(64, 4, np.uint8))  # puts go through the kept route too
    assert (a == 4).all() and ref._route.writable is True
    rt.resolver.drop(ref.spec.gva)
    ref.put(np.full(64, 5, np.uint8))  # refused natively (closed), settled, kept anew
    assert (a == 5).all() and not ref._route.keeper[0].closed
    rt.unpublish(ref)
    out[:] = 9
    with pytest.raises(StaleReferenceError):
        ref.get(out)
    assert (out == 9).all()  # nothing of the retired window was copied
    with pytest.raises(StaleReferenceError):
        ref.put(np.full(64, 6, np.uint8))
    assert (a == 5).all()  # nor written into it


def test_kept_routes_stay_right_past_the_cache_bound(rt):
    """More windows than the cache holds, read in turn twice: the resolutions the bound dropped
    are freed though refs kept routes through them; each such ref resolves again at its next
    get; every get returns its own window's bytes."""
    limit = rt.resolver.limit
    n = limit + 64
    arrays, refs = [], []
    for i in range(n):
        a = rt.alloc(64, np.uint8)
        a[:] = i % 251
        arrays.append(a)
        refs.append(rt.publish(a))
    out = np.empty(64, np.uint8)
    for i, r in enumerate(refs):
        assert (r.get(out) == i % 251).all(), i
    assert sum(r._route.keeper[0] is None for r in refs) == n - limit  # dropped by the bound: let go
    for i, r in enumerate(refs):
        assert (r.get(out) == i % 251).all(), i
        assert r._route is not None and not r._route.keeper[0].closed


def test_a_kept_route_is_the_refs_runtime_and_spec_only():
    """A ref keeps its route for the runtime and spec it read through: bound to another
    runtime (as after fork, where a ref's closed runtime gives way to the default one) or
    given another spec, the kept route is not used."""
    with memsem.Runtime() as r1, memsem.Runtime() as r2:
        a = r1.alloc(64, np.uint8)
        a[:] = 5
        ref = r1.publish(a)
        b = r2.alloc(64, np.uint8)
        b[:] = 6
        other = r2.publish(b)
        out = np.empty(64, np.uint8)
        ref.get(out)
        assert ref._route is not None and ref._route.token is r1.token
        twin = r2.ref(ref.to_bytes())  # same window through the other runtime
        twin._route = ref._route  # even a route kept by another runtime's ref
        assert (twin.get(out) == 5).all() and twin._route.token is r2.token
        ref.spec = other.spec  # a ref pointed elsewhere reads there, never a's bytes
        assert (ref.get(out) == 6).all() and ref._route.spec is other.spec


def test_a_kept_route_of_a_read_only_ref_never_writes(rt):
    """A read-only ref keeps its route for gets; its puts still take the door and are refused,
    the window's bytes unchanged."""
    a = rt.alloc(16, np.uint8)
    a[:] = 3
    ro = rt.publish(a, access="r")
    out = np.empty(16, np.uint8)
    assert (ro.get(out) == 3).all() and ro._route is not None and ro._route.writable is False
    for _ in range(2):
        with pytest.raises(AccessDeniedError):
            ro.put(np.zeros(16, np.uint8))
    assert (a == 3).all() and (ro.get(out) == 3).all()


def test_a_kept_route_keeps_nothing_alive_the_cache_dropped(rt):
    """A resolution the cache dropped is freed (its mappings, its owner's pidfd), though refs
    that kept a route through it live on (they keep only its plan's memory); the next get
    resolves again."""
    refs = []
    for i in range(3):
        a = rt.alloc(64, np.uint8)
        a[:] = i
        refs.append((rt.publish(a), a))
    out = np.empty(64, np.uint8)
    for ref, _ in refs:
        ref.get(out)
    weak = [weakref.ref(ref._route.keeper[0]) for ref, _ in refs]
    assert all(w() is not None for w in weak)
    for ref, _ in refs:
        rt.resolver.drop(ref.spec.gva)
    gc.collect()
    assert [w() for w in weak] == [None, None, None]
    for i, (ref, _) in enumerate(refs):
        assert (ref.get(out) == i).all() and ref._route.keeper[0] is not None


def _pidfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    return n


@pytest.mark.multiproc
def test_kept_routes_hold_no_dead_owners_pidfd(rt):
    """Refs to windows of owners that died keep none of their pidfds open once the cache dropped
    the resolutions: at most the resolver's bounded memo of owners does (found by review)."""
    resolver = rt.resolver
    resolver.limit = resolver.cap = 1  # its memo of dropped windows' owners: 4 x limit
    agents = [Agent(SPAWN, timeout=30.0) for _ in range(6)]
    try:
        base = _pidfds()
        refs = [rt.ref(a.call("publish", i, 64, True, "r", None)) for i, a in enumerate(agents)]
        out = np.empty(64, np.uint8)
        for r in refs:
            r.get(out)
            r.get(out)
        assert all(r._route is not None for r in refs)
        for a in agents:
            a.kill()
        for r in refs:
            resolver.drop(r.spec.gva)
        gc.collect()
        assert _pidfds() - base <= 4 * resolver.limit + 1
    finally:
        for a in agents:
            a.kill()


def test_an_unbound_refs_kept_route_keeps_no_closed_runtime_alive():
    """An unbound ref reads through the current runtime; once that runtime is closed, what the
    ref keeps holds none of it (found by review), and the ref reads through the next one."""
    owner = memsem.Runtime(timeout=5)  # not entered: the unbound ref reads through the newest
    try:
        a = owner.alloc(64, np.uint8)
        a[:] = 8
        b = owner.publish(a).to_bytes()
        cons = memsem.Runtime(timeout=5)
        ref = memsem.TensorRef.from_bytes(b)  # unbound: the newest open runtime, cons
        out = np.empty(64, np.uint8)
        ref.get(out)
        assert ref._route is not None and ref._route.token is cons.token
        w = weakref.ref(cons)
        cons.close()
        del cons
        gc.collect()
        assert w() is None, "a ref's kept route kept a closed runtime alive"
        assert ref._route.keeper == [None]
        out[:] = 0
        assert (ref.get(out) == 8).all() and ref._route.token is owner.token  # the current one now
    finally:
        owner.close()


# -- how many functions a get walks (benchmarks/count_get_calls.py counts them; issue 34) -----------
def _counter():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "count_get_calls.py")
    spec = importlib.util.spec_from_file_location("count_get_calls", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: the most distinct Python functions a cold same-node ``get(out=)`` may walk through (issue 34:
#: 108 at filing, 88 before the resolution was made a straight line)
COLD_GET_FUNCTIONS = 50


@pytest.fixture
def counter(monkeypatch):
    # the owner's liveness re-check is not due during these gets (it is every
    # LIVENESS_INTERVAL_S: then a get takes the retry loop, which checks it)
    monkeypatch.setattr(memsem.core._resolve, "LIVENESS_INTERVAL_S", 3600.0)
    mod = _counter()
    undo = mod.spy_on_copy_buf()  # a ref's route made from now on is counted as the native call it is
    try:
        yield mod
    finally:
        undo()


@pytest.mark.multiproc
def test_a_cold_same_node_get_walks_few_functions_and_a_warm_one_is_one_native_call(counter):
    """A fresh runtime's first get of a window published by another process (the owner's record
    read, both segments mapped, the plan and the ref's route made) walks at most
    COLD_GET_FUNCTIONS distinct Python functions; its second get (the owner's liveness re-check
    not due) is one native call and nothing else (no Python function below ``TensorRef.get``,
    no other C call)."""
    agent = Agent(SPAWN, timeout=30.0)
    try:
        data = agent.call("publish", 3, 64, True, "rw", None)
        with memsem.Runtime() as rt:
            ref = rt.ref(data)
            out = np.zeros(64, np.uint8)
            cold = counter.count_calls(lambda: ref.get(out))
            assert ref.route().kind == "host/shm" and isinstance(ref._route, PlanRoute)
            np.testing.assert_array_equal(out, pattern(3, 64))
            assert cold["frames"] >= 1, "the cold get's copy was not seen"
            assert cold["distinct"] <= COLD_GET_FUNCTIONS, "\n".join(cold["functions"])
            out[:] = 0
            warm = counter.count_calls(lambda: ref.get(out))
            np.testing.assert_array_equal(out, pattern(3, 64))
            assert (warm["calls"], warm["calls_c"], warm["native"]) == (1, 1, 1), warm["functions"]
    finally:
        agent.stop()


@pytest.mark.multiproc
def test_a_warm_tcp_get_is_one_native_call(counter, monkeypatch):
    """Over tcp (the owner on another node), a ref's second small get (the owner's liveness
    re-check not due) makes one native call (the request and its reply, ``memsem._hot.wire``)
    and no other native one."""
    monkeypatch.setenv("MEMSEM_NODE_ID", "hot-other-node")  # the agent's node (inherited at spawn)
    agent = Agent(SPAWN, timeout=30.0, engines=["loopback", "host", "tcp"])
    monkeypatch.delenv("MEMSEM_NODE_ID")
    try:
        data = agent.call("publish", 4, 64, True, "rw", None)
        with memsem.Runtime(engines=["loopback", "host", "tcp"]) as rt:
            ref = rt.ref(data)
            out = np.zeros(64, np.uint8)
            ref.get(out)
            assert ref.route().kind == "tcp"
            out[:] = 0
            warm = counter.count_calls(lambda: ref.get(out))
            np.testing.assert_array_equal(out, pattern(4, 64))
            assert warm["native"] == 1, warm["functions"]
    finally:
        agent.stop()  # it closes its runtime: a record of another node's dead process is never collected here
