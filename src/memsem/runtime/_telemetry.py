"""Telemetry: what memsem counts while it works.

Cheap on the hot path: a resolved window holds its route's counter (a two-item list: ops,
bytes) and the bound ``append`` of its op kind's pending-sample buffer, so a get/put adds two
integers and stores one sample; there is no lock and no call into this module. Under concurrent
threads an increment may rarely be lost (the adds are not atomic across bytecodes); the figures
are telemetry, not accounting. ``memsem bench`` reports the cost (``telemetry_ns_per_op``).

Latency samples (nanoseconds) wait in a bounded buffer per op kind until a snapshot
(``Runtime.stats()``, a metrics scrape) folds them into a cumulative histogram (fixed buckets,
``LATENCY_BUCKETS_S``, monotonic counts as Prometheus expects) and into a ring of the last 4096
samples that gives p50/p99. The histogram is exact while snapshots come at least every
``PENDING_MAX`` operations of a kind; a snapshot that finds a full buffer counts an overflow
(``Stats.latency_histograms[kind]["overflows"]``: older samples may have been dropped).

Errors the runtime raises are counted by kind (``count_error``): ``stale`` (generation moved),
``torn`` (a seqlock read saw a write section and retried or failed), ``lease_expired`` and
``peer_lost``.
"""
from __future__ import annotations

import dataclasses
import resource
import threading
from collections import defaultdict, deque
from typing import Any

import numpy as np

_RING = 4096
#: latency samples of one op kind held between two snapshots (older ones are dropped)
PENDING_MAX = 1 << 16
#: upper bounds (seconds) of the latency histogram buckets; a last +Inf bucket follows
LATENCY_BUCKETS_S = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                     1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BUCKETS_NS = np.array([round(b * 1e9) for b in LATENCY_BUCKETS_S], dtype=np.int64)
#: error kinds counted by ``Telemetry.count_error``
ERROR_KINDS = ("stale", "torn", "lease_expired", "peer_lost")


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
        latency_histograms: per op kind, cumulative since the runtime started: ``buckets_s``
            (upper bounds in seconds, the last one ``inf``), ``counts`` (cumulative count per
            bucket, as Prometheus' ``le``), ``sum_s``, ``count`` and ``overflows`` (snapshots
            that found samples dropped).
        peak_rss_bytes: the process's peak resident set size.
        windows_published: windows this runtime owns now.
        pipelines: totals over the pipelines this runtime ran (``count``, ``tiles``,
            ``bytes_moved``, ``move_s``, ``caller_wait_s``, ``ready_wait_s``) and the last one's
            ``first_tile_s`` and ``overlap_ratio``; first-tile latency percentiles are in
            ``latency_us["pipeline_first_tile"]``.
        errors: errors raised, by kind (``stale``, ``torn``, ``lease_expired``, ``peer_lost``).
        leases_held: leases this runtime holds now (-1 when the caller did not say).
    """

    bytes_by_route: dict[str, int]
    ops_by_route: dict[str, int]
    bounce_bytes: int
    registrations: dict[str, int]
    latency_us: dict[str, dict[str, float]]
    peak_rss_bytes: int
    windows_published: int
    pipelines: dict[str, float] = dataclasses.field(default_factory=dict)
    latency_histograms: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    leases_held: int = -1

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Telemetry:
    def __init__(self) -> None:
        self._routes: dict[str, list[int]] = {}  # route kind -> [ops, bytes]
        self.bounce_bytes = 0
        self.registrations: defaultdict[str, int] = defaultdict(int)
        # pending samples per op kind (the hot path appends), folded in by snapshots
        self._lat: defaultdict[str, deque[int]] = defaultdict(lambda: deque(maxlen=PENDING_MAX))
        self._ring: defaultdict[str, deque[int]] = defaultdict(lambda: deque(maxlen=_RING))
        self._hist: dict[str, list[Any]] = {}  # kind -> [bucket counts (+Inf last), sum_ns, overflows]
        self._fold_lock = threading.Lock()
        self.pipelines: defaultdict[str, float] = defaultdict(float)
        self._errors = dict.fromkeys(ERROR_KINDS, 0)

    def count_error(self, kind: str) -> None:
        """Count one error the runtime raises: ``kind`` is one of :data:`ERROR_KINDS`.

        Raises:
            ValueError: unknown kind.
        """
        if kind not in self._errors:
            raise ValueError(f"kind must be one of {ERROR_KINDS}, got {kind!r}")
        self._errors[kind] += 1

    @property
    def errors(self) -> dict[str, int]:
        return dict(self._errors)

    def _fold(self) -> None:
        """Move pending samples into the histograms and rings (snapshots only)."""
        with self._fold_lock:
            for kind, pending in list(self._lat.items()):
                n = len(pending)
                if not n:
                    continue
                h = self._hist.get(kind)
                if h is None:
                    h = self._hist[kind] = [np.zeros(len(_BUCKETS_NS) + 1, np.int64), 0, 0]
                if n >= PENDING_MAX:
                    h[2] += 1
                # popleft n times: samples appended meanwhile stay for the next fold
                a = np.fromiter((pending.popleft() for _ in range(n)), dtype=np.int64, count=n)
                h[0] += np.bincount(np.searchsorted(_BUCKETS_NS, a, side="left"), minlength=len(h[0]))
                h[1] += int(a.sum())
                self._ring[kind].extend(a.tolist())

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

    def snapshot(self, windows: int, *, leases: int = -1) -> Stats:
        """A :class:`Stats` (folds the pending latency samples first).

        Args:
            windows: windows the runtime owns now. leases: leases it holds now (-1: unknown).
        """
        self._fold()
        lat = {}
        hist = {}
        bounds = [*LATENCY_BUCKETS_S, float("inf")]
        with self._fold_lock:
            for kind, ring in list(self._ring.items()):
                if ring:
                    a = np.fromiter(ring, dtype=np.int64)
                    lat[kind] = {"p50": float(np.percentile(a, 50)) / 1e3,
                                 "p99": float(np.percentile(a, 99)) / 1e3, "n": float(len(a))}
            for kind, (counts, sum_ns, overflows) in self._hist.items():
                cum = np.cumsum(counts)
                hist[kind] = {"buckets_s": bounds, "counts": [int(c) for c in cum], "sum_s": sum_ns / 1e9,
                              "count": int(cum[-1]), "overflows": int(overflows)}
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return Stats(self.bytes_by_route, self.ops_by_route, self.bounce_bytes,
                     dict(self.registrations), lat, rss, windows, dict(self.pipelines), hist,
                     self.errors, int(leases))
