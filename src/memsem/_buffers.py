"""Buffer acceptance: turn numpy arrays, CPU torch tensors, DLPack producers and buffer-protocol
objects into a :class:`BufferInfo` (address, bytes, dtype, shape), checked at the door.

memsem windows are C-contiguous byte ranges. Non-contiguous views (transposes, steps, negative
strides) are rejected with an error that says so: a strided window would need a gather copy on
every access, which would silently defeat zero-copy. Make the data contiguous first (a copy you
can see) or publish its base.
"""
from __future__ import annotations

import ctypes
import dataclasses
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


def from_numpy(arr: np.ndarray, argname: str = "obj") -> BufferInfo:
    if not arr.flags.c_contiguous:
        raise _noncontig(argname, arr, arr.strides)
    code = _dtypes.code_of(arr.dtype)
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


def from_torch(t: Any, argname: str = "obj") -> BufferInfo:
    if t.device.type != "cpu":
        raise ValueError(f"{argname} must be a CPU tensor for this route, got device {t.device}")
    if not t.is_contiguous():
        raise _noncontig(argname, t, tuple(t.stride()))
    code = _dtypes.code_of(t.dtype)
    return BufferInfo(
        address=t.data_ptr(),
        nbytes=t.numel() * t.element_size(),
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
        capsule = obj.__dlpack__()
    except TypeError:
        capsule = obj.__dlpack__(stream=None)
    ptr = _capsule_get(capsule, b"dltensor")
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
        raise TypeError(f"{argname} has DLPack dtype code={t.dtype.code} bits={t.dtype.bits}; not supported")
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
    arr = np.asarray(mv) if mv.format not in ("", "B") or mv.ndim != 1 else np.frombuffer(mv, np.uint8)
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
