"""The memsem error tree.

Every failure memsem reports is a :class:`MemsemError` (caller mistakes are ``TypeError`` /
``ValueError`` naming the argument). Engine and native failures are translated into these
classes at one boundary, the runtime, and chained with ``raise ... from``.
"""
from __future__ import annotations

import errno as _errno
import os

__all__ = [
    "MemsemError",
    "StaleReferenceError",
    "VersionGoneError",
    "WindowRetiredError",
    "NameHeldError",
    "LeaseExpiredError",
    "LeaseHeldError",
    "PeerLostError",
    "AccessDeniedError",
    "NotSupportedError",
    "EngineError",
    "MemsemTimeoutError",
    "WindowNotFoundError",
    "OutOfMemoryError",
]


def _rebuild(cls: type, args: tuple, state: dict) -> "MemsemError":
    """Unpickle a memsem error without calling its constructor (keyword-only attributes)."""
    try:
        exc = cls.__new__(cls)
    except TypeError:  # a MemoryError subclass: its own __new__ refuses a subclass of two bases
        exc = BaseException.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class MemsemError(Exception):
    """Root of every error memsem raises for a failed operation.

    Every memsem error pickles with its attributes (it crosses process boundaries: a worker's
    error re-raised by its parent), whatever its constructor's keyword-only arguments.
    """

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class StaleReferenceError(MemsemError):
    """The window's generation moved: the ref was minted for memory that was unpublished,
    republished, resized or reused. No byte of the transfer is valid."""

    def __init__(self, message: str, *, window: str | None = None,
                 expected: int | None = None, found: int | None = None) -> None:
        super().__init__(message)
        self.window = window
        self.expected = expected
        self.found = found


class VersionGoneError(StaleReferenceError):
    """The version asked for was overwritten: the window lives on (same generation, the ref is
    good), it holds a newer version now. A follower catches up: it reads the latest version
    (``version=0``) or ``found``. A pinned lease keeps a version readable.

    Attributes:
        wanted: the version asked for. found: the version the window (that slot) holds now.
        window: the window's name ("" or None when unnamed). ``expected`` / ``found`` of
        :class:`StaleReferenceError` hold the same two versions.
    """

    def __init__(self, message: str, *, window: str | None = None, wanted: int | None = None,
                 found: int | None = None) -> None:
        super().__init__(message, window=window, expected=wanted, found=found)
        self.wanted = wanted


class WindowRetiredError(StaleReferenceError):
    """The window's generation the ref was minted for is retired: the window was unpublished,
    republished, resized or reused (or its owner exited). The ref will never work again; a
    follower looks the name up again (``Runtime.lookup(name, timeout=...)``) for the new one.

    Attributes:
        generation: the ref's generation. found: the generation the window has now, or None
        when it is gone. window: its name. ``expected`` / ``found`` of
        :class:`StaleReferenceError` hold the same two generations.
    """

    def __init__(self, message: str, *, window: str | None = None, generation: int | None = None,
                 found: int | None = None, expected: int | None = None) -> None:
        g = generation if generation is not None else expected
        super().__init__(message, window=window, expected=g, found=found)
        self.generation = g


class WindowNotFoundError(WindowRetiredError):
    """No window is published at that GVA or under that name (any more, or not yet): for a ref,
    its window was retired and its record is gone; for a name, nothing holds it now
    (``Runtime.lookup(name, timeout=...)`` waits for it to appear). Never a version error."""


