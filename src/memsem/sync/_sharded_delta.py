"""Delta loads of a sharded reader (``ShardedReader``, docs/weight-sync.md): a reader whose
tensors hold version ``b`` of its slices, as its last load left them, moves only what changed
in them up to ``v``.

1. **The records.** For every rank it reads, the reader reads the rank's delta records of
   versions ``b + 1`` to ``v`` (``memsem.sync._delta.record_heads``: the index, then each
   record's head, digests and counts). Each changed tile of the rank's window was recorded
   either as a patch (element indices and values) or whole (read from version ``v``'s window).
2. **Per tile, the cheaper move.** A changed tile the reader holds some bytes of (its plan's
   runs, ``(source offset, nbytes, target address)``) is patched when its patches in those
   records come to fewer bytes than the reader holds of it, else its bytes in the runs are
   read whole at ``v`` (as are tiles recorded whole in any of the records). A rank where the
   delta would move as many bytes as its runs is read in full (at ``v``, like the others).
3. **Patches through the plan.** The patches of the tiles to patch are read (one gather per
   record, adjacent patches one range), decoded (numpy, vectorised), and each element whose
   source bytes lie inside a run is written at the run's target address plus its offset in the
   run (``searchsorted`` over the elements' window offsets, per run: runs may overlap in their
   source); the records are applied in version order, so the last write of an element is its
   value at ``v``. An element cut by a run's edge, an index outside its tile: a full load.
4. **Targets converted on read** (fp8, ``Target(dtype=...)``) take no patches: their runs read
   the changed tiles' bytes whole at ``v`` into their staging buffer (the path before patches),
   and the target is converted again from it.

**Fail closed, never a mix.** After every load the reader keeps a 64-bit digest of every
64 KiB of what it holds (:class:`Held`); before a delta it checks its tensors still hold those
bytes (one read of them, on the CPU threads): tensors changed since (by the user), other
tensors, a history that does not cover ``b`` to ``v`` on every rank, a record that is not
readable or not that version's: the load is a full load. The records are the writer's
records of exactly those versions because (the argument of ``memsem.sync._delta``):

* the index is the owner's own window, read as one committed version, written only by the
  owner's history keeper; its entry for ``v`` names ``v`` and the record's window by its ref,
  generation included, so a record unpublished since (fallen out of the history) or a window
  reused for another fails the read instead of returning other bytes;
* each record's head names its version ``v``, its base ``v - 1`` (a record of digests only,
  base 0, is no delta: full load), this layout's tiles and tile bytes, and its counts add up to
  its payload (``Record.parse``); every patch index is checked to lie inside its tile;
* the owner publishes a record only after checking, by the slots' seqlock, that the slots
  held ``v - 1`` and ``v`` while it compared them, so record ``v`` turns ``v - 1``'s bytes
  into ``v``'s, and unchanged tiles have the same digest at both;
* the version-``v`` bytes read whole are read pinned at ``v``, like a full load's;
* where the reader holds a whole changed tile as one contiguous run, it checks the tile after
  the patches against the record's digest of ``v`` (``_delta``'s check); a mismatch is a full
  load. A tile held only in part (a column slice) cannot be digested by the reader: there it
  relies on the points above.

So every byte the reader holds is ``b``'s where no record changed it (equal at ``v``), or was
written from version ``v``'s window, or by the last patch of it up to ``v``: the result is
``v``, bit-exact.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from memsem.core import RuntimeCore
from memsem.native import DELTA_DENSE
from memsem.sync._delta import Heads
from memsem.sync._delta_format import patch_sizes
from memsem.sync._delta_writer import digest_tiles

#: bytes per tile of the reader's own digests
HELD_TILE_BYTES = 64 << 10
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _pieces(s: np.ndarray, e: np.ndarray, cs: np.ndarray, ce: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every non-empty overlap of an interval ``[s, e)`` (any order, may overlap) with one of
    ``[cs, ce)`` (ascending, not overlapping): ``(i, j, lo, hi)``, int64 arrays."""
    i0 = np.searchsorted(ce, s, "right")
    i1 = np.searchsorted(cs, e, "left")
    cnt = np.maximum(i1 - i0, 0)
    total = int(cnt.sum())
    if not total:
        z = np.zeros(0, np.int64)
        return z, z, z, z
    i = np.repeat(np.arange(len(s)), cnt)
    j = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(i0, cnt)
    lo = np.maximum(s[i], cs[j])
    hi = np.minimum(e[i], ce[j])
    keep = hi > lo
    return i[keep], j[keep], lo[keep], hi[keep]


def intersect(runs: list[tuple[int, int, int]], changed: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The parts of ``runs`` (``(source offset, nbytes, address)``) inside ``changed``
    (``(offset, nbytes)``, ascending, not overlapping), as runs."""
    if not runs or not changed:
        return []
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    c = np.asarray(changed, dtype=np.int64).reshape(-1, 2)
    i, _j, lo, hi = _pieces(r[:, 0], r[:, 0] + r[:, 1], c[:, 0], c[:, 0] + c[:, 1])
    return list(zip(lo.tolist(), (hi - lo).tolist(), (r[i, 2] + lo - r[i, 0]).tolist()))


def _merged(src: np.ndarray, n: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """``(src, n, dst)`` runs sorted by source, merged where source and destination continue."""
    if not len(src):
        return []
    order = np.lexsort((dst, src))
    src, n, dst = src[order], n[order], dst[order]
    cont = (src[:-1] + n[:-1] == src[1:]) & (dst[:-1] + n[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return list(zip(src[starts].tolist(), np.add.reduceat(n, starts).tolist(), dst[starts].tolist()))


@dataclasses.dataclass
class _Patch:
    """Elements of ``itemsize`` bytes one record writes into one target of a reader."""

    target: int
    offset: np.ndarray  # bytes into the target, int64
    values: np.ndarray  # uint of itemsize bytes, one per element

    @property
    def itemsize(self) -> int:
        return self.values.itemsize


@dataclasses.dataclass
class RankDelta:
    """What one rank's records make a reader move (:func:`rank_delta`).

    Attributes:
        reads: ``(source offset, nbytes, address)`` to read at version ``v`` from the rank's
        window. patches: per record (version order), the elements to write. check:
        ``(address, nbytes, digest)`` arrays of whole tiles to check after the patches.
    """

    reads: list[tuple[int, int, int]]
    patches: list[list[_Patch]]
    check: tuple[np.ndarray, np.ndarray, np.ndarray]

    @classmethod
    def nothing(cls) -> "RankDelta":
        """Nothing to move (the reader holds the version already)."""
        return cls([], [], _no_check())


def _decode(heads: Heads, i: int, tiles: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Record ``i``'s patches of ``tiles`` (of ``k``-byte elements; payload read): each
    element's byte offset in the window (int64, ascending) and its value (uint of ``k``
    bytes); None when an index lies outside its tile or repeats."""
    t, rec = heads.tiles, heads.records[i]
    sizes = patch_sizes(rec.counts, t.itemsize).astype(np.int64)
    po = (np.cumsum(sizes) - sizes)[tiles]  # each patch's start, on an 8-byte bound: typed views
    c = rec.counts[tiles].astype(np.int64)
    ends = np.cumsum(c)
    at = np.arange(int(ends[-1]) if len(c) else 0, dtype=np.int64)
    idx = rec.payload.view(np.uint16)[np.repeat(po // 2 - (ends - c), c) + at].astype(np.int64)
    eo = np.repeat(heads.win[tiles].astype(np.int64), c) + idx * k
    vals = rec.payload.view(_UINT[k])[np.repeat((po + ((2 * c + 7) & ~7)) // k - (ends - c), c) + at]
    lim = t.nbytes[tiles].astype(np.int64) // k
    if len(eo) < 2 or np.all(eo[1:] > eo[:-1]):  # ascending: so is each patch, its last index its largest
        return (eo, vals) if not len(c) or np.all(idx[ends - 1] < lim) else None
    if np.any(np.maximum.reduceat(idx, ends - c) >= lim):
        return None
    order = np.argsort(eo, kind="stable")
    eo, vals = eo[order], vals[order]
    if np.any(eo[1:] == eo[:-1]):
        return None  # an element twice in one record
    return eo, vals


def rank_delta(heads: Heads, runs: np.ndarray, bases: np.ndarray, converted: np.ndarray) -> RankDelta | None:
    """What one rank's records (``heads``: versions ``b + 1`` to ``v``) make a reader move
    (module docstring, steps 2 and 3); reads the patches it needs. None: doubt (a full load).

    Args:
        runs: the plan's runs of the rank (``ReshardPlan.runs[rank]``: source offset, target,
            offset in the target, nbytes; int64). bases: each target's address (int64).
        converted: per target, whether it is converted on read (no patches).
    """
    t, recs = heads.tiles, heads.records
    src, tgt, toff, n = runs[:, 0], runs[:, 1], runs[:, 2], runs[:, 3]
    addr = bases[tgt] + toff
    conv = converted[tgt]
    if not t.n or not len(runs):
        return RankDelta.nothing()
    ts = heads.win.astype(np.int64)
    te = ts + t.nbytes.astype(np.int64)
    order = np.argsort(ts, kind="stable")
    changed = np.zeros(t.n, bool)
    dense = np.zeros(t.n, bool)
    cost = np.zeros(t.n, np.int64)
    for r in recs:
        changed |= r.counts != 0
        dense |= r.counts == DELTA_DENSE
        cost += patch_sizes(r.counts, t.itemsize).astype(np.int64)
    ri, tj, lo, hi = _pieces(src, src + n, ts[order], te[order])
    tile = order[tj]
    plain = ~conv[ri]
    held = np.bincount(tile[plain], weights=(hi - lo)[plain], minlength=t.n).astype(np.int64)
    patch = changed & ~dense & (held > 0) & (cost < held)
    rd = changed[tile] & ~(plain & patch[tile])
    reads = _merged(lo[rd], (hi - lo)[rd], addr[ri[rd]] + lo[rd] - src[ri[rd]])
    if sum(x[1] for x in reads) + int(cost[patch].sum()) >= int(n.sum()):  # as many bytes: read the runs at v
        return RankDelta(list(zip(src.tolist(), n.tolist(), addr.tolist())), [], _no_check())
    # tiles held whole in one run, changed: checked against the writer's digest of v
    whole = plain & changed[tile] & (lo == ts[tile]) & (hi == te[tile])
    check = (addr[ri[whole]] + lo[whole] - src[ri[whole]], hi[whole] - lo[whole], recs[-1].digests[tile[whole]])
    ps = np.flatnonzero(~conv)
    ps = ps[np.lexsort((src[ps], tgt[ps]))]  # by target: the elements come out grouped by target
    patches: list[list[_Patch]] = []
    for i, r in enumerate(recs):
        mine = np.flatnonzero(patch & (r.counts != 0))
        heads.read_payload(i, mine)
        out: list[_Patch] = []
        for k in np.unique(t.itemsize[mine]).tolist():
            got = _decode(heads, i, mine[t.itemsize[mine] == k], k)
            p = None if got is None else _through(*got, src[ps], n[ps], tgt[ps], toff[ps])
            if p is None:
                return None
            out += p
        patches.append(out)
    return RankDelta(reads, patches, check)


def _through(eo: np.ndarray, vals: np.ndarray, rs: np.ndarray, rn: np.ndarray, tgt: np.ndarray,
             toff: np.ndarray) -> list[_Patch] | None:
    """Elements at window offsets ``eo`` (ascending) with values ``vals`` mapped through runs
    (``rs``, ``rn``: source offset and bytes; ``tgt``, ``toff``: target and offset there;
    ordered by target) to their targets; None when a run's edge cuts an element."""
    if not len(eo):
        return []
    k = vals.itemsize
    re = rs + rn
    ee = eo + k
    i0 = np.searchsorted(eo, rs, "left")
    i1 = np.searchsorted(ee, re, "right")
    if np.any(np.searchsorted(ee, rs, "right") != i0) or np.any(np.searchsorted(eo, re, "left") != i1):
        return None  # an element starts before a run and ends inside it, or the other way
    cnt = np.maximum(i1 - i0, 0)
    total = int(cnt.sum())
    if not total:
        return []
    ei = np.repeat(i0 - (np.cumsum(cnt) - cnt), cnt) + np.arange(total)  # run by run, its elements
    off = np.repeat(toff - rs, cnt) + eo[ei]
    vals = vals[ei]
    per = np.bincount(tgt, weights=cnt).astype(np.int64)
    out, at = [], 0
    for target in np.flatnonzero(per).tolist():  # runs ordered by target: one slice each
        z = at + int(per[target])
        out.append(_Patch(target, off[at:z], vals[at:z]))
        at = z
    return out


def _no_check() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z = np.zeros(0, np.int64)
    return z, z, np.zeros(0, np.uint64)


def apply(core: RuntimeCore, deltas: dict[int, RankDelta], views: list[np.ndarray]) -> tuple[bool, np.ndarray]:
    """Write every rank's patches into ``views`` (each target's bytes, flat uint8) in version
    order, then check the whole tiles; returns whether they all match the writer's digests,
    and the addresses the patches wrote (int64)."""
    written = []
    depth = max((len(d.patches) for d in deltas.values()), default=0)
    for i in range(depth):  # record i of every rank: ranks hold disjoint bytes
        for d in deltas.values():
            for p in d.patches[i] if i < len(d.patches) else ():
                written.append(_write(p, views))
    a, nb, want = (np.concatenate(x) for x in zip(*(d.check for d in deltas.values()))) if deltas else _no_check()
    ok = True
    if len(a):
        ok = bool(np.array_equal(digest_tiles(core, a.astype(np.uint64), nb.astype(np.uint64)), want))
    return ok, np.concatenate(written) if written else np.zeros(0, np.int64)


def _write(p: _Patch, views: list[np.ndarray]) -> np.ndarray:
    """Write ``p``'s values into its target's bytes (``views``); the addresses written."""
    v, k, o = views[p.target], p.itemsize, p.offset
    if v.ctypes.data % k == 0 and v.nbytes % k == 0 and not np.any(o % k):
        v.view(_UINT[k])[o // k] = p.values
    else:
        v[(o[:, None] + np.arange(k)).reshape(-1)] = p.values.view(np.uint8).reshape(-1)
    return o + v.ctypes.data


class Held:
    """What a reader's last load left in its memory: the version, where, and a digest of every
    ``HELD_TILE_BYTES`` of it.

    Args:
        core: the reader's runtime core (its CPU threads digest).
        bases / sizes: each target's address and bytes (the memory the plan reads into).
        version: the version loaded there.
    """

    def __init__(self, core: RuntimeCore, bases: list[int], sizes: list[int], version: int) -> None:
        self.key = tuple(bases)
        self.version = version
        self._core = core
        addr, nb = [], []
        for a, n in zip(bases, sizes):
            k = np.arange(0, n, HELD_TILE_BYTES, dtype=np.uint64)
            addr.append(np.uint64(a) + k)
            nb.append(np.minimum(np.uint64(HELD_TILE_BYTES), np.uint64(n) - k))
        a = np.concatenate(addr) if addr else np.zeros(0, np.uint64)
        order = np.argsort(a, kind="stable")
        self._addr = a[order].astype(np.uint64)
        self._nbytes = (np.concatenate(nb) if nb else np.zeros(0, np.uint64))[order].astype(np.uint64)
        self._digests = self._digest()

    def _digest(self, sel: np.ndarray | None = None) -> np.ndarray:
        if sel is None:
            return digest_tiles(self._core, self._addr, self._nbytes)
        return digest_tiles(self._core, np.ascontiguousarray(self._addr[sel]), np.ascontiguousarray(self._nbytes[sel]))

    def intact(self) -> bool:
        """Whether the memory still holds what the last load left (reads all of it)."""
        return bool(np.array_equal(self._digest(), self._digests))

    def moved(self, version: int, ranges: list[tuple[int, int, int]], points: Any = None) -> None:
        """``ranges`` (``(offset, nbytes, address)``) and the elements at ``points`` (addresses,
        int64 array) were written with version ``version``'s bytes (the rest held it already):
        digest again the tiles they touched."""
        self.version = version
        if not len(self._addr):
            return
        mark = np.zeros(len(self._addr) + 1, np.int64)
        if ranges:
            r = np.asarray(ranges, dtype=np.uint64).reshape(-1, 3)
            first = np.searchsorted(self._addr, r[:, 2], "right") - 1
            last = np.searchsorted(self._addr, r[:, 2] + r[:, 1] - np.uint64(1), "right") - 1
            np.add.at(mark, np.maximum(first, 0), 1)
            np.add.at(mark, last + 1, -1)
        touched = np.cumsum(mark[:-1]) > 0
        if points is not None and len(points):
            touched[np.maximum(np.searchsorted(self._addr, points.astype(np.uint64), "right") - 1, 0)] = True
        sel = np.flatnonzero(touched)
        if len(sel):
            self._digests[sel] = self._digest(sel)


__all__ = ["HELD_TILE_BYTES", "Held", "RankDelta", "apply", "intersect", "rank_delta"]
