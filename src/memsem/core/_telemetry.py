"""Telemetry: what memsem counts while it works.

Free on the hot path: the native copy itself counts, in its resolution's plan, the operations,
bytes and a latency histogram per direction (relaxed atomic adds; 4 buckets per power of two of
nanoseconds, see ``memsem_lat_bucket``). This module only reads them: a snapshot sums the plans
of live resolutions and the totals folded in from released ones. Operations off the hot path
(xcopy batches, views, pipelines) and error counts are recorded here directly.
"""
from __future__ import annotations

import collections
import dataclasses
import resource
import threading
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import native

if TYPE_CHECKING:
    from memsem.core._resolve import Resolution

_NB = native.LAT_BUCKETS
#: queued pipeline records folded into the totals at once (bounds the queue between reads)
_PIPE_FOLD = 256
#: lower bound in ns of every latency bucket (the last bucket is open-ended)
BUCKET_FLOOR_NS = np.array([native.lib.memsem_lat_bucket_floor(b) for b in range(_NB)], np.float64)
#: delta-version counters (``Stats.deltas``)
DELTA_KEYS = ("loads_delta", "loads_full", "mismatches", "bytes_moved", "bytes_loaded", "records", "records_none",
              "record_s", "commit_hook_s")
#: error kinds counted (``Stats.errors``)
ERROR_KINDS = ("stale", "torn", "busy", "lease_expired", "peer_lost", "timeout")
#: the route of latency samples whose operation is not one route (an xcopy batch may span several)
MIXED_ROUTE = "mixed"
#: native buckets whose lower bounds are the finite ``le`` bounds of ``latency_histograms``:
#: every fourth from 2**10 ns (1.024 us) to 2**32 ns (4.295 s), then the last native bucket's
#: floor (1.75 * 2**32 ns, 7.516 s: everything longer shares that bucket), then +Inf
PROMETHEUS_BUCKETS = (*range(36, 125, 4), _NB - 1)


@dataclasses.dataclass
class Stats:
    """A snapshot of a runtime's counters.

    Attributes:
        bytes_by_route: bytes moved per route kind (e.g. ``host/shm``), both directions.
        ops_by_route: operations per route kind.
        bounce_bytes: bytes copied through any intermediate buffer (staging, remote-to-remote).
        registrations: regions registered with engines (per engine).
        latency_us: per op kind (``get``, ``put``, ``xcopy``, ``view``, ``pipeline_first_tile``):
            ``p50``, ``p99`` (microseconds, from the histogram: the bucket's lower bound) and ``n``.
        latency_histograms: per op kind, cumulative since the runtime started, in Prometheus'
            form: ``buckets_s`` (upper bounds in seconds: powers of two of ns from 2**10 ns =
            1.024 us to 2**32 ns = 4.295 s, then 7.516 s, then ``inf``: docs/metrics.md),
            ``counts`` (cumulative count per bound), ``sum_s``,
            ``count``, ``overflows`` (always 0: the native counters never drop a sample).
        latency_histograms_by_route: the same per op kind and route kind (``host/shm``, ...;
            ``mixed`` for xcopy batches, which may span routes).
        write_sections: write sections this runtime's windows committed (``committed``) and
            the seconds their opens waited for readers' pins of versions they overwrite
            (``blocked_s``): the writer's (trainer's) time blocked by readers.
        peak_rss_bytes: the process's peak resident set size.
        windows_published: windows this runtime owns now.
        pipelines: totals over the pipelines this runtime ran (``count``, ``tiles``,
            ``bytes_moved``, ``move_s``, ``caller_wait_s``, ``ready_wait_s``) and the last one's
            ``first_tile_s`` and ``overlap_ratio``.
        errors: counts of ``stale`` (generation moved), ``torn`` (a copy raced a write section
            and was retried), ``busy`` (a reader waited for a write section), ``lease_expired``,
            ``peer_lost`` and ``timeout`` outcomes.
        leases_held: leases this runtime holds now.
        resolutions: resolutions cached now (each holds its window's mappings).
        deltas: state-dict loads of this runtime (``StateDictRef.load``, the follower loop):
            ``loads_delta`` (moved only what changed since the version the buffers held),
            ``loads_full``, ``mismatches`` (a delta's result failed the writer's digests: loaded
            in full instead), ``bytes_moved`` (bytes the loads moved: a delta's patches and
            changed tiles, a full load's tensors), ``bytes_loaded`` (bytes of the tensors the
            loads filled); and, as a writer, ``records`` (delta records its histories made),
            ``records_none`` (versions recorded without a delta: overwritten first, or no
            previous version), ``record_s`` (seconds its background thread spent on them) and
            ``commit_hook_s`` (seconds of the writers' own threads spent noting commits for it).
        followers: per followed name (``Runtime.follow`` loops of this runtime that are open),
            ``held`` (the version the follower loaded last; 0 before its first load),
            ``latest`` (the writer's latest committed version, read now: a read of the
            window's version word, across nodes one request; absent when it cannot be read:
            no window yet, the owner gone), ``lag`` (``latest - held``) and ``since_load_s``
            (seconds since the last load; absent before it). Several followers of one name:
            the one furthest behind (lowest ``held``, longest ``since_load_s``); a source
            without a name reports under ``""``.
    """

    bytes_by_route: dict[str, int]
    ops_by_route: dict[str, int]
    bounce_bytes: int
    registrations: dict[str, int]
    latency_us: dict[str, dict[str, float]]
    peak_rss_bytes: int
    windows_published: int
    pipelines: dict[str, float] = dataclasses.field(default_factory=dict)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    leases_held: int = 0
    resolutions: int = 0
    latency_histograms: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict, repr=False)
    latency_histograms_by_route: dict[str, dict[str, dict[str, Any]]] = dataclasses.field(
        default_factory=dict, repr=False)
    write_sections: dict[str, float] = dataclasses.field(default_factory=dict)
    followers: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    deltas: dict[str, float] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _drain(q: "collections.deque[tuple]") -> list[tuple]:
    """Everything queued in ``q`` now, oldest first (pops: appends of other threads meanwhile
    are kept, in order, for the next drain)."""
    out = []
    pop = q.popleft
    while True:
        try:
            out.append(pop())
        except IndexError:
            return out


