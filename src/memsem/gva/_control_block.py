"""The control block: one small shared segment per window, owned by the window's owner.

Layout, in 64-bit words (all accessed with native acquire/release atomics):

====  ==============================================================================
word  meaning
====  ==============================================================================
0     magic ``MEMSEMCB``
1     layout version (3)
2     owner pid
3     owner start time (clock ticks since boot; pid + start time identify a process)
4     generation (authoritative; bumped at unpublish, republish, resize, reuse)
5     state: 1 LIVE, 2 CLOSING (no new leases), 3 DEAD
6     permissions (bit 0 read, bit 1 write)
7     bytes of one data slot (the window's size)
8     latest committed version (double-buffered windows; futex word of version waits)
9     owner heartbeat (CLOCK_MONOTONIC ns, refreshed by the owner's runtime)
10    number of ready words
11    number of lease slots
12    tile size in bytes of the ready words (0 when not tiled)
13    number of in-flight slots
14    number of data slots (1, or 2 for double-buffered versions)
15    bytes from one data slot to the next (0 with one slot)
16    slot 0 sequence word: ``version << 1 | writing`` (odd while a write section is open)
17    slot 1 sequence word (double-buffered windows)
18    flags (bit 0: owner writes outside write sections are trapped, debug mode)
19    writer intent: the version a write section is being opened for (0: none). Set before
      the writer waits for leases pinning the version its slot holds; a reader pinning a
      version of that slot backs off while it is set (so pinned readers never starve it)
20    ready sequence: incremented (and futex-woken) after every ready-word write, so one
      watcher of all ready words (the tcp owner pushing transitions) waits on one word
21-23 reserved
24..  lease slots, 6 words each: holder pid, holder start time, expiry (monotonic ns),
      lease id (0 = free slot), version the lease pins (0 = none), reserved
then  in-flight slots, 2 words each: holder identity (``pid | start << 22``, 0 = free) and the
      number of copies the holder has in flight on this window right now
then  ready words, one per tile: the generation the tile was marked ready for, 0 = not ready.
      Consumers futex-wait on the low 32 bits of a tile's own word.
====  ==============================================================================

In-flight accounting belongs to participants, like leases: a process counts its copies in its
own slot, so the owner waiting for copies to drain ignores (and reclaims) the slots of dead
processes. No death at any instant can leave a count the owner waits for forever.
"""
from __future__ import annotations

import enum
import secrets

from memsem import native
from memsem.native import Segment

_load = native.lib.memsem_load_acquire
_cast = native.ffi.cast
_U64P = native.ffi.typeof("uint64_t *")

MAGIC = int.from_bytes(b"MEMSEMCB", "little")
LAYOUT_VERSION = 3
HEADER_WORDS = 24
#: slot layouts, defined once in native/memsem_native.h (the native copy and scans read them):
#: a lease slot's words (pid, start, expiry ns, lease id, pinned version, spare) and an
#: in-flight slot's words (identity, count), as byte offsets from the slot's address
LEASE_WORDS = native.lib.MEMSEM_LEASE_WORDS
INFLIGHT_WORDS = native.lib.MEMSEM_INFLIGHT_WORDS
L_PID = 8 * native.lib.MEMSEM_LEASE_PID
L_START = 8 * native.lib.MEMSEM_LEASE_START
L_EXPIRY = 8 * native.lib.MEMSEM_LEASE_EXPIRY
L_ID = 8 * native.lib.MEMSEM_LEASE_ID
L_VERSION = 8 * native.lib.MEMSEM_LEASE_VERSION
I_IDENT = 8 * native.lib.MEMSEM_INFLIGHT_IDENT
I_COUNT = 8 * native.lib.MEMSEM_INFLIGHT_COUNT
DEFAULT_LEASE_SLOTS = 64
DEFAULT_INFLIGHT_SLOTS = 128
MAX_READY_WORDS = 1 << 24

(W_MAGIC, W_VERSION, W_OWNER_PID, W_OWNER_START, W_GENERATION, W_STATE, W_PERMS, W_NBYTES,
 W_LATEST, W_HEARTBEAT, W_NREADY, W_NLEASE, W_TILE_BYTES, W_NINFLIGHT, W_NSLOTS, W_SLOT_STRIDE,
 W_SEQ0, W_SEQ1, W_FLAGS, W_WRITER, W_READY_SEQ) = range(21)
#: the header words the native pin (``memsem_pin_latest``) reads, as native/memsem_native.h names them
_NATIVE_WORDS = {"MEMSEM_CB_GENERATION": W_GENERATION, "MEMSEM_CB_STATE": W_STATE, "MEMSEM_CB_LATEST": W_LATEST,
                 "MEMSEM_CB_SEQ0": W_SEQ0, "MEMSEM_CB_WRITER": W_WRITER}
