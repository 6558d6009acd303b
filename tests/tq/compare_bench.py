"""Print bench_tq.py results side by side: ``python compare_bench.py A.json B.json ...``.

Each file is one bench_tq.py JSON line; runs of the same backend and workload are summarized by
their median. Prints wall time, loopback bytes and CPU per phase, and memsem's own counters.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

METRICS = ["put_wall_s", "get_wall_s", "clear_wall_s", "put_lo_bytes", "get_lo_bytes",
           "lo_bytes_per_payload_byte", "put_cpu_s", "get_cpu_s"]
MEMSEM = ["put_memsem_agent_alloc_bytes", "put_memsem_agent_registrations", "get_memsem_get_bytes",
          "get_memsem_runs_get", "get_memsem_staged_bytes"]


def main(paths: list[str]) -> int:
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for p in paths:
        with open(p) as f:
            d = json.loads(f.read())
        runs[(d["payload_bytes"], d["backend"])].append(d)
    for (payload, backend), ds in sorted(runs.items()):
        ok = all(d["rows_verified"] == d["rows_expected"] and d["producer_exited_before_get"] for d in ds)
        print(f"payload {payload / 2**20:.1f} MiB  {backend:14s} runs={len(ds)} verified={ok}")
        for m in METRICS + [k for k in MEMSEM if k in ds[0]]:
            vals = [d[m] for d in ds if m in d]
            print(f"    {m:32s} median {statistics.median(vals):>14.4g}   all {vals}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
