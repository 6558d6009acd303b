"""POSIX shared segments in ``/dev/shm`` (or ``MEMSEM_SHM_DIR``).

Names are ``memsem.<uid>.<kind>.<pid>-<start>.<token>``: the creator's pid and start time let ``memsem gc`` find
segments of dead processes; the 128-bit random token makes names unguessable. Segments are
created ``O_EXCL`` with mode 0600 and their full size is reserved with ``posix_fallocate`` at
creation, so an over-full tmpfs fails right there (``OutOfMemoryError``) instead of raising
SIGBUS at first touch later.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets

from memsem._errors import EngineError, OutOfMemoryError, WindowNotFoundError
from memsem.native._lib import ffi
from memsem.native._proc import process_start_time


def segment_dir() -> str:
    """Directory holding memsem segments: ``MEMSEM_SHM_DIR`` or ``/dev/shm``."""
    return os.environ.get("MEMSEM_SHM_DIR", "/dev/shm")


def segment_prefix(uid: int | None = None) -> str:
    """Prefix of every segment name of this user."""
    return f"memsem.{os.getuid() if uid is None else uid}."


class Segment:
    """A mapped shared segment. ``close()`` unmaps (safe twice); only the creator unlinks.

    Attributes:
        name: file name inside :func:`segment_dir`.
        nbytes: mapped size in bytes.
        address: address of the first byte in this process.
        buffer: the ``mmap`` object.
    """

    __slots__ = ("name", "nbytes", "address", "buffer", "owner", "_cdata", "_closed", "__weakref__")

    def __init__(self, name: str, nbytes: int, buffer: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.nbytes = nbytes
        self.buffer = buffer
        self.owner = owner
        self._cdata = ffi.from_buffer(buffer)
        self.address = int(ffi.cast("uintptr_t", self._cdata))
        self._closed = False

    @property
    def path(self) -> str:
        return os.path.join(segment_dir(), self.name)

    @classmethod
    def create(cls, kind: str, nbytes: int) -> "Segment":
        """Create, size (reserving tmpfs pages up front) and map a new segment of ``nbytes``."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes!r}")
        if not kind.isalpha():
            raise ValueError(f"kind must be letters only, got {kind!r}")
        pid = os.getpid()
        name = f"{segment_prefix()}{kind}.{pid}-{_start_time(pid)}.{secrets.token_hex(16)}"
        path = os.path.join(segment_dir(), name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                os.unlink(path)
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise OutOfMemoryError(
                        f"cannot reserve {nbytes} bytes for a shared segment in {segment_dir()}: "
                        f"{os.strerror(exc.errno)} (free space there: {_free_bytes(segment_dir())} bytes)"
                    ) from exc
                raise EngineError(f"posix_fallocate of {path}", errno=exc.errno) from exc
            try:
                buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                os.unlink(path)
                raise EngineError(f"mmap of {path}", errno=exc.errno) from exc
        finally:
            os.close(fd)
        return cls(name, nbytes, buf, owner=True)

    @classmethod
    def attach(cls, name: str, nbytes: int | None = None, *, writable: bool = True) -> "Segment":
        """Map an existing segment. Never unlinks it (only the creator or gc does)."""
        if os.sep in name or not name.startswith(segment_prefix()):
            raise ValueError(f"segment name must be a memsem segment of this user, got {name!r}")
        path = os.path.join(segment_dir(), name)
        try:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise WindowNotFoundError(f"shared segment {name!r} no longer exists") from exc
        try:
            size = os.fstat(fd).st_size
            if nbytes is None:
                nbytes = size
            if size < nbytes:
                raise WindowNotFoundError(
                    f"shared segment {name!r} holds {size} bytes, fewer than the {nbytes} described")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        return cls(name, nbytes, buf, owner=False)

    def export(self, offset: int = 0, nbytes: int | None = None) -> "object":
        """A buffer export of the mapping (a uint8 numpy array): while it (or anything holding
        it) lives, ``close()`` cannot unmap, so raw-address views built next to it stay valid."""
        import numpy as np

        n = self.nbytes - offset if nbytes is None else nbytes
        return np.frombuffer(self.buffer, np.uint8, count=n, offset=offset)

    def unlink(self) -> None:
        """Remove the name (creator only; mappings stay valid until closed). Safe twice."""
        if not self.owner:
            raise PermissionError(f"segment {self.name!r} was attached, not created: never unlink it")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap. If views into it still exist the mapping stays until they are gone."""
        if self._closed:
            return
        self._closed = True
        try:
            self._cdata = None
            self.buffer.close()
        except BufferError:
            # Exported views (numpy arrays) remain; the mmap is released with the last of them.
            pass

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_START: dict[int, int] = {}


def _start_time(pid: int) -> int:
    st = _START.get(pid)
    if st is None:
        st = _START[pid] = process_start_time(pid)
    return st


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize
