"""Delta buckets of the verl backend (``memsem.integrations.verl``, ``delta=True``).

Between two syncs most bytes of a model do not change (issue 36). With ``delta=True`` the
trainer and every rollout keep, in host memory, the bytes of every bucket of the last sync they
completed (a :class:`BucketStore`); in the next sync, a bucket whose layout (its metadata: the
same tensor chunks at the same offsets) is the one of that sync's bucket travels as a **delta
bucket**: the changed elements of each tile (``memsem.native.record_tiles``: a patch of element
indices and values, or the tile whole when many changed) and the digest of every tile of the new
bytes. A rollout patches its own copy of that bucket and checks every tile against those digests
(``memsem.native.check_tiles``, fused with the patching); the tensors it yields are views of its
copy, so verl's loaders get whole tensors, as with full buckets.

The data area of a delta bucket (``wire`` bytes at the slot's ``meta_bytes``), 8-byte aligned:

* ``_DHEAD``: tiles ``n``, patch bytes ``P``, whole-tile bytes ``D``;
* ``n`` uint32 counts (0: unchanged, ``DENSE``: moved whole, else the elements of its patch),
  padded to 8 bytes; ``n`` uint64 digests of the new tiles;
* the patches, in tile order (``record_tiles``' layout), ``P`` bytes;
* the tiles moved whole, in tile order, ``D`` bytes.

A bucket goes as a delta only when that comes to at most ``DELTA_MAX`` of its data bytes; else
in full. Fail closed: the sha256 digest of the bucket as sent (checked before anything is
accepted, whoever relayed it) catches wrong bytes on the way; a tile digest that does not match
after the patch means this rollout's copy was not the last sync's bytes (its consumer wrote into
a yielded tensor, say): it reads the bucket's bytes whole from the trainer's store window (the
trainer's copy, published for the sync) and checks them again, so the tensors yielded are the
trainer's, never a mix.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

from memsem import native
from memsem.sync._delta_format import SPARSE_MAX, patch_sizes
from memsem.sync._delta_writer import DENSE, chunks

#: bytes of a tile (at most 65536 elements of one tensor chunk: a patch's indices are uint16)
TILE_BYTES = 64 << 10
#: a bucket goes as a delta when its delta is at most this fraction of its data bytes (the
#: rollout's check reads every byte once more: beyond it a full bucket moves as fast)
DELTA_MAX = 0.5
#: head of a delta bucket's data area: tiles, patch bytes, whole-tile bytes
_DHEAD = struct.Struct("<QQQ")


def _pad8(n: int) -> int:
    return (n + 7) & ~7


@dataclasses.dataclass(frozen=True)
class BucketTiles:
    """The tiles of one bucket's data area, as arrays by tile.

    Attributes:
        off: uint64, each tile's first byte within the data area. nbytes: uint64, its bytes.
        itemsize: uint32, its elements' bytes (1, 2, 4 or 8). limit: uint32, the most differing
        elements its patch may hold (``SPARSE_MAX`` of what the tile whole costs).
    """

    off: np.ndarray
    nbytes: np.ndarray
    itemsize: np.ndarray
    limit: np.ndarray

    @classmethod
    def of(cls, chunks_: list[tuple[int, int, int]], tile_bytes: int = TILE_BYTES) -> "BucketTiles":
        """The tiles of a bucket's chunks: ``(offset, nbytes, itemsize)`` each (offset in bytes
        from the data area's start, a multiple of ``itemsize``). Elements of another size than
        1, 2, 4 or 8 bytes (``complex128``: 16) are patched as the widest of those that divides
        it (a patch moves exact bytes whatever it calls an element).

        Raises:
            ValueError: an itemsize that is not a positive int.
        """
        offs, sizes, items = [np.zeros(0, np.uint64)], [np.zeros(0, np.uint64)], [np.zeros(0, np.uint32)]
        for off, size, item in chunks_:
            if isinstance(item, bool) or not isinstance(item, int) or item <= 0:
                raise ValueError(f"itemsize must be an int > 0 (bytes), got {item!r}")
            item = next(w for w in (8, 4, 2, 1) if item % w == 0)
            step = min(tile_bytes, 65536 * item) // item * item
            starts = np.arange(0, size, step, dtype=np.uint64)
            offs.append(starts + np.uint64(off))
            sizes.append(np.minimum(np.uint64(step), np.uint64(size) - starts))
            items.append(np.full(len(starts), item, np.uint32))
        nb = np.concatenate(sizes).astype(np.uint64)
        it = np.concatenate(items).astype(np.uint32)
        limit = np.floor(SPARSE_MAX * nb.astype(np.float64) / (2 + it.astype(np.float64))).astype(np.uint32)
        return cls(np.concatenate(offs).astype(np.uint64), nb, it, limit)

    @property
    def n(self) -> int:
        return len(self.off)

    def head_bytes(self) -> int:
        """Bytes of a delta bucket's head, counts and digests."""
        return _DHEAD.size + _pad8(4 * self.n) + 8 * self.n


