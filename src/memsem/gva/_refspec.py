"""RefSpec: the serializable content of a ref (what crosses process boundaries).

Wire format (little endian), 60 bytes plus 8 per dimension plus the name::

    magic "MSR1" | flags u8 | dtype u8 | ndim u8 | name_len u8 |
    gva u64 | generation u64 | key 16 B | offset u64 | nbytes u64 | byte_offset u32 |
    shape ndim x u64 | name utf-8

It carries no pointer: the GVA is resolved through the directory, and the 128-bit access key is
a capability checked against the directory's digest before a byte moves.
"""
from __future__ import annotations

import dataclasses
import struct

from memsem import _dtypes

MAGIC = b"MSR1"
_HEAD = struct.Struct("<4sBBBBQQ16sQQI")
FLAG_RW = 1
FLAG_TORCH = 2
FLAG_DLPACK = 4


@dataclasses.dataclass(frozen=True)
class RefSpec:
    """Addressing data of a ref: a byte range of a window plus how to interpret it.

    Attributes:
        gva: base GVA of the window. generation: generation the ref was minted for.
        key: 16-byte access key. access: "r" or "rw".
        offset: byte offset of this ref's range inside the window.
        nbytes: bytes in the range. dtype_code/shape: element view of the range (C order).
        byte_offset: DLPack byte_offset of the published source (re-exported as is).
        framework: "numpy", "torch" or "dlpack" (what ``get`` returns by default).
        name: the window's name, for messages ("" when unnamed).
    """

    gva: int
    generation: int
    key: bytes
    access: str
    offset: int
    nbytes: int
    dtype_code: int
    shape: tuple[int, ...]
    byte_offset: int = 0
    framework: str = "numpy"
    name: str = ""

    @property
    def writable(self) -> bool:
        return self.access == "rw"

    @property
    def label(self) -> str:
        return f"window {self.name!r} (gva {self.gva:#x})" if self.name else f"window gva {self.gva:#x}"

    def to_bytes(self) -> bytes:
        name = self.name.encode()
        if len(name) > 255:
            name = name[:255]
        flags = (FLAG_RW if self.writable else 0) | (FLAG_TORCH if self.framework == "torch" else 0) \
            | (FLAG_DLPACK if self.framework == "dlpack" else 0)
        head = _HEAD.pack(MAGIC, flags, self.dtype_code, len(self.shape), len(name), self.gva,
                          self.generation, self.key, self.offset, self.nbytes, self.byte_offset)
        return head + struct.pack(f"<{len(self.shape)}Q", *self.shape) + name

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "RefSpec":
        data = bytes(data)
        if len(data) < _HEAD.size or data[:4] != MAGIC:
            raise ValueError(f"data is not a serialized memsem ref (got {len(data)} bytes starting {data[:4]!r})")
        magic, flags, dtype, ndim, nlen, gva, gen, key, off, nbytes, boff = _HEAD.unpack_from(data)
        end = _HEAD.size + 8 * ndim + nlen
        if len(data) != end:
            raise ValueError(f"serialized ref has {len(data)} bytes, its header says {end}")
        shape = struct.unpack_from(f"<{ndim}Q", data, _HEAD.size)
        try:
            name = data[_HEAD.size + 8 * ndim:end].decode()
        except UnicodeDecodeError:
            raise ValueError("data is not a serialized memsem ref (its name is not UTF-8)") from None
        _dtypes.name_of(dtype)  # validates the code
        fw = "torch" if flags & FLAG_TORCH else "dlpack" if flags & FLAG_DLPACK else "numpy"
        return cls(gva, gen, key, "rw" if flags & FLAG_RW else "r", off, nbytes, dtype, tuple(shape),
                   boff, fw, name)
