"""A scripted engine for logic tests: wraps a real engine and slows, fails or reorders it.

Used by memsem's own tests (slow gets racing a lease expiry, failing ranges in a batch) and
offered to users for theirs. It never hides a real failure: every injected fault is explicit.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from memsem._errors import EngineError
from memsem.engines._base import ControlWords, Descriptor, Engine, LocalRegion, Op, RemoteRegion, Request, WatchMode


class _ScriptedRemote(RemoteRegion):
    """A remote region of the inner engine, reached through the script (no DirectAccess)."""

    def __init__(self, engine: "ScriptedEngine", nbytes: int, real: RemoteRegion) -> None:
        super().__init__(engine, nbytes, None)
        #: the inner engine's own region
        self.real = real


class ScriptedEngine(Engine):
    """Delegates to ``inner`` with scripted behaviour.

    Args:
        inner: the engine doing the real work.
        delay: seconds to sleep before each get/put (the copy happens after the sleep).
        fail: ``fail(kind, offset, nbytes) -> bool``; True makes that op raise EngineError.
        reorder: run the ops of a submitted batch in a random order.
        seed: seed for ``reorder``.
        before: ``before(kind, offset, nbytes)``, called before each get/put (after ``delay``):
            a test blocks it on an event to force an order (an operation is then provably in
            flight while the test acts) instead of hoping for one with sleeps.
    """

    def __init__(self, inner: Engine, *, delay: float = 0.0,
                 fail: Callable[[str, int, int], bool] | None = None,
                 reorder: bool = False, seed: int = 0,
                 before: Callable[[str, int, int], None] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name  # descriptors stay tagged with the real engine
        self.delay = delay
        self.fail = fail
        self.reorder = reorder
        self.before = before
        #: with ``reorder`` the runtime's xcopy hands whole batches to ``submit`` (as it does to
        #: engines with asynchronous hardware), so the reordering reaches the runtime's logic
        self.batches = bool(reorder)
        self.location_attrs = dict(inner.location_attrs)
        self._rng = random.Random(seed)
        self.calls: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def register(self, region: LocalRegion) -> Descriptor | None:
        return self.inner.register(region)

    def deregister(self, descriptor: Descriptor) -> None:
        self.inner.deregister(descriptor)

    def on_publish(self, descriptor: Descriptor, n_tiles: int, gva: int,
                   words: ControlWords | None = None) -> None:
        self.inner.on_publish(descriptor, n_tiles, gva, words)

    def can_watch(self, remote: RemoteRegion) -> WatchMode:
        return self.inner.can_watch(remote.real)

    def read_words(self, remote: RemoteRegion, kind: int, index: int, count: int) -> list[int]:
        self._step("read_words", index, count)
        return self.inner.read_words(remote.real, kind, index, count)

    def watch(self, remote: RemoteRegion, targets: Sequence[tuple[int, int, int]],
              on_update: Callable[[list[tuple[int, int, int]]], None], on_lost: Callable[[str], None],
              timeout: float) -> Any:
        return self.inner.watch(remote.real, targets, on_update, on_lost, timeout)

    def set_ready(self, remote: RemoteRegion, tile: int, ready: bool) -> None:
        self.inner.set_ready(remote.real, tile, ready)

    def add_rows(self, remote: RemoteRegion, tile: int, rows: int, total: int) -> int:
        return self.inner.add_rows(remote.real, tile, rows, total)

    def attach(self, descriptor: Descriptor, nbytes: int, credential: bytes = b"") -> RemoteRegion:
        # No DirectAccess: the runtime must come through get/put so the script applies.
        return _ScriptedRemote(self, nbytes, self.inner.attach(descriptor, nbytes, credential))

    def detach(self, remote: RemoteRegion) -> None:
        remote.real.close()

    def view(self, remote: RemoteRegion) -> np.ndarray:
        return self.inner.view(remote.real)

    def bind(self, context) -> None:
        super().bind(context)
        self.inner.bind(context)

    def _step(self, kind: str, offset: int, nbytes: int) -> None:
        with self._lock:
            self.calls.append((kind, offset, nbytes))
        if self.delay:
            time.sleep(self.delay)
        if self.before is not None:
            self.before(kind, offset, nbytes)
        if self.fail is not None and self.fail(kind, offset, nbytes):
            raise EngineError(f"scripted failure of {kind} at offset {offset} ({nbytes} bytes)",
                              name="SCRIPTED")

    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        self._step("get", offset, dst.nbytes)
        self.inner.get(remote.real, offset, dst)

    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        self._step("put", offset, src.nbytes)
        self.inner.put(remote.real, offset, src)

    def submit(self, ops: Sequence[Op]) -> Request:
        """Run the batch's ops (in a random order with ``reorder``); every op ends final."""
        ops = list(ops)
        order = ops[:]
        if self.reorder:
            with self._lock:
                self._rng.shuffle(order)
        req = super().submit(order)
        req.ops = ops
        return req

    def close(self) -> None:
        super().close()
        self.inner.close()