def _runs(tiles: BucketTiles, sel: np.ndarray) -> list[tuple[int, int, int]]:
    """``(data offset, payload offset, bytes)`` of the tiles ``sel`` (bool by tile) laid end to
    end in tile order, adjacent tiles merged: what one copy each moves."""
    idx = np.flatnonzero(sel)
    if not len(idx):
        return []
    off, nb = tiles.off[idx].astype(np.int64), tiles.nbytes[idx].astype(np.int64)
    at = np.concatenate(([0], np.cumsum(nb)[:-1]))
    cut = np.flatnonzero(off[1:] != off[:-1] + nb[:-1]) + 1
    starts, ends = np.concatenate(([0], cut)), np.concatenate((cut, [len(idx)]))
    return [(int(off[s]), int(at[s]), int(at[e - 1] + nb[e - 1] - at[s])) for s, e in zip(starts, ends)]


def encode(tiles: BucketTiles, new: np.ndarray, old: np.ndarray, prev: np.ndarray | None,
           out: np.ndarray) -> tuple[int | None, np.ndarray]:
    """Write the delta bucket that turns ``old`` into ``new`` at ``out``.

    Args:
        tiles: the bucket's tiles (of its metadata).
        new / old: uint8, the bucket's data area now / in the last sync (same length).
        prev: uint64 digests of ``old``'s tiles (from the last ``encode``), or None: tiles whose
            digest is unchanged are then not compared element by element.
        out: uint8, where the delta goes (the slot's data area).

    Returns:
        ``(wire, digests)``: the delta's bytes at ``out``, or None when it would be more than
        ``DELTA_MAX`` of the data bytes (send the bucket in full; ``out`` holds nothing of
        use); and the digests of ``new``'s tiles either way. Blocking (native, GIL released).
    """
    n, used = tiles.n, len(new)
    counts = np.empty(n, np.uint32)
    digests = np.empty(n, np.uint64)
    head = tiles.head_bytes()
    cap = int(DELTA_MAX * used) - head
    base = new.ctypes.data
    if cap <= 0 or len(out) < head:
        # a bucket too small to gain: its digests only
        native.digest_tiles((tiles.off + np.uint64(base)).ctypes.data, tiles.nbytes.ctypes.data, n, digests.ctypes.data)
        return None, digests
    na = tiles.off + np.uint64(base)
    oa = tiles.off + np.uint64(old.ctypes.data)
    pv = prev.ctypes.data if prev is not None and len(prev) == n else 0
    patch = native.record_tiles(na.ctypes.data, oa.ctypes.data, tiles.nbytes.ctypes.data, tiles.itemsize.ctypes.data,
                                tiles.limit.ctypes.data, pv, n, digests.ctypes.data, counts.ctypes.data,
                                out.ctypes.data + head, min(cap, len(out) - head))
    dense = counts == DENSE
    whole = int(tiles.nbytes[dense].sum())
    wire = head + patch + whole
    if wire > head + cap or wire > len(out):
        return None, digests
    at = head + patch
    for off, rel, size in _runs(tiles, dense):
        out[at + rel:at + rel + size] = new[off:off + size]
    out[:_DHEAD.size] = np.frombuffer(_DHEAD.pack(n, patch, whole), np.uint8)
    c0 = _DHEAD.size
    out[c0:c0 + 4 * n] = counts.view(np.uint8)
    d0 = c0 + _pad8(4 * n)
    out[d0:d0 + 8 * n] = digests.view(np.uint8)
    return wire, digests


@dataclasses.dataclass
class Delta:
    """A delta bucket's parts (views of its data area), parsed by :func:`parse`."""

    counts: np.ndarray
    digests: np.ndarray
    patches: np.ndarray
    whole: np.ndarray


def parse(tiles: BucketTiles, wire: np.ndarray) -> Delta:
    """The parts of the delta bucket ``wire`` (uint8, its ``wire`` bytes) for ``tiles``.

    Raises:
        ValueError: it is not a delta of a bucket of these tiles (sizes that do not fit).
    """
    if len(wire) < _DHEAD.size:
        raise ValueError(f"a delta of {len(wire)} bytes has no head")
    n, patch, whole = _DHEAD.unpack(wire[:_DHEAD.size].tobytes())
    if n != tiles.n:
        raise ValueError(f"a delta of {n} tiles for a bucket of {tiles.n}")
    head = tiles.head_bytes()
    if head + patch + whole != len(wire):
        raise ValueError(f"a delta of {len(wire)} bytes claims {head} + {patch} + {whole}")
    c0 = _DHEAD.size
    counts = wire[c0:c0 + 4 * n].view(np.uint32)
    digests = wire[c0 + _pad8(4 * n):head].view(np.uint64)
    dense = counts == DENSE
    if int(patch_sizes(counts, tiles.itemsize).sum()) != patch or int(tiles.nbytes[dense].sum()) != whole:
        raise ValueError("a delta whose patches or whole tiles do not add up to its sizes")
    if np.any(counts[~dense] > tiles.limit[~dense]):
        raise ValueError("a delta whose patch holds more elements than its tile allows")
    return Delta(counts, digests, wire[head:head + patch], wire[head + patch:])


