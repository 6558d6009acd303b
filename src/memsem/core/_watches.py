"""Watches of control words for remote consumers (the owner side of an engine that pushes
them: tcp): subscriptions of a grant's window and the hub that watches the words.

**Watches.** A grant can subscribe a consumer to control words of its window (the ready words,
the latest-version word): one hub thread per runtime blocks in the native multi-word waiter on
the window's ready sequence word and latest-version word; on a change the subscriptions are
marked dirty and their engine's sender collects the words that changed since it last sent them
(coalesced; memory per subscription is one snapshot). No polling, no sleeps.
"""
from __future__ import annotations

import errno as _errno
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import native
from memsem._errors import EngineError, MemsemError
from memsem.engines import WATCH_HEADER, WATCH_READY
from memsem.gva._control_block import W_GENERATION, W_LATEST, W_READY_SEQ, W_SEQ0, W_SEQ1, W_STATE

if TYPE_CHECKING:
    from memsem.core._serve import Grant

log = logging.getLogger(__name__)

#: header words of a control block a remote consumer may watch
WATCHABLE_HEADER = (W_GENERATION, W_STATE, W_LATEST, W_SEQ0, W_SEQ1)
#: targets of one watch, and subscriptions of one runtime
MAX_TARGETS = 16
MAX_SUBSCRIPTIONS = 65536

_ffi = native.ffi
_lib = native.lib


