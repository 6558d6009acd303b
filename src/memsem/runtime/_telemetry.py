"""Telemetry: what memsem counts while it works.

Cheap on the hot path: a resolved window holds its route's counter (a two-item list: ops,
bytes) and the bound ``append`` of its op kind's latency ring, so a get/put adds two integers
and stores one sample; there is no lock and no call into this module. Under concurrent threads
an increment may rarely be lost (the adds are not atomic across bytecodes); the figures are
telemetry, not accounting. ``memsem bench`` reports the cost (``telemetry_ns_per_op``).
"""
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
        self._routes: dict[str, list[int]] = {}  # route kind -> [ops, bytes]
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

    def route_counter(self, route: str) -> list[int]:
        """The live ``[ops, bytes]`` counter of ``route`` (the hot path adds to it in place)."""
        c = self._routes.get(route)
        if c is None:
            c = self._routes.setdefault(route, [0, 0])
        return c

    def latency_sink(self, kind: str) -> Any:
        """The bound ``append`` of op kind ``kind``'s latency ring (nanoseconds)."""
        return self._lat[kind].append

    @property
    def bytes_by_route(self) -> dict[str, int]:
        return {r: c[1] for r, c in list(self._routes.items())}

    @property
    def ops_by_route(self) -> dict[str, int]:
        return {r: c[0] for r, c in list(self._routes.items())}

    def record(self, kind: str, route: str, nbytes: int, elapsed_ns: int) -> None:
        """Count one operation (the off-hot-path form: xcopy, view)."""
        c = self.route_counter(route)
        c[0] += 1
        c[1] += nbytes
        self._lat[kind].append(elapsed_ns)

    def snapshot(self, windows: int) -> Stats:
        lat = {}
        for kind, ring in list(self._lat.items()):
            if ring:
                a = np.fromiter(ring, dtype=np.int64)
                lat[kind] = {"p50": float(np.percentile(a, 50)) / 1e3,
                             "p99": float(np.percentile(a, 99)) / 1e3, "n": float(len(a))}
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return Stats(self.bytes_by_route, self.ops_by_route, self.bounce_bytes,
                     dict(self.registrations), lat, rss, windows, dict(self.pipelines))
