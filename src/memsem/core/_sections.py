"""Write sections: the owner changes published bytes only inside one (versions within one
generation; docs/weight-sync.md).

* open, for version ``new = latest + 1`` written into slot ``s = new % n_slots``: set the
  writer intent word (``W_WRITER = new``, sequentially consistent), wait for leases pinning a
  version ``p < new`` that lives in slot ``s`` (each sleep is a futex wait on the pinned
  lease's id word, woken by its release, bounded by its expiry: never longer than the lease),
  then make the slot's sequence word odd. With two slots the other slot keeps version
  ``latest`` readable throughout; with one slot readers wait for the close.
* close: release-store the even sequence word, the latest-version word, clear the intent,
  futex-wake both words (version waiters and readers waiting on the sequence).
* a body that raises leaves the slot's sequence odd (its bytes are garbage): with two slots
  readers keep reading ``latest``; with one slot they wait for the next section.
* watchers (``CommitWatch``): bookkeeping done after a commit, off the writer's path (a state
  dict's delta history): told each committed version and its slot on the writer's thread (they
  only take note), and told before the window retires (they stop reading its slots first).
* write guard (debug/testing): ``"protect"`` keeps memsem-allocated, page-aligned slots
  read-only (mprotect) between sections, so an owner store outside a section faults
  (SIGSEGV); ``"checksum"`` records a crc32 of the committed slot and the next section verifies
  it (``OwnerWriteError``).

The owner's windows themselves (``Owned``) and the retire protocol live in ``_publish``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from memsem import _args, native
from memsem._args import VERSION_MAX
from memsem._errors import LeaseHeldError, MemsemError, MemsemTimeoutError, OwnerWriteError, WindowRetiredError
from memsem.gva import ControlBlock, lease_slots as _lease
from memsem.gva._control_block import W_SEQ0, W_WRITER
from memsem.core._wait import Wait

if TYPE_CHECKING:
    from memsem.core._publish import Owned
    from memsem.core._telemetry import Telemetry

log = logging.getLogger(__name__)


def open_sections(owned: Sequence["Owned"], *, copy: bool, timeout: float, telemetry: "Telemetry",
                  counted: bool = True) -> "WriteSection":
    """Open one write section over ``owned`` windows (in GVA order: two sections never wait on
    each other); waits up to ``timeout`` s in all for pinning leases. All or nothing: a failure
    rolls back the windows already opened. ``counted``: its commit counts in the telemetry's
    write sections (False: memsem's own bookkeeping, a delta history's index).

    Raises:
        ValueError: no window. LeaseHeldError, OwnerWriteError, MemsemError: see
        ``Publisher.open_section``.
    """
    owned = sorted(owned, key=lambda o: o.info.gva)
    if not owned:
        raise ValueError("a write section needs at least one window")
    wait = Wait("pinned versions to be let go", timeout, telemetry=telemetry)
    items: list[_Item] = []
    try:
        for o in owned:
            items.append(_open_one(o, wait))
    except BaseException:
        for it in reversed(items):
            it.rollback()
        raise
    for it in items:  # all open: now the bytes may change
        it.prepare(copy)
    return WriteSection(items, telemetry if counted else None)


def _open_one(o: "Owned", wait: Wait) -> "_Item":
    lock = o.section_lock
    if not lock.acquire(blocking=False):
        if o.section_thread >= 0:
            raise MemsemError(f"{o.label}: a write section is already open")
        # a retire holds it (RETIRE_HOLDS): it may yet end with the window live (leases held)
        if not lock.acquire(timeout=wait.left()):
            raise MemsemTimeoutError(f"{o.label}: a retire of the window in progress did not end within "
                                     f"{wait.timeout:g} s: no write section opened",
                                     what=f"the retire of {o.label}", timeout=wait.timeout)
    # The section holds the memory it writes (the control block, the slots' segment, the
    # published object): a forced retire (the runtime closing) never unmaps it under the
    # section. Pinned first, then the window checked: a retire that went on meanwhile is seen.
    try:
        holds = _hold_memory(o)
    except ValueError:
        lock.release()
        raise WindowRetiredError(f"{o.label} was retired: no write section opens on it") from None
    if o.retiring or (o.n_slots > 1 and o.slots_segment is None):
        _release(o, holds)
        raise WindowRetiredError(f"{o.label} was retired: no write section opens on it")
    o.section_thread = threading.get_ident()
    cb = o.cb
    try:
        if o.guard == "checksum":
            latest = cb.latest
            sl = cb.slot_of(latest)
            want = o.sums.get(sl)
            if want is not None and o.checksum(sl) != want:
                o.sums[sl] = o.checksum(sl)  # reported once
                raise OwnerWriteError(
                    f"{o.label}: the bytes of version {latest} changed since its write section "
                    "closed: the owner wrote them outside a write section (readers may have read "
                    "a mixture of versions); change published bytes only inside write_section()")
        new = cb.latest + 1
        if new > VERSION_MAX:
            raise MemsemError(f"{o.label} holds version {new - 1}, the largest a window has: republish it "
                              "(a new generation starts its versions at 1 again)")
        slot = cb.slot_of(new)
        seq_a = cb.addr(W_SEQ0 + slot)
        prev = native.load_acquire(seq_a)
        if prev & 1 and not o.aborted:
            raise MemsemError(f"{o.label}: a write section is already open (sequence word {prev:#x})")
        writer_a = cb.addr(W_WRITER)
        native.store_release(writer_a, new)
        native.lib.memsem_fence_seq_cst()  # Dekker with pinning readers: intent, then scan
        try:
            blocked = _wait_pins(cb, new, wait, o.label)
        except BaseException:
            native.store_release(writer_a, 0)
            native.futex_wake(cb.latest_addr)
            raise
        native.store_release(seq_a, (new << 1) | 1)
        native.lib.memsem_fence_seq_cst()
        return _Item(o, new, slot, prev, blocked, holds)
    except BaseException:
        _release(o, holds)
        raise


def _hold_memory(o: "Owned") -> tuple:
    """Pin the segments a section writes (ValueError: one was closed: the window retired)."""
    segs = [o.cb.segment] + ([o.slots_segment] if o.slots_segment is not None else [])
    pinned: list = []
    try:
        for seg in segs:
            seg.pin()
            pinned.append(seg)
    except ValueError:
        for seg in pinned:
            seg.unpin()
        raise
    return (tuple(pinned), o.keepalive)


def _release(o: "Owned", holds: tuple) -> None:
    """End a section's hold on its window: the section lock, then the memory pins."""
    o.section_thread = 0
    o.section_lock.release()
    for seg in holds[0]:
        seg.unpin()