class NameHeldError(MemsemError):
    """A live process of the job already publishes a window under that name: a name has one
    owner. Publish under another name, or take it over explicitly (``publish(...,
    replace=True)``).

    Attributes:
        name: the name. holder: what the directory records of its owner (``pid``, ``node``,
        ``rank``; ``gva`` of its window).
    """

    def __init__(self, message: str, *, name: str, holder: dict | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.holder = dict(holder or {})


class LeaseExpiredError(MemsemError):
    """The caller's lease on the window expired, before or during the access."""


class LeaseHeldError(MemsemError):
    """The owner tried to unpublish or reuse a window while unexpired leases exist.

    Attributes:
        holders: list of ``(pid, seconds_left)`` of the leases still held.
    """

    def __init__(self, message: str, *, holders: list[tuple[int, float]] | None = None) -> None:
        super().__init__(message)
        self.holders = holders or []


class PeerLostError(MemsemError):
    """The window's owner (or the peer of a connection) is dead or unreachable."""


class AccessDeniedError(MemsemError, PermissionError):
    """Wrong access key, or a write through a read-only ref or to a read-only window."""


class NotSupportedError(MemsemError, NotImplementedError):
    """The route or engine cannot do this here (the message names the route/engine and why)."""


class OutOfMemoryError(MemsemError, MemoryError):
    """A shared segment or symmetric heap could not be sized (checked at publish/alloc time)."""


class EngineError(MemsemError):
    """A native or engine failure.

    Attributes:
        code: the native return code, if any.
        errno: the OS errno, if any.
        name: a symbolic name (errno name, work-completion status name, SHMEM function).
    """

    def __init__(self, message: str, *, code: int | None = None, errno: int | None = None,
                 name: str | None = None) -> None:
        if errno is not None and name is None:
            name = _errno.errorcode.get(errno)
        detail = []
        if name:
            detail.append(name)
        if errno is not None:
            try:
                text = os.strerror(errno)
            except (ValueError, OverflowError):  # a number no errno is (e.g. from a peer)
                text = "not an errno"
            detail.append(f"errno {errno}: {text}")
        if code is not None and errno is None:
            detail.append(f"code {code}")
        super().__init__(f"{message} ({', '.join(detail)})" if detail else message)
        self.code = code
        self.errno = errno
        self.name = name


class MemsemTimeoutError(MemsemError, TimeoutError):
    """A bounded wait ran out. ``what`` names what was waited for."""

    def __init__(self, message: str, *, what: str | None = None, timeout: float | None = None) -> None:
        super().__init__(message)
        self.what = what
        self.timeout = timeout


class AddressInUseError(MemsemError, OSError):
    """A server of memsem's (the metrics exporter) could not listen: its address and port are
    taken by another process or server (``errno`` is ``EADDRINUSE``). The message says what to
    do: another port, or port 0 to pick a free one.

    Attributes:
        addr: the address asked for. port: the TCP port asked for.
    """

    def __init__(self, message: str, *, addr: str | None = None, port: int | None = None) -> None:
        super().__init__(_errno.EADDRINUSE, message)  # an OSError: errno, strerror
        self.addr = addr
        self.port = port

    def __reduce__(self) -> tuple:
        return _rebuild_os_error, (type(self), self.errno, self.strerror, dict(self.__dict__))


def _rebuild_os_error(cls: type, code: int, message: str, state: dict) -> "MemsemError":
    """Unpickle a memsem error that is an OSError (its errno and strerror are set by OSError's
    own constructor, not kept in its ``__dict__``)."""
    exc = cls.__new__(cls)
    OSError.__init__(exc, code, message)
    exc.__dict__.update(state)
    return exc


__all__ += ["AddressInUseError"]


class RuntimeClosedError(MemsemError):
    """The runtime this call (or the ref it was made through) is bound to was closed, or belongs
    to the parent of this forked process."""


__all__ += ["RuntimeClosedError"]


class OwnerWriteError(MemsemError):
    """The owner changed a window's published bytes outside a write section, found by the
    window's write guard (``write_guard="checksum"``: the next write section found the bytes of
    the latest version changed). Readers may have read a mixture of versions with no error."""


__all__ += ["OwnerWriteError"]


class DigestMismatchError(MemsemError):
    """Bytes received from a relay (or the trainer) do not match the digest the trainer computed
    for them: the relay ``relay`` served wrong bytes. None of them were accepted.

    Attributes:
        relay: who served them ("rank 3 of 'policy'", or "the trainer"). version: the version.
        chunk: the chunk index.
    """

    def __init__(self, message: str, *, relay: str | None = None, version: int | None = None,
                 chunk: int | None = None) -> None:
        super().__init__(message)
        self.relay = relay
        self.version = version
        self.chunk = chunk


__all__ += ["DigestMismatchError"]
