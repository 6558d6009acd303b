"""Versioned weight sync: memsem vs torch.distributed gloo broadcast vs Ray's object store.

A synthetic state dict (~1 GB of ~300 mixed bf16/fp32 tensors; ``--quick``: 256 MB) from one
trainer to 1, 2 and 4 rollout processes on this machine, every figure measured in this run (see
``memsem_bench.weights`` for what each one times). Prints one JSON object (the keys of
``memsem bench --json`` for weight sync) and the goals of issue 13 beside them.

    python benchmarks/bench_weight_sync.py [--quick] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys


def run(quick: bool = True) -> dict:
    from memsem_bench.weights import weight_sync_keys

    notes: list[str] = []
    fig = weight_sync_keys(quick, notes)
    fig["notes"] = notes
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="256 MB instead of ~1 GB")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    a = p.parse_args(argv)
    from memsem_bench.weights import WEIGHT_GOALS, weight_goals_met

    fig = run(a.quick)
    if a.json:
        print(json.dumps(fig))
        return 0
    met = weight_goals_met(fig)
    for k, v in fig.items():
        if k == "notes":
            continue
        goal = WEIGHT_GOALS.get(k, "")
        flag = "" if k not in met or met[k] is None else ("  met" if met[k] else "  NOT met")
        print(f"{k:34} {v!s:>12}  {goal}{flag}")
    for n in fig["notes"]:
        print(f"note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
