"""Tiling: how a pipeline cuts a ref into tiles, and the sentence that says why.

With ``tile_bytes`` given, it is honoured and :func:`explain_given` says what it costs: the
modelled move time of a tile against the fixed cost of handing one over. Without it, a window
published with tiles is streamed in its own tiles; otherwise :func:`auto_tiles` picks the tile
count: one tile (a plain get) when the ref is too small for overlap to pay, else as many tiles as
keep the hand-offs within ``AUTO_LOSS`` of the move time (so a consumer that computes nothing
loses at most that against one get), up to ``AUTO_MAX_TILES``.

:func:`prefer_view` decides, for a pipeline with the automatic tiling that could hand out views of
the window, whether a view pays: a view moves nothing but costs a lease and its checks, which a
small ref's copy does not.

Pure functions of the sizes and the route's cost model; nothing here touches a window.
"""
from __future__ import annotations

import math

#: modelled fixed cost of one tile hand-off (caller side: the wait, the Tile, the release;
#: a futex wake when the caller sleeps), seconds; measured 5-25 us on a 2-vCPU VM (more when the
#: tiles just moved evicted the interpreter's data from the caches)
TILE_COST_S = 20e-6
#: modelled cost of handing a pipeline's first run to a mover thread (routes off the node, whose
#: tiles a Python thread moves), seconds
START_COST_S = 50e-6
#: the same for the native copy worker of the node's routes (``Resolution.direct``: host/shm,
#: host/cma), including the caller's first tiles taken while that worker is not yet running.
#: At 50 us a 4 MiB ref on host/cma was cut into 6 tiles and lost to get-then-compute (0.81-0.83
#: of it, ``benchmarks/bench_pipeline.py --parts vs_get``, 2-vCPU VM, idle); at 150 us it is one
#: get (0.88-0.94) while 8 MiB still gets 8 tiles (0.99-1.11) and 16 MiB on as before
NATIVE_START_COST_S = 150e-6
#: modelled fixed cost of a pipeline's view of the window (a lease acquired and released, the
#: view's mapping and generation checks, the array's finalizer), seconds; a ref whose modelled
#: copy costs less is copied instead. Measured about 30 us idle and 80 us loaded on a 2-vCPU VM,
#: the cost of copying 0.8-1.3 MiB there; against the route model's copy (host/shm 8 GB/s, well
#: below an in-cache copy) the crossover lies between 1 and 4 MiB
VIEW_COST_S = 150e-6
#: the automatic tile count keeps the fixed costs of tiling within this fraction of the move time
AUTO_LOSS = 0.25
#: ... and tiles only when it saves at least this fraction of get-then-compute (modelled)
AUTO_MIN_GAIN = 0.1
#: most tiles the automatic choice makes
AUTO_MAX_TILES = 64
#: automatic tiles are whole multiples of this many bytes where the ref's rows allow
TILE_ALIGN = 4096


def fmt_bytes(n: float) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n / s:.3g} {unit}"
    return f"{int(n)} B"


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def auto_tiles(nbytes: int, alpha: float, beta: float, *, row_bytes: int = 1, itemsize: int = 1,
               start_s: float = START_COST_S) -> tuple[int, str]:
    """The tile size the pipeline picks for a ref of ``nbytes`` bytes on a route whose cost
    model is ``alpha + bytes / beta`` seconds, and why (a sentence).

    A pipeline pays ``start_s + n x TILE_COST_S`` for ``n`` tiles (``start_s``: the mover's
    start, ``START_COST_S`` for a thread, ``NATIVE_START_COST_S`` for the node's native worker)
    and, for a consumer whose compute takes about as long as the move (what a pipeline is for),
    hides ``move x (1 - 1/n)`` of it. The choice is the ``n`` (at most ``AUTO_MAX_TILES``) with the largest modelled saving,
    provided the saving is at least ``AUTO_MIN_GAIN`` of get-then-compute and the fixed costs stay
    within ``AUTO_LOSS`` of the move (what a consumer that computes nothing loses against one
    get); else one tile (a plain get). Tiles are whole rows (``row_bytes``), and whole multiples of
    ``TILE_ALIGN`` bytes where the rows allow.
    """
    tile, n = choose_tiles(nbytes, alpha, beta, row_bytes, itemsize, start_s)
    return tile, explain_auto(nbytes, tile, n, alpha, beta, start_s)


