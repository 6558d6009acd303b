"""TensorRef: wrapping in place, dtypes/shapes round trips, serialization, permissions, DLPack."""
from __future__ import annotations

import ctypes
import pickle

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import memsem
from memsem import AccessDeniedError, StaleReferenceError, TensorRef
from memsem._buffers import _DLManagedTensor

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2]


def _random(shape, dtype, seed=0):
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dt == np.bool_:
        raw = raw & 1
    return raw.view(dt).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_roundtrips_bit_exact(rt, dtype):
    a = _random((3, 5), dtype)
    ref = rt.publish(a)
    b = TensorRef.from_bytes(ref.to_bytes(), rt).get()
    assert b.dtype == a.dtype and b.shape == a.shape
    assert b.tobytes() == a.tobytes()


@st.composite
def arrays_any_dtype(draw):
    """Arrays of every supported dtype (ml_dtypes ones built from raw bytes: any bit pattern)."""
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
    n = int(np.prod(shape)) * dt.itemsize
    raw = draw(hnp.arrays(np.uint8, n))
    if dt == np.bool_:
        raw = raw & 1
    return raw.view(dt).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(arr=arrays_any_dtype(), offset=st.integers(0, 7))
def test_property_shape_dtype_offset_roundtrip(arr, offset):
    with memsem.Runtime(timeout=5) as rt:
        ref = rt.publish(arr)
        assert ref.shape == arr.shape and ref.dtype == arr.dtype and ref.nbytes == arr.nbytes
        back = TensorRef.from_bytes(ref.to_bytes(), rt)
        assert back == ref
        out = back.get()
        assert out.shape == arr.shape and out.dtype == arr.dtype
        assert out.tobytes() == arr.tobytes()
        if arr.nbytes > offset:
            part = back.bytes(offset, arr.nbytes - offset).get()
            assert part.tobytes() == arr.reshape(-1).view(np.uint8)[offset:].tobytes()


def test_ref_is_compact_and_carries_no_pointer(rt):
    a = np.zeros((4, 8), np.float32)
    ref = rt.publish(a, name="w")
    b = ref.to_bytes()
    assert len(b) == 60 + 8 * 2 + len("w") + 32  # + the owner's mint: range and MAC
    assert a.ctypes.data.to_bytes(8, "little") not in b
    p = pickle.loads(pickle.dumps(ref))
    assert p == ref and (p.get() == a).all()
    with pytest.raises(ValueError, match="not a serialized memsem ref"):
        TensorRef.from_bytes(b"hello")
    with pytest.raises(ValueError, match=r"header \(ndim 2, name length 1, mint\) says"):
        TensorRef.from_bytes(b + b"x")


def test_publish_wraps_in_place_and_keeps_alive(rt):
    a = np.arange(10, dtype=np.int64)
    ref = rt.publish(a)
    a[3] = 99  # no staging copy: the window is the array
    assert ref.get()[3] == 99
    del a
    import gc

    gc.collect()
    assert ref.get()[3] == 99  # the window keeps the array alive


def test_noncontiguous_rejected_with_reason(rt):
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        rt.publish(a.T)
    with pytest.raises(ValueError, match="C-contiguous"):
        rt.publish(a[:, ::2])
    with pytest.raises(TypeError, match="obj must be"):
        rt.publish(object())
    with pytest.raises(TypeError, match="obj has dtype <U4, which holds strings"):
        rt.publish(np.zeros(3, dtype="U4"))


def test_readonly_array_gives_readonly_window(rt):
    """Case 3: a read-only numpy array: any put through any ref raises; the source is unchanged."""
    a = np.arange(16, dtype=np.float32)
    a.flags.writeable = False
    ref = rt.publish(a)
    assert ref.access == "r"
    with pytest.raises(AccessDeniedError):
        ref.put(np.zeros(16, np.float32))
    forged = TensorRef(memsem.gva.RefSpec(**{**ref.spec.__dict__, "access": "rw", "mint": None}), rt)
    with pytest.raises(AccessDeniedError, match="read-only"):
        forged.put(np.zeros(16, np.float32))
    with pytest.raises(AccessDeniedError):
        rt.publish(a, access="rw")
    assert (a == np.arange(16, dtype=np.float32)).all()
    v = ref.view()
    assert not v.flags.writeable


