"""Could a large tcp GET leave user space (issue 24: ``sendfile`` / ``splice`` from the segment's
fd)? 64 MiB from a shared-memory file to a socket on loopback, in the same run, rounds
interleaved: ``send()`` from the file's mapping in 1 MiB pieces (what memsem's owner does: one
seqlock bracket around each non-blocking send) against ``os.sendfile()`` from its fd in the
same pieces; a receiver process reads into one buffer and acknowledges each transfer.

    python benchmarks/bench_sendfile.py [--rounds R] [--mib M] [--json FILE]

Prints the median GB/s of each (and every round), and ``sendfile_vs_send``. Beside the figure,
why memsem does not use it even where it were faster: TCP ``sendfile`` hands the socket
references to the file's pages, which the kernel reads when it transmits, after the call
returned; a seqlock bracket closed after the call then proves nothing about the bytes that
leave (a write section may overwrite them meanwhile), while ``send()`` has copied them into the
socket buffer before it returns.
"""
from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import struct
import time

PIECE = 1 << 20


def _receiver(port: int, nbytes: int, rounds: int) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    mv = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            k = s.recv_into(mv[got:], nbytes - got)
            if not k:
                raise SystemExit("sender closed early")
            got += k
        s.sendall(b"k")


def measure(nbytes: int, rounds: int) -> dict:
    path = f"/dev/shm/memsem-bench-sendfile-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as m:
            m[:] = os.urandom(PIECE) * (nbytes // PIECE) + os.urandom(nbytes % PIECE)
            ls = socket.socket()
            ls.bind(("127.0.0.1", 0))
            ls.listen(1)
            ls.settimeout(60)
            p = mp.get_context("spawn").Process(target=_receiver, args=(ls.getsockname()[1], nbytes, 2 * rounds))
            p.start()
            c, _ = ls.accept()
            # blocking (sendfile needs it), bounded by the kernel: 60 s without progress fails
            c.setblocking(True)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 60, 0))
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 60, 0))
            ls.close()
            mv = memoryview(m)
            out: dict[str, list[float]] = {"send": [], "sendfile": []}
            try:
                for r in range(2 * rounds):
                    kind = "send" if r % 2 == 0 else "sendfile"
                    t0 = time.perf_counter()
                    sent = 0
                    while sent < nbytes:
                        if kind == "send":
                            sent += c.send(mv[sent:sent + PIECE])
                        else:
                            sent += os.sendfile(c.fileno(), fd, sent, min(PIECE, nbytes - sent))
                    if c.recv(1) != b"k":
                        raise SystemExit("receiver did not acknowledge")
                    out[kind].append(nbytes / (time.perf_counter() - t0) / 1e9)
            finally:
                mv.release()
                c.close()
                p.join(60)
    finally:
        os.close(fd)
        os.unlink(path)
    send, sf = statistics.median(out["send"]), statistics.median(out["sendfile"])
    return {"send_GBps": send, "sendfile_GBps": sf, "sendfile_vs_send": sf / send, "rounds": out,
            "nbytes": nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    f = measure(a.mib << 20, a.rounds)
    for k in ("send", "sendfile"):
        print(f"{k:9s} {f[k + '_GBps']:6.2f} GB/s (median of {a.rounds}; rounds {[round(x, 2) for x in f['rounds'][k]]})")
    print(f"sendfile_vs_send {f['sendfile_vs_send']:.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(f, fh, indent=1)


if __name__ == "__main__":
    main()
