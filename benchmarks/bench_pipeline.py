"""Pipeline benchmark: the pipeline's goals measured in one run, as ratios of figures measured
interleaved (round by round: each side once per round, in alternating order), reported as the
median of the per-round ratios with their spread (the 25th and 75th percentiles), so a burst of
foreign load hits both sides of a ratio alike.

1. Overlap, move time ~= compute time per tile (a 64 MiB ref, or 256 MiB in the full run, 4 MiB
   tiles, route host/cma): per round the pipeline, get-everything-then-compute ("bulk"), the
   ideal ``fill + sum(max(move, compute)) + drain`` from that round's own per-tile moves and
   computes, and the **machine ceiling**: one thread copying the tiles and one computing, side by
   side with no hand-off at all (what no pipeline can beat on this machine, at this moment).
   Keys: ``pipeline_vs_ideal`` (goal <= 1.15), ``pipeline_speedup_vs_bulk`` (goal >= 1.7),
   ``ceiling_speedup_vs_bulk``, ``ceiling_vs_ideal``, ``pipeline_vs_ceiling``: measured in 5
   consecutive runs, each key the worst run's (``<key>_runs``: every run's).
1b. Never slower than get-then-compute: for refs of 64 KiB .. 256 MiB on the host/shm and
   host/cma routes, ``rt.pipeline(ref)`` (automatic tiles, automatic view-or-copy) with the
   compute on each tile against one ``get`` into a preallocated array then the same compute over
   the whole ref (compute proportional to the bytes, ~= the move). Key: ``pipeline_vs_get_min``,
   the smallest median ratio get-then-compute / pipeline over sizes and routes (goal >= 0.95);
   ``pipeline_vs_get_min_shm`` / ``_cma`` per route. ``pipeline_fixed_us_shm`` / ``_cma``: what a
   one-tile pipeline costs beyond the get it makes (64 KiB, median of interleaved differences).
2. First-tile latency of a ref with 1 MiB tiles vs one 1 MiB ``get()`` (goal <= 3x).
3. Consumer RSS growth while streaming 1 GiB (256 MiB quick) vs ``depth x tile_bytes + 64 MiB``.

The data lives in a producer process: private memory (route host/cma: one kernel copy per tile,
nothing mapped into the consumer) and a shared segment (route host/shm). ``run(quick=True)``
returns the keys above plus the raw figures and the load average before and after; ``memsem
bench`` calls it.
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
from collections.abc import Callable
from typing import Any

import numpy as np

import memsem
from memsem.pipeline import Pipeline

MiB = 1 << 20
#: sizes of ``pipeline_vs_get_min``: 64 KiB .. 256 MiB, powers of 4
VS_GET_SIZES = [64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
#: routes of ``pipeline_vs_get_min``: window kind in the producer -> route
ROUTES = {"private": "host/cma", "shared": "host/shm"}


# -- processes -----------------------------------------------------------------------------------
def _producer(conn, nbytes: int, kinds: tuple[str, ...]) -> None:
    with memsem.Runtime() as rt:
        refs = {}
        keep = []
        for kind in kinds:
            data = rt.alloc(nbytes, np.uint8) if kind == "shared" else np.empty(nbytes, np.uint8)
            data.view(np.uint32)[:] = np.arange(nbytes // 4, dtype=np.uint32)  # touched, non-trivial
            keep.append(data)
            refs[kind] = rt.publish(data, access="r", name=f"bench-src-{kind}").to_bytes()
        conn.send(refs)
        conn.poll(3600)
        conn.recv()


class _Source:
    """A producer process holding ``nbytes`` in private memory and (``kinds``) a shared segment."""

    def __init__(self, nbytes: int, kinds: tuple[str, ...] = ("private",)) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer, args=(child, nbytes, kinds), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120):
            raise TimeoutError("producer did not publish within 120 s")
        self.refs: dict[str, bytes] = self.conn.recv()
        self.data = self.refs["private"]

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


def _load() -> float:
    return round(os.getloadavg()[0], 2)


# -- interleaving --------------------------------------------------------------------------------
def interleaved(sides: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every side once per round (the order rotates from round to round); each side returns
    its own time in seconds. Returns side -> the times of its rounds, in round order."""
    names = list(sides)
    out: dict[str, list[float]] = {k: [0.0] * rounds for k in names}
    for r in range(rounds):
        k = r % len(names)
        for name in (names[k:] + names[:k]) if r % 2 == 0 else (names[k:] + names[:k])[::-1]:
            out[name][r] = sides[name]()
    return out


