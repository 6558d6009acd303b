"""Tile-ready words: one 64-bit word per tile holding the generation it was marked ready for.

Producer: write the tile, then ``mark`` (release store of the generation, then futex wake on the
word's low 32 bits; then the control block's ready sequence word is incremented and woken, for
watchers of every ready word at once). Consumer: acquire-load; if not ready, futex-wait on that
very word (the runtime's one wait, ``memsem.core._wait``: bounded slices, re-checking the
generation and the owner's liveness between them). A mark from an old generation never equals
the current generation, so it never satisfies a wait on the new one.
"""
from __future__ import annotations

from memsem import native
from memsem.gva._control_block import W_READY_SEQ, ControlBlock


def _bump(cb: ControlBlock) -> None:
    a = cb.addr(W_READY_SEQ)
    native.fetch_add(a, 1)
    native.futex_wake(a)


def is_ready(cb: ControlBlock, tile: int, generation: int) -> bool:
    return native.load_acquire(cb.ready_addr(tile)) == generation


def mark(cb: ControlBlock, tile: int, generation: int) -> None:
    a = cb.ready_addr(tile)
    native.store_release(a, generation)
    native.futex_wake(a)
    _bump(cb)


def clear(cb: ControlBlock, tile: int, generation: int | None = None) -> bool:
    """Clear the tile's word (only if it holds ``generation``, when given); True if cleared."""
    a = cb.ready_addr(tile)
    if generation is None:
        native.store_release(a, 0)
    elif not native.compare_exchange(a, generation, 0)[0]:
        return False
    _bump(cb)
    return True


def ready_tiles(cb: ControlBlock, generation: int) -> list[int]:
    return [i for i in range(cb.n_ready) if native.load_acquire(cb.ready_addr(i)) == generation]
