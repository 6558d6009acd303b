"""``memsem bench`` plumbing and the hot-path guarantees it relies on (cheap; no MPI run)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import memsem
from memsem.cli import _bench, _bench_measure as M


def test_ref_range_checked_on_cached_resolution():
    # A ref whose range was widened past its window (same key) must not read beyond the
    # window, also once the window's resolution is cached.
    with memsem.Runtime() as rt:
        ref = rt.publish(np.arange(64, dtype=np.uint8))
        ref.get()  # resolution cached
        # (a ref claiming more than its mint does not even build: drop the mint to forge one)
        wide = memsem.TensorRef(dataclasses.replace(ref.spec, nbytes=4096, shape=(4096,), mint=None), rt)
        with pytest.raises(ValueError, match="outside"):
            wide.get()
        shifted = memsem.TensorRef(dataclasses.replace(ref.spec, offset=32, mint=None), rt)
        with pytest.raises(ValueError, match="outside"):
            shifted.put(np.zeros(64, np.uint8))


def test_telemetry_counts_gets_and_puts():
    with memsem.Runtime() as rt:
        ref = rt.publish(np.zeros(1000, np.uint8), access="rw")
        out = np.empty(1000, np.uint8)
        for _ in range(3):
            ref.get(out)
        ref.put(np.ones(1000, np.uint8))
        st = rt.stats()
        route = ref.route().kind
        assert st.ops_by_route[route] == 4
        assert st.bytes_by_route[route] == 4000
        assert st.latency_us["get"]["n"] == 3 and st.latency_us["put"]["n"] == 1
        assert st.bounce_bytes == 0


def test_goal_checks():
    fig = {"get_64B_us": 1.5, "mpi_sendrecv_64B_us": 2.0, "get_64MiB_GBps": 9.0, "copyto_64MiB_GBps": 10.0,
           "view_64MiB_us": 25.0, "pipeline_vs_ideal": None, "bounce_bytes_host": 0}
    assert _bench.goal_met("get_64B_us", fig) is True
    assert _bench.goal_met("get_64MiB_GBps", fig) is True
    assert _bench.goal_met("view_64MiB_us", fig) is False
    assert _bench.goal_met("pipeline_vs_ideal", fig) is None
    assert _bench.goal_met("bounce_bytes_host", fig) is True
    assert _bench.goal_met("get_64B_us", {"get_64B_us": 1.0}) is None  # peer missing: no verdict


def test_sizes_and_paired_sampling():
    assert M.SIZES_FULL[0] == 64 and M.SIZES_FULL[-1] == 256 << 20
    assert all(b == 4 * a for a, b in zip(M.SIZES_FULL, M.SIZES_FULL[1:]))
    assert set(M.SIZES_QUICK) <= set(M.SIZES_FULL) and {64, 64 << 20} <= set(M.SIZES_QUICK)
    calls = []
    out = M.paired({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, per_round=2)
    assert len(out["a"]) == len(out["b"]) == 6
    assert calls[2:] == ["a", "a", "b", "b"] * 3  # interleaved round by round, after one warm-up each
