"""The control block: one small shared segment per window, owned by the window's owner.

Layout, in 64-bit words (all accessed with native acquire/release atomics):

====  ==============================================================================
word  meaning
====  ==============================================================================
0     magic ``MEMSEMCB``
1     layout version
2     owner pid
3     owner start time (clock ticks since boot; pid + start time identify a process)
4     generation (authoritative; bumped at unpublish, republish, resize, reuse)
5     state: 1 LIVE, 2 CLOSING (no new leases), 3 DEAD
6     permissions (bit 0 read, bit 1 write)
7     window size in bytes
8     in-flight transfer count (copies running right now, any process)
9     owner heartbeat (CLOCK_MONOTONIC ns, refreshed by the owner's runtime)
10    number of ready words
11    number of lease slots
12    tile size in bytes of the ready words (0 when not tiled)
13-15 reserved
16..  lease slots, 4 words each: holder pid, holder start time, expiry (monotonic ns),
      lease id (0 = free slot)
then  ready words, one per tile: the generation the tile was marked ready for, 0 = not ready.
      Consumers futex-wait on the low 32 bits of a tile's own word.
====  ==============================================================================
"""
from __future__ import annotations

import enum
import secrets
import threading

from memsem import native
from memsem.native import Segment

MAGIC = int.from_bytes(b"MEMSEMCB", "little")
LAYOUT_VERSION = 1
HEADER_WORDS = 16
LEASE_WORDS = 4
DEFAULT_LEASE_SLOTS = 64

W_MAGIC, W_VERSION, W_OWNER_PID, W_OWNER_START, W_GENERATION, W_STATE, W_PERMS, W_NBYTES, \
    W_INFLIGHT, W_HEARTBEAT, W_NREADY, W_NLEASE, W_TILE_BYTES = range(13)

PERM_READ = 1
PERM_WRITE = 2


class WindowState(enum.IntEnum):
    """State of a window slot in its control block."""

    INIT = 0
    LIVE = 1
    CLOSING = 2
    DEAD = 3


def control_block_bytes(n_ready: int, n_lease: int = DEFAULT_LEASE_SLOTS) -> int:
    return 8 * (HEADER_WORDS + LEASE_WORDS * n_lease + max(n_ready, 0))


def new_generation() -> int:
    """A random first generation (48 bits, non-zero): a window reusing a GVA of a dead process
    never starts at a generation an old ref could hold."""
    return secrets.randbits(48) | 1


class ControlBlock:
    """Typed access to a mapped control block (owner or consumer side).

    Every accessor is one native atomic; the object itself holds no lock and may be shared by
    threads.
    """

    __slots__ = ("segment", "base", "n_ready", "n_lease", "_lease0", "_ready0", "_pins", "_close_pending",
                 "_pin_lock", "__weakref__")

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.base = segment.address
        if segment.nbytes < 8 * HEADER_WORDS or self.word(W_MAGIC) != MAGIC:
            raise ValueError(f"segment {segment.name!r} is not a memsem control block")
        version = self.word(W_VERSION)
        if version != LAYOUT_VERSION:
            raise ValueError(f"control block layout version {version}, this memsem reads {LAYOUT_VERSION}")
        self.n_ready = self.word(W_NREADY)
        self.n_lease = self.word(W_NLEASE)
        self._lease0 = self.base + 8 * HEADER_WORDS
        self._ready0 = self._lease0 + 8 * LEASE_WORDS * self.n_lease
        self._pins = 0
        self._close_pending = False
        self._pin_lock = threading.Lock()

    @classmethod
    def create(cls, *, owner_pid: int, owner_start: int, nbytes: int, perms: int, n_ready: int,
               tile_bytes: int, n_lease: int = DEFAULT_LEASE_SLOTS) -> "ControlBlock":
        seg = Segment.create("cb", control_block_bytes(n_ready, n_lease))
        b = seg.address
        for w, v in ((W_VERSION, LAYOUT_VERSION), (W_OWNER_PID, owner_pid), (W_OWNER_START, owner_start),
                     (W_GENERATION, new_generation()), (W_STATE, WindowState.INIT), (W_PERMS, perms),
                     (W_NBYTES, nbytes), (W_NREADY, n_ready), (W_NLEASE, n_lease),
                     (W_TILE_BYTES, tile_bytes), (W_HEARTBEAT, native.monotonic_ns())):
            native.store_release(b + 8 * w, int(v))
        native.store_release(b + 8 * W_MAGIC, MAGIC)  # last: a reader seeing the magic sees the rest
        return cls(seg)

    @classmethod
    def attach(cls, name: str) -> "ControlBlock":
        return cls(Segment.attach(name))

    # -- words ------------------------------------------------------------------------------------
    def addr(self, word: int) -> int:
        return self.base + 8 * word

    def word(self, word: int) -> int:
        return native.load_acquire(self.base + 8 * word)

    def set_word(self, word: int, value: int) -> None:
        native.store_release(self.base + 8 * word, value)

    @property
    def generation(self) -> int:
        return native.load_acquire(self.base + 8 * W_GENERATION)

    @property
    def generation_addr(self) -> int:
        return self.base + 8 * W_GENERATION

    @property
    def inflight_addr(self) -> int:
        return self.base + 8 * W_INFLIGHT

    @property
    def state(self) -> WindowState:
        return WindowState(self.word(W_STATE))

    def bump_generation(self) -> int:
        """Advance the generation; returns the new one. Old refs and ready marks become stale."""
        return native.fetch_add(self.base + 8 * W_GENERATION, 1) + 1

    # -- leases -----------------------------------------------------------------------------------
    def lease_slot_addr(self, slot: int) -> int:
        if not 0 <= slot < self.n_lease:
            raise IndexError(f"lease slot {slot} out of range [0, {self.n_lease})")
        return self._lease0 + 8 * LEASE_WORDS * slot

    def lease_slots(self) -> list[tuple[int, int, int, int, int]]:
        """Snapshot ``(slot, pid, start, expiry_ns, lease_id)`` of every occupied slot."""
        out = []
        for s in range(self.n_lease):
            a = self._lease0 + 8 * LEASE_WORDS * s
            lid = native.load_acquire(a + 24)
            if lid:
                out.append((s, native.load_acquire(a), native.load_acquire(a + 8),
                            native.load_acquire(a + 16), lid))
        return out

    # -- ready words ------------------------------------------------------------------------------
    def ready_addr(self, tile: int) -> int:
        if not 0 <= tile < self.n_ready:
            raise IndexError(f"tile {tile} out of range [0, {self.n_ready})")
        return self._ready0 + 8 * tile

    # -- lifetime ---------------------------------------------------------------------------------
    def pin(self) -> None:
        """Keep the mapping while a holder (a Lease) may still read it: ``close`` is deferred
        until the last ``unpin``. A lease outliving its window's resolution (republish, runtime
        close) must never read unmapped memory."""
        with self._pin_lock:
            if self.segment._closed:
                raise ValueError(f"control block {self.segment.name!r} is already unmapped")
            self._pins += 1

    def unpin(self) -> None:
        with self._pin_lock:
            self._pins -= 1
            close = self._pins <= 0 and self._close_pending
        if close:
            self.segment.close()

    @property
    def closed(self) -> bool:
        """True once ``close`` was called (the mapping may live on while pinned)."""
        return self._close_pending or self.segment._closed

    def close(self) -> None:
        """Unmap, or mark for unmapping at the last ``unpin``. Safe twice."""
        with self._pin_lock:
            if self._pins > 0:
                self._close_pending = True
                return
            self._close_pending = True
        self.segment.close()