class Subscription:
    """Control words of one window watched for one remote consumer (see ``Grant.watch``)."""

    def __init__(self, hub: "WatchHub", grant: "Grant", targets: list[tuple[int, int, int]],
                 notify: Callable[[], None]) -> None:
        self.hub = hub
        self.gva = grant.gva
        self.notify = notify
        #: set by the engine that serves it: ``flush(timeout)`` returns once what ``notify``
        #: started was handed to the consumer's connection (at most ``timeout`` s)
        self.flush: Callable[[float], None] | None = None
        self.dirty = True
        self.closed = False
        self._lock = threading.Lock()
        self._cb = grant.pin_control()
        cb = self._cb
        self.header = [i for kind, i, _ in targets if kind == WATCH_HEADER]
        self._last_header: dict[int, int] = {}
        self._ready: list[tuple[int, np.ndarray, np.ndarray]] = []
        for kind, index, count in targets:
            if kind == WATCH_READY and count:
                words = np.frombuffer(_ffi.buffer(_ffi.cast("char *", cb.ready_addr(index)), 8 * count), np.uint64)
                self._ready.append((index, words, np.zeros(count, np.uint64)))
        self.watches_ready = bool(self._ready)

    def collect(self) -> list[tuple[int, int, int]]:
        """``(kind, index, value)`` of every watched word that changed since the last collect
        (all non-zero ones the first time). Empty once closed."""
        with self._lock:
            if self.closed:
                return []
            cb = self._cb
            out: list[tuple[int, int, int]] = []
            for i in self.header:
                v = cb.word(i)
                if self._last_header.get(i) != v:
                    self._last_header[i] = v
                    out.append((WATCH_HEADER, i, v))
            for first, words, last in self._ready:
                now = words.copy()  # aligned 8-byte words: each read whole
                native.lib.memsem_fence_seq_cst()
                changed = np.flatnonzero(now != last)
                if changed.size:
                    last[changed] = now[changed]
                    out.extend((WATCH_READY, first + int(t), int(now[t])) for t in changed)
            return out

    def close(self) -> None:
        """Stop watching (safe twice; the control block is unpinned)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._ready = []
        self.hub.unsubscribe(self)
        self._cb.unpin()


class _Window:
    """A window the hub watches: its words and subscriptions."""

    __slots__ = ("gva", "cb", "subs", "words", "baseline", "shard", "pinned")

    def __init__(self, gva: int, cb: Any, words: list[int]) -> None:
        self.gva = gva
        self.cb = cb
        #: the hub holds one pin of ``cb`` while this is True (``WatchHub._release`` drops it once)
        self.pinned = True
        #: the shard whose thread waits on the words (only it unpins while it runs)
        self.shard: _Shard | None = None
        self.subs: set[Subscription] = set()
        #: addresses of 8-byte words whose change wakes the hub
        self.words = words
        #: their values when the watch began (read before any subscriber's first collect, so
        #: a change between the two is never missed)
        self.baseline = {a: native.load_acquire(a) for a in words}


class WatchHub:
    """One runtime's watcher of control words for remote subscribers: one thread per
    ``SHARD_WORDS`` watched words, blocked in the native multi-word waiter (``futex_waitv``
    where the kernel has it, else bounded futex slices), woken by the writers of the words."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[int, _Window] = {}
        self._shards: list[_Shard] = []
        self._closed = False
        self.count = 0
        probe = _lib.memsem_wait_probe()
        self._mode = _lib.MEMSEM_WAIT_WAITV if probe == 1 else _lib.MEMSEM_WAIT_SLICES
        #: words (8-byte) one shard watches besides its wake word
        self._per_shard = (_lib.MEMSEM_WAITV_MAX - 1) // 2 if self._mode == _lib.MEMSEM_WAIT_WAITV else 256

    def subscribe(self, grant: "Grant", targets: Sequence[tuple[int, int, int]],
                  notify: Callable[[], None]) -> Subscription:
        checked = _check_targets(grant, targets)
        with self._lock:
            if self._closed:
                raise MemsemError("the runtime is closing: no new watches")
            if self.count >= MAX_SUBSCRIPTIONS:
                raise MemsemError(f"this owner serves {self.count} watches already (at most {MAX_SUBSCRIPTIONS})")
            sub = Subscription(self, grant, checked, notify)
            w = self._windows.get(grant.gva)
            if w is None:
                cb = sub._cb
                cb.pin()  # the hub's own pin while it watches the window's words
                w = self._windows[grant.gva] = _Window(
                    grant.gva, cb, [cb.addr(W_LATEST)] + ([cb.addr(W_READY_SEQ)] if grant.n_ready else []))
                self._place(w)
            w.subs.add(sub)
            self.count += 1
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            w = self._windows.get(sub.gva)
            if w is None or sub not in w.subs:
                return
            w.subs.discard(sub)
            self.count -= 1
            if not w.subs:
                del self._windows[w.gva]
                s = w.shard
                if s is not None and w in s.windows:
                    s.windows.remove(w)
                    s.used -= len(w.words)
                    if s.thread.is_alive():
                        # unpinned by the shard's thread once it no longer waits on the words
                        s.retired.append(w)
                        s.bump()
                        return
                self._release(w)

    def _release(self, w: _Window) -> None:
        """Drop the hub's pin of ``w``'s control block, once (the hub's lock is held): the shard
        thread, an unsubscribe and ``close`` may each find the window; only one unpins."""
        if w.pinned:
            w.pinned = False
            w.cb.unpin()

    def _place(self, w: _Window) -> None:
        shard = next((s for s in self._shards if s.used + len(w.words) <= self._per_shard), None)
        if shard is None:
            shard = _Shard(self, len(self._shards))
            self._shards.append(shard)
            shard.thread.start()
        shard.windows.append(w)
        w.shard = shard
        shard.used += len(w.words)
        shard.bump()

    def changed(self, gva: int, flush_s: float = 0.0) -> None:
        """Words of window ``gva`` may have changed without a wake (its generation moved):
        let its subscribers collect; with ``flush_s``, return once their engines handed the
        change to the consumers' connections (at most ``flush_s`` s in all)."""
        with self._lock:
            w = self._windows.get(gva)
            subs = list(w.subs) if w is not None else []
        for s in subs:
            s.dirty = True
            s.notify()
        deadline = native.monotonic_ns() + int(flush_s * 1e9)
        for s in subs:
            left = (deadline - native.monotonic_ns()) / 1e9
            if s.flush is not None and left > 0:
                s.flush(left)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            shards = list(self._shards)
            subs = [s for w in self._windows.values() for s in w.subs]
        for s in shards:
            s.stop = True
            s.bump()
        for s in shards:
            if s.thread is not threading.current_thread():
                s.thread.join(2.0)
        for sub in subs:
            sub.close()
        with self._lock:
            self._shards = []
            for s in shards:
                # a thread still running (it missed the join) unpins its own windows as it stops;
                # nothing is unpinned under a wait that may still read the words
                if not s.thread.is_alive():
                    for w in s.windows + s.retired:
                        self._release(w)
                    s.windows, s.retired = [], []


