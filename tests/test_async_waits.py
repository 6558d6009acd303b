"""asyncio forms of the runtime's blocking waits (issue 25): ``TensorRef.wait_tile_async``,
``FieldRef.wait_tiles_async`` / ``wait_rows_async``, ``FieldSet.wait_async`` and
``StateDictRef.load_async``. Each is woken by the event it waits for (forced in order by the
test: the await is seen pending before the producer writes), times out naming what it waited
for, checks its arguments before it waits, and is cancelled cleanly (its native waiter is
removed; a load not started ends CANCELLED with its destination untouched).

No wall-clock bound is asserted: short timeouts only prove that a wait which cannot succeed ends.
"""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import memsem

WAIT = 30.0


@pytest.fixture
def pair():
    """An owner and a consumer runtime: the consumer resolves the owner's windows as any other
    process would (its own mappings of the control block), so its waits use the word waiter."""
    with memsem.Runtime(timeout=10.0) as owner, memsem.Runtime(timeout=10.0, workers=1) as consumer:
        yield owner, consumer


async def _until_waiting(rt: memsem.Runtime, n: int = 1) -> None:
    """Let the loop run until ``n`` words are awaited on ``rt``'s native word waiter."""
    waiter = rt.word_waiter()
    for _ in range(10_000):
        if waiter.pending >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"no await reached the word waiter (pending {waiter.pending})")


def test_wait_tile_async_is_woken_by_the_mark(pair):
    owner, consumer = pair
    ref = owner.publish(np.zeros(4 * 64, np.uint8), tile_bytes=64)
    cref = consumer.ref(ref.to_bytes())

    async def main():
        task = asyncio.ensure_future(cref.wait_tile_async(2, timeout=WAIT))
        await _until_waiting(consumer)
        assert not task.done()
        ref.mark_ready(1)  # another tile: the wait goes on
        await asyncio.sleep(0)
        assert not task.done()
        ref.mark_ready(2)
        await asyncio.wait_for(task, WAIT)

    asyncio.run(main())
    assert consumer.word_waiter().pending == 0


@pytest.mark.parametrize("index, exc", [(4, ValueError), (-1, ValueError), (True, TypeError),
                                        ("1", TypeError)])
def test_wait_tile_async_checks_its_index(pair, index, exc):
    owner, consumer = pair
    ref = owner.publish(np.zeros(4 * 64, np.uint8), tile_bytes=64)
    cref = consumer.ref(ref.to_bytes())
    with pytest.raises(exc, match="tile"):
        asyncio.run(cref.wait_tile_async(index, timeout=WAIT))


def test_wait_tile_async_times_out_naming_the_tile(pair):
    owner, consumer = pair
    ref = owner.publish(np.zeros(4 * 64, np.uint8), tile_bytes=64, name="async-tiles")
    cref = consumer.ref(ref.to_bytes())
    with pytest.raises(memsem.MemsemTimeoutError, match="tile 3"):
        asyncio.run(cref.wait_tile_async(3, timeout=0.05))


def test_cancelling_wait_tile_async_removes_its_waiter(pair):
    owner, consumer = pair
    ref = owner.publish(np.zeros(4 * 64, np.uint8), tile_bytes=64)
    cref = consumer.ref(ref.to_bytes())

    async def main():
        task = asyncio.ensure_future(cref.wait_tile_async(0, timeout=WAIT))
        await _until_waiting(consumer)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        assert consumer.word_waiter().pending == 0
        ref.mark_ready(0)  # nothing delivered to the cancelled wait; a new one returns at once
        await asyncio.wait_for(cref.wait_tile_async(0, timeout=WAIT), WAIT)

    asyncio.run(main())


def test_wait_rows_async_completes_from_two_writers(pair):
    """Two producers each write half of a tile's rows (threads started after the await is
    seen pending): the write completing the tile marks it and wakes the await."""
    owner, consumer = pair
    fs = owner.publish_fields({"x": ((16, 4), np.float32)}, tile_rows=8, name="async-rows")
    cx = memsem.FieldSet.from_bytes(fs.to_bytes(), consumer)["x"]
    rows = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)

    async def main():
        task = asyncio.ensure_future(cx.wait_rows_async(0, 8, timeout=WAIT))
        await _until_waiting(consumer)
        fs["x"].put_rows(0, rows[0:4])
        await asyncio.sleep(0)
        assert not task.done()  # half a tile marks nothing
        t = threading.Thread(target=fs["x"].put_rows, args=(4, rows[4:8]))
        t.start()
        await asyncio.wait_for(task, WAIT)
        t.join(WAIT)

    asyncio.run(main())
    np.testing.assert_array_equal(cx.get_rows(0, 8, timeout=WAIT), rows[0:8])
    with pytest.raises(memsem.MemsemTimeoutError, match="field 'x'"):
        asyncio.run(cx.wait_rows_async(8, 16, timeout=0.05))


@pytest.mark.parametrize("call", ["rows", "tiles"])
@pytest.mark.parametrize("start, stop, exc", [(5, 2, ValueError), (-1, 4, ValueError), (0, 99, ValueError),
                                              (True, 4, TypeError)])
