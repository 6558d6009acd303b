"""What a pipeline measured: :class:`PipelineStats` (the caller's snapshot) and the summary the
runtime's telemetry keeps of a closed pipeline."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class PipelineStats:
    """What one pipeline measured (all times in seconds, CLOCK_MONOTONIC).

    Attributes:
        tiles: tiles of the ref. delivered: tiles handed to the caller so far.
        tile_bytes: bytes per tile (the last may be shorter). depth: staging slots.
        mode: ``"staged"`` (copies into slots), ``"out"`` (copies into the caller's ``out``) or
            ``"view"`` (zero-copy views of the window, nothing moved).
        route: route kind used to reach the window (e.g. ``host/cma``).
        mover: who moved tiles after the first: ``"native"`` (a worker of the runtime's
            native mover pool), ``"thread"`` (a Python thread: routes the native movers cannot
            copy on), ``"caller"`` (no mover: one tile, or no way to watch the owner natively)
            or ``"none"`` (view mode).
        explanation: why this tile count, and what a tile costs (see ``auto_tiles``).
        first_tile_s: from construction to the first tile handed to the caller.
        total_s: from construction to the release of the last tile (or to now / close).
        move_s: time spent copying (mover and caller).
        ready_wait_s: time spent waiting for the producer's ready words (mover or caller).
        caller_hold_s: time the mover waited for the caller to release a slot.
        caller_wait_s: time the caller waited in ``next()`` for data.
        compute_s: time the caller held tiles (between hand-out and release).
        overlap_ratio: fraction of ``move_s`` during which the caller was computing on another
            tile (1.0 = every copy hidden behind compute; 1.0 when nothing was moved).
        bytes_moved: bytes copied (0 in view mode).
        caller_tiles: tiles the caller moved itself: tile 0, a tile the mover had not started
            when the caller wanted it (the caller never waits for a late mover), a tile after an
            unusual outcome (a write section, a closed resolution...), the tiles after a late
            one (until the late run ended, and ``2**k`` tiles after the k-th late tile).
        late_tiles: of those, tiles a native worker had started but not finished well past
            their expected move time (1.5x the route's modelled move, or, once the worker copied
            a tile of the pipeline, 3x its mean copy, at least 100 us, when that is shorter;
            descheduled): the caller copied them into a spare slot.
    """

    tiles: int
    delivered: int
    tile_bytes: int
    depth: int
    mode: str
    route: str
    first_tile_s: float | None
    total_s: float
    move_s: float
    ready_wait_s: float
    caller_hold_s: float
    caller_wait_s: float
    compute_s: float
    overlap_ratio: float
    bytes_moved: int
    mover: str = "caller"
    caller_tiles: int = 0
    explanation: str = ""
    late_tiles: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        ft = "-" if self.first_tile_s is None else f"{self.first_tile_s * 1e3:.3f} ms"
        return (f"pipeline[{self.mode} {self.route}, mover {self.mover}] {self.delivered}/{self.tiles} tiles of "
                f"{self.tile_bytes} B, depth {self.depth}: first tile {ft}, total "
                f"{self.total_s * 1e3:.1f} ms, moving {self.move_s * 1e3:.1f} ms, waiting for "
                f"producer {self.ready_wait_s * 1e3:.1f} ms, for caller {self.caller_hold_s * 1e3:.1f} ms, "
                f"caller waited {self.caller_wait_s * 1e3:.1f} ms, overlap {self.overlap_ratio:.2f}, "
                f"{self.bytes_moved} B moved ({self.caller_tiles} tiles by the caller, {self.late_tiles} taken over); "
                f"{self.explanation}")


def overlap(moves: list[tuple[float, float]], computes: list[tuple[float, float]], move_s: float) -> float:
    """Fraction of ``move_s`` (all moves) during which the caller computed, ``moves`` being the
    intervals of the mover's moves (the caller's own never overlap its computing); 1.0 when
    nothing was moved."""
    if move_s <= 0:
        return 1.0
    return min(1.0, intersection(moves, computes) / move_s) if moves else 0.0


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two lists of disjoint, sorted intervals."""
    a = sorted(a)
    b = sorted(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