if any(getattr(native.lib, k) != w for k, w in _NATIVE_WORDS.items()):
    raise ImportError("native/memsem_native.h's control block words differ from memsem.gva._control_block's "
                      "layout: rebuild memsem's native library")

PERM_READ = 1
PERM_WRITE = 2
FLAG_TRAP_WRITES = 1
#: the version of a window's bytes right after publish (versions count write sections from here)
FIRST_VERSION = 1


class WindowState(enum.IntEnum):
    """State of a window slot in its control block."""

    INIT = 0
    LIVE = 1
    CLOSING = 2
    DEAD = 3


def control_block_bytes(n_ready: int, n_lease: int = DEFAULT_LEASE_SLOTS,
                        n_inflight: int = DEFAULT_INFLIGHT_SLOTS) -> int:
    return 8 * (HEADER_WORDS + LEASE_WORDS * n_lease + INFLIGHT_WORDS * n_inflight + max(n_ready, 0))


def new_generation() -> int:
    """A random first generation (48 bits, non-zero): a window reusing a GVA of a dead process
    never starts at a generation an old ref could hold."""
    return secrets.randbits(48) | 1


def identity_word(pid: int, start: int) -> int:
    """A process as one 64-bit word (pid < 2**22, start time in clock ticks < 2**42)."""
    return (pid & 0x3FFFFF) | (start << 22)


def identity_of(word: int) -> tuple[int, int]:
    """``(pid, start)`` of an identity word."""
    return word & 0x3FFFFF, word >> 22


