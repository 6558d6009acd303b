"""asyncio: ``await completion`` / ``await batch``, cancellation, default timeouts, and the
native word waiter (``memsem.core._async.AsyncWordWaiter``).

Orders are forced by the tests (a gated engine holds a copy until the test opens the gate);
nothing here depends on scheduling luck or asserts a wall-clock bound.
"""
from __future__ import annotations

import asyncio
import gc
import math
import os
import threading
import weakref

import numpy as np
import pytest

import memsem
from memsem.engines.host import HostEngine
from memsem.testing import ScriptedEngine

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

        async def main(out):
            c = cref.get_async(out)
            task = asyncio.ensure_future(c.wait_async(20.0))
            await asyncio.get_running_loop().run_in_executor(None, gate.wait_started)
            assert c.state == memsem.State.RUNNING
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return c

        c = asyncio.run(main(out))
        del out  # only the handle references the buffer now
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


# -- the native word waiter ---------------------------------------------------------------------
from memsem import native  # noqa: E402
from memsem.native import Segment  # noqa: E402
from memsem.core._async import AsyncWordWaiter, probe  # noqa: E402
from tests._proc import reap, recv, spawn  # noqa: E402

MODES = ["waitv", "slices"]


def word_writer(conn, name, nbytes):
    """Child: map the segment and store words on command, waking their futexes."""
    seg = Segment.attach(name, nbytes)
    arr = seg.export()
    conn.send("ready")
    while True:
        if not conn.poll(60):
            return
        cmd = conn.recv()
        if cmd[0] == "stop":
            conn.send("bye")
            return
        for off, size, value in cmd[1]:
            view = arr[off:off + size].view(np.uint64 if size == 8 else np.uint32)
            view[0] = value
            native.futex_wake(seg.address + off)
        conn.send("done")


@pytest.fixture
def segment():
    seg = Segment.create("test", 1 << 16)
    try:
        yield seg
    finally:
        seg.unlink()
        seg.close()


@pytest.fixture
def writer(segment):
    p, conn = spawn(word_writer, segment.name, segment.nbytes)
    assert recv(conn, 60) == "ready"

    def write(*triples):
        conn.send(("set", list(triples)))
        assert recv(conn, 60) == "done"

    try:
        yield write
    finally:
        conn.send(("stop",))
        reap([p])


@pytest.fixture(params=MODES)
def waiter(request):
    if request.param == "waitv" and probe()[0] != "waitv":
        pytest.skip(f"this kernel cannot: {probe()[1]}")
    with AsyncWordWaiter(mode=request.param) as w:
        yield w


def test_many_words_written_by_another_process(segment, writer, waiter):
    """300 64-bit words and 100 32-bit words (more than one futex_waitv call holds), three
    awaits on some of them, resolved by stores of a spawned process."""
    base = segment.address
    words64 = [(i * 8, 8) for i in range(300)]
    words32 = [(4096 + i * 4, 4) for i in range(100)]

    async def main():
        futs = [waiter.wait(base + off, 0, 30.0, size=size) for off, size in words64 + words32]
        extra = [waiter.wait(base + off, 0, 30.0, size=8) for off, _ in words64[:20]]
        assert waiter.pending == 420
        if waiter.mode == "waitv":
            assert waiter.threads >= 6  # 127 futex entries per thread; a 64-bit word takes 2
        else:
            assert waiter.threads == 1
        loop = asyncio.get_running_loop()
        triples = [(off, size, (7 << 32 | i) if size == 8 else 1000 + i)
                   for i, (off, size) in enumerate(words64 + words32)]
        await loop.run_in_executor(None, lambda: writer(*triples))
        got = await asyncio.wait_for(asyncio.gather(*futs), 30.0)
        got_extra = await asyncio.wait_for(asyncio.gather(*extra), 30.0)
        return triples, got, got_extra

    triples, got, got_extra = asyncio.run(main())
    assert got == [v for _, _, v in triples]
    assert got_extra == got[:20]
    assert waiter.pending == 0


def test_a_change_of_the_high_half_only_is_seen(segment, writer, waiter):
    base = segment.address
    writer((0, 8, 5))

    async def main():
        fut = waiter.wait(base, 5, 30.0)
        await asyncio.get_running_loop().run_in_executor(None, lambda: writer((0, 8, 5 | (1 << 32))))
        return await asyncio.wait_for(fut, 30.0)

    assert asyncio.run(main()) == 5 | (1 << 32)


def test_a_word_already_changed_resolves_at_once(segment, writer, waiter):
    writer((8, 8, 42))

    async def main():
        return await asyncio.wait_for(waiter.wait(segment.address + 8, 0, 30.0), 30.0)

    assert asyncio.run(main()) == 42


def test_cancelling_an_await_removes_its_waiter(segment, writer, waiter):
    base = segment.address

    async def main():
        task = asyncio.ensure_future(waiter.wait(base, 0, 30.0))
        other = waiter.wait(base + 8, 0, 30.0)
        await asyncio.sleep(0)
        assert waiter.pending == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # the future's done callbacks run one loop iteration later
        assert waiter.pending == 1
        # The cancelled word changes later: nothing is delivered to the dead future, the other
        # waiter still works.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: writer((0, 8, 1), (8, 8, 2)))
        return await asyncio.wait_for(other, 30.0)

    assert asyncio.run(main()) == 2
    assert waiter.pending == 0