def choose_tiles(nbytes: int, alpha: float, beta: float, row_bytes: int, itemsize: int,
                 start_s: float = START_COST_S) -> tuple[int, int]:
    """``(tile_bytes, n_tiles)`` of :func:`auto_tiles`, without the sentence."""
    move = alpha + nbytes / beta
    best, gain = 1, 0.0
    for n in range(2, AUTO_MAX_TILES + 1):
        cost = start_s + n * TILE_COST_S
        if cost > AUTO_LOSS * move:
            break
        g = move * (1 - 1 / n) - cost
        if g > gain:
            best, gain = n, g
    if best == 1 or gain < AUTO_MIN_GAIN * 2 * move or nbytes < 2:
        return max(1, nbytes), 1
    # Whole rows, and whole pages where the rows allow (aligned copies and kernels).
    unit = next((u for u in (math.lcm(max(1, row_bytes), TILE_ALIGN), row_bytes, itemsize)
                 if 0 < u <= nbytes // best), 1)
    tile = -(-nbytes // best)
    tile = -(-tile // unit) * unit
    return tile, -(-nbytes // tile)


def prefer_view(nbytes: int, alpha: float, beta: float) -> bool:
    """Whether a view of a ref of ``nbytes`` bytes pays on a route that can map the window: its
    modelled copy (``alpha + nbytes / beta``) costs more than a view's fixed cost
    (``VIEW_COST_S``)."""
    return alpha + nbytes / beta > VIEW_COST_S


def explain_copied(nbytes: int, alpha: float, beta: float) -> str:
    """Why a pipeline that could hand out views copies instead (see :func:`prefer_view`)."""
    return (f"copied, not viewed: the copy (about {fmt_s(alpha + nbytes / beta)}) costs less than a "
            f"view's lease and checks (about {fmt_s(VIEW_COST_S)})")


def explain_auto(nbytes: int, tile: int, n: int, alpha: float, beta: float, start_s: float = START_COST_S) -> str:
    move = alpha + nbytes / beta
    if n == 1:
        return (f"one tile (a plain get): moving {fmt_bytes(nbytes)} takes about {fmt_s(move)}, too "
                f"little for overlap to repay starting a mover ({fmt_s(start_s)}) and "
                f"handing tiles over ({fmt_s(TILE_COST_S)} each)")
    cost = start_s + n * TILE_COST_S
    return (f"{n} tiles of {fmt_bytes(tile)} (automatic): moving {fmt_bytes(nbytes)} takes about "
            f"{fmt_s(move)}; with compute as long as the move the pipeline hides about "
            f"{fmt_s(move * (1 - 1 / n))} of it for {fmt_s(cost)} of hand-offs (a consumer that "
            "computes nothing pays those against one get)")


def explain_given(tile_bytes: int, n_tiles: int, alpha: float, beta: float, why: str) -> str:
    if n_tiles == 1:
        return f"one tile of {fmt_bytes(tile_bytes)} ({why}): a plain get, nothing to overlap"
    move = alpha + tile_bytes / beta
    ratio = TILE_COST_S / move
    if ratio > 0.5:
        cost = (f"each tile moves in about {fmt_s(move)} but its hand-off costs about "
                f"{fmt_s(TILE_COST_S)} ({ratio:.2g}x the move): the stream is bound by hand-offs; "
                "larger tiles (or tile_bytes=None for an automatic choice) would be faster")
    else:
        cost = (f"each tile moves in about {fmt_s(move)}; its hand-off costs about "
                f"{fmt_s(TILE_COST_S)} ({ratio:.0%} of the move)")
    return f"{n_tiles} tiles of {fmt_bytes(tile_bytes)} ({why}): {cost}"


def ready_words(ref_offset: int, ref_nbytes: int, tile_bytes: int, window_tile_bytes: int, n_ready: int,
                index: int) -> range:
    """Window tiles (ready words) that pipeline tile ``index`` of a ref overlaps (the native
    mover computes the same)."""
    off = index * tile_bytes
    n = min(tile_bytes, ref_nbytes - off)
    start = ref_offset + off
    first = start // window_tile_bytes
    last = (start + max(n, 1) - 1) // window_tile_bytes
    return range(first, min(last, n_ready - 1) + 1)
