"""Process helpers shared by tests: spawn a child with a Pipe, receive with a timeout, reap.

Every wait here is bounded; a child's exception comes back as an AssertionError with its
traceback, and a child that dies without one (a signal, a native crash: faulthandler prints its
threads' stacks) as an AssertionError saying so.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
import traceback

CTX = mp.get_context("spawn")


class Gate:
    """Holds a scripted engine's copy until the test opens it: pass it as
    ``ScriptedEngine(..., before=gate)``; ``entered`` is set once a copy is provably in flight.
    Forces an order instead of hoping for one with sleeps."""

    def __init__(self) -> None:
        import threading

        self.entered = threading.Event()
        self.open = threading.Event()

    def __call__(self, kind: str, offset: int, nbytes: int) -> None:
        self.entered.set()
        if not self.open.wait(120):
            raise AssertionError("the test never opened the gate")


def _child(fn, conn, *args):
    import faulthandler

    faulthandler.enable(all_threads=True)  # a native crash prints every thread's stack (captured stderr)
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
    try:
        msg = conn.recv()
    except (EOFError, ConnectionResetError) as exc:  # no Python error of its own came first
        raise AssertionError(f"the child died without a message ({exc!r}): killed, or a native crash "
                             "(its stack, from faulthandler, is in the captured stderr)") from exc
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise AssertionError("child failed:\n" + msg[1])
    return msg


def until(cond, timeout=20.0, what="condition"):
    """Wait for ``cond()`` to hold, polling, at most ``timeout`` s (then AssertionError naming
    ``what``): for a state the test can only observe, never to hope that time made it true."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout} s")
        time.sleep(0.005)


class SeenLock:
    """Stands in for a window's section lock (``Owned.section_lock``) and tells the test when
    someone waits on it (``waiting``): an order forced, not hoped for."""

    def __init__(self, lock):
        self._lock = lock
        self.waiting = threading.Event()

    def acquire(self, blocking=True, timeout=-1):
        if blocking and self._lock.acquire(blocking=False):
            return True
        if blocking:
            self.waiting.set()
        return self._lock.acquire(blocking, timeout)

    def release(self):
        self._lock.release()

    def locked(self):
        return self._lock.locked()


def reap(procs, timeout=20.0):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def idle_producer(conn, nbytes, tile_bytes):
    """Child: publish ``nbytes`` with tiles, mark tile 0 ready, send the ref, then idle (to be
    SIGKILLed by the test while a consumer waits on tile 1)."""
    import numpy as np

    import memsem

    with memsem.Runtime() as rt:
        arr = np.zeros(nbytes, np.uint8)
        ref = rt.publish(arr, tile_bytes=tile_bytes)
        ref.put_tile(0, np.ones(tile_bytes, np.uint8))
        conn.send(ref.to_bytes())
        time.sleep(120)
