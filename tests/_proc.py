"""Process helpers shared by tests: spawn a child with a Pipe, receive with a timeout, reap.

Every wait here is bounded; a child's exception comes back as an AssertionError with its
traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback

CTX = mp.get_context("spawn")


def _child(fn, conn, *args):
    try:
        fn(conn, *args)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise


def spawn(fn, *args):
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_child, args=(fn, child) + args, daemon=True)
    p.start()
    child.close()
    return p, parent


def recv(conn, timeout=60.0):
    if not conn.poll(timeout):
        raise TimeoutError(f"no message from the child within {timeout} s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise AssertionError("child failed:\n" + msg[1])
    return msg


def reap(procs, timeout=20.0):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
