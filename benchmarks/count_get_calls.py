"""How many functions a get walks through, cold and warm, same node and tcp (issue 34).

    python benchmarks/count_get_calls.py [--json FILE]

An owner process publishes a 64 B window (named, read-write, engines loopback, host and tcp).
Each case runs in a fresh consumer process (a fresh runtime: nothing resolved yet), which
counts with ``sys.setprofile`` everything between entering the measured call and returning:

* ``distinct``: distinct functions (Python code objects, and C functions by qualified name);
* ``calls``: calls, Python and C (a generator's resumption counts as a call);
* ``native``: calls of memsem's native functions (``memsem._hot``, ``memsem._native``);
* ``frames``: Python frames from ``TensorRef.get`` (frame 1) down to the one that makes the
  last call that moves the bytes: a native copy (``memsem_plan_copy``, ``memsem._hot.copy`` /
  ``copy_buf`` / ``wire``), or over tcp the request's send on the socket;
* ``depth``: the deepest Python frame reached, counted the same way (imports excluded).

A ref's same-node route calls ``memsem._hot.copy_buf`` through a ``functools.partial``, which
``sys.setprofile`` does not report (a partial is no C function to it): in the consumer, the
module globals holding ``copy_buf`` are replaced by a Python spy that calls it, and the counter
reports the spy's call as that native call (the spy's own frame is not counted).

Python functions are counted as distinct code objects (``py``), C functions by qualified name
(``+C``: both). Imports made during the call (a module loaded on first use) are not counted:
they are the interpreter's, once per process.

"cold" is the consumer's first call, "warm" its second, made at once (a get made after the
owner's liveness interval, ``LIVENESS_INTERVAL_S``, re-checks the owner first: more calls). Cases: ``ref.get(out)`` of a ref from
bytes, ``lookup(name).get()`` (the lookup counted too), on the same node (route host) and from
another node (``MEMSEM_NODE_ID`` differs: route tcp). A count, not a time: the same on a loaded
machine. Goal (issue 34): a cold same-node ``get(out)`` through at most 50 distinct functions,
a warm one a single native call.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import subprocess
import sys
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, SRC)

NAME = "count/w"
NBYTES = 64
#: the native calls that move a get's bytes
COPY_CALLS = {"memsem_plan_copy", "copy", "copy_buf", "wire"}
#: the calls that send a request over tcp (on the whole path)
SEND_CALLS = {"send", "sendall", "sendmsg"}
NATIVE_MODULES = {"memsem._hot", "memsem._native"}
CASES = ("get_out", "lookup_get")


def _c_key(fn: Any) -> tuple[str, str]:
    if isinstance(fn, functools.partial):  # a C callable that calls another without an event
        fn = fn.func
    mod = getattr(fn, "__module__", None)
    owner = getattr(fn, "__self__", None)
    if mod is None and owner is not None and not isinstance(owner, type(sys)):
        mod = type(owner).__module__ + "." + type(owner).__qualname__
    return str(mod), getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))


def count_calls(fn: Callable[[], Any], root: Any = None) -> dict[str, Any]:
    """Run ``fn()`` under ``sys.setprofile`` and count what runs inside it (``fn``'s own frame
    excluded; imports made meanwhile excluded). ``root``: the function whose entry is frame 1
    for ``frames`` (default ``TensorRef.get``).

    Returns:
        ``distinct`` (Python functions), ``calls`` (Python), ``distinct_c`` / ``calls_c`` (C),
        ``native`` (calls of memsem's native functions), ``frames``, ``depth``, and ``functions`` (the
        distinct ones, by name).
    """
    from memsem import TensorRef

    root_code = (root or TensorRef.get).__code__
    me = fn.__code__
    spy = _spy.__code__
    py: dict[Any, str] = {}
    cfn: dict[Any, str] = {}
    st = {"calls": 0, "calls_c": 0, "native": 0, "frames": 0, "depth": 0}
    stack: list[Any] = []  # the frames entered inside fn (codes); None above fn
    roots: list[int] = []  # depths of the root's frames on the stack
    imports = [0]  # > 0: inside an import (not counted)

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if not stack:
                if code is me:
                    stack.append(None)
                return
            if code is spy:
                return  # the spy's call is not counted: its C call is, as if made by its caller
            stack.append(code)
            if imports[0] or code.co_filename.startswith("<frozen importlib"):
                imports[0] += 1
                return
            st["calls"] += 1
            if code is root_code:
                roots.append(len(stack))
            st["depth"] = max(st["depth"], len(stack) - (roots[0] if roots else 2) + 1)
            if code not in py:
                py[code] = f"{code.co_filename.rsplit('/src/', 1)[-1]}:{code.co_firstlineno} {code.co_qualname}"
        elif event == "return":
            if not stack or frame.f_code is spy:
                return
            code = stack.pop()
            if imports[0]:
                imports[0] -= 1
            elif roots and roots[-1] == len(stack) + 1:
                roots.pop()
        elif event == "c_call" and stack and not imports[0]:
            st["calls_c"] += 1
            key = _c_key(arg)
            cfn.setdefault(key, f"C {key[0]}.{key[1]}")
            name = key[1].rsplit(".", 1)[-1]
            moves = False
            if key[0] in NATIVE_MODULES:
                st["native"] += 1
                moves = name in COPY_CALLS
            elif key[0].startswith("socket") and name in SEND_CALLS:
                moves = True
            if moves:  # frames from the root (frame 1) to the one making this call
                st["frames"] = len(stack) - (roots[-1] if roots else 2) + 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {"distinct": len(py), "calls": st["calls"], "distinct_c": len(cfn), "calls_c": st["calls_c"],
            "native": st["native"], "frames": st["frames"], "depth": st["depth"], "functions": sorted(py.values()) + sorted(cfn.values())}


def _spy(*args: Any) -> int:
    return _copy_buf(*args)


_copy_buf: Any = None


def spy_on_copy_buf() -> Callable[[], None]:
    """Make the partials of ``memsem._hot.copy_buf`` made from now on visible to the counter
    (see the module docstring); returns what undoes it (a test puts the modules back)."""
    global _copy_buf
    from memsem import _hot

    _copy_buf = _hot.copy_buf
    spied = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("memsem.") and mod is not None:
            for attr, v in list(vars(mod).items()):
                if v is _copy_buf:
                    setattr(mod, attr, _spy)
                    spied.append((mod, attr))

    def undo() -> None:
        for mod, attr in spied:
            setattr(mod, attr, _copy_buf)

    return undo


# -- roles -------------------------------------------------------------------------------------------
def _owner() -> None:
    import numpy as np

    import memsem

    with memsem.Runtime() as rt:
        a = rt.alloc(NBYTES, np.uint8)
        a[:] = np.arange(NBYTES, dtype=np.uint8)
        ref = rt.publish(a, access="rw", name=NAME)
        print(ref.to_bytes().hex(), flush=True)
        sys.stdin.readline()  # until the driver is done


def _consumer(case: str, refhex: str) -> None:
    import numpy as np

    import memsem

    spy_on_copy_buf()
    with memsem.Runtime() as rt:
        if case == "get_out":
            ref = rt.ref(bytes.fromhex(refhex))
            out = np.empty(NBYTES, np.uint8)

            def probe() -> Any:
                return ref.get(out)
        elif case == "lookup_get":
            def probe() -> Any:
                return rt.lookup(NAME).get()
        else:
            raise ValueError(f"case must be one of {CASES}, got {case!r}")
        cold = count_calls(probe)
        got = probe()
        if list(np.asarray(got).view(np.uint8)) != list(range(NBYTES)):
            raise RuntimeError("the get returned the wrong bytes")
        warm = count_calls(probe)
        route = rt.lookup(NAME).route().kind
    print(json.dumps({"cold": cold, "warm": warm, "route": route}))


# -- driver --------------------------------------------------------------------------------------------
def measure(cases: tuple[str, ...] = CASES, places: tuple[str, ...] = ("same-node", "tcp")) -> dict[str, Any]:
    """Run the owner and one fresh consumer per (place, case); returns their counts by
    ``"<place> <case>"``."""
    job = f"count{os.getpid()}{secrets.token_hex(3)}"
    env = dict(os.environ, MEMSEM_JOB=job, MEMSEM_DIRECTORY="local", MEMSEM_ENGINES="loopback,host,tcp")
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MEMSEM_NODE_ID", None)
    me = [sys.executable, os.path.abspath(__file__)]
    owner = subprocess.Popen(me + ["--role", "owner"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    results: dict[str, Any] = {}
    try:
        refhex = owner.stdout.readline().strip()
        if not refhex:
            raise RuntimeError("the owner did not publish")
        for place in places:
            cenv = dict(env, MEMSEM_NODE_ID=f"count-other-node-{job}") if place == "tcp" else env
            for case in cases:
                p = subprocess.run(me + ["--role", "consumer", "--case", case, "--ref", refhex], env=cenv,
                                   capture_output=True, text=True, timeout=300)
                if p.returncode != 0:
                    raise RuntimeError(f"consumer {place} {case} failed:\n{p.stderr[-3000:]}")
                results[f"{place} {case}"] = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        try:
            owner.communicate("\n", timeout=30)  # the owner leaves when told
        except subprocess.TimeoutExpired:
            owner.kill()
            owner.communicate()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("driver", "owner", "consumer"), default="driver")
    ap.add_argument("--case", choices=CASES)
    ap.add_argument("--ref")
    ap.add_argument("--json", help="write the results (with the functions walked) here")
    ap.add_argument("--list", action="store_true", help="print the distinct functions of each cold case")
    args = ap.parse_args()
    if args.role == "owner":
        _owner()
        return
    if args.role == "consumer":
        _consumer(args.case, args.ref)
        return
    res = measure()
    cols = ("distinct", "calls", "distinct_c", "calls_c", "native", "frames", "depth")
    head = " ".join(f"{c:>10}" for c in ("py fns", "py calls", "C fns", "C calls", "native", "frames", "depth"))
    print(f"{'case':24} {'route':9} {'':5} {head}")
    for k, r in res.items():
        for when in ("cold", "warm"):
            c = r[when]
            print(f"{k:24} {r['route']:9} {when:5} " + " ".join(f"{c[x]:10}" for x in cols))
    if args.list:
        for k, r in res.items():
            print(f"\n== {k}, cold: {r['cold']['distinct']} Python + {r['cold']['distinct_c']} C functions")
            for f in r["cold"]["functions"]:
                print("  " + f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
