"""Telemetry: what memsem counts while it works (cheap on the hot path: a few dict adds and one
ring-buffer store per operation, no lock: counters are per-thread-safe under the GIL)."""
from __future__ import annotations

import dataclasses
import resource
from collections import defaultdict, deque
from typing import Any

import numpy as np

_RING = 4096


@dataclasses.dataclass
class Stats:
    """A snapshot of a runtime's counters.

    Attributes:
        bytes_by_route: bytes moved per route kind (e.g. ``host/shm``), both directions.
        ops_by_route: operations per route kind.
        bounce_bytes: bytes copied through any intermediate buffer (staging, remote-to-remote).
        registrations: regions registered with engines (per engine).
        latency_us: per op kind (``get``, ``put``, ``xcopy``, ``view``): p50 and p99 in us of the
            last 4096 operations.
        peak_rss_bytes: the process's peak resident set size.
        windows_published: windows this runtime owns now.
        pipelines: totals over the pipelines this runtime ran (``count``, ``tiles``,
            ``bytes_moved``, ``move_s``, ``caller_wait_s``, ``ready_wait_s``) and the last one's
            ``first_tile_s`` and ``overlap_ratio``; first-tile latency percentiles are in
            ``latency_us["pipeline_first_tile"]``.
    """

    bytes_by_route: dict[str, int]
    ops_by_route: dict[str, int]
    bounce_bytes: int
    registrations: dict[str, int]
    latency_us: dict[str, dict[str, float]]
    peak_rss_bytes: int
    windows_published: int
    pipelines: dict[str, float] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Telemetry:
    def __init__(self) -> None:
        self.bytes_by_route: defaultdict[str, int] = defaultdict(int)
        self.ops_by_route: defaultdict[str, int] = defaultdict(int)
        self.bounce_bytes = 0
        self.registrations: defaultdict[str, int] = defaultdict(int)
        self._lat: defaultdict[str, deque[int]] = defaultdict(lambda: deque(maxlen=_RING))
        self.pipelines: defaultdict[str, float] = defaultdict(float)

    def record_pipeline(self, st: Any) -> None:
        """Add one finished pipeline's :class:`memsem.pipeline.PipelineStats`."""
        p = self.pipelines
        p["count"] += 1
        p["tiles"] += st.delivered
        p["bytes_moved"] += st.bytes_moved
        p["move_s"] += st.move_s
        p["caller_wait_s"] += st.caller_wait_s
        p["ready_wait_s"] += st.ready_wait_s
        p["overlap_ratio"] = st.overlap_ratio
        if st.first_tile_s is not None:
            p["first_tile_s"] = st.first_tile_s
            self._lat["pipeline_first_tile"].append(int(st.first_tile_s * 1e9))

    def record(self, kind: str, route: str, nbytes: int, elapsed_ns: int) -> None:
        self.bytes_by_route[route] += nbytes
        self.ops_by_route[route] += 1
        self._lat[kind].append(elapsed_ns)

    def snapshot(self, windows: int) -> Stats:
        lat = {}
        for kind, ring in list(self._lat.items()):
            if ring:
                a = np.fromiter(ring, dtype=np.int64)
                lat[kind] = {"p50": float(np.percentile(a, 50)) / 1e3,
                             "p99": float(np.percentile(a, 99)) / 1e3, "n": float(len(a))}
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return Stats(dict(self.bytes_by_route), dict(self.ops_by_route), self.bounce_bytes,
                     dict(self.registrations), lat, rss, windows, dict(self.pipelines))
