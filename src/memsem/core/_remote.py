"""Control words of windows owned on another node, kept current here (the consumer side).

Tile-ready words, the latest-version word and the sequence words live in a window's control
block, which is mapped only on the owner's node. For a window reached over another node's
route, :class:`RemoteControl` is a local mirror of those words, laid out like a control block
(header words, then one ready word per tile), so the readiness code and version waits read and
futex-wait on it exactly as on one node. The route's engine keeps it current:

* ``push`` (tcp): the owner's runtime watches the words (its watch hub) and sends every change;
  the engine's reader thread stores each value (release) and wakes the mirror word's futex. A
  wait here is a futex wait on local memory: no polling, no sleeps.
* ``read`` (rdma): the words are read one-sidedly from the owner's registered control words
  (header and ready words, registered remote-read only) when asked (``sync``, and while
  waiting: a read of the awaited word, then a back-off doubling from ``READ_BACKOFF_S[0]`` to
  ``READ_BACKOFF_S[1]``; the generation word is read again with every change of a ready word
  and at the end of every wait slice). A read that fails decides at once: ``PeerLostError``
  when the owner's queue pair is gone (the engine's retries exhausted, about 0.5 s after the
  owner died), ``StaleReferenceError`` when the owner deregistered the words (it retired the
  window: republish, unpublish, close).

Every guarantee of ready words on one node holds: the mirror's ready words carry the generation
they were marked for; the mirror's generation word is the owner's (a retire pushes the new one
and wakes every waiter: ``StaleReferenceError``); a subscription that ends without ``close``
(the owner's process died, the link broke) wakes every waiter, and the next check decides:
``PeerLostError`` when the owner is dead or unreachable, ``StaleReferenceError`` when its window
is gone, else the subscription is made again (the owner sends the current values).
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import native
from memsem._errors import AccessDeniedError, EngineError, MemsemError, MemsemTimeoutError, NotSupportedError, PeerLostError
from memsem.engines import WATCH_HEADER, WATCH_READY
from memsem.gva import RefSpec
from memsem.gva._control_block import HEADER_WORDS, W_GENERATION, W_LATEST, W_SEQ0, W_SEQ1, W_STATE
from memsem.core import _translate as tr
from memsem.core._resolve import Resolution
from memsem.core._bracket import engine_failure

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore

#: header words every mirror carries
HEADER_TARGETS = (W_GENERATION, W_STATE, W_LATEST, W_SEQ0, W_SEQ1)
#: back-off of one-sided reads while waiting (seconds, doubling from the first to the last)
READ_BACKOFF_S = (20e-6, 1e-3)
#: a waiting consumer also asks the directory about the owner at most this often (seconds);
#: the connection itself (closed by the kernel when the owner dies, keepalive when the node
#: vanishes) says it at once
DIRECTORY_CHECK_S = 1.0


class RemoteControl:
    """A read-only mirror of the control words of a window owned on another node.

    Attributes:
        n_ready: ready words (tiles). mode: "push" or "read". lost: why the engine's
            subscription ended (None while it lives). base: address of word 0 (local memory).
    """

    n_slots = 1

    def __init__(self, res: Resolution, mode: str, spec: RefSpec | None = None,
                 core: "RuntimeCore | None" = None) -> None:
        self.n_ready = res.info.n_ready
        self.mode = mode
        self._words = np.zeros(HEADER_WORDS + max(self.n_ready, 0), np.uint64)
        self.base = int(self._words.ctypes.data)
        self._ready0 = self.base + 8 * HEADER_WORDS
        self.lost: str | None = None
        self.sub: Any = None
        self.checked = time.monotonic()
        #: this runtime changed words at the owner since the mirror last caught up (``wrote``)
        self._wrote = False
        native.store_release(self.addr(W_GENERATION), res.generation)
        self._res = weakref.ref(res)
        self._spec = spec
        self._core = core

    # -- the ControlBlock reading interface ---------------------------------------------------------
    def addr(self, word: int) -> int:
        return self.base + 8 * word

    def word(self, word: int) -> int:
        return native.load_acquire(self.base + 8 * word)

    @property
    def generation(self) -> int:
        return native.load_acquire(self.base + 8 * W_GENERATION)

    @property
    def latest_addr(self) -> int:
        return self.base + 8 * W_LATEST

    @property
    def seq_addr(self) -> int:
        return self.base + 8 * W_SEQ0

    @property
    def closed(self) -> bool:
        return False

    def ready_addr(self, tile: int) -> int:
        if not 0 <= tile < self.n_ready:
            raise IndexError(f"tile {tile} out of range [0, {self.n_ready})")
        return self._ready0 + 8 * tile

    # -- kept current by the engine -----------------------------------------------------------------
    def apply(self, changes: list[tuple[int, int, int]]) -> None:
        """Store the owner's values (release) and wake their waiters (engine thread)."""
        for kind, index, value in changes:
            if kind == WATCH_READY:
                if not 0 <= index < self.n_ready:
                    continue
                a = self._ready0 + 8 * index
            elif kind == WATCH_HEADER and 0 <= index < HEADER_WORDS:
                a = self.base + 8 * index
            else:
                continue
            native.store_release(a, value)
            native.futex_wake(a)
            if kind == WATCH_HEADER and index == W_GENERATION:
                self.wake_all()

    def on_lost(self, reason: str) -> None:
        self.lost = reason or "lost"
        self.wake_all()

    def wake_all(self) -> None:
        native.futex_wake(self.addr(W_GENERATION))
        native.futex_wake(self.addr(W_LATEST))
        native.futex_wake(self.addr(W_SEQ0))
        for t in range(self.n_ready):
            native.futex_wake(self._ready0 + 8 * t)

    # -- one-sided reads (mode "read") -----------------------------------------------------------
    def _read(self, res: Resolution, kind: int, index: int, count: int) -> list[int]:
        """``count`` words read from the owner; engine failures become the window's errors."""
        try:
            return res.engine.read_words(res.remote, kind, index, count)
        except (MemsemTimeoutError, NotSupportedError):
            raise
        except MemsemError as exc:
            raise tr.chain(self._failure(res, exc), exc) from exc

    def _failure(self, res: Resolution, exc: MemsemError) -> MemsemError:
        spec = self._spec
        label = spec.label if spec is not None else f"window gva {res.info.gva:#x}"
        if isinstance(exc, PeerLostError):
            if self._core is not None:
                self._core.telemetry.count_error("peer_lost")
            return res.peer.lost(f"{label} (a one-sided read of its control words failed: {exc})")
        if isinstance(exc, EngineError) and exc.name == "IBV_WC_REM_ACCESS_ERR" and spec is not None:
            # the owner deregisters a window's control words only when it retires the window
            core = self._core
            rec = core.directory.get_window(spec.gva) if core is not None else None
            found = None if rec is None else int(rec.get("generation", -1))
            if core is not None:
                core.resolver.drop(spec.gva, res)
                core.telemetry.count_error("stale")
            return tr.stale(spec, None if found == spec.generation else found)
        if spec is not None:
            return tr.engine_failure(exc, spec, res.peer, "control word read")
        return exc

    def _read_generation(self, res: Resolution) -> None:
        """Read the owner's generation word into the mirror (twice when it moved, so a word
        torn by the transport never passes for a new generation)."""
        g = self._read(res, WATCH_HEADER, W_GENERATION, 1)[0]
        if g != self.generation:
            g2 = self._read(res, WATCH_HEADER, W_GENERATION, 1)[0]
            if g2 != g:
                return  # moving now: the next read decides
        self.apply([(WATCH_HEADER, W_GENERATION, g)])

    def wrote(self) -> None:
        """This runtime changed a word at the owner (``set_ready``, ``add_rows``, through the
        engine's data path): the next read of the mirror (``settle``) catches up first, so a
        runtime always reads its own writes (a clear is never followed by the mark it cleared)."""
        self._wrote = True

    def settle(self) -> bool:
        """Before the mirror is read: when this runtime wrote words at the owner since the last
        catch-up, catch up now (pushed: the subscription's ``sync``, one round trip that returns
        once every change the owner made before it is applied here; read: one-sided reads of
        every word). A no-op otherwise. Returns True when the subscription ended meanwhile
        (the caller gets the mirror again: ``RemoteWords.control`` makes a new one, which starts
        from the owner's current words, this runtime's writes included).

        Raises:
            PeerLostError / StaleReferenceError: as ``sync``. MemsemTimeoutError: no answer
                within the runtime's timeout.
        """
        if not self._wrote:
            return False
        self._wrote = False
        try:
            if self.mode == "read":
                self.sync()
                return False
            res, sub = self._res(), self.sub
            if res is None or sub is None or self.lost is not None:
                return self.lost is not None
            try:
                sub.sync(self._core.timeout if self._core is not None else 10.0)
            except MemsemTimeoutError:
                raise
            except PeerLostError as exc:  # the watch connection ended (not the owner, necessarily)
                self.on_lost(str(exc))
                return True
            except MemsemError as exc:
                raise tr.chain(self._failure(res, exc), exc) from exc
            return False
        except BaseException:
            self._wrote = True
            raise

    def sync(self) -> None:
        """Bring the words up to date now (one-sided reads; pushed mirrors are current)."""
        if self.mode != "read":
            return
        res = self._res()
        if res is None:
            return
        vals = self._read(res, WATCH_HEADER, 0, HEADER_WORDS)
        if self.n_ready:
            rv = self._read(res, WATCH_READY, 0, self.n_ready)
            self.apply([(WATCH_READY, t, v) for t, v in enumerate(rv)])
        self.apply([(WATCH_HEADER, i, vals[i]) for i in HEADER_TARGETS if i != W_GENERATION])
        if vals[W_GENERATION] != self.generation:
            self._read_generation(res)  # confirmed by reading it again

    def wait_word(self, addr: int, expected: int, slice_s: float) -> None:
        """Block at most ``slice_s`` while the word at ``addr`` (of this mirror) holds
        ``expected``: a futex wait (push), or one-sided reads with a bounded back-off (read)."""
        if self.mode != "read":
            if native.load_acquire(addr) == expected and self.lost is None:
                native.futex_wait(addr, expected & 0xFFFFFFFF, slice_s)
            return
        res = self._res()
        if res is None:
            return
        end = time.monotonic() + slice_s
        pause = READ_BACKOFF_S[0]
        if addr >= self._ready0:
            kind, index = WATCH_READY, (addr - self._ready0) // 8
        else:
            kind, index = WATCH_HEADER, (addr - self.base) // 8
        while True:
            v = self._read(res, kind, index, 1)[0]
            if v != expected:
                self.apply([(kind, index, v)])
                if not (kind == WATCH_HEADER and index == W_GENERATION):
                    self._read_generation(res)  # read after the word: its generation matters too
                return
            left = end - time.monotonic()
            if left <= 0:
                self._read_generation(res)  # a retired window is seen within one slice
                return
            time.sleep(min(pause, left))
            pause = min(pause * 2, READ_BACKOFF_S[1])

    def close(self) -> None:
        sub, self.sub = self.sub, None
        if sub is not None:
            try:
                sub.close()
            except MemsemError:
                pass


