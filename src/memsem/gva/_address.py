"""The GVA: one 64-bit job-wide address space, sliced by rank.

``gva = rank << RANK_SHIFT | offset``: each participant (PE, rank) owns a 2**44-byte slice
(16 TiB), so resolution GVA -> (owner rank, window, offset) is a shift plus one table lookup.
Windows are placed in a rank's slice at 64 KiB alignment by a bump allocator; a GVA is never
reused by the same runtime, and a new runtime reusing a dead rank starts windows at fresh random
generations, so an old ref can never match a new window.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Any

from memsem.engines._base import Descriptor

RANK_SHIFT = 44
RANK_LIMIT = 1 << (64 - RANK_SHIFT)
SLICE_BYTES = 1 << RANK_SHIFT
GVA_ALIGN = 1 << 16


def make_gva(rank: int, offset: int) -> int:
    if not 0 <= rank < RANK_LIMIT:
        raise ValueError(f"rank must be in [0, {RANK_LIMIT}), got {rank!r}")
    if not 0 <= offset < SLICE_BYTES:
        raise ValueError(f"offset must be in [0, {SLICE_BYTES}), got {offset!r}")
    return (rank << RANK_SHIFT) | offset


def split_gva(gva: int) -> tuple[int, int]:
    """``(rank, offset)`` of a GVA."""
    return gva >> RANK_SHIFT, gva & (SLICE_BYTES - 1)


class SliceAllocator:
    """Bump allocator of window bases inside one rank's slice (never reuses an address)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._next = GVA_ALIGN  # offset 0 stays unused: GVA 0 of rank 0 is never valid

    def allocate(self, nbytes: int) -> int:
        span = max(GVA_ALIGN, (nbytes + GVA_ALIGN - 1) // GVA_ALIGN * GVA_ALIGN)
        if self._next + span > SLICE_BYTES:
            raise MemoryError(f"rank {self.rank}'s GVA slice is exhausted")
        gva = make_gva(self.rank, self._next)
        self._next += span
        return gva


def key_digest(key: bytes) -> str:
    """What the directory stores instead of the access key itself."""
    return hashlib.sha256(b"memsem-access-key\0" + key).hexdigest()


def key_matches(key: bytes, digest: str) -> bool:
    return hmac.compare_digest(key_digest(key), digest)


@dataclasses.dataclass
class WindowInfo:
    """A published window as the directory holds it (no tensor data, no key).

    Attributes:
        gva: base GVA. nbytes: size in bytes. name: optional user name.
        generation: generation at publish (the control block holds the live value).
        access: "r" or "rw". key_digest: sha256 digest of the access key.
        rank, owner_pid, owner_start, node: the owner.
        control: control-block segment name ("" when the owner's node holds none for remote
            consumers). n_ready/tile_bytes: ready words.
        descriptors: engine name -> Descriptor.
        dtype_code, shape, byte_offset, framework: how the window was published.
    """

    gva: int
    nbytes: int
    name: str
    generation: int
    access: str
    key_digest: str
    rank: int
    owner_pid: int
    owner_start: int
    node: str
    control: str
    n_ready: int
    tile_bytes: int
    descriptors: dict[str, Descriptor]
    dtype_code: int
    shape: tuple[int, ...]
    byte_offset: int = 0
    framework: str = "numpy"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in _FIELDS}
        d["descriptors"] = {k: v.to_json() for k, v in self.descriptors.items()}
        d["shape"] = list(self.shape)
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WindowInfo":  # noqa: D102
        d = dict(d)
        d["descriptors"] = {k: Descriptor.from_json(v) for k, v in d["descriptors"].items()}
        d["shape"] = tuple(d["shape"])
        return cls(**d)


_FIELDS = dataclasses.fields(WindowInfo)
