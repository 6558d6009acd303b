"""A memsem "node" process for test_many_nodes.py, run inside a network namespace.

    python _node.py producer            publish windows, print their refs (one JSON line), then
                                        obey JSON commands on stdin, one reply line each
    python _node.py consumer SCENARIO   read refs (one JSON line) on stdin, run SCENARIO, print
                                        JSON result lines; exit 0 when every check passed

Environment: MEMSEM_DIRECTORY (redis://...), MEMSEM_NODE_ID, MEMSEM_JOB, MEMSEM_JOB_SECRET,
MEMSEM_HEARTBEAT_TTL. Every wait has a timeout.
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np

import memsem
from memsem import Runtime

ENGINES = ("loopback", "host", "tcp")
N_W = 1 << 18  # float32 elements of window "w" (1 MiB)
N_BIG = 8 << 20  # bytes of window "big"


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def producer() -> None:
    rt = Runtime(engines=ENGINES, timeout=10)
    w = rt.publish(np.arange(N_W, dtype=np.float32), name="w")
    ro = rt.publish(np.full(1024, 7, np.uint8), name="ro", access="r")
    big = rt.publish(np.arange(N_BIG, dtype=np.uint8), name="big")
    dst = rt.publish(np.zeros(N_W, np.float32), name="dst")
    wins = {"w": w, "ro": ro, "big": big, "dst": dst}
    say(refs={k: v.to_bytes().hex() for k, v in wins.items()}, endpoint=rt.engine("tcp").endpoint,
        rank=rt.rank)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "read":
                a = rt.ref(bytes.fromhex(cmd["ref"])).get()
                say(ok=True, sum=float(np.asarray(a, np.float64).sum()), head=np.asarray(a).ravel()[:4].tolist())
            elif op == "unpublish":
                t0 = time.monotonic()
                rt.unpublish(wins[cmd["name"]], timeout=cmd.get("timeout", 1.0))
                say(ok=True, s=time.monotonic() - t0)
            elif op == "exit":
                say(ok=True)
                break
            else:
                say(ok=False, error=f"unknown op {op}")
        except Exception as exc:
            say(ok=False, error=type(exc).__name__, msg=str(exc))
    rt.close()


def expect(exc_types, fn):
    try:
        fn()
    except exc_types as exc:
        return type(exc).__name__
    raise AssertionError(f"expected {exc_types}, nothing raised")


def consumer(scenario: str) -> None:
    info = json.loads(sys.stdin.readline())
    refs = {k: bytes.fromhex(v) for k, v in info["refs"].items()}
    rt = Runtime(engines=ENGINES, timeout=10)
    try:
        w, ro, big, dst = (rt.ref(refs[k]) for k in ("w", "ro", "big", "dst"))
        if scenario == "basic":
            route = rt.route(w)
            assert route.kind == "tcp", rt.explain(w)
            a = w.get()
            assert a.dtype == np.float32 and (a == np.arange(N_W, dtype=np.float32)).all()
            b = big.get()
            assert (b == np.arange(N_BIG, dtype=np.uint8)).all()
            # put: small and large, then the producer reads it back
            w.put(np.arange(N_W, dtype=np.float32) * 2)
            assert (w.get() == np.arange(N_W, dtype=np.float32) * 2).all()
            # xcopy: window -> local, local -> window, window -> window (both remote)
            out = np.empty(N_W, np.float32)
            batch = rt.xcopy([(w, out), (np.full(N_W, 3, np.float32), dst)])
            batch.wait(20)
            assert (out == np.arange(N_W, dtype=np.float32) * 2).all()
            assert (dst.get() == 3).all()
            rt.xcopy([(w, dst)]).wait(20)
            assert (dst.get() == np.arange(N_W, dtype=np.float32) * 2).all()
            # pipeline over the big window (no ready words across nodes: plain tiles)
            pipe_ok = False
            if hasattr(rt, "pipeline"):
                seen = 0
                with rt.pipeline(big, tile_bytes=1 << 20, depth=2, wait_ready=False) as p:
                    for tile in p:
                        with tile:
                            arr = tile.raw if hasattr(tile, "raw") else tile.array
                            off = tile.offset if hasattr(tile, "offset") else seen
                            assert (np.asarray(arr).view(np.uint8).ravel() ==
                                    np.arange(off, off + arr.nbytes, dtype=np.uint64).astype(np.uint8)).all()
                            seen += arr.nbytes
                assert seen == N_BIG, seen
                pipe_ok = True
            # permission and key checks at the owner
            denied = expect(memsem.AccessDeniedError, lambda: ro.put(np.zeros(1024, np.uint8)))
            assert (ro.get() == 7).all()
            forged = bytearray(refs["w"])
            forged[32] ^= 0xFF  # a byte of the access key
            bad = expect(memsem.AccessDeniedError, lambda: rt.ref(bytes(forged)).get())
            # lookup by name: the access key is sealed in the directory for the job secret
            looked = rt.lookup("w")
            assert (looked.get()[:4] == np.arange(4, dtype=np.float32) * 2).all()
            st = rt.stats()
            say(ok=True, route=route.kind, explain=rt.explain(w), pipeline=pipe_ok, denied=denied,
                forged=bad, stats=str(st)[:400])
        elif scenario == "lease":
            lease = rt.lease(w, ttl=5.0).acquire()
            assert (w.get(lease=lease)[:2] == np.arange(2, dtype=np.float32)).all()
            say(ok=True, step="held", remaining=lease.remaining())
            sys.stdin.readline()  # the producer tried to unpublish: it must have been refused
            assert lease.renew(5.0) > 4.0
            w.get(lease=lease)
            lease.release()
            say(ok=True, step="released")
            sys.stdin.readline()  # the producer unpublished now
            err = expect(memsem.StaleReferenceError, lambda: w.get())
            say(ok=True, step="stale", error=err)
        elif scenario == "kill":
            assert (w.get()[:2] == np.arange(2, dtype=np.float32)).all()
            say(ok=True, step="ready")
            sys.stdin.readline()  # the producer was SIGKILLed
            t0 = time.monotonic()
            errors = []
            while time.monotonic() - t0 < 30:
                try:
                    w.get()
                except (memsem.PeerLostError, memsem.StaleReferenceError) as exc:
                    errors.append(type(exc).__name__)
                    break
                except memsem.MemsemTimeoutError as exc:
                    errors.append(type(exc).__name__)
            say(ok=bool(errors) and errors[-1] != "MemsemTimeoutError", step="gone", errors=errors,
                s=time.monotonic() - t0)
        elif scenario == "wrong-secret":
            err = expect(memsem.AccessDeniedError, lambda: w.get())
            say(ok=True, error=err)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    except Exception as exc:
        say(ok=False, error=type(exc).__name__, msg=str(exc), tb=traceback.format_exc())
        rt.close()
        sys.exit(1)
    rt.close()


if __name__ == "__main__":
    if sys.argv[1] == "producer":
        producer()
    else:
        consumer(sys.argv[2])
