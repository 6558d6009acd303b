"""``memsem topo``: what this machine has and which route each case takes."""
from __future__ import annotations

import json
import os

import numpy as np

from memsem import native
from memsem.engines import engine_class, engine_names
from memsem.engines.host import HostEngine


def probe_engines() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for name in engine_names():
        try:
            cls = engine_class(name)
            avail = cls.probe()
            out[name] = {"available": bool(avail), "reason": avail.reason}
        except Exception as exc:  # an engine that cannot even be imported is reported, not fatal
            out[name] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    cma = HostEngine.cma_availability()
    out["host"]["cross_memory_attach"] = bool(cma)
    if not cma:
        out["host"]["reason"] = (out["host"]["reason"] + "; " if out["host"]["reason"] else "") + cma.reason
    return out


def run_topo(args) -> int:
    from memsem import Runtime

    engines = probe_engines()
    info: dict[str, object] = {
        "node": native.node_id(), "pid": os.getpid(), "segment_dir": native.segment_dir(),
        "engines": engines, "routes": {},
    }
    from memsem import NotSupportedError
    from memsem.core import default_engines
    from memsem.topology import Location, choose_route

    # The engines a Runtime enables by default, plus the cross-node ones available here, so
    # that the windows carry their descriptors and the "another node" route can be shown.
    names = default_engines()
    names += [n for n in ("tcp", "rdma") if n not in names and engines.get(n, {}).get("available")]
    with Runtime(engines=names) as rt:
        priv = rt.publish(np.zeros(1 << 20, np.uint8), )  # unnamed: two topo runs of one job never meet
        shm = rt.alloc(1 << 20, np.uint8)
        shared = rt.publish(shm)
        routes: dict[str, object] = {"same process": rt.route(priv)}
        # What a process elsewhere would get: reason from the other side's point of view.
        for label, ref, where in (("same node, private memory", priv, native.node_id()),
                                  ("same node, shared segment", shared, native.node_id()),
                                  ("another node", shared, "(another node)")):
            res = rt.resolve(ref.spec)
            try:
                routes[label] = choose_route(Location(where, -1, {}), Location(res.info.node, res.info.owner_pid),
                                             res.info.descriptors, rt.available, nbytes=ref.nbytes)
            except NotSupportedError as exc:
                routes[label] = str(exc)
        for label, r in routes.items():
            if isinstance(r, str):
                info["routes"][label] = {"engine": None, "kind": None, "reason": r}
                continue
            info["routes"][label] = {"engine": r.engine, "kind": r.kind, "reason": r.reason,
                                     "alpha_us": r.alpha * 1e6, "beta_GBps": r.beta / 1e9,
                                     "cost_1MiB_us": r.cost(1 << 20) * 1e6, "zero_copy": r.zero_copy}
        info["engines_enabled"] = names
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"node {info['node']}  pid {info['pid']}  segments in {info['segment_dir']}")
    print("engines:")
    for name, e in engines.items():
        state = "available" if e["available"] else "unavailable"
        print(f"  {name:9s} {state}{': ' + str(e['reason']) if e['reason'] else ''}")
    print(f"routes (modeled cost of 1 MiB; engines {','.join(info['engines_enabled'])}):")
    for label, r in info["routes"].items():
        if r["kind"] is None:
            print(f"  {label:28s} -> none       ({r['reason']})")
            continue
        print(f"  {label:28s} -> {r['kind']:9s} {r['cost_1MiB_us']:8.1f} us  "
              f"view: {'zero-copy' if r['zero_copy'] else 'no'}  ({r['reason']})")
    if "tcp" in info["engines_enabled"] and "tcp" not in default_engines():
        print("  (another node: a Runtime enables tcp with engines=[..., 'tcp'] or MEMSEM_ENGINES=loopback,host,tcp;\n"
              "   across nodes it also needs a redis:// directory, and MEMSEM_TCP_HOST where the address\n"
              "   that routes to the directory is not the one peers reach: docs/many-nodes.md)")
    return 0
