"""The async word waiter: asyncio futures resolved when shared words leave a value.

Tile-ready words, version words and generation words live in shared segments and change in
other processes. A coroutine that waits for one must neither block its event loop nor poll it,
and a program may await thousands of them. :class:`AsyncWordWaiter` keeps one background thread
(per 127 futex entries; see below) blocked in native code (``memsem_wait_any``, the GIL released)
on all awaited words at once, plus an internal *wake word* that it bumps to add or remove a
waiter. When a word leaves the value a waiter expects, the thread resolves that waiter's future
on its own event loop (``loop.call_soon_threadsafe``) with the new value; when its deadline
passes first, the future fails with :class:`memsem.MemsemTimeoutError`.

How the thread blocks, probed once per process (never assumed):

* ``waitv``: Linux ``futex_waitv`` (kernel >= 5.16) on every word at once. A 64-bit word is two
  32-bit entries (both halves), so no change can slip between the thread's last look and its
  sleep. One call takes 128 entries: the wake word and 127 for words (a 64-bit word takes two),
  so each further 127 entries get one more thread (threads per *word*, never per await: awaits
  of the same word and value share one entry).
* ``slices``: where ``futex_waitv`` is missing or refused (ENOSYS, EPERM), the thread waits on
  one word at a time for at most ``MEMSEM_WAIT_SLICE_US`` (2 ms) and re-checks every word after
  each slice: a change is seen within one slice, at the cost of ~500 wake-ups a second while
  anything is awaited (none when nothing is).

Writers must wake the word's address after storing (``memsem.native.futex_wake``), as memsem's
``mark_ready`` does; the waiter works across processes (shared futexes).

Lifetime: the memory under an awaited word must stay mapped until its future is done; pass the
object that holds the mapping as ``keep=`` (the waiter references it until then). ``close()``
(also run by the runtime's ``close``) wakes the thread, joins it and fails every pending future
with :class:`memsem.MemsemError` ("closed"); nothing hangs. Cancelling a future (or the task
awaiting it) removes its waiter. A child forked while waits are pending starts with none of
them (the parent's futures belong to the parent's loops) and new threads on its first wait.
"""
from __future__ import annotations

import asyncio
import errno as _errno
import os
import threading
import weakref
from typing import Any

from memsem import _args
from memsem._errors import EngineError, MemsemError, MemsemTimeoutError, NotSupportedError
from memsem.native._lib import ffi, lib

__all__ = ["AsyncWordWaiter", "probe"]

#: futex entries of one native wait call (the kernel's FUTEX_WAITV_MAX)
WAITV_MAX = lib.MEMSEM_WAITV_MAX
#: seconds an idle waiter thread sleeps before it looks again (adding a waiter wakes it at once)
IDLE_S = 3600.0

_probe: int | None = None


def probe() -> tuple[str, str]:
    """The mode this process can use: ``("waitv", reason)`` or ``("slices", reason)``."""
    global _probe
    if _probe is None:
        _probe = lib.memsem_wait_probe()
    if _probe == 1:
        return "waitv", "futex_waitv available"
    name = _errno.errorcode.get(-_probe, str(-_probe))
    return "slices", f"futex_waitv unavailable ({name}): bounded futex waits in slices"


class _Waiter:
    __slots__ = ("key", "deadline_ns", "fut", "loop", "what", "timeout", "keep")

    def __init__(self, key: tuple[int, int, int], deadline_ns: int, fut: "asyncio.Future[int]",
                 loop: asyncio.AbstractEventLoop, what: str, timeout: float, keep: Any) -> None:
        self.key, self.deadline_ns, self.fut, self.loop = key, deadline_ns, fut, loop
        self.what, self.timeout, self.keep = what, timeout, keep


def _set_result(fut: "asyncio.Future[int]", value: int) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: "asyncio.Future[int]", exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _deliver(w: _Waiter, fn: Any, arg: Any) -> None:
    try:
        w.loop.call_soon_threadsafe(fn, w.fut, arg)
    except RuntimeError:  # its loop is closed: nobody is waiting any more
        pass


