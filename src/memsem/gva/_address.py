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

from memsem import _dtypes
from memsem.engines._base import Descriptor, typed_field
from memsem.gva._control_block import MAX_READY_WORDS

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


_KEY_SALT = b"memsem-access-key\0"


def key_digest(key: bytes) -> str:
    """What the directory stores instead of the access key itself."""
    return hashlib.sha256(_KEY_SALT + key).hexdigest()


def key_matches(key: bytes, digest: str) -> bool:
    """``key`` is the access key whose :func:`key_digest` is ``digest`` (compared in constant
    time)."""
    return hmac.compare_digest(hashlib.sha256(_KEY_SALT + key).hexdigest(), digest)


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
    def from_json(cls, d: Any) -> "WindowInfo":
        """Parse a directory record (``to_json`` output), checking every field's type.

        Unknown fields are ignored (a newer writer may add some).

        Raises:
            ValueError: not an object, a field missing or of the wrong type, an unknown access
                or dtype code, a descriptor that does not parse; the message names the window
                (when its gva parsed) and the field.
        """
        what = "window record"
        gva = typed_field(d, "gva", int, what)
        what = f"window record of gva {gva:#x}"
        out: dict[str, Any] = {"gva": gva}
        for name, kind, default in _RECORD_FIELDS:
            out[name] = typed_field(d, name, kind, what) if default is ... else \
                typed_field(d, name, kind, what, default)
        if out["extra"] is None:
            out["extra"] = {}
        for name in ("gva", "nbytes", "generation", "rank", "owner_pid", "owner_start", "n_ready",
                     "tile_bytes", "byte_offset"):
            if out[name] < 0:
                raise ValueError(f"{what} field {name!r} must be >= 0, got {out[name]}")
        if out["n_ready"] > min(MAX_READY_WORDS, max(out["nbytes"], 1)):
            raise ValueError(f"{what} field 'n_ready' must be at most {min(MAX_READY_WORDS, max(out['nbytes'], 1))} "
                             f"(a ready word per tile, a tile per byte at most), got {out['n_ready']}")
        if out["access"] not in ("r", "rw"):
            raise ValueError(f"{what} field 'access' must be 'r' or 'rw', got {out['access']!r}")
        if out["dtype_code"] not in _dtypes.CODES:
            raise ValueError(f"{what} field 'dtype_code' {out['dtype_code']} is not a known dtype code")
        shape = out["shape"]
        for i, dim in enumerate(shape):
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
                raise ValueError(f"{what} field 'shape' must hold ints >= 0, got {dim!r} at [{i}]")
        out["shape"] = tuple(shape)
        descs = {}
        for ename, raw in out["descriptors"].items():
            try:
                desc = Descriptor.from_json(raw)
            except ValueError as exc:
                raise ValueError(f"{what} field 'descriptors'[{ename!r}]: {exc}") from None
            if desc.engine != ename:
                raise ValueError(f"{what} field 'descriptors'[{ename!r}] is tagged for engine "
                                 f"{desc.engine!r}")
            descs[ename] = desc
        out["descriptors"] = descs
        return cls(**out)


#: (field, type, default) of a window record after ``gva``; ``...`` marks a required field
_RECORD_FIELDS: tuple[tuple[str, Any, Any], ...] = (
    ("nbytes", int, ...), ("name", str, ""), ("generation", int, ...), ("access", str, ...),
    ("key_digest", str, ...), ("rank", int, ...), ("owner_pid", int, ...), ("owner_start", int, ...),
    ("node", str, ...), ("control", str, ""), ("n_ready", int, 0), ("tile_bytes", int, 0),
    ("descriptors", dict, ...), ("dtype_code", int, ...), ("shape", (list, tuple), ...),
    ("byte_offset", int, 0), ("framework", str, "numpy"), ("extra", dict, None),
)

_FIELDS = dataclasses.fields(WindowInfo)
