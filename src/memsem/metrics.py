"""Prometheus exporter of a runtime's telemetry (extra ``memsem[metrics]``: ``prometheus_client``).

Opt-in and off the hot path: a custom collector reads ``Runtime.stats()`` snapshots when it is
scraped; nothing is counted twice and a get/put does no more work because an exporter exists.

Two ways in::

    server = memsem.metrics.serve(rt, port=9464)      # own HTTP server, loopback by default
    ...                                               # curl http://127.0.0.1:9464/metrics
    server.close()

    from prometheus_client import REGISTRY            # or your own registry / server / push
    REGISTRY.register(memsem.metrics.collector(rt))

Metrics (all carry the label ``rank``, the runtime's rank, plus any ``labels`` given):

==========================================  =========  ==========================================
``memsem_bytes_total{route}``               counter    bytes moved per route (``host/shm``, ...)
``memsem_ops_total{route}``                 counter    operations per route
``memsem_bounce_bytes_total``               counter    bytes copied through a bounce buffer
``memsem_op_latency_seconds{op}``           histogram  get / put / xcopy / view latency
``memsem_pipeline_first_tile_seconds``      histogram  first-tile latency of pipelines
``memsem_pipeline_overlap_ratio``           gauge      overlap of the last pipeline (0..1)
``memsem_pipeline_tiles_total``             counter    tiles delivered by pipelines
``memsem_pipeline_bytes_total``             counter    bytes moved by pipelines
``memsem_pipeline_caller_wait_seconds_total``  counter time callers waited for tiles
``memsem_leases_held``                      gauge      leases this runtime holds now
``memsem_windows_published``                gauge      windows this runtime owns now
``memsem_errors_total{kind}``               counter    stale / torn / lease_expired / peer_lost
``memsem_registrations_total{engine}``      counter    regions registered per engine
``memsem_peak_rss_bytes``                   gauge      the process's peak resident set size
``memsem_runtime_open``                     gauge      1 while the runtime is open, then 0
==========================================  =========  ==========================================

A collector holds its runtime weakly; once the runtime is closed (or gone) a scrape returns only
``memsem_runtime_open 0``: it never raises and never keeps the runtime alive.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from memsem import _args

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
    raise ImportError("memsem.metrics needs prometheus_client: pip install 'memsem[metrics]'") from exc

__all__ = ["MetricsServer", "RuntimeCollector", "collector", "serve"]


def _fmt_bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


class RuntimeCollector(Collector):
    """A ``prometheus_client`` collector of one runtime's ``stats()``.

    Args:
        runtime: a :class:`memsem.Runtime` (held weakly).
        labels: extra constant labels (e.g. ``{"job": "rollout"}``); names must be valid
            Prometheus label names and not ``rank``, ``route``, ``op``, ``kind`` or ``engine``.
        prefix: metric name prefix (default ``memsem``).
    """

    _RESERVED = {"rank", "route", "op", "kind", "engine", "le"}

    def __init__(self, runtime: Any, *, labels: Mapping[str, str] | None = None, prefix: str = "memsem") -> None:
        if not callable(getattr(runtime, "stats", None)):
            raise TypeError(f"runtime must be a memsem Runtime, got {type(runtime).__name__}")
        extra = dict(labels or {})
        for k, v in extra.items():
            if not isinstance(k, str) or not k.isidentifier() or k.startswith("__") or k in self._RESERVED:
                raise ValueError(f"labels: {k!r} is not a free Prometheus label name")
            if not isinstance(v, str):
                raise TypeError(f"labels[{k!r}] must be a str, got {v!r}")
        if not isinstance(prefix, str) or not prefix.isidentifier():
            raise ValueError(f"prefix must be a valid metric name prefix, got {prefix!r}")
        self._rt = weakref.ref(runtime)
        self._rank = str(getattr(runtime, "rank", ""))
        self._label_names = ["rank", *extra]
        self._label_values = [self._rank, *extra.values()]
        self._prefix = prefix

    def _name(self, n: str) -> str:
        return f"{self._prefix}_{n}"

    def describe(self) -> Iterator[Any]:
        return iter(())  # described by collect(): registering never runs a snapshot

    def collect(self) -> Iterator[Any]:
        rt = self._rt()
        names, values = self._label_names, self._label_values
        up = GaugeMetricFamily(self._name("runtime_open"), "1 while the runtime is open, then 0", labels=names)
        if rt is None or getattr(rt, "closed", True):
            up.add_metric(values, 0)
            yield up
            return
        st = rt.stats()
        up.add_metric(values, 1)
        yield up

        def counter(name: str, doc: str, extra: list[str] | None = None) -> CounterMetricFamily:
            return CounterMetricFamily(self._name(name), doc, labels=names + (extra or []))

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(self._name(name), doc, labels=names)

        b = counter("bytes", "Bytes moved per route (both directions)", ["route"])
        o = counter("ops", "Operations per route", ["route"])
        for route, n in sorted(st.bytes_by_route.items()):
            b.add_metric(values + [route], n)
        for route, n in sorted(st.ops_by_route.items()):
            o.add_metric(values + [route], n)
        yield b
        yield o
        bb = counter("bounce_bytes", "Bytes copied through an intermediate (bounce) buffer")
        bb.add_metric(values, st.bounce_bytes)
        yield bb

        lat = HistogramMetricFamily(self._name("op_latency_seconds"), "Latency of get/put/xcopy/view operations",
                                    labels=names + ["op"])
        first = HistogramMetricFamily(self._name("pipeline_first_tile_seconds"), "First-tile latency of pipelines",
                                      labels=names)
        for kind, h in sorted(st.latency_histograms.items()):
            buckets = [(_fmt_bound(le), c) for le, c in zip(h["buckets_s"], h["counts"])]
            if kind == "pipeline_first_tile":
                first.add_metric(values, buckets, h["sum_s"])
            else:
                lat.add_metric(values + [kind], buckets, h["sum_s"])
        yield lat
        yield first

        p = st.pipelines
        ov = gauge("pipeline_overlap_ratio", "Overlap ratio of the last pipeline (0: none, 1: full)")
        if p.get("count"):
            ov.add_metric(values, float(p.get("overlap_ratio", 0.0)))
        yield ov
        for key, name, doc in (("tiles", "pipeline_tiles", "Tiles delivered by pipelines"),
                               ("bytes_moved", "pipeline_bytes", "Bytes moved by pipelines"),
                               ("caller_wait_s", "pipeline_caller_wait_seconds", "Seconds callers waited for tiles"),
                               ("count", "pipelines", "Pipelines run")):
            c = counter(name, doc)
            c.add_metric(values, float(p.get(key, 0.0)))
            yield c

        lh = gauge("leases_held", "Leases this runtime holds now")
        if st.leases_held >= 0:
            lh.add_metric(values, st.leases_held)
        yield lh
        wp = gauge("windows_published", "Windows this runtime owns now")
        wp.add_metric(values, st.windows_published)
        yield wp
        err = counter("errors", "Errors raised, by kind (stale, torn, lease_expired, peer_lost)", ["kind"])
        for kind, n in sorted(st.errors.items()):
            err.add_metric(values + [kind], n)
        yield err
        reg = counter("registrations", "Regions registered with engines", ["engine"])
        for eng, n in sorted(st.registrations.items()):
            reg.add_metric(values + [eng], n)
        yield reg
        rss = gauge("peak_rss_bytes", "Peak resident set size of the process")
        rss.add_metric(values, st.peak_rss_bytes)
        yield rss


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
        self._httpd, self._thread = start_http_server(port, addr=addr, registry=self.registry)
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
        OSError: the port cannot be bound. TypeError / ValueError: bad argument.
    """
    port = _args.count(port, "port", maximum=65535)
    if not isinstance(addr, str) or not addr:
        raise TypeError(f"addr must be a host address string, got {addr!r}")
    return MetricsServer(runtime, port=port, addr=addr, labels=labels)
