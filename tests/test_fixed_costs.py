"""The fixed costs of a view and of a one-tile pipeline (issue 39): what they do once, and the
lock-free paths that replaced per-call locks, pins and finalizers, still right."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import memsem
from memsem.core._staging import StagingPool
from memsem.native import Segment


def _count_resolves(rt, monkeypatch) -> list[int]:
    calls = [0]
    resolve = rt.resolver.resolve

    def counted(spec, info=None):
        calls[0] += 1
        return resolve(spec, info)

    monkeypatch.setattr(rt.resolver, "resolve", counted)
    return calls


def test_a_view_resolves_its_window_once(rt, monkeypatch):
    a = rt.alloc(1 << 16, np.uint8)
    a[:] = 7
    ref = rt.publish(a)
    ref.view()  # resolved and mapped once before counting
    calls = _count_resolves(rt, monkeypatch)
    v = ref.view()
    assert calls[0] == 1  # its checks, its pin (a lease) and its mapping share one resolution
    assert int(v[:16].sum()) == 7 * 16
    lease = ref.lease(ttl=None).acquire()
    calls[0] = 0
    w = ref.view(lease=lease)  # a caller's lease pinning no version: joined by a pin of the view's
    assert calls[0] == 1 and int(w[-1]) == 7
    del v, w
    gc.collect()
    lease.release()


def test_views_are_counted_in_the_stats_they_queue_for(rt):
    a = rt.alloc(4096, np.uint8)
    ref = rt.publish(a)
    for _ in range(300):  # past one fold of the queue (256) and a part of the next
        ref.view()
    st = rt.stats()
    assert st.latency_us["view"]["n"] == 300
    assert st.latency_histograms["view"]["count"] == 300


def test_segment_exports_share_one_pin_and_outlive_close():
    seg = Segment.create("data", 1 << 16)
    try:
        base = seg.holders
        a = seg.export(0, 4096)
        b = seg.export(4096, 4096, readonly=True)
        assert seg.holders == base + 1  # one pin under every export, not one each
        assert a.base is not b.base  # each export has an object of its own under it
        assert a.flags.writeable and not b.flags.writeable
        a[:] = 5
        assert int(seg.export(0, 4096)[0]) == 5
        assert seg.export(0, 0).size == 0
        seg.close()
        with pytest.raises(ValueError, match="closed"):
            seg.export(0, 16)
        assert seg.mapped and int(a.sum()) == 5 * 4096  # the exports still hold the mapping
        del a, b
        gc.collect()
        assert not seg.mapped  # the last export gone: unmapped
    finally:
        seg.close()
        seg.unlink()


def test_staging_pool_lends_its_own_buffers_and_keeps_at_most_its_limit():
    pool = StagingPool(limit=3 * 4096)
    a = pool.borrow(4096)
    a_addr = a.__array_interface__["data"][0]
    assert a_addr % StagingPool.ALIGN == 0 and a.nbytes == 4096
    pool.give_back(a)
    b = pool.borrow(4096)
    assert b is a  # the pool's own buffer, lent again
    c, d, e = pool.borrow(4096), pool.borrow(4096), pool.borrow(4096)
    for x in (b, c, d, e):
        pool.give_back(x)
    assert pool._pooled == 3 * 4096  # the fourth was over the limit: dropped
    assert sorted(id(x) for x in pool._free[4096]) == sorted(id(x) for x in (b, c, d))
    pool.clear()
    assert pool.borrow(4096) is not b


def test_a_tile_released_by_two_threads_is_released_once(rt):
    a = rt.alloc(1 << 16, np.uint8)
    ref = rt.publish(a)
    with rt.pipeline(ref, tile_bytes=4096, zero_copy=False) as p:
        for tile in p:
            start = threading.Barrier(3)

            def release(t=tile):
                start.wait(5)
                t.release()

            threads = [threading.Thread(target=release) for _ in range(2)]
            for t in threads:
                t.start()
            start.wait(5)
            tile.release()
            for t in threads:
                t.join(5)
            assert tile.released and p.tiles_held == 0
    st = p.stats
    assert st.delivered == 16 and p.tiles_held == 0


def test_a_pin_of_the_latest_waits_for_an_open_write_section_then_pins_its_commit(rt):
    # the native one-call pin (memsem_pin_latest): an odd sequence word backs it off, and the
    # pin waits for the commit (here: past its timeout, the section staying open)
    ref = rt.publish(np.zeros(64, np.uint8))
    with memsem.Runtime(timeout=0.5) as other:
        r = other.ref(ref.to_bytes())
        first = r.pin(ttl=None)
        assert first.version == 1
        first.release()
        with rt.write_section(ref) as s:
            s.array()[:] = 2
            with pytest.raises(memsem.MemsemTimeoutError):
                r.pin(ttl=None, timeout=0.05)  # the section stays open: no pin holds
            with pytest.raises(memsem.MemsemTimeoutError):
                r.view()  # nor does a view's own pin (within the runtime's timeout)
        lease = r.pin(ttl=None)
        assert lease.version == 2 and (r.get(lease=lease, version=2) == 2).all()
        v = r.view()
        assert (v == 2).all()
        lease.release()
        del v


def test_a_pin_of_a_republished_window_is_stale(rt):
    a = rt.alloc(64, np.uint8)
    ref = rt.publish(a, name="w")
    with memsem.Runtime(timeout=10.0) as other:
        r = other.ref(ref.to_bytes())
        r.view()  # resolved there
        rt.unpublish("w", timeout=5.0)
        rt.publish(a, name="w")
        with pytest.raises(memsem.StaleReferenceError):
            r.pin(ttl=None)
        with pytest.raises(memsem.StaleReferenceError):
            r.view()