class _Item:
    """One window of an open write section."""

    __slots__ = ("owned", "version", "slot", "prev_seq", "blocked_s", "copied", "holds")

    def __init__(self, owned: "Owned", version: int, slot: int, prev_seq: int, blocked_s: float,
                 holds: tuple) -> None:
        self.owned, self.version, self.slot, self.prev_seq = owned, version, slot, prev_seq
        self.blocked_s = blocked_s
        self.copied = False
        self.holds = holds  # the pinned segments and the published object (``_hold_memory``)

    def rollback(self) -> None:
        """Undo an open whose bytes were not touched yet (another window of the set failed)."""
        o, cb = self.owned, self.owned.cb
        a = cb.addr(W_SEQ0 + self.slot)
        native.store_release(a, self.prev_seq)  # nothing was written while odd: readers are fine
        native.store_release(cb.addr(W_WRITER), 0)
        native.futex_wake(a)
        native.futex_wake(cb.latest_addr)
        _release(o, self.holds)

    def prepare(self, copy: bool) -> None:
        o = self.owned
        o.protect(self.slot, True)
        if copy and o.n_slots > 1 and o.info.nbytes:
            src = o.cb.slot_of(self.version - 1)
            native.memcpy(o.slot_address(self.slot), o.slot_address(src), o.info.nbytes)
            self.copied = True

    def commit(self) -> None:
        o, cb = self.owned, self.owned.cb
        if o.guard == "checksum":
            o.sums[self.slot] = o.checksum(self.slot)
        o.protect(self.slot, False)
        a = cb.addr(W_SEQ0 + self.slot)
        # The latest-version word first, then the slot's sequence word: a reader that got the
        # bytes of version v (the slot's sequence said v) reads a latest version >= v after it,
        # so a label read around a copy never lags the bytes (a version-0 read that sees the new
        # latest before the sequence waits the instant between the two stores).
        native.store_release(cb.latest_addr, self.version)
        native.store_release(a, self.version << 1)
        native.store_release(cb.addr(W_WRITER), 0)
        native.futex_wake(a)
        native.futex_wake(cb.latest_addr)
        o.aborted = False
        o.sections += 1
        o.blocked_s += self.blocked_s
        _release(o, self.holds)
        for w in o.watchers:
            try:
                w.committed(self.version, self.slot)
            except Exception:  # noqa: BLE001 - the version is committed; a watcher's failure is its own
                log.exception("%s: a commit watcher failed on version %d", o.label, self.version)

    def abort(self) -> None:
        o, cb = self.owned, self.owned.cb
        o.protect(self.slot, False)
        o.sums.pop(self.slot, None)
        o.aborted = True
        native.store_release(cb.addr(W_WRITER), 0)
        native.futex_wake(cb.latest_addr)
        _release(o, self.holds)