def ratio_stats(num: list[float], den: list[float]) -> dict[str, float]:
    """Median of the per-round ratios ``num[r] / den[r]`` and their spread (25th, 75th pct)."""
    rs = sorted(a / b for a, b in zip(num, den) if b > 0)
    if not rs:
        return {"median": float("nan"), "p25": float("nan"), "p75": float("nan"), "rounds": 0}
    q = statistics.quantiles(rs, n=4) if len(rs) >= 2 else [rs[0]] * 3
    return {"median": statistics.median(rs), "p25": q[0], "p75": q[2], "rounds": len(rs)}


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


def _timed(fn: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return run


# -- 1: pipeline vs ideal, vs bulk, vs the machine's ceiling ------------------------------------
def overlap_bench(rt: memsem.Runtime, ref: memsem.TensorRef, tile_bytes: int, depth: int,
                  rounds: int = 9) -> dict[str, Any]:
    """Interleaved rounds of: the ideal (this round's per-tile moves and computes, one after the
    other), the machine ceiling (a copy thread and the compute side by side, no hand-off),
    bulk get-then-compute, and the pipeline. Ratios are medians of per-round ratios."""
    n = ref.num_tiles(tile_bytes)
    spec = ref.spec
    slot = np.zeros(tile_bytes, np.uint8)
    other = np.zeros(tile_bytes, np.uint8)
    whole = np.zeros(spec.nbytes, np.uint8)  # pre-touched: bulk pays no page faults
    get = rt.transfer
    sizes = [min(tile_bytes, spec.nbytes - i * tile_bytes) for i in range(n)]
    get(spec, "get", 0, slot)
    comp = _Compute(tile_bytes)
    comp.calibrate(slot, _median_time(lambda: get(spec, "get", 0, slot), 9))
    ideal: list[float] = []
    move_tiles: list[float] = []
    comp_tiles: list[float] = []
    stats: list[Any] = []

    def run_ideal() -> float:
        mv, cp = [], []
        for i in range(n):
            t = time.perf_counter()
            get(spec, "get", i * tile_bytes, slot[:sizes[i]])
            t1 = time.perf_counter()
            comp(slot)
            mv.append(t1 - t)
            cp.append(time.perf_counter() - t1)
        ideal.append(mv[0] + sum(max(mv[i + 1], cp[i]) for i in range(n - 1)) + cp[-1])
        move_tiles.append(statistics.median(mv))
        comp_tiles.append(statistics.median(cp))
        return ideal[-1]

    def run_ceiling() -> None:
        th = threading.Thread(target=lambda: [get(spec, "get", i * tile_bytes, other[:sizes[i]]) for i in range(n)])
        th.start()
        for _ in range(n):
            comp(slot)
        th.join()

    def run_bulk() -> None:
        get(spec, "get", 0, whole)
        for i in range(n):
            comp(whole[i * tile_bytes:(i + 1) * tile_bytes])

    def run_pipe() -> None:
        with Pipeline(rt, spec, tile_bytes=tile_bytes, depth=depth, zero_copy=False) as p:
            for tile in p:
                with tile:
                    comp(tile.raw)
        stats.append(p.stats)

    t = interleaved({"ideal": run_ideal, "ceiling": _timed(run_ceiling), "bulk": _timed(run_bulk),
                     "pipeline": _timed(run_pipe)}, rounds)
    vs_ideal = ratio_stats(t["pipeline"], t["ideal"])
    speedup = ratio_stats(t["bulk"], t["pipeline"])
    ceil_speedup = ratio_stats(t["bulk"], t["ceiling"])
    ceil_ideal = ratio_stats(t["ceiling"], t["ideal"])
    vs_ceil = ratio_stats(t["pipeline"], t["ceiling"])
    return {"tiles": n, "tile_bytes": tile_bytes, "depth": depth, "compute_units": comp.units, "rounds": rounds,
            "move_per_tile_s": statistics.median(move_tiles), "compute_per_tile_s": statistics.median(comp_tiles),
            "ideal_s": statistics.median(t["ideal"]), "pipeline_s": statistics.median(t["pipeline"]),
            "bulk_s": statistics.median(t["bulk"]), "ceiling_s": statistics.median(t["ceiling"]),
            "pipeline_vs_ideal": vs_ideal["median"], "pipeline_speedup_vs_bulk": speedup["median"],
            "ceiling_speedup_vs_bulk": ceil_speedup["median"], "ceiling_vs_ideal": ceil_ideal["median"],
            "pipeline_vs_ceiling": vs_ceil["median"],
            "spread": {"pipeline_vs_ideal": vs_ideal, "pipeline_speedup_vs_bulk": speedup,
                       "ceiling_speedup_vs_bulk": ceil_speedup, "ceiling_vs_ideal": ceil_ideal,
                       "pipeline_vs_ceiling": vs_ceil},
            "overlap_ratio": statistics.median(s.overlap_ratio for s in stats),
            "caller_tiles": statistics.median(s.caller_tiles for s in stats),
            "late_tiles": statistics.median(getattr(s, "late_tiles", 0) for s in stats), "route": stats[0].route}


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


def vs_get_bench(rt: memsem.Runtime, refs: dict[str, memsem.TensorRef], sizes: list[int],
                 quick: bool) -> dict[str, Any]:
    """For each route and size: get-then-compute (one ``get`` into a preallocated, touched
    array, then the compute over it) against ``rt.pipeline(ref)`` with the compute per tile,
    interleaved rounds. ``ratio`` = median over rounds of get-then-compute / pipeline (>= 1: the
    pipeline does not lose); ``alloc_ratio`` takes ``ref.get()`` (a new array each time, as
    get-then-compute code usually reads) as the baseline instead."""
    out: dict[str, Any] = {}
    for kind, full in refs.items():
        for n in sizes:
            ref = full.bytes(0, n)
            whole = np.empty(n, np.uint8)
            whole[:] = 0
            ref.get(whole)
            comp = _ByteCompute()
            comp.calibrate(whole, _median_time(lambda: ref.get(whole), 7))
            rounds = (300 if n <= 256 << 10 else 100 if n <= MiB else 30 if n <= 16 * MiB else 9 if n <= 64 * MiB
                      else 5) * (1 if quick else 3)
            last: list[Any] = []

            def run_bulk() -> None:
                ref.get(whole)
                comp(whole)

            def run_alloc() -> None:
                comp(ref.get())

            def run_pipe() -> None:
                with rt.pipeline(ref) as p:
                    for tile in p:
                        with tile:
                            comp(tile.raw)
                last[:] = [p]

            run_pipe()
            t = interleaved({"bulk": _timed(run_bulk), "pipeline": _timed(run_pipe), "alloc": _timed(run_alloc)},
                            rounds)
            r, a = ratio_stats(t["bulk"], t["pipeline"]), ratio_stats(t["alloc"], t["pipeline"])
            p = last[0]
            st = p.stats
            out[f"{ROUTES[kind]} {n}"] = {
                "route": st.route, "bytes": n, "get_then_compute_s": statistics.median(t["bulk"]),
                "alloc_get_then_compute_s": statistics.median(t["alloc"]),
                "pipeline_s": statistics.median(t["pipeline"]),
                "ratio": r["median"], "ratio_p25": r["p25"], "ratio_p75": r["p75"], "alloc_ratio": a["median"],
                "tiles": p.n_tiles, "mode": st.mode, "mover": st.mover, "explanation": p.explanation,
                "rounds": rounds}
    res: dict[str, Any] = {"sizes": out,
                           "pipeline_vs_get_min": min(v["ratio"] for v in out.values()),
                           "pipeline_vs_get_alloc_min": min(v["alloc_ratio"] for v in out.values())}
    worst = min(out.values(), key=lambda v: v["ratio"])  # the size and route the minimum comes from
    res["pipeline_vs_get_min_spread"] = [worst["ratio_p25"], worst["ratio_p75"]]
    for route in {v["route"] for v in out.values()}:
        res[f"pipeline_vs_get_min_{route.split('/')[-1]}"] = min(v["ratio"] for v in out.values()
                                                                 if v["route"] == route)
    return res


def fixed_cost_bench(rt: memsem.Runtime, refs: dict[str, memsem.TensorRef], nbytes: int = 64 << 10,
                     rounds: int = 2000) -> dict[str, Any]:
    """What a one-tile pipeline costs beyond the one get it makes: interleaved rounds of a get of
    ``nbytes`` into a preallocated array and of ``rt.pipeline(ref)`` over the same bytes (no
    compute); the median of the per-round differences, in microseconds, per route."""
    out: dict[str, Any] = {}
    for kind, full in refs.items():
        ref = full.bytes(0, nbytes)
        whole = np.empty(nbytes, np.uint8)

        def pipe() -> None:
            with rt.pipeline(ref) as p:
                for tile in p:
                    with tile:
                        pass

        pipe()
        t = interleaved({"get": _timed(lambda: ref.get(whole)), "pipeline": _timed(pipe)}, rounds)
        diffs = sorted(b - a for a, b in zip(t["get"], t["pipeline"]))
        out[ROUTES[kind]] = {"get_us": statistics.median(t["get"]) * 1e6,
                             "pipeline_us": statistics.median(t["pipeline"]) * 1e6,
                             "fixed_us": diffs[len(diffs) // 2] * 1e6}
    return out


# -- 2: first tile -------------------------------------------------------------------------------
def first_tile_bench(rt: memsem.Runtime, ref: memsem.TensorRef, tile_bytes: int, depth: int,
                     rounds: int = 15) -> dict[str, Any]:
    one = ref.bytes(0, tile_bytes)
    one.get()
    firsts: list[float] = []

    def first() -> float:
        p = Pipeline(rt, ref.spec, tile_bytes=tile_bytes, depth=depth, zero_copy=False)
        next(p)
        f = p.stats.first_tile_s
        p.close()
        firsts.append(f)
        return f

    t = interleaved({"get": _timed(one.get), "first": first}, rounds)  # get(): a new 1 MiB array
    r = ratio_stats(t["first"], t["get"])
    return {"ref_bytes": ref.nbytes, "tile_bytes": tile_bytes, "one_get_s": statistics.median(t["get"]),
            "first_tile_s": statistics.median(t["first"]), "first_tile_ratio": r["median"], "spread": r}


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
def run(quick: bool = True, *, tile_bytes: int = MiB, depth: int = 2, overlap_tile_bytes: int = 4 * MiB,
        parts: tuple[str, ...] = ("overlap", "vs_get", "first_tile", "rss"),
        sizes: list[int] | None = None, overlap_runs: int = 5) -> dict[str, Any]:
    """Measure the goals; returns the ratios and the raw figures (see module docstring).

    The overlap is measured in ``overlap_runs`` consecutive runs (each its own rounds): the
    speedups are the lowest run's, the ratios to the ideal and the ceiling the highest run's,
    every run's in ``<key>_runs``.

    The overlap goal uses ``overlap_tile_bytes`` tiles (4 MiB); first tile and RSS use
    ``tile_bytes`` (1 MiB). ``parts`` selects what to measure (the keys of the others are
    absent); ``sizes`` replaces ``VS_GET_SIZES``."""
    sizes = list(VS_GET_SIZES if sizes is None else sizes)
    ref_bytes = (64 if quick else 256) * MiB
    stream_bytes = (256 if quick else 1024) * MiB
    src_bytes = max(ref_bytes, max(sizes) if "vs_get" in parts else 0, stream_bytes if "rss" in parts else 0)
    out: dict[str, Any] = {"quick": quick, "cpus": len(os.sched_getaffinity(0)), "load_before": _load()}
    src = _Source(src_bytes, tuple(ROUTES))
    try:
        with memsem.Runtime() as rt:
            full = rt.ref(src.data)
            ref = full.bytes(0, ref_bytes)
            if "overlap" in parts:
                # ``runs`` consecutive runs (the "in each of 5 consecutive runs"): each key is
                # the worst run's (lowest speedup, highest vs-ideal), its spread that run's; every
                # run's figure in <key>_runs
                runs = [overlap_bench(rt, ref, overlap_tile_bytes, depth, rounds=7 if quick else 15)
                        for _ in range(overlap_runs)]
                out["overlap"] = runs[-1]
                out["overlap_runs"] = runs
                for k in ("pipeline_vs_ideal", "pipeline_speedup_vs_bulk", "ceiling_speedup_vs_bulk",
                          "ceiling_vs_ideal", "pipeline_vs_ceiling"):
                    worse = min if k in ("pipeline_speedup_vs_bulk", "ceiling_speedup_vs_bulk") else max
                    ov = worse(runs, key=lambda r: r[k])
                    out[k] = ov[k]
                    out[f"{k}_runs"] = [r[k] for r in runs]
                    sp = ov["spread"][k]  # memsem bench prints <key>_spread: [p25, p75] of the per-round ratios
                    out[f"{k}_spread"] = [sp["p25"], sp["p75"]]
            if "vs_get" in parts:
                refs = {k: rt.ref(v) for k, v in src.refs.items()}
                vg = out["vs_get"] = vs_get_bench(rt, refs, sizes, quick)
                out.update({k: v for k, v in vg.items() if k.startswith("pipeline_vs_get")})
                fc = out["fixed_cost"] = fixed_cost_bench(rt, refs)
                for route, v in fc.items():
                    out[f"pipeline_fixed_us_{route.split('/')[-1]}"] = v["fixed_us"]
            if "first_tile" in parts:
                ft = out["first_tile"] = first_tile_bench(rt, ref, tile_bytes, depth)
                out["first_tile_ratio"] = ft["first_tile_ratio"]
                out["first_tile_ratio_spread"] = [ft["spread"]["p25"], ft["spread"]["p75"]]
            rss_src = full.bytes(0, stream_bytes).to_bytes() if "rss" in parts else b""
        if "rss" in parts:
            rs = out["rss"] = rss_bench(rss_src, tile_bytes, depth)
            out["rss_overhead_MiB"] = rs["rss_overhead_MiB"]
            out["rss_growth_vs_budget"] = rs["rss_growth_vs_budget"]
    finally:
        src.close()
    out["load_after"] = _load()
    return out


def report(r: dict[str, Any]) -> str:
    ms = 1e3

    def fmt(n: int) -> str:
        return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"

    def spr(k: str) -> str:
        d = r[f"{k}_spread"]
        return f"[{d[0]:.2f}, {d[1]:.2f}]"

    def runs(k: str) -> str:
        return ", ".join(f"{x:.2f}" for x in r.get(f"{k}_runs", [r[k]]))

    lines = [f"memsem pipeline benchmark ({'quick' if r['quick'] else 'full'}, {r['cpus']} CPUs, load average "
             f"{r['load_before']} -> {r['load_after']}; ratios: median of interleaved rounds [25th, 75th pct])"]
    if "overlap" in r:
        ov = r["overlap"]
        lines += [
            f"  1. route {ov['route']}: {ov['tiles']} tiles of {ov['tile_bytes'] // MiB} MiB, depth {ov['depth']}, "
            f"{ov['rounds']} rounds; move {ov['move_per_tile_s'] * ms:.3f} ms/tile, compute "
            f"{ov['compute_per_tile_s'] * ms:.3f} ms/tile",
            f"     pipeline {ov['pipeline_s'] * ms:.1f} ms | ideal {ov['ideal_s'] * ms:.1f} ms | bulk get-then-compute "
            f"{ov['bulk_s'] * ms:.1f} ms | ceiling {ov['ceiling_s'] * ms:.1f} ms | overlap {ov['overlap_ratio']:.2f} | "
            f"tiles by the caller {ov['caller_tiles']:.0f} (taken over {ov['late_tiles']:.0f})",
            f"     pipeline / ideal          = {r['pipeline_vs_ideal']:.3f}x {spr('pipeline_vs_ideal')}"
            f"   (goal <= 1.15 in every run; runs {runs('pipeline_vs_ideal')})",
            f"     bulk / pipeline (speedup) = {r['pipeline_speedup_vs_bulk']:.3f}x "
            f"{spr('pipeline_speedup_vs_bulk')}   (goal >= 1.7 in every run; runs {runs('pipeline_speedup_vs_bulk')})",
            f"     machine ceiling (copy thread || compute, no hand-off): bulk / ceiling = "
            f"{r['ceiling_speedup_vs_bulk']:.3f}x {spr('ceiling_speedup_vs_bulk')}, ceiling / ideal = "
            f"{r['ceiling_vs_ideal']:.3f}x; pipeline / ceiling = {r['pipeline_vs_ceiling']:.3f}x "
            f"{spr('pipeline_vs_ceiling')} (each the worst of the runs; the last run's line above)",
        ]
    if "vs_get" in r:
        lines.append("  1b. never slower than get-then-compute (rt.pipeline(ref), compute ~= move; "
                     "ratio = get-then-compute / pipeline):")
        lines += [f"     {v['route']:>8} {fmt(v['bytes']):>8}: {v['tiles']:>3} tile(s) {v['mode']:<6} mover "
                  f"{v['mover']:<6} get-then-compute {v['get_then_compute_s'] * ms:8.3f} ms | pipeline "
                  f"{v['pipeline_s'] * ms:8.3f} ms | ratio {v['ratio']:.3f} [{v['ratio_p25']:.2f}, "
                  f"{v['ratio_p75']:.2f}] (vs a get into a new array: {v['alloc_ratio']:.3f})"
                  for v in r["vs_get"]["sizes"].values()]
        per = ", ".join(f"{k[len('pipeline_vs_get_min_'):]} {v:.3f}" for k, v in r.items()
                        if k.startswith("pipeline_vs_get_min_") and not k.endswith("_spread"))
        lines.append(f"     pipeline_vs_get_min       = {r['pipeline_vs_get_min']:.3f}x ({per})   (goal >= 0.95)")
        lines += [f"     one-tile pipeline beyond its get ({k}, 64 KiB): {v['fixed_us']:.1f} us "
                  f"(get {v['get_us']:.1f} us, "
                  f"pipeline {v['pipeline_us']:.1f} us)" for k, v in r.get("fixed_cost", {}).items()]
    if "first_tile" in r:
        ft = r["first_tile"]
        lines += [f"  2. first tile of a {ft['ref_bytes'] // MiB} MiB ref {ft['first_tile_s'] * ms:.3f} ms | one "
                  f"{ft['tile_bytes'] // MiB} MiB get() {ft['one_get_s'] * ms:.3f} ms",
                  f"     first tile / one get      = {r['first_tile_ratio']:.3f}x [{ft['spread']['p25']:.2f}, {ft['spread']['p75']:.2f}]   (goal <= 3)"]
    if "rss" in r:
        rs = r["rss"]
        lines += [f"  3. streamed {rs['streamed'] // MiB} MiB in {rs['seconds']:.2f} s: RSS growth "
                  f"{rs['rss_growth_MiB']:.1f} MiB | budget depth x tile + 64 MiB = {rs['rss_budget_MiB']:.0f} MiB",
                  f"     RSS growth / budget       = {r['rss_growth_vs_budget']:.3f}x   (goal <= 1.0; overhead "
                  f"beyond the slots {r['rss_overhead_MiB']:.1f} MiB)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memsem pipeline benchmark")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (64 MiB refs, 256 MiB stream)")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON too")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--tile-mib", type=int, default=1)
    ap.add_argument("--parts", default="overlap,vs_get,first_tile,rss",
                    help="comma-separated: overlap, vs_get, first_tile, rss")
    ap.add_argument("--sizes", default="", help="comma-separated byte counts for vs_get (default 64 KiB .. 256 MiB)")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")] if a.sizes else None
    r = run(a.quick, tile_bytes=a.tile_mib * MiB, depth=a.depth, parts=tuple(a.parts.split(",")), sizes=sizes)
    print(report(r))
    if a.json:
        print(json.dumps(r, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