def test_put_get_byte_ranges_and_tiles(rt):
    a = np.zeros(1000, np.uint8)
    ref = rt.publish(a)
    ref.bytes(100, 10).put(np.full(10, 7, np.uint8))
    assert a[100:110].tolist() == [7] * 10 and a[99] == 0 and a[110] == 0
    assert ref.tile(3, 256).nbytes == 232 and ref.num_tiles(256) == 4
    with pytest.raises(ValueError, match="outside"):
        ref.bytes(995, 10)
    with pytest.raises(ValueError, match="bytes"):
        ref.put(np.zeros(10, np.uint8))
    with pytest.raises(ValueError, match="out holds"):
        ref.get(np.zeros(5, np.uint8))


def test_generation_stale_after_unpublish_and_republish(rt):
    a = np.ones(8, np.float32)
    ref = rt.publish(a, name="x")
    ref2 = rt.publish(np.full(8, 2, np.float32), name="x", replace=True)  # republish: generation moves
    assert ref2.generation != ref.generation and ref2.gva == ref.gva
    with pytest.raises(StaleReferenceError):
        ref.get()
    assert (ref2.get() == 2).all()
    rt.unpublish("x")
    with pytest.raises(StaleReferenceError):
        ref2.get()


def test_wrong_key_denied_and_moves_nothing(rt):
    a = np.arange(8, dtype=np.float32)
    ref = rt.publish(a)
    forged = TensorRef(memsem.gva.RefSpec(**{**ref.spec.__dict__, "key": b"\0" * 16}), rt)
    out = np.full(8, -1, np.float32)
    with pytest.raises(AccessDeniedError, match="access key"):
        forged.get(out)
    assert (out == -1).all()


def test_view_zero_copy_same_process(rt):
    a = rt.alloc((4, 4), np.float32)
    ref = rt.publish(a)
    v = ref.view()
    a[1, 1] = 5
    assert v[1, 1] == 5
    assert np.shares_memory(v, a) or v.__array_interface__["data"][0] == a.__array_interface__["data"][0]


def test_completion_states(rt):
    a = np.arange(1 << 16, dtype=np.float32)
    ref = rt.publish(a)
    c = ref.get_async()
    out = c.wait(10)
    assert c.done() and c.state == memsem.State.DONE and (out == a).all()
    c2 = ref.put_async(np.zeros(5, np.float32))
    with pytest.raises(ValueError):
        c2.wait(10)
    assert c2.state == memsem.State.FAILED


def _dlpack_with_offset(base: np.ndarray, byte_offset: int, n: int):
    """A DLPack producer exporting float32[n] as (base pointer, byte_offset)."""
    from memsem.refs._dlpack import _PyCapsule_New

    class Producer:
        def __init__(self):
            self.shape = (ctypes.c_int64 * 1)(n)
            mt = _DLManagedTensor()
            t = mt.dl_tensor
            t.data = base.ctypes.data
            t.device.device_type, t.device.device_id = 1, 0
            t.ndim = 1
            t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 32, 1
            t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
            t.strides = None
            t.byte_offset = byte_offset
            self.mt = mt

        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kw):
            return _PyCapsule_New(ctypes.addressof(self.mt), b"dltensor", None)

    return Producer()


def test_dlpack_byte_offset_preserved(rt):
    """Case 1: src[8:] exported as base pointer + byte_offset; publish, get, re-export."""
    src = np.arange(32, dtype=np.float32)
    prod = _dlpack_with_offset(src, 8 * 4, 24)
    ref = rt.publish(prod)
    assert ref.byte_offset == 32 and ref.shape == (24,)
    back = TensorRef.from_bytes(ref.to_bytes(), rt)
    assert back.byte_offset == 32
    buf = back.get(framework="dlpack")
    cap = buf.__dlpack__()
    from memsem._buffers import _capsule_get

    t = _DLManagedTensor.from_address(_capsule_get(cap, b"dltensor")).dl_tensor
    assert t.byte_offset == 32 and t.data == buf.base.ctypes.data
    re = np.from_dlpack(buf)
    assert re.tobytes() == src[8:].tobytes()


def test_torch_bf16_and_fp8_roundtrip(rt):
    """Case 2: bfloat16 and float8_e4m3fn: dtype and bits exact, numpy and torch."""
    torch = pytest.importorskip("torch")
    t = torch.randn(64, 8).to(torch.bfloat16)
    ref = rt.publish(t)
    got = TensorRef.from_bytes(ref.to_bytes(), rt).get()
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), t.view(torch.int16))
    as_np = ref.get(framework="numpy")
    assert as_np.dtype == ml_dtypes.bfloat16
    assert as_np.view(np.uint16).tobytes() == t.view(torch.int16).numpy().tobytes()
    f8 = torch.randn(100).to(torch.float8_e4m3fn)
    r8 = rt.publish(f8)
    g8 = r8.get()
    assert g8.dtype == torch.float8_e4m3fn and torch.equal(g8.view(torch.uint8), f8.view(torch.uint8))
    n8 = _random((100,), ml_dtypes.float8_e4m3fn)
    assert rt.publish(n8).get(framework="numpy").tobytes() == n8.tobytes()
    with pytest.raises(ValueError, match="C-contiguous"):
        rt.publish(t.t())


def test_runtime_ref_rebuilds_every_kind_of_ref():
    """``rt.ref(data)`` takes the ``to_bytes()`` of any ref kind and returns that kind, bound to
    the runtime; anything else is refused by name."""
    from memsem import FieldRef, FieldSet, StateDictRef, TensorRef

    with memsem.Runtime() as owner, memsem.Runtime() as other:
        t = owner.publish(np.arange(8, dtype=np.int32))
        sd = owner.publish_state_dict({"w": np.ones(4, np.float32)})
        fs = owner.publish_fields({"x": ((4, 2), np.float32)})
        for ref, kind in ((t, TensorRef), (sd, StateDictRef), (fs, FieldSet), (fs["x"], FieldRef)):
            back = other.ref(ref.to_bytes())
            assert type(back) is kind and back.to_bytes() == ref.to_bytes()
        np.testing.assert_array_equal(other.ref(t.to_bytes()).get(), np.arange(8, dtype=np.int32))
        assert other.ref(sd.to_bytes()).get()["w"].tolist() == [1.0] * 4
        with pytest.raises(ValueError, match="not a serialized memsem ref"):
            other.ref(b"MSXX" + bytes(60))
        with pytest.raises(TypeError, match="bytes"):
            other.ref("MSR1")


def test_a_state_dicts_load_is_strict_about_names_both_ways():
    """``load(into)`` (strict by default) refuses an ``into`` with a name the state dict lacks
    (it would keep its old values unnoticed) as it refuses a missing one, naming both, before
    any byte moves; ``strict=False`` loads the names both have and leaves the others."""
    with memsem.Runtime() as owner, memsem.Runtime() as other:
        sd = other.ref(owner.publish_state_dict({"w": np.ones(4, np.float32), "b": np.full(2, 2.0)}).to_bytes())
        into = {"w": np.zeros(4, np.float32), "b": np.zeros(2), "renamed.w": np.zeros(4, np.float32)}
        for load in (sd.load, lambda d, **kw: sd.load_async(d, **kw).wait(30)):
            with pytest.raises(KeyError) as info:
                load(into)
            msg = str(info.value)
            assert "not in the state dict 'renamed.w'" in msg and "strict=False" in msg and "missing" not in msg
            assert (into["w"] == 0).all() and (into["b"] == 0).all()  # nothing moved
            with pytest.raises(KeyError, match=r"missing 'b'; not in the state dict 'renamed.w'"):
                load({"w": into["w"], "renamed.w": into["renamed.w"]})
            assert load(into, strict=False) == 1
            assert (into["w"] == 1).all() and (into["b"] == 2).all() and (into["renamed.w"] == 0).all()
            into["w"][:] = 0
            into["b"][:] = 0
        assert sd.load({"w": into["w"], "b": into["b"]}) == 1  # exactly its names: strict holds
        with pytest.raises(TypeError, match="strict"):
            sd.load(into, strict="no")