class WriteSection:
    """An open write section on one window or a set of windows (``Runtime.write_section``).

    While it is open no reader returns the bytes being written as valid; ``commit`` (or leaving
    the ``with`` block normally) publishes each window's next version. A body that raises
    aborts it: no version is published over half-written bytes (a double-buffered window keeps
    serving its latest version; a single-slot window stays unreadable until the next section).

    Attributes:
        version: the version being written (of the first window; ``versions`` for each).
        blocked_s: seconds the open waited for leases pinning versions it overwrites.
        copied: whether the target slots were filled with the latest version's bytes first.
    """

    def __init__(self, items: list[_Item], telemetry: "Telemetry | None") -> None:
        self._items = items
        self._telemetry = telemetry
        self._done = False

    @property
    def version(self) -> int:
        return self._items[0].version

    @property
    def versions(self) -> dict[str, int]:
        """``{window label: version being written}``."""
        return {it.owned.label: it.version for it in self._items}

    @property
    def blocked_s(self) -> float:
        return sum(it.blocked_s for it in self._items)

    @property
    def copied(self) -> bool:
        return all(it.copied for it in self._items)

    @property
    def open(self) -> bool:
        return not self._done

    def array(self, index: int = 0) -> np.ndarray:
        """The bytes being written of window ``index`` (in the order given, sorted by GVA for
        sets), as an array of its dtype and shape over the target slot itself."""
        if self._done:
            raise MemsemError("the write section is closed: its arrays are no longer writable")
        it = self._items[_args.index(index, "index", len(self._items), of="windows of the section")]
        return it.owned.slot_array(it.slot)

    def arrays(self) -> list[np.ndarray]:
        return [self.array(i) for i in range(len(self._items))]

    def commit(self) -> int:
        """Publish the next version of every window; returns it (of the first window)."""
        if self._done:
            raise MemsemError("the write section is already closed")
        retired = [it.owned.label for it in self._items if it.owned.retiring]
        if retired:  # a forced retire (its runtime closed) went on under the section
            self.abort()
            raise WindowRetiredError(f"{', '.join(retired)} retired while this write section was open "
                                     "(its runtime closed): no version was published")
        self._done = True
        for it in self._items:
            it.commit()
        if self._telemetry is not None:
            self._telemetry.record_sections(self.blocked_s)
        return self.version

    def abort(self) -> None:
        """Close without publishing (the slots' bytes are dropped). Safe after close."""
        if self._done:
            return
        self._done = True
        for it in self._items:
            it.abort()

    def __enter__(self) -> "WriteSection":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __repr__(self) -> str:
        state = "open" if not self._done else "closed"
        return f"<WriteSection {state} {self.versions}>"