class _Shard:
    """One thread and its wake word; up to ``capacity`` futex entries of words."""

    def __init__(self, owner: "AsyncWordWaiter", index: int, capacity: int | None) -> None:
        self.owner = owner
        self.capacity = capacity  # None: unlimited (slices mode)
        self.used = 0
        self.keys: dict[tuple[int, int, int], list[_Waiter]] = {}
        self._wake = ffi.new("uint32_t *")
        self._wake_addr = int(ffi.cast("uintptr_t", self._wake))
        self.thread = threading.Thread(target=self._run, name=f"memsem-async-wait-{index}", daemon=True)
        self.error: BaseException | None = None

    def slots(self, size: int) -> int:
        return 2 if size == 8 and self.owner.mode == "waitv" else 1

    def fits(self, size: int) -> bool:
        return self.capacity is None or self.used + self.slots(size) <= self.capacity

    def bump(self) -> None:
        lib.memsem_wait_bump(self._wake)

    def _run(self) -> None:
        owner = self.owner
        mode = lib.MEMSEM_WAIT_WAITV if owner.mode == "waitv" else lib.MEMSEM_WAIT_SLICES
        while True:
            with owner._lock:
                if owner._closed:
                    return
                keys = list(self.keys)
                n = len(keys) + 1
                words = ffi.new("struct memsem_wait_word[]", n)
                words[0].addr, words[0].size, words[0].expected = self._wake_addr, 4, self._wake[0]
                for i, (addr, size, expected) in enumerate(keys, 1):
                    words[i].addr, words[i].size, words[i].expected = addr, size, expected
                now = lib.memsem_monotonic_ns()
                deadline = min((w.deadline_ns for ws in self.keys.values() for w in ws),
                               default=now + int(IDLE_S * 1e9))
            rc = lib.memsem_wait_any(words, n, deadline, mode)
            if rc < 0 and rc != -_errno.ETIMEDOUT:
                err = EngineError("async word wait failed", errno=-rc)
                self.error = err
                owner._fail_shard(self, err)
                return
            now = lib.memsem_monotonic_ns()
            done: list[tuple[_Waiter, Any, Any]] = []
            with owner._lock:
                for i, key in enumerate(keys, 1):
                    if words[i].changed and key in self.keys:
                        value = int(words[i].seen)
                        for w in self.keys.pop(key):
                            done.append((w, _set_result, value))
                        self.used -= self.slots(key[1])
                for key, ws in list(self.keys.items()):
                    expired = [w for w in ws if w.deadline_ns <= now]
                    if not expired:
                        continue
                    for w in expired:
                        ws.remove(w)
                        done.append((w, _set_exception, MemsemTimeoutError(
                            f"{w.what} did not change within {w.timeout} s", what=w.what, timeout=w.timeout)))
                    if not ws:
                        del self.keys[key]
                        self.used -= self.slots(key[1])
            for w, fn, arg in done:
                _deliver(w, fn, arg)
                w.keep = None


