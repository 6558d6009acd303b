"""Unlisted windows (``publish_spec(listed=False)``): no directory record, written or removed;
a consumer resolves the window from the record its owner hands out with the ref
(``resolver.carry``), checked as a directory's record would be. What the Ray tensor transport
publishes (its records travel in Ray's object metadata)."""
from __future__ import annotations

import numpy as np
import pytest

import memsem

CALLS = ("get_window", "window_with_key", "put_window", "remove_window", "lease_holders", "lookup")


def _count(rt) -> dict[str, int]:
    """Count ``rt``'s directory calls of ``CALLS`` from now (the dict fills as they happen)."""
    d, calls = rt.directory, {}
    for name in CALLS:
        def counted(*a, _f=getattr(d, name), _n=name, **k):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **k)

        setattr(d, name, counted)
    return calls


@pytest.fixture
def pair():
    """An owner and a consumer: two runtimes of one job (the consumer's reads go by a route,
    as another process's would: the owner's control block checks the generation)."""
    with memsem.Runtime(timeout=10.0) as owner, memsem.Runtime(timeout=10.0) as consumer:
        yield owner, consumer


def test_an_unlisted_window_resolves_from_its_carried_record_with_no_directory_call(pair):
    owner, consumer = pair
    a = np.arange(1000, dtype=np.float64)
    mine, theirs = _count(owner), _count(consumer)
    spec = owner.publish_spec(a, access="r", listed=False)
    record = owner.publisher.record(spec)
    assert owner.directory.get_window(spec.gva) is None and record["generation"] == spec.generation
    ref = consumer.ref(spec.to_bytes())
    with pytest.raises(memsem.WindowNotFoundError):  # no record in the directory: nothing to resolve
        ref.get()
    theirs.clear()
    with consumer.resolver.carry(ref.spec, record) as info:
        assert info.gva == spec.gva and not info.extra["listed"]
        assert np.array_equal(ref.get(), a)
        a[0] = 7.0  # in place: the window is the array's memory
        assert ref.get()[0] == 7.0
    assert theirs == {}
    assert np.array_equal(ref.bytes(8, 16).get().view(np.float64), a[1:3])  # cached: resolved already
    owner.unpublish_spec(spec)
    assert mine == {"get_window": 1}  # the test's own read above; publish and unpublish made none
    with pytest.raises(memsem.StaleReferenceError):  # the cached resolution: its generation moved
        ref.get()
    fresh = memsem.Runtime(timeout=10.0)
    try:
        with fresh.resolver.carry(ref.spec, record), pytest.raises(memsem.StaleReferenceError):
            fresh.ref(spec.to_bytes()).get()  # a new resolution from the record: the window is gone
    finally:
        fresh.close()


def test_unlisted_arguments_are_checked(pair):
    owner, consumer = pair
    with pytest.raises(ValueError, match="name='w' with listed=False"):
        owner.publish_spec(np.zeros(4), name="w", listed=False)
    with pytest.raises(TypeError, match="listed must be True or False"):
        owner.publish_spec(np.zeros(4), listed="no")
    spec = owner.publish_spec(np.zeros(4), listed=False)
    other = owner.publish_spec(np.ones(4), listed=False)
    ref = consumer.ref(spec.to_bytes())
    with pytest.raises(ValueError, match="not of window gva"):
        with consumer.resolver.carry(ref.spec, owner.publisher.record(other)):
            pass
    with pytest.raises(ValueError, match="field"):
        with consumer.resolver.carry(ref.spec, {"gva": spec.gva}):
            pass
    forged = dict(owner.publisher.record(other), gva=spec.gva, generation=spec.generation)
    with consumer.resolver.carry(ref.spec, forged), pytest.raises(memsem.AccessDeniedError):
        ref.get()  # the ref's key does not match the record's digest
