"""A follower over tcp beside a trainer committing every step: loads completed per second beside
commits per second, on one node (two node ids, loopback) and across two network namespaces.

    python benchmarks/bench_follow.py [--seconds S] [--mib M] [--json FILE]

Each row: the trainer commits a state dict of M MiB (8 tensors) back to back (step 0 ms) or
after a step's compute (20 ms); the follower is ``Runtime.follow`` with its defaults (every
load pinned at the owner, bit-exact checked). Figures are of this machine in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from memsem_bench import follow as B  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows = []
    print(f"{'link':9} {'MiB':>4} {'step ms':>7} {'commits/s':>9} {'loads/s':>8} {'loads/commit':>12} "
          f"{'trainer blocked':>15} {'bit-exact':>9}")
    for link in ("loopback", "veth"):
        for step_ms in (0.0, 20.0):
            r = B.figures(link, seconds=args.seconds, mib=args.mib, step_ms=step_ms)
            rows.append(r)
            if "skipped" in r:
                print(f"{link:9} skipped: {r['skipped']}")
                break
            print(f"{link:9} {args.mib:>4} {step_ms:>7.0f} {r['commits_per_s']:>9.1f} {r['loads_per_s']:>8.1f} "
                  f"{r['loads_per_s'] / r['commits_per_s']:>12.2f} {r['blocked_s'] / r['seconds']:>14.0%} "
                  f"{'yes' if r['bad'] == 0 else 'NO':>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
