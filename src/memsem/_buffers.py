"""Buffer acceptance: turn numpy arrays, CPU torch tensors, DLPack producers and buffer-protocol
objects into a :class:`BufferInfo` (address, bytes, dtype, shape), checked at the door.

memsem windows are C-contiguous byte ranges. Non-contiguous views (transposes, steps, negative
strides) are rejected with an error that says so: a strided window would need a gather copy on
every access, which would silently defeat zero-copy. Make the data contiguous first (a copy you
can see) or publish its base.

memsem moves bytes, so it only accepts buffers whose bytes *are* their values:

* dtypes are plain numbers and bools (``memsem._dtypes``): object arrays (their bytes are
  pointers to Python objects), structured/void records, str/bytes, datetime/timedelta, non-native
  byte order and other dtypes are refused with a ``TypeError`` naming the argument;
* torch tensors must be plain strided CPU memory: conjugate and negative views (a lazy bit, not
  the bytes), sparse, mkldnn and nested layouts, quantized, meta, zero and non-CPU tensors are
  refused with the reason and the call that makes an acceptable tensor (``.resolve_conj()``,
  ``.to_dense()``, ``.cpu()``...). Torch's own errors never leak out of here.

Every path that takes a destination or a source (publish, get/put and their ``_async`` forms,
xcopy, pipelines, FieldRef rows, ``put_tile``) comes through :func:`buffer_info` or the numpy
fast-path test ``dtype in memsem._dtypes.NUMPY_CODES``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys
from weakref import ref as _weakref
from typing import Any

import numpy as np

from memsem import _dtypes


@dataclasses.dataclass(frozen=True)
class BufferInfo:
    """What memsem needs to know about a caller's buffer.

    Attributes:
        address: address of the first element in bytes (DLPack ``data + byte_offset``).
        nbytes: size in bytes.
        dtype_code: wire code (see ``memsem._dtypes``).
        shape: shape in elements.
        readonly: True when the producer marked the memory read-only.
        byte_offset: DLPack ``byte_offset`` of the source (0 for other sources), kept so a
            re-export reproduces it.
        framework: "numpy", "torch", "dlpack" or "buffer".
        keepalive: the object(s) that own the memory.
    """

    address: int
    nbytes: int
    dtype_code: int
    shape: tuple[int, ...]
    readonly: bool
    byte_offset: int
    framework: str
    keepalive: Any


def _is_torch_dtype(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.dtype)


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _c_contiguous(shape: tuple[int, ...], strides_elems: tuple[int, ...] | None) -> bool:
    if strides_elems is None:
        return True
    expected = 1
    for dim, st in zip(reversed(shape), reversed(strides_elems)):
        if dim != 1 and st != expected:
            return False
        expected *= dim
    return True


def _noncontig(argname: str, obj: object, strides: object) -> ValueError:
    return ValueError(
        f"{argname} must be C-contiguous; got {type(obj).__name__} with strides {strides}. "
        "memsem windows are contiguous byte ranges: call np.ascontiguousarray / .contiguous() "
        "(a copy) or publish the base buffer"
    )


def _dtype_reason(dt: np.dtype) -> str:
    if dt.hasobject:
        return ("holds pointers to Python objects, not values (copying its bytes would copy "
                "pointers); convert it to a numeric array first")
    if dt.fields is not None:
        return "is a structured (record) dtype; move each field as its own array, or view it as uint8"
    if dt.kind == "V":
        return "is an opaque void dtype; view it as uint8 to move raw bytes"
    if dt.kind in "US":
        return "holds strings; encode them into a uint8 array first"
    if dt.kind in "Mm":
        return "is a datetime/timedelta; view it as int64 (arr.view('i8')) to move the raw values"
    if not dt.isnative:
        return "is not in native byte order; convert it with arr.astype(arr.dtype.newbyteorder('='))"
    return "is not a dtype memsem moves"


def dtype_code(dtype: Any, argname: str, *, of_buffer: bool = True) -> int:
    """Wire code of a dtype: of buffer ``argname`` (``of_buffer``), or the dtype argument
    ``argname`` itself (a numpy/torch dtype, a scalar type or a name).

    Raises:
        TypeError: the dtype is not a plain number or bool; the message names ``argname``, the
            dtype, why it is refused and what to do instead.
    """
    try:
        hit = _dtypes.NUMPY_CODES.get(dtype)
    except TypeError:  # unhashable (a list of record fields...): not a plain dtype
        hit = None
    if hit is not None:
        return hit
    if not isinstance(dtype, np.dtype) and not _is_torch_dtype(dtype) and dtype not in _dtypes.supported_names():
        try:
            dtype = np.dtype(dtype)  # np.float32, "<U3", object, a record description...
        except (TypeError, ValueError):
            pass
        else:
            hit = _dtypes.NUMPY_CODES.get(dtype)
            if hit is not None:
                return hit
    supported = ", ".join(_dtypes.supported_names())
    if isinstance(dtype, np.dtype):
        head = f"{argname} has dtype {dtype}, which" if of_buffer else \
            f"{argname}={dtype} is refused: this dtype"
        raise TypeError(f"{head} {_dtype_reason(dtype)}; memsem moves plain numbers and bools ({supported})")
    try:
        return _dtypes.code_of(dtype)
    except TypeError as exc:
        raise TypeError(f"{argname}: {exc}") from None


def from_numpy(arr: np.ndarray, argname: str = "obj") -> BufferInfo:
    code = dtype_code(arr.dtype, argname)
    if not arr.flags.c_contiguous:
        raise _noncontig(argname, arr, arr.strides)
    return BufferInfo(
        address=arr.__array_interface__["data"][0],
        nbytes=arr.nbytes,
        dtype_code=code,
        shape=tuple(arr.shape),
        readonly=not arr.flags.writeable,
        byte_offset=0,
        framework="numpy",
        keepalive=arr,
    )


def _torch_refusal(t: Any, argname: str) -> Exception | None:
    """Why torch tensor ``t`` cannot be used as plain CPU bytes (None when it can)."""
    torch = sys.modules["torch"]
    if t.is_nested:
        return ValueError(f"{argname} is a nested tensor (layout {t.layout}): its components are not "
                          "one byte range with one shape; pass its components (t.unbind()) or "
                          "t.to_padded_tensor(0)")
    layout = t.layout
    if layout is not torch.strided:
        kind = "a sparse" if "sparse" in str(layout) else f"a {str(layout).removeprefix('torch.')}"
        return ValueError(f"{argname} is {kind} tensor (layout {layout}): its values are not one "
                          "contiguous byte range; call .to_dense() first")
    if t.is_quantized:
        return TypeError(f"{argname} is a quantized tensor ({t.dtype}): its bytes are not its values; "
                         "call .dequantize() for the values, or .int_repr() for the raw integers")
    dev = t.device.type
    if dev == "meta" or t.is_meta:
        return ValueError(f"{argname} is a meta tensor: it has no data; materialize it first "
                          "(e.g. torch.empty_like(t, device='cpu'))")
    if dev != "cpu":
        return ValueError(f"{argname} lives on device {t.device}; memsem's host routes move CPU "
                          "memory: call .cpu() first")
    if t.is_conj():
        return ValueError(f"{argname} is a conjugate view (is_conj()): its bytes hold the "
                          "unconjugated values; call .resolve_conj() first")
    if t.is_neg():
        return ValueError(f"{argname} is a negative view (is_neg()): its bytes hold the "
                          "un-negated values; call .resolve_neg() first")
    zero = getattr(t, "_is_zerotensor", None)
    if zero is not None and zero():
        return ValueError(f"{argname} is a lazy zero tensor with no memory; call .clone() first")
    return None


def from_torch(t: Any, argname: str = "obj") -> BufferInfo:
    err = _torch_refusal(t, argname)
    if err is not None:
        raise err
    code = dtype_code(t.dtype, argname)
    if not t.is_contiguous():
        raise _noncontig(argname, t, tuple(t.stride()))
    try:
        address = t.data_ptr()
    except RuntimeError as exc:  # tensor subclasses without storage (fake, functional, wrapper)
        raise ValueError(f"{argname} ({type(t).__name__}) has no CPU memory of its own "
                         f"({str(exc).splitlines()[0]}); pass a plain tensor") from None
    nbytes = t.numel() * t.element_size()
    if address == 0 and nbytes:
        raise ValueError(f"{argname} ({type(t).__name__}) has no CPU memory of its own; pass a plain tensor")
    return BufferInfo(
        address=address,
        nbytes=nbytes,
        dtype_code=code,
        shape=tuple(t.shape),
        readonly=False,
        byte_offset=0,
        framework="torch",
        keepalive=t,
    )


# --- DLPack (https://dmlc.github.io/dlpack/latest/c_api.html): struct layout of DLManagedTensor.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DL_CPU = 1
_DL_CPU_PINNED = 3
# (DLPack type code, bits) -> dtype name
_DL_TYPES = {
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16", (5, 64): "complex64", (5, 128): "complex128", (6, 8): "bool",
    (7, 8): "float8_e4m3fn", (9, 8): "float8_e5m2",
}
_NAME_TO_DL = {v: k for k, v in _DL_TYPES.items()}

_capsule_get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def from_dlpack(obj: Any, argname: str = "obj") -> BufferInfo:
    try:
        try:
            capsule = obj.__dlpack__()
        except TypeError:
            capsule = obj.__dlpack__(stream=None)
    except (TypeError, ValueError, RuntimeError, BufferError, NotImplementedError) as exc:
        raise ValueError(f"{argname}.__dlpack__() refused to export its memory: {exc}") from None
    try:
        ptr = _capsule_get(capsule, b"dltensor")
    except (TypeError, ValueError):
        ptr = None
    if not ptr:
        raise ValueError(f"{argname}.__dlpack__() returned a capsule that is not an unconsumed 'dltensor'")
    t = _DLManagedTensor.from_address(ptr).dl_tensor
    if t.device.device_type not in (_DL_CPU, _DL_CPU_PINNED):
        raise ValueError(
            f"{argname} lives on DLPack device type {t.device.device_type}; only CPU memory is "
            "published by the host engines")
    if t.dtype.lanes != 1:
        raise TypeError(f"{argname} has a vector DLPack dtype (lanes={t.dtype.lanes}); not supported")
    name = _DL_TYPES.get((t.dtype.code, t.dtype.bits))
    if name is None:
        raise TypeError(f"{argname} has DLPack dtype code={t.dtype.code} bits={t.dtype.bits}, which is "
                        f"not a dtype memsem moves (plain numbers and bools: "
                        f"{', '.join(_dtypes.supported_names())})")
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = tuple(int(t.strides[i]) for i in range(t.ndim)) if t.strides else None
    if not _c_contiguous(shape, strides):
        raise _noncontig(argname, obj, strides)
    code = _dtypes.code_of(name)
    itemsize = _dtypes.numpy_dtype(code).itemsize
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return BufferInfo(
        address=int(t.data or 0) + int(t.byte_offset),
        nbytes=n * itemsize,
        dtype_code=code,
        shape=shape,
        readonly=bool(getattr(obj, "flags", None) is not None and not obj.flags.writeable),
        byte_offset=int(t.byte_offset),
        framework="dlpack",
        keepalive=(obj, capsule),  # the unconsumed capsule's destructor frees it when we drop it
    )


def from_buffer_protocol(obj: Any, argname: str = "obj") -> BufferInfo:
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise _noncontig(argname, obj, mv.strides)
    try:
        arr = np.asarray(mv) if mv.format not in ("", "B") or mv.ndim != 1 else np.frombuffer(mv, np.uint8)
    except (TypeError, ValueError, NotImplementedError) as exc:  # a format numpy cannot read
        raise TypeError(f"{argname} exports buffer format {mv.format!r}, which is not a dtype memsem "
                        f"moves ({exc}); plain numbers and bools: {', '.join(_dtypes.supported_names())}") from None
    info = from_numpy(arr.reshape(mv.shape) if mv.ndim else arr, argname)
    return dataclasses.replace(info, readonly=mv.readonly, framework="buffer", keepalive=(obj, mv, arr))


def buffer_info(obj: Any, argname: str = "obj") -> BufferInfo:
    """Inspect ``obj`` (numpy, torch CPU tensor, ``__dlpack__`` producer, buffer protocol).

    Raises:
        TypeError: unsupported object or dtype (the message names ``argname``).
        ValueError: non-contiguous, non-CPU, or otherwise unusable memory.
    """
    if isinstance(obj, np.ndarray):
        return from_numpy(obj, argname)
    if _is_torch_tensor(obj):
        return from_torch(obj, argname)
    if hasattr(obj, "__dlpack__"):
        return from_dlpack(obj, argname)
    try:
        memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{argname} must be a numpy array, a CPU torch tensor, an object with __dlpack__ or "
            f"a buffer-protocol object; got {type(obj).__name__}") from None
    return from_buffer_protocol(obj, argname)


_UINT8_CODE = 3


def check_dtype(argname: str, code: int, ref_code: int) -> None:
    """A local buffer's dtype (wire code) against a ref's: the same, or uint8 on either side
    (raw bytes). Anything else would reinterpret the bytes.

    Raises:
        TypeError: naming ``argname`` and both dtypes.
    """
    if code != ref_code and code != _UINT8_CODE and ref_code != _UINT8_CODE:
        raise TypeError(f"{argname} dtype {_dtypes.name_of(code)} differs from the ref's "
                        f"{_dtypes.name_of(ref_code)}; view it as uint8 to copy raw bytes")


def check_buffer(obj: Any, argname: str, *, writable: bool, dtype_code: int | None = None) -> None:
    """Refuse, now, a buffer that a later (e.g. asynchronous) copy would refuse: the same checks
    as :func:`as_byte_array` without building the view (a dtype lookup for C-contiguous numpy).
    ``dtype_code``: the ref's dtype the buffer must have (:func:`check_dtype`).

    Raises:
        TypeError / ValueError: as :func:`buffer_info`, or ``writable`` and the buffer is read-only,
        or (TypeError) its dtype differs from ``dtype_code``.
    """
    if type(obj) is np.ndarray and obj.flags.c_contiguous and obj.dtype in _dtypes.NUMPY_CODES:
        if writable and not obj.flags.writeable:
            raise ValueError(f"{argname} is read-only; a writable destination is needed")
        if dtype_code is not None:
            check_dtype(argname, _dtypes.NUMPY_CODES[obj.dtype], dtype_code)
        return
    _flat, info = as_byte_array(obj, argname, writable=writable)
    if dtype_code is not None:
        check_dtype(argname, info.dtype_code, dtype_code)


def as_array(obj: Any, argname: str, *, writable: bool = False) -> np.ndarray:
    """A numpy array of ``obj``'s own shape and dtype over its memory (no copy), after the
    checks of :func:`buffer_info` (torch bfloat16/fp8 tensors included, which numpy cannot
    convert by itself)."""
    if type(obj) is np.ndarray:
        check_buffer(obj, argname, writable=writable)
        return obj
    flat, info = as_byte_array(obj, argname, writable=writable)
    return flat.view(_dtypes.numpy_dtype(info.dtype_code)).reshape(info.shape)


def as_byte_array(obj: Any, argname: str, *, writable: bool) -> tuple[np.ndarray, BufferInfo]:
    """A flat uint8 numpy view over ``obj``'s memory (no copy) plus its BufferInfo."""
    info = buffer_info(obj, argname)
    if writable and info.readonly:
        raise ValueError(f"{argname} is read-only; a writable destination is needed")
    arr = _view_of(info)
    return arr, info


