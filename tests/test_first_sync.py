"""First sync into fresh buffers: destinations memsem allocates for a state dict come from one
huge-page mapping (``memsem._buffers.empty_arena``), so a first load faults 2 MiB pages rather
than 4 KiB ones. The arrays are ordinary, independent, writable arrays of the right dtype and
shape; the mapping lives as long as any of them."""
from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import memsem
from memsem._buffers import ARENA_ALIGN, empty_arena


def test_arena_arrays_are_independent_aligned_and_outlive_each_other():
    arrs = empty_arena([(np.float32, (1000, 3)), (np.uint8, (5,)), (np.int64, ()), (np.float16, (0,))])
    assert [a.shape for a in arrs] == [(1000, 3), (5,), (), (0,)]
    assert [a.dtype for a in arrs] == [np.float32, np.uint8, np.int64, np.float16]
    assert all(a.__array_interface__["data"][0] % ARENA_ALIGN == 0 for a in arrs[:3])
    for i, a in enumerate(arrs):
        a[...] = i + 1
    assert (arrs[0] == 1).all() and (arrs[1] == 2).all() and int(arrs[2]) == 3
    keep = arrs[1]
    del arrs
    gc.collect()
    assert keep.tolist() == [2] * 5  # the mapping lives while any array of it does
    assert empty_arena([]) == []


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_state_dict_empty_like_loads_exactly(framework):
    if framework == "torch":
        torch = pytest.importorskip("torch")
    sd = {"a": np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(1024, 3072), "b": np.arange(7, dtype=np.int16),
          "c": np.ones((2, 2), np.float64), "d": np.arange(10).astype(ml_dtypes.bfloat16)}
    with memsem.Runtime() as rt:
        ref = rt.publish_state_dict(sd, name="fs/sd")
        with memsem.Runtime() as cons:
            cref = cons.lookup_state_dict("fs/sd")
            dst = cref.empty_like(framework)
            cref.load(dst)
            for k, v in sd.items():
                t = dst[k]
                if framework == "torch":
                    got = (t.view(torch.uint8).numpy().view(v.dtype) if k == "d" else t.numpy())
                else:
                    got = t
                assert got.dtype == v.dtype and got.shape == v.shape
                np.testing.assert_array_equal(got.view(np.uint8), v.view(np.uint8))
            if framework == "torch":
                assert all(isinstance(t, torch.Tensor) for t in dst.values())
        rt.unpublish(ref, timeout=5)
