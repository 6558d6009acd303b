"""The Prometheus exporter (memsem.metrics): scraped over HTTP on loopback, counters move; the
exporter, docs/metrics.md and the Grafana dashboard name the same metrics."""
from __future__ import annotations

import json
import pathlib
import re
import urllib.error
import urllib.request
from typing import Any

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
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "memsem_rank")))] = s.value
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
    c0, c2 = (value(s, "memsem_op_latency_seconds_count", op="get", route=route) for s in (before, after))
    assert (c0, c2) == (0, 3)
    inf = value(after, "memsem_op_latency_seconds_bucket", op="get", route=route, le="+Inf")
    assert inf == 3 and value(after, "memsem_op_latency_seconds_sum", op="get", route=route) > 0
    # Buckets are cumulative (monotonic in le), as Prometheus expects.
    bounds = sorted((float(dict(k[1])["le"]), v) for k, v in after.items()
                    if k[0] == "memsem_op_latency_seconds_bucket" and dict(k[1]).get("op") == "get"
                    and dict(k[1]).get("route") == route)
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
    for kind in ("lease_expired", "peer_lost"):
        assert (before.get(("memsem_errors_total", (("kind", kind),))) == 0
                and after.get(("memsem_errors_total", (("kind", kind),))) == 0)
    for kind in ("torn", "busy"):
        assert after.get(("memsem_write_section_retries_total", (("kind", kind),))) == 0


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


def test_a_weight_sync_only_job_leaves_the_pipeline_panel_empty(rt):
    """docs/metrics.md: follow / load / stream feed no pipeline metric (the dashboard's
    Pipelines panel is empty on such a job), while the bytes moved do count."""
    model = {"w": np.zeros(4096, np.float32)}
    sd = rt.publish_state_dict(model, name="policy", slots=2)
    with memsem.Runtime(timeout=10.0) as cons, memsem.metrics.serve(cons) as server:
        local = {"w": np.zeros(4096, np.float32)}
        follower = cons.follow("policy", into=local, timeout=10)
        assert next(follower)[0] == 1
        sd.update({"w": np.ones(4096, np.float32)})
        assert next(follower)[0] == 2 and (local["w"] == 1).all()
        follower.close()
        rsd = cons.lookup_state_dict("policy", timeout=10)
        for bucket in rsd.stream({"w": np.zeros(4096, np.float32)}):
            pass
        after = scrape(server.url)
    assert sum(v for (n, _), v in after.items() if n == "memsem_bytes_total") >= 3 * 4 * 4096
    for name in ("memsem_pipeline_tiles_total", "memsem_pipeline_bytes_total", "memsem_pipelines_total",
                 "memsem_pipeline_first_tile_seconds_count"):
        assert value(after, name) == 0, name
    assert not any(n == "memsem_pipeline_overlap_ratio" for n, _ in after)  # no sample at all


def test_follower_staleness_per_name(rt):
    """Per followed name: the version the follower holds, the writer's latest, their difference
    and the seconds since the last load; gone once the follower is closed."""
    model = {"w": np.zeros(64, np.float32)}
    sd = rt.publish_state_dict(model, name="policy", slots=2)
    with memsem.Runtime(timeout=10.0) as cons, memsem.metrics.serve(cons) as server:
        follower = cons.follow("policy", timeout=10)
        assert next(follower)[0] == 1
        for _ in range(2):
            model["w"] += 1
            sd.update(model)  # the follower does not load these (yet)
        behind = scrape(server.url)
        assert next(follower)[0] == 3
        caught_up = scrape(server.url)
        assert cons.stats().followers["policy"]["lag"] == 0
        follower.close()
        closed = scrape(server.url)
    def of(samples, metric):  # the sample of the name "policy" (None: no sample)
        return samples.get((metric, (("name", "policy"),)))

    figures = ("memsem_follower_version", "memsem_follower_latest_version", "memsem_follower_lag_versions")
    assert [of(behind, f) for f in figures] == [1, 3, 2]
    assert [of(caught_up, f) for f in figures] == [3, 3, 0]
    since = [of(s, "memsem_follower_seconds_since_load") for s in (behind, caught_up)]
    assert all(x is not None and x >= 0 for x in since)
    assert not [k for k in closed if k[0].startswith("memsem_follower_")]