def _percentile(counts: np.ndarray, q: float) -> float:
    total = counts.sum()
    if total == 0:
        return 0.0
    idx = int(np.searchsorted(np.cumsum(counts), q * total, side="left"))
    return float(BUCKET_FLOOR_NS[min(idx, _NB - 1)])


class Telemetry:
    """Counters of one runtime (thread safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: id -> weak reference of the unreleased resolutions (each removed by its ``absorb``)
        self._live: "dict[int, weakref.ref[Resolution]]" = {}
        #: route kind -> [ops, bytes] of released resolutions
        self._routes: dict[str, list[int]] = {}
        #: (op kind, route kind) -> histogram counts, and the sum of the latencies they count (ns)
        self._hist: dict[tuple[str, str], np.ndarray] = {}
        self._sum: dict[tuple[str, str], int] = {}
        self._sections = [0, 0.0]
        self.bounce_bytes = 0
        self.registrations: defaultdict[str, int] = defaultdict(int)
        self.pipelines: defaultdict[str, float] = defaultdict(float)
        #: closed pipelines' figures not yet folded into ``pipelines`` (appends and pops of a
        #: deque are atomic: a pipeline's close takes no lock)
        self._pipes: collections.deque[tuple] = collections.deque()
        #: the same for operations counted by ``record`` (views)
        self._ops: collections.deque[tuple] = collections.deque()
        self.errors: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)
        self._deltas: dict[str, float] = dict.fromkeys(DELTA_KEYS, 0)
        #: the follower loops of this runtime (held weakly: a follower nobody iterates goes)
        self._followers: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def add_follower(self, follower: Any) -> None:
        """Report ``follower`` (a ``memsem.Follower``: ``staleness()``) in ``Stats.followers``."""
        with self._lock:
            self._followers.add(follower)

    def _staleness(self) -> dict[str, dict[str, float]]:
        """``Stats.followers``: each open follower's ``staleness()``, the worst per name. Reads
        outside the lock (a latest version may be a request)."""
        with self._lock:
            followers = list(self._followers)
        out: dict[str, dict[str, float]] = {}
        for f in followers:
            st = f.staleness()
            if st is None:
                continue
            name = st.pop("name")
            now = out.get(name)
            if now is None:
                out[name] = st
                continue
            now["held"] = min(now["held"], st["held"])
            if "latest" in st:
                now["latest"] = max(now.get("latest", 0), st["latest"])
            if "since_load_s" in st or "since_load_s" in now:
                now["since_load_s"] = max(now.get("since_load_s", 0.0), st.get("since_load_s", 0.0))
        for st in out.values():
            if "latest" in st:
                st["lag"] = max(0, st["latest"] - st["held"])
        return out

    # -- hot-path counters live in plans ----------------------------------------------------------
    def track(self, res: "Resolution") -> None:
        with self._lock:
            self._live[id(res)] = weakref.ref(res)

    def absorb(self, res: "Resolution") -> None:
        """Fold a released resolution's counters into the totals (once)."""
        ops, nbytes, hist, sums = _plan_counts(res.plan)
        with self._lock:
            self._live.pop(id(res), None)
            c = self._routes.setdefault(res.route.kind, [0, 0])
            c[0] += ops
            c[1] += nbytes
            for k, h, t in zip(("get", "put"), hist, sums):
                key = (k, res.route.kind)
                self._add_hist(key, h)
                self._sum[key] = self._sum.get(key, 0) + t

    def _add_hist(self, kind: tuple[str, str], h: np.ndarray) -> None:
        cur = self._hist.get(kind)
        if cur is None:
            self._hist[kind] = h.astype(np.int64, copy=True)
        else:
            cur += h.astype(np.int64)

    # -- off the hot path -------------------------------------------------------------------------
    def record(self, kind: str, route: str, nbytes: int, elapsed_ns: int) -> None:
        """Count one operation that did not go through a plan (views). Takes no lock: queued
        like a pipeline's figures, and folded into the totals when they are read (or every
        ``_PIPE_FOLD``)."""
        q = self._ops
        q.append((kind, route, nbytes, elapsed_ns))
        if len(q) >= _PIPE_FOLD:
            with self._lock:
                self._fold_queued()

    def record_latency(self, kind: str, elapsed_ns: int, route: str = MIXED_ROUTE) -> None:
        self.record_latencies(kind, [elapsed_ns], route)

    def record_latencies(self, kind: str, samples_ns: list[int], route: str = MIXED_ROUTE) -> None:
        """Latency samples of one op kind and route under one lock (xcopy's ranges done inline)."""
        if not samples_ns:
            return
        with self._lock:
            self._add_samples((kind, route), samples_ns)

    def count_error(self, kind: str) -> None:
        """Count one outcome of ``ERROR_KINDS`` (the runtime calls it where it raises them)."""
        with self._lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def count_delta(self, **amounts: float) -> None:
        """Add ``amounts`` to the delta counters (keys of ``DELTA_KEYS``)."""
        with self._lock:
            d = self._deltas
            for k, v in amounts.items():
                d[k] += v

    def record_sections(self, blocked_s: float) -> None:
        """Count one committed write section and the seconds its open waited for pins."""
        with self._lock:
            self._sections[0] += 1
            self._sections[1] += float(blocked_s)

    def record_pipeline(self, delivered: int, bytes_moved: int, move_s: float, caller_wait_s: float,
                        ready_wait_s: float, overlap_ratio: float, first_tile_s: float | None) -> None:
        """Add one finished pipeline's figures (those of its ``PipelineStats``): tiles delivered,
        bytes moved, seconds moving, the caller's seconds waiting for tiles and for ready words,
        the overlap ratio, and the first tile's latency in seconds (None: no tile was
        delivered), also a ``pipeline_first_tile`` latency sample. Takes no lock: the figures
        are queued and folded into the totals when they are read (or every ``_PIPE_FOLD``)."""
        q = self._pipes
        q.append((delivered, bytes_moved, move_s, caller_wait_s, ready_wait_s, overlap_ratio, first_tile_s))
        if len(q) >= _PIPE_FOLD:
            with self._lock:
                self._fold_queued()

    def _fold_queued(self) -> None:
        """Fold the queued operations' and pipelines' figures into the totals (the caller holds
        the lock): column sums, and each kind's latencies into its histogram at once (one
        bincount), so a queued record's share of a fold is a few hundred nanoseconds."""
        samples: dict[tuple[str, str], list[int]] = {}
        for kind, route, nbytes, ns in _drain(self._ops):
            c = self._routes.setdefault(route, [0, 0])
            c[0] += 1
            c[1] += nbytes
            lst = samples.get((kind, route))
            if lst is None:
                lst = samples[(kind, route)] = []
            lst.append(ns)
        pipes = _drain(self._pipes)
        if pipes:
            p = self.pipelines
            delivered, moved, move_s, wait_s, ready_s, ov, first = zip(*pipes)
            p["count"] += len(pipes)
            p["tiles"] += sum(delivered)
            p["bytes_moved"] += sum(moved)
            p["move_s"] += sum(move_s)
            p["caller_wait_s"] += sum(wait_s)
            p["ready_wait_s"] += sum(ready_s)
            p["overlap_ratio"] = ov[-1]
            firsts = [f for f in first if f is not None]
            if firsts:
                p["first_tile_s"] = firsts[-1]
                samples[("pipeline_first_tile", MIXED_ROUTE)] = [int(f * 1e9) for f in firsts]
        for key, ns in samples.items():
            self._add_samples(key, ns)

    def _add_samples(self, key: tuple[str, str], samples_ns: list[int]) -> None:
        """Latency samples (ns) of one op kind and route into its histogram and sum (the caller
        holds the lock)."""
        bucket = native.lib.memsem_lat_bucket
        ns = [max(0, int(x)) for x in samples_ns]
        h = self._hist.get(key)
        if h is None:
            h = self._hist[key] = np.zeros(_NB, np.int64)
        if len(ns) == 1:
            h[bucket(ns[0])] += 1  # one sample (one xcopy range): no ufunc machinery
        else:
            h += np.bincount([bucket(x) for x in ns], minlength=_NB)
        self._sum[key] = self._sum.get(key, 0) + sum(ns)

    # -- reading ----------------------------------------------------------------------------------
    def _sums(self) -> tuple[dict[str, list[int]], dict[tuple[str, str], np.ndarray], dict[tuple[str, str], int]]:
        with self._lock:
            self._fold_queued()
            routes = {k: list(v) for k, v in self._routes.items()}
            hist = {k: v.copy() for k, v in self._hist.items()}
            sums = dict(self._sum)
            live = [r for r in (w() for w in self._live.values()) if r is not None]
        for res in live:
            ops, nbytes, h, t = _plan_counts(res.plan)
            c = routes.setdefault(res.route.kind, [0, 0])
            c[0] += ops
            c[1] += nbytes
            for k, hh, tt in zip(("get", "put"), h, t):
                key = (k, res.route.kind)
                if key in hist:
                    hist[key] += hh.astype(np.int64)
                else:
                    hist[key] = hh.astype(np.int64)
                sums[key] = sums.get(key, 0) + tt
        return routes, hist, sums

    @property
    def bytes_by_route(self) -> dict[str, int]:
        return {r: c[1] for r, c in self._sums()[0].items()}

    @property
    def ops_by_route(self) -> dict[str, int]:
        return {r: c[0] for r, c in self._sums()[0].items()}

    def snapshot(self, windows: int, leases: int = 0, resolutions: int = 0) -> Stats:
        routes, hist, sums = self._sums()
        by_kind: dict[str, np.ndarray] = {}
        sum_kind: dict[str, int] = {}
        by_route: dict[str, dict[str, dict[str, Any]]] = {}
        for (kind, route), h in sorted(hist.items()):
            if not h.any():
                continue
            by_kind[kind] = by_kind[kind] + h if kind in by_kind else h.copy()
            sum_kind[kind] = sum_kind.get(kind, 0) + sums.get((kind, route), 0)
            by_route.setdefault(kind, {})[route] = _prometheus_buckets(h, sums.get((kind, route), 0))
        lat = {}
        lat_hist = {}
        for kind, h in by_kind.items():
            lat[kind] = {"p50": _percentile(h, 0.5) / 1e3, "p99": _percentile(h, 0.99) / 1e3,
                         "n": float(h.sum())}
            lat_hist[kind] = _prometheus_buckets(h, sum_kind[kind])
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with self._lock:
            errors = dict(self.errors)
            self._fold_queued()
            pipelines = dict(self.pipelines)
            sections = {"committed": self._sections[0], "blocked_s": self._sections[1]}
            deltas = dict(self._deltas)
        return Stats({r: c[1] for r, c in routes.items()}, {r: c[0] for r, c in routes.items()},
                     self.bounce_bytes, dict(self.registrations), lat, rss, windows, pipelines,
                     errors, leases, resolutions, lat_hist, by_route, sections, self._staleness(), deltas)


