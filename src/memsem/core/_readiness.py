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

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from memsem import _args, native
from memsem._errors import AccessDeniedError, EngineError, StaleReferenceError
from memsem.engines import RemoteOutcome, WatchMode
from memsem.gva import ControlBlock, RefSpec, ready_words as _ready
from memsem.core import _translate as tr
from memsem.core._remote import RemoteControl, RemoteWords
from memsem.core._bracket import Status, engine_failure
from memsem.core._resolve import Resolution
from memsem.core._wait import Wait, window_checks

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore


class Readiness:
    """Ready-word operations of one runtime (and waits on other control words)."""

    def __init__(self, core: "RuntimeCore", mirrors: RemoteWords) -> None:
        self._core = core
        #: mirrors of control words of windows owned on other nodes (shared with the transfers)
        self.mirrors = mirrors

    @contextlib.contextmanager
    def _held(self, spec: RefSpec, words: bool = True, tiles: bool = True) -> Iterator[tuple[Resolution, Any]]:
        """The resolution and its control block (or, owner on another node, its mirror; None
        when ``words`` is False and there is none here), held (counted) so nothing unmaps it
        meanwhile. ``tiles``: the window must have been published with tiles."""
        for _ in range(3):
            res = self._core.resolver.resolve(spec)
            if res.enter():
                break
        else:
            raise tr.stale(spec, None)
        try:
            yield self._checked(spec, res, words, tiles)
        finally:
            res.leave()

    def _checked(self, spec: RefSpec, res: Resolution, words: bool = True,
                 tiles: bool = True) -> tuple[Resolution, Any]:
        cb: Any = res.cb
        if tiles and res.info.n_ready == 0:
            raise ValueError(f"{spec.label} was published without tiles (pass tile_bytes= or tiles= to publish)")
        if cb is None:
            if not words:
                return res, None
            cb = self.mirrors.control(res, spec)
            if cb.settle():  # this runtime's own writes at the owner are read back, never a word before them
                cb = self.mirrors.control(res, spec)  # its watch ended meanwhile: made again, current
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
        except (EngineError, AccessDeniedError) as exc:  # an owner's outcome or refusal, translated once
            raise engine_failure(exc, res, spec, put=True, lease=None, version=0) from exc
        finally:
            self.mirrors.wrote(res)  # even a failed request may have changed the word

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

    def add_rows(self, spec: RefSpec, tile: int, rows: int, total: int) -> int:
        """A producer wrote ``rows`` of tile ``tile``'s ``total`` rows (disjoint from what other
        writers wrote): count them; the writer whose rows complete the tile marks it ready
        (``memsem.gva.ready_words.add_rows``: same node in the control block, across nodes at
        the owner, which counts for every producer). Returns the rows written so far
        (``total``: the tile is ready).

        Raises:
            ValueError: the tile would count more rows than it has (rows written twice), or a
                bad tile / count. AccessDeniedError: a read-only ref or window. NotSupportedError:
                a route that cannot count at the owner (write whole tiles, or ``mark_ready``).
        """
        what = "a partial tile write"
        self._writer(spec, tile, what)
        rows = _args.count(rows, "rows", minimum=1, maximum=_ready.MAX_COUNTED_ROWS, unit="rows")
        total = _args.count(total, "total", minimum=rows, maximum=_ready.MAX_COUNTED_ROWS, unit="rows")
        with self._held(spec, words=False) as (res, cb):
            t = self._check_writer(spec, res, tile, what)
            if cb is not None:
                try:
                    return _ready.add_rows(cb, t, spec.generation, rows, total)
                except _ready.RowsOverflow as exc:
                    raise ValueError(f"{spec.label}: {exc}") from None
            try:
                return self._remote_add_rows(spec, res, t, rows, total)
            finally:
                self.mirrors.wrote(res)

    def _remote_add_rows(self, spec: RefSpec, res: Resolution, t: int, rows: int, total: int) -> int:
        """``add_rows`` at the owner on another node (its outcomes translated once)."""
        try:
            return res.engine.add_rows(res.remote_for(spec), t, rows, total)
        except RemoteOutcome as exc:
            if exc.status == Status.RANGE:
                raise ValueError(f"{spec.label}: tile {t}: {rows} more rows would pass its {total} at the "
                                 "owner: rows written twice") from None
            raise engine_failure(exc, res, spec, put=True, lease=None, version=0) from exc
        except StaleReferenceError:
            self._core.resolver.drop(spec.gva, res)
            raise
        except (EngineError, AccessDeniedError) as exc:
            raise engine_failure(exc, res, spec, put=True, lease=None, version=0) from exc

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

    def wait(self, spec: RefSpec, tile: int, timeout: float | None = None, *,
             stop: Callable[[], None] | None = None) -> None:
        """Block until tile ``tile`` is marked ready for the ref's generation. ``stop``: the
        caller's check after every slice (it raises to end the wait early).

        Raises:
            MemsemTimeoutError: not ready within ``timeout`` s (names the window and tile).
            PeerLostError: the owner died while waiting (found within one wait slice; on
                another node, when its connection ends, or by the directory's heartbeat).
            StaleReferenceError: the generation moved (before or while waiting).
        """
        core = self._core
        t = _args.timeout_or(timeout, core.timeout)
        with self._held(spec) as (res, cb):
            self._wait(spec, res, cb, _args.index(tile, "tile", cb.n_ready, of=spec.label), t, stop)

    async def wait_async(self, spec: RefSpec, tile: int, timeout: float | None = None,
                         loop: asyncio.AbstractEventLoop | None = None) -> None:
        """``wait`` for asyncio: the tile's ready word is awaited through the runtime's native
        word waiter (the event loop is never blocked or polled); a window on another node is
        awaited on its mirror by a worker thread. Cancelling the awaiting task ends the wait.

        Raises:
            As ``wait``.
        """
        core = self._core
        t = _args.timeout_or(timeout, core.timeout)
        loop = loop or asyncio.get_running_loop()
        res = core.resolver.resolve(spec)
        if res.cb is None:  # a mirror: its waits block on its words, in a thread
            await loop.run_in_executor(None, lambda: self.wait(spec, tile, t))
            return
        res, cb = self._checked(spec, res)
        i = _args.index(tile, "tile", cb.n_ready, of=spec.label)
        gen = spec.generation
        w = self._word_wait(spec, res, cb, f"tile {i} of {spec.label}", t, state="not ready", during=f"tile {i}")
        await w.until_async(cb.ready_addr(i), lambda v: v == gen, core.word_waiter(), res, loop)

    def _wait(self, spec: RefSpec, res: Resolution, cb: Any, tile: int, t: float,
              stop: Callable[[], None] | None = None) -> None:
        gen = spec.generation
        remote = isinstance(cb, RemoteControl)
        self._word_wait(spec, res, cb, f"tile {tile} of {spec.label}", t, state="not ready",
                        during=f"tile {tile}", stop=stop).until(
            cb.ready_addr(tile), lambda v: v == gen, mirror=cb if remote else None,
            sync=cb.sync if remote and cb.mode == WatchMode.READ else None)  # read: as new as its last read

    def _word_wait(self, spec: RefSpec, res: Resolution, cb: Any, what: str, t: float, *, state: str,
                   during: str, detail: Callable[[], str] | None = None,
                   stop: Callable[[], None] | None = None) -> Wait:
        """The one wait on words of ``spec``'s window (``cb``: its control block here, or the mirror
        of a remote one), re-checking the generation and the owner's liveness every slice."""
        remote = isinstance(cb, RemoteControl)
        check = (lambda: self.mirrors.check(res, spec, cb)) if remote else None
        return Wait(what, t, telemetry=self._core.telemetry, state=state, detail=detail, stop=stop,
                    recheck=window_checks(res, spec, cb, remote_check=check, during=during))

    # -- any control word ---------------------------------------------------------------------------
    def wait_word(self, spec: RefSpec, word: int, until: Callable[[int], bool], timeout: float | None = None,
                  *, what: str | None = None, stop: Callable[[], None] | None = None) -> int:
        """Block until ``until(value)`` holds for header word ``word`` of the window's control
        block (``memsem.gva._control_block.W_LATEST``: the latest committed version; ``W_SEQ0``...),
        on this node or, through its mirror, on another; returns that value.

        This is the one function version waits go through, wherever the owner is. Bounded by
        ``timeout`` (seconds, default the runtime's); re-checks the generation and the owner's
        liveness between slices like ``wait``.

        Raises:
            MemsemTimeoutError, StaleReferenceError, PeerLostError.
        """
        t = _args.timeout_or(timeout, self._core.timeout)
        label = what or f"control word {word} of {spec.label}"
        with self._held(spec, tiles=False) as (res, cb):
            remote = isinstance(cb, RemoteControl)
            a = cb.addr(word)
            w = self._word_wait(spec, res, cb, label, t, state="not reached", during=label,
                                detail=lambda: f"it is {native.load_acquire(a)}", stop=stop)
            return w.until(a, until, mirror=cb if remote else None,
                           sync=cb.sync if remote and cb.mode == WatchMode.READ else None)

    def control(self, spec: RefSpec) -> ControlBlock | RemoteControl:
        """The control block of ``spec``'s window as this runtime reads it: mapped on this node,
        else its mirror (words kept current by the route's engine). For waits on other words
        than ready words; valid while the ref's resolution lives."""
        res = self._core.resolver.resolve(spec)
        return res.cb if res.cb is not None else self.mirrors.control(res, spec)
