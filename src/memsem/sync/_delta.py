"""Delta versions of state dicts: move only what changed, and still hold exactly version v+1.

The owner keeps a bounded history of what each commit changed (``memsem.sync._delta_writer``;
the format is ``memsem.sync._delta_format``). A reader whose tensors hold version ``base`` as
memsem last left them loads version ``v`` (``StateDictRef.load(into, base=)``; the follower loop
does it by default):

1. it waits (``delta_wait``) for the owner to have recorded ``v`` (the index window's version
   moves in step with the state dict's) and reads the index: every version after ``base`` must
   have a delta record in the history, and their patches and changed tiles must come to at most
   ``DELTA_MAX`` of the tensors' bytes; else it loads in full;
2. it reads those records (one get each), applies their patches in version order, then moves
   the union of their changed tiles from version ``v`` of the window itself (one gather, one
   version, coalesced: adjacent tiles of a tensor are one range);
3. it checks every tile of the tensors loaded against the writer's digest of ``v``: a mismatch
   (the tensors changed since ``base``, a record or a tile not the writer's) is a full load of
   ``v``, so a load returns one version, bit-exact, or raises: never a mix.

``changed_ranges(a, b)`` gives the window byte ranges that changed between two versions (whole
tiles); :func:`record_heads` gives the records themselves, their payloads read only where a
reader of parts of tensors (a reshard plan, ``memsem.sync._sharded_delta``) needs them.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np

from memsem import native
from memsem._errors import MemsemError, MemsemTimeoutError, VersionGoneError
from memsem.core import Lease, RuntimeCore
from memsem.gva import RefSpec
from memsem.sync._state_dict import DeltaInfo, StateDictLayout, StateDictRef, install_delta_versions
from memsem.sync._delta_format import (
    DEFAULT_TILE_BYTES,
    KIND_RECORD,
    Index,
    Record,
    Tiles,
    index_nbytes,
    patch_sizes,
    record_nbytes,
)
from memsem.sync._delta_writer import DENSE, DeltaHistory, chunks

#: a delta is loaded only when its records and changed tiles come to at most this fraction of the
#: bytes of the tensors loaded (its digest check reads every byte once more: beyond it, a full
#: load is as fast)
DELTA_MAX = 0.5
#: ``delta_wait=None``: the most a load waits for a record, and what a full load is taken to
#: cost before one was timed here
WAIT_MAX_S, WAIT_FIRST_S = 2.0, 0.25
#: ``delta_wait=None`` where deltas were slower than full loads: one in this many loads tries a
#: delta again
PROBE_EVERY = 16


def delta_pays(delta_s: float | None, full_s: float | None, skipped: int) -> tuple[bool, int]:
    """The rule every delta reader follows by default: try a delta unless the last delta load
    (``delta_s`` seconds) took at least as long as the last full load (``full_s``); then load in
    full, and try a delta again every ``PROBE_EVERY`` loads. ``skipped``: the loads made in full
    so far for that reason. Returns ``(try a delta, skipped now)``."""
    if delta_s is None or full_s is None or delta_s < full_s:
        return True, skipped
    skipped += 1
    return skipped % PROBE_EVERY == 0, skipped


class _Reader:
    """What a runtime's delta loads keep between calls (``core.part("delta-reader")``): the tiles
    of each layout, the refs of index windows."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiles: dict[tuple[int, int, bytes], Tiles] = {}
        self._index: dict[bytes, RefSpec] = {}
        #: seconds the last delta load of each window took here (its wait excluded), and the
        #: loads made in full since because deltas were slower
        self.delta_s: dict[tuple[int, int, bytes], float] = {}
        self.skipped: dict[tuple[int, int, bytes], int] = {}

    def tiles(self, ref: StateDictRef) -> Tiles:
        key = _key(ref)
        with self._lock:
            t = self._tiles.get(key)
        if t is None:
            lay = ref.layout
            t = Tiles.of(lay.entries, lay.delta.tile_bytes)
            with self._lock:
                if len(self._tiles) > 256:
                    self._tiles.clear()
                self._tiles[key] = t
        return t

    def index(self, info: DeltaInfo) -> RefSpec:
        with self._lock:
            spec = self._index.get(info.index)
        if spec is None:
            spec = RefSpec.from_bytes(info.index)
            with self._lock:
                if len(self._index) > 256:
                    self._index.clear()
                self._index[info.index] = spec
        return spec

    def close(self) -> None:
        with self._lock:
            self._tiles.clear()
            self._index.clear()
            self.delta_s.clear()
            self.skipped.clear()


