"""Relays pass deltas on (docs/fanout.md, "Deltas through relays").

A relay that holds version ``b`` of the trainer, complete and checked, builds version ``v`` from
it instead of moving every chunk:

1. it gets the delta records of versions ``b + 1`` to ``v`` (``memsem.sync._delta_format``):
   from its parent relay, which offers the records it got beside its versions (in its
   manifest), else from the trainer's delta history (one get per record). A record is a hint:
   nothing in it is trusted;
2. it copies ``b``'s bytes into ``v``'s data window (a local copy), applies the records' patches
   in version order, and checks every chunk against the trainer's digest of ``v`` (as a chunk
   moved from upstream is checked: the CPU cost of a full version); a chunk that matches is marked ready
   (its children read it at once), a chunk that does not, or that holds a tile a record moved
   whole, is moved from upstream as usual (and checked there).

So every chunk a relay serves is version ``v``'s by the trainer's digest whatever the records
said (fail closed, by chunk: never a mix), and a hop moves about the records' bytes plus the
chunks of tiles changed almost everywhere. The records it got are offered on to its children.
"""
from __future__ import annotations

import numpy as np

from memsem import native
from memsem._buffers import array_address
from memsem._errors import MemsemError
from memsem.core import RuntimeCore
from memsem.gva import RefSpec
from memsem.sync._delta import DELTA_MAX, _Plan
from memsem.sync._delta_format import DELTA_DENSE, KIND_RECORD, Record, Tiles, patch_sizes
from memsem.sync._fanout_source import Digests, digest_of
from memsem.sync._state_dict import StateDictRef

#: records a relay keeps offering to its children (the newest ones)
KEEP_RECORDS = 8


def tiles_of(sd: StateDictRef) -> tuple[Tiles, np.ndarray]:
    """The delta tiles of ``sd``'s layout and each tile's byte offset in the window (uint64)."""
    lay = sd.layout
    t = Tiles.of(lay.entries, lay.delta.tile_bytes)
    offs = np.array([lay.header_bytes + e.offset for e in lay.entries], np.uint64)
    win = (offs[t.entry] + t.start).astype(np.uint64) if t.n else np.zeros(0, np.uint64)
    return t, win


def fetch_record(core: RuntimeCore, spec: RefSpec, version: int, tiles: Tiles) -> Record:
    """Version ``version``'s record from the window ``spec`` (one get), checked for shape.

    Raises:
        ValueError: not that version's record of these tiles. As ``get``.
    """
    if not 0 < spec.nbytes <= 2 * tiles.n * 16 + int(tiles.nbytes.sum()) * 2 + (1 << 20):
        raise ValueError(f"delta record of version {version}: a window of {spec.nbytes} bytes")
    raw = np.empty(spec.nbytes, np.uint8)
    core.transfer(spec, "get", 0, raw)
    return Record.parse(raw, version, tiles)


def trainer_records(sd: StateDictRef, versions: list[int], wait: float) -> dict[int, Record]:
    """The records of ``versions`` (ascending) from the trainer's history (each a delta from
    the one before), waiting up to ``wait`` s for the last one's (not at all while the trainer's
    last record came later than that after its commit); {} unless the history holds
    every one of them and they come to at most ``DELTA_MAX`` of the window's bytes (nothing is
    fetched that could not be used)."""
    if sd.layout.delta is None or not versions:
        return {}
    plan = _Plan(sd, [], [])
    try:
        idx = plan.read_index()
        if idx.entry(versions[-1]) is None:
            if idx.latency_s > wait:  # its last record came later than that: waiting would not pay
                return {}
            idx = plan.index_at(versions[-1], wait, None)
        if idx is None:
            return {}
        entries = [idx.entry(v) for v in versions]
        if any(e is None or e.kind != KIND_RECORD for e in entries):
            return {}
        if sum(e.record_bytes + e.dense for e in entries) > DELTA_MAX * sd.layout.nbytes:
            return {}
        out = {}
        for v, e in zip(versions, entries):
            rec = fetch_record(plan.core, RefSpec.from_bytes(e.ref), v, plan.tiles)
            if rec.base != v - 1:
                return {}
            out[v] = rec
        return out
    except (MemsemError, ValueError):
        return {}


def apply(buf: np.ndarray, sd: StateDictRef, recs: list[Record], dg: Digests) -> tuple[list[int], int]:
    """Patch ``buf`` (the window bytes of the version before ``recs[0]``) with ``recs`` (the
    versions up to ``dg.version``, in order) and check every chunk against ``dg``.

    Returns:
        ``(chunks that hold version dg.version by its digest, bytes checked)``; the other
        chunks must be moved from upstream. The digest checks run on the calling thread.
    """
    tiles, win = tiles_of(sd)
    c, nchunks = dg.chunk_bytes, dg.n_chunks
    dense = np.zeros(tiles.n, bool)
    for r in recs:
        dense |= r.counts == DELTA_DENSE
    need = np.zeros(nchunks, bool)  # chunks moved from upstream
    lo = (win // np.uint64(c)).astype(np.int64)
    hi = ((win + np.maximum(tiles.nbytes, np.uint64(1)) - np.uint64(1)) // np.uint64(c)).astype(np.int64)

    for a, z in zip(lo[dense].tolist(), hi[dense].tolist()):
        need[a:z + 1] = True
    addr = (win + np.uint64(array_address(buf))).astype(np.uint64)
    for r in recs:
        cs = r.counts.copy()
        cs[dense] = 0
        if not cs.any():
            continue
        sizes = patch_sizes(cs, tiles.itemsize)
        src = ((np.cumsum(sizes) - sizes).astype(np.uint64) + np.uint64(r.payload.ctypes.data)).astype(np.uint64)
        if native.patch_tiles(addr.ctypes.data, tiles.nbytes.ctypes.data, tiles.itemsize.ctypes.data,
                              cs.ctypes.data, src.ctypes.data, tiles.n):
            need[:] = True  # an index outside its tile: no chunk is trusted to the records
            return [], 0
    good, checked = [], 0
    for k in range(nchunks):
        if need[k]:
            continue
        part = buf[k * c:min((k + 1) * c, dg.nbytes)]
        checked += part.nbytes
        if digest_of(dg.algo, part, dg.size) == dg.values[k]:
            good.append(k)
    return good, checked


def worth_it(recs: list[Record], nbytes: int) -> bool:
    """Whether records (their bytes and the tiles they move whole) come to at most
    ``DELTA_MAX`` of the window's ``nbytes``."""
    return sum(r.raw.nbytes + r.dense_bytes for r in recs) <= DELTA_MAX * nbytes


__all__ = ["KEEP_RECORDS", "apply", "fetch_record", "tiles_of", "trainer_records", "worth_it"]
