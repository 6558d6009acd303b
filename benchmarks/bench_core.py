"""Issue 2's benchmark: cross-process get of 64 B and 64 MiB and ``view()`` of a 64 MiB window,
each measured interleaved with ``np.copyto`` of the same size in the same run, with ratios.

Goals (not tests): 64 B get <= 2 us median; 64 MiB get >= 0.9x ``np.copyto``; view O(1)
(``view()`` of 64 MiB costs about what ``view()`` of 64 B costs). A spawned producer process
owns the windows (a shared segment, route host/shm, and private memory, route host/cma).
Thread-count variables (OPENBLAS_NUM_THREADS etc.) do not matter: copies are single-threaded.

    .venv/bin/python benchmarks/bench_core.py [--full]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import memsem
from memsem_bench import measure as M

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="more repetitions (slower, steadier)")
    a = ap.parse_args(argv)
    quick = not a.full
    t0 = time.perf_counter()
    prod = M.Producer([64, 64 * MiB])
    rows = []
    try:
        with memsem.Runtime() as rt:
            for route in ("host/shm", "host/cma"):
                refs = {n: rt.ref(b) for n, b in prod.refs[route].items()}
                shm = {n: rt.ref(b) for n, b in prod.refs["host/shm"].items()}
                got = refs[64].route().kind
                c = M.core_figures(refs[64], refs[64 * MiB], shm[64 * MiB], quick=quick)
                v64 = statistics.median(_view_times(shm[64], 500 if quick else 3000)) / 1e3
                rows.append((route, got, c, v64))
    finally:
        prod.close()
    for route, got, c, v64 in rows:
        print(f"route {route} (runtime chose {got}):")
        g, r = c["get_64B_vs_copyto"], c["get_64MiB_vs_copyto"]
        print(f"  64 B get        {c['get_64B_us']:8.2f} us   np.copyto {c['copyto_64B_us']:6.2f} us   "
              f"ratio {g.value:5.2f}x (rounds p10..p90 {g.p10:.2f}..{g.p90:.2f})   goal <= 2 us: "
              f"{'met' if c['get_64B_us'] <= 2 else 'NOT met'}")
        t = c["get_64B_p99_vs_copyto_p99"]
        print(f"  64 B tails      get p99 {c['get_64B_p99_us']:.2f} p999 {c['get_64B_p999_us']:.2f} us   np.copyto p99 "
              f"{c['copyto_64B_p99_us']:.2f} p999 {c['copyto_64B_p999_us']:.2f} us   p99 ratio {t.value:5.2f}x "
              f"(rounds p10..p90 {t.p10:.2f}..{t.p90:.2f})   goal <= 2: {'met' if t.value <= 2 else 'NOT met'}")
        print(f"  64 MiB get      {c['get_64MiB_GBps']:8.2f} GB/s np.copyto {c['copyto_64MiB_GBps']:6.2f} GB/s "
              f"ratio {r.value:5.2f}x (p10..p90 {r.p10:.2f}..{r.p90:.2f})   goal >= 0.9x: "
              f"{'met' if r.value >= 0.9 else 'NOT met'}")
    route, got, c, v64 = rows[0]
    ratio = c["view_64MiB_us"] / v64
    print(f"view() 64 MiB {c['view_64MiB_us']:.2f} us vs view() 64 B {v64:.2f} us (host/shm): ratio {ratio:.2f}x "
          f"(O(1): {'met' if ratio < 2 else 'NOT met'}); a 64 MiB np.copyto takes "
          f"{64 * MiB / c['copyto_64MiB_GBps'] / 1e3:.0f} us")
    print(f"({time.perf_counter() - t0:.1f} s; ratios are medians of per-round ratios, the two sides interleaved; "
          "on a shared machine compare the ratios)")
    return 0


def _view_times(ref, n: int) -> list[int]:
    out = []
    v = ref.view()
    del v
    for _ in range(n):
        t = time.perf_counter_ns()
        v = ref.view()
        out.append(time.perf_counter_ns() - t)
        del v
    return out


if __name__ == "__main__":
    sys.exit(main())
