"""asyncio: ``await completion`` / ``await batch``, cancellation, default timeouts, and the
native word waiter (``memsem.runtime._async.AsyncWordWaiter``).

Orders are forced by the tests (a gated engine holds a copy until the test opens the gate);
nothing here depends on scheduling luck or asserts a wall-clock bound.
"""
from __future__ import annotations

import asyncio
import gc
import math
import threading
import weakref

import numpy as np
import pytest

import memsem
from memsem.engines.host import HostEngine
from memsem.engines.mock import ScriptedEngine

GATE_TIMEOUT = 30.0


class Gate:
    """A ``fail`` hook for ScriptedEngine: each op announces itself and waits for the gate."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.open = threading.Event()
        self.calls = 0

    def __call__(self, kind: str, offset: int, nbytes: int) -> bool:
        self.calls += 1
        self.started.release()
        if not self.open.wait(GATE_TIMEOUT):
            raise AssertionError("gate never opened")
        return False

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=GATE_TIMEOUT), "no op reached the engine"


@pytest.fixture
def owner():
    with memsem.Runtime(timeout=10.0) as rt:
        yield rt


def gated_consumer(gate: Gate, workers: int = 1) -> memsem.Runtime:
    return memsem.Runtime(timeout=10.0, workers=workers, engines=["host"],
                          engine_objects={"host": ScriptedEngine(HostEngine(), fail=gate)})


def published(owner, n=4096, seed=3):
    data = np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)
    return data, owner.publish(data)


# -- await completion / batch -------------------------------------------------------------------
def test_await_get_and_put(owner):
    data, ref = published(owner)
    before = data.copy()
    with memsem.Runtime(timeout=10.0) as cons:
        cref = cons.ref(ref.to_bytes())

        async def main():
            got = await cref.get_async()
            new = (data[::-1]).copy()
            await cref.put_async(new)
            again = await cref.get_async().wait_async(5.0)
            return got, new, again

        got, new, again = asyncio.run(main())
    assert np.array_equal(got, before)
    assert np.array_equal(again, new) and np.array_equal(data, new)


def test_await_failure_raises_the_transfer_error(owner):
    data, ref = published(owner)
    with memsem.Runtime(timeout=10.0) as cons:
        cref = cons.ref(ref.to_bytes())
        owner.unpublish(ref)

        async def main():
            return await cref.get_async()

        with pytest.raises(memsem.StaleReferenceError):
            asyncio.run(main())


def test_await_batch(owner):
    data, ref = published(owner)
    with memsem.Runtime(timeout=10.0) as cons:
        cref = cons.ref(ref.to_bytes())
        outs = [np.zeros(1024, np.uint8) for _ in range(4)]

        async def main():
            return await cons.xcopy([(cref.bytes(i * 1024, 1024), outs[i]) for i in range(4)])

        results = asyncio.run(main())
    assert [r.state for r in results] == [memsem.State.DONE] * 4
    assert np.array_equal(np.concatenate(outs), data)


def test_many_concurrent_awaits_share_one_loop(owner):
    data, ref = published(owner, 1 << 16)
    with memsem.Runtime(timeout=10.0, workers=2) as cons:
        cref = cons.ref(ref.to_bytes())

        async def main():
            return await asyncio.gather(*(cref.get_async() for _ in range(64)))

        threads_before = threading.active_count()
        outs = asyncio.run(main())
        # No thread per await: only the runtime's fixed worker pool may have started.
        assert threading.active_count() <= threads_before + 2
    assert all(np.array_equal(o, data) for o in outs)


def test_await_is_woken_by_the_transfer_not_by_polling(owner):
    """While the copy is held at the gate, the awaiting loop runs no callback at all."""
    data, ref = published(owner)
    gate = Gate()
    with gated_consumer(gate) as cons:
        cref = cons.ref(ref.to_bytes())

        async def main():
            loop = asyncio.get_running_loop()
            c = cref.get_async()
            task = asyncio.ensure_future(c.wait_async(20.0))
            await asyncio.sleep(0)
            await loop.run_in_executor(None, gate.wait_started)
            ticks = []
            orig = loop._run_once  # count loop iterations while the await is blocked

            def counting():
                ticks.append(1)
                orig()

            loop._run_once = counting
            try:
                await loop.run_in_executor(None, lambda: threading.Event().wait(0.2))
                idle = len(ticks)
            finally:
                loop._run_once = orig
            gate.open.set()
            return await task, idle

        got, idle = asyncio.run(main())
    assert np.array_equal(got, data)
    # A poller would iterate the loop continuously; here the loop only wakes for the executor's
    # own completion (a handful of iterations), never in a busy cycle.
    assert idle < 20, idle


def test_cancel_await_of_running_transfer_keeps_buffers_and_runs_to_done(owner):
    data, ref = published(owner)
    gate = Gate()
    with gated_consumer(gate) as cons:
        cref = cons.ref(ref.to_bytes())
        out = np.zeros(data.nbytes, np.uint8)
        out_alive = weakref.ref(out)

        async def main():
            c = cref.get_async(out)
            task = asyncio.ensure_future(c.wait_async(20.0))
            await asyncio.get_running_loop().run_in_executor(None, gate.wait_started)
            assert c.state == memsem.State.RUNNING
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return c

        c = asyncio.run(main())
        del out
        gc.collect()
        # The await is gone, the copy is held in the engine: the handle keeps its buffer alive.
        assert c.state == memsem.State.RUNNING and out_alive() is not None
        gate.open.set()
        got = c.wait(20.0)
        assert c.state == memsem.State.DONE
        assert got is out_alive() and np.array_equal(got, data)
        # Final: the handle lets its buffers go (the result is the caller's array).
        del got
        assert c._keep is None


def test_cancel_await_of_pending_transfer_cancels_it(owner):
    data, ref = published(owner)
    gate = Gate()
    with gated_consumer(gate, workers=1) as cons:
        cref = cons.ref(ref.to_bytes())

        async def main():
            first = cref.get_async()  # occupies the only worker, held at the gate
            await asyncio.get_running_loop().run_in_executor(None, gate.wait_started)
            second = cref.get_async()
            assert second.state == memsem.State.PENDING
            task = asyncio.ensure_future(second.wait_async(20.0))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return first, second

        first, second = asyncio.run(main())
        assert second.state == memsem.State.CANCELLED
        gate.open.set()
        assert np.array_equal(first.wait(20.0), data)
        with pytest.raises(memsem.MemsemError, match="cancelled before it started"):
            second.wait(1.0)
        assert gate.calls == 1  # the cancelled get never reached the engine


def test_shield_lets_a_pending_transfer_run(owner):
    data, ref = published(owner)
    gate = Gate()
    with gated_consumer(gate, workers=1) as cons:
        cref = cons.ref(ref.to_bytes())

        async def main():
            first = cref.get_async()
            await asyncio.get_running_loop().run_in_executor(None, gate.wait_started)
            second = cref.get_async()
            task = asyncio.ensure_future(asyncio.shield(second))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.open.set()
            return await first, await second

        a, b = asyncio.run(main())
    assert np.array_equal(a, data) and np.array_equal(b, data)


def test_cancel_await_batch_cancels_only_ranges_not_started(owner):
    data, ref = published(owner)
    gate = Gate()
    with gated_consumer(gate, workers=1) as cons:
        cref = cons.ref(ref.to_bytes())
        outs = [np.zeros(1024, np.uint8) for _ in range(3)]

        async def main():
            batch = cons.xcopy([(cref.bytes(i * 1024, 1024), outs[i]) for i in range(3)])
            await asyncio.get_running_loop().run_in_executor(None, gate.wait_started)
            task = asyncio.ensure_future(batch.wait_async(20.0))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return batch

        batch = asyncio.run(main())
        gate.open.set()
        results = batch.wait(20.0)
    states = [r.state for r in results]
    assert states == [memsem.State.DONE, memsem.State.CANCELLED, memsem.State.CANCELLED]
    assert np.array_equal(outs[0], data[:1024]) and not outs[1].any() and not outs[2].any()


def test_await_timeout_leaves_the_transfer_running(owner):
    data, ref = published(owner)
    gate = Gate()
    with gated_consumer(gate) as cons:
        cref = cons.ref(ref.to_bytes())
        c = cref.get_async()
        batch = cons.xcopy([(cref.bytes(0, 16), np.zeros(16, np.uint8))])

        async def main():
            with pytest.raises(memsem.MemsemTimeoutError, match="not complete after 0.05 s"):
                await c.wait_async(0.05)
            with pytest.raises(memsem.MemsemTimeoutError, match="not final after 0.05 s"):
                await batch.wait_async(0.05)

        gate.wait_started()
        asyncio.run(main())
        assert not c.done()
        gate.open.set()
        assert np.array_equal(c.wait(20.0), data)
        batch.close(20.0)


# -- default and validated timeouts --------------------------------------------------------------
def test_handles_default_to_the_runtime_timeout(owner):
    data, ref = published(owner)
    with memsem.Runtime(timeout=7.5) as cons:
        cref = cons.ref(ref.to_bytes())
        c = cref.get_async()
        b = cons.xcopy([(cref.bytes(0, 16), np.zeros(16, np.uint8))])
        assert c.timeout == 7.5 and b.timeout == 7.5
        assert np.array_equal(c.wait(), data)  # no timeout argument needed
        b.wait()
        b.close()
    assert memsem.Completion("x").timeout == 30.0
    assert memsem.Batch([]).timeout == 30.0


@pytest.mark.parametrize("bad,exc", [(math.nan, ValueError), (math.inf, ValueError), (-1, ValueError),
                                     (True, TypeError), ("1", TypeError)])
def test_handle_timeouts_are_validated(owner, bad, exc):
    data, ref = published(owner)
    with memsem.Runtime(timeout=10.0) as cons:
        cref = cons.ref(ref.to_bytes())
        c = cref.get_async()
        b = cons.xcopy([(cref.bytes(0, 16), np.zeros(16, np.uint8))])
        for call in (c.wait, b.wait, b.close):
            with pytest.raises(exc, match="timeout"):
                call(bad)
        for coro_fn in (c.wait_async, b.wait_async):
            with pytest.raises(exc, match="timeout"):
                asyncio.run(coro_fn(bad))
        with pytest.raises(exc, match="timeout"):
            memsem.Completion("x", timeout=bad)
        with pytest.raises(exc, match="timeout"):
            memsem.Batch([], timeout=bad)
        c.wait(10.0)
        b.close(10.0)