def _view_of(info: BufferInfo) -> np.ndarray:
    if isinstance(info.keepalive, np.ndarray):
        return info.keepalive.reshape(-1).view(np.uint8)
    return address_view(info.address, info.nbytes, info.keepalive, readonly=info.readonly)


class _Interface:
    """Exposes an address range through ``__array_interface__``; holds the memory's owner, so the
    numpy array built on it (whose ``base`` is this object) keeps the owner alive."""

    __slots__ = ("__array_interface__", "owner", "__weakref__")

    def __init__(self, address: int, nbytes: int, owner: Any, readonly: bool) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "version": 3, "shape": (nbytes,), "typestr": "|u1", "data": (address, readonly),
        }


def address_view(address: int, nbytes: int, owner: Any, *, readonly: bool = False) -> np.ndarray:
    """A flat uint8 array over ``nbytes`` at ``address``; keeps ``owner`` alive while it lives."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.asarray(_Interface(address, nbytes, owner, readonly))


def dlpack_type_of(code: int) -> tuple[int, int]:
    return _NAME_TO_DL[_dtypes.name_of(code)]


# Address lookup of numpy arrays on the hot path: ``__array_interface__`` costs ~1 us, so the data
# address is cached per live array (weakly; verified by identity and size, since an in-place
# ``ndarray.resize`` to another size may move the data).
_ADDR: dict[int, tuple[Any, int, int]] = {}


def array_address(a: np.ndarray) -> int:
    """Data address of a numpy array (cached while the array lives)."""
    c = _ADDR.get(id(a))
    if c is not None and c[0]() is a and c[2] == a.nbytes:
        return c[1]
    addr = a.__array_interface__["data"][0]
    if len(_ADDR) > 4096:
        _ADDR.clear()
    _ADDR[id(a)] = (_weakref(a), addr, a.nbytes)
    return addr


#: alignment of arena tensors (bytes) and of the arena itself (a transparent huge page)
ARENA_ALIGN = 64
_HUGE = 2 << 20


def empty_arena(layout: "list[tuple[np.dtype, tuple[int, ...]]]") -> "list[np.ndarray]":
    """New uninitialized arrays of the given dtypes and shapes, carved out of one anonymous
    mapping aligned to and advised for transparent huge pages (``MADV_HUGEPAGE``).

    A first copy into fresh memory pays a page fault per page of the destination; with 2 MiB
    pages instead of 4 KiB ones that costs several times less (numpy advises huge pages only for
    arrays of 4 MiB or more on its own). The arrays share the mapping: it is unmapped when the
    last of them is collected. Each array starts on an ``ARENA_ALIGN``-byte boundary.
    """
    sizes = [int(np.dtype(dt).itemsize * int(np.prod(shape, dtype=np.int64))) for dt, shape in layout]
    total = sum(-(-n // ARENA_ALIGN) * ARENA_ALIGN for n in sizes)
    if total == 0:
        return [np.empty(shape, dt) for dt, shape in layout]
    m = mmap.mmap(-1, total + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(m, np.uint8)
    off = (-base.__array_interface__["data"][0]) % _HUGE
    advise = getattr(m, "madvise", None)
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None and huge is not None:
        try:
            advise(huge, off, total)
        except OSError:  # no transparent huge pages here: plain pages, same arrays
            pass
    out = []
    for (dt, shape), n in zip(layout, sizes):
        out.append(base[off:off + n].view(np.dtype(dt)).reshape(shape))
        off += -(-n // ARENA_ALIGN) * ARENA_ALIGN
    return out
