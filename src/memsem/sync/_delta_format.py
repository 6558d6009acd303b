"""The bytes of a state dict's delta history: its tiles, records and index (docs/weight-sync.md).

**Tiles.** Every tensor of the state dict is cut into tiles of ``tile_bytes`` bytes from its
first byte (the last one shorter; an empty tensor has none): the unit of digests and of changes.
Tiles are numbered in layout order; ``Tiles`` holds them as arrays (numpy, one entry per tile).

**A record** (one window per version, published once written, never changed) says what version
``v`` is and how it differs from ``v - 1``::

    head     RECORD_HEAD: magic, v, base (v - 1, or 0: no delta, digests only), tiles,
             tile_bytes, payload bytes, dense bytes (of the tiles moved whole), 0
    digests  uint64 per tile: the digest of the tile's bytes at v (``memsem.native.digest``)
    counts   uint32 per tile (padded to 8 bytes): 0 unchanged since base, DELTA_DENSE changed
             (read from version v's window), else the elements of its patch
    payload  the patches of the tiles whose count is a number, in tile order: that many uint16
             element indices (ascending, padded to 8 bytes), then their values (padded to 8)

**The index** (one small double-buffered window) lists the records held: its version moves in
step with the state dict's (index version ``v`` is committed once version ``v`` was recorded, or
found overwritten before it could be), so a reader waits for a record like for any version::

    head     INDEX_HEAD: magic, history, tile_bytes, tiles, data bytes of the window, and the
             microseconds from the last version's commit until its entry was committed
    entries  ``history`` entries of ENTRY_BYTES, version v at v % history: ENTRY (v, kind,
             record bytes, payload bytes, dense bytes, ref length), then the record's ref

Every number read from a peer's index or record is bounded here before it is used.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

from memsem.native import DELTA_DENSE

INDEX_MAGIC = b"MSDLIDX1"
RECORD_MAGIC = b"MSDLREC1"
INDEX_HEAD = struct.Struct("<8sQQQQQ")
RECORD_HEAD = struct.Struct("<8sQQQQQQQ")
ENTRY = struct.Struct("<QQQQQQ")
#: bytes per index entry (the entry, then the record's serialized ref)
ENTRY_BYTES = 320
#: entry kinds: no entry yet; a record (its window's ref follows); recorded without one
KIND_EMPTY, KIND_RECORD, KIND_NONE = 0, 1, 2
#: default bytes per tile; a patch's indices are uint16, so a tile holds at most 65536 elements
DEFAULT_TILE_BYTES = 64 << 10
#: a changed tile is patched when its patch is under this fraction of its bytes, else moved whole
SPARSE_MAX = 0.75
#: the patches of one record hold at most this fraction of the state dict's bytes (beyond it,
#: every changed tile of that version is moved whole): the bound of one record's memory
PAYLOAD_MAX = 0.25


def pad8(n: Any) -> Any:
    """``n`` rounded up to a multiple of 8 (ints or uint64 arrays)."""
    return (n + 7) & ~7 if isinstance(n, int) else (n + np.uint64(7)) & ~np.uint64(7)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The tiles of a state dict's tensors (see the module docstring), as arrays by tile.

    Attributes:
        tile_bytes: bytes per tile. entry: the layout entry of each tile. start: its first byte
        within the tensor. nbytes: its bytes. itemsize: its elements' bytes. first: the first
        tile of each entry (one more value at the end: the number of tiles).
    """

    tile_bytes: int
    entry: np.ndarray
    start: np.ndarray
    nbytes: np.ndarray
    itemsize: np.ndarray
    first: np.ndarray

    @classmethod
    def of(cls, entries: Any, tile_bytes: int) -> "Tiles":
        """The tiles of layout ``entries`` (``TensorEntry``)."""
        counts = np.array([-(-e.nbytes // tile_bytes) for e in entries], np.int64)
        first = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        n = int(first[-1])
        entry = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        start = ((np.arange(n, dtype=np.int64) - first[entry]) * tile_bytes).astype(np.uint64)
        size = np.array([e.nbytes for e in entries], np.uint64)
        nbytes = np.minimum(np.uint64(tile_bytes), size[entry] - start) if n else np.zeros(0, np.uint64)
        item = np.array([e.dtype.itemsize for e in entries], np.uint32)
        return cls(tile_bytes, entry, start, nbytes.astype(np.uint64), item[entry] if n else np.zeros(0, np.uint32),
                   first)

    @property
    def n(self) -> int:
        return len(self.entry)

    def limits(self) -> np.ndarray:
        """Per tile, the most differing elements a patch may hold (``SPARSE_MAX``), uint32."""
        per = 2 + self.itemsize.astype(np.float64)
        return np.floor(SPARSE_MAX * self.nbytes.astype(np.float64) / per).astype(np.uint32)

    def addresses(self, bases: np.ndarray) -> np.ndarray:
        """uint64 address of every tile, given the address of each entry's first byte."""
        return (bases.astype(np.uint64)[self.entry] + self.start).astype(np.uint64)

    def select(self, entry_mask: np.ndarray) -> np.ndarray:
        """Indices of the tiles of the entries ``entry_mask`` selects (bool per entry)."""
        return np.flatnonzero(entry_mask[self.entry]) if self.n else np.zeros(0, np.int64)


def patch_sizes(counts: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """Bytes of each tile's patch (0 for unchanged and whole tiles), uint64."""
    c = counts.astype(np.uint64)
    sparse = (counts != 0) & (counts != DELTA_DENSE)
    size = pad8(np.uint64(2) * c) + pad8(c * itemsize.astype(np.uint64))
    return np.where(sparse, size, np.uint64(0)).astype(np.uint64)


def record_nbytes(n_tiles: int, payload: int) -> int:
    return RECORD_HEAD.size + 8 * n_tiles + pad8(4 * n_tiles) + payload


@dataclasses.dataclass
class Record:
    """One version's record, read back (see the module docstring): views into ``raw``."""

    version: int
    base: int
    digests: np.ndarray
    counts: np.ndarray
    payload: np.ndarray
    dense_bytes: int
    raw: np.ndarray

    @classmethod
    def new(cls, version: int, base: int, digests: np.ndarray, counts: np.ndarray, payload_bytes: int,
            dense_bytes: int, tile_bytes: int) -> "Record":
        """A record to fill: head, digests and counts written; the payload left to the caller."""
        n = len(digests)
        raw = np.empty(record_nbytes(n, payload_bytes), np.uint8)
        raw[:RECORD_HEAD.size] = np.frombuffer(RECORD_HEAD.pack(RECORD_MAGIC, version, base, n, tile_bytes,
                                                                payload_bytes, dense_bytes, 0), np.uint8)
        rec = cls._views(raw, version, base, n, payload_bytes, dense_bytes)
        rec.digests[:] = digests
        rec.counts[:] = counts
        raw[RECORD_HEAD.size + 8 * n + 4 * n:RECORD_HEAD.size + 8 * n + pad8(4 * n)] = 0
        return rec

    @classmethod
    def _views(cls, raw: np.ndarray, version: int, base: int, n: int, payload: int, dense: int) -> "Record":
        h = RECORD_HEAD.size
        dg = raw[h:h + 8 * n].view(np.uint64)
        ct = raw[h + 8 * n:h + 12 * n].view(np.uint32)
        p0 = h + 8 * n + pad8(4 * n)
        return cls(version, base, dg, ct, raw[p0:p0 + payload], dense, raw)

    @classmethod
    def parse(cls, raw: np.ndarray, version: int, tiles: Tiles) -> "Record":
        """Check a record read from a peer against what the reader expects of ``version``.

        Raises:
            ValueError: not that version's record of these tiles (named).
        """
        if raw.nbytes < RECORD_HEAD.size:
            raise ValueError(f"delta record of version {version}: {raw.nbytes} bytes, shorter than its head")
        magic, v, base, n, tb, payload, dense, _ = RECORD_HEAD.unpack(raw[:RECORD_HEAD.size].tobytes())
        if magic != RECORD_MAGIC or v != version or n != tiles.n or tb != tiles.tile_bytes:
            raise ValueError(f"delta record of version {version}: not it (magic {magic!r}, version {v}, {n} tiles "
                             f"of {tb} bytes; expected {tiles.n} of {tiles.tile_bytes})")
        if base not in (0, version - 1) or record_nbytes(n, payload) != raw.nbytes:
            raise ValueError(f"delta record of version {version}: base {base}, {payload} payload bytes in a "
                             f"record of {raw.nbytes} bytes")
        rec = cls._views(raw, v, base, n, payload, dense)
        if base:
            c = rec.counts
            sparse = (c != 0) & (c != DELTA_DENSE)
            if np.any(c[sparse].astype(np.uint64) > tiles.nbytes[sparse] // tiles.itemsize[sparse].astype(np.uint64)):
                raise ValueError(f"delta record of version {version}: a patch holds more elements than its tile")
            if int(patch_sizes(c, tiles.itemsize).sum()) != payload:
                raise ValueError(f"delta record of version {version}: its patches do not add up to its "
                                 f"{payload} payload bytes")
        return rec


@dataclasses.dataclass(frozen=True)
class Entry:
    """One index entry: the record of ``version`` (``kind``), its window's ref and sizes."""

    version: int
    kind: int
    record_bytes: int
    payload: int
    dense: int
    ref: bytes


def index_nbytes(history: int) -> int:
    return INDEX_HEAD.size + history * ENTRY_BYTES


def index_head(history: int, tile_bytes: int, n_tiles: int, data_bytes: int) -> bytes:
    return INDEX_HEAD.pack(INDEX_MAGIC, history, tile_bytes, n_tiles, data_bytes, 0)


def set_latency(arr: np.ndarray, seconds: float) -> None:
    """Record in the index bytes ``arr`` how long the last entry took after its commit."""
    arr[INDEX_HEAD.size - 8:INDEX_HEAD.size] = np.frombuffer(struct.pack("<Q", int(seconds * 1e6)), np.uint8)


def write_entry(arr: np.ndarray, history: int, e: Entry) -> None:
    """Write ``e`` at its place (``version % history``) in the index bytes ``arr``."""
    if len(e.ref) > ENTRY_BYTES - ENTRY.size:
        raise ValueError(f"a record's ref of {len(e.ref)} bytes does not fit an index entry")
    off = INDEX_HEAD.size + (e.version % history) * ENTRY_BYTES
    raw = ENTRY.pack(e.version, e.kind, e.record_bytes, e.payload, e.dense, len(e.ref)) + e.ref
    arr[off:off + ENTRY_BYTES] = 0
    arr[off:off + len(raw)] = np.frombuffer(raw, np.uint8)


class Index:
    """An index read back from a peer (checked against the reader's tiles)."""

    def __init__(self, raw: bytes, tiles: Tiles, data_bytes: int, history: int) -> None:
        if len(raw) != index_nbytes(history):
            raise ValueError(f"delta index: {len(raw)} bytes, expected {index_nbytes(history)}")
        magic, hist, tb, n, nb, us = INDEX_HEAD.unpack(raw[:INDEX_HEAD.size])
        if magic != INDEX_MAGIC or hist != history or tb != tiles.tile_bytes or n != tiles.n or nb != data_bytes:
            raise ValueError(f"delta index: magic {magic!r}, history {hist}, {n} tiles of {tb} bytes over {nb} "
                             f"bytes; expected {history}, {tiles.n} of {tiles.tile_bytes} over {data_bytes}")
        self._raw = raw
        self.history = history
        #: seconds the owner took to record its last version (from its commit; at most an hour)
        self.latency_s = min(us, 3600_000_000) / 1e6
        self._limit = 2 * data_bytes + record_nbytes(tiles.n, 0)

    def entry(self, version: int) -> Entry | None:
        """The entry of ``version`` (None: not there, or overwritten by a later one)."""
        off = INDEX_HEAD.size + (version % self.history) * ENTRY_BYTES
        v, kind, rb, payload, dense, n = ENTRY.unpack(self._raw[off:off + ENTRY.size])
        if v != version or kind not in (KIND_RECORD, KIND_NONE):
            return None
        if kind == KIND_RECORD and not (0 < n <= ENTRY_BYTES - ENTRY.size and rb <= self._limit
                                        and payload <= rb and dense <= self._limit):
            raise ValueError(f"delta index: the entry of version {version} is out of bounds "
                             f"(ref {n} bytes, record {rb} bytes, payload {payload}, dense {dense})")
        ref = self._raw[off + ENTRY.size:off + ENTRY.size + n] if kind == KIND_RECORD else b""
        return Entry(v, kind, rb, payload, dense, bytes(ref))


__all__ = ["DEFAULT_TILE_BYTES", "ENTRY_BYTES", "Entry", "INDEX_HEAD", "Index", "KIND_EMPTY", "KIND_NONE",
           "KIND_RECORD", "PAYLOAD_MAX", "RECORD_HEAD", "Record", "SPARSE_MAX", "Tiles", "index_head",
           "index_nbytes", "pad8", "patch_sizes", "record_nbytes", "set_latency", "write_entry"]
