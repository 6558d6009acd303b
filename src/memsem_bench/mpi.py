"""MPI peers of ``memsem bench``; run as ``mpiexec -n 2 python -m memsem_bench.mpi``.

Rank 0 measures, rank 1 is the peer; rank 0 prints one JSON line with per-call samples (ns):

* ``sendrecv``: ping-pong with ``Send``/``Recv``; a sample is half a round trip (the one-way
  latency, as osu_latency reports it).
* ``rma_get`` / ``rma_put``: passive-target RMA on a window from ``Win.Allocate`` (MPICH maps it
  in shared memory on one node): ``Lock(1, SHARED) Get Unlock`` and ``Lock(1, EXCLUSIVE) Put
  Unlock``; a sample is the whole epoch (the data is at its destination when Unlock returns).
* ``paired`` (with ``--pair-memsem``): a memsem 64 B get (rank 1 owns the window in a shared
  segment: route host/shm, as ``get_64B_us``) interleaved round by round with the 64 B
  Send/Recv ping-pong; per-round medians (ns; the ping-pong halved) of both sides, for the ratio
  ``get_64B_vs_mpi_sendrecv``. While rank 0 runs memsem gets, rank 1 sleeps (polling for the
  next ping-pong round every 0.2 ms), so it does not spin on a core the get needs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

_now = time.perf_counter_ns
MiB = 1 << 20


def _budget(n: int, quick: bool) -> float:
    return (0.04 if quick else 0.25) if n < MiB else (0.12 if quick else 0.6)


def _pingpong(comm, rank: int, buf: np.ndarray) -> None:
    if rank == 0:
        comm.Send(buf, 1, 0)
        comm.Recv(buf, 1, 0)
    else:
        comm.Recv(buf, 0, 0)
        comm.Send(buf, 0, 0)


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pair-memsem", action="store_true")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        if rank == 0:
            print("run with mpiexec -n 2", file=sys.stderr)
        return 2
    cap = 20000 if a.quick else 100000
    out: dict[str, dict[str, list[int]]] = {"sendrecv": {}, "rma_get": {}, "rma_put": {}}
    for n in sizes:
        buf = np.full(n, 1, np.uint8)
        # -- Send/Recv ping-pong: a short calibration sets the iteration count (so the timed
        # loop carries no extra messages), then every round trip is timed.
        warm = 3 if n >= 16 * MiB else 200
        cal = []
        for _ in range(warm):
            t0 = _now()
            _pingpong(comm, rank, buf)
            cal.append(_now() - t0)
        per = max(1, sorted(cal)[len(cal) // 2])
        iters = comm.bcast(max(5, min(cap, int(_budget(n, a.quick) * 1e9) // per)) if rank == 0 else None, root=0)
        samples: list[int] = []
        for _ in range(iters):
            t = _now()
            _pingpong(comm, rank, buf)
            samples.append((_now() - t) // 2)
        out["sendrecv"][str(n)] = samples
        # -- RMA, passive target: rank 1 only waits in a barrier.
        win = MPI.Win.Allocate(n if rank == 1 else 0, 1, comm=comm)
        if rank == 1:
            np.frombuffer(win.tomemory(), np.uint8, n)[:] = 2 if n else 0
        comm.Barrier()
        if rank == 0:
            for kind in ("rma_get", "rma_put"):
                lock = MPI.LOCK_SHARED if kind == "rma_get" else MPI.LOCK_EXCLUSIVE
                op = win.Get if kind == "rma_get" else win.Put
                res: list[int] = []
                for _ in range(2 if n >= 16 * MiB else 20):
                    win.Lock(1, lock)
                    op(buf, 1)
                    win.Unlock(1)
                end = _now() + int(_budget(n, a.quick) * 1e9)
                while len(res) < cap and (len(res) < 5 or _now() < end):
                    t = _now()
                    win.Lock(1, lock)
                    op(buf, 1)
                    win.Unlock(1)
                    res.append(_now() - t)
                out[kind][str(n)] = res
        comm.Barrier()
        win.Free()
    paired = _pair_memsem(comm, rank, rounds=30 if a.quick else 100, per_round=200) if a.pair_memsem else None
    if rank == 0:
        print(json.dumps({"library": MPI.Get_library_version().splitlines()[0].strip(),
                          "samples": out, "paired": paired}))
    return 0


_CTRL = 7


def _pair_memsem(comm, rank: int, *, rounds: int, per_round: int) -> dict[str, list[float]] | None:
    """Rounds of ``per_round`` memsem 64 B gets and ``per_round`` 64 B ping-pongs, the order
    reversed every other round; per-round medians in ns (ping-pong halved: one-way)."""
    import statistics

    import memsem

    buf = np.full(64, 1, np.uint8)
    with memsem.Runtime() as rt:
        if rank == 1:
            win = rt.alloc(64, np.uint8)
            win[:] = 3
            ref = rt.publish(win, name=f"bench/mpi/{rt.rank}")
            comm.send(ref.to_bytes(), dest=0, tag=_CTRL)
            while True:
                while not comm.Iprobe(source=0, tag=_CTRL):
                    time.sleep(0.0002)
                n = comm.recv(source=0, tag=_CTRL)
                if n is None:
                    break
                for _ in range(n + 20):
                    _pingpong(comm, 1, buf)
            comm.Barrier()
            return None
        ref = rt.ref(comm.recv(source=1, tag=_CTRL))
        out = np.empty(64, np.uint8)
        for _ in range(200):
            ref.get(out)
        gets: list[float] = []
        pps: list[float] = []
        for r in range(rounds):
            for side in (("get", "pp") if r % 2 == 0 else ("pp", "get")):
                ts = []
                if side == "get":
                    for _ in range(per_round):
                        t = _now()
                        ref.get(out)
                        ts.append(_now() - t)
                    gets.append(statistics.median(ts))
                else:
                    comm.send(per_round, dest=1, tag=_CTRL)
                    for _ in range(20):  # rank 1 wakes from its sleep: not timed
                        _pingpong(comm, 0, buf)
                    for _ in range(per_round):
                        t = _now()
                        _pingpong(comm, 0, buf)
                        ts.append((_now() - t) / 2)
                    pps.append(statistics.median(ts))
        comm.send(None, dest=1, tag=_CTRL)
        comm.Barrier()
        return {"get": gets, "sendrecv": pps, "route": ref.route().kind}


if __name__ == "__main__":
    sys.exit(main())