def test_wait_rows_and_tiles_async_check_arguments_before_waiting(pair, call, start, stop, exc):
    owner, consumer = pair
    fs = owner.publish_fields({"x": ((16, 4), np.float32)}, tile_rows=8)
    x = memsem.FieldSet.from_bytes(fs.to_bytes(), consumer)["x"]
    fn = x.wait_rows_async if call == "rows" else x.wait_tiles_async
    if call == "tiles" and stop == 99:
        stop = 3  # tiles: 2 of them
    with pytest.raises(exc):
        asyncio.run(fn(start, stop, timeout=WAIT))
    assert consumer.word_waiter().pending == 0  # refused before anything was awaited


def test_fieldset_wait_async_every_field(pair):
    owner, consumer = pair
    fs = owner.publish_fields({"a": ((8, 2), np.int32), "b": ((8,), np.float64)}, tile_rows=4)

    async def main():
        task = asyncio.ensure_future(fs.wait_async(timeout=WAIT))
        await asyncio.sleep(0)
        assert not task.done()
        fs["a"].put_rows(0, np.ones((8, 2), np.int32))
        await asyncio.sleep(0)
        assert not task.done()  # field b is not complete
        fs["b"].put_rows(0, np.ones(8, np.float64))
        await asyncio.wait_for(task, WAIT)
        await asyncio.wait_for(fs.wait_async("a", rows=(2, 6), timeout=WAIT), WAIT)

    asyncio.run(main())
    with pytest.raises(ValueError, match="rows= needs field="):
        asyncio.run(fs.wait_async(rows=(0, 1)))
    with pytest.raises(TypeError, match="rows must be"):
        asyncio.run(fs.wait_async("a", rows=[0, 1]))


def test_fieldset_wait_async_times_out_naming_the_field(pair):
    owner, _ = pair
    fs = owner.publish_fields({"a": ((8, 2), np.int32), "b": ((8,), np.float64)}, tile_rows=4)
    fs["a"].put_rows(0, np.ones((8, 2), np.int32))
    with pytest.raises(memsem.MemsemTimeoutError, match="field 'b'"):
        asyncio.run(fs.wait_async(timeout=0.05))


def _state_dict(seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"w": g.standard_normal((64, 32)).astype(np.float32), "b": g.integers(0, 9, 100).astype(np.int64)}


def test_load_async_loads_one_version_bit_exact(pair):
    owner, consumer = pair
    src = _state_dict(1)
    sd = owner.publish_state_dict(src, name="async-sd")
    csd = consumer.ref(sd.to_bytes())
    with sd.write_section() as w:
        for k, v in _state_dict(2).items():
            w.tensors[k][...] = v
    into = {k: np.zeros_like(v) for k, v in src.items()}

    async def main():
        return await csd.load_async(into)

    v = asyncio.run(main())
    assert v == 2
    for k, want in _state_dict(2).items():
        np.testing.assert_array_equal(into[k], want)
    into1 = {k: np.zeros_like(t) for k, t in src.items()}
    assert csd.load_async(into1, version=1).wait(WAIT) == 1  # the other slot: version 1, exactly
    for k, want in src.items():
        np.testing.assert_array_equal(into1[k], want)


@pytest.mark.parametrize("bad, exc", [({"w": np.zeros((64, 32), np.float32)}, KeyError),
                                      ("into", TypeError),
                                      ({"w": np.zeros((64, 31), np.float32), "b": np.zeros(100, np.int64)}, ValueError)])
def test_load_async_checks_into_at_the_call(pair, bad, exc):
    owner, consumer = pair
    csd = consumer.ref(owner.publish_state_dict(_state_dict(1)).to_bytes())
    with pytest.raises(exc):
        csd.load_async(bad)


@pytest.mark.parametrize("version, exc", [(True, TypeError), (-1, ValueError), (2**63, ValueError), (1.5, TypeError)])
def test_load_async_checks_the_version_at_the_call(pair, version, exc):
    owner, consumer = pair
    src = _state_dict(1)
    csd = consumer.ref(owner.publish_state_dict(src).to_bytes())
    with pytest.raises(exc, match="version"):
        csd.load_async({k: np.zeros_like(v) for k, v in src.items()}, version=version)


def test_cancelling_a_pending_load_async_leaves_into_untouched(pair):
    owner, consumer = pair
    src = _state_dict(1)
    csd = consumer.ref(owner.publish_state_dict(src).to_bytes())
    into = {k: np.zeros_like(v) for k, v in src.items()}
    release = threading.Event()
    started = threading.Event()

    def block():
        started.set()
        if not release.wait(WAIT):
            raise AssertionError("never released")

    blocker = consumer.submit("the only worker, held", block)  # workers=1

    async def main():
        assert started.wait(WAIT)
        load = csd.load_async(into)
        assert load.state == memsem.State.PENDING
        task = asyncio.ensure_future(load.wait_async(WAIT))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return load

    load = asyncio.run(main())
    assert load.state == memsem.State.CANCELLED
    release.set()
    blocker.wait(WAIT)
    for v in into.values():
        assert not v.any()  # never written
    with pytest.raises(memsem.MemsemError, match="cancelled before it started"):
        load.wait(1.0)
