"""pyzmq "get" round trips across a link: a small request, a reply sent zero-copy from a numpy
buffer, received into a preallocated destination. Run as two processes (one per namespace):

    python zmq_bench.py server --bind tcp://10.201.x.1:5555 [--max-bytes N]
    python zmq_bench.py client --connect tcp://10.201.x.1:5555 --size 64 --iters 2000 \
        [--recv recv_into|frame] [--pattern reqrep|dealer] [--chunk BYTES] [--quit]

With ``--chunk`` the server sends the payload as one multipart message of chunk-sized frames and
the client receives each frame into its slice of the destination. Measured here: 4-8 MiB frames
move 64 MiB about 2x faster than one 64 MiB frame. (libzmq delivers a multipart message atomically,
so the receiver still sees frame 0 only after the last frame arrived; no overlap of copy and wire.)

The client prints one JSON line: size, iters, recv method, and latency stats (us) or throughput
(GB/s, 1e9 bytes/s), and whether every payload it checked was intact. The server answers
``b"get" + size + chunk (8 bytes LE each)`` with ``size`` bytes of its source array (``copy=False`` for sizes at or
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
        size, chunk = struct.unpack_from("<QQ", req, 3)
        payload = memoryview(src)[:size]          # a view: no copy
        if pattern == "dealer":
            sock.send(ident, zmq.SNDMORE)
        if not chunk or chunk >= size:
            sock.send(payload, copy=False)        # zero-copy above zmq.COPY_THRESHOLD
        else:                                     # one multipart message of chunk-sized frames
            for off in range(0, size, chunk):
                last = off + chunk >= size
                sock.send(payload[off:off + chunk], copy=False, flags=0 if last else zmq.SNDMORE)
    sock.close(linger=0)
    ctx.term()


def client(connect: str, size: int, iters: int, warmup: int, recv: str, pattern: str,
           verify: bool, quit_server: bool = False, chunk: int = 0) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER if pattern == "dealer" else zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    sock.connect(connect)
    dst = np.zeros(size, dtype=np.uint8)          # preallocated destination
    req = b"get" + struct.pack("<QQ", size, chunk)
    expect = _pattern(size) if verify else None
    ok = True

    dmv = memoryview(dst)

    def one() -> None:
        sock.send(req)
        off = 0
        while True:                               # one frame, or chunk frames of one message
            if recv == "recv_into":
                n = sock.recv_into(dmv[off:])     # libzmq copies msg -> dst, GIL released
                if off + n > size:
                    raise RuntimeError(f"frame of {n} B at {off} overflows {size} B (truncated)")
            else:
                frame = sock.recv(copy=False)     # Frame over libzmq's buffer, no copy yet
                n = frame.buffer.nbytes
                if off + n > size:
                    raise RuntimeError(f"frame of {n} B at {off} overflows {size} B")
                dmv[off:off + n] = frame.buffer   # the one copy into the destination
            off += n
            if not sock.getsockopt(zmq.RCVMORE):
                break
        if off != size:
            raise RuntimeError(f"got {off} bytes, expected {size}")

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
        "chunk": chunk,
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
    c.add_argument("--chunk", type=int, default=0,
                   help="server sends the payload as frames of this size (one multipart message)")
    c.add_argument("--no-verify", action="store_true")
    c.add_argument("--quit", action="store_true", help="tell the server to exit afterwards")
    a = ap.parse_args(argv)
    if a.role == "server":
        serve(a.bind, a.max_bytes, a.pattern)
    else:
        warmup = a.warmup if a.warmup is not None else max(2, a.iters // 10)
        print(json.dumps(client(a.connect, a.size, a.iters, warmup, a.recv, a.pattern,
                                not a.no_verify, a.quit, a.chunk)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