class _Shard:
    """One hub thread: its wake word and the windows whose words it waits on."""

    def __init__(self, hub: WatchHub, index: int) -> None:
        self.hub = hub
        self.windows: list[_Window] = []
        #: windows no longer watched, unpinned by this shard's thread outside its wait
        self.retired: list[_Window] = []
        self.used = 0
        self.stop = False
        self._wake = _ffi.new("uint32_t *")
        self._wake_addr = int(_ffi.cast("uintptr_t", self._wake))
        self.thread = threading.Thread(target=self._run, name=f"memsem-watch-hub-{index}", daemon=True)

    def bump(self) -> None:
        _lib.memsem_wait_bump(self._wake)

    def _run(self) -> None:
        hub = self.hub
        seen: dict[int, int] = {}
        try:
            while True:
                with hub._lock:
                    for w in self.retired:  # no longer waited on (this thread is between waits)
                        hub._release(w)
                    self.retired = []
                    if self.stop:
                        for w in self.windows:
                            hub._release(w)
                        self.windows = []
                        return
                    addrs = [(w, a) for w in self.windows for a in w.words]
                    live = {a for _, a in addrs}
                for a in list(seen):
                    if a not in live:
                        del seen[a]
                n = len(addrs) + 1
                words = _ffi.new("struct memsem_wait_word[]", n)
                words[0].addr, words[0].size, words[0].expected = self._wake_addr, 4, self._wake[0]
                for i, (w, a) in enumerate(addrs, 1):
                    v = seen.get(a)
                    if v is None:
                        v = seen[a] = w.baseline[a]
                    words[i].addr, words[i].size, words[i].expected = a, 8, v
                rc = _lib.memsem_wait_any(words, n, native.monotonic_ns() + int(3600e9), hub._mode)
                if rc < 0 and rc != -_errno.ETIMEDOUT:
                    raise EngineError("watch hub wait failed", errno=-rc)
                dirty: set[_Window] = set()
                for i, (w, a) in enumerate(addrs, 1):
                    if words[i].changed:
                        seen[a] = int(words[i].seen)
                        dirty.add(w)
                for w in dirty:
                    for s in list(w.subs):
                        s.dirty = True
                        s.notify()
        except BaseException:  # noqa: BLE001 - a dead hub must not stay silent: subscribers lose
            log.exception("memsem watch hub failed; its watches end")
            with hub._lock:
                subs = [s for w in self.windows for s in w.subs]
            for s in subs:
                s.dirty = True
                s.notify()


def _check_targets(grant: "Grant", targets: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    if not 0 < len(targets) <= MAX_TARGETS:
        raise ValueError(f"a watch names 1 to {MAX_TARGETS} targets, got {len(targets)}")
    out = []
    for kind, index, count in targets:
        if kind == WATCH_HEADER:
            if index not in WATCHABLE_HEADER or count != 1:
                raise ValueError(f"control word {index} (x{count}) cannot be watched; watchable: "
                                 f"{WATCHABLE_HEADER}")
        elif kind == WATCH_READY:
            if index < 0 or count < 0 or index + count > grant.n_ready:
                raise ValueError(f"ready words [{index}, {index + count}) lie outside the window's "
                                 f"{grant.n_ready} ready words")
        else:
            raise ValueError(f"watch target kind {kind} is unknown")
        out.append((int(kind), int(index), int(count)))
    return out


__all__ = ["MAX_SUBSCRIPTIONS", "MAX_TARGETS", "Subscription", "WATCHABLE_HEADER", "WatchHub"]
