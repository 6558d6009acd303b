"""Host engine: same node, another process.

Two descriptor kinds, both tagged ``host``:

* ``shm``: the window lives in a shared segment (``Runtime.alloc``); consumers map it and copy
  with memcpy, or hand out a zero-copy ``view``.
* ``cma``: the window is ordinary private memory of the owner (any numpy array or tensor);
  consumers use cross-memory attach (``process_vm_readv`` / ``process_vm_writev``), one copy,
  no staging. Needs the same user (or CAP_SYS_PTRACE) and a ptrace scope that allows it.
"""
from __future__ import annotations

import os

import numpy as np

from memsem import native
from memsem._errors import NotSupportedError
from memsem.engines._base import Availability, Descriptor, DirectAccess, Engine, LocalRegion, RemoteRegion
from memsem.native import Segment


def _ptrace_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


class HostEngine(Engine):
    """Same-node engine over shared segments and cross-memory attach."""

    name = "host"

    def __init__(self) -> None:
        super().__init__()
        #: the segment directory as this engine was made (``native.segment_dir()``)
        self._folder = native.segment_dir()

    @classmethod
    def probe(cls) -> Availability:
        if not os.path.isdir(native.segment_dir()):
            return Availability(False, f"segment directory {native.segment_dir()} does not exist")
        return Availability(True)

    @staticmethod
    def cma_availability() -> Availability:
        scope = _ptrace_scope()
        if scope >= 2 and os.geteuid() != 0:
            return Availability(False, f"kernel.yama.ptrace_scope={scope} forbids process_vm_readv "
                                       "between processes without CAP_SYS_PTRACE")
        return Availability(True)

    @classmethod
    def reach(cls, me, owner, descriptor, cost):  # noqa: D102 - see Engine.reach
        if me.node != owner.node:
            return f"owner is on node {owner.node!r}, this process on {me.node!r}"
        if descriptor.field("kind", str) == "shm":
            return ("host/shm", "same node, window in a shared segment", True)
        avail = cls.cma_availability()
        if not avail:
            return avail.reason
        return ("host/cma", "same node, private memory of another process (cross-memory attach)", False)

    def register(self, region: LocalRegion) -> Descriptor:
        fields = {"pid": os.getpid(), "address": region.address, "writable": region.writable}
        if region.segment is not None:
            fields.update(kind="shm", segment=region.segment, offset=region.segment_offset)
        else:
            fields.update(kind="cma")
        return Descriptor(self.name, fields)

    def attach(self, descriptor: Descriptor, nbytes: int, credential: bytes = b"") -> RemoteRegion:
        self._check_descriptor(descriptor)
        kind = descriptor.field("kind", str)
        writable = descriptor.field("writable", bool, True)
        pid = descriptor.field("pid", int)
        if kind == "shm":
            off = descriptor.field("offset", int, 0)
            seg_name = descriptor.field("segment", str)
            if off < 0 or "/" in seg_name or not seg_name:
                raise ValueError(f"host descriptor: segment {seg_name!r} at offset {off} is not a segment range")
            seg = Segment.attach(seg_name, off + nbytes, writable=writable, folder=self._folder)
            return RemoteRegion(self, nbytes, DirectAccess(False, pid, seg.address + off),
                                writable=writable, segment=seg)
        if kind == "cma":
            avail = self.cma_availability()
            if not avail:
                raise NotSupportedError(f"host engine (cross-memory attach): {avail.reason}")
            return RemoteRegion(self, nbytes, DirectAccess(True, pid, descriptor.field("address", int)),
                                writable=writable)
        raise ValueError(f"host descriptor field 'kind' must be 'shm' or 'cma', got {kind!r}")

    def detach(self, remote: RemoteRegion) -> None:
        if remote.segment is not None:
            remote.segment.close()  # unmapped once the last view of it is gone

    def view(self, remote: RemoteRegion) -> np.ndarray:
        seg = remote.segment
        if seg is None:
            raise NotSupportedError(
                "view() needs a shared segment; this window is private memory of another process "
                "(route host/cma): use get(), or publish memory from Runtime.alloc()")
        # The array holds the mapping (a pin on the segment) for as long as it, or any array
        # derived from it, lives: detach/close never unmap under a view.
        return seg.export(remote.direct.address - seg.address, remote.nbytes, readonly=not remote.writable)

    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        self._check_range(remote, offset, dst.nbytes)
        d = remote.direct
        if d.cma:
            native.vm_read(d.pid, dst.ctypes.data, d.address + offset, dst.nbytes)
        else:
            native.memcpy(dst.ctypes.data, d.address + offset, dst.nbytes)

    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        self._check_range(remote, offset, src.nbytes)
        d = remote.direct
        if d.cma:
            native.vm_write(d.pid, src.ctypes.data, d.address + offset, src.nbytes)
        else:
            native.memcpy(d.address + offset, src.ctypes.data, src.nbytes)
