"""Across nodes: memsem's tcp route against a plain-socket request/response baseline, same run.

Two "nodes" on this machine: a producer and a consumer process with different node ids (so the
route is tcp), joined by a veth pair between two network namespaces when this process may make
them (root, iproute2), else over loopback; the figures say which (``tcp_link``). The directory
is the local one (the namespaces share /dev/shm), so no server is needed.

Figures (medians; GB/s = 1e9 bytes/s):

=========================  ===================================================================
``tcp_get_64B_us``         ``TensorRef.get(out=)`` of 64 B through the whole runtime path
``socket_rtt_64B_us``      one request/response of 64 B on a plain blocking socket (TCP_NODELAY,
                           ``recv_into``), same link, measured interleaved with the above
``tcp_get_64MiB_GBps``     64 MiB get (pipelined chunks, owner-checked)
``socket_64MiB_GBps``      64 MiB answered on a plain socket (``sendall`` / ``recv_into``)
``remote_first_tile_ratio``  first tile of a pipeline (``wait_ready=True``) over a remote
                           256 MiB window in 1 MiB tiles, over one 1 MiB remote get
``socket_rtt_64B_us_loopback``  the same plain-socket round trip to a server process on the
                           consumer's own loopback (veth runs only): where the baseline's swing
                           comes from
``tcp_get_64B_us_one_core``  the 64 B rounds again with owner and consumer on one CPU (and
                           ``socket_rtt_64B_us_one_core``, ``tcp_get_64B_vs_socket_one_core``):
                           a round trip is then the CPU both sides spend on it
``tcp_get_64B_p99_us``     p99 (``_p999_us``: p999) of every 64 B get of those rounds, and
                           ``socket_rtt_64B_p99_us`` / ``_p999_us`` of the socket's; their ratio
                           ``tcp_get_64B_p99_vs_socket_p99`` (``..._p999_vs_socket_p999``)
``tcp_placement``          the CPUs of the main run, e.g. "apart: owner CPU 1, consumer CPU 0";
                           ``tcp_affinity``: the CPUs each process read as its own
``tcp_owner_rss_MiB_1000_idle``  growth of the owner's RSS with 1,000 idle connections (each
                           authenticated and used for one 64 B get, then silent)
``tcp_owner_threads_1000_idle``  the owner process's threads meanwhile
``tcp_owner_rss_MiB_2000_unauth``  growth of the owner's RSS with 2,000 connections that never
                           authenticate (half stall before the hello, half after it)
=========================  ===================================================================

Placement: every process of the owner's side (the memsem owner, the plain-socket servers) runs
on one CPU and the consumer's on another (``placement_cpus("apart")``), the model of two nodes,
each with CPUs of its own. Unpinned, the scheduler placed the two sides per run, and the plain
socket's 64 B round trip here is 13-14 us when both share a core and 55-60 us across two (a
wake-up of the other, idle core): the earlier runs' ratios swung with that (0.30-14), not with
the code.

Ratios (``RATIO_KEYS``) are medians of per-round ratios: the sides run interleaved in rounds of
100 calls (30 rounds quick), the order reversed every other round; ``<key>_spread`` is
``[p10, p90]`` of the per-round ratios, ``<abs key>_spread`` of the per-round medians.

Goals (issues 14, 24; not tests): tcp 64 B get <= 1.3 x the socket round trip; 64 MiB >= 1.0 x
the socket's throughput; remote first tile <= 3 x one tile get (issue 21: the owner's RSS grows by
at most 32 MiB with 1,000 idle connections).

Run alone: ``python -m memsem_bench.tcp [--quick] [--json]``.

One module, over 600 lines, because it is one benchmark: the tcp route and its plain-socket
baseline, producer and consumer roles of one script, and the owner's cost of connections.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

MiB = 1 << 20
SMALL = 64
BIG = 64 * MiB
PIPE_BYTES = 256 * MiB
TILE = 1 * MiB
GOALS = {
    "tcp_get_64B_us": "<= 1.3 x socket_rtt_64B_us",
    "tcp_get_64MiB_GBps": ">= 1.0 x socket_64MiB_GBps",
    "remote_first_tile_ratio": "<= 3",
    "tcp_owner_rss_MiB_1000_idle": "<= 32",
}
KEYS = ("tcp_get_64B_us", "socket_rtt_64B_us", "tcp_get_64MiB_GBps", "socket_64MiB_GBps",
        "remote_first_tile_ratio", "tcp_owner_rss_MiB_1000_idle", "tcp_owner_threads_1000_idle",
        "tcp_owner_rss_MiB_2000_unauth", "tcp_link")
IDLE_CONNECTIONS = 1000
UNAUTH_CONNECTIONS = 2000
#: ratios of rounds (each with a ``<key>_spread`` of [p10, p90]); the socket's own ratio
#: veth / loopback says how much of the baseline is the link
RATIO_KEYS = ("tcp_get_64B_vs_socket", "tcp_get_64B_vs_socket_loopback", "socket_veth_vs_loopback",
              "tcp_get_64MiB_vs_socket", "remote_first_tile_ratio")
#: tails of the 64 B rounds: the p99 (p999) of every tcp get over the socket's, same rounds
TAIL_RATIO_KEYS = ("tcp_get_64B_p99_vs_socket_p99", "tcp_get_64B_p999_vs_socket_p999")
#: every key ``figures`` returns
ALL_KEYS = KEYS + tuple(k for k in RATIO_KEYS if k not in KEYS) + tuple(f"{k}_spread" for k in RATIO_KEYS) + (
    "tcp_get_64B_p99_us", "tcp_get_64B_p999_us", "socket_rtt_64B_p99_us", "socket_rtt_64B_p999_us",
    *TAIL_RATIO_KEYS, *(f"{k}_spread" for k in TAIL_RATIO_KEYS),
    "socket_rtt_64B_us_loopback", "socket_rtt_64B_us_spread", "socket_rtt_64B_us_loopback_spread",
    "tcp_get_64B_us_spread", "tcp_get_64MiB_GBps_spread", "socket_64MiB_GBps_spread", "tcp_placement",
    "tcp_get_64B_us_one_core", "socket_rtt_64B_us_one_core", "tcp_get_64B_vs_socket_one_core",
    "tcp_get_64B_vs_socket_one_core_spread", "tcp_affinity", "tcp_affinity_one_core")
_HDR = struct.Struct("<QQ")
_QUIT = (1 << 64) - 1


# -- the plain-socket baseline -------------------------------------------------------------------------
def socket_server(host: str, port: int, max_bytes: int, ready: Any = None) -> None:
    """Answer ``offset u64 | nbytes u64`` requests with ``nbytes`` bytes of a buffer: the least
    a request/response get can do on a socket (one thread per connection, ``sendall``)."""
    src = bytearray(range(256)) * (max(max_bytes, 256) >> 8)  # byte i is i % 256
    mv = memoryview(src)
    ls = socket.create_server((host, port))
    if ready is not None:
        ready(ls.getsockname()[1])

    def serve(c: socket.socket) -> None:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hb = memoryview(bytearray(16))
        try:
            while True:
                got = 0
                while got < 16:
                    k = c.recv_into(hb[got:])
                    if not k:
                        return
                    got += k
                off, n = _HDR.unpack(hb)
                if n == _QUIT:
                    with contextlib.suppress(OSError):
                        ls.shutdown(socket.SHUT_RDWR)  # wakes the accept below
                    ls.close()
                    return
                c.sendall(mv[off:off + n])
        except OSError:
            return
        finally:
            c.close()

    while True:
        try:
            c, _ = ls.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(c,), daemon=True).start()


class SocketClient:
    """The consumer side of the baseline: one connection, one request in flight."""

    def __init__(self, host: str, port: int) -> None:
        self.s = socket.create_connection((host, port), timeout=30)
        self.s.settimeout(None)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get(self, dst: memoryview, offset: int = 0) -> None:
        n = len(dst)
        self.s.sendall(_HDR.pack(offset, n))
        got = 0
        while got < n:
            k = self.s.recv_into(dst[got:])
            if not k:
                raise EOFError("baseline server closed")
            got += k

    def quit(self) -> None:
        with contextlib.suppress(OSError):
            self.s.sendall(_HDR.pack(0, _QUIT))
        self.s.close()


# -- the two nodes ---------------------------------------------------------------------------------------
def _producer() -> None:
    import numpy as np

    import memsem

    host = os.environ.get("MEMSEM_TCP_HOST", "127.0.0.1")
    _raise_nofile(IDLE_CONNECTIONS + 512)  # the owner serves at most its open-file limit
    with memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=60) as rt:
        small = rt.publish(np.arange(SMALL, dtype=np.uint8), name="bench/small")
        big = rt.publish((np.arange(BIG, dtype=np.uint32) % 251).astype(np.uint8), name="bench/big")
        tile = rt.publish(np.ones(TILE, np.uint8), name="bench/tile")
        pipe = rt.publish(np.zeros(PIPE_BYTES, np.uint8), name="bench/pipe", tile_bytes=TILE)
        for t in range(PIPE_BYTES // TILE):
            pipe.mark_ready(t)
        port_box: list[int] = []
        got = threading.Event()
        threading.Thread(target=socket_server, args=(host, 0, BIG, lambda p: (port_box.append(p), got.set())),
                         daemon=True).start()
        got.wait(30)
        print(json.dumps({"small": small.to_bytes().hex(), "big": big.to_bytes().hex(),
                          "tile": tile.to_bytes().hex(), "pipe": pipe.to_bytes().hex(),
                          "host": host, "socket_port": port_box[0], "pid": os.getpid(),
                          "owner_cpu": os.environ.get("MEMSEM_BENCH_CPU"),
                          "owner_affinity": sorted(os.sched_getaffinity(0)),
                          "link": os.environ.get("MEMSEM_BENCH_LINK", "loopback")}), flush=True)
        sys.stdin.readline()


def socket_client_run(host: str, port: int, size: int, iters: int, quit: bool = False) -> dict[str, Any]:
    """Measure ``iters`` requests of ``size`` bytes against ``socket_server`` (after 10% warm-up):
    median latency, GB/s, and whether every byte arrived intact."""
    c = SocketClient(host, port)
    dst = bytearray(size)
    mv = memoryview(dst)
    for _ in range(max(1, iters // 10)):
        c.get(mv)
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        c.get(mv)
        lat.append(time.perf_counter_ns() - t0)
    intact = dst == bytearray(range(256)) * (size >> 8) + bytearray(range(size & 255))
    if quit:
        c.quit()
    else:
        c.s.close()
    med = statistics.median(lat)
    return {"size": size, "iters": iters, "lat_us_p50": med / 1e3, "lat_us_min": min(lat) / 1e3,
            "gbps": size / med, "intact": bool(intact)}


def _pin_from_env() -> None:
    """This process (every thread it starts after) on the CPU ``MEMSEM_BENCH_CPU`` names."""
    cpu = os.environ.get("MEMSEM_BENCH_CPU")
    if cpu:
        os.sched_setaffinity(0, {int(cpu)})


def placement_cpus(placement: str) -> tuple[int, int] | None:
    """``(owner CPU, consumer CPU)`` for ``placement``, or None (not pinned: fewer than two CPUs
    allowed to this process for "apart", or "none" asked for).

    "apart" (the model of two nodes: each side's processes on a CPU of its own) puts the owner
    on the highest CPU this process may use and the consumer on the lowest; "shared" puts both
    on the lowest (a round trip is then the CPU both sides spend on it, no wake-up of an idle
    core). Unpinned, the scheduler decides per run, and a plain-socket round trip here is
    13-14 us on one core and 55-60 us across two (measured): the baseline then swings with
    placement, not with the code.
    """
    if placement not in ("apart", "shared", "none"):
        raise ValueError(f"placement must be 'apart', 'shared' or 'none', got {placement!r}")
    allowed = sorted(os.sched_getaffinity(0))
    if placement == "none" or (placement == "apart" and len(allowed) < 2):
        return None
    return (allowed[-1] if placement == "apart" else allowed[0]), allowed[0]


def _p10_p90(values: list[float]) -> tuple[float, float]:
    xs = sorted(values)
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return q[0], q[-1]


def _loopback_server(cpu: str | None) -> tuple[subprocess.Popen, int]:
    """A plain-socket baseline server in a process of its own on this namespace's loopback:
    the same baseline without the veth between the two namespaces (on the owner's CPU ``cpu``
    when the owner is pinned)."""
    env = dict(os.environ)
    env.pop("MEMSEM_BENCH_CPU", None)
    if cpu is not None:
        env["MEMSEM_BENCH_CPU"] = cpu
    p = subprocess.Popen([sys.executable, "-m", "memsem_bench.tcp", "--role", "socket-server",
                          "--addr", "127.0.0.1:0", "--size", str(SMALL)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    if not line:
        p.kill()
        raise RuntimeError("the loopback baseline server did not start")
    return p, int(json.loads(line)["port"])


def _ratios(num: list[float], den: list[float]) -> dict[str, Any]:
    """Median of per-round ratios and their p10 / p90 (see ``memsem_bench.measure.RatioStat``)."""
    from memsem_bench.measure import ratio_of_rounds

    st = ratio_of_rounds(num, den)
    return {"value": st.value, "p10": st.p10, "p90": st.p90, "rounds": st.rounds}


def _tails(calls: dict[str, list[float]], block: int) -> dict[str, Any]:
    """p99 / p999 (us) of every call of the 64 B rounds, per side, and the tcp get's tail over
    the socket's (pooled; p10 / p90 of the same ratio round by round)."""
    from memsem_bench.measure import tail_ratio, tails_us

    out: dict[str, Any] = {k: list(tails_us(v)) for k, v in calls.items()}
    for q, name in ((99.0, "tcp_get_64B_p99_vs_socket_p99"), (99.9, "tcp_get_64B_p999_vs_socket_p999")):
        st = tail_ratio(calls["tcp"], calls["socket"], block, q)
        out[name] = {"value": st.value, "p10": st.p10, "p90": st.p90, "rounds": st.rounds}
    return out


# -- the owner's cost of connections -------------------------------------------------------------------
def _raise_nofile(n: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n and hard != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard == resource.RLIM_INFINITY else min(hard, max(n, soft)),
                                                    hard))