def _key(ref: StateDictRef) -> tuple[int, int, bytes]:
    return (ref.spec.gva, ref.spec.generation, ref.spec.key)


def _reader(core: RuntimeCore) -> _Reader:
    return core.part("delta-reader", _Reader)


class _Plan:
    """One delta load being made: the tiles of the tensors loaded, where they are in ``into``."""

    def __init__(self, ref: StateDictRef, entries: Any, ranges: list) -> None:
        lay = ref.layout
        self.ref, self.layout, self.key = ref, lay, _key(ref)
        self.core: RuntimeCore = ref.runtime
        self.reader = _reader(self.core)
        self.tiles = t = self.reader.tiles(ref)
        pos = {e.name: i for i, e in enumerate(lay.entries)}
        mask = np.zeros(len(lay.entries), bool)
        bases = np.zeros(len(lay.entries), np.uint64)
        for e, (_off, _n, addr) in zip(entries, ranges):
            i = pos[e.name]
            mask[i] = True
            bases[i] = addr
        self.sel = t.select(mask)
        self.addr = t.addresses(bases)  # every tile's address in into (0 for tensors not loaded)
        offs = np.array([lay.header_bytes + e.offset for e in lay.entries], np.uint64)
        self.win = (offs[t.entry] + t.start).astype(np.uint64) if t.n else np.zeros(0, np.uint64)
        self.loaded = int(sum(r[1] for r in ranges))

    def read_index(self) -> Index:
        """The owner's index, now (one get)."""
        core, info = self.core, self.layout.delta
        raw = np.empty(index_nbytes(info.history), np.uint8)
        core.transfer(self.reader.index(info), "get", 0, raw)
        return Index(raw.tobytes(), self.tiles, self.layout.data_bytes, info.history)

    def index_at(self, target: int, wait: float | None, full_s: float | None) -> Index | None:
        """The index once it says what ``target`` is (waiting ``wait`` s; None: as long as it can
        pay, see ``budget``), else None."""
        idx = self.read_index()
        if idx.entry(target) is not None:
            return idx
        left = self.budget(idx, full_s) if wait is None else wait
        if left <= 0:
            return None
        try:
            self.core.wait_version(self.reader.index(self.layout.delta), target, left)
        except MemsemTimeoutError:
            return None
        idx = self.read_index()
        return idx if idx.entry(target) is not None else None

    def slower(self, full_s: float | None) -> bool:
        """Whether a delta load took longer here last time than a full load (the check reads
        every byte: on one node with few CPUs a copy is as fast): then load in full, but try a
        delta again every ``PROBE_EVERY`` loads (the figures move)."""
        pays, self.reader.skipped[self.key] = delta_pays(self.reader.delta_s.get(self.key), full_s,
                                                          self.reader.skipped.get(self.key, 0))
        return not pays

    def budget(self, idx: Index, full_s: float | None) -> float:
        """Seconds worth waiting for a record: what a full load costs here (its last time;
        ``WAIT_FIRST_S`` before any) less what a delta load costs (its last time; half the
        full one before any), at most ``WAIT_MAX_S``; 0 while the owner's last record came
        later than that after its commit (waiting would not pay)."""
        full = WAIT_FIRST_S if full_s is None else full_s
        delta = self.reader.delta_s.get(self.key, full / 2)
        left = min(WAIT_MAX_S, max(0.0, full - delta))
        return 0.0 if idx.latency_s > left else left

    def records(self, idx: Index, first: int, last: int, limit: int | None) -> list[Record] | None:
        """The records of versions ``first`` to ``last``, each a delta from the one before
        (``first``'s may be digests only when ``first == last``); None when the history lacks
        one, or (``limit``) they would move more bytes than it."""
        entries = []
        for v in range(first, last + 1):
            e = idx.entry(v)
            if e is None or e.kind != KIND_RECORD:
                return None
            entries.append(e)
        if limit is not None and sum(e.record_bytes + e.dense for e in entries) > limit:
            return None
        out = []
        for e in entries:
            raw = np.empty(e.record_bytes, np.uint8)
            self.core.transfer(RefSpec.from_bytes(e.ref), "get", 0, raw)
            rec = Record.parse(raw, e.version, self.tiles)
            out.append(rec)
        return out

    def heads(self, idx: Index, first: int, last: int) -> tuple[list[Record], list[RefSpec]] | None:
        """The records of versions ``first`` to ``last`` read up to their payloads (head,
        digests and counts, checked by ``Record.parse``; the payload bytes left unread), and
        their windows; None when the history lacks one."""
        recs, specs = [], []
        for v in range(first, last + 1):
            e = idx.entry(v)
            if e is None or e.kind != KIND_RECORD:
                return None
            raw = np.empty(e.record_bytes, np.uint8)
            spec = RefSpec.from_bytes(e.ref)
            head = min(e.record_bytes, record_nbytes(self.tiles.n, 0))
            self.core.transfer(spec, "get", 0, raw[:head])
            recs.append(Record.parse(raw, v, self.tiles))
            specs.append(spec)
        return recs, specs

    def changed(self, recs: list[Record]) -> np.ndarray:
        """Per tile, whether any of ``recs`` (deltas) changed it."""
        m = np.zeros(self.tiles.n, bool)
        for r in recs:
            m |= r.counts != 0
        return m

    def ranges(self, tiles: np.ndarray, with_addr: bool = True) -> list:
        """Coalesced ``(window offset, nbytes[, address in into])`` of ``tiles`` (ascending)."""
        if not len(tiles):
            return []
        t = self.tiles
        brk = np.ones(len(tiles), bool)
        brk[1:] = (tiles[1:] != tiles[:-1] + 1) | (t.entry[tiles[1:]] != t.entry[tiles[:-1]])
        starts = np.flatnonzero(brk)
        ends = np.append(starts[1:], len(tiles)) - 1
        a, z = tiles[starts], tiles[ends]
        off = self.win[a]
        n = self.win[z] + t.nbytes[z] - off
        if not with_addr:
            return list(zip(off.tolist(), n.tolist()))
        return list(zip(off.tolist(), n.tolist(), self.addr[a].tolist()))

    def _patches(self, rec: Record, skip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the tiles loaded: ``rec``'s counts (0 for tiles in ``skip``: moved whole) and the
        addresses of their patches."""
        t, sel = self.tiles, self.sel
        c = rec.counts
        sizes = patch_sizes(c, t.itemsize)
        offs = (np.cumsum(sizes) - sizes).astype(np.uint64)
        cs = c[sel].copy()
        cs[skip[sel]] = 0
        return cs, (offs[sel] + np.uint64(rec.payload.ctypes.data)).astype(np.uint64)

    def _split(self, fn: Any, *arrays: np.ndarray) -> int:
        """``fn(i, j)`` over chunks of the tiles loaded, on the CPU threads; the sum of results."""
        return sum(self.core.cpu_map(lambda r: fn(*r), chunks(self.tiles.nbytes[self.sel])))

    def patch(self, rec: Record, skip: np.ndarray) -> bool:
        """Apply ``rec``'s patches to the tiles loaded (not those in ``skip``); False: an index
        fell outside its tile."""
        cs, src = self._patches(rec, skip)
        dst, nb, it = self.addr[self.sel], self.tiles.nbytes[self.sel], self.tiles.itemsize[self.sel]
        return not self._split(lambda i, j: native.patch_tiles(
            dst.ctypes.data + 8 * i, nb.ctypes.data + 8 * i, it.ctypes.data + 4 * i, cs.ctypes.data + 4 * i,
            src.ctypes.data + 8 * i, j - i))

    def check(self, digests: np.ndarray, rec: Record | None, skip: np.ndarray) -> bool:
        """Apply ``rec``'s patches (None: none), and check every tile loaded against
        ``digests`` (the writer's, by tile) in the same pass; True when all match."""
        if not len(self.sel):
            return True
        dst, nb, it = self.addr[self.sel], self.tiles.nbytes[self.sel], self.tiles.itemsize[self.sel]
        want = digests[self.sel].copy()
        if rec is not None:
            cs, src = self._patches(rec, skip)
            cp, sp = cs.ctypes.data, src.ctypes.data
        else:
            cs = src = None
            cp = sp = 0
        return not self._split(lambda i, j: native.check_tiles(
            dst.ctypes.data + 8 * i, nb.ctypes.data + 8 * i, it.ctypes.data + 4 * i, cp + 4 * i if cp else 0,
            sp + 8 * i if sp else 0, want.ctypes.data + 8 * i, j - i))


# -- the DeltaVersions the refs layer calls -----------------------------------------------------------
class DeltaVersions:
    """Delta versions for ``memsem.sync._state_dict`` (installed by ``memsem.sync``)."""

    def begin(self, core: RuntimeCore, layout: StateDictLayout, sources: list[int],
              history: int) -> tuple[DeltaInfo, DeltaHistory]:
        h = DeltaHistory(core, layout, sources, history, DEFAULT_TILE_BYTES)
        return DeltaInfo(h.index.to_bytes(), DEFAULT_TILE_BYTES, history), h

    def attach(self, token: DeltaHistory, ref: StateDictRef) -> None:
        token.attach(ref)

    def abandon(self, token: DeltaHistory) -> None:
        token.abandon()

    def load(self, ref: StateDictRef, entries: Any, ranges: list, keep: list, *, base: int, version: int,
             lease: Lease | None, wait: float | None, full_s: float | None) -> int:
        """``StateDictRef.load(into, base=)``: see the module docstring."""
        plan = _Plan(ref, entries, ranges)
        core = plan.core
        tel = core.telemetry

        def full() -> int:
            return ref.load_full(ranges, keep, version=version, lease=lease)

        pinned = version or (lease.version if lease is not None else 0)
        target = pinned or core.latest_version(ref.spec)
        # the latest read here may lag the owner's (across nodes it is a mirror): then the full
        # load asks the owner for its latest
        if base > target or (base == target and not pinned) or (wait is None and plan.slower(full_s)):
            return full()
        moved = 0
        try:
            idx = plan.index_at(target, wait, full_s)
            if idx is None:
                return full()
            t0 = time.perf_counter()
            moved += index_nbytes(idx.history)
            first = base + 1 if base < target else target
            recs = plan.records(idx, first, target, int(DELTA_MAX * plan.loaded))
            if recs is None or (base < target and any(r.base != r.version - 1 for r in recs)):
                return full()
            moved += sum(r.raw.nbytes for r in recs)
        except (MemsemError, ValueError):
            return full()  # the history is gone or not readable: the full load says why if it fails
        deltas = recs if base < target else []
        whole = _dense_any(deltas, plan.tiles.n)
        rng = plan.ranges(plan.sel[whole[plan.sel]])
        if rng:  # the tiles moved whole first, from version target itself: no patch touches them
            try:
                core.gather(ref.spec, rng, version=target, lease=lease, keep=keep)
            except VersionGoneError:
                if version:
                    raise
                return full()  # the latest moved on under the load: the full load takes the latest
            moved += sum(r[1] for r in rng)
        for r in deltas[:-1]:  # older patches in order; the last one is applied by the check
            if not plan.patch(r, whole):
                tel.count_delta(mismatches=1)
                return full()
        if not plan.check(recs[-1].digests, deltas[-1] if deltas else None, whole):
            tel.count_delta(mismatches=1)
            return full()
        plan.reader.delta_s[plan.key] = time.perf_counter() - t0
        tel.count_delta(loads_delta=1, bytes_moved=moved, bytes_loaded=plan.loaded)
        return target

    def changed_ranges(self, ref: StateDictRef, a: int, b: int, timeout: float | None) -> list[tuple[int, int]] | None:
        """``StateDictRef.changed_ranges``: see there."""
        plan = _Plan(ref, [], [])
        wait = plan.core.timeout if timeout is None else timeout
        try:
            idx = plan.index_at(b, wait, None)
            recs = None if idx is None else plan.records(idx, a + 1, b, None)
        except (MemsemError, ValueError):
            return None
        if recs is None or any(r.base != r.version - 1 for r in recs):
            return None
        return plan.ranges(np.flatnonzero(plan.changed(recs)), with_addr=False)


@dataclasses.dataclass
class Heads:
    """What :func:`record_heads` read: one window's records of the versions after ``a`` up
    to ``b``, in version order, their payloads not yet read.

    Attributes:
        tiles: the window's tiles. win: each tile's byte offset in the window (uint64).
        records: the records (``Record``; ``payload`` holds unread bytes until
        :meth:`read_payload` reads a part of it). specs: each record's window. nbytes: bytes
        read so far (the index and the records' heads, digests and counts).
    """

    core: RuntimeCore
    tiles: Tiles
    win: np.ndarray
    records: list[Record]
    specs: list[RefSpec]
    nbytes: int

    def read_payload(self, i: int, tiles: np.ndarray) -> int:
        """Read the patches of ``tiles`` (ascending tile numbers; patched ones in record ``i``)
        of record ``i`` into its ``payload`` (one gather, adjacent patches one range); returns
        the bytes read."""
        rec = self.records[i]
        sizes = patch_sizes(rec.counts, self.tiles.itemsize)
        offs = np.cumsum(sizes) - sizes
        tiles = tiles[sizes[tiles] > 0]
        if not len(tiles):
            return 0
        lo, hi = offs[tiles], offs[tiles] + sizes[tiles]
        brk = np.ones(len(tiles), bool)
        brk[1:] = lo[1:] != hi[:-1]
        starts = np.flatnonzero(brk)
        ends = np.append(starts[1:], len(tiles)) - 1
        a, z = lo[starts].astype(np.int64), hi[ends].astype(np.int64)
        p0 = rec.payload.ctypes.data - rec.raw.ctypes.data
        base = rec.raw.ctypes.data + p0
        self.core.gather(self.specs[i], list(zip((a + p0).tolist(), (z - a).tolist(), (a + base).tolist())),
                         keep=rec.raw)
        n = int((z - a).sum())
        self.nbytes += n
        return n


def record_heads(ref: StateDictRef, a: int, b: int, timeout: float) -> Heads | None:
    """The records of versions ``a + 1`` to ``b`` (``a < b``) of ``ref``'s delta history, each
    read up to its payload, for a reader of parts of tensors that reads only the patches it
    needs (``memsem.sync._sharded_delta``). Waits up to ``timeout`` s for ``b``'s record.

    Returns None when the history does not hold each of them as a delta from the version
    before (gone, never recorded, recorded as digests only, not readable, or not that
    version's: ``Record.parse``): the reader loads in full.
    """
    plan = _Plan(ref, [], [])
    try:
        idx = plan.index_at(b, timeout, None)
        got = None if idx is None else plan.heads(idx, a + 1, b)
    except (MemsemError, ValueError):
        return None
    if got is None or any(r.base != r.version - 1 for r in got[0]):
        return None
    recs, specs = got
    n = index_nbytes(idx.history) + sum(min(r.raw.nbytes, record_nbytes(plan.tiles.n, 0)) for r in recs)
    return Heads(plan.core, plan.tiles, plan.win, recs, specs, n)


def _dense_any(recs: list[Record], n: int) -> np.ndarray:
    m = np.zeros(n, bool)
    for r in recs:
        m |= r.counts == DENSE
    return m


def install() -> None:
    install_delta_versions(DeltaVersions())


__all__ = ["DELTA_MAX", "DeltaVersions", "Heads", "install", "record_heads"]
