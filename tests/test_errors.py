"""Memsem errors cross process boundaries (a worker's error re-raised by its parent, a rollout's
error sent to its trainer): every public error pickles with its message, type and attributes."""
from __future__ import annotations

import inspect
import multiprocessing
import pickle

import pytest

import memsem
from memsem import _errors

#: each public error with the keyword arguments its constructor takes (required ones included)
KWARGS = {
    "StaleReferenceError": {"window": "w", "expected": 3},
    "VersionGoneError": {"window": "w", "wanted": 2, "found": 5},
    "WindowRetiredError": {"window": "w", "generation": 4},
    "WindowNotFoundError": {"window": "w"},
    "NameHeldError": {"name": "policy", "holder": {"pid": 12, "node": "n1", "rank": 0}},
    "LeaseHeldError": {"holders": [(12, 1.5)]},
    "EngineError": {"code": -7, "errno": 104, "name": "aclshmem_finalize"},
    "MemsemTimeoutError": {"what": "version 3 of 'w'", "timeout": 1.0},
    "DigestMismatchError": {"relay": "rank 1", "version": 2},
    "AddressInUseError": {"addr": "127.0.0.1", "port": 9464},
}
ERRORS = sorted(name for name in _errors.__all__ if isinstance(getattr(_errors, name), type))


def _make(name: str) -> memsem.MemsemError:
    cls = getattr(_errors, name)
    params = inspect.signature(cls.__init__).parameters
    kw = {k: v for k, v in KWARGS.get(name, {}).items() if k in params}
    return cls(f"{name} happened", **kw)


@pytest.mark.parametrize("name", ERRORS)
def test_every_error_pickles_with_its_attributes(name):
    exc = _make(name)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc) and back.args == exc.args
    assert vars(back) == vars(exc)


def _raise(conn, name: str) -> None:
    conn.send(_make(name))


def test_an_error_sent_by_another_process_arrives_whole():
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_raise, args=(b, "NameHeldError"))
    p.start()
    try:
        assert a.poll(60), "the child sent nothing"
        got = a.recv()
    finally:
        p.join(30)
    assert isinstance(got, memsem.NameHeldError) and got.name == "policy" and got.holder["pid"] == 12
