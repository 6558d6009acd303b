"""Leases and in-flight accounting on a control block (same-node, lock-free).

A lease is a slot in the window's control block: holder pid + start time, expiry (monotonic
ns) and a random lease id. The owner cannot unpublish or reuse a window while an unexpired lease
of a live holder exists. Protocol (Dekker-style, with sequentially consistent fences):

* consumer: claim a free or reclaimable slot with CAS of its lease id word to a *claim mark*
  (even, naming the claimer's pid; lease ids are odd), write pid/start/version/expiry, publish
  the lease id (release), fence, then read the window state; if it is not LIVE, free the slot
  and fail. While a slot holds a claim mark its other words may still be the previous
  holder's: every reader treats it as taken (scans skip it, reclaim and reap leave it alone),
  except that the mark of a claimer that died is reclaimed. Without the mark, a second claimer
  that read the slot between the first one's CAS and its stores saw the previous holder's
  expired expiry and stole the slot, and the first one's fresh lease read as expired.
* owner: set state CLOSING, fence, then scan the slots; it proceeds only when no slot holds an
  unexpired lease of a live process (dead holders are reaped on the way).

So either the owner sees the lease, or the consumer sees CLOSING: never neither.
"""
from __future__ import annotations

import math
import random

from memsem import native
from memsem.gva._control_block import LEASE_WORDS, L_EXPIRY, L_ID, L_PID, L_START, L_VERSION, W_STATE, ControlBlock, WindowState
from memsem.native import process_alive


class LeaseSlotsFull(Exception):
    """Internal: no free lease slot (the runtime turns it into a MemsemError)."""


class WindowClosing(Exception):
    """Internal: the window is not LIVE (closing or dead)."""


def acquire(cb: ControlBlock, pid: int, start: int, ttl_ns: int, version: int = 0) -> tuple[int, int]:
    """Claim a lease slot; returns ``(slot, lease_id)``. ``version`` (0: none) is the version of
    the window's bytes the lease pins (double-buffered windows keep it readable)."""
    now = native.monotonic_ns()
    lease_id = random.getrandbits(63) | 1  # tells leases of one slot apart (ABA); not a secret
    mark = claim_mark(pid)
    if cb.n_lease:
        # The common case in one native call: the first free slot (the protocol above).
        slot = native.lib.memsem_lease_claim(cb.lease_slot_addr(0), cb.n_lease, mark, pid, start, version,
                                             now + ttl_ns, lease_id, cb.base + 8 * W_STATE, WindowState.LIVE)
        if slot >= 0:
            return slot, lease_id
        if slot == -2:
            raise WindowClosing()
    # No free slot: reclaim one whose lease expired or whose holder died.
    for slot in range(cb.n_lease):
        a = cb.lease_slot_addr(slot)
        cur = native.load_acquire(a + L_ID)
        if cur & 1:
            # Reclaim a slot whose lease expired or whose holder died.
            expiry = native.load_acquire(a + L_EXPIRY)
            holder, hstart = native.load_acquire(a + L_PID), native.load_acquire(a + L_START)
            if expiry > now and process_alive(holder, hstart):
                continue
        elif cur:
            # Being claimed: taken, unless its claimer died between its CAS and its stores.
            if process_alive(cur >> 2, 0):
                continue
        ok, _ = native.compare_exchange(a + L_ID, cur, mark)
        if not ok:
            continue
        native.store_release(a + L_PID, pid)
        native.store_release(a + L_START, start)
        native.store_release(a + L_VERSION, version)
        native.store_release(a + L_EXPIRY, now + ttl_ns)
        native.store_release(a + L_ID, lease_id)  # the lease exists from here on
        native.lib.memsem_fence_seq_cst()
        if cb.word(W_STATE) != WindowState.LIVE:
            release(cb, slot, lease_id)
            raise WindowClosing()
        return slot, lease_id
    raise LeaseSlotsFull()


def expiry_of(cb: ControlBlock, slot: int, lease_id: int) -> int:
    """Expiry (monotonic ns) of the lease, or 0 when the slot no longer holds it."""
    a = cb.lease_slot_addr(slot)
    exp = native.load_acquire(a + L_EXPIRY)
    if native.load_acquire(a + L_ID) != lease_id:
        return 0
    return exp


