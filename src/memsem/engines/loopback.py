"""Loopback engine: the window lives in this very process; one memcpy (or zero with view)."""
from __future__ import annotations

import os
import secrets

import numpy as np

from memsem import native
from memsem._buffers import address_view
from memsem._errors import NotSupportedError
from memsem.engines._base import Descriptor, DirectAccess, Engine, LocalRegion, RemoteRegion


#: token -> the object owning a registered region's memory, for every loopback engine of this
#: process: a view taken through another runtime of the same process keeps the memory alive
#: even after its owner unpublished (or force-closed) the window.
_KEEPALIVE: dict[str, object] = {}


class LoopbackEngine(Engine):
    """Same-process engine. Descriptor fields: ``pid``, ``address``, ``writable``, ``token``."""

    name = "loopback"

    def register(self, region: LocalRegion) -> Descriptor:
        token = secrets.token_hex(8)
        _KEEPALIVE[token] = region.keepalive
        return Descriptor(self.name, {"pid": os.getpid(), "address": region.address,
                                      "writable": region.writable, "token": token})

    def deregister(self, descriptor: Descriptor) -> None:
        super().deregister(descriptor)
        _KEEPALIVE.pop(descriptor.field("token", str, ""), None)

    def attach(self, descriptor: Descriptor, nbytes: int, credential: bytes = b"") -> RemoteRegion:
        self._check_descriptor(descriptor)
        d = descriptor
        pid = d.field("pid", int)
        address = d.field("address", int)
        if pid != os.getpid():
            raise NotSupportedError(f"loopback reaches only this process ({os.getpid()}), not pid {pid}")
        remote = RemoteRegion(self, nbytes, DirectAccess(False, pid, address))
        remote.keepalive = _KEEPALIVE.get(d.field("token", str, ""))  # type: ignore[attr-defined]
        remote.writable = d.field("writable", bool, True)  # type: ignore[attr-defined]
        return remote

    def view(self, remote: RemoteRegion) -> np.ndarray:
        d = remote.direct
        return address_view(d.address, remote.nbytes, (remote, getattr(remote, "keepalive", None)),
                            readonly=not getattr(remote, "writable", True))

    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        self._check_range(remote, offset, dst.nbytes)
        native.memcpy(dst.ctypes.data, remote.direct.address + offset, dst.nbytes)

    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        self._check_range(remote, offset, src.nbytes)
        native.memcpy(remote.direct.address + offset, src.ctypes.data, src.nbytes)
