"""Tile-ready words: the producer's marks and the consumers' waits (see ``memsem.gva.ready``).

Readiness writes (``mark_ready``, ``clear_ready``) are writes to the window: they need a
read-write ref *and* a window published read-write, like puts, and the ref's generation.
Waits are bounded, sliced (``WAIT_SLICE_S``) and between slices re-check the generation
(``StaleReferenceError``, the same error ``get`` gives) and the owner's liveness
(``PeerLostError``).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from memsem import _args, native
from memsem._errors import AccessDeniedError, MemsemTimeoutError, NotSupportedError
from memsem.gva import ControlBlock, RefSpec, ready as _ready
from memsem.runtime import _translate as tr
from memsem.runtime._liveness import WAIT_SLICE_S
from memsem.runtime._resolve import Resolution

if TYPE_CHECKING:
    from memsem.runtime._core import RuntimeCore


class Readiness:
    """Ready-word operations of one runtime."""

    def __init__(self, core: "RuntimeCore") -> None:
        self._core = core

    @contextlib.contextmanager
    def _held(self, spec: RefSpec) -> Iterator[tuple[Resolution, ControlBlock]]:
        """The resolution and its control block, held (counted) so nothing unmaps it meanwhile."""
        for _ in range(3):
            res = self._core.resolver.resolve(spec)
            if res.enter():
                break
        else:
            raise tr.stale(spec, None)
        try:
            yield self._checked(spec, res)
        finally:
            res.leave()

    def _checked(self, spec: RefSpec, res: Resolution) -> tuple[Resolution, ControlBlock]:
        cb = res.cb
        if cb is None:
            raise NotSupportedError(f"ready words of {spec.label} live in its control block, which is not "
                                    f"mapped on route {res.route.kind} (owner on another node)")
        if cb.n_ready == 0:
            raise ValueError(f"{spec.label} was published without tiles (pass tile_bytes= or tiles= to publish)")
        if cb.generation != spec.generation:
            self._core.resolver.drop(spec.gva, res)
            raise tr.stale(spec, cb.generation)
        return res, cb

    def _writer(self, spec: RefSpec, tile: int, what: str) -> ControlBlock:
        if not spec.writable:
            raise AccessDeniedError(f"{what} through a read-only ref to {spec.label}: readiness is "
                                    "the producer's to set")
        return what

    def _check_writer(self, spec: RefSpec, res: Resolution, cb: ControlBlock, tile: int, what: str) -> int:
        if not res.writable:
            raise AccessDeniedError(f"{what} on {spec.label}: the window was published read-only; "
                                    "readiness is written like its bytes")
        return _args.index(tile, "tile", cb.n_ready, of=spec.label)

    def mark(self, spec: RefSpec, tile: int) -> None:
        """Release-store tile ``tile``'s ready word with the ref's generation and wake waiters."""
        self._writer(spec, tile, "mark_ready")
        with self._held(spec) as (res, cb):
            _ready.mark(cb, self._check_writer(spec, res, cb, tile, "mark_ready"), spec.generation)

    def clear(self, spec: RefSpec, tile: int) -> None:
        """Clear tile ``tile``'s ready word, only if it holds this ref's generation (a stale ref
        never clears a mark of the new generation)."""
        self._writer(spec, tile, "clear_ready")
        with self._held(spec) as (res, cb):
            t = self._check_writer(spec, res, cb, tile, "clear_ready")
            native.compare_exchange(cb.ready_addr(t), spec.generation, 0)

    def is_ready(self, spec: RefSpec, tile: int) -> bool:
        with self._held(spec) as (_, cb):
            return _ready.is_ready(cb, _args.index(tile, "tile", cb.n_ready, of=spec.label), spec.generation)

    def ready_tiles(self, spec: RefSpec) -> list[int]:
        with self._held(spec) as (_, cb):
            return _ready.ready_tiles(cb, spec.generation)

    def n_tiles(self, spec: RefSpec) -> int:
        with self._held(spec) as (_, cb):
            return cb.n_ready

    def wait(self, spec: RefSpec, tile: int, timeout: float | None = None) -> None:
        """Block until tile ``tile`` is marked ready for the ref's generation.

        Raises:
            MemsemTimeoutError: not ready within ``timeout`` s (names the window and tile).
            PeerLostError: the owner died while waiting (found within one wait slice).
            StaleReferenceError: the generation moved (before or while waiting).
        """
        core = self._core
        t = _args.timeout_or(timeout, core.timeout)
        with self._held(spec) as (res, cb):
            self._wait(spec, res, cb, _args.index(tile, "tile", cb.n_ready, of=spec.label), t)

    def _wait(self, spec: RefSpec, res: Resolution, cb: ControlBlock, tile: int, t: float) -> None:
        core = self._core
        deadline = time.monotonic() + t
        while True:
            left = deadline - time.monotonic()
            got = _ready.wait_slice(cb, tile, spec.generation, max(0.0, min(WAIT_SLICE_S, left)))
            if cb.generation != spec.generation:
                core.resolver.drop(spec.gva, res)
                core.telemetry.count_error("stale")
                raise tr.stale(spec, cb.generation)
            if got:
                return
            if not res.own_cb and not res.peer.alive():
                core.telemetry.count_error("peer_lost")
                raise res.peer.lost(f"{spec.label}, while tile {tile} was awaited,")
            if time.monotonic() >= deadline:
                core.telemetry.count_error("timeout")
                raise MemsemTimeoutError(f"tile {tile} of {spec.label} not ready after {t} s",
                                         what=f"tile {tile} of {spec.label}", timeout=t)
