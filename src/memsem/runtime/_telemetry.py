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
    """

    bytes_by_route: dict[str, int]
    ops_by_route: dict[str, int]
    bounce_bytes: int
    registrations: dict[str, int]
    latency_us: dict[str, dict[str, float]]
    peak_rss_bytes: int
    windows_published: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Telemetry:
    def __init__(self) -> None:
        self.bytes_by_route: defaultdict[str, int] = defaultdict(int)
        self.ops_by_route: defaultdict[str, int] = defaultdict(int)
        self.bounce_bytes = 0
        self.registrations: defaultdict[str, int] = defaultdict(int)
        self._lat: defaultdict[str, deque[int]] = defaultdict(lambda: deque(maxlen=_RING))

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
                     dict(self.registrations), lat, rss, windows)
