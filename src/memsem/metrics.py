"""Prometheus exporter of a runtime's telemetry (needs ``prometheus_client``: from the memsem
checkout ``pip install '.[metrics]'``).

Opt-in and off the hot path: a custom collector reads ``Runtime.stats()`` snapshots when it is
scraped; nothing is counted twice and a get/put does no more work because an exporter exists.

Two ways in::

    server = memsem.metrics.serve(rt, port=9464)      # own HTTP server, loopback by default
    ...                                               # curl http://127.0.0.1:9464/metrics
    server.close()

    from prometheus_client import REGISTRY            # or your own registry / server / push
    REGISTRY.register(memsem.metrics.collector(rt, labels={"rank": "3"}))

Every metric carries ``memsem_rank`` (the runtime's rank in memsem's directory, which is not the
training job's rank) plus the ``labels`` given, e.g. the job's own ``rank``. The metrics, their
labels, help texts and histogram buckets are listed in docs/metrics.md (a test holds the two
equal); a ready Grafana dashboard is docs/grafana/memsem.json.

A collector holds its runtime weakly; once the runtime is closed (or gone) a scrape returns only
``memsem_runtime_open 0``: it never raises and never keeps the runtime alive.
"""
from __future__ import annotations

import errno
import re
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from memsem import _args
from memsem._errors import AddressInUseError

try:
    from prometheus_client.core import (
        CollectorRegistry,
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.exposition import start_http_server
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("memsem.metrics needs prometheus_client: pip install 'prometheus_client>=0.20'") from exc

__all__ = ["FAMILIES", "MetricsServer", "RuntimeCollector", "collector", "serve"]


def _fmt_bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


#: ``Stats.errors`` kinds that are errors raised to a caller (``memsem_errors_total``)
ERROR_KINDS = ("stale", "lease_expired", "peer_lost")
#: ``Stats.errors`` kinds that count copy attempts meeting an owner's open write section
SECTION_RETRY_KINDS = ("torn", "busy")

#: the label memsem sets on every metric (the runtime's directory rank)
RANK_LABEL = "memsem_rank"
#: a Prometheus label name (https://prometheus.io/docs/concepts/data_model/): ASCII letters,
#: digits and underscores, not starting with a digit; names starting with ``__`` are Prometheus'
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _check_label(name: Any, reserved: set[str]) -> None:
    """Raise TypeError / ValueError naming ``name`` and what is wrong with it as an extra label."""
    if not isinstance(name, str):
        raise TypeError(f"labels: a label name must be a str, got {name!r}")
    if not _LABEL_NAME.fullmatch(name):
        bad = next((f"{c!r} at position {i}" for i, c in enumerate(name)
                    if not (c.isascii() and (c.isalnum() or c == "_"))), None)
        why = (f"it has {bad}" if bad else "it is empty" if not name else "it starts with a digit")
        raise ValueError(f"labels: {name!r} is not a valid Prometheus label name ({why}): a label name is "
                         "ASCII letters, digits and underscores, not starting with a digit, e.g. "
                         f"{re.sub(r'[^a-zA-Z0-9_]', '_', name).lstrip('0123456789') or 'rank'!r}")
    if name.startswith("__"):
        raise ValueError(f"labels: {name!r} starts with '__', which Prometheus reserves for its own labels")
    if name in reserved:
        raise ValueError(f"labels: {name!r} is a label memsem sets itself (memsem sets "
                         f"{', '.join(sorted(reserved))}): choose another name")

#: name (without prefix) -> (type, labels, help); the one list the collector emits and
#: docs/metrics.md shows (tests/test_metrics.py compares them)
FAMILIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "runtime_open": ("gauge", (), "1 while the runtime is open, then 0"),
    "bytes": ("counter", ("route",), "Bytes moved per route, both directions"),
    "ops": ("counter", ("route",), "Operations per route"),
    "bounce_bytes": ("counter", (), "Bytes copied through an intermediate (bounce) buffer"),
    "op_latency_seconds": ("histogram", ("op", "route"),
                           "Latency of get, put, xcopy and view operations, per route (xcopy: route mixed)"),
    "pipeline_first_tile_seconds": ("histogram", (), "First-tile latency of pipelines"),
    "pipeline_overlap_ratio": ("gauge", (), "Overlap ratio of the last pipeline (0: none, 1: all of the move hidden)"),
    "pipeline_tiles": ("counter", (), "Tiles delivered by pipelines"),
    "pipeline_bytes": ("counter", (), "Bytes moved by pipelines"),
    "pipeline_caller_wait_seconds": ("counter", (), "Seconds callers waited for tiles"),
    "pipelines": ("counter", (), "Pipelines run"),
    "leases_held": ("gauge", (), "Leases this runtime holds now"),
    "windows_published": ("gauge", (), "Windows this runtime owns now"),
    "errors": ("counter", ("kind",),
               "Errors raised to callers: stale (StaleReferenceError), lease_expired (LeaseExpiredError), "
               "peer_lost (PeerLostError)"),
    "wait_timeouts": ("counter", (),
                      "Waits that ended at their timeout (MemsemTimeoutError), deliberate short waits included"),
    "write_section_retries": ("counter", ("kind",),
                              "Copy attempts that met an open write section of the owner: torn (the copy raced "
                              "it and was retried), busy (the reader waited for it to close); each attempt counts"),
    "write_sections": ("counter", (), "Write sections committed on this runtime's windows"),
    "writer_blocked_seconds": ("counter", (),
                               "Seconds write sections on this runtime's windows waited for readers' pins "
                               "(a trainer's time blocked by rollouts)"),
    "follower_version": ("gauge", ("name",),
                         "Version a follower of the name holds: the last it loaded (the furthest behind when "
                         "several follow it; 0 before its first load)"),
    "follower_latest_version": ("gauge", ("name",), "Latest version the name's writer committed, read at the scrape"),
    "follower_lag_versions": ("gauge", ("name",), "Versions a follower of the name is behind its writer (latest - held)"),
    "follower_seconds_since_load": ("gauge", ("name",), "Seconds since a follower of the name last loaded a version"),
    "registrations": ("counter", ("engine",), "Regions registered with engines"),
    "peak_rss_bytes": ("gauge", (), "Peak resident set size of the process"),
}

