"""Loopback engine: the window lives in this very process; one memcpy (or zero with view)."""
from __future__ import annotations

import os
import secrets
import threading
from typing import Any

import numpy as np

from memsem import native
from memsem._buffers import address_view
from memsem._errors import NotSupportedError, WindowNotFoundError
from memsem.engines._base import Descriptor, DirectAccess, Engine, LocalRegion, RemoteRegion


class LoopbackEngine(Engine):
    """Same-process engine. Descriptor fields: ``pid``, ``address``, ``writable``, ``token``.

    Registrations are process-wide (every runtime of a process shares its address space): the
    table maps a registration's token to the object that owns the memory, from ``register`` to
    ``deregister``. ``attach`` takes that object into the remote region, so the memory outlives
    every copy and view made through the region, even past the owner's unpublish.
    """

    name = "loopback"
    _regions: dict[str, Any] = {}
    _lock = threading.Lock()

    @classmethod
    def reach(cls, me, owner, descriptor, cost):  # noqa: D102 - see Engine.reach
        if me.node == owner.node and me.pid == owner.pid == descriptor.field("pid", int):
            return ("loopback", "the window lives in this process", True)
        return "the owner is another process"

    def register(self, region: LocalRegion) -> Descriptor:
        token = secrets.token_hex(8)
        with self._lock:
            self._regions[token] = region.keepalive
        return Descriptor(self.name, {"pid": os.getpid(), "address": region.address,
                                      "writable": region.writable, "token": token})

    def deregister(self, descriptor: Descriptor) -> None:
        super().deregister(descriptor)
        with self._lock:
            self._regions.pop(descriptor.field("token", str), None)

    def attach(self, descriptor: Descriptor, nbytes: int, credential: bytes = b"") -> RemoteRegion:
        self._check_descriptor(descriptor)
        pid = descriptor.field("pid", int)
        if pid != os.getpid():
            raise NotSupportedError(f"loopback reaches only this process ({os.getpid()}), not pid {pid}")
        token = descriptor.field("token", str)
        with self._lock:
            if token not in self._regions:
                raise WindowNotFoundError("the loopback registration is gone (unpublished)")
            keep = self._regions[token]
        return RemoteRegion(self, nbytes, DirectAccess(False, pid, descriptor.field("address", int)),
                            writable=descriptor.field("writable", bool, True), keepalive=keep)

    def view(self, remote: RemoteRegion) -> np.ndarray:
        d = remote.direct
        return address_view(d.address, remote.nbytes, remote.keepalive, readonly=not remote.writable)

    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        self._check_range(remote, offset, dst.nbytes)
        native.memcpy(dst.ctypes.data, remote.direct.address + offset, dst.nbytes)

    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        self._check_range(remote, offset, src.nbytes)
        native.memcpy(remote.direct.address + offset, src.ctypes.data, src.nbytes)
