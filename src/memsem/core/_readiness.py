"""Tile-ready words: the producer's marks and the consumers' waits (see ``memsem.gva.ready_words``).

Readiness writes (``mark_ready``, ``clear_ready``) are writes to the window: they need a
read-write ref *and* a window published read-write, like puts, and the ref's generation.
Waits are bounded, sliced (``WAIT_SLICE_S``) and between slices re-check the generation
(``StaleReferenceError``, the same error ``get`` gives) and the owner's liveness
(``PeerLostError``).

A window owned on another node has no control block here: its words are read from a mirror
(``memsem.core._remote.RemoteControl``) that the route's engine keeps current (the owner
pushes changes over tcp, rdma reads them one-sidedly), and the same code waits on it. Marks of
such a window go to its owner (``Engine.set_ready``), which checks the ref like a put.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from memsem import _args, native
from memsem._errors import AccessDeniedError, EngineError, MemsemTimeoutError, StaleReferenceError
from memsem.gva import ControlBlock, RefSpec, ready_words as _ready
from memsem.core import _translate as tr
from memsem.core._liveness import WAIT_SLICE_S
from memsem.core._remote import RemoteControl, RemoteWords
from memsem.core._transfer import owner_checked_failure
from memsem.core._resolve import Resolution

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore


class Readiness:
    """Ready-word operations of one runtime (and waits on other control words)."""

    def __init__(self, core: "RuntimeCore") -> None:
        self._core = core
        #: mirrors of control words of windows owned on other nodes
        self.remote = RemoteWords(core)

    @contextlib.contextmanager
    def _held(self, spec: RefSpec, words: bool = True) -> Iterator[tuple[Resolution, Any]]:
        """The resolution and its control block (or, owner on another node, its mirror; None
        when ``words`` is False and there is none here), held (counted) so nothing unmaps it
        meanwhile."""
        for _ in range(3):
            res = self._core.resolver.resolve(spec)
            if res.enter():
                break
        else:
            raise tr.stale(spec, None)
        try:
            yield self._checked(spec, res, words)
        finally:
            res.leave()

    def _checked(self, spec: RefSpec, res: Resolution, words: bool = True) -> tuple[Resolution, Any]:
        cb: Any = res.cb
        if res.info.n_ready == 0:
            raise ValueError(f"{spec.label} was published without tiles (pass tile_bytes= or tiles= to publish)")
        if cb is None:
            if not words:
                return res, None
            cb = self.remote.control(res, spec)
        if cb.generation != spec.generation:
            self._core.resolver.drop(spec.gva, res)
            raise tr.stale(spec, cb.generation)
        return res, cb

    def _writer(self, spec: RefSpec, tile: int, what: str) -> str:
        if not spec.writable:
            raise AccessDeniedError(f"{what} through a read-only ref to {spec.label}: readiness is "
                                    "the producer's to set")
        return what

    def _check_writer(self, spec: RefSpec, res: Resolution, tile: int, what: str) -> int:
        if not res.writable:
            raise AccessDeniedError(f"{what} on {spec.label}: the window was published read-only; "
                                    "readiness is written like its bytes")
        return _args.index(tile, "tile", res.info.n_ready, of=spec.label)

    def _remote_set(self, spec: RefSpec, res: Resolution, tile: int, ready: bool) -> None:
        try:
            res.engine.set_ready(res.remote_for(spec), tile, ready)
        except StaleReferenceError:
            self._core.resolver.drop(spec.gva, res)
            raise
        except (EngineError, AccessDeniedError) as exc:  # ADAPTER (issue 20 §1): owner_checked_failure
            err = owner_checked_failure(self._core, exc, res, spec, put=True, kind="ready mark")
            raise tr.chain(err, exc) from exc

    def mark(self, spec: RefSpec, tile: int) -> None:
        """Release-store tile ``tile``'s ready word with the ref's generation and wake waiters."""
        self._set(spec, tile, True)

    def clear(self, spec: RefSpec, tile: int) -> None:
        """Clear tile ``tile``'s ready word, only if it holds this ref's generation (a stale ref
        never clears a mark of the new generation)."""
        self._set(spec, tile, False)

    def _set(self, spec: RefSpec, tile: int, ready: bool) -> None:
        what = "mark_ready" if ready else "clear_ready"
        self._writer(spec, tile, what)
        with self._held(spec, words=False) as (res, cb):
            t = self._check_writer(spec, res, tile, what)
            if cb is None:
                self._remote_set(spec, res, t, ready)
            elif ready:
                _ready.mark(cb, t, spec.generation)
            else:
                _ready.clear(cb, t, spec.generation)

    def is_ready(self, spec: RefSpec, tile: int) -> bool:
        with self._held(spec) as (_, cb):
            if isinstance(cb, RemoteControl):
                cb.sync()
            return _ready.is_ready(cb, _args.index(tile, "tile", cb.n_ready, of=spec.label), spec.generation)

    def ready_tiles(self, spec: RefSpec) -> list[int]:
        with self._held(spec) as (_, cb):
            if isinstance(cb, RemoteControl):
                cb.sync()
            return _ready.ready_tiles(cb, spec.generation)

    def n_tiles(self, spec: RefSpec) -> int:
        with self._held(spec, words=False) as (res, _):
            return res.info.n_ready

    def wait(self, spec: RefSpec, tile: int, timeout: float | None = None) -> None:
        """Block until tile ``tile`` is marked ready for the ref's generation.

        Raises:
            MemsemTimeoutError: not ready within ``timeout`` s (names the window and tile).
            PeerLostError: the owner died while waiting (found within one wait slice; on
                another node, when its connection ends, or by the directory's heartbeat).
            StaleReferenceError: the generation moved (before or while waiting).
        """
        core = self._core
        t = _args.timeout_or(timeout, core.timeout)
        with self._held(spec) as (res, cb):
            self._wait(spec, res, cb, _args.index(tile, "tile", cb.n_ready, of=spec.label), t)

    def _wait(self, spec: RefSpec, res: Resolution, cb: Any, tile: int, t: float) -> None:
        core = self._core
        deadline = time.monotonic() + t
        remote = isinstance(cb, RemoteControl)
        a = cb.ready_addr(tile)
        while True:
            left = deadline - time.monotonic()
            if remote:
                v = native.load_acquire(a)
                got = v == spec.generation
                if not got:
                    cb.wait_word(a, v, max(0.0, min(WAIT_SLICE_S, left)))
                    got = native.load_acquire(a) == spec.generation
            else:
                got = _ready.wait_slice(cb, tile, spec.generation, max(0.0, min(WAIT_SLICE_S, left)))
            if cb.generation != spec.generation:
                core.resolver.drop(spec.gva, res)
                core.telemetry.count_error("stale")
                raise tr.stale(spec, cb.generation)
            if got:
                return
            if remote:
                try:
                    self.remote.check(res, spec, cb)
                except StaleReferenceError:
                    core.telemetry.count_error("stale")
                    raise
                except Exception:
                    core.telemetry.count_error("peer_lost")
                    raise
            elif not res.own_cb and not res.peer.alive():
                core.telemetry.count_error("peer_lost")
                raise res.peer.lost(f"{spec.label}, while tile {tile} was awaited,")
            if time.monotonic() >= deadline:
                core.telemetry.count_error("timeout")
                raise MemsemTimeoutError(f"tile {tile} of {spec.label} not ready after {t} s",
                                         what=f"tile {tile} of {spec.label}", timeout=t)

    # -- any control word ---------------------------------------------------------------------------
    def wait_word(self, spec: RefSpec, word: int, until: Callable[[int], bool], timeout: float | None = None,
                  *, what: str | None = None) -> int:
        """Block until ``until(value)`` holds for header word ``word`` of the window's control
        block (``memsem.gva._control_block.W_LATEST``: the latest committed version; ``W_SEQ0``...),
        on this node or, through its mirror, on another; returns that value.

        This is the one function version waits go through, wherever the owner is. Bounded by
        ``timeout`` (seconds, default the runtime's); re-checks the generation and the owner's
        liveness between slices like ``wait``.

        Raises:
            MemsemTimeoutError, StaleReferenceError, PeerLostError.
        """
        core = self._core
        t = _args.timeout_or(timeout, core.timeout)
        label = what or f"control word {word} of {spec.label}"
        for _ in range(3):
            res = core.resolver.resolve(spec)
            if res.enter():
                break
        else:
            raise tr.stale(spec, None)
        try:
            cb: Any = res.cb if res.cb is not None else self.remote.control(res, spec)
            remote = isinstance(cb, RemoteControl)
            a = cb.addr(word)
            deadline = time.monotonic() + t
            while True:
                if remote and cb.mode == "read":
                    cb.sync()
                v = native.load_acquire(a)
                if cb.generation != spec.generation:
                    core.resolver.drop(spec.gva, res)
                    raise tr.stale(spec, cb.generation)
                if until(v):
                    return v
                left = deadline - time.monotonic()
                if left <= 0:
                    core.telemetry.count_error("timeout")
                    raise MemsemTimeoutError(f"{label}: not reached after {t} s", what=label, timeout=t)
                s = min(WAIT_SLICE_S, left)
                if remote:
                    cb.wait_word(a, v, s)
                    self.remote.check(res, spec, cb)
                else:
                    native.futex_wait(a, v & 0xFFFFFFFF, s)
                    if not res.own_cb and not res.peer.alive():
                        raise res.peer.lost(f"{spec.label}, while {label} was awaited,")
        finally:
            res.leave()

    def control(self, spec: RefSpec) -> ControlBlock | RemoteControl:
        """The control block of ``spec``'s window as this runtime reads it: mapped on this node,
        else its mirror (words kept current by the route's engine). For waits on other words
        than ready words; valid while the ref's resolution lives."""
        res = self._core.resolver.resolve(spec)
        return res.cb if res.cb is not None else self.remote.control(res, spec)
