"""A trainer "node" for the RL data-plane test: consumes micro-batches of a FieldSet owned by a
producer on another node, each as soon as its rows are ready in every field.

    python _trainer.py      reads {"set": hex, "micro_tiles": k, "timeout": s} on stdin, then
                            prints one JSON line per micro-batch ({"mb": i, "sums": {...},
                            "rows": [a, b]}) and {"done": true, "route": ...} at the end

One pipeline per field (``FieldRef.pipeline``: ready words across nodes), iterated in lockstep:
micro-batch i is tiles i of every field. Every wait is bounded by ``timeout``.
"""
from __future__ import annotations

import contextlib
import json
import sys
import traceback

import numpy as np

import memsem


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    with memsem.Runtime(engines=("loopback", "host", "tcp"), timeout=float(cfg.get("timeout", 60))) as rt:
        try:
            fs = memsem.FieldSet.from_bytes(bytes.fromhex(cfg["set"]), rt)
            names = sorted(fs)
            route = rt.route(fs[names[0]]).kind
            with contextlib.ExitStack() as stack:
                pipes = [stack.enter_context(fs[n].pipeline(tiles_per_step=cfg["micro_tiles"],
                                                            timeout=float(cfg.get("timeout", 60))))
                         for n in names]
                for i, tiles in enumerate(zip(*pipes)):
                    sums = {n: float(np.asarray(t.array, np.float64).sum()) for n, t in zip(names, tiles)}
                    firsts = {n: float(np.asarray(t.array).ravel()[0]) for n, t in zip(names, tiles)}
                    rows = list(tiles[0].rows)
                    for t in tiles:
                        t.release()
                    say(mb=i, sums=sums, firsts=firsts, rows=rows)
            say(done=True, route=route, stats=str(rt.stats())[:300])
        except Exception as exc:
            say(error=type(exc).__name__, msg=str(exc), tb=traceback.format_exc()[-3000:])
            sys.exit(1)


if __name__ == "__main__":
    main()
