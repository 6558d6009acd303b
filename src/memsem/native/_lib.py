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

COPY_MEMCPY = lib.MEMSEM_COPY_MEMCPY
COPY_VM = lib.MEMSEM_COPY_VM
LAT_BUCKETS = lib.MEMSEM_LAT_BUCKETS

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


# -- delta versions (native/memsem_delta.c): each array argument is the address of a C array,
#    indexed by tile (uint64 unless named otherwise); the caller keeps them alive and sized ----------
#: a tile's count meaning "changed, moved whole" (else: 0 unchanged, or the elements of its patch)
DELTA_DENSE = lib.MEMSEM_DELTA_DENSE


def digest(addr: int, nbytes: int, seed: int = 0) -> int:
    """The 64-bit digest (not cryptographic) of ``nbytes`` at ``addr``, GIL released."""
    return lib.memsem_digest(addr, nbytes, seed)


def digest_tiles(addr: int, nbytes: int, n: int, out: int) -> None:
    """``out[i]`` = the digest of tile ``i`` (at ``addr[i]``, ``nbytes[i]`` bytes), ``n`` tiles."""
    lib.memsem_digest_tiles(_cast(_u64p, addr), _cast(_u64p, nbytes), n, _cast(_u64p, out))


def record_tiles(new: int, old: int, nbytes: int, itemsize: int, limit: int, prev: int, n: int, digest: int,
                 count: int, out: int, out_cap: int) -> int:
    """Digest each tile at ``new[i]`` and find what changed since ``old[i]`` (see the header:
    ``prev`` 0 for no previous digests); returns the bytes of patches written at ``out``."""
    return lib.memsem_record_tiles(_cast(_u64p, new), _cast(_u64p, old), _cast(_u64p, nbytes), _cast(_u32p, itemsize),
                                   _cast(_u32p, limit), _cast(_u64p, prev) if prev else ffi.NULL, n,
                                   _cast(_u64p, digest), _cast(_u32p, count), out, out_cap)


def patch_tiles(dst: int, nbytes: int, itemsize: int, count: int, patch: int, n: int) -> int:
    """Apply the patch at ``patch[i]`` to each sparse tile at ``dst[i]``; returns the indices that
    fell outside their tile (not written; 0 normally)."""
    return lib.memsem_patch_tiles(_cast(_u64p, dst), _cast(_u64p, nbytes), _cast(_u32p, itemsize),
                                  _cast(_u32p, count), _cast(_u64p, patch), n)


def check_tiles(dst: int, nbytes: int, itemsize: int, count: int, patch: int, expected: int, n: int) -> int:
    """``patch_tiles`` (``count`` 0: none), then each tile's digest against ``expected[i]``;
    returns the tiles that do not match."""
    return lib.memsem_check_tiles(_cast(_u64p, dst), _cast(_u64p, nbytes), _cast(_u32p, itemsize),
                                  _cast(_u32p, count) if count else ffi.NULL, _cast(_u64p, patch) if patch else ffi.NULL,
                                  _cast(_u64p, expected), n)


class UseWord:
    """A native use word (see ``native/memsem_native.h``): counts the holders of a resource and
    tells exactly one caller when to release it (the closer, or the last holder to leave).

    Lock-free, so safe from finalizers and signal-free threads alike. ``addr`` is the word's
    address, for native calls that enter and leave it themselves (``memsem_plan_copy``).
    """

    __slots__ = ("_cell", "addr", "__weakref__")

    def __init__(self, cell: object = None) -> None:
        # ``cell`` lets a struct's first member serve (a plan's use word); else a fresh word.
        self._cell = ffi.new("uint64_t *") if cell is None else cell
        self.addr = int(ffi.cast("uintptr_t", self._cell))

    def enter(self) -> bool:
        """Count one holder; False (nothing counted) when the word is closed."""
        return lib.memsem_use_enter(self._cell) == 0

    def leave(self) -> bool:
        """Drop one holder; True when the caller must release the resource now."""
        return lib.memsem_use_leave(self._cell) == 1

    def close(self) -> int:
        """Close the word. Returns 1 when the caller must release now (no holder left), 0 when
        holders remain (the last to leave releases), 2 when it was already closed (only the
        first close counts)."""
        return lib.memsem_use_close(self._cell)

    def wait_idle(self, timeout: float) -> bool:
        """Block until a closed word has no holder, at most ``timeout`` s; False on timeout."""
        return lib.memsem_use_wait_idle(self._cell, float(timeout)) == 0

    @property
    def closed(self) -> bool:
        return bool(self._cell[0] >> 63)

    @property
    def holders(self) -> int:
        return int(self._cell[0] & ((1 << 63) - 1))


def new_plan() -> object:
    """A zeroed ``memsem_plan`` (owned by the returned cdata: keep it referenced)."""
    return ffi.new("memsem_plan *")


def map_fd(fd: int, nbytes: int, writable: bool) -> int:
    """mmap(MAP_SHARED) the first ``nbytes`` of ``fd``; returns the address. The mapping holds
    no file descriptor: the caller closes ``fd``. Raises EngineError with the errno."""
    a = lib.memsem_map(fd, nbytes, 1 if writable else 0)
    if a < 0:
        raise EngineError(f"mmap of {nbytes} bytes failed", errno=-a)
    return a


def unmap(addr: int, nbytes: int) -> None:
    """munmap; raises EngineError with the errno."""
    check_rc(lib.memsem_unmap(addr, nbytes), "munmap failed")


def protect(addr: int, nbytes: int, writable: bool) -> None:
    """mprotect a page-aligned range read-write or read-only; raises EngineError."""
    check_rc(lib.memsem_protect(addr, nbytes, 1 if writable else 0), "mprotect failed")


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC in nanoseconds: one clock for every process of a node."""
    return lib.memsem_monotonic_ns()

