"""A ready-made measurement: stream one ref through a pipeline and report what the issue asks
(first-tile latency against one tile-sized get, overlap, bytes moved). Used by ``memsem demo``."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from memsem.pipeline._pipeline import Pipeline
from memsem.core import RuntimeCore


def _checksum(raw: np.ndarray) -> int:
    n8 = raw.nbytes - raw.nbytes % 8
    s = int(raw[:n8].view(np.uint64).sum(dtype=np.uint64)) if n8 else 0
    return (s + int(raw[n8:].sum(dtype=np.uint64))) & 0xFFFFFFFFFFFFFFFF


def stream_report(runtime: RuntimeCore, ref: Any, *, tile_bytes: int, depth: int = 2,
                  compute: Callable[[np.ndarray], Any] | None = None, zero_copy: bool | None = False,
                  timeout: float | None = None, baseline_repeats: int = 5) -> dict[str, Any]:
    """Stream ``ref`` through a pipeline, computing on each tile, and measure.

    Args:
        runtime: the consumer's runtime. ref: a TensorRef (or RefSpec).
        tile_bytes: bytes per tile. depth: staging slots.
        compute: called with each tile's ``array``; default a uint64 checksum of its bytes.
        zero_copy: passed to :class:`Pipeline` (default False: copy, so the numbers measure moves).
        baseline_repeats: how many single-tile gets the first-tile baseline takes the median of.

    Returns:
        A dict: the pipeline's :class:`PipelineStats` fields, plus ``one_tile_get_s`` (median
        latency of one ``tile_bytes`` get into a new buffer, measured in this call),
        ``first_tile_ratio`` (first-tile latency / one_tile_get_s) and ``checksum`` (of the bytes
        seen, when ``compute`` is the default).
    """
    spec = getattr(ref, "spec", ref)
    n = min(int(tile_bytes), spec.nbytes)
    lat = []
    for _ in range(max(1, baseline_repeats)):
        t = time.perf_counter()
        buf = np.empty(n, np.uint8)
        runtime.transfer(spec, "get", 0, buf)
        lat.append(time.perf_counter() - t)
    one = statistics.median(lat)
    total = 0
    with Pipeline(runtime, spec, tile_bytes=tile_bytes, depth=depth, zero_copy=zero_copy,
                  timeout=timeout) as p:
        for tile in p:
            with tile:
                if compute is None:
                    total = (total + _checksum(tile.raw)) & 0xFFFFFFFFFFFFFFFF
                else:
                    compute(tile.array)
        st = p.stats
    out = st.as_dict()
    out["one_tile_get_s"] = one
    out["first_tile_ratio"] = (st.first_tile_s / one) if st.first_tile_s and one > 0 else None
    if compute is None:
        out["checksum"] = total
    return out
