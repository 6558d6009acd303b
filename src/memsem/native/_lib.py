"""Thin typed wrappers over the cffi module ``memsem._native``."""
from __future__ import annotations

import errno as _errno

from memsem._errors import EngineError, NotSupportedError

try:
    from memsem._native import ffi, lib
except ImportError as exc:  # pragma: no cover - only when the package was not built
    raise NotSupportedError(
        "memsem._native is not built: install memsem with pip (it compiles native/ with cffi)"
    ) from exc

GUARD_BEFORE = lib.MEMSEM_GUARD_BEFORE
GUARD_AFTER = lib.MEMSEM_GUARD_AFTER
COPY_MEMCPY = lib.MEMSEM_COPY_MEMCPY
COPY_VM_READ = lib.MEMSEM_COPY_VM_READ
COPY_VM_WRITE = lib.MEMSEM_COPY_VM_WRITE

_u64p = ffi.typeof("uint64_t *")
_u32p = ffi.typeof("uint32_t *")
_voidp = ffi.typeof("void *")
_cast = ffi.cast


def check_rc(rc: int, what: str) -> int:
    """Raise :class:`EngineError` carrying the errno when ``rc`` is a negative errno."""
    if rc < 0:
        raise EngineError(what, errno=-rc)
    return rc


def load_acquire(addr: int) -> int:
    """Atomic 64-bit load with acquire ordering at ``addr`` (8-byte aligned)."""
    return lib.memsem_load_acquire(_cast(_u64p, addr))


def store_release(addr: int, value: int) -> None:
    """Atomic 64-bit store with release ordering."""
    lib.memsem_store_release(_cast(_u64p, addr), value)


def fetch_add(addr: int, delta: int) -> int:
    """Atomic fetch-and-add (acq_rel); returns the previous value."""
    return lib.memsem_fetch_add(_cast(_u64p, addr), delta)


def fetch_sub(addr: int, delta: int) -> int:
    """Atomic fetch-and-sub (acq_rel); returns the previous value."""
    return lib.memsem_fetch_sub(_cast(_u64p, addr), delta)


def compare_exchange(addr: int, expected: int, desired: int) -> tuple[bool, int]:
    """Atomic CAS. Returns ``(swapped, value_seen)``."""
    exp = ffi.new("uint64_t *", expected)
    ok = lib.memsem_compare_exchange(_cast(_u64p, addr), exp, desired)
    return bool(ok), int(exp[0])


def futex_wait(addr: int, expected: int, timeout: float) -> bool:
    """Block while the 32-bit word at ``addr`` equals ``expected``, at most ``timeout`` seconds.

    Returns True when woken (or the word already differed), False on timeout. Spurious wake-ups
    are possible: callers re-check their condition.
    """
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
    rc = lib.memsem_futex_wait(_cast(_u32p, addr), expected & 0xFFFFFFFF, float(timeout))
    if rc == 0 or rc == -_errno.EINTR:
        return True
    if rc == -_errno.ETIMEDOUT:
        return False
    raise EngineError("futex wait failed", errno=-rc)


def futex_wake(addr: int, n: int = 2**31 - 1) -> int:
    """Wake up to ``n`` waiters on the 32-bit word at ``addr``; returns how many were woken."""
    return check_rc(lib.memsem_futex_wake(_cast(_u32p, addr), n), "futex wake failed")


def vm_read(pid: int, local: int, remote: int, nbytes: int) -> None:
    """process_vm_readv ``nbytes`` from ``remote`` in ``pid`` into ``local``. Raises EngineError."""
    check_rc(lib.memsem_vm_read(pid, _cast(_voidp, local), remote, nbytes),
             f"process_vm_readv from pid {pid} failed")


def vm_write(pid: int, local: int, remote: int, nbytes: int) -> None:
    """process_vm_writev ``nbytes`` from ``local`` to ``remote`` in ``pid``. Raises EngineError."""
    check_rc(lib.memsem_vm_write(pid, _cast(_voidp, local), remote, nbytes),
             f"process_vm_writev to pid {pid} failed")


def memcpy(dst: int, src: int, nbytes: int) -> None:
    """memcpy between two mapped addresses, GIL released."""
    lib.memsem_memcpy(_cast(_voidp, dst), _cast(_voidp, src), nbytes)


def guarded_copy(guard: int, expected: int, inflight: int, method: int, pid: int,
                 dst: int, src: int, nbytes: int) -> int:
    """One-call guarded copy (see native/memsem_native.h). Returns 0, GUARD_BEFORE, GUARD_AFTER
    or a negative errno; the caller interprets them. For COPY_VM_READ ``src`` is in ``pid``; for
    COPY_VM_WRITE ``dst`` is."""
    return lib.memsem_guarded_copy(guard, expected, inflight, method, pid, dst, src, nbytes)


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC in nanoseconds: one clock for every process of a node."""
    return lib.memsem_monotonic_ns()

