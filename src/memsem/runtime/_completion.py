"""Completions: handles for non-blocking transfers, with a state enum and bounded waits.

Completion means *remote* completion: for a get, the bytes are in the destination; for a put,
they are visible at the target window. Local-only completion is never reported as DONE.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from memsem._errors import MemsemError, MemsemTimeoutError
from memsem.engines._base import OpState

T = TypeVar("T")

#: Completion states share the engine op states: PENDING, RUNNING, DONE, FAILED, CANCELLED.
State = OpState


class Completion(Generic[T]):
    """Handle of one non-blocking transfer.

    Thread safety: any thread may ``wait``/``done``/``state``.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._future: cf.Future[T] = cf.Future()
        self._running = False

    @classmethod
    def run(cls, pool: cf.ThreadPoolExecutor, what: str, fn: Callable[[], T]) -> "Completion[T]":
        c = cls(what)

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

    def wait(self, timeout: float) -> T:
        """Block until final, at most ``timeout`` seconds; return the result.

        Raises:
            MemsemTimeoutError: not final in time (the transfer keeps running).
            MemsemError: the transfer failed (the original error, e.g. StaleReferenceError).
        """
        try:
            return self._future.result(timeout=timeout)
        except cf.TimeoutError:
            raise MemsemTimeoutError(f"{self.what} not complete after {timeout} s", what=self.what,
                                     timeout=timeout) from None
        except cf.CancelledError:
            raise MemsemError(f"{self.what} was cancelled") from None

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
    or CANCELLED. ``wait`` never raises for a failed range: inspect ``results``/``errors``, or
    call ``raise_for_errors``. ``close`` reclaims the batch (cancels what did not start, waits
    for the rest)."""

    def __init__(self, results: list[RangeResult]) -> None:
        self.results = results
        self._left = len(results)
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._futures: list[cf.Future[Any]] = []
        if not results:
            self._event.set()

    def _settle(self, r: RangeResult, state: OpState, error: BaseException | None = None) -> None:
        with self._lock:
            if r.state.final:
                return  # settled once only (a cancel can race the range's own end)
            r.state, r.error = state, error
            self._left -= 1
            if self._left == 0:
                self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> list[RangeResult]:
        """Block until every range is final, at most ``timeout`` s; returns ``results``.

        Raises:
            MemsemTimeoutError: some range is still running (names how many).
        """
        if not self._event.wait(timeout):
            left = [r.index for r in self.results if not r.state.final]
            raise MemsemTimeoutError(f"xcopy batch: ranges {left} not final after {timeout} s",
                                     what="xcopy batch", timeout=timeout)
        return self.results

    @property
    def errors(self) -> dict[int, BaseException]:
        return {r.index: r.error for r in self.results if r.error is not None}

    def raise_for_errors(self) -> None:
        errs = self.errors
        if errs:
            first = min(errs)
            raise MemsemError(f"xcopy: {len(errs)} of {len(self.results)} ranges failed; first, "
                              f"range {first}: {errs[first]}") from errs[first]

    def close(self, timeout: float = 30.0) -> None:
        for f in self._futures:
            f.cancel()
        for r, f in zip(self.results, self._futures):
            if f.cancelled() and not r.state.final:
                self._settle(r, OpState.CANCELLED)
        self.wait(timeout)

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
