"""Delta loads of a sharded reader (``ShardedReader``, docs/weight-sync.md): a reader whose
tensors hold version ``b`` of its slices, as its last load left them, moves only the parts of its
ranges that changed up to ``v``.

1. Each rank's delta history says which byte ranges of its window changed from ``b`` to ``v``
   (``StateDictRef.changed_ranges``: whole tiles, from the writer's digests); the reader's own
   ranges (its reshard plan's) are intersected with them (:func:`intersect`) and only those
   bytes are read, at version ``v`` (pinned as a full load is).
2. Fail closed: after every load the reader keeps a 64-bit digest of every 64 KiB of what it
   holds (:class:`Held`); before a delta it checks its tensors still hold those bytes (one read
   of them, on the CPU threads). Tensors changed since (by the user), other tensors, a history
   that does not cover ``b`` to ``v`` on every rank: the load is a full load.

Every byte outside the changed ranges is the same at ``b`` and ``v`` by the writer's digests, and
every byte inside them was read at ``v``: the result is ``v``, bit-exact, never a mix.
"""
from __future__ import annotations

import numpy as np

from memsem.core import RuntimeCore
from memsem.sync._delta_writer import digest_tiles

#: bytes per tile of the reader's own digests
HELD_TILE_BYTES = 64 << 10


def intersect(runs: list[tuple[int, int, int]], changed: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The parts of ``runs`` (``(source offset, nbytes, address)``) inside ``changed``
    (``(offset, nbytes)``, ascending, not overlapping), as runs."""
    if not runs or not changed:
        return []
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    c = np.asarray(changed, dtype=np.int64).reshape(-1, 2)
    cs, ce = c[:, 0], c[:, 0] + c[:, 1]
    s, e = r[:, 0], r[:, 0] + r[:, 1]
    i0 = np.searchsorted(ce, s, "right")
    i1 = np.searchsorted(cs, e, "left")
    cnt = np.maximum(i1 - i0, 0)
    total = int(cnt.sum())
    if not total:
        return []
    ri = np.repeat(np.arange(len(r)), cnt)
    ci = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(i0, cnt)
    lo = np.maximum(s[ri], cs[ci])
    hi = np.minimum(e[ri], ce[ci])
    keep = hi > lo
    lo, hi, ri = lo[keep], hi[keep], ri[keep]
    return list(zip(lo.tolist(), (hi - lo).tolist(), (r[ri, 2] + lo - s[ri]).tolist()))


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

    def moved(self, version: int, ranges: list[tuple[int, int, int]]) -> None:
        """``ranges`` (``(offset, nbytes, address)``) were written with version ``version``'s
        bytes (the rest held it already): digest again the tiles they touched."""
        self.version = version
        if not ranges or not len(self._addr):
            return
        r = np.asarray(ranges, dtype=np.uint64).reshape(-1, 3)
        first = np.searchsorted(self._addr, r[:, 2], "right") - 1
        last = np.searchsorted(self._addr, r[:, 2] + r[:, 1] - np.uint64(1), "right") - 1
        mark = np.zeros(len(self._addr) + 1, np.int64)
        np.add.at(mark, np.maximum(first, 0), 1)
        np.add.at(mark, last + 1, -1)
        sel = np.flatnonzero(np.cumsum(mark[:-1]) > 0)
        self._digests[sel] = self._digest(sel)


__all__ = ["HELD_TILE_BYTES", "Held", "intersect"]