def test_own_registry_and_a_closed_runtime_stops_cleanly():
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    rt = memsem.Runtime(timeout=10.0)
    col = memsem.metrics.collector(rt, labels={"job": "rollout"})
    reg.register(col)
    text = generate_latest(reg).decode()
    assert 'memsem_runtime_open{job="rollout",memsem_rank="' in text
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
    for name in ("route", "memsem_rank", "kind", "le", "name"):
        with pytest.raises(ValueError, match="label"):
            memsem.metrics.collector(rt, labels={name: "x"})
    with pytest.raises(ValueError, match="label"):
        memsem.metrics.collector(rt, labels={"bad-name": "x"})


def test_a_refused_label_says_what_is_wrong_with_it(rt):
    """A hyphen is the problem of ``bad-label`` (not the reserved names); a reserved name is
    refused as one memsem sets."""
    with pytest.raises(ValueError) as info:
        memsem.metrics.collector(rt, labels={"bad-label": "x"})
    msg = str(info.value)
    assert "'bad-label' is not a valid Prometheus label name" in msg and "'-' at position 3" in msg
    assert "'bad_label'" in msg and "memsem sets" not in msg
    with pytest.raises(ValueError, match="starts with a digit"):
        memsem.metrics.collector(rt, labels={"9lives": "x"})
    with pytest.raises(ValueError, match="'route' is a label memsem sets itself"):
        memsem.metrics.collector(rt, labels={"route": "x"})
    with pytest.raises(TypeError, match="must be a str"):
        memsem.metrics.collector(rt, labels={3: "x"})


def test_a_port_in_use_is_a_memsem_error_naming_it(rt):
    with memsem.metrics.serve(rt) as first:
        with pytest.raises(memsem.AddressInUseError) as info:
            memsem.metrics.serve(rt, port=first.port)
        assert value(scrape(first.url), "memsem_runtime_open") == 1  # the first one serves on
    exc = info.value
    assert isinstance(exc, memsem.MemsemError) and isinstance(exc, OSError)
    assert exc.port == first.port and exc.addr == "127.0.0.1" and exc.errno == __import__("errno").EADDRINUSE
    assert f"port {first.port} on 127.0.0.1 is in use" in str(exc) and "port=0" in str(exc)
    assert isinstance(exc.__cause__, OSError)


def test_the_jobs_own_rank_label_is_free(rt):
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    reg.register(memsem.metrics.collector(rt, labels={"rank": "3", "job": "rollout"}))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    (sample,) = fams["memsem_runtime_open"].samples
    assert sample.labels == {"memsem_rank": str(rt.rank), "rank": "3", "job": "rollout"}


def test_a_deliberate_short_wait_is_a_timeout_not_an_error(rt):
    sd = rt.publish_state_dict({"w": np.zeros(16, np.float32)}, name="policy", slots=2)
    with memsem.Runtime(timeout=10.0) as cons, memsem.metrics.serve(cons) as server:
        rsd = memsem.StateDictRef.from_bytes(sd.to_bytes(), cons)
        v = rsd.load({"w": np.zeros(16, np.float32)})
        before = scrape(server.url)
        for _ in range(3):  # a follower polling for the next version
            with pytest.raises(memsem.MemsemTimeoutError):
                rsd.wait_version(v + 1, timeout=0.01)
        after = scrape(server.url)
    assert value(after, "memsem_wait_timeouts_total") - value(before, "memsem_wait_timeouts_total") == 3
    errors = {k: n for k, n in after.items() if k[0] == "memsem_errors_total"}
    assert errors and all(n == 0 for n in errors.values()), errors
    assert {dict(k[1])["kind"] for k in errors} == set(memsem.metrics.ERROR_KINDS)


def test_write_sections_and_writer_blocked_seconds(rt):
    model = {"w": np.zeros(64, np.float32)}
    with memsem.metrics.serve(rt) as server:
        sd = rt.publish_state_dict(model, name="policy", slots=2)
        before = scrape(server.url)
        for step in range(3):
            model["w"] += 1
            sd.update(model)
        after = scrape(server.url)
    assert value(after, "memsem_write_sections_total") - value(before, "memsem_write_sections_total") == 3
    # nobody pinned a version: the trainer was never blocked
    assert value(after, "memsem_writer_blocked_seconds_total") == 0


# -- the exporter, docs/metrics.md and the Grafana dashboard agree ---------------------------------

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "metrics.md").read_text()
#: labels Prometheus adds to every scraped series (target labels), usable in queries
TARGET_LABELS = {"job", "instance"}