def _prometheus_buckets(h: np.ndarray, sum_ns: int) -> dict[str, Any]:
    """A histogram in Prometheus' form: cumulative counts at ``le`` bounds that are lower bounds
    of native buckets (``PROMETHEUS_BUCKETS``, so no native bucket straddles a bound), then +Inf."""
    cum = np.cumsum(h)
    bounds, counts = [], []
    for b in PROMETHEUS_BUCKETS:
        bounds.append(float(BUCKET_FLOOR_NS[b]) / 1e9)
        counts.append(int(cum[b - 1]))
    bounds.append(float("inf"))
    counts.append(int(cum[-1]))
    return {"buckets_s": bounds, "counts": counts, "sum_s": sum_ns / 1e9, "count": int(cum[-1]),
            "overflows": 0}


def _plan_counts(plan: Any) -> tuple[int, int, tuple[np.ndarray, np.ndarray], tuple[int, int]]:
    ops = int(plan.ops[0]) + int(plan.ops[1])
    nbytes = int(plan.bytes[0]) + int(plan.bytes[1])
    lat = np.frombuffer(native.ffi.buffer(plan.lat), np.uint64).reshape(2, _NB).copy()
    return ops, nbytes, (lat[0], lat[1]), (int(plan.lat_sum[0]), int(plan.lat_sum[1]))
