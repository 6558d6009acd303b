"""First sync: where a consumer's first copy of a state dict into fresh tensors spends its time.

An owner process publishes a state dict shaped like a model's (2 x 64 MiB, 62 x 2 MiB and 64
small tensors, ~252 MiB) once as one state-dict window and once as one window per tensor. A
fresh consumer process measures, phase by phase:

* ``runtime_start``: ``memsem.Runtime()`` (gc of dead processes' leftovers, directory, rank);
* ``first_resolution``: the state-dict window's first resolution and layout (directory record,
  key check, owner liveness, control block and segment mapped, in-flight slot, plan);
* ``first_load`` into tensors from ``empty_like()`` (memsem's allocation: one huge-page mapping)
  and ``first_load_4k`` into tensors from plain ``np.empty`` per tensor (4 KiB pages below 4 MiB);
* ``dst_fault_only``: first touch of the same amount of fresh ``np.empty`` memory, no copy at
  all (the destination's own cost);
* ``steady_load``: the same load again (nothing left to fault);
* ``new_mapping_load``: a second runtime's first load into touched tensors (its own resolution
  and mapping of the segment: the source mapping's page faults);
* ``per_tensor_resolve`` / ``per_tensor_first_get`` / ``per_tensor_steady_get`` /
  ``per_tensor_new_mapping_get``: the same for the one-window-per-tensor layout.

    .venv/bin/python benchmarks/bench_first_sync.py [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np

MiB = 1 << 20
SHAPES = [(4096, 4096)] * 2 + [(1024, 512)] * 62 + [(512,)] * 64


def _owner(conn: Any) -> None:
    import memsem

    with memsem.Runtime() as rt:
        sd = {f"layer{i}.w": np.full(s, i, np.float32) for i, s in enumerate(SHAPES)}
        ref = rt.publish_state_dict(sd, name="first-sync/sd")
        tensors = {}
        for k, v in sd.items():
            a = rt.alloc(v.shape, np.float32)
            a[...] = v
            tensors[k] = rt.publish(a, name=f"first-sync/t/{k}").to_bytes()
        conn.send({"sd": ref.to_bytes(), "tensors": tensors})
        conn.recv()


def _consumer(conn: Any, refs: dict[str, Any]) -> None:
    import memsem
    from memsem.sync._state_dict import StateDictRef

    now = time.perf_counter
    T: dict[str, float] = {}
    t = now()
    rt = memsem.Runtime()
    T["runtime_start"] = now() - t
    t = now()
    sd = StateDictRef.from_bytes(refs["sd"], rt)
    lay = sd.layout
    T["first_resolution"] = now() - t
    into = sd.empty_like("numpy")
    t = now()
    sd.load(into)
    T["first_load"] = now() - t
    t = now()
    sd.load(into)
    T["steady_load"] = now() - t
    plain = {e.name: np.empty(e.shape, e.dtype) for e in lay.entries}
    t = now()
    sd.load(plain)
    T["first_load_4k"] = now() - t
    t = now()
    for e in lay.entries:
        np.empty(e.shape, e.dtype).fill(0)
    T["dst_fault_only"] = now() - t
    with memsem.Runtime() as rt2:
        sd2 = StateDictRef.from_bytes(refs["sd"], rt2)
        sd2.layout
        t = now()
        sd2.load(into)
        T["new_mapping_load"] = now() - t
        route = rt2.route(sd2).kind
    with memsem.Runtime() as rt3:
        trefs = {k: rt3.ref(b) for k, b in refs["tensors"].items()}
        t = now()
        for r in trefs.values():
            r.route()
        T["per_tensor_resolve"] = now() - t
        outs = {k: np.empty(r.shape, np.float32) for k, r in trefs.items()}
        t = now()
        for k, r in trefs.items():
            r.get(outs[k])
        T["per_tensor_first_get"] = now() - t
        t = now()
        for k, r in trefs.items():
            r.get(outs[k])
        T["per_tensor_steady_get"] = now() - t
    with memsem.Runtime() as rt4:  # fresh resolutions and mappings, touched destinations
        trefs = {k: rt4.ref(b) for k, b in refs["tensors"].items()}
        for r in trefs.values():
            r.route()
        t = now()
        for k, r in trefs.items():
            r.get(outs[k])
        T["per_tensor_new_mapping_get"] = now() - t
    rt.close()
    conn.send((sd.nbytes, route, len(lay.entries), T))


def run() -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(b,), daemon=True)
    owner.start()
    try:
        if not a.poll(300):
            raise TimeoutError("owner did not publish within 300 s")
        refs = a.recv()
        c, d = ctx.Pipe()
        cons = ctx.Process(target=_consumer, args=(d, refs), daemon=True)
        cons.start()
        if not c.poll(300):
            raise TimeoutError("consumer did not finish within 300 s")
        n, route, k, T = c.recv()
        cons.join(30)
    finally:
        try:
            a.send("exit")
        except OSError:
            pass
        owner.join(30)
        if owner.is_alive():
            owner.kill()
    return {"bytes": n, "tensors": k, "route": route, "seconds": T,
            "first_load_GBps": n / T["first_load"] / 1e9, "first_load_4k_GBps": n / T["first_load_4k"] / 1e9,
            "steady_GBps": n / T["steady_load"] / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = run()
    T = r["seconds"]
    print(f"state dict {r['bytes'] / MiB:.0f} MiB in {r['tensors']} tensors, route {r['route']}")
    for k, v in T.items():
        print(f"  {k:22s} {v * 1e3:9.2f} ms")
    print(f"  first load {r['first_load_GBps']:.2f} GB/s (huge-page destination), {r['first_load_4k_GBps']:.2f} GB/s "
          f"(np.empty per tensor); steady {r['steady_GBps']:.2f} GB/s")
    if a.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
