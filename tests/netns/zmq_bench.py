"""pyzmq "get" round trips across a link: a small request, a reply sent zero-copy from a numpy
buffer, received into a preallocated destination. Run as two processes (one per namespace):

    python zmq_bench.py server --bind tcp://10.201.x.1:5555 [--max-bytes N]
    python zmq_bench.py client --connect tcp://10.201.x.1:5555 --size 64 --iters 2000 \
        [--recv recv_into|frame] [--pattern reqrep|dealer]

The client prints one JSON line: size, iters, recv method, and latency stats (us) or throughput
(GB/s, 1e9 bytes/s), and whether every payload it checked was intact. The server answers
``b"get" + size(8 bytes LE)`` with ``size`` bytes of its source array (``copy=False`` for sizes at or
above zmq.COPY_THRESHOLD; pyzmq copies smaller ones anyway), and ``b"quit"`` (client ``--quit``) with ``b"bye"`` and exits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import time

import numpy as np
import zmq


def _pattern(nbytes: int) -> np.ndarray:
    # Non-trivial content so that a wrong offset or a stale buffer is visible.
    return (np.arange(nbytes, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def serve(bind: str, max_bytes: int, pattern: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER if pattern == "dealer" else zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    src = _pattern(max_bytes)
    print(json.dumps({"ready": bind}), flush=True)
    while True:
        if pattern == "dealer":
            ident, req = sock.recv_multipart(copy=True)
        else:
            req = sock.recv(copy=True)
        if req == b"quit":
            if pattern == "dealer":
                sock.send_multipart([ident, b"bye"])
            else:
                sock.send(b"bye")
            break
        (size,) = struct.unpack_from("<Q", req, 3)
        payload = memoryview(src)[:size]          # a view: no copy
        if pattern == "dealer":
            sock.send(ident, zmq.SNDMORE)
        sock.send(payload, copy=False)            # zero-copy above zmq.COPY_THRESHOLD
    sock.close(linger=0)
    ctx.term()


def client(connect: str, size: int, iters: int, warmup: int, recv: str, pattern: str,
           verify: bool, quit_server: bool = False) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER if pattern == "dealer" else zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    sock.connect(connect)
    dst = np.zeros(size, dtype=np.uint8)          # preallocated destination
    req = b"get" + struct.pack("<Q", size)
    expect = _pattern(size) if verify else None
    ok = True

    def one() -> None:
        sock.send(req)
        if recv == "recv_into":
            n = sock.recv_into(dst)               # libzmq copies msg -> dst, GIL released
            if n != size:
                raise RuntimeError(f"got {n} bytes, expected {size} (truncated if larger)")
        else:
            frame = sock.recv(copy=False)         # Frame over libzmq's buffer, no copy yet
            mv = frame.buffer
            if mv.nbytes != size:
                raise RuntimeError(f"got {mv.nbytes} bytes, expected {size}")
            dst[:] = np.frombuffer(mv, dtype=np.uint8)   # the one copy into the destination

    for _ in range(warmup):
        one()
    if verify:
        dst[:] = 0
        one()
        ok = bool(np.array_equal(dst, expect))
    times = []
    t_all = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_all
    if verify:
        ok = ok and bool(np.array_equal(dst, expect))
    if quit_server:
        sock.send(b"quit")
        sock.recv()
    sock.close(linger=0)
    ctx.term()
    times.sort()
    us = [t * 1e6 for t in times]
    return {
        "connect": connect, "pattern": pattern, "recv": recv, "size": size, "iters": iters,
        "intact": ok,
        "lat_us_p50": round(statistics.median(us), 2),
        "lat_us_p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 2),
        "lat_us_mean": round(statistics.fmean(us), 2),
        "lat_us_min": round(us[0], 2),
        "gbps": round(size * iters / total / 1e9, 3),
        "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--bind", required=True)
    s.add_argument("--max-bytes", type=int, default=64 << 20)
    s.add_argument("--pattern", choices=["reqrep", "dealer"], default="reqrep")
    c = sub.add_parser("client")
    c.add_argument("--connect", required=True)
    c.add_argument("--size", type=int, default=64)
    c.add_argument("--iters", type=int, default=1000)
    c.add_argument("--warmup", type=int, default=None)
    c.add_argument("--recv", choices=["recv_into", "frame"], default="recv_into")
    c.add_argument("--pattern", choices=["reqrep", "dealer"], default="reqrep")
    c.add_argument("--no-verify", action="store_true")
    c.add_argument("--quit", action="store_true", help="tell the server to exit afterwards")
    a = ap.parse_args(argv)
    if a.role == "server":
        serve(a.bind, a.max_bytes, a.pattern)
    else:
        warmup = a.warmup if a.warmup is not None else max(2, a.iters // 10)
        print(json.dumps(client(a.connect, a.size, a.iters, warmup, a.recv, a.pattern,
                                not a.no_verify, a.quit)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
