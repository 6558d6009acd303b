"""Tile-ready words: one 64-bit word per tile holding the generation it was marked ready for.

Producer: write the tile, then ``mark`` (release store of the generation, then futex wake on the
word's low 32 bits; then the control block's ready sequence word is incremented and woken, for
watchers of every ready word at once). Consumer: acquire-load; if not ready, futex-wait on that
very word (the runtime's one wait, ``memsem.core._wait``: bounded slices, re-checking the
generation and the owner's liveness between them). A mark from an old generation never equals
the current generation, so it never satisfies a wait on the new one.

**Tiles written in parts** (``add_rows``): disjoint writers of one tile each add the rows they
wrote; while the tile is incomplete its word holds a *partial* value (``PARTIAL`` set, the
generation's low ``PARTIAL_GEN_BITS`` bits and the rows written so far), which never equals a
generation (never ready); the writer whose rows complete the tile stores the generation (the
mark). A partial count of another generation is started over, never added to.
"""
from __future__ import annotations

from memsem import native
from memsem.gva._control_block import W_READY_SEQ, ControlBlock


#: a partial word: bit 63, then the generation's low bits, then the rows written so far
PARTIAL = 1 << 63
PARTIAL_ROW_BITS = 24
PARTIAL_GEN_BITS = 63 - PARTIAL_ROW_BITS
#: the most rows of one tile that can be counted
MAX_COUNTED_ROWS = (1 << PARTIAL_ROW_BITS) - 1
_ROWS = MAX_COUNTED_ROWS
_GEN = (1 << PARTIAL_GEN_BITS) - 1


class RowsOverflow(ValueError):
    """More rows were added to a tile than it has (rows written twice)."""


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


def add_rows(cb: ControlBlock, tile: int, generation: int, rows: int, total: int) -> int:
    """Add ``rows`` written rows to tile ``tile`` of ``total`` rows, for ``generation``; the
    call whose rows complete the tile marks it ready. Returns the rows written so far (``total``:
    ready). Lock-free (a compare-exchange made again only when another writer changed the word
    meanwhile).

    Raises:
        RowsOverflow: the count would pass ``total`` (some rows were written twice): the word
            is left as it was.
    """
    a = cb.ready_addr(tile)
    tag = PARTIAL | ((generation & _GEN) << PARTIAL_ROW_BITS)
    cur = native.load_acquire(a)
    while True:
        if cur == generation:
            return total  # marked already (a whole-tile mark, or complete)
        done = (cur & _ROWS) if (cur & ~_ROWS) == tag else 0
        new = done + rows
        if new > total:
            raise RowsOverflow(f"tile {tile}: {done} + {rows} rows written of its {total}: rows written twice")
        want = generation if new == total else tag | new
        ok, cur = native.compare_exchange(a, cur, want)
        if ok:
            if new == total:
                native.futex_wake(a)
                _bump(cb)
            return new


def rows_of(word: int, generation: int) -> int:
    """Rows a ready word says were written for ``generation`` (0 when none; a ready word: -1)."""
    if word == generation:
        return -1
    tag = PARTIAL | ((generation & _GEN) << PARTIAL_ROW_BITS)
    return word & _ROWS if (word & ~_ROWS) == tag else 0


def ready_tiles(cb: ControlBlock, generation: int) -> list[int]:
    return [i for i in range(cb.n_ready) if native.load_acquire(cb.ready_addr(i)) == generation]
