"""Tests of the test infrastructure itself: namespaces + veth, a real Redis across the link,
plain-socket round trips across the link (the tcp engine's baseline), clean teardown, and
measured numbers.

Run:  pytest -s tests/netns          (as root; -s shows the numbers)
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import textwrap
import time

import pytest

import netns
from redis_server import redis_server

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
MiB = 1 << 20


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line of ``proc`` within ``timeout`` s, or fail with its stderr."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        proc.kill()
        raise AssertionError(f"no output within {timeout}s; stderr: {proc.stderr.read()}")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"process exited rc={proc.wait()}; stderr: {proc.stderr.read()}")
    return line


def _ns_exists(name: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return any(line.split()[0] == name for line in out.splitlines() if line.strip())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_probe_returns_reason():
    ok, reason = netns.probe()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    print(f"\nnetns probe: ok={ok} reason={reason}")


@pytest.mark.netns
def test_veth_ping_both_ways(ns_pair):
    a, b = ns_pair
    assert a.addr != b.addr and a.peer_addr == b.addr
    ok, detail = a.ping(b.addr)
    assert ok, detail
    ok, detail = b.ping(a.addr)
    assert ok, detail
    # Each namespace sees only lo and veth0: nothing of the host.
    links = a.run(["ip", "-o", "link"]).stdout
    assert "veth0" in links and links.count("\n") == 2, links


@pytest.mark.netns
def test_namespace_address_not_reachable_from_root(ns_pair):
    a, _ = ns_pair
    route = subprocess.run(["ip", "route", "get", a.addr], capture_output=True, text=True)
    # The root namespace has no route to 10.201.x.0/24 via veth (it may have a default route,
    # but never the veth): the pair is private to the two namespaces.
    assert "veth0" not in route.stdout


@pytest.mark.netns
def test_redis_in_a_reachable_from_b(ns_pair, redis_binary):
    a, b = ns_pair
    with redis_server(ns=a) as srv:
        assert srv.host == a.addr and srv.ns_name == a.name
        assert srv.ping()  # over the unix socket, from the root namespace
        code = textwrap.dedent(f"""
            import redis, json
            r = redis.Redis.from_url({srv.url!r}, socket_timeout=5)
            r.set("memsem:k", b"\\x00value\\xff")
            r.hset("memsem:h", mapping={{"gen": 7, "owner": "node-b"}})
            r.set("memsem:ttl", "x", px=60000)
            print(json.dumps({{"get": r.get("memsem:k").hex(),
                               "h": {{k.decode(): v.decode() for k, v in r.hgetall("memsem:h").items()}},
                               "pttl": r.pttl("memsem:ttl"),
                               "client_addr": r.client_info()["addr"]}}))
        """)
        cp = b.run([PY, "-c", code], timeout=30)
        out = json.loads(cp.stdout)
        assert bytes.fromhex(out["get"]) == b"\x00value\xff"
        assert out["h"] == {"gen": "7", "owner": "node-b"}
        assert 0 < out["pttl"] <= 60000
        assert out["client_addr"].startswith(b.addr + ":")  # the connection came over veth
        # And the value is there when read from ns A itself.
        cp = a.run([PY, "-c", f"import redis; print(redis.Redis.from_url({srv.url!r}).get('memsem:k'))"])
        assert "value" in cp.stdout


def test_redis_on_loopback(redis_binary):
    import redis  # redis-py

    with redis_server() as srv:
        assert srv.host == "127.0.0.1" and srv.ns_name is None
        r = redis.Redis.from_url(srv.url)
        r.set("k", "v")
        assert r.get("k") == b"v"
        assert redis.Redis.from_url(srv.unix_url).get("k") == b"v"
        pid = srv.proc.pid
    assert not _alive(pid)


def test_redis_password(redis_binary):
    import redis

    with redis_server(password="s3cret") as srv:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=srv.host, port=srv.port).ping()
        assert redis.Redis.from_url(srv.url).ping()
        assert srv.ping()


@pytest.mark.netns
def test_teardown_leaves_nothing(netns_available, redis_binary):
    with netns.veth_pair() as (a, b):
        names = (a.name, b.name)
        with redis_server(ns=a) as srv:
            redis_pid = srv.proc.pid
            tmpdir = os.path.dirname(srv.unix_socket)
            assert _alive(redis_pid)
        assert not _alive(redis_pid) and not os.path.exists(tmpdir)
        # A process started in b and never stopped by the test: teardown must kill it.
        sleeper = b.popen(["sleep", "1000"])
        # And one started behind the harness's back (not a Popen it knows): found via netns pids.
        orphan = subprocess.Popen(["ip", "netns", "exec", a.name, "sleep", "1000"],
                                  start_new_session=True)
        time.sleep(0.1)
        assert orphan.pid in a.pids() and sleeper.pid in b.pids()
    assert not any(_ns_exists(n) for n in names)
    assert sleeper.poll() is not None
    orphan.wait(timeout=5)
    # The veth pair went with the namespaces; nothing appeared in the root namespace.
    assert "10.201." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout


@pytest.mark.netns
def test_teardown_on_error(netns_available, redis_binary):
    names = []
    pid = None
    with pytest.raises(ZeroDivisionError):
        with netns.veth_pair() as (a, b):
            names = [a.name, b.name]
            with redis_server(ns=a) as srv:
                pid = srv.proc.pid
                1 / 0
    assert names and not any(_ns_exists(n) for n in names)
    assert pid is not None and not _alive(pid)


def test_cleanup_stale_ignores_live_and_foreign():
    # Only names of the form memsem-*-<deadpid>-* are touched; without root it just lists nothing.
    if not netns.probe()[0]:
        pytest.skip("network namespaces unavailable: " + netns.probe()[1])
    live = f"memsem-a-{os.getpid()}-999"
    subprocess.run(["ip", "netns", "add", live], check=True)
    dead = "memsem-a-999999999-0"
    subprocess.run(["ip", "netns", "add", dead], check=True)
    try:
        removed = netns.cleanup_stale()
        assert dead in removed and live not in removed
        assert _ns_exists(live) and not _ns_exists(dead)
    finally:
        for n in (live, dead):
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


# ---------------------------------------------------------------- plain sockets


def _socket_pair_run(server_ns, client_ns, host, client_args):
    """Start the plain-socket baseline server (memsem_bench.tcp) in server_ns (or here), run
    clients (in client_ns or here), return their JSON results."""
    srv_cmd = [PY, "-m", "memsem_bench.tcp", "--role", "socket-server", "--addr", f"{host}:0"]
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = server_ns.popen(srv_cmd, **kw) if server_ns else subprocess.Popen(srv_cmd, **kw)
    results = []
    try:
        port = json.loads(_readline(server, 30))["port"]
        for i, args in enumerate(client_args):
            cmd = [PY, "-m", "memsem_bench.tcp", "--role", "socket-client", "--addr", f"{host}:{port}", *args]
            if i == len(client_args) - 1:
                cmd.append("--quit")
            cp = (client_ns.run(cmd, timeout=300) if client_ns
                  else subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True))
            results.append(json.loads(cp.stdout.strip().splitlines()[-1]))
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return results


@pytest.mark.netns
def test_socket_roundtrips_across_veth_are_intact(ns_pair):
    a, b = ns_pair
    res = _socket_pair_run(a, b, a.addr, [
        ["--size", str(64 * MiB), "--iters", "2"],
        ["--size", str(10 * MiB + 3), "--iters", "2"],
        ["--size", "64", "--iters", "50"],
    ])
    assert all(r["intact"] for r in res), res


def _fmt(r):
    return (f"{r['size']:>9} B  p50 {r['lat_us_p50']:>9.1f} us  min {r['lat_us_min']:>8.1f} us  "
            f"{r['gbps']:.3f} GB/s")


@pytest.mark.netns
@pytest.mark.bench
def test_socket_bench_veth_vs_loopback(ns_pair):
    """64 B latency and 64 MiB throughput of a plain-socket request/response 'get' (the baseline
    the tcp engine is measured against), veth vs loopback."""
    a, b = ns_pair
    lat_iters = os.environ.get("MEMSEM_BENCH_LAT_ITERS", "2000")
    big_iters = os.environ.get("MEMSEM_BENCH_BIG_ITERS", "10")
    clients = [["--size", "64", "--iters", lat_iters], ["--size", str(64 * MiB), "--iters", big_iters]]
    veth = _socket_pair_run(a, b, a.addr, clients)
    loop = _socket_pair_run(None, None, "127.0.0.1", clients)
    print(f"\nplain-socket get over veth ({a.name} -> {b.name}):")
    for r in veth:
        print("  " + _fmt(r))
    print("plain-socket get over loopback (root namespace):")
    for r in loop:
        print("  " + _fmt(r))
    out = os.environ.get("MEMSEM_BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"veth": veth, "loopback": loop}, f, indent=1)
    assert all(r["intact"] for r in veth + loop)


@pytest.mark.netns
def test_setup_timings(netns_available, redis_binary):
    """How long the fixtures cost: namespace pair creation, redis start, teardown."""
    rows = []
    for _ in range(3):
        t0 = time.perf_counter()
        with netns.veth_pair() as (a, b):
            t1 = time.perf_counter()
            with redis_server(ns=a):
                t2 = time.perf_counter()
            t3 = time.perf_counter()
        t4 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    print("\nnetns pair up / redis start+PING / redis stop / netns teardown (ms):")
    for r in rows:
        print("  " + "  ".join(f"{x * 1e3:7.1f}" for x in r))
    assert max(r[0] + r[1] for r in rows) < 10.0