def renew(cb: ControlBlock, slot: int, lease_id: int, ttl_ns: int) -> int:
    """Extend an unexpired lease; returns the new expiry, or 0 when it already expired/was lost.

    The extension is a CAS on the expiry word (a slot reclaimed meanwhile is never written), and
    it counts only if the old expiry had not passed once the new one was in place: an owner that
    judged the lease expired read its clock before the CAS, so it can never have passed a lease
    this call reports renewed.
    """
    a = cb.lease_slot_addr(slot)
    now = native.monotonic_ns()
    exp = native.load_acquire(a + L_EXPIRY)
    if native.load_acquire(a + L_ID) != lease_id or exp <= now:
        return 0
    new = now + ttl_ns
    ok, _ = native.compare_exchange(a + L_EXPIRY, exp, new)
    if not ok or native.load_acquire(a + L_ID) != lease_id:  # reclaimed or changed meanwhile
        return 0
    native.lib.memsem_fence_seq_cst()
    if native.monotonic_ns() >= exp:
        # The old expiry passed before the extension was visible: an owner may have passed the
        # lease as expired. Undo (harmless if it fails) and report it lost.
        native.compare_exchange(a + L_EXPIRY, new, exp)
        return 0
    return new


def release(cb: ControlBlock, slot: int, lease_id: int) -> None:
    """Free the slot if it still holds this lease (idempotent). A writer waiting for a lease
    that pins a version, and an owner retiring the window, sleep on the lease id word: they
    are woken here."""
    a = cb.lease_slot_addr(slot)
    ok, _ = native.compare_exchange(a + L_ID, lease_id, 0)
    if ok and (native.load_acquire(a + L_VERSION) or cb.word(W_STATE) != WindowState.LIVE):
        native.futex_wake(a + L_ID)  # a writer of the pinned slot, or the owner retiring the window


#: expiries this far ahead (ns) belong to leases held until released (ttl=None)
FOREVER_NS = 1 << 61


def blocking_leases(cb: ControlBlock, *, reap: bool = True) -> list[tuple[int, float, int]]:
    """``(pid, seconds_left, address of the lease id word)`` of unexpired leases held by live
    processes (``math.inf`` for a lease held until released). Reaps dead holders' slots when
    ``reap``. The id word changes when the lease is released (and wakes a retiring owner)."""
    now = native.monotonic_ns()
    out = []
    for slot, pid, start, expiry, _version in cb.unexpired_leases(now):
        if not process_alive(pid, start):
            if reap:
                _reap(cb, slot, pid, start)
            continue
        out.append((pid, math.inf if expiry - now >= FOREVER_NS else (expiry - now) / 1e9,
                    cb.lease_slot_addr(slot) + L_ID))
    return out


def blocking_holders(cb: ControlBlock, *, reap: bool = True) -> list[tuple[int, float]]:
    """``(pid, seconds_left)`` of unexpired leases held by live processes (``math.inf`` for a
    lease held until released). Reaps dead holders' slots when ``reap``."""
    return [(pid, left) for pid, left, _ in blocking_leases(cb, reap=reap)]


def pinned_versions(cb: ControlBlock) -> dict[int, float]:
    """Versions pinned by unexpired leases of live holders -> seconds until the last of them
    expires (dead holders' slots are reaped)."""
    now = native.monotonic_ns()
    out: dict[int, float] = {}
    for slot, pid, start, expiry, version in cb.unexpired_leases(now):
        if not version:
            continue
        if not process_alive(pid, start):
            _reap(cb, slot, pid, start)
            continue
        out[version] = max(out.get(version, 0.0), (expiry - now) / 1e9)
    return out


def blocking_pins(cb: ControlBlock, new: int) -> list[tuple[int, int, int, int]]:
    """Leases a writer of version ``new`` must wait for: unexpired leases of live holders that
    pin a version ``p < new`` living in the slot ``new`` is written to (``p % n_slots == new %
    n_slots``). Returns ``(pid, version, expiry_ns, address of the lease id word)``; dead
    holders' slots are reaped. Pins of ``new`` or later (a reader reserving a version not
    written yet) never block it."""
    now = native.monotonic_ns()
    n = cb.n_slots
    out = []
    for slot, pid, start, expiry, version in cb.unexpired_leases(now):
        if not version or version >= new or version % n != new % n:
            continue
        if not process_alive(pid, start):
            _reap(cb, slot, pid, start)
            continue
        out.append((pid, version, expiry, cb.lease_slot_addr(slot) + L_ID))
    return out


def _reap(cb: ControlBlock, slot: int, pid: int, start: int) -> None:
    """Free a dead holder's slot (only if it still holds that holder's lease: never a slot
    being claimed, whose words may still name the dead holder)."""
    a = cb.lease_slot_addr(slot)
    lid = native.load_acquire(a + L_ID)
    if lid & 1 and native.load_acquire(a + L_PID) == pid and native.load_acquire(a + L_START) == start:
        native.compare_exchange(a + L_ID, lid, 0)


def claim_mark(pid: int) -> int:
    """The value a lease id word holds while ``pid`` claims the slot (even, never a lease id)."""
    return (pid << 2) | 2


def lease_words() -> int:
    return LEASE_WORDS
