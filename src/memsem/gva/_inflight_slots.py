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
from memsem.gva._control_block import I_COUNT, I_IDENT, ControlBlock, identity_of
from memsem.native import process_alive

_load, _store, _cas = native.lib.memsem_load_acquire, native.lib.memsem_store_release, native.lib.memsem_compare_exchange
_cast = native.ffi.cast
_U64P = native.ffi.typeof("uint64_t *")


class InflightSlotsFull(Exception):
    """Internal: every in-flight slot is held by a live process (the runtime raises a
    MemsemError naming them)."""

    def __init__(self, holders: list[int]) -> None:
        super().__init__(holders)
        self.holders = holders


def claim(cb: ControlBlock, me: int) -> int:
    """Claim a free (or a dead holder's) slot for the process of identity word ``me``
    (:func:`~memsem.gva._control_block.identity_word`); returns its index."""
    seen = native.ffi.new("uint64_t *")
    for reclaim in (False, True):
        for slot in range(cb.n_inflight):
            a = cb.inflight_slot_addr(slot)
            ident = _cast(_U64P, a + I_IDENT)
            cur = _load(ident)
            if cur != 0:
                if not reclaim:
                    continue
                hpid, hstart = identity_of(cur)
                if process_alive(hpid, hstart):
                    continue
            seen[0] = cur
            if _cas(ident, seen, me):
                # A dead holder's count is void; ours starts at 0 (the native copy adds to it).
                _store(_cast(_U64P, a + I_COUNT), 0)
                return slot
    live = [identity_of(native.load_acquire(cb.inflight_slot_addr(s) + I_IDENT))[0] for s in range(cb.n_inflight)]
    raise InflightSlotsFull(sorted(set(p for p in live if p)))


def release(cb: ControlBlock, slot: int, me: int) -> None:
    """Free ``slot`` if it still belongs to the process of identity word ``me`` (its copies are
    all done)."""
    native.compare_exchange(cb.inflight_slot_addr(slot) + I_IDENT, me, 0)


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