def _exercised_families():
    """Every family the exporter emits, after a workload that gives each of them samples."""
    from prometheus_client import CollectorRegistry, generate_latest

    with memsem.Runtime(timeout=10.0) as owner, memsem.Runtime(timeout=10.0) as cons:
        reg = CollectorRegistry()
        reg.register(memsem.metrics.collector(cons))
        reg.register(memsem.metrics.collector(owner, labels={"side": "owner"}))
        data = np.arange(1 << 14, dtype=np.uint8)
        ref = owner.publish(data)
        cref = cons.ref(ref.to_bytes())
        cref.get()
        with cons.pipeline(cref, tile_bytes=1 << 12, depth=2, zero_copy=False) as p:
            for tile in p:
                with tile:
                    pass
        lease = cref.lease(ttl=30.0).acquire()
        sd = owner.publish_state_dict({"w": np.zeros(8, np.float32)}, name="policy", slots=2)
        sd.update({"w": np.ones(8, np.float32)})
        follower = cons.follow("policy", timeout=10)
        next(follower)
        text = generate_latest(reg).decode()
        follower.close()
        lease.release()
    fams: dict[str, Any] = {}
    for f in text_string_to_metric_families(text):  # one family per collector: merge them
        if f.name in fams:
            assert (fams[f.name].type, fams[f.name].documentation) == (f.type, f.documentation)
            fams[f.name].samples += f.samples
        else:
            fams[f.name] = f
    return fams


def _doc_table() -> dict[str, tuple[str, set[str], str]]:
    rows = {}
    for line in DOC.splitlines():
        m = re.match(r"^\| `(memsem_\w+)` \| (\w+) \| ([^|]*) \| (.*) \|$", line)
        if m:
            labels = set(re.findall(r"`(\w+)`", m.group(3)))
            rows[m.group(1)] = (m.group(2), labels, m.group(4).replace("`", ""))
    return rows


def test_docs_list_exactly_what_the_exporter_emits():
    fams = _exercised_families()
    docs = _doc_table()
    emitted = {}
    for f in fams.values():
        shown = f.name + "_total" if f.type == "counter" else f.name
        labels = set()
        for s in f.samples:
            labels |= set(s.labels)
        assert f.samples, f"{shown}: no samples after the workload"
        emitted[shown] = (f.type, labels - {"memsem_rank", "side", "le"}, f.documentation)
    assert sorted(docs) == sorted(emitted)
    for name, want in emitted.items():
        assert docs[name] == want, f"docs/metrics.md row of {name}: {docs[name]} != exporter {want}"
    # the families memsem_rank and the caller's labels are on every sample
    for f in fams.values():
        assert all("memsem_rank" in s.labels for s in f.samples), f.name


def test_documented_buckets_are_the_emitted_ones():
    block = DOC.split("## Histogram buckets", 1)[1].split("```", 2)[1]
    documented = block.split()
    fams = _exercised_families()
    for name in ("memsem_op_latency_seconds", "memsem_pipeline_first_tile_seconds"):
        les = []
        for s in fams[name].samples:
            if s.name.endswith("_bucket") and s.labels.get("le") not in les:
                les.append(s.labels["le"])
        assert [float(x) for x in les] == [float(x) for x in documented], name
    assert float(documented[0]) == 1.024e-06 and documented[-1] == "+Inf"


def test_grafana_dashboard_queries_only_emitted_metrics_and_labels():
    dash = json.loads((ROOT / "docs" / "grafana" / "memsem.json").read_text())
    fams = _exercised_families()
    samples: dict[str, set[str]] = {}  # sample name -> its labels
    for f in fams.values():
        for s in f.samples:
            samples.setdefault(s.name, set()).update(s.labels)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert len(exprs) >= 10
    used = set()
    for expr in exprs:
        for name in re.findall(r"\bmemsem_[a-z_]+\b", expr):
            if name == "memsem_rank":
                continue
            assert name in samples, f"dashboard queries {name}, which the exporter never emits: {expr}"
            used.add(name)
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                owners = [n for n in re.findall(r"\bmemsem_[a-z_]+\b", expr) if n in samples]
                assert all(label in samples[n] for n in owners), f"label {label!r} of {expr}"
        for label in re.findall(r"(\w+)=~?\"", expr):
            assert label in TARGET_LABELS | {"memsem_rank"}, f"{label} in {expr}"
    # every documented metric is on the dashboard
    for name, (kind, _, _) in _doc_table().items():
        shown = {name + "_bucket"} if kind == "histogram" else {name}
        assert shown & used, f"{name} has no panel on the dashboard"
