"""The owner's side of delta versions: a state dict's history, recorded off the writer's path.

A :class:`DeltaHistory` watches the commits of one state-dict window (``CommitWatch``). The
writer's thread only notes each committed version (a deque append and a wake-up: the writer's
whole cost per version); the runtime's one :class:`DeltaKeeper` thread then records it:

1. digest every tile of the version in its slot (``memsem.native.digest_tiles``, on the
   runtime's CPU threads);
2. the tiles whose digest differs from the previous version's changed; with two slots the
   previous version's slot still holds its bytes (until the commit after this one opens), so each
   changed tile is compared element by element: a tile with few changed elements becomes a
   patch (indices and values), one with many is moved whole (``_delta_format.SPARSE_MAX``). With
   one slot (or once the previous slot was overwritten) changed tiles are moved whole;
3. it checks that both slots still hold those versions (a seqlock read: bytes read while a slot
   was being overwritten are dropped, never recorded), publishes the record as a window of its
   own, and commits the index's entry for the version (index version = data version); the
   record that falls out of the history (``history`` versions back) is unpublished.

The writer never waits for this: a writer that commits again before a record is done only
makes that record weaker (its changed tiles moved whole) or absent (``KIND_NONE``: readers of
that version load in full). Version 1's digests are computed at publish, from the tensors given.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any

import numpy as np

from memsem import native
from memsem._errors import MemsemError, StaleReferenceError
from memsem.core import RuntimeCore
from memsem.gva import RefSpec
from memsem.sync._delta_format import (
    INDEX_HEAD,
    KIND_NONE,
    KIND_RECORD,
    PAYLOAD_MAX,
    Entry,
    Record,
    Tiles,
    index_head,
    index_nbytes,
    set_latency,
    write_entry,
)

log = logging.getLogger(__name__)

DENSE = native.DELTA_DENSE
#: bytes of tiles one native call of a CPU thread handles (the unit the work is split in)
CHUNK_BYTES = 8 << 20


def chunks(nbytes: np.ndarray, sel: np.ndarray | None = None) -> list[tuple[int, int]]:
    """``[i, j)`` index ranges of ``sel`` (default: every tile) of about ``CHUNK_BYTES`` each."""
    n = len(nbytes) if sel is None else len(sel)
    if n == 0:
        return []
    sizes = nbytes if sel is None else nbytes[sel]
    cum = np.cumsum(sizes.astype(np.int64))
    cuts = np.searchsorted(cum, np.arange(CHUNK_BYTES, int(cum[-1]), CHUNK_BYTES), side="right")
    bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < n)), n]
    return list(zip(bounds[:-1], bounds[1:]))


def digest_tiles(core: RuntimeCore, addr: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The digest of every tile (``addr``, ``nbytes``: uint64 by tile) on the CPU threads."""
    out = np.empty(len(addr), np.uint64)
    a, b, o = addr.ctypes.data, nbytes.ctypes.data, out.ctypes.data
    core.cpu_map(lambda r: native.digest_tiles(a + 8 * r[0], b + 8 * r[0], r[1] - r[0], o + 8 * r[0]),
                 chunks(nbytes))
    return out