_FAMILY_TYPES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}


class RuntimeCollector(Collector):
    """A ``prometheus_client`` collector of one runtime's ``stats()``.

    Args:
        runtime: a :class:`memsem.Runtime` (held weakly).
        labels: extra constant labels (e.g. ``{"rank": "3", "job": "rollout"}``: the training
            job's own rank is free to use); names must be valid Prometheus label names and not
            one memsem sets (``memsem_rank``, ``route``, ``op``, ``kind``, ``engine``, ``name``,
            ``le``).
        prefix: metric name prefix (default ``memsem``).
    """

    _RESERVED = {RANK_LABEL, "route", "op", "kind", "engine", "name", "le"}

    def __init__(self, runtime: Any, *, labels: Mapping[str, str] | None = None, prefix: str = "memsem") -> None:
        if not callable(getattr(runtime, "stats", None)):
            raise TypeError(f"runtime must be a memsem Runtime, got {type(runtime).__name__}")
        extra = dict(labels or {})
        for k, v in extra.items():
            _check_label(k, self._RESERVED)
            if not isinstance(v, str):
                raise TypeError(f"labels[{k!r}] must be a str, got {v!r}")
        if not isinstance(prefix, str) or not prefix.isidentifier():
            raise ValueError(f"prefix must be a valid metric name prefix, got {prefix!r}")
        self._rt = weakref.ref(runtime)
        self._rank = str(getattr(runtime, "rank", ""))
        self._label_names = [RANK_LABEL, *extra]
        self._label_values = [self._rank, *extra.values()]
        self._prefix = prefix

    def _family(self, name: str) -> Any:
        kind, labels, doc = FAMILIES[name]
        return _FAMILY_TYPES[kind](f"{self._prefix}_{name}", doc, labels=self._label_names + list(labels))

    def describe(self) -> Iterator[Any]:
        return iter(())  # described by collect(): registering never runs a snapshot

    def collect(self) -> Iterator[Any]:
        rt = self._rt()
        values = self._label_values
        up = self._family("runtime_open")
        if rt is None or getattr(rt, "closed", True):
            up.add_metric(values, 0)
            yield up
            return
        st = rt.stats()
        up.add_metric(values, 1)
        yield up

        def single(name: str, value: float | None) -> Any:
            f = self._family(name)
            if value is not None:
                f.add_metric(values, value)
            return f

        def by(name: str, items: Mapping[str, float]) -> Any:
            f = self._family(name)
            for key, n in sorted(items.items()):
                f.add_metric(values + [key], n)
            return f

        yield by("bytes", st.bytes_by_route)
        yield by("ops", st.ops_by_route)
        yield single("bounce_bytes", st.bounce_bytes)

        def buckets(h: Mapping[str, Any]) -> list[tuple[str, float]]:
            return [(_fmt_bound(le), c) for le, c in zip(h["buckets_s"], h["counts"])]

        lat = self._family("op_latency_seconds")
        for op, routes in sorted(st.latency_histograms_by_route.items()):
            if op == "pipeline_first_tile":
                continue
            for route, h in sorted(routes.items()):
                lat.add_metric(values + [op, route], buckets(h), h["sum_s"])
        yield lat
        first = self._family("pipeline_first_tile_seconds")
        h = st.latency_histograms.get("pipeline_first_tile")
        if h is not None:
            first.add_metric(values, buckets(h), h["sum_s"])
        yield first

        p = st.pipelines
        yield single("pipeline_overlap_ratio", float(p.get("overlap_ratio", 0.0)) if p.get("count") else None)
        for key, name in (("tiles", "pipeline_tiles"), ("bytes_moved", "pipeline_bytes"),
                          ("caller_wait_s", "pipeline_caller_wait_seconds"), ("count", "pipelines")):
            yield single(name, float(p.get(key, 0.0)))

        yield single("leases_held", st.leases_held if st.leases_held >= 0 else None)
        yield single("windows_published", st.windows_published)
        yield by("errors", {k: st.errors.get(k, 0) for k in ERROR_KINDS})
        yield single("wait_timeouts", st.errors.get("timeout", 0))
        yield by("write_section_retries", {k: st.errors.get(k, 0) for k in SECTION_RETRY_KINDS})
        ws = st.write_sections
        yield single("write_sections", ws.get("committed", 0))
        yield single("writer_blocked_seconds", ws.get("blocked_s", 0.0))
        follows = st.followers
        for key, name in (("held", "follower_version"), ("latest", "follower_latest_version"),
                          ("lag", "follower_lag_versions"), ("since_load_s", "follower_seconds_since_load")):
            yield by(name, {n: f[key] for n, f in follows.items() if key in f})
        yield by("registrations", st.registrations)
        yield single("peak_rss_bytes", st.peak_rss_bytes)


