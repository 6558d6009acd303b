"""Lifetimes of arrays, views and async work: derived arrays keep mappings and leases alive,
nothing segfaults after close, every queued operation reaches a final state, bad timeouts are
refused. (Regressions of a read-only review.)"""
from __future__ import annotations

import gc
import math

import numpy as np
import pytest

import memsem
from memsem import AccessDeniedError, LeaseHeldError, StaleReferenceError
from tests.conftest import run_children


def _alloc_derived_after_gc_and_close() -> float:
    with memsem.Runtime(timeout=5) as rt:
        a = rt.alloc(1 << 16, np.float32).reshape(256, 256)[:128]  # the returned array dies here
        gc.collect()
        a[:] = 1
        ref = rt.publish(a)
        ref.get()
    gc.collect()
    a += 1  # the runtime is closed: the mapping must still be there for the caller's array
    return float(a.sum())


def test_alloc_views_outlive_the_returned_array_and_close():
    # In a child: a use-after-unmap would kill it with SIGSEGV instead of failing this test.
    assert run_children(_alloc_derived_after_gc_and_close, [()]) == [2.0 * 128 * 256]


def test_slice_of_a_view_keeps_its_lease(rt):
    a = rt.alloc(1024, np.uint8)
    ref = rt.publish(a, name="w")
    s = ref.view()[:8]  # the view itself is gone; its slice must still hold the lease
    gc.collect()
    with pytest.raises(LeaseHeldError):
        rt.unpublish("w", timeout=0.2)
    del s
    gc.collect()
    rt.unpublish("w", timeout=2)


def test_readiness_is_the_producers_and_generation_checked(rt):
    ref = rt.publish(np.zeros(4096, np.uint8), name="t", tile_bytes=1024)
    ro = memsem.TensorRef(memsem.gva.RefSpec(**{**ref.spec.__dict__, "access": "r"}), rt)
    with pytest.raises(AccessDeniedError):
        ro.mark_ready(1)
    new = rt.publish(np.zeros(4096, np.uint8), name="t", tile_bytes=1024, replace=True)
    new.put_tile(0, np.ones(1024, np.uint8))
    with pytest.raises(StaleReferenceError):
        rt.readiness.clear(ref.spec, 0)  # a stale ref never clears the new generation's mark
    assert new.is_ready(0)
    with pytest.raises(ValueError, match="whole window"):
        new.tile(2, 1024).put_tile(0, np.ones(1024, np.uint8))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "1"])
def test_bad_timeouts_refused(rt, bad):
    ref = rt.publish(np.zeros(64, np.uint8), name="b", tiles=2)
    with pytest.raises((ValueError, TypeError), match="timeout"):
        ref.wait_tile(0, timeout=bad)
    with pytest.raises((ValueError, TypeError), match="timeout"):
        rt.unpublish("b", timeout=bad)


def test_queued_work_ends_final_when_the_runtime_closes():
    rt = memsem.Runtime(timeout=5, workers=1)
    ref = rt.publish(np.zeros(32 << 20, np.uint8))
    comps = [ref.get_async() for _ in range(6)]
    batch = rt.xcopy([(ref, np.empty(32 << 20, np.uint8)) for _ in range(4)])
    rt.close()
    for c in comps:
        assert c.done() and c.state.final
    batch.wait(5)
    assert all(r.state.final for r in batch.results)
