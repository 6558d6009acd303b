"""Bounded resources under churn (issue 12, class 5): fds, mappings and RSS stay within small
constants over 10^5 publish/unpublish cycles at RLIMIT_NOFILE 1024, and for a consumer reading
10^4 short-lived windows. Cycles/s are printed (figures for the closing note; not asserted)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CYCLES = int(os.environ.get("MEMSEM_CHURN_CYCLES", "100000"))
WINDOWS = int(os.environ.get("MEMSEM_CHURN_WINDOWS", "10000"))

_PROBE = """
import os, resource
def fds(): return len(os.listdir('/proc/self/fd'))
def maps():
    with open('/proc/self/maps') as f: return sum(1 for _ in f)
def rss_kib():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'): return int(line.split()[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
"""


def _run(body: str, timeout: float = 1200.0) -> dict:
    code = _PROBE + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ})
    assert p.returncode == 0, f"churn script failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_publish_unpublish_cycles_stay_bounded():
    out = _run(f"""
        import json, time
        import numpy as np
        import memsem
        N = {CYCLES}
        with memsem.Runtime(timeout=5) as rt:
            a = np.zeros(4096, np.uint8)
            sh = rt.alloc(4096, np.uint8)
            for i in range(200):  # warm up: caches, lazy imports
                rt.unpublish(rt.publish(a))
            base = (fds(), maps(), rss_kib())
            peak = list(base)
            t0 = time.perf_counter()
            for i in range(N):
                obj = sh if i % 3 == 0 else a
                r = rt.publish(obj, name="w") if i % 2 else rt.publish(obj)
                if i % 10 == 0:
                    r.get()
                rt.unpublish(r)
                if i % 1000 == 0:
                    peak = [max(peak[0], fds()), max(peak[1], maps()), max(peak[2], rss_kib())]
            dt = time.perf_counter() - t0
        print(json.dumps({{"cycles_per_s": N / dt, "base": base, "peak": peak, "end": [fds(), maps(), rss_kib()]}}))
    """)
    print(f"\nchurn: {CYCLES} publish/unpublish cycles at {out['cycles_per_s']:.0f} cycles/s; "
          f"fds {out['base'][0]} -> peak {out['peak'][0]}, maps {out['base'][1]} -> peak {out['peak'][1]}, "
          f"RSS {out['base'][2]} -> peak {out['peak'][2]} KiB")
    assert out["peak"][0] <= out["base"][0] + 4, out
    assert out["peak"][1] <= out["base"][1] + 16, out
    assert out["peak"][2] <= out["base"][2] + 32 * 1024, out  # 32 MiB of slack for allocator noise


@pytest.mark.slow
def test_consumer_of_many_short_lived_windows_stays_bounded():
    out = _run(f"""
        import json, os, time, multiprocessing as mp
        import numpy as np
        import memsem

        def owner(conn, n):
            with memsem.Runtime(timeout=5) as rt:
                for b in range(0, n, 100):
                    refs = []
                    for k in range(100):
                        arr = rt.alloc(8192, np.uint8) if k % 2 else np.full(8192, k % 251, np.uint8)
                        arr[:] = k % 251
                        refs.append((rt.publish(arr), arr))
                    conn.send([r.to_bytes() for r, _ in refs])
                    assert conn.recv() == "read"
                    for r, _ in refs:
                        rt.unpublish(r)
                conn.send(None)

        if __name__ == "__main__":
            ctx = mp.get_context("fork")  # -c code: spawn could not import owner()
            a, b = ctx.Pipe()
            p = ctx.Process(target=owner, args=(b, {WINDOWS}))
            p.start()
            with memsem.Runtime(timeout=5) as rt:
                base = (fds(), maps(), rss_kib())
                peak = list(base)
                t0 = time.perf_counter()
                n = 0
                while True:
                    batch = a.recv()
                    if batch is None:
                        break
                    for k, rb in enumerate(batch):
                        got = rt.ref(rb).get()
                        assert (got == k % 251).all()
                        n += 1
                    a.send("read")
                    peak = [max(peak[0], fds()), max(peak[1], maps()), max(peak[2], rss_kib())]
                dt = time.perf_counter() - t0
                res = rt.stats().resolutions
            p.join(60)
            print(json.dumps({{"windows": n, "per_s": n / dt, "base": base, "peak": peak, "cached": res}}))
    """)
    print(f"\nconsumer: {out['windows']} short-lived windows read at {out['per_s']:.0f}/s; fds "
          f"{out['base'][0]} -> peak {out['peak'][0]}, maps {out['base'][1]} -> peak {out['peak'][1]}, "
          f"RSS {out['base'][2]} -> peak {out['peak'][2]} KiB, {out['cached']} resolutions cached at the end")
    assert out["windows"] == WINDOWS
    assert out["peak"][0] <= out["base"][0] + 8, out
    assert out["peak"][1] <= out["base"][1] + 2 * 128 + 16, out  # at most RESOLUTION_LIMIT resolutions
    assert out["peak"][2] <= out["base"][2] + 64 * 1024, out


@pytest.mark.parametrize("working_set, limit, cap", [(20, 4, 32), (6, 8, 64), (34, 4, 32), (40, 4, 32)])
def test_the_resolution_bound_follows_a_working_set_of_live_windows(working_set, limit, cap):
    """A consumer reading the same live windows in turn: each window dropped for the bound and
    asked for again doubles the bound (up to its cap), so from the third pass on nothing is
    resolved again when the working set fits the cap. A working set past the cap misses on
    every get whatever the bound: it grows to the cap when the ghosts saw a window again, and not
    at all when even they could not hold the working set. Windows each read once (the churn
    above) never grow it."""
    import numpy as np

    import memsem

    with memsem.Runtime(timeout=10) as owner, memsem.Runtime(timeout=10) as consumer:
        arrays = [owner.alloc(64, np.uint8) for _ in range(working_set)]
        for i, a in enumerate(arrays):
            a[:] = i
        refs = [consumer.ref(owner.publish(a, access="r").to_bytes()) for a in arrays]
        resolver = consumer.resolver
        resolver.limit, resolver.cap = limit, cap
        made = []
        real_make = resolver._make

        def counting_make(spec, *args, **kwargs):
            made.append(spec.gva)
            return real_make(spec, *args, **kwargs)

        resolver._make = counting_make
        out = np.empty(64, np.uint8)
        per_pass = []
        for _ in range(4):
            before = len(made)
            for i, r in enumerate(refs):
                r.get(out)
                assert (out == i).all()
            per_pass.append(len(made) - before)
        assert per_pass[0] == working_set  # the first pass resolves every window once
        if working_set <= limit:
            assert per_pass[1:] == [0, 0, 0] and resolver.grown == 0 and resolver.limit == limit
        elif working_set <= cap:
            assert per_pass[2:] == [0, 0], per_pass
            assert limit < resolver.limit <= cap and resolver.limit >= working_set
            assert len(resolver.cache) == working_set
        else:
            assert per_pass[3] == working_set, per_pass  # in turn past the bound: every get misses
            if working_set <= cap + limit:  # the ghosts (cap of them) held windows read again
                assert resolver.limit == cap and len(resolver.cache) == cap
            else:
                assert resolver.limit == limit and resolver.grown == 0