class RemoteWords:
    """The mirrors of one runtime, one per resolution of a window on another node."""

    def __init__(self, core: "RuntimeCore") -> None:
        self._core = core
        self._lock = threading.Lock()
        self._mirrors: "weakref.WeakKeyDictionary[Resolution, RemoteControl]" = weakref.WeakKeyDictionary()

    def control(self, res: Resolution, spec: RefSpec) -> RemoteControl:
        """The mirror of ``res``'s window (subscribed on first use, within the runtime's timeout).

        Raises:
            NotSupportedError: the route's engine can neither be pushed to nor read one-sidedly.
            PeerLostError / StaleReferenceError: the owner is gone, or its window is.
        """
        m = self._mirrors.get(res)
        if m is not None and m.lost is None:
            return m
        with self._lock:
            m = self._mirrors.get(res)
            if m is None:
                mode = res.engine.can_watch(res.remote)
                if not mode:
                    raise NotSupportedError(
                        f"ready words of {spec.label} live in its control block on node {res.info.node!r}; "
                        f"route {res.route.kind} (engine {res.engine.name!r}) cannot watch them from here")
                m = RemoteControl(res, mode, spec, self._core)
                self._subscribe(res, spec, m)
                self._mirrors[res] = m
            elif m.lost is not None:
                self.recover(res, spec, m)
            return m

    def _subscribe(self, res: Resolution, spec: RefSpec, m: RemoteControl) -> None:
        if m.mode == "read":
            m.sync()
            return
        targets = [(WATCH_HEADER, w, 1) for w in HEADER_TARGETS]
        if m.n_ready:
            targets.append((WATCH_READY, 0, m.n_ready))
        try:
            m.sub = res.engine.watch(res.remote, targets, m.apply, m.on_lost, self._core.timeout)
        except (EngineError, AccessDeniedError) as exc:  # an owner's outcome or refusal, translated once
            raise engine_failure(exc, res, spec, put=False, lease=None, version=0) from exc
        m.lost = None

    def wrote(self, res: Resolution) -> None:
        """This runtime changed words of ``res``'s window at the owner: its mirror, if there is
        one, catches up before it is read next (``RemoteControl.settle``)."""
        m = self._mirrors.get(res)
        if m is not None:
            m.wrote()

    def recover(self, res: Resolution, spec: RefSpec, m: RemoteControl) -> None:
        """The subscription ended: say why (``PeerLostError`` for a dead or unreachable owner,
        ``StaleReferenceError`` for a window that is gone), else subscribe again."""
        reason = m.lost
        if not res.peer.alive():
            raise res.peer.lost(f"{spec.label} (its watch ended: {reason})")
        rec = self._core.directory.get_window(spec.gva)
        if rec is None or int(rec.get("generation", -1)) != spec.generation:
            self._core.resolver.drop(spec.gva, res)
            raise tr.stale(spec, None if rec is None else int(rec["generation"]))
        try:
            self._subscribe(res, spec, m)
        except (PeerLostError, EngineError) as exc:
            raise PeerLostError(f"the owner of {spec.label} on node {res.info.node!r} is unreachable: its "
                                f"watch ended ({reason}) and cannot be made again ({exc})") from exc

    def check(self, res: Resolution, spec: RefSpec, m: RemoteControl) -> None:
        """Between slices of a wait: a lost subscription is recovered (or raises), and the
        directory is asked about the owner at most every ``DIRECTORY_CHECK_S``."""
        if m.lost is not None:
            with self._lock:
                if m.lost is not None:
                    self.recover(res, spec, m)
            return
        now = time.monotonic()
        if now - m.checked >= DIRECTORY_CHECK_S:
            m.checked = now
            if not res.peer.alive():
                raise res.peer.lost(spec.label)

    def close(self) -> None:
        with self._lock:
            mirrors = list(self._mirrors.values())
            self._mirrors.clear()
        for m in mirrors:
            m.close()


__all__ = ["DIRECTORY_CHECK_S", "READ_BACKOFF_S", "RemoteControl", "RemoteWords"]