class DeltaKeeper:
    """One runtime's thread that records its histories' versions (``core.part("delta-keeper")``)."""

    def __init__(self, core: RuntimeCore) -> None:
        self._core = core
        self._cond = threading.Condition()
        self._queue: collections.deque[DeltaHistory] = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="memsem-delta", daemon=True)
        self._thread.start()

    def wake(self, history: "DeltaHistory") -> None:
        with self._cond:
            self._queue.append(history)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                h = self._queue.popleft()
            try:
                h.work()
            except Exception:  # noqa: BLE001 - a bug of one history stops it, not the thread
                log.exception("delta history of %s failed; it records no more versions", h.label)
                h.stop()

    def close(self) -> None:
        """Stop the thread after the version it records now (the runtime's close)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(30.0)


class DeltaHistory:
    """The delta history of one state-dict window (see the module docstring)."""

    def __init__(self, core: RuntimeCore, layout: Any, sources: list[int], history: int, tile_bytes: int) -> None:
        self._core = core
        self.history = history
        self.tiles = Tiles.of(layout.entries, tile_bytes)
        self.data_bytes = layout.data_bytes
        self.label = "a state dict"
        self._lock = threading.Lock()
        self._stopped = False
        self._pending: dict[int, float] = {}  # version -> perf_counter() of its commit
        self._cleaned = False
        self._next = 2  # the next version to record (version 1 is recorded here)
        self._records: dict[int, RefSpec] = {}
        self._slots: Any = None
        self._offs = np.zeros(0, np.uint64)
        self._limits = self.tiles.limits()
        self._scratch: np.ndarray | None = None  # where the patches of a version are made
        #: seconds from each commit until its index entry was committed (the last 64): what a
        #: reader waiting for the record waits; the last one is in the index's head
        self.latency_s: list[float] = []
        t = self.tiles
        bases = np.array(sources, np.uint64)
        dg = digest_tiles(core, t.addresses(bases), t.nbytes)
        self._prev: tuple[int, np.ndarray] | None = (1, dg)
        rec = Record.new(1, 0, dg, np.full(t.n, DENSE, np.uint32), 0, 0, tile_bytes)
        spec = core.publish_spec(rec.raw, access="r")
        try:
            idx = np.zeros(index_nbytes(history), np.uint8)
            idx[:INDEX_HEAD.size] = np.frombuffer(index_head(history, tile_bytes, t.n, self.data_bytes), np.uint8)
            write_entry(idx, history, Entry(1, KIND_RECORD, rec.raw.nbytes, 0, 0, spec.to_bytes()))
            self.index = core.publish_spec(idx, access="r", slots=2)
        except BaseException:
            core.unpublish_spec(spec)
            raise
        self._records[1] = spec
        self._keeper: DeltaKeeper = core.part("delta-keeper", lambda: DeltaKeeper(core))

    # -- lifetime --------------------------------------------------------------------------------
    def attach(self, ref: Any) -> None:
        """Watch the commits of ``ref``'s window (published with the layout carrying this index)."""
        lay = ref.layout
        offs = np.array([lay.header_bytes + e.offset for e in lay.entries], np.uint64)
        self._offs = (offs[self.tiles.entry] + self.tiles.start).astype(np.uint64) if self.tiles.n else self._offs
        self.label = ref.spec.label
        self._slots = self._core.watch_commits(ref.spec, self)

    def abandon(self) -> None:
        """The state dict's publish failed: unpublish this history's windows."""
        self.stop()
        self._cleanup()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    # -- CommitWatch -------------------------------------------------------------------------------
    def committed(self, version: int, slot: int) -> None:
        t0 = time.perf_counter()
        self._pending[version] = t0
        self._keeper.wake(self)
        self._core.telemetry.count_delta(commit_hook_s=time.perf_counter() - t0)

    def retiring(self) -> None:
        with self._lock:  # the keeper's thread reads no slot or control word after this
            self._stopped = True
        self._cleanup()  # the history goes with its window (the retire's caller holds its owner's lock)

    # -- the keeper's thread -------------------------------------------------------------------------
    def work(self) -> None:
        while not self._stopped:
            v = self._next
            at = self._pending.pop(v, None)
            if at is None:
                return
            t0 = time.perf_counter()
            entry = self._record(v)
            if entry is None:  # stopped meanwhile
                break
            if not self._commit(entry, time.perf_counter() - at):
                break
            self._next = v + 1
            now = time.perf_counter()
            self.latency_s = self.latency_s[-63:] + [now - at]
            self._core.telemetry.count_delta(record_s=now - t0, **({"records": 1} if entry.kind == KIND_RECORD
                                                                  else {"records_none": 1}))
        if self._stopped:
            self._cleanup()

    def _holds(self, *versions: int) -> bool | None:
        """Whether the slots hold ``versions`` now; None once stopped."""
        with self._lock:
            if self._stopped:
                return None
            return all(self._slots.holds(v) for v in versions)

    def _record(self, v: int) -> Entry | None:
        core, t = self._core, self.tiles
        with self._lock:
            if self._stopped:
                return None
            if not self._slots.holds(v):
                self._prev = None
                return Entry(v, KIND_NONE, 0, 0, 0, b"")
            new = self._slots.array(v)
            old = self._slots.array(v - 1) if self._slots.n_slots > 1 and self._slots.holds(v - 1) else None
        new_addr = (self._offs + np.uint64(new.ctypes.data)).astype(np.uint64)
        prev = self._prev[1] if self._prev is not None and self._prev[0] == v - 1 else None
        if prev is None and old is None:  # nothing to compare with: digests only
            dg = digest_tiles(core, new_addr, t.nbytes)
            counts = None
            payload = np.zeros(0, np.uint8)
        else:
            old_addr = ((self._offs + np.uint64(old.ctypes.data)).astype(np.uint64) if old is not None
                        else np.zeros(t.n, np.uint64))
            dg, counts, payload = self._scan(new_addr, old_addr, prev)
        held = self._holds(v, *((v - 1,) if old is not None else ()))
        if held is None:
            return None
        if not held:
            if not self._holds(v):
                self._prev = None
                return Entry(v, KIND_NONE, 0, 0, 0, b"")
            # the previous version's slot was overwritten under the comparison: no patches
            if prev is None:
                counts = None
            else:
                counts[counts != 0] = DENSE
            payload = payload[:0]
        if counts is None:
            rec = Record.new(v, 0, dg, np.full(t.n, DENSE, np.uint32), 0, 0, t.tile_bytes)
        else:
            dense = int(t.nbytes[counts == DENSE].sum())
            rec = Record.new(v, v - 1, dg, counts, payload.nbytes, dense, t.tile_bytes)
            rec.payload[:] = payload
        self._prev = (v, dg)
        spec = core.publish_spec(rec.raw, access="r")
        with self._lock:
            gone = self._cleaned
            if not gone:
                self._records[v] = spec
        if gone:  # the window retired meanwhile: the record goes too
            with contextlib.suppress(MemsemError):
                core.unpublish_spec(spec, timeout=core.timeout)
            return None
        return Entry(v, KIND_RECORD, rec.raw.nbytes, rec.payload.nbytes, rec.dense_bytes, spec.to_bytes())

    def _scan(self, new_addr: np.ndarray, old_addr: np.ndarray,
              prev: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Digests, counts and patches of every tile (``memsem.native.record_tiles``), chunk by
        chunk on the CPU threads; each chunk's patches may take ``PAYLOAD_MAX`` of its bytes."""
        t = self.tiles
        parts = chunks(t.nbytes)
        caps = [int(PAYLOAD_MAX * int(t.nbytes[i:j].sum())) for i, j in parts]
        total = sum(caps)
        if self._scratch is None or self._scratch.nbytes < total:
            self._scratch = np.empty(total, np.uint8)
        starts = np.cumsum([0, *caps[:-1]]).tolist()
        base = self._scratch.ctypes.data
        dg = np.empty(t.n, np.uint64)
        counts = np.empty(t.n, np.uint32)
        na, oa, nb, it, lim = new_addr, old_addr, t.nbytes, t.itemsize, self._limits
        pv = prev.ctypes.data if prev is not None else 0

        def one(k: int) -> int:
            i, j = parts[k]
            return native.record_tiles(na.ctypes.data + 8 * i, oa.ctypes.data + 8 * i, nb.ctypes.data + 8 * i,
                                       it.ctypes.data + 4 * i, lim.ctypes.data + 4 * i, pv + 8 * i if pv else 0, j - i,
                                       dg.ctypes.data + 8 * i, counts.ctypes.data + 4 * i, base + starts[k], caps[k])

        used = self._core.cpu_map(one, range(len(parts)))
        payload = np.concatenate([self._scratch[s:s + u] for s, u in zip(starts, used)]) if parts else \
            np.zeros(0, np.uint8)
        return dg, counts, payload

    def _commit(self, entry: Entry, latency_s: float) -> bool:
        """Commit ``entry`` as the index's version ``entry.version`` (with ``latency_s``, the
        seconds since that version's commit, in the head); unpublish the record that falls out
        of the history. False (and the history stops) when the index is not in step."""
        core = self._core
        if self._cleaned:  # the window retired: the index is gone or going
            return False
        # A retire of the index (the state dict's unpublish or republish, in another thread) waits
        # for this section to close before it releases the index's memory (the core's rule).
        try:
            with core.write_section(self.index, copy=True, counted=False) as sec:
                arr = sec.array().reshape(-1).view(np.uint8)
                write_entry(arr, self.history, entry)
                set_latency(arr, latency_s)
        except MemsemError:
            if not self._stopped:
                log.warning("delta history of %s: the index could not be written; it stops", self.label,
                            exc_info=True)
            self.stop()
            return False
        if sec.version != entry.version:
            log.error("delta history of %s: index version %d for version %d: it stops", self.label, sec.version,
                      entry.version)
            self.stop()
            return False
        old = self._records.pop(entry.version - self.history, None)
        if old is not None:
            with contextlib.suppress(MemsemError):
                core.unpublish_spec(old, timeout=core.timeout)
        return True

    def _cleanup(self) -> None:
        """Unpublish the index and the records, before the caller's retire returns (once; a
        closing runtime retires them itself). The index's retire waits for the keeper's write
        section on it, if one is open (``_commit``), to close: never unmapped under it."""
        with self._lock:
            if self._cleaned:
                return
            self._cleaned = True
            specs, self._records = [*self._records.values(), self.index], {}
        if self._core.closed:
            return  # a closing runtime retires them itself
        for spec in specs:
            try:
                self._core.unpublish_spec(spec, timeout=self._core.timeout)
            except StaleReferenceError:  # gone already (WindowNotFoundError included)
                pass
            except MemsemError as exc:  # the window's retire goes on; this one is left to its close
                log.warning("delta history of %s: unpublishing %#x failed: %s", self.label, spec.gva, exc)


__all__ = ["CHUNK_BYTES", "DeltaHistory", "DeltaKeeper", "chunks", "digest_tiles"]
