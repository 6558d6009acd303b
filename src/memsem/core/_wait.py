"""One wait: a deadline, a word to sleep on, re-checks every slice, one timeout error.

Every blocking wait of the runtime is a :class:`Wait`: a version to be committed, a tile to be
marked, an open write section to close (the retry of a copy that found it open or was torn by
it), leases to be released, copies in flight to drain, a pinned version to be let go. A wait

* has one deadline, armed when the wait begins (a retry loop begins its wait at its first
  retry of any kind, so no retry outlives the caller's timeout);
* sleeps on a word where there is one: a futex wait on a control-block word (woken by its
  writer), or on the local mirror of a remote window's word (``memsem.core._remote``: woken by
  the owner's push, or read one-sidedly with a bounded back-off); a plain pause only where no
  word exists (a lease held in another node's directory);
* sleeps at most ``WAIT_SLICE_S`` at a time and after every slice runs its re-checks: the
  caller's ``stop`` (a closing part, e.g. a relay's follower thread: its own error ends the
  wait within a slice), the window's generation (``StaleReferenceError``; the resolution is
  dropped) and the owner's liveness (``PeerLostError``), so a wait never outlives what it
  waits on or who waits;
* ends in one ``MemsemTimeoutError`` naming what it waited for and for how long, counted once in
  the runtime's telemetry (kind "timeout").
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memsem import native
from memsem._errors import MemsemTimeoutError, PeerLostError, StaleReferenceError
from memsem.core import _translate as tr
from memsem.core._liveness import WAIT_SLICE_S

if TYPE_CHECKING:
    from memsem.core._resolve import Resolution
    from memsem.core._telemetry import Telemetry
    from memsem.gva import RefSpec

_MASK32 = 0xFFFFFFFF
#: asyncio waits re-check generation and liveness this often (seconds): the native word waiter
#: wakes them on a change, the slice only bounds how stale a dead owner can be
ASYNC_SLICE_S = 1.0


class Wait:
    """One bounded wait (see the module docstring).

    Args:
        what: what is waited for ("version 3 of window 'w' (gva 0x...)"): the error's ``what``.
        timeout: seconds (already through the argument door).
        telemetry: the runtime's counters (the timeout is counted there once).
        state: how the error says it ended: "<what> <state> after <timeout> s".
        recheck: called after every slice; raises when the wait must end (stale, peer lost);
            ``rechecking`` replaces it (a retry loop that resolved its ref again).
        detail: called for the timeout message's last words ("latest is 2").
        stop: the caller's own check, called after every slice before the re-checks; raises
            to end the wait early (a part that is closing). Kept by ``rechecking``.
    """

    __slots__ = ("what", "timeout", "state", "_end", "_recheck", "_telemetry", "_detail", "_stop", "slices")

    def __init__(self, what: str, timeout: float, *, telemetry: "Telemetry", state: str = "not reached",
                 recheck: Callable[[], None] | None = None, detail: Callable[[], str] | None = None,
                 stop: Callable[[], None] | None = None) -> None:
        self.what = what
        self.state = state
        self.timeout = timeout
        self._end = time.monotonic() + timeout
        self._recheck = recheck
        self._telemetry = telemetry
        self._detail = detail
        self._stop = stop
        #: slices slept so far (tests count them)
        self.slices = 0

    def left(self) -> float:
        """Seconds left before the deadline (0.0 once it passed)."""
        return max(0.0, self._end - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self._end

    def check(self) -> None:
        """Raise the wait's timeout error when its deadline passed."""
        if time.monotonic() >= self._end:
            raise self.error()

    def error(self) -> MemsemTimeoutError:
        """The one timeout error of this wait (counted)."""
        self._telemetry.count_error("timeout")
        more = ""
        if self._detail is not None:
            try:
                more = f" ({self._detail()})"
            except Exception:  # noqa: BLE001 - the detail is decoration; the timeout is the error
                more = ""
        return MemsemTimeoutError(f"{self.what} {self.state} after {self.timeout:g} s{more}",
                                  what=self.what, timeout=self.timeout)

    def rechecking(self, recheck: Callable[[], None] | None) -> "Wait":
        """Replace the re-checks (after the caller resolved its ref again); returns self."""
        self._recheck = recheck
        return self

    def recheck(self) -> None:
        """Everything the wait re-checks after a slice (raises when the wait must end)."""
        if self._stop is not None:
            self._stop()
        if self._recheck is not None:
            self._recheck()

    def before(self) -> None:
        """What must hold before a value is accepted (a window's generation)."""
        g = getattr(self._recheck, "generation", None)
        if g is not None:
            g()

    # -- sleeping ---------------------------------------------------------------------------------
    def sleep(self, block: Callable[[float], Any]) -> None:
        """One slice: raise at the deadline, else ``block(seconds)`` for at most a slice (it may
        return early), then the re-checks."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise self.error()
        block(min(WAIT_SLICE_S, left))
        self.slices += 1
        self.recheck()

    def nap(self, block: Callable[[float], Any]) -> bool:
        """``sleep`` for a caller that raises its own error at the deadline (a retire raises
        LeaseHeldError naming the holders): False, without blocking or re-checking, once the
        deadline passed."""
        left = self._end - time.monotonic()
        if left <= 0:
            return False
        block(min(WAIT_SLICE_S, left))
        self.slices += 1
        self.recheck()
        return True

    def sleep_word(self, addr: int, expected: int, mirror: Any = None) -> None:
        """One slice asleep while the 64-bit word at ``addr`` holds ``expected``: a futex wait on
        its low half, or (``mirror``: a remote window's local mirror) the mirror's own wait."""
        if mirror is not None:
            self.sleep(lambda s: mirror.wait_word(addr, expected, s))
        else:
            self.sleep(lambda s: native.futex_wait(addr, expected & _MASK32, s))

    def pause(self) -> None:
        """One slice of plain sleep: only for what has no word to wait on (leases held in another
        node's directory)."""
        self.sleep(time.sleep)

    def until(self, addr: int, done: Callable[[int], bool], mirror: Any = None,
              sync: Callable[[], None] | None = None) -> int:
        """Wait until ``done(word)`` holds for the word at ``addr``; returns its value. The
        re-checks run before a value is accepted (a word of a retired window never satisfies
        the wait). ``sync`` refreshes a mirror read one-sidedly before each look."""
        while True:
            if sync is not None:
                sync()
            v = native.load_acquire(addr)
            self.before()
            if done(v):
                return v
            self.sleep_word(addr, v, mirror)

    async def until_async(self, addr: int, done: Callable[[int], bool], waiter: Any, keep: Any,
                          loop: asyncio.AbstractEventLoop) -> int:
        """``until`` for asyncio, through the runtime's native word waiter (one background thread
        for all awaited words): the event loop is never blocked or polled. Re-checks every
        ``ASYNC_SLICE_S``."""
        while True:
            v = native.load_acquire(addr)
            self.before()
            if done(v):
                return v
            left = self._end - time.monotonic()
            if left <= 0:
                raise self.error()
            try:
                await waiter.wait(addr, v, min(ASYNC_SLICE_S, left), loop, what=self.what, keep=keep)
            except MemsemTimeoutError:
                pass  # one slice of the waiter; this wait's own deadline decides
            self.slices += 1


class WindowChecks:
    """The re-checks of a wait on a window's words (``window_checks``). Calling it checks
    everything (after a slice); ``generation`` only what must hold before a value is accepted
    (a word of a retired window never satisfies a wait; a tile already marked is ready even
    if its owner has died since: the next copy says so)."""

    __slots__ = ("_res", "_spec", "_cb", "_remote_check", "_where")

    def __init__(self, res: "Resolution", spec: "RefSpec", words: Any, remote_check: Callable[[], None] | None,
                 where: str) -> None:
        self._res, self._spec, self._cb = res, spec, words
        self._remote_check = remote_check
        self._where = where

    def generation(self) -> None:
        cb, spec = self._cb, self._spec
        if cb is not None:
            g = cb.generation
            if g != spec.generation:
                res = self._res
                res.resolver.drop(spec.gva, res)
                res.telemetry.count_error("stale")
                raise tr.stale(spec, g)

    def __call__(self) -> None:
        self.generation()
        res = self._res
        if self._remote_check is not None:
            try:
                self._remote_check()
            except StaleReferenceError:
                res.telemetry.count_error("stale")
                raise
            except PeerLostError:
                res.telemetry.count_error("peer_lost")
                raise
        elif not res.own_cb and not res.peer.is_self and not res.peer.alive():
            res.telemetry.count_error("peer_lost")
            raise res.peer.lost(self._where)


def window_checks(res: "Resolution", spec: "RefSpec", words: Any = None,
                  remote_check: Callable[[], None] | None = None, during: str = "") -> WindowChecks:
    """The re-checks of a wait on a window's words (``words``: its control block here, or the
    mirror of a remote one; default the resolution's control block): the generation moved
    (StaleReferenceError, the resolution is dropped, counted "stale") and the owner is dead
    (PeerLostError, counted "peer_lost"; ``remote_check`` for a mirror: its subscription and
    the directory's view of the owner). ``during`` names the wait in a PeerLostError."""
    where = f"{spec.label}, while {during} was awaited," if during else spec.label
    return WindowChecks(res, spec, res.cb if words is None else words, remote_check, where)


__all__ = ["ASYNC_SLICE_S", "Wait", "WindowChecks", "window_checks"]