def test_timeouts_fail_their_own_futures_only(segment, writer, waiter):
    base = segment.address

    async def main():
        short = waiter.wait(base, 0, 0.05, what="tile 3 of test window")
        zero = waiter.wait(base, 0, 0.0)
        long = waiter.wait(base + 8, 0, 30.0)
        with pytest.raises(memsem.MemsemTimeoutError, match="tile 3 of test window did not change within 0.05 s"):
            await asyncio.wait_for(short, 30.0)
        with pytest.raises(memsem.MemsemTimeoutError):
            await asyncio.wait_for(zero, 30.0)
        assert isinstance(short.exception(), TimeoutError)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: writer((8, 8, 9)))
        return await asyncio.wait_for(long, 30.0)

    assert asyncio.run(main()) == 9


def test_close_fails_pending_awaits_and_stops_threads(segment, waiter):
    base = segment.address
    keep = object()

    class Holder:
        pass

    holder = Holder()
    keep_ref = weakref.ref(holder)

    async def main(holder):
        futs = [waiter.wait(base + 8 * i, 0, 30.0, keep=holder if i == 0 else keep) for i in range(10)]
        await asyncio.sleep(0)
        waiter.close()
        results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30.0)
        return results

    results = asyncio.run(main(holder))
    assert all(isinstance(r, memsem.MemsemError) and "closed" in str(r) for r in results)
    assert waiter.threads == 0 and waiter.closed
    del holder
    gc.collect()
    assert keep_ref() is None  # the waiter let go of what it kept
    waiter.close()  # safe twice

    async def after():
        waiter.wait(base, 0, 1.0)

    with pytest.raises(memsem.MemsemError, match="closed"):
        asyncio.run(after())


def test_runtime_close_closes_its_word_waiter(segment):
    base = segment.address
    rt = memsem.Runtime(timeout=10.0)
    w = rt.word_waiter()
    assert rt.word_waiter() is w  # one per runtime
    assert w.threads == 0  # created lazily

    async def main():
        fut = w.wait(base, 0, 30.0)
        await asyncio.sleep(0)
        assert w.threads == 1
        rt.close()
        with pytest.raises(memsem.MemsemError, match="closed"):
            await asyncio.wait_for(fut, 30.0)

    try:
        asyncio.run(main())
    finally:
        rt.close()
    assert w.closed and w.threads == 0
    with pytest.raises(memsem.MemsemError, match="runtime is closed"):
        rt.word_waiter()


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"addr": 3}, ValueError, "aligned"),
    ({"addr": 0}, ValueError, "addr"),
    ({"addr": True}, TypeError, "addr"),
    ({"size": 2}, ValueError, "size"),
    ({"expected": 1 << 64}, ValueError, "expected"),
    ({"expected": -1}, ValueError, "expected"),
    ({"size": 4, "expected": 1 << 32}, ValueError, "expected"),
    ({"timeout": math.nan}, ValueError, "timeout"),
    ({"timeout": math.inf}, ValueError, "timeout"),
    ({"timeout": -1.0}, ValueError, "timeout"),
    ({"timeout": True}, TypeError, "timeout"),
])
def test_wait_arguments_are_checked(segment, kwargs, exc, match):
    args = {"addr": segment.address, "expected": 0, "timeout": 1.0, "size": 8}
    args.update(kwargs)
    with AsyncWordWaiter() as w:
        async def main():
            w.wait(args.pop("addr"), args.pop("expected"), args.pop("timeout"), **args)

        with pytest.raises(exc, match=match):
            asyncio.run(main())
        assert w.threads == 0 and w.pending == 0
    with pytest.raises(ValueError, match="mode"):
        AsyncWordWaiter(mode="spin")


def test_a_kernel_without_futex_waitv_gets_slices(monkeypatch):
    import errno

    import memsem.core._async as am

    real = probe()
    monkeypatch.setattr(am, "_probe", -errno.ENOSYS)
    mode, reason = probe()
    assert mode == "slices" and "ENOSYS" in reason
    with AsyncWordWaiter() as w:
        assert w.mode == "slices" and "ENOSYS" in w.reason
    with pytest.raises(memsem.NotSupportedError, match="ENOSYS"):
        AsyncWordWaiter(mode="waitv")
    monkeypatch.setattr(am, "_probe", -errno.EPERM)  # a seccomp filter refusing the call
    assert probe()[0] == "slices" and "EPERM" in probe()[1]
    monkeypatch.undo()
    assert probe() == real


def _forked_wait(conn, addr):
    async def main(w):
        return await asyncio.wait_for(w.wait(addr, 0, 30.0), 30.0)

    conn.send(asyncio.run(main(_INHERITED[0])))


_INHERITED: list = []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_waits_with_threads_of_its_own(segment):
    import multiprocessing as mp

    base = segment.address
    arr = segment.export()
    with AsyncWordWaiter() as w:
        _INHERITED[:] = [w]

        async def parent_pending():
            fut = w.wait(base + 8, 0, 30.0)  # pending in the parent while it forks
            await asyncio.sleep(0)
            arr[:8].view(np.uint64)[0] = 77  # the word the child awaits has changed already
            ctx = mp.get_context("fork")
            a, b = ctx.Pipe()
            p = ctx.Process(target=_forked_wait, args=(b, base), daemon=True)
            p.start()
            got = await asyncio.get_running_loop().run_in_executor(None, lambda: a.poll(60) and a.recv())
            p.join(30)
            fut.cancel()
            return got

        try:
            assert asyncio.run(parent_pending()) == 77
        finally:
            _INHERITED.clear()
