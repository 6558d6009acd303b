"""The Prometheus exporter (memsem.metrics): scraped over HTTP on loopback, counters move."""
from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import pytest

import memsem

prometheus_client = pytest.importorskip("prometheus_client")  # in the test extra: never skipped in CI
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import memsem.metrics  # noqa: E402


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "rank")))] = s.value
    return out


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_scrape_shows_counters_moving_during_a_get(rt):
    data = np.arange(1 << 16, dtype=np.uint8)
    ref = rt.publish(data)
    with memsem.Runtime(timeout=10.0) as cons, memsem.metrics.serve(cons, port=0) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        cref = cons.ref(ref.to_bytes())
        before = scrape(server.url)
        assert value(before, "memsem_runtime_open") == 1
        assert np.array_equal(cref.get(), data)
        route = cons.route(cref).kind
        mid = scrape(server.url)
        for _ in range(2):
            cref.get()
        after = scrape(server.url)
    b0, b1, b2 = (value(s, "memsem_bytes_total", route=route) for s in (before, mid, after))
    o0, o1, o2 = (value(s, "memsem_ops_total", route=route) for s in (before, mid, after))
    assert (b0, b1, b2) == (0, data.nbytes, 3 * data.nbytes)
    assert (o0, o1, o2) == (0, 1, 3)
    c0, c2 = (value(s, "memsem_op_latency_seconds_count", op="get") for s in (before, after))
    assert (c0, c2) == (0, 3)
    inf = value(after, "memsem_op_latency_seconds_bucket", op="get", le="+Inf")
    assert inf == 3 and value(after, "memsem_op_latency_seconds_sum", op="get") > 0
    # Buckets are cumulative (monotonic in le), as Prometheus expects.
    bounds = sorted((float(dict(k[1])["le"]), v) for k, v in after.items()
                    if k[0] == "memsem_op_latency_seconds_bucket" and dict(k[1]).get("op") == "get")
    assert [v for _, v in bounds] == sorted(v for _, v in bounds)


def test_error_and_lease_counters(rt):
    data = np.zeros(4096, np.uint8)
    ref = rt.publish(data)
    with memsem.Runtime(timeout=10.0) as cons, memsem.metrics.serve(cons) as server:
        cref = cons.ref(ref.to_bytes())
        lease = cref.lease(ttl=30.0).acquire()
        held = scrape(server.url)
        lease.release()
        released = scrape(server.url)
        assert value(held, "memsem_leases_held") == 1 and value(released, "memsem_leases_held") == 0
        cref.get()
        before = scrape(server.url)
        rt.unpublish(ref)
        with pytest.raises(memsem.StaleReferenceError):
            cref.get()
        after = scrape(server.url)
    assert value(before, "memsem_errors_total", kind="stale") == 0
    assert value(after, "memsem_errors_total", kind="stale") >= 1
    for kind in ("torn", "lease_expired", "peer_lost"):
        assert (before.get(("memsem_errors_total", (("kind", kind),))) == 0
                and after.get(("memsem_errors_total", (("kind", kind),))) == 0)


def test_pipeline_metrics(rt):
    data = np.arange(1 << 16, dtype=np.uint8)
    ref = rt.publish(data)
    with memsem.Runtime(timeout=10.0) as cons, memsem.metrics.serve(cons) as server:
        cref = cons.ref(ref.to_bytes())
        before = scrape(server.url)
        got = bytearray()
        with cons.pipeline(cref, tile_bytes=1 << 13, depth=2, zero_copy=False) as p:
            for tile in p:
                with tile:
                    got += tile.array.tobytes()
        after = scrape(server.url)
    assert bytes(got) == data.tobytes()
    assert value(before, "memsem_pipeline_tiles_total") == 0 and value(after, "memsem_pipeline_tiles_total") == 8
    assert value(after, "memsem_pipeline_bytes_total") == data.nbytes
    assert value(after, "memsem_pipeline_first_tile_seconds_count") == 1
    assert 0.0 <= value(after, "memsem_pipeline_overlap_ratio") <= 1.0


def test_own_registry_and_a_closed_runtime_stops_cleanly():
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    rt = memsem.Runtime(timeout=10.0)
    col = memsem.metrics.collector(rt, labels={"job": "rollout"})
    reg.register(col)
    text = generate_latest(reg).decode()
    assert 'memsem_runtime_open{job="rollout",rank="' in text
    assert "memsem_windows_published" in text
    rt.close()
    text = generate_latest(reg).decode()  # never raises after close
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"memsem_runtime_open"}
    assert families["memsem_runtime_open"].samples[0].value == 0
    del rt
    assert generate_latest(reg)  # the runtime is gone: the collector holds it weakly


def test_server_close_stops_serving(rt):
    server = memsem.metrics.serve(rt)
    url = server.url
    assert value(scrape(url), "memsem_runtime_open") == 1
    server.close()
    server.close()  # safe twice
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(url, timeout=5)


@pytest.mark.parametrize("kwargs,exc", [({"port": -1}, ValueError), ({"port": 70000}, ValueError),
                                        ({"port": True}, TypeError), ({"addr": ""}, TypeError)])
def test_serve_arguments_are_checked(rt, kwargs, exc):
    with pytest.raises(exc):
        memsem.metrics.serve(rt, **kwargs)


def test_collector_arguments_are_checked(rt):
    with pytest.raises(TypeError, match="runtime"):
        memsem.metrics.collector(object())
    with pytest.raises(ValueError, match="label"):
        memsem.metrics.collector(rt, labels={"route": "x"})
    with pytest.raises(ValueError, match="label"):
        memsem.metrics.collector(rt, labels={"bad-name": "x"})