def collector(runtime: Any, *, labels: Mapping[str, str] | None = None, prefix: str = "memsem") -> RuntimeCollector:
    """A collector of ``runtime``'s telemetry, for a registry you own (see :class:`RuntimeCollector`)."""
    return RuntimeCollector(runtime, labels=labels, prefix=prefix)


class MetricsServer:
    """An HTTP server exposing one runtime's metrics at ``/metrics`` (any path answers).

    Attributes:
        port: the TCP port it listens on (the one chosen when ``port=0`` was asked).
        addr: the address it is bound to.
        registry: its own ``CollectorRegistry`` (only this runtime's collector).
    """

    def __init__(self, runtime: Any, *, port: int, addr: str, labels: Mapping[str, str] | None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RuntimeCollector(runtime, labels=labels))
        try:
            self._httpd, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise AddressInUseError(
                f"memsem.metrics.serve: port {port} on {addr} is in use (another exporter or process "
                f"listens there; `ss -ltnp 'sport = :{port}'` names it): pass another port, or port=0 "
                "to pick a free one (server.port says which)", addr=addr, port=port) from exc
        self.addr = addr
        self.port = int(self._httpd.server_address[1])
        self._lock = threading.Lock()
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket. Safe twice."""
        t = _args.timeout(timeout, "timeout")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(t)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<MetricsServer {self.url}{' closed' if self._closed else ''}>"


def serve(runtime: Any, port: int = 0, addr: str = "127.0.0.1", *,
          labels: Mapping[str, str] | None = None) -> MetricsServer:
    """Serve ``runtime``'s metrics over HTTP in Prometheus' text format, from a daemon thread.

    Args:
        runtime: a :class:`memsem.Runtime`.
        port: TCP port; 0 picks a free one (read it from ``server.port``).
        addr: address to bind; loopback by default (metrics name windows and routes: expose them
            beyond the host deliberately, e.g. ``addr="0.0.0.0"``).
        labels: extra constant labels for every metric.

    Returns:
        A :class:`MetricsServer` (``.port``, ``.url``, ``.close()``, ``with`` support).

    Raises:
        AddressInUseError: ``port`` on ``addr`` is taken (a MemsemError and an OSError; its
            message says what to do). OSError: the port cannot be bound for another reason
            (e.g. a port below 1024 without the privilege). TypeError / ValueError: bad argument
            (a label name that is not a valid Prometheus label name or one memsem sets).
    """
    port = _args.count(port, "port", maximum=65535)
    if not isinstance(addr, str) or not addr:
        raise TypeError(f"addr must be a host address string, got {addr!r}")
    return MetricsServer(runtime, port=port, addr=addr, labels=labels)
