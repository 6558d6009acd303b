"""memsem's tcp route against a plain-socket request/response baseline, same run, per link.

    python benchmarks/bench_tcp.py [--full] [--placement apart|shared|none] [--json FILE]

For each link (loopback, and a veth pair between two network namespaces when run as root) a
producer "node" and a consumer "node" (different MEMSEM_NODE_ID, so the route is tcp) measure,
interleaved in one run (``memsem_bench.tcp``):

* 64 B: ``TensorRef.get(out=)`` through the whole runtime path, and one request/response on a
  plain blocking socket (TCP_NODELAY, ``recv_into``) to a server thread in the producer;
* 64 MiB: the same two (memsem: pipelined 1 MiB chunks, each bracketed at the owner);
* the first tile of a pipeline (``wait_ready=True``) over a remote 256 MiB window in 1 MiB
  tiles, over one 1 MiB remote get;
* the 64 B rounds again with both processes on one CPU (what a round trip costs in CPU).

``--placement`` (``memsem_bench.tcp.placement_cpus``): "apart" (default) runs the owner's side on one
CPU and the consumer's on another, the model of two nodes; "shared" both on one CPU; "none" lets
the scheduler place them (the plain socket's 64 B round trip then swings 13-60 us between runs
here, with the placement).

Goals (issues 14, 24; ratios of interleaved rounds in the same run, not tests): tcp 64 B get
<= 1.3 x the socket round trip, 64 MiB >= 1.0 x the socket's throughput, remote first tile <= 3 x
one tile get.
GB/s = 1e9 bytes/s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from memsem_bench import tcp as B  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="more iterations (default: the quick run)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--placement", default="apart", choices=("apart", "shared", "none"),
                    help="the CPUs of the main run (default: apart, one for each side)")
    args = ap.parse_args()
    results = {}
    for link in ("loopback", "veth"):
        fig, note = B.figures(quick=not args.full, link=link, placement=args.placement)
        results[link] = {"figures": fig, "note": note, "goals": B.goals_met(fig)}
    print(f"memsem tcp vs a plain socket, same run ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    print(f"{'link':9} {'64 B get us':>12} {'socket us':>10} {'lo us':>7} {'ratio [p10..p90]':>18} "
          f"{'64 MiB GB/s':>12} {'socket':>7} {'ratio [p10..p90]':>18} {'first tile':>11}")

    def rs(f: dict, k: str) -> str:
        sp = f.get(f"{k}_spread")
        return f"{f[k]:.2f} [{sp[0]:.2f}..{sp[1]:.2f}]" if sp else f"{f[k]:.2f}"

    for link, r in results.items():
        f = r["figures"]
        if f.get("tcp_get_64B_us") is None:
            print(f"{link:9} skipped: {r['note']}")
            continue
        lo = f.get("socket_rtt_64B_us_loopback")
        print(f"{link:9} {f['tcp_get_64B_us']:12.1f} {f['socket_rtt_64B_us']:10.1f} "
              f"{'-' if lo is None else f'{lo:.1f}':>7} {rs(f, 'tcp_get_64B_vs_socket'):>18} "
              f"{f['tcp_get_64MiB_GBps']:12.2f} {f['socket_64MiB_GBps']:7.2f} {rs(f, 'tcp_get_64MiB_vs_socket'):>18} "
              f"{rs(f, 'remote_first_tile_ratio'):>11}")
        if f.get("tcp_get_64B_us_one_core") is not None:
            print(f"{'':9} one CPU: {f['tcp_get_64B_us_one_core']:.1f} us against {f['socket_rtt_64B_us_one_core']:.1f} "
                  f"us, {rs(f, 'tcp_get_64B_vs_socket_one_core')} ({f['tcp_placement']} in the main run)")
        if f.get("tcp_get_64B_p99_us") is not None:
            print(f"{'':9} tails, every call of the 64 B rounds: get p99 {f['tcp_get_64B_p99_us']:.1f} p999 "
                  f"{f['tcp_get_64B_p999_us']:.1f} us, socket p99 {f['socket_rtt_64B_p99_us']:.1f} p999 "
                  f"{f['socket_rtt_64B_p999_us']:.1f} us; p99 / p99 {rs(f, 'tcp_get_64B_p99_vs_socket_p99')}")
    print("ratios: medians of per-round ratios, both sides interleaved; 'lo': the same plain socket on the "
          "consumer's own loopback (veth runs)")
    for key, goal in B.GOALS.items():
        verdicts = ", ".join(f"{link}: {'met' if r['goals'][key] else 'NOT met' if r['goals'][key] is False else 'n/a'}"
                             for link, r in results.items())
        print(f"goal {key:24} {goal:30} {verdicts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