class CommitWatch(Protocol):
    """What watches the commits of a window its runtime owns (``RuntimeCore.watch_commits``)."""

    def committed(self, version: int, slot: int) -> None:
        """``version`` was committed into data slot ``slot``. Called on the writer's thread right
        after the commit (the section lock is released): take note and return, never block."""

    def retiring(self) -> None:
        """The window retires (unpublish, republish, close): stop reading its slots and control
        words before returning (the caller goes on to release them)."""


class CommittedSlots:
    """The owner's view of the committed versions of one of its windows, for a watcher's work
    after a commit (``RuntimeCore.watch_commits``): a version's bytes in place, and whether its
    slot still holds it (a seqlock check: read, then ask ``holds`` again; a version whose slot
    moved meanwhile was overwritten under the read, and what was read is not that version).

    Use it only until the watcher's ``retiring`` was called: the control block goes after that.
    The arrays it returns keep the slots' memory mapped for as long as they live.
    """

    def __init__(self, owned: "Owned") -> None:
        self._owned = owned
        self.n_slots = owned.n_slots
        self.nbytes = owned.info.nbytes
        self.label = owned.label

    def holds(self, version: int) -> bool:
        """Whether ``version`` is committed and its slot holds it now (not being overwritten).
        A full fence first: the reads of the slot before the call are ordered before it."""
        cb = self._owned.cb
        native.lib.memsem_fence_seq_cst()
        return cb.seq(cb.slot_of(version)) == version << 1

    def latest(self) -> int:
        """The latest committed version."""
        return self._owned.cb.latest

    def array(self, version: int) -> np.ndarray:
        """The bytes of the slot ``version`` lives in, as a flat uint8 array over the memory
        itself (read it, then check ``holds(version)``)."""
        o = self._owned
        return o.slot_array(o.cb.slot_of(version)).reshape(-1).view(np.uint8)


def _wait_pins(cb: ControlBlock, new: int, wait: Wait, label: str) -> float:
    """Wait until no lease pins a version that version ``new`` overwrites; each slice is a futex
    wait on the pinned lease's id word (woken by its release), bounded by the lease's expiry.
    Returns the seconds waited (0.0 when nothing was pinned). Raises LeaseHeldError at the
    deadline."""
    t0 = None
    while True:
        pins = _lease.blocking_pins(cb, new)
        if not pins:
            return 0.0 if t0 is None else time.monotonic() - t0
        if t0 is None:
            t0 = time.monotonic()
        if wait.expired:
            holders = [(pid, max(0.0, (exp - native.monotonic_ns()) / 1e9)) for pid, _, exp, _ in pins]
            raise LeaseHeldError(
                f"cannot write version {new} of {label}: leases pinning version(s) "
                f"{sorted({v for _, v, _, _ in pins})} (in the slot it overwrites) outlasted {wait.timeout} s, "
                "held by " + ", ".join(f"pid {p} ({format_left(left)})" for p, left in holders), holders=holders)
        _pid, _version, exp, id_addr = pins[0]
        left_lease = max(0.0, (exp - native.monotonic_ns()) / 1e9)
        lid = native.load_acquire(id_addr)
        wait.nap(lambda sl: native.futex_wait(id_addr, lid & 0xFFFFFFFF, min(sl, left_lease + 1e-4)) if lid else None)


def format_left(seconds: float) -> str:
    """A lease's time left, for messages."""
    return "held until released" if seconds == float("inf") else f"{seconds:.2f} s left"


__all__ = ["CommitWatch", "CommittedSlots", "WriteSection", "format_left", "open_sections"]
