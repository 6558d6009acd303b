"""A pipeline's plan: what it decides from the ref, its resolution and the arguments (the route,
view or copy, the tiling and why, the default staging geometry), before it moves anything."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from memsem import _dtypes
from memsem._errors import NotSupportedError
from memsem.gva import RefSpec
from memsem.pipeline import _tiling

#: default look-ahead (staging slots)
DEFAULT_DEPTH = 2
_U8 = np.dtype(np.uint8)
#: plans kept per resolution (distinct ranges piped with the default tiling); past it, forgotten
MEMO_LIMIT = 64


class Plan:
    """What a pipeline over one range decides from the ref, its resolution and the arguments
    (the route, view or copy, the tiling and why); raises for arguments that contradict the
    window. A plan of the default arguments is kept on the resolution (``Resolution.memo``)."""

    __slots__ = ("route", "wait_ready", "window_tile_bytes", "n_ready", "dtype", "row_bytes", "flat", "view",
                 "mode", "tile_bytes", "n_tiles", "why", "start_s", "default_slots")

    def __init__(self, spec: RefSpec, res: Any, tile_bytes: int | None, wait_ready: bool | None,
                 zero_copy: bool | None, has_out: bool) -> None:
        route = self.route = res.route
        # the mover's modelled start: the node's native copy worker, or a thread off the node
        self.start_s = _tiling.NATIVE_START_COST_S if res.direct else _tiling.START_COST_S
        info = res.info
        has_ready = info.n_ready > 0 and info.tile_bytes > 0
        if wait_ready is None:
            wait_ready = has_ready
        elif wait_ready and not has_ready:
            raise ValueError(f"wait_ready=True but {spec.label} was published without tiles "
                             "(no ready words); publish with tile_bytes= or tiles=")
        self.wait_ready = wait_ready
        self.window_tile_bytes = info.tile_bytes
        self.n_ready = info.n_ready
        dtype = self.dtype = _dtypes.numpy_dtype(spec.dtype_code)
        shape = spec.shape
        self.row_bytes = rb = math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize
        self.flat = rb == 1 and len(shape) == 1 and dtype is _U8
        nbytes = spec.nbytes
        # A double-buffered versioned window: its owner rewrites the slots, so nothing may view
        # them (a view would show the next version being written); tiles are copies.
        slotted = res.cb is not None and res.cb.n_slots > 1
        why = "auto"
        if zero_copy is None:
            view = not has_out and route.zero_copy and not slotted
            if view and tile_bytes is None and not has_ready and nbytes \
                    and not _tiling.prefer_view(nbytes, route.alpha, route.beta):
                view, why = False, "small"
        elif zero_copy:
            if not route.zero_copy:
                raise NotSupportedError(f"zero_copy=True but route {route.kind} to {spec.label} cannot "
                                        f"map the window ({route.reason})")
            if slotted:
                raise NotSupportedError(f"zero_copy=True but {spec.label} is a double-buffered versioned "
                                        "window (its owner rewrites the slots): nothing can view it; copy "
                                        "it (zero_copy=None or False), with lease=ref.pin() for one version")
            view = True
        else:
            view = False
        self.view = view
        self.mode = "view" if view else ("out" if has_out else "staged")
        if tile_bytes is not None:
            why = "tile_bytes given"
        elif has_ready:
            tile_bytes, why = info.tile_bytes, "the window's own tiles"
        elif view or nbytes == 0:
            tile_bytes, why = max(1, nbytes), "view" if nbytes else "empty"
        else:
            tile_bytes = _tiling.choose_tiles(nbytes, route.alpha, route.beta, rb, dtype.itemsize, self.start_s)[0]
        self.tile_bytes = tile_bytes
        self.n_tiles = -(-nbytes // tile_bytes) if nbytes else 1
        self.why = why
        #: ``(slots, bytes per slot)`` of the staging with ``depth=DEFAULT_DEPTH`` (see Pipeline)
        self.default_slots = (min(DEFAULT_DEPTH, self.n_tiles), max(1, min(tile_bytes, nbytes)))


