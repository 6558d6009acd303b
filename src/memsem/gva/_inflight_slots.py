"""In-flight accounting per participant (same node, lock-free).

Every process that copies to or from a window counts its running copies in a slot of its own in
the window's control block: identity word (``pid | start << 22``) and a counter. A slot is
claimed once per resolution (CAS on the identity word, from free or from a dead holder) and
released when the resolution is released. The native copy increments and decrements the counter
around the copy, sequentially consistent with its generation check (Dekker with the owner).

The owner, retiring a window, bumps the generation and then waits until every slot of a *live*
holder reads 0; slots of dead holders are reclaimed on the way. So a participant killed inside a
copy never wedges the window, and a live one is waited for (bounded by the caller's timeout).
"""
from __future__ import annotations

from memsem import native
from memsem.gva._control_block import I_COUNT, I_IDENT, ControlBlock, identity_of, identity_word
from memsem.native import process_alive


class InflightSlotsFull(Exception):
    """Internal: every in-flight slot is held by a live process (the runtime raises a
    MemsemError naming them)."""

    def __init__(self, holders: list[int]) -> None:
        super().__init__(holders)
        self.holders = holders


def claim(cb: ControlBlock, pid: int, start: int) -> int:
    """Claim a free (or a dead holder's) slot for ``pid``/``start``; returns its index."""
    me = identity_word(pid, start)
    for reclaim in (False, True):
        for slot in range(cb.n_inflight):
            a = cb.inflight_slot_addr(slot)
            cur = native.load_acquire(a + I_IDENT)
            if cur != 0:
                if not reclaim:
                    continue
                hpid, hstart = identity_of(cur)
                if process_alive(hpid, hstart):
                    continue
            ok, _ = native.compare_exchange(a + I_IDENT, cur, me)
            if ok:
                # A dead holder's count is void; ours starts at 0 (the native copy adds to it).
                native.store_release(a + I_COUNT, 0)
                return slot
    live = [identity_of(native.load_acquire(cb.inflight_slot_addr(s) + I_IDENT))[0] for s in range(cb.n_inflight)]
    raise InflightSlotsFull(sorted(set(p for p in live if p)))


def release(cb: ControlBlock, slot: int, pid: int, start: int) -> None:
    """Free ``slot`` if it still belongs to ``pid``/``start`` (its copies are all done)."""
    native.compare_exchange(cb.inflight_slot_addr(slot) + I_IDENT, identity_word(pid, start), 0)


def count_addr(cb: ControlBlock, slot: int) -> int:
    """Address of the slot's counter (what the native copy adds to)."""
    return cb.inflight_slot_addr(slot) + I_COUNT


def busy_counts(cb: ControlBlock) -> list[tuple[int, int, int]]:
    """``(pid, copies, address of the slot's count)`` of live holders with copies in flight right
    now (slots of dead holders are reclaimed on the way). The owner's retire sleeps on a count
    (futex on its low 32 bits): a copy that finds the generation moved wakes it as it leaves."""
    if not cb.busy_inflight():  # one native scan: the common case is nothing in flight
        return []
    out = []
    for slot in range(cb.n_inflight):
        a = cb.inflight_slot_addr(slot)
        ident = native.load_acquire(a + I_IDENT)
        if not ident:
            continue
        n = native.load_acquire(a + I_COUNT)
        if not n:
            continue
        pid, start = identity_of(ident)
        if process_alive(pid, start):
            out.append((pid, n, a + I_COUNT))
        else:
            _reclaim(cb, ident)
    return out


def busy_holders(cb: ControlBlock) -> list[tuple[int, int]]:
    """``(pid, copies)`` of live holders with copies in flight right now; slots of dead holders
    are reclaimed on the way (one native scan, then a liveness check per busy slot)."""
    out = []
    for ident, n in cb.busy_inflight():
        pid, start = identity_of(ident)
        if process_alive(pid, start):
            out.append((pid, n))
        else:
            _reclaim(cb, ident)
    return out


def _reclaim(cb: ControlBlock, ident: int) -> None:
    """A dead holder's marks are void: free its slot(s)."""
    for slot in range(cb.n_inflight):
        a = cb.inflight_slot_addr(slot)
        if native.load_acquire(a + I_IDENT) == ident:
            native.compare_exchange(a + I_IDENT, ident, 0)
