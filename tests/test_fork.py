"""fork() (issue 12, class 4): a child owns nothing of its parent.

A child forked from a process that owns windows (``os.fork``, multiprocessing "fork",
DataLoader-style workers) never unlinks, retires or bumps what its parent owns, whatever it does
at exit; an inherited runtime is unusable in the child (``RuntimeClosedError``), and refs bound
to it work through the child's own default runtime, so a put from the child lands in the
parent's memory, never in the child's copy-on-write pages.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import memsem
from memsem.native import segment_dir

FORK = mp.get_context("fork")


def _run_script(body: str, timeout: float = 120.0) -> str:
    """Run ``body`` in a fresh interpreter (a forked child there may exit normally: its
    finalizers and atexit handlers run, which is the point) and return its stdout."""
    code = textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ})
    assert p.returncode == 0, f"script failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_forked_child_exiting_normally_leaves_the_parent_intact():
    out = _run_script("""
        import os, sys, gc
        import numpy as np
        import memsem
        from memsem.native import segment_dir

        with memsem.Runtime(timeout=5) as rt:
            shared = rt.alloc(4096, np.uint8)
            shared[:] = 7
            ref = rt.publish(shared, name="shared")
            priv = np.arange(4096, dtype=np.uint8)
            pref = rt.publish(priv, name="priv")
            gen = ref.generation
            seg = rt.publisher.segment_of(shared.__array_interface__["data"][0], 4096).name
            cb = rt.publisher.owned[ref.spec.gva].cb.segment.name
            for how in ("exit", "with", "close", "gc"):
                pid = os.fork()
                if pid == 0:
                    # the child: every way of leaving, then a normal interpreter exit
                    if how == "with":
                        rt.__exit__(None, None, None)
                    elif how == "close":
                        rt.close()
                    elif how == "gc":
                        del shared
                        gc.collect()
                    sys.exit(0)
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0, how
                assert os.path.exists(os.path.join(segment_dir(), seg)), f"{how}: alloc segment unlinked"
                assert os.path.exists(os.path.join(segment_dir(), cb)), f"{how}: control block unlinked"
                assert ref.generation == gen and rt.publisher.owned[ref.spec.gva].cb.generation == gen, how
                assert (ref.get() == 7).all() and (pref.get() == priv).all(), how
                assert rt.directory.get_window(ref.spec.gva) is not None, f"{how}: record removed"
        print("ok")
    """)
    assert out.strip().endswith("ok")


def _child_uses_inherited(rt_and_refs, q) -> None:
    rt, ref, pref = rt_and_refs
    out = {}
    try:
        rt.publish(np.zeros(4))
    except memsem.RuntimeClosedError as exc:
        out["inherited"] = "RuntimeClosedError" if "forked" in str(exc) else str(exc)
    out["get"] = bytes(pref.get()[:4])                     # a ref bound to the inherited runtime
    pref.put(np.full(pref.nbytes, 42, np.uint8))           # lands in the parent's memory
    out["route"] = pref.route().kind
    q.put(out)


def test_refs_work_in_a_forked_child_and_puts_reach_the_parent(rt):
    priv = np.arange(4096, dtype=np.uint8)
    pref = rt.publish(priv, name="priv")
    ref = rt.publish(rt.alloc(64, np.uint8), name="shared")
    q = FORK.Queue()
    p = FORK.Process(target=_child_uses_inherited, args=((rt, ref, pref), q))
    p.start()
    out = q.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    assert out["inherited"] == "RuntimeClosedError"
    assert out["get"] == bytes(range(4))
    assert out["route"] == "host/cma"  # the child is another process: cross-memory attach
    assert (priv == 42).all(), "the child's put did not reach the parent's memory"
    assert (pref.get() == 42).all()


def test_dataloader_style_fork_workers_read_refs(rt):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset

    weights = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    ref = rt.publish(weights, name="w", access="r")
    mine = f".{os.getpid()}-"  # this process's segments (other tests' come and go meanwhile)
    seg_names = {n for n in os.listdir(segment_dir()) if mine in n}

    class Rows(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int):
            return torch.from_numpy(ref.bytes(i * 4096, 4096).get().view(np.float32).copy())

    loader = DataLoader(Rows(), batch_size=8, num_workers=2, multiprocessing_context="fork")
    rows = torch.cat(list(loader)).numpy()
    assert (rows == weights).all()
    # the workers exited: nothing of the parent's is gone, the window is intact
    assert seg_names <= set(os.listdir(segment_dir()))
    assert (ref.get() == weights).all()
    lease = ref.lease(ttl=5).acquire()  # the window is live and leasable
    lease.release()
