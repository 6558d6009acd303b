"""DLPack export of received data, keeping the producer's ``byte_offset``.

``TensorRef.get(framework="dlpack")`` returns a :class:`DLPackBuffer`: its ``__dlpack__`` hands
out a DLManagedTensor whose ``data`` is the buffer's base and whose ``byte_offset`` is the one
the producer published with, so a consumer re-exporting sees exactly what the producer exported.
(The capsule plumbing uses ctypes.pythonapi; memsem's data path never does.)
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from memsem import _dtypes
from memsem._buffers import _DLManagedTensor, dlpack_type_of

_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_CAPSULE_DTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # PyObject* being destroyed: never incref it
_live: dict[int, Any] = {}
_lock = threading.Lock()

_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
# Private prototypes (raw PyObject* as void*): setting argtypes on ctypes.pythonapi's shared
# function objects would change them for every other user.
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


@_DELETER
def _deleter(ptr: int) -> None:
    with _lock:
        _live.pop(ptr, None)


@_CAPSULE_DTOR
def _capsule_dtor(capsule: int) -> None:
    if _PyCapsule_IsValid(capsule, b"dltensor"):  # never consumed: we still own it
        _deleter(_PyCapsule_GetPointer(capsule, b"dltensor"))


class DLPackBuffer:
    """Bytes received from a ref, exportable through DLPack with the producer's byte_offset.

    Attributes:
        base: flat uint8 array of ``byte_offset + nbytes`` bytes; the data starts at
            ``base[byte_offset:]``.
        byte_offset: DLPack byte_offset reported on export.
        array: numpy view of the data (shape and dtype of the ref).
    """

    def __init__(self, dtype_code: int, shape: tuple[int, ...], byte_offset: int) -> None:
        dt = _dtypes.numpy_dtype(dtype_code)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        self.dtype_code = dtype_code
        self.shape = tuple(shape)
        self.byte_offset = byte_offset
        self.base = np.zeros(byte_offset + n, np.uint8)
        self.array = self.base[byte_offset:].view(dt).reshape(shape)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        mt = _DLManagedTensor()
        t = mt.dl_tensor
        t.data = self.base.ctypes.data
        t.device.device_type, t.device.device_id = 1, 0
        t.ndim = ndim
        code, bits = dlpack_type_of(self.dtype_code)
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, 1
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = None
        t.byte_offset = self.byte_offset
        mt.deleter = ctypes.cast(_deleter, ctypes.c_void_p).value
        ptr = ctypes.addressof(mt)
        with _lock:
            _live[ptr] = (mt, shape, self)
        return _PyCapsule_New(ptr, b"dltensor", ctypes.cast(_capsule_dtor, ctypes.c_void_p).value)