class AsyncWordWaiter:
    """Resolves asyncio futures when shared 32/64-bit words leave an expected value.

    Args:
        mode: ``"auto"`` (default: ``futex_waitv`` where the kernel has it, else slices),
            ``"waitv"`` (NotSupportedError where unavailable) or ``"slices"``.

    Threads start lazily (none until the first wait). Thread safety: one waiter serves any
    number of event loops and threads; call ``wait`` from the thread running ``loop`` (asyncio
    futures are not thread safe); ``close`` from any thread. Use ``close()`` or ``with``.
    """

    def __init__(self, *, mode: str = "auto") -> None:
        if mode not in ("auto", "waitv", "slices"):
            raise ValueError(f"mode must be 'auto', 'waitv' or 'slices', got {mode!r}")
        found, reason = probe()
        if mode == "waitv" and found != "waitv":
            raise NotSupportedError(f"AsyncWordWaiter(mode='waitv'): {reason}")
        self.mode = found if mode == "auto" else mode
        self.reason = reason if mode == "auto" or mode == found else "slices requested"
        self._lock = threading.Lock()
        self._shards: list[_Shard] = []
        self._closed = False
        _instances.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        """How many futures are waiting now."""
        with self._lock:
            return sum(len(ws) for s in self._shards for ws in s.keys.values())

    @property
    def threads(self) -> int:
        """How many background threads run now."""
        with self._lock:
            return sum(1 for s in self._shards if s.thread.is_alive())

    def wait(self, addr: int, expected: int, timeout: float, loop: asyncio.AbstractEventLoop | None = None,
             *, size: int = 8, what: str | None = None, keep: Any = None) -> "asyncio.Future[int]":
        """A future resolved with the word's new value once the ``size``-byte word at ``addr``
        differs from ``expected``; failed with MemsemTimeoutError after ``timeout`` seconds.

        Args:
            addr: address of the word (4-byte aligned for size 4, 8-byte aligned for size 8),
                usually in a shared segment; it must stay mapped until the future is done.
            expected: the value to wait away from (unsigned, fits ``size`` bytes).
            timeout: seconds (finite, >= 0).
            loop: the event loop of the future (default: the running loop).
            size: 4 or 8 (bytes).
            what: what is awaited, for the timeout message (e.g. "tile 3 of window w7").
            keep: an object kept referenced until the future is done (the mapping's holder).

        Returns:
            An ``asyncio.Future[int]``. Cancelling it removes the waiter.

        Raises:
            TypeError / ValueError: bad argument (named). MemsemError: the waiter is closed.
            RuntimeError: no ``loop`` given and no loop running in this thread.
        """
        if size not in (4, 8) or isinstance(size, bool):
            raise ValueError(f"size must be 4 or 8 (bytes), got {size!r}")
        addr = _args.count(addr, "addr", minimum=1)
        if addr % size:
            raise ValueError(f"addr must be {size}-byte aligned for a {size}-byte word, got {addr:#x}")
        expected = _args.count(expected, "expected", maximum=(1 << (8 * size)) - 1)
        t = _args.timeout(timeout, "timeout")
        if loop is None:
            loop = asyncio.get_running_loop()
        what = what or f"{size}-byte word at {addr:#x} (== {expected})"
        fut: asyncio.Future[int] = loop.create_future()
        deadline = lib.memsem_monotonic_ns() + int(t * 1e9)
        key = (addr, size, expected)
        w = _Waiter(key, deadline, fut, loop, what, t, keep)
        with self._lock:
            if self._closed:
                raise MemsemError(f"async word waiter is closed: cannot await {what}")
            shard = next((s for s in self._shards if key in s.keys), None)
            if shard is None:
                shard = next((s for s in self._shards if s.fits(size)), None)
                if shard is None:
                    cap = None if self.mode == "slices" else WAITV_MAX - 1
                    shard = _Shard(self, len(self._shards), cap)
                    self._shards.append(shard)
                    shard.thread.start()
                shard.used += shard.slots(size)
                shard.keys[key] = []
            shard.keys[key].append(w)
            shard.bump()
        fut.add_done_callback(lambda f, w=w, shard=shard: self._forget(shard, w) if f.cancelled() else None)
        return fut

    def _forget(self, shard: _Shard, w: _Waiter) -> None:
        with self._lock:
            ws = shard.keys.get(w.key)
            if ws is None or w not in ws:
                return
            ws.remove(w)
            if not ws:
                del shard.keys[w.key]
                shard.used -= shard.slots(w.key[1])
            w.keep = None
            if not self._closed:
                shard.bump()

    def _fail_shard(self, shard: _Shard, err: BaseException) -> None:
        with self._lock:
            waiters = [w for ws in shard.keys.values() for w in ws]
            shard.keys.clear()
            shard.used = 0
            if shard in self._shards:
                self._shards.remove(shard)
        for w in waiters:
            _deliver(w, _set_exception, err)
            w.keep = None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads and fail every pending future with MemsemError. Safe twice.

        Raises:
            MemsemTimeoutError: a thread did not stop within ``timeout`` s (it is a daemon
                thread blocked in native code; its futures are failed anyway).
        """
        t = _args.timeout(timeout, "timeout")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            shards, self._shards = self._shards, []
            for s in shards:
                s.bump()
        for s in shards:
            if s.thread.is_alive() and s.thread is not threading.current_thread():
                s.thread.join(t)
        stuck = [s.thread.name for s in shards if s.thread.is_alive()]
        for s in shards:
            for ws in s.keys.values():
                for w in ws:
                    _deliver(w, _set_exception, MemsemError(f"async word waiter closed while awaiting {w.what}"))
                    w.keep = None
            s.keys.clear()
        if stuck:
            raise MemsemTimeoutError(f"async word waiter threads {stuck} did not stop in {t} s",
                                     what="async word waiter threads", timeout=t)

    def __enter__(self) -> "AsyncWordWaiter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.pending} pending, {self.threads} thread(s)"
        return f"<AsyncWordWaiter {self.mode}: {state}>"


_instances: "weakref.WeakSet[AsyncWordWaiter]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's waiter threads, and the parent's futures belong
    to the parent's event loops: start every waiter afresh (new threads on the next wait)."""
    for w in list(_instances):
        w._lock = threading.Lock()
        w._shards = []


os.register_at_fork(after_in_child=_after_fork_in_child)
