"""Shared test helpers: isolated job namespaces and bounded child processes (spawn)."""
from __future__ import annotations

import multiprocessing as mp
import os
import secrets

import pytest

SPAWN = mp.get_context("spawn")

# tests/verl runs in .venv-verl (make test-verl); the core venv has no verl to import
import importlib.util as _ilu  # noqa: E402

collect_ignore_glob = [] if _ilu.find_spec("verl") is not None else ["verl/*"]
# tests/ray runs where Ray is installed (make test-tq runs it in the TransferQueue venv)
if _ilu.find_spec("ray") is None:
    collect_ignore_glob.append("ray/*")


@pytest.fixture(autouse=True)
def _isolated_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets its own directory namespace (children inherit it through the env)."""
    monkeypatch.setenv("MEMSEM_JOB", f"t{os.getpid()}-{secrets.token_hex(4)}")


@pytest.fixture
def rt():
    import memsem

    with memsem.Runtime(timeout=10.0) as runtime:
        yield runtime


def run_children(target, args_list, timeout: float = 60.0):
    """Start one spawn process per args tuple with a result queue as last argument; return the
    results in order. Raises AssertionError naming a child that failed or hung."""
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=_wrap, args=(target, i, a, q), daemon=True) for i, a in enumerate(args_list)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(out) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"children {sorted(set(range(len(procs))) - set(out))} hung for {timeout} s")
            try:
                i, ok, val = q.get(timeout=min(left, 1.0))
            except _q.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in out]
                if dead and q.empty():
                    time.sleep(0.2)
                    if q.empty():
                        raise AssertionError(f"children {dead} died without a result "
                                             f"(exit codes {[procs[i].exitcode for i in dead]})")
                continue
            if not ok:
                raise AssertionError(f"child {i} failed:\n{val}")
            out[i] = val
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[i] for i in range(len(procs))]


def _wrap(target, i, args, q):
    import traceback

    try:
        q.put((i, True, target(*args)))
    except BaseException:
        q.put((i, False, traceback.format_exc()))
