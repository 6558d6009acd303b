"""Buffers whose bytes are not their values, or that are not plain CPU memory, are refused at every
door that takes a destination or a source (issue 12 §1, §2).

Each bad buffer has exactly the byte count of the window it is offered to, so only the dtype /
tensor-kind check can refuse it. Every (path, buffer) pair must raise TypeError or ValueError that
names the argument and the reason (never torch's own RuntimeError, never a crash), and the window
must hold its old bytes afterwards.
"""
from __future__ import annotations

import ctypes
import re
import warnings

import numpy as np
import pytest

from memsem._buffers import buffer_info

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:A builtin ctypes object gave a PEP3118", "ignore::UserWarning")

N = 8  # float64 elements in the window: 64 bytes
PATTERN = np.arange(1, N + 1, dtype=np.float64) * 1.5


class _Pair(ctypes.Structure):
    _fields_ = [("a", ctypes.c_int32), ("b", ctypes.c_double)]


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.zeros(64), 0.1, 0, torch.quint8)


def _nested(layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.zeros(4, dtype=torch.float64),
                                           torch.zeros(4, dtype=torch.float64)], layout=layout)


#: name -> (factory of a 64-byte buffer, regex of the reason in the message)
BAD = {
    "object": (lambda: np.empty(N, object), r"dtype object.*pointers to Python objects"),
    "structured": (lambda: np.zeros(4, [("a", "<i4"), ("b", "<i4"), ("c", "<i8")]), r"structured"),
    "void": (lambda: np.zeros(8, "V8"), r"void"),
    "str": (lambda: np.zeros(4, "U4"), r"strings"),
    "bytes": (lambda: np.zeros(8, "S8"), r"strings"),
    "datetime": (lambda: np.zeros(N, "M8[s]"), r"datetime"),
    "timedelta": (lambda: np.zeros(N, "m8[ns]"), r"datetime/timedelta"),
    "big_endian": (lambda: np.zeros(N, ">f8"), r"byte order"),
    "float128": (lambda: np.zeros(4, np.longdouble), r"not a dtype memsem moves"),
    "ctypes_struct": (lambda: (_Pair * 4)(), r"structured"),
    "torch_conj": (lambda: torch.zeros(N, dtype=torch.complex64).conj(), r"conjugate view.*resolve_conj\(\)"),
    "torch_neg": (lambda: torch._neg_view(torch.zeros(N, dtype=torch.float64)), r"negative view.*resolve_neg\(\)"),
    "torch_sparse_coo": (lambda: torch.zeros(N, dtype=torch.float64).to_sparse(), r"sparse.*to_dense\(\)"),
    "torch_sparse_csr": (lambda: torch.zeros(2, 4, dtype=torch.float64).to_sparse_csr(), r"sparse.*to_dense\(\)"),
    "torch_nested": (lambda: _nested(torch.strided), r"nested tensor"),
    "torch_jagged": (lambda: _nested(torch.jagged), r"nested tensor"),
    "torch_quantized": (_quantized, r"quantized.*dequantize\(\)"),
    "torch_meta": (lambda: torch.empty(N, dtype=torch.float64, device="meta"), r"meta tensor"),
    "torch_zerotensor": (lambda: torch._efficientzerotensor(N, dtype=torch.float64), r"zero tensor.*clone\(\)"),
}
if torch.backends.mkldnn.is_available():
    BAD["torch_mkldnn"] = (lambda: torch.zeros(16).to_mkldnn(), r"mkldnn.*to_dense\(\)")


def _field(rt):
    fs = rt.publish_fields({"f": PATTERN.reshape(N, 1).copy()}, tile_rows=N, name="fs")
    return fs["f"]


#: path -> (call(rt, ref, bad), regex naming the argument)
PATHS = {
    "publish": (lambda rt, ref, bad: rt.publish(bad), r"^obj "),
    "get_out": (lambda rt, ref, bad: ref.get(out=bad), r"^out "),
    "get_async_out": (lambda rt, ref, bad: ref.get_async(out=bad), r"^out "),
    "put": (lambda rt, ref, bad: ref.put(bad), r"^src "),
    "put_async": (lambda rt, ref, bad: ref.put_async(bad), r"^src "),
    "xcopy_dst": (lambda rt, ref, bad: rt.xcopy([(ref, bad)]), r"^pairs\[0\] dst "),
    "xcopy_src": (lambda rt, ref, bad: rt.xcopy([(bad, ref)]), r"^pairs\[0\] src "),
    "xcopy_second_pair": (lambda rt, ref, bad: rt.xcopy([(ref, np.empty(N)), (bad, ref)]), r"^pairs\[1\] src "),
    "pipeline_out": (lambda rt, ref, bad: rt.pipeline(ref, tile_bytes=16, out=bad), r"^out "),
    "put_tile": (lambda rt, ref, bad: ref.put_tile(0, bad), r"^data "),
    "field_put_rows": (lambda rt, ref, bad: _field(rt).put_rows(0, bad), r"^data "),
    "field_get_rows_out": (lambda rt, ref, bad: _field(rt).get_rows(0, N, wait=False, out=bad), r"^out "),
    "field_pipeline_out": (lambda rt, ref, bad: _field(rt).pipeline(out=bad), r"^out "),
    "fieldset_publish": (lambda rt, ref, bad: rt.publish_fields({"x": bad}, name="bad"), r"^fields\['x'\] "),
}