def _proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` (bytes) and ``Threads`` of a process."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k == "VmRSS":
                out["rss"] = int(v.split()[0]) * 1024
            elif k == "Threads":
                out["threads"] = int(v)
    return out


def _settled(pid: int) -> dict[str, int]:
    """The owner's status once its RSS stopped moving (its loop has served every connection)."""
    last = _proc_status(pid)
    for _ in range(50):
        time.sleep(0.1)
        now = _proc_status(pid)
        if now["rss"] == last["rss"]:
            return now
        last = now
    return last


def idle_connections(ref: Any, n: int) -> list[socket.socket]:
    """``n`` connections to the owner of ``ref`` (on another node), each authenticated with the
    ref's credential (OPEN) and used for one get of its bytes, then left idle: what a job's
    consumers cost an owner between transfers. Raw protocol (``memsem.engines.tcp._wire``)."""
    from memsem.engines.tcp import _wire as W
    from memsem.gva import credential_proof, credential_token

    res = ref.runtime.resolve(ref.spec)
    host, port = W.split_endpoint(res.remote.endpoint)
    token = credential_token(ref.spec)
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection((host, port), timeout=30)
            socks.append(s)
            hello = _recv_exact(s, W.HELLO.size)
            nonce = W.HELLO.unpack(hello)[3]
            body = token + credential_proof(ref.spec.key, nonce + W.H16.pack(1), token)
            s.sendall(W.CHELLO.pack(W.MAGIC, W.PROTOCOL, W.KIND_DATA)
                      + W.REQ.pack(W.OP_OPEN, 0, 1, 1, 0, len(body), 0, 0) + body
                      + W.REQ.pack(W.OP_GET, 0, 1, 2, ref.spec.offset, ref.spec.nbytes, 0, 1000))
            st = W.REP.unpack(_recv_exact(s, W.REP.size))
            if st[0] != W.OK:
                raise RuntimeError(f"the owner refused idle connection {len(socks)}: status {st[0]}")
            _recv_exact(s, 2 * W.REP.size + ref.spec.nbytes)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def unauthenticated_connections(ref: Any, n: int) -> list[socket.socket]:
    """``n`` connections that never authenticate: half send nothing, half only the hello."""
    from memsem.engines.tcp import _wire as W

    host, port = W.split_endpoint(ref.runtime.resolve(ref.spec).remote.endpoint)
    socks = []
    for i in range(n):
        s = socket.create_connection((host, port), timeout=30)
        if i % 2:
            s.sendall(W.CHELLO.pack(W.MAGIC, W.PROTOCOL, W.KIND_DATA))
        socks.append(s)
    return socks


def _recv_exact(s: socket.socket, n: int) -> bytes:
    b = bytearray()
    while len(b) < n:
        k = s.recv(n - len(b))
        if not k:
            raise EOFError(f"the owner closed the connection after {len(b)} of {n} bytes")
        b += k
    return bytes(b)


def connection_costs(ref: Any, owner_pid: int) -> dict[str, Any]:
    """The owner's RSS growth (MiB) and threads with ``IDLE_CONNECTIONS`` idle connections,
    and its RSS growth with ``UNAUTH_CONNECTIONS`` that never authenticate."""
    _raise_nofile(UNAUTH_CONNECTIONS + 512)
    out: dict[str, Any] = {}
    base = _settled(owner_pid)
    socks = idle_connections(ref, IDLE_CONNECTIONS)
    try:
        now = _settled(owner_pid)
        out["tcp_owner_rss_MiB_1000_idle"] = (now["rss"] - base["rss"]) / (1 << 20)
        out["tcp_owner_threads_1000_idle"] = now["threads"]
    finally:
        for s in socks:
            s.close()
    base = _settled(owner_pid)
    socks = unauthenticated_connections(ref, UNAUTH_CONNECTIONS)
    try:
        ref.get()  # an honest consumer still gets in
        now = _settled(owner_pid)
        out["tcp_owner_rss_MiB_2000_unauth"] = (now["rss"] - base["rss"]) / (1 << 20)
    finally:
        for s in socks:
            s.close()
    return out


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1e3


def _consumer(quick: bool, small_only: bool = False) -> None:
    import numpy as np

    import memsem

    from memsem_bench.measure import smoke

    info = json.loads(sys.stdin.readline())
    tiny = smoke()
    rounds = 4 if tiny else 30 if quick else 100
    block = 100
    big_iters = 2 if tiny else 7 if quick else 15
    now = time.perf_counter_ns
    med = statistics.median
    lo_proc = None
    with memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=60) as rt:
        small, big, tile, pipe = (rt.ref(bytes.fromhex(info[k])) for k in ("small", "big", "tile", "pipe"))
        route = rt.route(small).kind
        base = SocketClient(info["host"], info["socket_port"])
        sides: dict[str, Any] = {}
        out = np.empty(SMALL, np.uint8)
        omv = memoryview(out)
        sides["tcp"] = lambda: small.get(out=out)
        sides["socket"] = lambda: base.get(omv)
        if info.get("link") == "veth":  # the same baseline on this namespace's loopback
            lo_proc, lo_port = _loopback_server(info.get("owner_cpu"))
            lo = SocketClient("127.0.0.1", lo_port)
            lomv = memoryview(bytearray(SMALL))
            sides["socket_lo"] = lambda: lo.get(lomv)
        for _ in range(300):
            for fn in sides.values():
                fn()
        per: dict[str, list[float]] = {k: [] for k in sides}
        calls: dict[str, list[float]] = {k: [] for k in sides}  # every call's time, for the tails
        items = list(sides.items())
        for r in range(rounds):  # interleaved rounds, the order reversed every other round
            for k, fn in (items if r % 2 == 0 else items[::-1]):
                ts = []
                for _ in range(block):
                    t0 = now()
                    fn()
                    ts.append(now() - t0)
                per[k].append(med(ts))
                calls[k].extend(ts)
        if small_only:
            base.quit()
            if lo_proc is not None:
                lo.quit()
                lo_proc.wait(10)
            small.get(out=out)
            res = {"route": route, "intact": bool((out == np.arange(SMALL, dtype=np.uint8)).all()),
                   "affinity": {"owner": info["owner_affinity"], "consumer": sorted(os.sched_getaffinity(0))},
                   "tcp_get_64B_us": med(per["tcp"]) / 1e3, "socket_rtt_64B_us": med(per["socket"]) / 1e3,
                   "ratios": {"tcp_get_64B_vs_socket": _ratios(per["tcp"], per["socket"])},
                   "rounds_us": {k: [v / 1e3 for v in vs] for k, vs in per.items()}}
            print(json.dumps(res), flush=True)
            return
        dst = np.empty(BIG, np.uint8)
        dmv = memoryview(dst)
        big.get(out=dst)
        base.get(dmv)
        mem_t, sock_t = [], []
        for i in range(big_iters):
            for k in (("m", "s") if i % 2 == 0 else ("s", "m")):
                t0 = now()
                if k == "m":
                    big.get(out=dst)
                    mem_t.append(now() - t0)
                else:
                    base.get(dmv)
                    sock_t.append(now() - t0)
        big.get(out=dst)
        intact = bool((dst[:1 << 20] == (np.arange(1 << 20, dtype=np.uint32) % 251).astype(np.uint8)).all())
        del dst, dmv
        tbuf = np.empty(TILE, np.uint8)
        for _ in range(3):
            tile.get(out=tbuf)
        with rt.pipeline(pipe, tile_bytes=TILE, depth=2, wait_ready=True) as p:  # subscribes
            next(iter(p)).release()
        one, first = [], []
        for _ in range(3 if tiny else 21 if quick else 51):  # interleaved: one tile get, one pipeline's first tile
            t0 = now()
            tile.get(out=tbuf)
            one.append(now() - t0)
            t0 = now()
            with rt.pipeline(pipe, tile_bytes=TILE, depth=2, wait_ready=True) as p:
                for t in p:
                    with t:
                        first.append(now() - t0)
                    break
        base.quit()
        if lo_proc is not None:
            lo.quit()
            lo_proc.wait(10)
        costs = connection_costs(small, info["pid"])
        res: dict[str, Any] = {**costs,
            "route": route, "intact": intact,
            "affinity": {"owner": info["owner_affinity"], "consumer": sorted(os.sched_getaffinity(0))},
            "tcp_get_64B_us": med(per["tcp"]) / 1e3, "socket_rtt_64B_us": med(per["socket"]) / 1e3,
            "tcp_get_64MiB_GBps": BIG / med(mem_t), "socket_64MiB_GBps": BIG / med(sock_t),
            "tile_get_1MiB_us": med(one) / 1e3, "first_tile_us": med(first) / 1e3,
            "remote_first_tile_ratio": med(first) / med(one),
            "ratios": {"tcp_get_64B_vs_socket": _ratios(per["tcp"], per["socket"]),
                       "tcp_get_64MiB_vs_socket": _ratios(sock_t, mem_t),  # GB/s ratio: times inverted
                       "remote_first_tile_ratio": _ratios(first, one)},
            "rounds_us": {k: [v / 1e3 for v in vs] for k, vs in per.items()},
            "tails": _tails(calls, block),
            "rounds_GBps": {"tcp": [BIG / t for t in mem_t], "socket": [BIG / t for t in sock_t]},
        }
        if "socket_lo" in per:
            res["socket_rtt_64B_us_loopback"] = med(per["socket_lo"]) / 1e3
            res["ratios"]["tcp_get_64B_vs_socket_loopback"] = _ratios(per["tcp"], per["socket_lo"])
            res["ratios"]["socket_veth_vs_loopback"] = _ratios(per["socket"], per["socket_lo"])
        print(json.dumps(res), flush=True)


# -- namespaces ------------------------------------------------------------------------------------------
def _ip() -> str | None:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)


def namespaces_possible() -> str | None:
    """None when a veth pair between two namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return f"network namespaces need root (euid {os.geteuid()})"
    if _ip() is None:
        return "iproute2 'ip' not found"
    return None


@contextlib.contextmanager
def veth_pair() -> Iterator[tuple[list[str], list[str], str]]:
    """Two namespaces joined by veth: ``(argv prefix of A, of B, A's address)``; both removed on
    exit (with every process left in them)."""
    ip = _ip()
    tok = secrets.token_hex(2)  # "memsem-<x>-<pid>-<n>": the test harness reaps it if this process dies
    a, b = f"memsem-bencha-{os.getpid()}-{tok}", f"memsem-benchb-{os.getpid()}-{tok}"
    x = os.getpid() % 250 + 2
    made = []

    def run(*args: str) -> None:
        subprocess.run([ip, *args], check=True, capture_output=True, timeout=20)

    try:
        for n in (a, b):
            run("netns", "add", n)
            made.append(n)
        run("link", "add", "veth0", "netns", a, "type", "veth", "peer", "name", "veth0", "netns", b)
        for n, addr in ((a, f"10.203.{x}.1"), (b, f"10.203.{x}.2")):
            run("-n", n, "link", "set", "lo", "up")
            run("-n", n, "addr", "add", f"{addr}/24", "dev", "veth0")
            run("-n", n, "link", "set", "veth0", "up")
        yield [ip, "netns", "exec", a], [ip, "netns", "exec", b], f"10.203.{x}.1"
    finally:
        for n in made:
            pids = subprocess.run([ip, "netns", "pids", n], capture_output=True, text=True).stdout.split()
            for p in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(p), 9)
            subprocess.run([ip, "netns", "del", n], capture_output=True)


def _run_nodes(quick: bool, why: str | None, link: str, cpus: tuple[int, int] | None,
               small_only: bool = False) -> dict[str, Any]:
    """One producer and one consumer process (in two namespaces unless ``why``), pinned to
    ``cpus`` (owner, consumer) when given: the consumer's result."""
    job = f"benchtcp{os.getpid()}{secrets.token_hex(2)}"
    me = [sys.executable, "-m", "memsem_bench.tcp"]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    env = dict(os.environ, MEMSEM_JOB=job, MEMSEM_DIRECTORY="local")
    env.pop("MEMSEM_BENCH_CPU", None)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    with contextlib.ExitStack() as stack:
        if why:
            pa, pb, host = [], [], "127.0.0.1"
        else:
            pa, pb, host = stack.enter_context(veth_pair())
        penv = dict(env, MEMSEM_NODE_ID="bench-node-a", MEMSEM_TCP_HOST=host, MEMSEM_BENCH_LINK=link)
        cenv = dict(env, MEMSEM_NODE_ID="bench-node-b")
        if cpus is not None:  # each "node" on a core of its own, or both on one (see placement_cpus)
            penv["MEMSEM_BENCH_CPU"], cenv["MEMSEM_BENCH_CPU"] = str(cpus[0]), str(cpus[1])
        prod = subprocess.Popen(pa + me + ["--role", "producer"], env=penv, **pipes)
        try:
            line = prod.stdout.readline()
            if not line:
                raise RuntimeError(f"producer failed: {prod.stderr.read()[-2000:]}")
            flags = (["--quick"] if quick else []) + (["--small-only"] if small_only else [])
            cons = subprocess.Popen(pb + me + ["--role", "consumer"] + flags, env=cenv, **pipes)
            out, err = cons.communicate(line, timeout=900)
            if cons.returncode != 0:
                raise RuntimeError(f"consumer failed: {err[-2000:]}")
            return json.loads(out.strip().splitlines()[-1])
        finally:
            with contextlib.suppress(OSError):
                prod.stdin.write("\n")
                prod.stdin.flush()
            try:
                prod.wait(30)
            except subprocess.TimeoutExpired:
                prod.kill()
                prod.wait(5)


def figures(quick: bool = True, link: str = "auto", placement: str = "apart") -> tuple[dict[str, Any], str | None]:
    """Run both nodes and return ``(figures, note)``; figures hold ``KEYS`` (None where not
    measured) and the note says which link and placement were measured, or why something was
    skipped.

    ``link``: "auto" (veth where namespaces can be made, else loopback), "veth" or "loopback".
    ``placement``: the CPUs of the main run (``placement_cpus``; "apart" by default). After it,
    the 64 B rounds run once more with both processes on one CPU (``*_one_core`` keys): what
    each round trip costs in CPU, beside what it costs in time between two "nodes".
    """
    if link not in ("auto", "veth", "loopback"):
        raise ValueError(f"link must be 'auto', 'veth' or 'loopback', got {link!r}")
    cpus = placement_cpus(placement)
    why = namespaces_possible() if link != "loopback" else "loopback asked for"
    if link == "veth" and why:
        return {k: None for k in ALL_KEYS}, f"tcp figures over veth skipped: {why}"
    link = "loopback" if why else "veth"
    empty: dict[str, Any] = {k: None for k in ALL_KEYS}
    try:
        res = _run_nodes(quick, why, link, cpus)
        one = _run_nodes(quick, why, link, placement_cpus("shared"), small_only=True)
    except Exception as exc:  # the rest of the bench goes on; the note says what failed
        return empty, f"tcp figures: {type(exc).__name__}: {exc}"
    if res.get("route") != "tcp" or not res.get("intact"):
        return empty, f"tcp figures: route {res.get('route')!r}, bytes intact: {res.get('intact')}"
    fig = {k: (round(res[k], 3) if isinstance(res.get(k), float) else res.get(k)) for k in KEYS}
    fig["tcp_link"] = link
    # ratios: medians of per-round ratios, both sides interleaved, with their p10 / p90
    for k in RATIO_KEYS:
        st = res.get("ratios", {}).get(k)
        fig[k] = None if not st or st["value"] is None else round(st["value"], 3)
        fig[f"{k}_spread"] = None if not st or st["value"] is None else [round(st["p10"], 3), round(st["p90"], 3)]
    lo = res.get("socket_rtt_64B_us_loopback")
    fig["socket_rtt_64B_us_loopback"] = None if lo is None else round(lo, 3)
    rounds = res.get("rounds_us", {})
    for k, name in (("socket", "socket_rtt_64B_us"), ("socket_lo", "socket_rtt_64B_us_loopback"),
                    ("tcp", "tcp_get_64B_us")):
        v = rounds.get(k)
        fig[f"{name}_spread"] = [round(x, 3) for x in _p10_p90(v)] if v else None
    for k, name in (("tcp", "tcp_get_64MiB_GBps"), ("socket", "socket_64MiB_GBps")):
        v = res.get("rounds_GBps", {}).get(k)
        fig[f"{name}_spread"] = [round(x, 3) for x in _p10_p90(v)] if v else None
    tails = res.get("tails", {})
    for k, name in (("tcp", "tcp_get_64B"), ("socket", "socket_rtt_64B")):
        p99, p999 = tails.get(k, (None, None))
        fig[f"{name}_p99_us"] = None if p99 is None else round(p99, 3)
        fig[f"{name}_p999_us"] = None if p999 is None else round(p999, 3)
    for k in TAIL_RATIO_KEYS:
        st = tails.get(k)
        fig[k] = None if not st or st["value"] is None else round(st["value"], 3)
        fig[f"{k}_spread"] = None if not st or st["value"] is None else [round(st["p10"], 3), round(st["p90"], 3)]
    fig["tcp_placement"] = "unpinned" if cpus is None else f"{placement}: owner CPU {cpus[0]}, consumer CPU {cpus[1]}"
    fig["tcp_affinity"] = res.get("affinity")  # the CPUs each process ran on, as it saw them
    if one.get("route") == "tcp" and one.get("intact"):
        st = one["ratios"]["tcp_get_64B_vs_socket"]
        fig["tcp_get_64B_us_one_core"] = round(one["tcp_get_64B_us"], 3)
        fig["socket_rtt_64B_us_one_core"] = round(one["socket_rtt_64B_us"], 3)
        fig["tcp_get_64B_vs_socket_one_core"] = None if st["value"] is None else round(st["value"], 3)
        fig["tcp_get_64B_vs_socket_one_core_spread"] = (None if st["value"] is None
                                                        else [round(st["p10"], 3), round(st["p90"], 3)])
        fig["tcp_affinity_one_core"] = one.get("affinity")
    note = (f"tcp figures over {link}" + (f" ({why})" if why else " (veth pair between two network namespaces)")
            + f", {fig['tcp_placement']}")
    return fig, note


def bench_figures(quick: bool, notes: list[str]) -> dict[str, Any]:
    """``memsem bench``'s hook: the figures, with the note appended to ``notes``."""
    fig, note = figures(quick)
    if note:
        notes.append(note)
    return fig


def goals_met(fig: dict[str, Any]) -> dict[str, bool | None]:
    def ratio(a: str, b: str) -> float | None:
        return None if fig.get(a) is None or not fig.get(b) else fig[a] / fig[b]

    r64 = fig.get("tcp_get_64B_vs_socket")
    r64 = ratio("tcp_get_64B_us", "socket_rtt_64B_us") if r64 is None else r64
    rbw = fig.get("tcp_get_64MiB_vs_socket")
    rbw = ratio("tcp_get_64MiB_GBps", "socket_64MiB_GBps") if rbw is None else rbw
    ft = fig.get("remote_first_tile_ratio")
    rss = fig.get("tcp_owner_rss_MiB_1000_idle")
    return {"tcp_get_64B_us": None if r64 is None else r64 <= 1.3,
            "tcp_get_64MiB_GBps": None if rbw is None else rbw >= 1.0,
            "remote_first_tile_ratio": None if ft is None else ft <= 3,
            "tcp_owner_rss_MiB_1000_idle": None if rss is None else rss <= 32}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--role", choices=("producer", "consumer", "socket-server", "socket-client"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--addr", default="127.0.0.1:0", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=SMALL, help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=1000, help=argparse.SUPPRESS)
    ap.add_argument("--quit", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--small-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    host, _, port = args.addr.rpartition(":")
    _pin_from_env()
    if args.role == "socket-server":
        socket_server(host, int(port), max(args.size, BIG), lambda p: print(json.dumps({"port": p}), flush=True))
        return 0
    if args.role == "socket-client":
        print(json.dumps(socket_client_run(host, int(port), args.size, args.iters, args.quit)))
        return 0
    if args.role == "producer":
        _producer()
        return 0
    if args.role == "consumer":
        _consumer(args.quick, args.small_only)
        return 0
    fig, note = figures(args.quick)
    if args.json:
        print(json.dumps(fig))
    else:
        print(note)
        for k in KEYS:
            print(f"  {k:26} {fig.get(k)}")
        for k, met in goals_met(fig).items():
            print(f"  goal {k:21} {GOALS[k]:32} {'met' if met else 'NOT met' if met is False else 'n/a'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
