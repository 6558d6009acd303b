"""Pipeline benchmark: the three goals of issue 3, measured in one run, printed as ratios.

1. Move time ~= compute time per tile: pipeline total vs the ideal ``fill + sum(max(move,
   compute)) + drain`` (goal <= 1.1x), and speedup vs get-everything-then-compute on the same
   data in the same run (goal >= 1.7x).
2. First-tile latency of a 256 MiB ref with 1 MiB tiles vs the latency of one 1 MiB ``get()``
   (goal <= 3x).
3. Consumer RSS growth while streaming 1 GiB vs ``depth x tile_bytes + 64 MiB`` (goal <= 1.0x).

The data lives in a producer process's private memory (route host/cma: one kernel copy per
tile, nothing mapped into the consumer), so moves are real and the consumer's RSS only holds
what the pipeline allocates. ``--quick`` shrinks the sizes (64 MiB refs, 256 MiB stream).

1b. Never slower than get-then-compute (issue 15): for refs of 256 KiB .. 256 MiB, a pipeline with
   the automatic tile choice against one get then the compute over the whole ref, the same
   compute (proportional to the bytes, ~= the move) in both, rounds interleaved; the smallest
   ratio is ``pipeline_vs_get_min`` (goal >= 1.0).

Every ratio is measured round by round with both sides interleaved, and reported as the median
of the per-round ratios, with ``<key>_spread`` = [p10, p90] of them.

``run(quick=True)`` returns a dict with ``pipeline_vs_ideal``, ``pipeline_speedup_vs_bulk``,
``pipeline_vs_get_min``, ``first_tile_ratio`` and ``rss_overhead_MiB`` (RSS growth beyond
``depth x tile_bytes``; the goal is <= 64) plus the raw figures; ``memsem bench`` calls it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

import memsem
from memsem.pipeline import Pipeline

MiB = 1 << 20
#: sizes of ``pipeline_vs_get_min``: 256 KiB .. 256 MiB, powers of 4
VS_GET_SIZES = [256 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]


# -- processes -----------------------------------------------------------------------------------
def _producer(conn, nbytes: int) -> None:
    with memsem.Runtime() as rt:
        data = np.empty(nbytes, np.uint8)
        data.view(np.uint32)[:] = np.arange(nbytes // 4, dtype=np.uint32)  # touched, non-trivial
        ref = rt.publish(data, access="r", name="bench-src")
        conn.send(ref.to_bytes())
        conn.poll(3600)
        conn.recv()


class _Source:
    """A producer process holding ``nbytes`` in private memory."""

    def __init__(self, nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer, args=(child, nbytes), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120):
            raise TimeoutError("producer did not publish within 120 s")
        self.data = self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send("exit")
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- compute -------------------------------------------------------------------------------------
class _Compute:
    """A consumer's work on one tile, shaped like a GEMM-style kernel: read the whole tile once
    (a sum over it), then compute-bound work on cache-resident data (``units`` passes of a
    GIL-releasing numpy kernel over a 32 KiB block), calibrated so that compute ~= move per tile.

    A purely memory-bound kernel (one streaming pass per byte) competes with the copy for the same
    memory bandwidth, so no pipeline could overlap the two on a 2-core machine; that would measure
    the memory bus, not the pipeline.
    """

    def __init__(self, tile_bytes: int) -> None:
        self.a = np.ones(8192, np.float32)
        self.b = np.empty_like(self.a)
        self.units = 1

    def __call__(self, tile: np.ndarray) -> float:
        acc = float(tile.view(np.float32).sum(dtype=np.float32)) if tile.nbytes % 4 == 0 else float(tile.sum())
        for _ in range(self.units):
            np.multiply(self.a, np.float32(1.0001), out=self.b)
        return acc + float(self.b[0])

    def calibrate(self, sample: np.ndarray, target_s: float) -> None:
        self.units = 0
        base = _median_time(lambda: self(sample), 7)
        self.units = 200
        per = (_median_time(lambda: self(sample), 7) - base) / 200
        self.units = max(1, round((target_s - base) / max(per, 1e-9)))


def _median_time(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# -- 1: pipeline vs ideal and vs bulk -----------------------------------------------------------
def _ratio_stat(ratios: list[float]) -> dict[str, Any]:
    """Median of per-round ratios with p10 / p90 (``memsem.cli._bench_measure.RatioStat``)."""
    from memsem.cli._bench_measure import RatioStat

    st = RatioStat.of(ratios)
    return {"value": st.value, "p10": st.p10, "p90": st.p90, "rounds": st.rounds}


def overlap_bench(rt: memsem.Runtime, ref: memsem.TensorRef, tile_bytes: int, depth: int,
                  repeats: int = 3) -> dict[str, Any]:
    """Rounds of: the ideal (each tile moved, then computed, one after the other: per-tile
    times), the machine's ceiling (copy thread || compute, no hand-off), bulk get-then-compute
    and the pipeline, the order of the last three reversed every other round. Per round
    ``pipeline / ideal`` and ``bulk / pipeline``; the figures are medians of those ratios
    (``*_stat`` has their p10 / p90)."""
    n = ref.num_tiles(tile_bytes)
    spec = ref.spec
    slot = np.empty(tile_bytes, np.uint8)
    slot[:] = 0
    rt.core.transfer(spec, "get", 0, slot)

    def tile_of(i: int, buf: np.ndarray) -> np.ndarray:
        return buf[:min(tile_bytes, spec.nbytes - i * tile_bytes)]

    def moves() -> list[float]:
        ts = []
        for i in range(n):
            t = time.perf_counter()
            rt.core.transfer(spec, "get", i * tile_bytes, tile_of(i, slot))
            ts.append(time.perf_counter() - t)
        return ts

    comp = _Compute(tile_bytes)
    comp.calibrate(slot, statistics.median(moves()))
    whole = np.empty(spec.nbytes, np.uint8)
    whole[:] = 0  # pre-touched: bulk pays no page faults (conservative for the pipeline)
    other = np.zeros(tile_bytes, np.uint8)
    stats = None

    def ideal() -> float:
        move_t = moves()
        comp_t = []
        for i in range(n):
            t = time.perf_counter()
            comp(slot)
            comp_t.append(time.perf_counter() - t)
        rec["move"].append(statistics.median(move_t))
        rec["comp"].append(statistics.median(comp_t))
        return move_t[0] + sum(max(move_t[i + 1], comp_t[i]) for i in range(n - 1)) + comp_t[-1]

    def ceiling() -> float:
        # copies on one thread and compute on another with no hand-off at all: no pipeline can
        # beat it; on 2 shared vCPUs it is far from the ideal
        t = time.perf_counter()
        th = threading.Thread(target=lambda: [rt.core.transfer(spec, "get", i * tile_bytes, tile_of(i, other))
                                              for i in range(n)])
        th.start()
        for i in range(n):
            comp(slot)
        th.join()
        return time.perf_counter() - t

    def bulk() -> float:
        t = time.perf_counter()
        rt.core.transfer(spec, "get", 0, whole)
        for i in range(n):
            comp(whole[i * tile_bytes:(i + 1) * tile_bytes])
        return time.perf_counter() - t

    def pipe() -> float:
        nonlocal stats
        t = time.perf_counter()
        with Pipeline(rt, spec, tile_bytes=tile_bytes, depth=depth, zero_copy=False) as p:
            for tile in p:
                with tile:
                    comp(tile.raw)
        dt = time.perf_counter() - t
        if stats is None or dt <= min(rec["pipe"], default=dt):
            stats = p.stats
        return dt

    rec: dict[str, list[float]] = {"ideal": [], "free": [], "bulk": [], "pipe": [], "move": [], "comp": []}
    pipe()  # warm: the pooled staging slots exist from here on
    rec["pipe"].clear()
    for r in range(repeats):
        rec["ideal"].append(ideal())
        order = (("free", ceiling), ("bulk", bulk), ("pipe", pipe))
        for k, fn in (order if r % 2 == 0 else order[::-1]):
            rec[k].append(fn())
    vs_ideal = _ratio_stat([p / i for p, i in zip(rec["pipe"], rec["ideal"])])
    speedup = _ratio_stat([b / p for b, p in zip(rec["bulk"], rec["pipe"])])
    ceil = _ratio_stat([f / i for f, i in zip(rec["free"], rec["ideal"])])
    vs_ceil = _ratio_stat([p / f for p, f in zip(rec["pipe"], rec["free"])])
    med = statistics.median
    return {"tiles": n, "tile_bytes": tile_bytes, "depth": depth, "compute_units": comp.units, "rounds": repeats,
            "move_per_tile_s": med(rec["move"]), "compute_per_tile_s": med(rec["comp"]),
            "ideal_s": med(rec["ideal"]), "pipeline_s": med(rec["pipe"]), "bulk_s": med(rec["bulk"]),
            "pipeline_vs_ideal": vs_ideal["value"], "pipeline_vs_ideal_stat": vs_ideal,
            "pipeline_speedup_vs_bulk": speedup["value"], "pipeline_speedup_vs_bulk_stat": speedup,
            "unsynchronized_s": med(rec["free"]), "ceiling_vs_ideal": ceil["value"], "ceiling_vs_ideal_stat": ceil,
            "pipeline_vs_ceiling": vs_ceil["value"], "pipeline_vs_ceiling_stat": vs_ceil,
            "overlap_ratio": stats.overlap_ratio, "route": stats.route}


# -- 1b: never slower than get-then-compute -----------------------------------------------------
class _ByteCompute:
    """Work proportional to the bytes it is given: one read of them (a float32 sum), then
    ``k x nbytes`` passes of a GIL-releasing kernel over a cache-resident 32 KiB block. The same
    total whether called once on the whole ref or once per tile (what get-then-compute and a
    pipeline each do); calibrated so computing the whole ref takes about as long as moving it."""

    def __init__(self) -> None:
        self.a = np.ones(8192, np.float32)
        self.b = np.empty_like(self.a)
        self.k = 0.0

    def __call__(self, x: np.ndarray) -> float:
        acc = float(x.view(np.float32).sum(dtype=np.float32)) if x.nbytes % 4 == 0 else float(x.sum())
        for _ in range(int(x.nbytes * self.k + 0.5)):
            np.multiply(self.a, np.float32(1.0001), out=self.b)
        return acc + float(self.b[0])

    def calibrate(self, x: np.ndarray, target_s: float) -> None:
        self.k = 0.0
        base = _median_time(lambda: self(x), 9)
        per = _median_time(lambda: [np.multiply(self.a, np.float32(1.0001), out=self.b) for _ in range(100)], 9) / 100
        self.k = max(0.0, (target_s - base) / per) / x.nbytes


def vs_get_bench(rt: memsem.Runtime, full: memsem.TensorRef, sizes: list[int], quick: bool) -> dict[str, Any]:
    """For each size: get-then-compute (one ``get`` into a preallocated, touched array, then the
    compute over it) against a pipeline with the automatic tile choice (compute per tile), rounds
    interleaved (each round runs both, in alternating order), medians. ``ratio`` = get-then-compute
    time / pipeline time (>= 1: the pipeline does not lose). ``alloc_ratio`` uses ``ref.get()``
    (a new array each time, as get-then-compute code usually reads) as the baseline instead."""
    out: dict[str, Any] = {}
    for n in sizes:
        ref = full.bytes(0, n)
        whole = np.empty(n, np.uint8)
        whole[:] = 0
        ref.get(whole)
        move = _median_time(lambda: ref.get(whole), 7)
        comp = _ByteCompute()
        comp.calibrate(whole, move)
        reps = (200 if n <= MiB else 40 if n <= 16 * MiB else 9 if n <= 64 * MiB else 5) * (1 if quick else 3)
        bulk, alloc, pipe = [], [], []
        tiles, mover, why = 1, "", ""

        def run_bulk() -> None:
            t = time.perf_counter()
            ref.get(whole)
            comp(whole)
            bulk.append(time.perf_counter() - t)

        def run_alloc() -> None:
            t = time.perf_counter()
            comp(ref.get())
            alloc.append(time.perf_counter() - t)

        def run_pipe() -> None:
            nonlocal tiles, mover, why
            t = time.perf_counter()
            with rt.pipeline(ref) as p:
                for tile in p:
                    with tile:
                        comp(tile.raw)
            pipe.append(time.perf_counter() - t)
            tiles, mover = p.n_tiles, p.stats.mover

        run_pipe()
        why = rt.pipeline(ref).explanation
        for r in range(reps):
            order = (run_bulk, run_pipe, run_alloc) if r % 2 else (run_pipe, run_alloc, run_bulk)
            for fn in order:
                fn()
        b, a, q = statistics.median(bulk), statistics.median(alloc), statistics.median(pipe)
        st = _ratio_stat([x / y for x, y in zip(bulk, pipe)])
        ast = _ratio_stat([x / y for x, y in zip(alloc, pipe)])
        out[str(n)] = {"bytes": n, "move_s": move, "get_then_compute_s": b, "alloc_get_then_compute_s": a,
                       "pipeline_s": q, "ratio": st["value"], "ratio_stat": st, "alloc_ratio": ast["value"],
                       "tiles": tiles, "mover": mover, "explanation": why, "rounds": reps}
    worst = min(out.values(), key=lambda v: v["ratio"])
    return {"sizes": out, "pipeline_vs_get_min": worst["ratio"], "pipeline_vs_get_min_stat": worst["ratio_stat"],
            "pipeline_vs_get_min_bytes": worst["bytes"],
            "pipeline_vs_get_alloc_min": min(v["alloc_ratio"] for v in out.values())}


# -- 2: first tile -------------------------------------------------------------------------------
def first_tile_bench(rt: memsem.Runtime, ref: memsem.TensorRef, tile_bytes: int, depth: int,
                     repeats: int = 15) -> dict[str, Any]:
    one = ref.bytes(0, tile_bytes)
    one.get()
    gets, firsts = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        one.get()  # a new 1 MiB array, as a user's get() gives
        gets.append(time.perf_counter() - t)
        p = Pipeline(rt, ref.spec, tile_bytes=tile_bytes, depth=depth, zero_copy=False)
        next(p)
        firsts.append(p.stats.first_tile_s)
        p.close()
    g, f = statistics.median(gets), statistics.median(firsts)
    st = _ratio_stat([x / y for x, y in zip(firsts, gets)])  # rounds: one get, then one first tile
    return {"ref_bytes": ref.nbytes, "tile_bytes": tile_bytes, "one_get_s": g, "first_tile_s": f,
            "first_tile_ratio": st["value"], "first_tile_ratio_stat": st}


# -- 3: RSS --------------------------------------------------------------------------------------
def _rss_consumer(conn, data: bytes, tile_bytes: int, depth: int) -> None:
    with memsem.Runtime() as rt:
        ref = rt.ref(data)
        ref.bytes(0, 4096).get()  # resolve (attach) before the baseline
        base = _rss()
        peak = base
        total = 0
        t = time.perf_counter()
        with rt.pipeline(ref, tile_bytes=tile_bytes, depth=depth, zero_copy=False) as p:
            for tile in p:
                with tile:
                    total += int(tile.raw[::4096].sum())
                    peak = max(peak, _rss())
        conn.send({"baseline_rss": base, "peak_rss": peak, "streamed": ref.nbytes,
                   "seconds": time.perf_counter() - t, "bytes_moved": p.stats.bytes_moved})


def rss_bench(data: bytes, tile_bytes: int, depth: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_rss_consumer, args=(child, data, tile_bytes, depth), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(600):
            raise TimeoutError("RSS consumer did not finish within 600 s")
        r = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    growth = r["peak_rss"] - r["baseline_rss"]
    budget = depth * tile_bytes + 64 * MiB
    r.update(rss_growth_MiB=growth / MiB, rss_budget_MiB=budget / MiB, rss_growth_vs_budget=growth / budget,
             rss_overhead_MiB=(growth - depth * tile_bytes) / MiB)
    return r


# -- driver --------------------------------------------------------------------------------------
def run(quick: bool = True, *, tile_bytes: int = MiB, depth: int = 2,
        overlap_tile_bytes: int = 4 * MiB) -> dict[str, Any]:
    """Measure the three goals; returns the ratios and the raw figures (see module docstring).

    The overlap goal uses ``overlap_tile_bytes`` tiles (4 MiB: a tile hand-off between the mover
    thread and the caller costs ~50 us on a 2-vCPU VM, which 1 MiB tiles moving in ~70 us cannot
    hide); first tile and RSS use ``tile_bytes`` (1 MiB, as the issue states)."""
    from memsem.cli._bench_measure import smoke

    tiny = smoke()
    ref_bytes = (16 if tiny else 64 if quick else 256) * MiB
    stream_bytes = (32 if tiny else 256 if quick else 1024) * MiB
    out: dict[str, Any] = {"quick": quick, "cpus": len(os.sched_getaffinity(0))}
    src = _Source(max(ref_bytes, stream_bytes))
    try:
        with memsem.Runtime() as rt:
            full = rt.ref(src.data)
            ref = full.bytes(0, ref_bytes)
            ov = overlap_bench(rt, ref, overlap_tile_bytes, depth, repeats=2 if tiny else 7 if quick else 15)
            vg = vs_get_bench(rt, full, VS_GET_SIZES[:2] if tiny else VS_GET_SIZES, quick)
            ft = first_tile_bench(rt, ref, tile_bytes, depth, repeats=3 if tiny else 15)
            rss_src = full.bytes(0, stream_bytes).to_bytes()
        rs = rss_bench(rss_src, tile_bytes, depth)
    finally:
        src.close()
    out.update(overlap=ov, vs_get=vg, pipeline_vs_get_min=vg["pipeline_vs_get_min"],
               pipeline_vs_get_alloc_min=vg["pipeline_vs_get_alloc_min"], first_tile=ft, rss=rs,
               pipeline_vs_ideal=ov["pipeline_vs_ideal"], pipeline_speedup_vs_bulk=ov["pipeline_speedup_vs_bulk"],
               first_tile_ratio=ft["first_tile_ratio"], rss_overhead_MiB=rs["rss_overhead_MiB"],
               rss_growth_vs_budget=rs["rss_growth_vs_budget"])
    # [p10, p90] of the per-round ratios behind each figure (``memsem bench``'s ``<key>_spread``)
    for key, st in (("pipeline_vs_ideal", ov["pipeline_vs_ideal_stat"]),
                    ("pipeline_speedup_vs_bulk", ov["pipeline_speedup_vs_bulk_stat"]),
                    ("pipeline_vs_ceiling", ov["pipeline_vs_ceiling_stat"]),
                    ("ceiling_vs_ideal", ov["ceiling_vs_ideal_stat"]),
                    ("first_tile_ratio", ft["first_tile_ratio_stat"]),
                    ("pipeline_vs_get_min", vg["pipeline_vs_get_min_stat"])):
        out[f"{key}_spread"] = None if st["value"] is None else [st["p10"], st["p90"]]
    out["pipeline_vs_ceiling"] = ov["pipeline_vs_ceiling"]
    out["ceiling_vs_ideal"] = ov["ceiling_vs_ideal"]
    return out


def _sp(r: dict[str, Any], key: str) -> str:
    v = r.get(f"{key}_spread")
    return "-" if v is None else f"{v[0]:.2f}..{v[1]:.2f}"


def report(r: dict[str, Any]) -> str:
    ov, ft, rs = r["overlap"], r["first_tile"], r["rss"]
    ms = 1e3

    def fmt(n: int) -> str:
        return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"

    lines = [
        f"memsem pipeline benchmark ({'quick' if r['quick'] else 'full'}, {r['cpus']} CPUs, route {ov['route']}, "
        f"tile {ov['tile_bytes'] // MiB} MiB, depth {ov['depth']})",
        f"  1. {ov['tiles']} tiles, move {ov['move_per_tile_s'] * ms:.3f} ms/tile, compute {ov['compute_per_tile_s'] * ms:.3f} ms/tile",
        f"     pipeline {ov['pipeline_s'] * ms:.1f} ms | ideal {ov['ideal_s'] * ms:.1f} ms | bulk get-then-compute {ov['bulk_s'] * ms:.1f} ms"
        f" | overlap {ov['overlap_ratio']:.2f}",
        f"     pipeline / ideal          = {r['pipeline_vs_ideal']:.3f}x   (goal <= 1.1; rounds p10..p90 "
        f"{_sp(r, 'pipeline_vs_ideal')})",
        f"     bulk / pipeline (speedup) = {r['pipeline_speedup_vs_bulk']:.3f}x   (goal >= 1.7; {_sp(r, 'pipeline_speedup_vs_bulk')})",
        f"     machine ceiling: copy thread || compute, no hand-off = {ov['unsynchronized_s'] * ms:.1f} ms "
        f"({ov['ceiling_vs_ideal']:.2f}x ideal); pipeline / ceiling = {ov['pipeline_vs_ceiling']:.3f}x",
        "     never slower than get-then-compute (automatic tiles, compute ~= move; ratio = get-then-compute / pipeline):",
        *[f"       {fmt(v['bytes']):>8}: {v['tiles']:>3} tile(s), mover {v['mover'] or '-':<6} get-then-compute "
          f"{v['get_then_compute_s'] * ms:8.3f} ms | pipeline {v['pipeline_s'] * ms:8.3f} ms | ratio {v['ratio']:.3f}"
          f" (vs a get into a new array: {v['alloc_ratio']:.3f})" for v in r["vs_get"]["sizes"].values()],
        f"     pipeline_vs_get_min       = {r['pipeline_vs_get_min']:.3f}x   (goal >= 1.0; at "
        f"{fmt(r['vs_get']['pipeline_vs_get_min_bytes'])}, {_sp(r, 'pipeline_vs_get_min')})",
        f"  2. first tile of a {ft['ref_bytes'] // MiB} MiB ref {ft['first_tile_s'] * ms:.3f} ms | one {ft['tile_bytes'] // MiB} MiB get() "
        f"{ft['one_get_s'] * ms:.3f} ms",
        f"     first tile / one get      = {r['first_tile_ratio']:.3f}x   (goal <= 3; {_sp(r, 'first_tile_ratio')})",
        f"  3. streamed {rs['streamed'] // MiB} MiB in {rs['seconds']:.2f} s: RSS growth {rs['rss_growth_MiB']:.1f} MiB | budget "
        f"depth x tile + 64 MiB = {rs['rss_budget_MiB']:.0f} MiB",
        f"     RSS growth / budget       = {r['rss_growth_vs_budget']:.3f}x   (goal <= 1.0; overhead beyond the slots "
        f"{r['rss_overhead_MiB']:.1f} MiB)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memsem pipeline benchmark (issue 3 goals)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (64 MiB refs, 256 MiB stream)")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON too")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--tile-mib", type=int, default=1)
    a = ap.parse_args(argv)
    r = run(a.quick, tile_bytes=a.tile_mib * MiB, depth=a.depth)
    print(report(r))
    if a.json:
        print(json.dumps(r, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
