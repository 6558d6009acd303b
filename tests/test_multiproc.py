"""Same-node, cross-process data movement (spawn), at 1, 2 and 4 consumer processes."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

import memsem
from memsem import TensorRef
from tests.conftest import run_children

pytestmark = pytest.mark.multiproc


def _pull(refbytes: bytes, expect_route: str) -> tuple[str, str, bool]:
    with memsem.Runtime(timeout=10) as rt:
        ref = rt.ref(refbytes)
        a = ref.get()
        route = ref.route().kind
        try:
            v = ref.view()
            viewed = bool((v == a).all())
            del v
        except memsem.NotSupportedError:
            viewed = False
        return hashlib.sha256(a.tobytes()).hexdigest(), route, viewed


@pytest.mark.parametrize("nproc", [1, 2, 4])
@pytest.mark.parametrize("shared", [False, True], ids=["cma", "shm"])
def test_consumers_get_and_view(rt, nproc, shared):
    data = np.random.default_rng(1).standard_normal((257, 33)).astype(np.float32)
    if shared:
        a = rt.alloc(data.shape, np.float32)
        a[...] = data
    else:
        a = data
    ref = rt.publish(a, access="r")
    route = "host/shm" if shared else "host/cma"
    res = run_children(_pull, [(ref.to_bytes(), route)] * nproc)
    digest = hashlib.sha256(data.tobytes()).hexdigest()
    for d, r, viewed in res:
        assert d == digest and r == route
        assert viewed is shared  # zero-copy view only over a shared segment


def _writer(refbytes: bytes, rank: int, n: int) -> bool:
    with memsem.Runtime(timeout=10) as rt:
        ref = rt.ref(refbytes)
        ref.bytes(rank * n, n).put(np.full(n, rank + 1, np.uint8))
    return True


@pytest.mark.parametrize("shared", [False, True], ids=["cma", "shm"])
def test_remote_puts_land_in_place(rt, shared):
    n = 4096
    a = rt.alloc(4 * n, np.uint8) if shared else np.zeros(4 * n, np.uint8)
    ref = rt.publish(a)
    run_children(_writer, [(ref.to_bytes(), r, n) for r in range(4)])
    for r in range(4):
        assert (a[r * n:(r + 1) * n] == r + 1).all()


def _attach_and_exit(refbytes: bytes) -> int:
    with memsem.Runtime(timeout=10) as rt:
        ref = rt.ref(refbytes)
        v = ref.view()
        s = int(v.sum())
        del v
    return s


def test_consumer_exit_never_unlinks(rt):
    """Case 4: a consumer attaches and exits normally: segments stay, others keep working."""
    a = rt.alloc(1024, np.uint8)
    a[:] = 1
    ref = rt.publish(a)
    res = rt.resolve(ref.spec)
    cb_path = os.path.join(memsem.native.segment_dir(), res.info.control)
    data_path = os.path.join(memsem.native.segment_dir(), res.info.descriptors["host"].fields["segment"])
    assert run_children(_attach_and_exit, [(ref.to_bytes(),)]) == [1024]
    assert os.path.exists(cb_path) and os.path.exists(data_path)
    assert run_children(_attach_and_exit, [(ref.to_bytes(),)]) == [1024]
    a[:] = 2
    assert ref.get().sum() == 2048


def _stale_reader(refbytes: bytes) -> str:
    with memsem.Runtime(timeout=10) as rt:
        try:
            TensorRef.from_bytes(refbytes, rt).get()
        except memsem.StaleReferenceError as exc:
            return type(exc).__name__
        return "no error"


def test_stale_ref_across_processes(rt):
    ref = rt.publish(np.ones(100, np.float32), name="w")
    rt.publish(np.zeros(100, np.float32), name="w", replace=True)
    assert run_children(_stale_reader, [(ref.to_bytes(),)]) == ["WindowRetiredError"]
    old = rt.lookup("w")
    rt.unpublish("w")
    assert run_children(_stale_reader, [(old.to_bytes(),)])[0] in ("WindowRetiredError", "WindowNotFoundError")


def test_example_script_runs():
    import subprocess
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "torch_share.py")
    out = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "bit-exact" in out.stdout


def _race_consumer(conn) -> None:
    """Reader thread: gets through whatever ref it holds; main thread: resolves each new
    generation the owner sends (which retires the old mapping). Reports (ok, stale)."""
    import threading

    with memsem.Runtime(timeout=10) as rt:
        current = [rt.ref(conn.recv())]
        stop = threading.Event()
        counts = {"ok": 0, "stale": 0}

        def reader():
            out = np.empty(1 << 20, np.uint8)
            while not stop.is_set():
                try:
                    current[0].get(out)
                    counts["ok"] += 1
                except memsem.StaleReferenceError:
                    counts["stale"] += 1

        th = threading.Thread(target=reader)
        th.start()
        while True:
            msg = conn.recv()
            if msg is None:
                break
            new = rt.ref(msg)
            new.get()  # resolves the new generation: the old mapping is retired under the reader
            current[0] = new
            conn.send("ok")
        stop.set()
        th.join(10)
        conn.send((counts["ok"], counts["stale"]))


def test_republish_race_never_crashes(rt):
    """Old mappings are retired, never unmapped under a copy of another thread."""
    from tests._proc import recv, reap, spawn

    a = rt.alloc(1 << 20, np.uint8)
    ref = rt.publish(a, name="race")
    p, conn = spawn(_race_consumer)
    conn.send(ref.to_bytes())
    for _ in range(40):
        b = rt.alloc(1 << 20, np.uint8)
        conn.send(rt.publish(b, name="race", replace=True).to_bytes())
        assert recv(conn, 20) == "ok"
    conn.send(None)
    ok, stale = recv(conn, 30)
    reap([p])
    assert p.exitcode == 0 and ok > 0
