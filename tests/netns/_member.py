"""Processes of the membership tests (test_membership.py): owners and consumers that keep
working while the redis directory is stopped and continued.

    python _member.py owner      publish window "w-<pid>" (4096 float32, 0..4095), print its ref, rank
                                 and incarnation (one JSON line), then obey JSON commands on stdin:
                                 stats, holders, exit
    python _member.py consumer   read {"refs": {name: hex}} on stdin, resolve every ref, hold a
                                 lease (until released) on "live", get every ref in a loop in a
                                 thread, counting outcomes by phase; commands: phase, report,
                                 fresh, exit

Environment: MEMSEM_DIRECTORY (redis://...), MEMSEM_NODE_ID, MEMSEM_JOB, MEMSEM_JOB_SECRET,
MEMSEM_HEARTBEAT_TTL. Every wait has a timeout.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import traceback

import numpy as np

import memsem
from memsem import Runtime

ENGINES = ("loopback", "host", "tcp")
N = 4096
WANT = float(np.arange(N, dtype=np.float64).sum())


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _stats(rt: Runtime) -> dict:
    d = rt.directory
    return {"reclaims": d.reclaims, "restored": d.restored, "incarnation": d.incarnation,
            "lost_rank": d.lost_rank, "rank": rt.rank}


def owner() -> None:
    rt = Runtime(engines=ENGINES, timeout=10)
    # a name has one owner in its job: each owner process its own (consumers take the ref)
    w = rt.publish(np.arange(N, dtype=np.float32), name=f"w-{os.getpid()}")
    say(ref=w.to_bytes().hex(), **_stats(rt))
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "stats":
                say(ok=True, **_stats(rt))
            elif op == "holders":
                say(ok=True, holders=[pid for pid, _ in rt.lease_holders(w)])
            elif op == "exit":
                say(ok=True)
                break
            else:
                say(ok=False, error=f"unknown op {op}")
        except Exception as exc:
            say(ok=False, error=type(exc).__name__, msg=str(exc))
    rt.close()


class Loop:
    """Gets of every ref, in a thread, counted by phase: {phase: {name: {"ok": n, type: n}}}."""

    def __init__(self, refs: dict) -> None:
        self.refs = refs
        self.phase = "before"
        self.counts: dict = {}
        self.last: dict = {}  # (name, error type) -> last message
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            for name, ref in self.refs.items():
                try:
                    a = ref.get()
                    out = "ok" if float(np.asarray(a, np.float64).sum()) == WANT else "wrong-bytes"
                except memsem.MemsemError as exc:
                    out = type(exc).__name__
                    with self.lock:
                        self.last[f"{name}/{out}"] = str(exc)[:600]
                with self.lock:
                    c = self.counts.setdefault(self.phase, {}).setdefault(name, {})
                    c[out] = c.get(out, 0) + 1
            self.stop.wait(0.005)


def consumer() -> None:
    info = json.loads(sys.stdin.readline())
    rt = Runtime(engines=ENGINES, timeout=10)
    refs = {k: rt.ref(bytes.fromhex(v)) for k, v in info["refs"].items()}
    peers = {k: rt.resolve(r.spec).peer for k, r in refs.items()}  # the owners as first resolved
    lease = rt.lease(refs["live"], ttl=None).acquire()
    say(ready=True, routes={k: rt.route(r).kind for k, r in refs.items()}, **_stats(rt))
    loop = Loop(refs)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "phase":
                with loop.lock:
                    loop.phase = cmd["name"]
                say(ok=True)
            elif op == "report":
                verdicts = {}
                for k, p in peers.items():
                    alive = p.alive()
                    verdicts[k] = {"alive": alive, "dead": p.dead, "why": p.why, "checks": p.checks,
                                   "incarnation": None if p.incarnation is None else p.incarnation[0]}
                with loop.lock:
                    say(ok=True, counts=loop.counts, last=loop.last, verdicts=verdicts, **_stats(rt))
            elif op == "fresh":
                # a new consumer: resolves every ref from the directory now
                out = {}
                with Runtime(engines=ENGINES, timeout=10) as fresh:
                    for k, v in info["refs"].items():
                        try:
                            a = fresh.ref(bytes.fromhex(v)).get()
                            out[k] = "ok" if float(np.asarray(a, np.float64).sum()) == WANT else "wrong-bytes"
                        except memsem.MemsemError as exc:
                            out[k] = type(exc).__name__
                say(ok=True, fresh=out)
            elif op == "exit":
                say(ok=True)
                break
            else:
                say(ok=False, error=f"unknown op {op}")
    except Exception as exc:
        say(ok=False, error=type(exc).__name__, msg=str(exc), tb=traceback.format_exc())
        raise
    finally:
        loop.stop.set()
        loop.thread.join(10)
        try:
            lease.release()
        except memsem.MemsemError:
            pass
        rt.close()


if __name__ == "__main__":
    if sys.argv[1] == "owner":
        owner()
    else:
        consumer()
