"""Runtime records: owned windows, owners' liveness, resolutions, serving grants, staging."""
from __future__ import annotations

import dataclasses
import os
import select
import threading
import time
from typing import Any

import numpy as np

from memsem import native
from memsem.engines import Engine, LocalRegion, RemoteRegion
from memsem.gva import (
    ControlBlock,
    WindowInfo,
)
from memsem.native import process_alive
from memsem.topology import Route


# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Owned:
    """Owner-side state of one window."""

    info: WindowInfo
    cb: ControlBlock
    key: bytes
    keepalive: Any
    region: LocalRegion
    engines: list[Engine]
    generation: int
    views: int = 0


class _Owner:
    """Liveness of a window's owner (same node: pidfd, so a recycled pid is never mistaken)."""

    __slots__ = ("pid", "start", "fd", "node", "checked", "dead", "remote")

    def __init__(self, pid: int, start: int, node: str) -> None:
        self.pid, self.start, self.node = pid, start, node
        self.fd = -1
        self.checked = 0.0  # monotonic time of the last check; -inf once seen dead
        self.dead = False
        #: another node: ``remote() -> bool`` asks the directory (heartbeat TTL); None: unknown
        self.remote: Any = None
        if node == native.node_id() and pid != os.getpid():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                fd = -1
            if fd >= 0 and not process_alive(pid, start):
                os.close(fd)
                fd = -1
            self.fd = fd

    def alive(self) -> bool:
        if self.pid == os.getpid() and self.node == native.node_id():
            return True
        if self.dead:
            return False
        self.checked = time.monotonic()
        if self.fd < 0:
            if self.node == native.node_id():
                ok = process_alive(self.pid, self.start)
            else:  # another node: its heartbeat in the directory decides (True when unknown)
                ok = self.remote is None or bool(self.remote())
        else:
            r, _, _ = select.select([self.fd], [], [], 0)
            ok = not r
        if not ok:
            self.dead = True  # a verdict that never changes: every later check raises at once
            self.checked = float("-inf")
        return ok

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclasses.dataclass
class _Resolved:
    """Consumer-side cache entry of a window (per GVA and generation)."""

    info: WindowInfo
    cb: ControlBlock | None
    remote: RemoteRegion
    route: Route
    engine: Engine
    owner: _Owner
    own_cb: bool
    #: the access key this resolution was verified with (a cached entry serves only that key)
    key: bytes = b""
    #: views mapping this resolution's memory; a dropped entry is unmapped when they are gone
    pins: int = 0
    dropped: bool = False
    # Hot-path plan, computed once per resolution.
    writable: bool = False
    direct: bool = False
    base: int = 0
    pid: int = 0
    gen_addr: int = 0
    inflight_addr: int = 0
    get_method: int = 0
    put_method: int = 0
    nbytes: int = 0
    # Telemetry of this route, bound once (see runtime._telemetry): [ops, bytes] and ring appends.
    counter: Any = None
    lat_get: Any = None
    lat_put: Any = None

    def __post_init__(self) -> None:
        self.writable = self.info.access == "rw"
        self.nbytes = self.info.nbytes
        d = self.remote.direct
        if d is not None and self.cb is not None:
            self.direct = True
            self.base = d.address
            self.pid = d.pid
            self.gen_addr = self.cb.generation_addr
            self.inflight_addr = self.cb.inflight_addr
            self.get_method = native.COPY_VM_READ if d.cma else native.COPY_MEMCPY
            self.put_method = native.COPY_VM_WRITE if d.cma else native.COPY_MEMCPY


class _Serving:
    """Owner side: a validated credential of a remote consumer (see ``RuntimeCore.serve_check``).

    Holds a pin on the window's control block while cached, and ``mem``, a flat uint8 array over
    the window that keeps its memory alive (zero-copy sends may read it after ``leave``'s caller
    returned; the engine keeps ``hold()`` until libzmq let go).
    """

    __slots__ = ("gva", "generation", "cb", "mem", "writable", "nbytes", "_gen", "_inflight")

    def __init__(self, gva: int, generation: int, cb: ControlBlock, mem: np.ndarray, writable: bool) -> None:
        self.gva, self.generation, self.cb, self.mem, self.writable = gva, generation, cb, mem, writable
        self.nbytes = mem.nbytes
        self._gen = cb.generation_addr
        self._inflight = cb.inflight_addr

    def current(self) -> int:
        """The window's generation now."""
        return native.load_acquire(self._gen)

    def enter(self) -> bool:
        """Count a copy in flight; False (nothing counted) when the generation moved."""
        native.fetch_add(self._inflight, 1)
        if native.load_acquire(self._gen) != self.generation:
            native.fetch_sub(self._inflight, 1)
            return False
        return True

    def leave(self) -> bool:
        """End the copy; True when the generation did not move meanwhile (the bytes are valid)."""
        ok = native.load_acquire(self._gen) == self.generation
        native.fetch_sub(self._inflight, 1)
        return ok

    def hold(self) -> None:
        """Keep the control block mapped beyond the cache's life (a pending zero-copy send)."""
        self.cb.pin()

    def unhold(self) -> None:
        self.cb.unpin()


# ----------------------------------------------------------------------------------------------
class StagingPool:
    """Reusable, page-aligned, pre-faulted staging buffers (pipelines' slots).

    A fresh buffer pays a page fault per 4 KiB page on first touch (tens of microseconds per MiB
    on a VM), which would land in the first tiles of every pipeline; pooled buffers pay it once
    per runtime. At most ``limit`` bytes stay pooled. Thread safe.
    """

    ALIGN = 4096

    def __init__(self, limit: int = 256 << 20) -> None:
        self.limit = limit
        self._free: dict[int, list[np.ndarray]] = {}
        self._pooled = 0
        self._lock = threading.Lock()

    def borrow(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes`` (contents undefined), page aligned and faulted in."""
        with self._lock:
            lst = self._free.get(nbytes)
            if lst:
                self._pooled -= nbytes
                return lst.pop()
        mem = np.empty(nbytes + self.ALIGN, np.uint8)
        skip = (-mem.__array_interface__["data"][0]) % self.ALIGN
        arr = mem[skip:skip + nbytes]
        arr[::self.ALIGN] = 0  # fault every page in now, not during the first copies
        return arr

    def give_back(self, arr: np.ndarray) -> None:
        with self._lock:
            if self._pooled + arr.nbytes <= self.limit:
                self._free.setdefault(arr.nbytes, []).append(arr)
                self._pooled += arr.nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._pooled = 0