def apply(core: Any, tiles: BucketTiles, delta: Delta, dst: np.ndarray) -> int:
    """Patch ``dst`` (uint8, this rollout's copy of the bucket's data area, the last sync's
    bytes) with ``delta`` and check every tile against the writer's digests, on the runtime's
    CPU threads (``core.cpu_map``). Returns the tiles that do not match (0: ``dst`` holds the
    writer's bytes). Blocking."""
    for off, rel, size in _runs(tiles, delta.counts == DENSE):
        dst[off:off + size] = delta.whole[rel:rel + size]
    sizes = patch_sizes(delta.counts, tiles.itemsize)
    ptr = np.empty(tiles.n, np.uint64)
    if tiles.n:
        ptr[0] = 0
        np.cumsum(sizes[:-1], out=ptr[1:])
    ptr += np.uint64(delta.patches.ctypes.data)
    return check(core, tiles, dst, delta.digests, delta.counts, ptr)


def check(core: Any, tiles: BucketTiles, dst: np.ndarray, digests: np.ndarray, counts: np.ndarray | None = None,
          ptr: np.ndarray | None = None) -> int:
    """``native.check_tiles`` over ``dst``'s tiles (patched first where ``counts``/``ptr``
    say), split among the CPU threads. Returns the tiles that do not match ``digests``."""
    addr = tiles.off + np.uint64(dst.ctypes.data)
    a, nb, it, dg = addr.ctypes.data, tiles.nbytes.ctypes.data, tiles.itemsize.ctypes.data, digests.ctypes.data
    c = counts.ctypes.data if counts is not None else 0
    p = ptr.ctypes.data if ptr is not None else 0

    def one(r: tuple[int, int]) -> int:
        i, j = r
        return native.check_tiles(a + 8 * i, nb + 8 * i, it + 4 * i, c + 4 * i if c else 0, p + 8 * i if p else 0,
                                  dg + 8 * i, j - i)

    return sum(core.cpu_map(one, chunks(tiles.nbytes)))


class BucketStore:
    """The bytes of every bucket of one sync, kept for the next sync's deltas.

    Attributes:
        token: the sync whose buckets these are (the trainer's ``prepare`` token of it), None
            while they are being changed (a sync under way, or one that failed).
        metas: each bucket's metadata (its JSON bytes, exactly as sent).
        parts: each bucket's data area (uint8 arrays; on the trainer views of ``flat``).
        digests: each bucket's tile digests (trainer), or None where not known.
        offsets: each bucket's offset in ``flat`` (trainer).
        flat: the trainer's copy of every bucket end to end (published for the sync as its
            store window, the rollouts' fallback), or None.
    """

    def __init__(self) -> None:
        self.token: str | None = None
        self.metas: list[bytes] = []
        self.parts: list[np.ndarray] = []
        self.digests: list[np.ndarray | None] = []
        self.offsets: list[int] = []
        self.flat: np.ndarray | None = None

    def part(self, index: int, meta: bytes) -> np.ndarray | None:
        """Bucket ``index``'s bytes when its metadata was ``meta``, else None."""
        if index < len(self.metas) and self.metas[index] == meta:
            return self.parts[index]
        return None

    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)


class StoreBuilder:
    """The store of a sync under way: bucket by bucket, in place where the layout held."""

    def __init__(self, old: BucketStore | None) -> None:
        self.old = old if old is not None else BucketStore()
        self.old.token = None  # changed from here on: no sync may take it as its base
        self.metas: list[bytes] = []
        self.parts: list[np.ndarray] = []
        self.digests: list[np.ndarray | None] = []

    def add(self, meta: bytes, part: np.ndarray, digests: np.ndarray | None) -> None:
        self.metas.append(meta)
        self.parts.append(part)
        self.digests.append(digests)

    def finish(self, token: str, flat: bool) -> BucketStore:
        """The store of the completed sync ``token``; ``flat``: every bucket end to end in one
        array (the trainer's, to publish), built only when the layout changed (peak: the old
        store and the new one)."""
        st = BucketStore()
        st.metas, st.parts, st.digests = self.metas, self.parts, self.digests
        if flat:
            old = self.old
            same = (old.flat is not None and len(old.parts) == len(st.parts)
                    and all(p is q for p, q in zip(old.parts, st.parts)))
            if same:
                st.flat, st.offsets = old.flat, old.offsets
            else:
                sizes = [int(p.nbytes) for p in st.parts]
                st.offsets = [0, *np.cumsum(sizes)[:-1].tolist()] if sizes else []
                st.flat = np.empty(max(1, sum(sizes)), np.uint8)
                for i, (at, size) in enumerate(zip(st.offsets, sizes)):
                    st.flat[at:at + size] = st.parts[i]
                    st.parts[i] = st.flat[at:at + size]
        st.token = token
        return st
