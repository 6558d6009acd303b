"""Completions: handles for non-blocking transfers, with a state enum and bounded waits.

Completion means *remote* completion: for a get, the bytes are in the destination; for a put,
they are visible at the target window. Local-only completion is never reported as DONE.

Both handles can be waited on from threads (``wait``) and from asyncio (``await handle`` or
``await handle.wait_async(timeout)``). An await is woken by the transfer itself: the thread that
finishes the transfer schedules the wake-up on the awaiting loop (``call_soon_threadsafe``), so
nothing polls and no thread is spent per await.

Cancelling an await (``task.cancel()``, ``asyncio.timeout``/``wait_for`` expiring) cancels the
*await*, never a copy in flight:

* a transfer that has not started yet (PENDING: queued behind others in the runtime's workers)
  is cancelled with it: it ends CANCELLED and never touches its buffers;
* a transfer that is RUNNING cannot be stopped half way: it runs on to DONE or FAILED, and the
  handle keeps its buffers (the ``out``/``src`` arrays) referenced until then, so they stay alive
  and mapped even if the caller drops every reference. ``handle.state`` and a later
  ``wait``/``await`` report how it ended. Do not write into ``src`` or read ``out`` before then.

To let a pending transfer run although the await is cancelled, await ``asyncio.shield(handle)``.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from memsem import _args
from memsem._errors import MemsemError, MemsemTimeoutError
from memsem.engines._base import OpState

if TYPE_CHECKING:  # asyncio is imported on first await: `import memsem` stays fast
    import asyncio

T = TypeVar("T")

#: Completion states share the engine op states: PENDING, RUNNING, DONE, FAILED, CANCELLED.
State = OpState

#: default bound (seconds) of ``wait``/``await`` for handles built directly; the runtime passes
#: its own ``timeout`` to the handles it creates.
DEFAULT_TIMEOUT = _args.DEFAULT_TIMEOUT_S


def _wake(waiter: "asyncio.Future[None]") -> None:
    if not waiter.done():
        waiter.set_result(None)


def _wake_from(loop: asyncio.AbstractEventLoop, waiter: "asyncio.Future[None]") -> Callable[[Any], None]:
    """A done callback, run by whichever thread ends the transfer, that wakes ``waiter`` on
    ``loop``. A closed loop has nobody left to wake."""

    def cb(_: Any) -> None:
        try:
            loop.call_soon_threadsafe(_wake, waiter)
        except RuntimeError:  # the loop was closed meanwhile
            pass

    return cb


async def _await_final(loop: asyncio.AbstractEventLoop, subscribe: Callable[[Callable[[Any], None]], None],
                       done: Callable[[], bool], timeout: float, on_cancel: Callable[[], None]) -> bool:
    """Await until ``done()`` or ``timeout`` seconds; True when final. On cancellation of the
    awaiting task, ``on_cancel()`` runs (it cancels what has not started) and the error propagates."""
    import asyncio

    if done():
        return True
    waiter: asyncio.Future[None] = loop.create_future()
    subscribe(_wake_from(loop, waiter))
    timer = loop.call_later(timeout, _wake, waiter)
    try:
        await waiter
    except asyncio.CancelledError:
        on_cancel()
        raise
    finally:
        timer.cancel()
    return done()


class Completion(Generic[T]):
    """Handle of one non-blocking transfer (``get_async``, ``put_async``).

    Args:
        what: what the transfer is, for messages (e.g. "get of window w7 gen 3").
        timeout: default bound in seconds of ``wait``/``await`` (the runtime passes its own).
        keep: objects kept referenced until the transfer is final (its buffers).

    Thread safety: any thread may ``wait``/``done``/``state``; any event loop may ``await``.
    """

    def __init__(self, what: str, *, timeout: float = DEFAULT_TIMEOUT, keep: Any = None) -> None:
        self.what = what
        self.timeout = _args.timeout(timeout, "timeout", positive=True)
        self._future: cf.Future[T] = cf.Future()
        self._keep = keep
        self._future.add_done_callback(self._release)

    def _release(self, _: Any) -> None:
        self._keep = None  # final: the buffers are the caller's again

    @classmethod
    def run(cls, pool: cf.ThreadPoolExecutor, what: str, fn: Callable[[], T], *,
            timeout: float = DEFAULT_TIMEOUT) -> "Completion[T]":
        """Run ``fn`` on ``pool``; the handle keeps ``fn`` (and so the buffers it closes over)
        referenced until it is final."""
        c = cls(what, timeout=timeout, keep=fn)

        def task() -> None:
            if not c._future.set_running_or_notify_cancel():
                return
            try:
                c._future.set_result(fn())
            except BaseException as exc:  # delivered through wait()
                c._future.set_exception(exc)

        fut = pool.submit(task)
        # A task dropped by the pool (runtime closing) never runs: the completion ends CANCELLED.
        fut.add_done_callback(lambda f: c._future.cancel() if f.cancelled() else None)
        return c

    @property
    def state(self) -> OpState:
        f = self._future
        if f.cancelled():
            return OpState.CANCELLED
        if f.done():
            return OpState.FAILED if f.exception() is not None else OpState.DONE
        return OpState.RUNNING if f.running() else OpState.PENDING

    def done(self) -> bool:
        """True when the state is final (DONE, FAILED or CANCELLED). Never blocks."""
        return self._future.done()

    def _outcome(self) -> T:
        try:
            return self._future.result(timeout=0)
        except cf.CancelledError:
            raise MemsemError(f"{self.what} was cancelled before it started") from None

    def _timed_out(self, timeout: float) -> MemsemTimeoutError:
        return MemsemTimeoutError(f"{self.what} not complete after {timeout} s (state "
                                  f"{self.state.name}; the transfer goes on)", what=self.what, timeout=timeout)

    def wait(self, timeout: float | None = None) -> T:
        """Block until final, at most ``timeout`` seconds (default: the runtime's timeout);
        return the result (what the blocking call would have returned).

        Raises:
            MemsemTimeoutError: not final in time (the transfer keeps running).
            MemsemError: the transfer failed (the original error, e.g. StaleReferenceError), or
                was cancelled before it started.
            TypeError / ValueError: ``timeout`` is not a finite number of seconds >= 0.
        """
        t = _args.timeout_or(timeout, self.timeout)
        try:
            return self._future.result(timeout=t)
        except cf.CancelledError:
            raise MemsemError(f"{self.what} was cancelled before it started") from None
        except TimeoutError:
            if not self._future.done():
                raise self._timed_out(t) from None
            raise  # the transfer's own timeout error

    async def wait_async(self, timeout: float | None = None) -> T:
        """Await until final, at most ``timeout`` seconds (default: the runtime's timeout);
        return the result. The event loop is woken by the transfer's end; nothing polls.

        Cancelling the awaiting task cancels the transfer only if it has not started (it then
        ends CANCELLED); a running transfer runs on to DONE or FAILED with its buffers kept
        alive by this handle (see the module docstring).

        Raises:
            MemsemTimeoutError: not final in time (the transfer keeps running).
            MemsemError: as for :meth:`wait`.
            asyncio.CancelledError: the awaiting task was cancelled.
        """
        import asyncio

        t = _args.timeout_or(timeout, self.timeout)
        loop = asyncio.get_running_loop()
        if not await _await_final(loop, self._future.add_done_callback, self._future.done, t,
                                  self._future.cancel):
            raise self._timed_out(t)
        return self._outcome()

    def __await__(self) -> Generator[Any, None, T]:
        """``await completion``: :meth:`wait_async` with the default timeout."""
        return self.wait_async().__await__()

    def cancel(self) -> bool:
        """Cancel if not started; True when it will never run."""
        return self._future.cancel()

    def exception(self) -> BaseException | None:
        if not self._future.done() or self._future.cancelled():
            return None
        return self._future.exception()

    def __repr__(self) -> str:
        return f"<Completion {self.what}: {self.state.name}>"


class RangeResult:
    """Final state of one range of an xcopy batch."""

    __slots__ = ("index", "state", "error", "nbytes")

    def __init__(self, index: int, nbytes: int) -> None:
        self.index = index
        self.state = OpState.PENDING
        self.error: BaseException | None = None
        self.nbytes = nbytes

    def __repr__(self) -> str:
        err = f" {type(self.error).__name__}: {self.error}" if self.error else ""
        return f"<range {self.index} {self.state.name} {self.nbytes} B{err}>"


class Batch:
    """Handle of an xcopy batch: one :class:`RangeResult` per range, each ending DONE, FAILED
    or CANCELLED. ``wait``/``await`` never raise for a failed range: inspect
    ``results``/``errors``, or call ``raise_for_errors``. ``close`` reclaims the batch (cancels
    what did not start, waits for the rest).

    Args:
        results: one RangeResult per range.
        timeout: default bound in seconds of ``wait``/``await``/``close`` (the runtime passes
            its own).

    Cancelling an ``await batch`` cancels the ranges that have not started (they end
    CANCELLED); running ranges go on to DONE or FAILED, their buffers referenced until they end.
    """

    def __init__(self, results: list[RangeResult], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.results = results
        self.timeout = _args.timeout(timeout, "timeout", positive=True)
        self._left = sum(1 for r in results if r.state < OpState.DONE)  # some may be final already
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._futures: list[cf.Future[Any]] = []
        self._callbacks: list[Callable[[Any], None]] = []
        if not self._left:
            self._event.set()

    def settle(self, r: RangeResult, state: OpState, error: BaseException | None = None) -> None:
        """(The runtime's) range ``r`` ended in ``state`` (final): once only."""
        with self._lock:
            if r.state.final:
                return  # settled once only (a cancel can race the range's own end)
            r.state, r.error = state, error
            self._left -= 1
            if self._left:
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def track(self, fut: "cf.Future[Any]") -> None:
        """(The runtime's) a worker task running ranges of this batch: cancelled with them."""
        self._futures.append(fut)

    def _add_done_callback(self, cb: Callable[[Any], None]) -> None:
        """Call ``cb(batch)`` once every range is final (now, if already so)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    def done(self) -> bool:
        return self._event.is_set()

    def _timed_out(self, timeout: float) -> MemsemTimeoutError:
        left = [r.index for r in self.results if not r.state.final]
        return MemsemTimeoutError(f"xcopy batch: ranges {left} not final after {timeout} s",
                                  what="xcopy batch", timeout=timeout)

    def wait(self, timeout: float | None = None) -> list[RangeResult]:
        """Block until every range is final, at most ``timeout`` s (default: the runtime's
        timeout); returns ``results``.

        Raises:
            MemsemTimeoutError: some range is still running (names which).
            TypeError / ValueError: ``timeout`` is not a finite number of seconds >= 0.
        """
        t = _args.timeout_or(timeout, self.timeout)
        if not self._event.wait(t):
            raise self._timed_out(t)
        return self.results

    async def wait_async(self, timeout: float | None = None) -> list[RangeResult]:
        """Await until every range is final, at most ``timeout`` s (default: the runtime's
        timeout); returns ``results``. Woken by the last range's end; nothing polls.

        Raises:
            MemsemTimeoutError: some range is still running. asyncio.CancelledError: the
                awaiting task was cancelled (ranges not started end CANCELLED).
        """
        import asyncio

        t = _args.timeout_or(timeout, self.timeout)
        loop = asyncio.get_running_loop()
        if not await _await_final(loop, self._add_done_callback, self._event.is_set, t, self._cancel_pending):
            raise self._timed_out(t)
        return self.results

    def __await__(self) -> Generator[Any, None, list[RangeResult]]:
        """``await batch``: :meth:`wait_async` with the default timeout."""
        return self.wait_async().__await__()

    @property
    def errors(self) -> dict[int, BaseException]:
        return {r.index: r.error for r in self.results if r.error is not None}

    def raise_for_errors(self) -> None:
        errs = self.errors
        if errs:
            first = min(errs)
            raise MemsemError(f"xcopy: {len(errs)} of {len(self.results)} ranges failed; first, "
                              f"range {first}: {errs[first]}") from errs[first]

    def start(self, r: RangeResult) -> bool:
        """(The runtime's) mark range ``r`` RUNNING, unless it was cancelled (or settled) first: False then, and
        the worker skips it."""
        with self._lock:
            if r.state != OpState.PENDING:
                return False
            r.state = OpState.RUNNING
            return True

    def _cancel_pending(self) -> None:
        """Cancel the ranges that have not started; they end CANCELLED."""
        for f in self._futures:
            f.cancel()
        for r in self.results:
            if r.state == OpState.PENDING:
                with self._lock:
                    if r.state != OpState.PENDING:
                        continue
                    r.state = OpState.RUNNING  # claimed for settling, never run
                self.settle(r, OpState.CANCELLED)

    def close(self, timeout: float | None = None) -> None:
        """Cancel the ranges not started and wait up to ``timeout`` s (default: the runtime's
        timeout) for the running ones.

        Raises:
            MemsemTimeoutError: ranges still running after ``timeout``.
        """
        t = _args.timeout_or(timeout, self.timeout)
        self._cancel_pending()
        self.wait(t)

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
