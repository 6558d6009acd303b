"""The dtypes a ref can carry, with stable one-byte codes for the wire format.

bfloat16 and float8 types come from ml_dtypes (numpy has none); torch dtypes are looked up by
name only when torch is already imported by the caller.
"""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

# code -> (canonical name, numpy dtype, torch attribute name)
_TABLE: dict[int, tuple[str, np.dtype, str | None]] = {
    1: ("bool", np.dtype(np.bool_), "bool"),
    2: ("int8", np.dtype(np.int8), "int8"),
    3: ("uint8", np.dtype(np.uint8), "uint8"),
    4: ("int16", np.dtype(np.int16), "int16"),
    5: ("uint16", np.dtype(np.uint16), "uint16"),
    6: ("int32", np.dtype(np.int32), "int32"),
    7: ("uint32", np.dtype(np.uint32), "uint32"),
    8: ("int64", np.dtype(np.int64), "int64"),
    9: ("uint64", np.dtype(np.uint64), "uint64"),
    10: ("float16", np.dtype(np.float16), "float16"),
    11: ("float32", np.dtype(np.float32), "float32"),
    12: ("float64", np.dtype(np.float64), "float64"),
    13: ("bfloat16", np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    14: ("float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
    15: ("float8_e5m2", np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2"),
    16: ("complex64", np.dtype(np.complex64), "complex64"),
    17: ("complex128", np.dtype(np.complex128), "complex128"),
}
_BY_NAME = {name: code for code, (name, _, _) in _TABLE.items()}
_BY_NUMPY = {dt: code for code, (_, dt, _) in _TABLE.items()}
#: numpy dtype -> wire code of every dtype memsem moves (plain numbers and bools). A numpy dtype
#: that is not a key (object, structured, void, str/bytes, datetime, non-native byte order,
#: float128...) is refused at every door: ``dtype in NUMPY_CODES`` is the hot-path test.
NUMPY_CODES: "dict[np.dtype, int]" = _BY_NUMPY


#: every wire dtype code
CODES = frozenset(_TABLE)


def codes() -> list[int]:
    """Every wire dtype code."""
    return list(_TABLE)


def supported_names() -> list[str]:
    return [name for name, _, _ in _TABLE.values()]


def code_of(dtype: object) -> int:
    """Wire code of a numpy dtype, torch dtype or dtype name. Raises TypeError if unsupported."""
    if type(dtype) is not str:
        try:
            hit = _BY_NUMPY.get(dtype)  # fast path: a native numpy dtype object
        except TypeError:
            hit = None
        if hit is not None:
            return hit
    if isinstance(dtype, str) and dtype in _BY_NAME:
        return _BY_NAME[dtype]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name in _BY_NAME:
            return _BY_NAME[name]
        raise TypeError(f"dtype {dtype} is not supported; supported: {', '.join(supported_names())}")
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise TypeError(f"dtype {dtype!r} is not a dtype; supported: {', '.join(supported_names())}") from exc
    dt = dt.newbyteorder("=") if dt.byteorder not in ("=", "|") and dt.isnative else dt
    if not dt.isnative:
        raise TypeError(f"dtype {dtype!r} is not in native byte order; convert it first")
    code = _BY_NUMPY.get(dt)
    if code is None:
        raise TypeError(f"dtype {dt} is not supported; supported: {', '.join(supported_names())}")
    return code


def numpy_dtype(code: int) -> np.dtype:
    try:
        return _TABLE[code][1]
    except KeyError:
        raise ValueError(f"unknown dtype code {code!r} in ref") from None


def name_of(code: int) -> str:
    try:
        return _TABLE[code][0]
    except KeyError:
        raise ValueError(f"unknown dtype code {code!r} in ref") from None


def torch_dtype(code: int):  # -> torch.dtype
    import torch

    attr = _TABLE[code][2]
    dt = getattr(torch, attr, None) if attr else None
    if dt is None:
        raise TypeError(f"torch {torch.__version__} has no dtype {name_of(code)}")
    return dt
