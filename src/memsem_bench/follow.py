"""A follower over tcp beside a trainer that commits every step (issue 22): loads completed per
second beside the trainer's commits per second, on one node (two node ids: every byte over
tcp on loopback) and across a veth pair between two network namespaces.

The trainer publishes a state dict (``tensors`` int64 tensors of ``mib`` MiB in all, each
version's bytes being the version) and commits write sections back to back, or one every
``step_ms`` (a training step's compute); the follower is ``Runtime.follow`` with its defaults
(each load pinned at the owner), checks every load bit-exact and counts. Both run ``seconds``.

    python -m memsem_bench.follow --role trainer|follower ...   (one node of the pair)
    memsem_bench.follow.figures(link, ...)                       (both, and the figures)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from typing import Any

from memsem_bench.tcp import namespaces_possible, veth_pair

ENGINES = ("loopback", "host", "tcp")


def _trainer(a: argparse.Namespace) -> None:
    import numpy as np

    import memsem

    n = max(1, (a.mib << 20) // 8 // a.tensors)
    with memsem.Runtime(engines=ENGINES, timeout=60) as rt:
        sd = rt.publish_state_dict({f"t{i}": np.ones(n, np.int64) for i in range(a.tensors)}, name="policy")
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # go
        t0 = time.monotonic()
        commits, blocked = 0, 0.0
        while time.monotonic() - t0 < a.seconds:
            if a.step_ms:
                time.sleep(a.step_ms / 1000)  # the step's compute
            with sd.write_section(copy=False) as sec:
                for t in sec.tensors.values():
                    t[...] = sec.version
            blocked += sec.blocked_s
            commits += 1
        print(json.dumps({"commits": commits, "seconds": time.monotonic() - t0, "blocked_s": blocked,
                          "last": sd.version()}), flush=True)
        sys.stdin.readline()  # the follower is done


def _follower(a: argparse.Namespace) -> None:
    import memsem

    with memsem.Runtime(engines=ENGINES, timeout=60) as rt:
        f = rt.follow("policy", timeout=max(5.0, a.seconds))
        v, tensors = next(f)  # warm: the first load allocates and resolves
        print(json.dumps({"ready": True, "route": rt.route(f.ref).kind}), flush=True)
        sys.stdin.readline()  # go
        t0 = time.monotonic()
        loads = bad = 0
        first = f.version
        try:
            for v, tensors in f:
                bad += sum(1 for t in tensors.values() if not (t == v).all())
                loads += 1
                if time.monotonic() - t0 >= a.seconds:
                    break
        except memsem.MemsemTimeoutError:
            pass  # the trainer stopped committing first (its run is over)
        print(json.dumps({"loads": loads, "seconds": time.monotonic() - t0, "bad": bad, "skipped": f.skipped,
                          "versions": f.version - first, "recovered": len(f.recovered)}), flush=True)


def _line(p: subprocess.Popen, what: str) -> dict:
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} failed: {p.stderr.read()[-2000:]}")
    return json.loads(line)


def figures(link: str = "loopback", *, seconds: float = 5.0, mib: int = 16, tensors: int = 8,
            step_ms: float = 0.0) -> dict[str, Any]:
    """Run a trainer and a follower for ``seconds`` and return their figures: ``commits_per_s``,
    ``loads_per_s``, ``bad`` (loads not bit-exact), ``versions_skipped``, ``blocked_s`` (trainer time
    waiting for the follower's pins), ``route``; ``link``: "loopback" (one node, two node ids)
    or "veth" (two network namespaces; {"skipped": why} when they cannot be made here)."""
    if link not in ("loopback", "veth"):
        raise ValueError(f"link must be 'loopback' or 'veth', got {link!r}")
    why = namespaces_possible() if link == "veth" else None
    if why:
        return {"link": link, "skipped": why}
    me = [sys.executable, "-m", "memsem_bench.follow", "--seconds", str(seconds), "--mib", str(mib),
          "--tensors", str(tensors), "--step-ms", str(step_ms)]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    env = dict(os.environ, MEMSEM_JOB=f"benchfollow{os.getpid()}{secrets.token_hex(2)}", MEMSEM_DIRECTORY="local")
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    with contextlib.ExitStack() as stack:
        pa, pb, host = stack.enter_context(veth_pair()) if link == "veth" else ([], [], "127.0.0.1")
        tr = subprocess.Popen(pa + me + ["--role", "trainer"], env=dict(env, MEMSEM_NODE_ID="follow-a",
                                                                       MEMSEM_TCP_HOST=host), **pipes)
        fo = None
        try:
            _line(tr, "trainer")
            fo = subprocess.Popen(pb + me + ["--role", "follower"], env=dict(env, MEMSEM_NODE_ID="follow-b"), **pipes)
            ready = _line(fo, "follower")
            for p in (tr, fo):
                p.stdin.write("\n")
                p.stdin.flush()
            got = _line(fo, "follower")
            trained = _line(tr, "trainer")
            tr.stdin.write("\n")
            tr.stdin.flush()
        finally:
            for p in (fo, tr):
                if p is None:
                    continue
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
    return {"link": link, "route": ready["route"], "mib": mib, "step_ms": step_ms,
            "commits_per_s": trained["commits"] / trained["seconds"], "loads_per_s": got["loads"] / got["seconds"],
            "loads": got["loads"], "commits": trained["commits"], "bad": got["bad"], "versions_skipped": got["skipped"],
            "blocked_s": trained["blocked_s"], "seconds": trained["seconds"], "recovered": got["recovered"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("trainer", "follower"), required=True)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=0.0)
    a = ap.parse_args(argv)
    (_trainer if a.role == "trainer" else _follower)(a)


if __name__ == "__main__":
    main()