class ControlBlock:
    """Typed access to a mapped control block (owner or consumer side).

    Every accessor is one native atomic; the object holds no lock and may be shared by threads.
    The mapping's lifetime is its segment's (``pin``/``unpin``/``close``; see
    :class:`memsem.native.Segment`): a holder that reads the block (a lease, a resolution, a
    serving grant) pins it, so it is never unmapped under it.
    """

    __slots__ = ("segment", "base", "n_ready", "n_lease", "n_inflight", "n_slots", "slot_stride", "generation_addr",
                 "seq_addr", "latest_addr", "_words", "_lease0", "_inflight0", "_ready0", "__weakref__")

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.base = b = segment.address
        #: addresses of the generation word, the slot sequence words (``n_slots`` consecutive
        #: words) and the latest-version word
        self.generation_addr = b + 8 * W_GENERATION
        self.seq_addr = b + 8 * W_SEQ0
        self.latest_addr = b + 8 * W_LATEST
        w = self._words = _cast(_U64P, b)  # the header words (native pointer arithmetic)
        if segment.nbytes < 8 * HEADER_WORDS or _load(w + W_MAGIC) != MAGIC:
            raise ValueError(f"segment {segment.name!r} is not a memsem control block")
        version = _load(w + W_VERSION)
        if version != LAYOUT_VERSION:
            raise ValueError(f"control block layout version {version}, this memsem reads {LAYOUT_VERSION}")
        # the layout words never change after publish: read once here
        self.n_ready = _load(w + W_NREADY)
        self.n_lease = _load(w + W_NLEASE)
        self.n_inflight = _load(w + W_NINFLIGHT)
        self.n_slots = _load(w + W_NSLOTS)
        self.slot_stride = _load(w + W_SLOT_STRIDE)
        self._lease0 = b + 8 * HEADER_WORDS
        self._inflight0 = self._lease0 + 8 * LEASE_WORDS * self.n_lease
        self._ready0 = self._inflight0 + 8 * INFLIGHT_WORDS * self.n_inflight
        if (self.n_ready > MAX_READY_WORDS or self.n_lease > 4096 or self.n_inflight > 4096
                or self.n_slots not in (1, 2)
                or self._ready0 + 8 * self.n_ready - b > segment.nbytes):  # control_block_bytes
            raise ValueError(f"segment {segment.name!r} has an inconsistent control block header")

    @classmethod
    def create(cls, *, owner_pid: int, owner_start: int, nbytes: int, perms: int, n_ready: int,
               tile_bytes: int, n_slots: int = 1, slot_stride: int = 0,
               n_lease: int = DEFAULT_LEASE_SLOTS, n_inflight: int = DEFAULT_INFLIGHT_SLOTS) -> "ControlBlock":
        seg = Segment.create("cb", control_block_bytes(n_ready, n_lease, n_inflight))
        b = seg.address
        for w, v in ((W_VERSION, LAYOUT_VERSION), (W_OWNER_PID, owner_pid), (W_OWNER_START, owner_start),
                     (W_GENERATION, new_generation()), (W_STATE, WindowState.INIT), (W_PERMS, perms),
                     (W_NBYTES, nbytes), (W_NREADY, n_ready), (W_NLEASE, n_lease),
                     (W_NINFLIGHT, n_inflight), (W_NSLOTS, n_slots), (W_SLOT_STRIDE, slot_stride),
                     (W_TILE_BYTES, tile_bytes), (W_HEARTBEAT, native.monotonic_ns()),
                     (W_LATEST, FIRST_VERSION), (W_WRITER, 0),
                     # version v lives in slot v % n_slots: with two slots version 1 is in slot 1
                     (W_SEQ0, FIRST_VERSION << 1 if n_slots == 1 else 0),
                     (W_SEQ1, FIRST_VERSION << 1 if n_slots == 2 else 0)):
            native.store_release(b + 8 * w, int(v))
        native.store_release(b + 8 * W_MAGIC, MAGIC)  # last: a reader seeing the magic sees the rest
        return cls(seg)

    @classmethod
    def attach(cls, name: str, folder: str | None = None) -> "ControlBlock":
        """Map the control block in segment ``name`` (``folder``: see ``Segment.attach``).

        Raises:
            As ``Segment.attach``; ValueError: the segment holds no control block of this layout.
        """
        seg = Segment.attach(name, folder=folder)
        try:
            return cls(seg)
        except BaseException:
            seg.close()
            raise

    # -- words ------------------------------------------------------------------------------------
    def addr(self, word: int) -> int:
        return self.base + 8 * word

    def word(self, word: int) -> int:
        return native.load_acquire(self.base + 8 * word)

    def set_word(self, word: int, value: int) -> None:
        native.store_release(self.base + 8 * word, value)

    @property
    def generation(self) -> int:
        return _load(self._words + W_GENERATION)

    @property
    def latest(self) -> int:
        """The latest committed version of the window's bytes."""
        return native.load_acquire(self.base + 8 * W_LATEST)

    def slot_of(self, version: int) -> int:
        """The data slot that holds (or will hold) ``version``."""
        return version % self.n_slots

    def seq(self, slot: int) -> int:
        """Sequence word of data slot ``slot``: ``version << 1 | writing``."""
        return native.load_acquire(self.base + 8 * (W_SEQ0 + slot))

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

    def lease_slots(self) -> list[tuple[int, int, int, int, int, int]]:
        """Snapshot ``(slot, pid, start, expiry_ns, lease_id, version)`` of every slot holding a lease."""
        out = []
        for s in range(self.n_lease):
            a = self._lease0 + 8 * LEASE_WORDS * s
            lid = native.load_acquire(a + L_ID)
            if lid & 1:  # a lease (even: a slot being claimed, see _lease)
                out.append((s, native.load_acquire(a + L_PID), native.load_acquire(a + L_START),
                            native.load_acquire(a + L_EXPIRY), lid, native.load_acquire(a + L_VERSION)))
        return out

    def unexpired_leases(self, now_ns: int) -> list[tuple[int, int, int, int, int]]:
        """``(slot, pid, start, expiry_ns, version)`` of occupied lease slots expiring after
        ``now_ns``: one native scan, after a sequentially consistent fence."""
        n = self.n_lease
        buf = native.ffi.new("uint64_t[]", 5 * max(n, 1))
        k = native.lib.memsem_scan_leases(self._lease0, n, now_ns, buf, n)
        return [tuple(int(buf[5 * i + j]) for j in range(5)) for i in range(k)]  # type: ignore[misc]

    # -- in-flight slots --------------------------------------------------------------------------
    def busy_inflight(self) -> list[tuple[int, int]]:
        """``(identity word, copies)`` of in-flight slots with copies running now: one native
        scan, after a sequentially consistent fence."""
        n = self.n_inflight
        buf = native.ffi.new("uint64_t[]", 2 * max(n, 1))
        k = native.lib.memsem_scan_inflight(self._inflight0, n, buf, n)
        return [(int(buf[2 * i]), int(buf[2 * i + 1])) for i in range(k)]

    def inflight_slot_addr(self, slot: int) -> int:
        """Address of in-flight slot ``slot`` (its identity word; the count is the next word)."""
        if not 0 <= slot < self.n_inflight:
            raise IndexError(f"in-flight slot {slot} out of range [0, {self.n_inflight})")
        return self._inflight0 + 8 * INFLIGHT_WORDS * slot

    # -- ready words ------------------------------------------------------------------------------
    def ready_addr(self, tile: int) -> int:
        if not 0 <= tile < self.n_ready:
            raise IndexError(f"tile {tile} out of range [0, {self.n_ready})")
        return self._ready0 + 8 * tile

    # -- lifetime (the segment's) -----------------------------------------------------------------
    def pin(self) -> None:
        """Count a holder of the mapping (a lease, a resolution, a grant).

        Raises:
            ValueError: the block was closed (no new holders).
        """
        self.segment.pin()

    def unpin(self) -> None:
        self.segment.unpin()

    @property
    def closed(self) -> bool:
        """True once ``close`` was called (the mapping may live on while held)."""
        return self.segment.closed

    def close(self) -> None:
        """Drop the opener's claim; unmapped when the last holder lets go. Safe twice."""
        self.segment.close()
