"""The SHMEM team of a process and its symmetric heap allocator (Ascend SHMEM via cffi).

A team is made once per process (collective: every PE calls :func:`init_team` with the same
unique id from :func:`new_uniqueid`); :class:`ShmemTeam` owns the library handle, the
symmetric heap (``malloc``/``free`` of :class:`SymmetricAllocation`), the per-PE signal slots
of tile-ready signals, and the stream copies complete on. The binding is
:mod:`memsem.engines.mte._binding`; the engine that moves windows' bytes through a team is
:class:`memsem.engines.mte.MteEngine`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
import threading
import weakref
from typing import Any


from memsem import _args
from memsem._errors import EngineError, MemsemError, MemsemTimeoutError, NotSupportedError, OutOfMemoryError


log = logging.getLogger(__name__)

#: signal slots (one per tile of a published window) reserved per PE at team init
DEFAULT_SIGNAL_SLOTS = 4096
#: bytes per signal slot: the signal word is an int32 (ACLSHMEM_SIGNAL_SIZE is 8)
SIGNAL_SLOT_BYTES = 8
#: zeroed bytes kept next to the slots to clear them with a put (works on NPU memory too)
_ZERO_BYTES = 4096
_ENGINE_TYPES = {"mte": 1, "sdma": 2, "roce": 4, "udma": 8}
_team_lock = threading.Lock()
_team: "ShmemTeam | None" = None


def _load(lib_path: str | os.PathLike[str] | None) -> tuple[Any, Any, pathlib.Path]:
    from memsem.engines.mte._binding import find_library, load_aclshmem

    path = find_library(lib_path)
    ffi, lib = load_aclshmem(path)
    return ffi, lib, path


def signal_value(generation: int) -> int:
    """The int32 value a tile's SHMEM signal word takes when ready for ``generation``
    (never 0, which means "not ready"); a signal from another generation does not match
    (modulo 2**31 - 1 generations)."""
    return int(generation) % 0x7FFFFFFF + 1


# ----------------------------------------------------------------------------------------------
class _AclRuntime:
    """The few libascendcl calls the engine needs on an NPU (never loaded for the emulator)."""

    def __init__(self) -> None:
        from cffi import FFI

        self.ffi = FFI()
        self.ffi.cdef("int aclrtSetDevice(int32_t deviceId);\n"
                      "int aclrtCreateStream(void **stream);\n"
                      "int aclrtDestroyStream(void *stream);\n"
                      "int aclrtSynchronizeStream(void *stream);\n")
        tried = []
        home = os.environ.get("ASCEND_HOME_PATH")
        names = ([str(pathlib.Path(home) / "lib64" / "libascendcl.so")] if home else []) + ["libascendcl.so"]
        for name in names:
            try:
                self.lib = self.ffi.dlopen(name)
                break
            except OSError as exc:
                tried.append(f"{name}: {exc}")
        else:
            raise NotSupportedError("mte engine on libshmem.so needs libascendcl.so (stream "
                                    "synchronization) and could not load it: " + "; ".join(tried))

    def check(self, rc: int, func: str) -> None:
        if rc != 0:
            raise EngineError(f"{func} failed", code=int(rc), name=func)


@dataclasses.dataclass
class SymmetricAllocation:
    """One block of the symmetric heap (same offset on every PE).

    Attributes:
        address: its address in this process (NPU memory on hardware, host memory with the emulator).
        offset: byte offset from the heap base (identical on every PE).
        nbytes: size in bytes.
    """

    address: int
    offset: int
    nbytes: int
    registrations: int = 0
    freed: bool = False


class ShmemTeam:
    """This process's membership in a SHMEM team (Ascend SHMEM is one team per process).

    Made by :func:`init_team`; ``close()`` (collective) finalizes the library. Attributes:
    ``team_id`` (same string on every PE, derived from the unique id), ``my_pe``, ``n_pes``,
    ``heap_base``, ``heap_bytes``, ``test_double`` (the host emulator is loaded),
    ``host_mapped`` (heap addresses are host memory: ``view()`` possible), ``library``.
    """

    def __init__(self, ffi: Any, lib: Any, path: pathlib.Path, my_pe: int, n_pes: int,
                 uniqueid: bytes, heap_bytes: int, *, timeout: float, engine_type: str,
                 device: int | None, signal_slots: int) -> None:
        from memsem.engines.mte._binding import is_test_double

        self.ffi, self.lib, self.library = ffi, lib, str(path)
        self.test_double = is_test_double(lib)
        self.host_mapped = self.test_double  # the real heap is NPU memory
        self.my_pe, self.n_pes, self.heap_bytes = my_pe, n_pes, heap_bytes
        self.team_id = "shmem-" + hashlib.sha256(uniqueid).hexdigest()[:16]
        self.device = device
        self._tls = threading.local()
        self.acl: _AclRuntime | None = None
        self._closed = False
        self._lock = threading.RLock()
        self._allocs: dict[int, SymmetricAllocation] = {}
        self._engines: "weakref.WeakSet[Any]" = weakref.WeakSet()  # MteEngine objects on this team
        if not self.test_double:
            self.acl = _AclRuntime()
            self.ensure_thread()
        # The unique id and attr must stay alive until init_attr returned (kept for the team's life).
        self._uid = ffi.new("aclshmemx_uniqueid_t *")
        ffi.memmove(self._uid, uniqueid, len(uniqueid))
        self._attr = ffi.new("aclshmemx_init_attr_t *")
        rc = lib.aclshmemx_set_attr_uniqueid_args(my_pe, n_pes, heap_bytes, self._uid, self._attr)
        self._check_rc(rc, "aclshmemx_set_attr_uniqueid_args")
        o = self._attr.option_attr  # the C++ default initializer, written by hand from C
        o.version = (1 << 16) + ffi.sizeof("aclshmem_init_optional_attr_t")
        o.data_op_engine_type = _ENGINE_TYPES[engine_type]
        secs = max(1, int(round(timeout)))
        o.shm_init_timeout = o.shm_create_timeout = o.control_operation_timeout = secs
        rc = lib.aclshmemx_init_attr(lib.ACLSHMEMX_INIT_WITH_UNIQUEID, self._attr)
        self._check_rc(rc, "aclshmemx_init_attr")
        try:
            got = (lib.aclshmem_my_pe(), lib.aclshmem_n_pes())
            if got != (my_pe, n_pes):
                raise EngineError(f"SHMEM reports PE {got[0]} of {got[1]}, asked for {my_pe} of {n_pes}",
                                  name="aclshmem_my_pe")
            base = lib.aclshmemx_get_heap_base(lib.DEVICE_SIDE)
            self.check("aclshmemx_get_heap_base")
            if base == ffi.NULL:
                raise EngineError("the symmetric heap has no base address", name="aclshmemx_get_heap_base")
            self.heap_base = int(ffi.cast("uintptr_t", base))
            # Signal slots (int32 words in 8-byte slots) plus a zero block to clear them with a put.
            self.signal_slots = int(signal_slots)
            self._sig = self.malloc(self.signal_slots * SIGNAL_SLOT_BYTES + _ZERO_BYTES, zero=True)
            self._free_slots: list[tuple[int, int]] = [(0, self.signal_slots)]  # (start, count)
        except BaseException:
            lib.aclshmem_finalize()
            raise

    # -- error plumbing -----------------------------------------------------------------------
    def emu_error(self) -> tuple[int, str]:
        """The emulator's recorded error of the last call ``(code, message)``; ``(0, "")`` on
        real Ascend SHMEM (its data-plane calls return void)."""
        if not self.test_double:
            return 0, ""
        from memsem.engines.mte._binding import emu_last_error

        return emu_last_error(self.ffi, self.lib)

    def _check_rc(self, rc: int, func: str) -> None:
        code, msg = self.emu_error()
        if rc != 0:
            raise EngineError(f"{func} failed" + (f": {msg}" if msg else ""), code=int(rc), name=func)

    def check(self, func: str) -> None:
        """Raise the error the emulator recorded for the last call (no-op on libshmem.so,
        whose data-plane calls return void: memsem checks their arguments beforehand)."""
        code, msg = self.emu_error()
        if code:
            if code == self.lib.ACLSHMEM_TIMEOUT_ERROR:
                raise MemsemTimeoutError(f"{func} timed out: {msg}", what=func)
            raise EngineError(msg or f"{func} failed", code=code, name=func)

    def ensure_thread(self) -> None:
        """On an NPU, bind the calling thread to the team's device (ACL contexts are per thread)."""
        if self.acl is not None and self.device is not None and not getattr(self._tls, "bound", False):
            self.acl.check(self.acl.lib.aclrtSetDevice(self.device), "aclrtSetDevice")
            self._tls.bound = True

    def _check_open(self) -> None:
        if self._closed:
            raise MemsemError(f"SHMEM team {self.team_id} is finalized")

    # -- symmetric heap -----------------------------------------------------------------------
    def in_heap(self, address: int, nbytes: int) -> bool:
        return self.heap_base <= address and address + nbytes <= self.heap_base + self.heap_bytes

    def malloc(self, nbytes: int, *, align: int = 0, zero: bool = False) -> SymmetricAllocation:
        """Collective: every PE calls it with the same arguments in the same order.

        Raises:
            ValueError: ``nbytes`` not positive. OutOfMemoryError: the heap cannot hold it.
            EngineError: the library refused (``name`` is the SHMEM function).
        """
        nbytes = _args.count(nbytes, "nbytes", minimum=1, maximum=_args.MAX_BYTES, unit="bytes")
        align = _args.count(align, "align", unit="bytes")
        if align and zero:
            raise ValueError("pass align or zero, not both")
        self._check_open()
        lib, ffi = self.lib, self.ffi
        self.ensure_thread()
        if align:
            func, p = "aclshmem_align", lib.aclshmem_align(int(align), int(nbytes))
        elif zero:
            func, p = "aclshmem_calloc", lib.aclshmem_calloc(1, int(nbytes))
        else:
            func, p = "aclshmem_malloc", lib.aclshmem_malloc(int(nbytes))
        code, msg = self.emu_error()
        if p == ffi.NULL:
            if code in (0, lib.ACLSHMEM_MALLOC_FAILED):
                raise OutOfMemoryError(f"{func}({nbytes}) failed: the {self.heap_bytes}-byte symmetric "
                                       f"heap of PE {self.my_pe} cannot hold it" + (f" ({msg})" if msg else ""))
            raise EngineError(msg or f"{func} failed", code=code, name=func)
        addr = int(ffi.cast("uintptr_t", p))
        a = SymmetricAllocation(addr, addr - self.heap_base, int(nbytes))
        with self._lock:
            self._allocs[addr] = a
        return a

    def free(self, alloc: SymmetricAllocation) -> None:
        """Collective ``aclshmem_free``. Refused while a published window uses the block."""
        with self._lock:
            if alloc.freed:
                return
            if alloc.registrations:
                raise MemsemError(f"symmetric block at heap offset {alloc.offset} is published in "
                                  f"{alloc.registrations} window(s); unpublish before free")
            alloc.freed = True
            self._allocs.pop(alloc.address, None)
        self.ensure_thread()
        self.lib.aclshmem_free(self.ffi.cast("void *", alloc.address))
        self.check("aclshmem_free")

    def add_engine(self, engine: Any) -> None:
        """An MteEngine that moves bytes on this team (closed with it)."""
        self._engines.add(engine)

    def own_allocation(self, address: int) -> SymmetricAllocation | None:
        """The allocation of ``malloc`` starting at ``address`` (never the team's signal slots)."""
        with self._lock:
            a = self._allocs.get(address)
        return None if a is self._sig else a

    def allocation_of(self, address: int, nbytes: int) -> SymmetricAllocation | None:
        with self._lock:
            for a in self._allocs.values():
                if a.address <= address and address + max(nbytes, 1) <= a.address + a.nbytes:
                    return a
        return None

    # -- signal slots (owner-local bookkeeping; offsets are the same on every PE) ---------------
    def take_slots(self, n: int) -> int | None:
        """First slot of ``n`` consecutive free signal slots, cleared; None when none are left."""
        with self._lock:
            for i, (start, count) in enumerate(self._free_slots):
                if count >= n:
                    self._free_slots[i] = (start + n, count - n)
                    if count == n:
                        del self._free_slots[i]
                    break
            else:
                return None
        self._clear_slots(start, n)
        return start

    def release_slots(self, start: int, n: int) -> None:
        with self._lock:
            self._free_slots.append((start, n))
            self._free_slots.sort()
            merged: list[tuple[int, int]] = []
            for s, c in self._free_slots:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + c)
                else:
                    merged.append((s, c))
            self._free_slots = merged

    def slot_address(self, slot: int) -> int:
        return self._sig.address + slot * SIGNAL_SLOT_BYTES

    def _clear_slots(self, start: int, n: int) -> None:
        zero = self._sig.address + self.signal_slots * SIGNAL_SLOT_BYTES
        stream = self.ffi.NULL
        done = 0
        while done < n * SIGNAL_SLOT_BYTES:
            chunk = min(_ZERO_BYTES, n * SIGNAL_SLOT_BYTES - done)
            self.lib.aclshmemx_putmem_on_stream(self.ffi.cast("void *", self.slot_address(start) + done),
                                                self.ffi.cast("void *", zero), chunk, self.my_pe, stream)
            self.check("aclshmemx_putmem_on_stream")
            done += chunk
        self.complete(stream)

    def complete(self, stream: Any) -> None:
        """Remote completion of everything posted on ``stream``: quiet, then (NPU) synchronize."""
        self.lib.aclshmemx_quiet_on_stream(stream)
        self.check("aclshmemx_quiet_on_stream")
        if self.acl is not None:
            self.acl.check(self.acl.lib.aclrtSynchronizeStream(stream), "aclrtSynchronizeStream")

    # -- collectives / lifetime --------------------------------------------------------------
    def barrier(self) -> None:
        """``aclshmem_barrier_all`` (collective; bounded by the team's control timeout)."""
        self._check_open()
        self.ensure_thread()
        self.lib.aclshmem_barrier_all()
        self.check("aclshmem_barrier_all")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Collective: finalize SHMEM (every symmetric block goes with it). Safe twice.
        Engines of runtimes still open on this team are closed first."""
        global _team
        if self._closed:
            return
        for eng in list(self._engines):
            eng.close()
        self._closed = True
        with _team_lock:
            if _team is self:
                _team = None
        self.ensure_thread()
        rc = self.lib.aclshmem_finalize()
        self._check_rc(rc, "aclshmem_finalize")

    def __enter__(self) -> "ShmemTeam":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "test double" if self.test_double else "libshmem.so"
        return (f"<ShmemTeam {self.team_id} PE {self.my_pe}/{self.n_pes} heap {self.heap_bytes} B "
                f"({kind} {self.library}){' finalized' if self._closed else ''}>")


def new_uniqueid(lib_path: str | os.PathLike[str] | None = None) -> bytes:
    """A fresh SHMEM unique id (``aclshmemx_get_uniqueid``) as bytes, to send to every PE.

    Call it in the process that will be PE 0 (on an NPU the id carries PE 0's bootstrap
    address) and hand the bytes to the others through any channel. 136 bytes.
    """
    ffi, lib, _ = _load(lib_path)
    uid = ffi.new("aclshmemx_uniqueid_t *")
    rc = lib.aclshmemx_get_uniqueid(uid)
    if rc != 0:
        raise EngineError("aclshmemx_get_uniqueid failed", code=int(rc), name="aclshmemx_get_uniqueid")
    return bytes(ffi.buffer(uid))


def init_team(my_pe: int, n_pes: int, uniqueid: bytes, heap_bytes: int, *,
              timeout: float = 120.0, engine_type: str = "mte", device: int | None = None,
              signal_slots: int = DEFAULT_SIGNAL_SLOTS,
              lib_path: str | os.PathLike[str] | None = None) -> ShmemTeam:
    """Join SHMEM team ``uniqueid`` as PE ``my_pe`` of ``n_pes`` (collective, blocking).

    Args:
        my_pe / n_pes: this process's PE number in ``[0, n_pes)`` and the team size.
        uniqueid: the bytes :func:`new_uniqueid` made on PE 0 (136 bytes).
        heap_bytes: size of this PE's symmetric heap (the same on every PE).
        timeout: seconds for init (every PE must join) and for each collective control step.
        engine_type: SHMEM data engine, ``"mte"`` (default), ``"sdma"``, ``"roce"``, ``"udma"``.
        device: NPU device id bound to each thread that calls SHMEM (``aclrtSetDevice``); None
            when the application set it already. Ignored by the host emulator.
        signal_slots: tile-ready signal words reserved per PE (one per tile of a window).
        lib_path: the library to load (default: ``MEMSEM_SHMEM_LIB``, SHMEM/CANN install).

    Returns:
        The process's :class:`ShmemTeam` (also what :func:`current_team` returns until closed).

    Raises:
        NotSupportedError: no SHMEM library (or it lacks a symbol). MemsemError: this process
        is already a PE of a team. EngineError: init failed (``name`` is the SHMEM function,
        ``code`` its return code; a PE that never joins gives ``ACLSHMEM_TIMEOUT_ERROR``).
        ValueError / TypeError: bad arguments (named).
    """
    global _team
    n_pes = _args.count(n_pes, "n_pes", minimum=1, unit="PEs")
    my_pe = _args.index(my_pe, "my_pe", n_pes, of=f"a team of {n_pes} PEs")
    heap_bytes = _args.count(heap_bytes, "heap_bytes", minimum=1, maximum=_args.MAX_BYTES, unit="bytes")
    signal_slots = _args.count(signal_slots, "signal_slots", unit="slots")
    if engine_type not in _ENGINE_TYPES:
        raise ValueError(f"engine_type must be one of {sorted(_ENGINE_TYPES)}, got {engine_type!r}")
    timeout = _args.timeout(timeout, "timeout", positive=True)
    if not isinstance(uniqueid, (bytes, bytearray, memoryview)):
        raise TypeError(f"uniqueid must be bytes from new_uniqueid(), got {type(uniqueid).__name__}")
    ffi, lib, path = _load(lib_path)
    uniqueid = bytes(uniqueid)
    if len(uniqueid) != ffi.sizeof("aclshmemx_uniqueid_t"):
        raise ValueError(f"uniqueid must be {ffi.sizeof('aclshmemx_uniqueid_t')} bytes "
                         f"(from new_uniqueid()), got {len(uniqueid)}")
    with _team_lock:
        if _team is not None and not _team.closed:
            raise MemsemError(f"this process is already {_team!r}; close() it first")
        team = ShmemTeam(ffi, lib, path, int(my_pe), int(n_pes), uniqueid, int(heap_bytes),
                         timeout=float(timeout), engine_type=engine_type, device=device,
                         signal_slots=int(signal_slots))
        _team = team
    log.debug("joined %r", team)
    return team


def current_team() -> ShmemTeam | None:
    """The SHMEM team of this process (from :func:`init_team`), or None."""
    t = _team
    return t if t is not None and not t.closed else None


__all__ = ["DEFAULT_SIGNAL_SLOTS", "SIGNAL_SLOT_BYTES", "ShmemTeam", "SymmetricAllocation", "current_team", "init_team", "new_uniqueid", "signal_value"]
