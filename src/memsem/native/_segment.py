"""POSIX shared segments in ``/dev/shm`` (or ``MEMSEM_SHM_DIR``).

Names are ``memsem.<uid>.<kind>.<pid>-<start>.<token>``: the creator's pid and start time let ``memsem gc`` find
segments of dead processes; the 128-bit random token makes names unguessable. Segments are
created ``O_EXCL`` with mode 0600 and their full size is reserved with ``posix_fallocate`` at
creation, so an over-full tmpfs fails right there (``OutOfMemoryError``) instead of raising
SIGBUS at first touch later.
"""
from __future__ import annotations

import errno
import os
import secrets
import weakref

import numpy as np

from memsem._errors import AccessDeniedError, EngineError, OutOfMemoryError, WindowNotFoundError
from memsem.native._lib import UseWord, map_fd, unmap
from memsem.native._proc import process_start_time


def segment_dir() -> str:
    """Directory holding memsem segments: ``MEMSEM_SHM_DIR`` or ``/dev/shm``."""
    return os.environ.get("MEMSEM_SHM_DIR", "/dev/shm")


def segment_prefix(uid: int | None = None) -> str:
    """Prefix of every segment name of this user."""
    return f"memsem.{os.getuid() if uid is None else uid}."


class Segment:
    """A mapped shared segment.

    The mapping holds no file descriptor (``memsem_map``), and its lifetime is one rule: it is
    counted by a native use word. Holders (a resolution, a lease, a view, a running copy) ``pin``
    it and ``unpin`` when done; ``close`` drops the opener's own claim; the mapping is unmapped
    when it is closed and the last holder let go, by whichever of them came last. It is never
    unmapped under a holder and never on a timer. Only the creating process ever unlinks the
    name, and never a process forked from it.

    Attributes:
        name: file name inside :func:`segment_dir`.
        nbytes: mapped size in bytes.
        address: address of the first byte in this process.
        owner: True when this process created the segment (it may unlink it).
        writable: whether the mapping allows writes.
    """

    __slots__ = ("name", "nbytes", "address", "owner", "writable", "_pid", "_use", "_whole", "__weakref__")

    def __init__(self, name: str, nbytes: int, address: int, owner: bool, writable: bool) -> None:
        self.name = name
        self.nbytes = nbytes
        self.address = address
        self.owner = owner
        self.writable = writable
        self._pid = os.getpid()
        self._use = UseWord()
        #: an array over the whole mapping, holding one pin on it, that exports slice (made at the
        #: first export, dropped by close)
        self._whole: object = None
        if not self._use.enter():  # the opener's own claim, dropped by close()
            raise EngineError(f"segment {name!r}: use word closed at creation")  # pragma: no cover

    @property
    def path(self) -> str:
        return os.path.join(segment_dir(), self.name)

    @classmethod
    def create(cls, kind: str, nbytes: int) -> "Segment":
        """Create, size (reserving tmpfs pages up front) and map a new segment of ``nbytes``."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be an int > 0, got {nbytes!r}")
        if not kind.isalpha():
            raise ValueError(f"kind must be letters only, got {kind!r}")
        pid = os.getpid()
        name = f"{segment_prefix()}{kind}.{pid}-{_start_time(pid)}.{secrets.token_hex(16)}"
        path = os.path.join(segment_dir(), name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                os.unlink(path)
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise OutOfMemoryError(
                        f"cannot reserve {nbytes} bytes for a shared segment in {segment_dir()}: "
                        f"{os.strerror(exc.errno)} (free space there: {_free_bytes(segment_dir())} bytes). "
                        "In a container /dev/shm is often 64 MiB: give it more (docker run --shm-size=16g, "
                        "Kubernetes: an emptyDir with medium Memory at /dev/shm), or point MEMSEM_SHM_DIR "
                        "at a larger tmpfs"
                    ) from exc
                raise EngineError(f"posix_fallocate of {path}", errno=exc.errno) from exc
            try:
                addr = map_fd(fd, nbytes, True)
            except EngineError:
                os.unlink(path)
                raise
        finally:
            os.close(fd)
        return cls(name, nbytes, addr, owner=True, writable=True)

    @classmethod
    def attach(cls, name: str, nbytes: int | None = None, *, writable: bool = True,
               folder: str | None = None) -> "Segment":
        """Map an existing segment of this user. Never unlinks it (only the creator or gc does).
        ``folder``: the segment directory (default :func:`segment_dir` now; a runtime passes the
        one it read when it was made).

        Raises:
            ValueError: ``name`` is not a memsem segment name of this user.
            WindowNotFoundError: no such segment (any more), or it is smaller than ``nbytes``.
            AccessDeniedError: it is not owned by this user or is not mode 0600.
        """
        if not isinstance(name, str) or os.sep in name or not name.startswith(segment_prefix()):
            raise ValueError(f"segment name must be a memsem segment of this user, got {name!r}")
        path = f"{segment_dir() if folder is None else folder}/{name}"
        try:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError as exc:
            raise WindowNotFoundError(f"shared segment {name!r} no longer exists") from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise AccessDeniedError(f"shared segment {name!r} is a symbolic link: refused") from None
            raise EngineError(f"open of shared segment {name!r}", errno=exc.errno) from exc
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise AccessDeniedError(f"shared segment {name!r} is owned by uid {st.st_uid} with mode "
                                        f"{oct(st.st_mode & 0o777)}; memsem maps only its user's 0600 segments")
            size = st.st_size
            if nbytes is None:
                nbytes = size
            if size < nbytes or nbytes <= 0:
                raise WindowNotFoundError(
                    f"shared segment {name!r} holds {size} bytes, fewer than the {nbytes} described")
            addr = map_fd(fd, nbytes, writable)
        finally:
            os.close(fd)
        return cls(name, nbytes, addr, owner=False, writable=writable)

    # -- holders ----------------------------------------------------------------------------------
    def pin(self) -> None:
        """Count a holder of the mapping.

        Raises:
            ValueError: the segment was already closed (a closed mapping takes no new holders).
        """
        if not self._use.enter():
            raise ValueError(f"segment {self.name!r} is closed: no new holders")

    def unpin(self) -> None:
        """Drop a holder; unmaps when the segment was closed and this was the last one."""
        if self._use.leave():
            self._unmap()

    def close(self) -> None:
        """Drop the opener's claim: unmapped now, or when the last holder lets go. Safe twice."""
        self._whole = None  # its pin goes when the last export over it does
        if self._use.close() == 2:
            return  # closed before: the opener's claim was dropped then
        if self._use.leave():  # the opener's own claim
            self._unmap()

    @property
    def closed(self) -> bool:
        """True once ``close`` was called (the mapping may live on while held)."""
        return self._use.closed

    @property
    def mapped(self) -> bool:
        """True while the mapping exists in this process."""
        return self.address != 0

    @property
    def holders(self) -> int:
        """Holders counted right now (the opener's claim included until ``close``)."""
        return self._use.holders

    def _unmap(self) -> None:
        addr, self.address = self.address, 0
        if addr:
            unmap(addr, self.nbytes)

    def export(self, offset: int = 0, nbytes: int | None = None, *, readonly: bool = False) -> "object":
        """A flat uint8 numpy array over ``[offset, offset + nbytes)`` of the mapping that holds
        it: the mapping lives while the array, or any array derived from it, lives.

        Raises:
            ValueError: the segment is closed, or the range lies outside it.
        """
        from memsem._buffers import address_view

        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + n}) lies outside segment {self.name!r} "
                             f"of {self.nbytes} bytes")
        if n == 0:
            return address_view(0, 0, None)
        # Every export is a slice of one array over the whole mapping that holds one pin on it
        # (no pin, finalizer or array interface per export), under a memoryview of its own: the
        # export's ``base``, one object per export that every array derived from it references
        # (what a caller ties the export's lifetime to).
        whole = self._whole
        if whole is None:
            if self._use.closed:
                raise ValueError(f"segment {self.name!r} is closed: no new holders")
            whole = self._whole = address_view(self.address, self.nbytes, _Hold(self), readonly=not self.writable)
        mv = memoryview(whole[offset:offset + n])  # type: ignore[index]
        return np.frombuffer(mv.toreadonly() if readonly and not mv.readonly else mv, np.uint8)

    def unlink(self) -> None:
        """Remove the name. Only the creating process does (an attached segment, or a creator's
        segment seen from a forked child, is never unlinked: PermissionError). Safe twice;
        mappings stay valid until closed."""
        if not self.owner:
            raise PermissionError(f"segment {self.name!r} was attached, not created: never unlink it")
        if os.getpid() != self._pid:
            return  # a forked child owns nothing of its parent's
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Segment {self.name} {self.nbytes} B {state}, {self.holders} holder(s)>"


class _Hold:
    """One holder of a segment's mapping, released when the object is collected (a view)."""

    __slots__ = ("__weakref__",)

    def __init__(self, seg: Segment) -> None:
        seg.pin()
        weakref.finalize(self, seg.unpin)


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