@pytest.fixture
def window(rt):
    src = PATTERN.copy()
    ref = rt.publish(src, name="w", tiles=1)
    return ref, src


@pytest.mark.parametrize("bad_name", sorted(BAD))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_refused_on_every_path(rt, window, path, bad_name):
    ref, src = window
    factory, reason = BAD[bad_name]
    call, arg = PATHS[path]
    bad = factory()
    with pytest.raises((TypeError, ValueError)) as ei:
        call(rt, ref, bad)
    msg = str(ei.value)
    assert re.search(arg, msg), f"{path}: message does not name the argument: {msg}"
    assert re.search(reason, msg), f"{bad_name}: message does not give the reason: {msg}"
    # Nothing moved: the window holds its bytes, and no window was published for the bad buffer.
    np.testing.assert_array_equal(src, PATTERN)
    np.testing.assert_array_equal(ref.get(), PATTERN)
    assert [w for w in rt.directory.windows() if w.get("name") not in ("w", "fs/f")] == []


def test_buffer_info_never_leaks_torch_errors():
    for name, (factory, reason) in BAD.items():
        with pytest.raises((TypeError, ValueError), match=reason):
            buffer_info(factory(), "x")


def test_fixed_tensors_move_their_values(rt):
    """The fixes the messages suggest give tensors whose bytes are their values: the values come
    back right (a conj view published as is would come back unconjugated)."""
    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    got = rt.publish(z.conj().resolve_conj()).get(framework="torch")
    assert torch.equal(got, z.conj())
    x = torch.arange(1.0, 5.0, dtype=torch.float64)
    got = rt.publish(torch._neg_view(x).resolve_neg()).get(framework="torch")
    assert torch.equal(got, -x)
    s = torch.tensor([0.0, 2.0, 0.0, 4.0], dtype=torch.float64).to_sparse()
    got = rt.publish(s.to_dense()).get(framework="torch")
    assert torch.equal(got, s.to_dense())


def _as_f64(buf):
    if isinstance(buf, torch.Tensor):
        return buf.numpy().view(np.uint8).view(np.float64)
    if isinstance(buf, np.ndarray):
        return buf.view(np.uint8).view(np.float64)
    return np.frombuffer(memoryview(buf).cast("B"), np.float64)


def test_plain_buffers_still_accepted(rt, window):
    """Control: the same paths accept plain buffers of every kind (numpy, torch, ctypes, bytearray)."""
    ref, src = window
    for out in (np.empty(N), torch.empty(N, dtype=torch.float64), (ctypes.c_double * N)(), bytearray(64),
                np.empty(64, np.uint8)):
        assert ref.get(out=out) is out
        np.testing.assert_array_equal(_as_f64(out), PATTERN)
        assert ref.get_async(out=out).wait(10) is out
    ref.put(PATTERN[::-1].copy())
    np.testing.assert_array_equal(src, PATTERN[::-1])
    ref.put_async(torch.from_numpy(PATTERN.copy())).wait(10)
    np.testing.assert_array_equal(src, PATTERN)


def test_readonly_destination_refused_before_async_start(rt, window):
    ref, _ = window
    out = np.empty(N)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        ref.get_async(out=out)
    with pytest.raises(ValueError, match=r"pairs\[0\] dst is read-only"):
        rt.xcopy([(ref, out)])


def test_two_local_sides_refused_at_the_call(rt):
    with pytest.raises(TypeError, match=r"pairs\[0\]: at least one side"):
        rt.xcopy([(np.zeros(4), np.zeros(4))])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_tensor_refused_with_cpu_hint(rt, window):
    ref, _ = window
    with pytest.raises(ValueError, match=r"out lives on device cuda.*\.cpu\(\)"):
        ref.get(out=torch.empty(N, dtype=torch.float64, device="cuda"))
    with pytest.raises(ValueError, match=r"obj lives on device cuda"):
        rt.publish(torch.zeros(N, device="cuda"))

