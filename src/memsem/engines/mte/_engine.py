"""MTE engine: one-sided copies between PEs of an Ascend SHMEM team (``libshmem.so`` via cffi).

An application makes the processes of a job one SHMEM team, then enables the engine::

    from memsem.engines.mte import MteEngine

    uid = MteEngine.new_uniqueid() if my_pe == 0 else None      # PE 0 only
    uid = broadcast(uid)                 # any channel: torch.distributed, Ray, a file, ZMQ
    team = MteEngine.init_team(my_pe, n_pes, uid, heap_bytes=1 << 30)   # collective
    with memsem.Runtime(engines=("loopback", "host", "mte")) as rt:
        w = rt.alloc((1024, 1024), np.float32, engine="mte")   # collective: symmetric heap
        ref = rt.publish(w, name="w")                           # has an "mte" descriptor
        ...
    team.close()                                                # collective: aclshmem_finalize

Mechanism (``memsem.engines.mte._binding`` holds the binding, ``_team`` the team and its heap):

* ``register`` gives a descriptor ``{team, pe, offset, nbytes, mapped, writable}`` only for a
  region that lies in the symmetric heap; other memory gets no mte route (``None``).
* ``attach`` translates the window's heap offset with ``aclshmem_ptr``; a peer whose heap is
  not mapped (NULL) is an :class:`EngineError` naming ``aclshmem_ptr``.
* ``get``/``put`` post ``aclshmemx_getmem_on_stream``/``putmem_on_stream`` on the engine's
  stream and complete with ``aclshmemx_quiet_on_stream`` (plus ``aclrtSynchronizeStream`` on
  an NPU): a blocking call returns at remote completion. ``submit`` posts a batch with the
  ``_nbi`` calls and completes it with one quiet. ``view`` works where ``aclshmem_ptr`` gives
  a host-usable address (the host emulator; not NPU memory).
* Tile-ready: ``put_signal`` writes a tile and raises its SHMEM signal word in one
  ``aclshmemx_putmem_signal``; the owner waits on it with ``wait_signal``
  (``aclshmem_signal_wait_until``). See docs/mte.md for what maps onto memsem's ready words.

The library is real Ascend SHMEM or its host emulator (a test double, loaded only when
``MEMSEM_SHMEM_LIB`` names it); emulator-only calls are guarded by ``is_test_double``. Never
imports torch_npu. Data-plane calls of the real library return void: ranges and PEs are
checked here before each call, and with the emulator its recorded error is checked after.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from memsem import _args, _dtypes
from memsem._buffers import address_view, dtype_code
from memsem._errors import EngineError, MemsemError, MemsemTimeoutError, NotSupportedError
from memsem.engines.mte._team import (
    ShmemTeam,
    SymmetricAllocation,
    _load,
    current_team,
    init_team,
    new_uniqueid,
    signal_value,
)
from memsem.engines._base import (
    Availability,
    ControlWords,
    Descriptor,
    Engine,
    LocalRegion,
    Op,
    OpKind,
    OpState,
    RemoteRegion,
    Request,
)

log = logging.getLogger(__name__)

class _MteRemote(RemoteRegion):
    """A window reached through SHMEM: PE, local symmetric address of the same offset, and the
    ``aclshmem_ptr`` translation (host-usable only where the team is ``host_mapped``)."""

    def __init__(self, engine: "MteEngine", nbytes: int, pe: int, sym: int, ptr: int,
                 writable: bool, sig_slot: int, n_sig: int) -> None:
        super().__init__(engine, nbytes, None)
        self.pe, self.sym, self.ptr, self.writable = pe, sym, ptr, writable
        self.sig_slot, self.n_sig = sig_slot, n_sig


class MteEngine(Engine):
    """Engine over one Ascend SHMEM team (see the module docstring).

    Constructed by the runtime (``Runtime(engines=(..., "mte"))``) on the process's team from
    :func:`init_team`, or directly as ``MteEngine(team)``.

    Attributes:
        location_attrs: ``{"shmem_team": team_id, "shmem_pe": my_pe}``, merged into the
            runtime's Location: the topology picks route ``mte`` for a window whose descriptor
            names the same team.
    """

    name: ClassVar[str] = "mte"
    new_uniqueid = staticmethod(new_uniqueid)
    init_team = staticmethod(init_team)

    @classmethod
    def probe(cls) -> Availability:
        """Whether a SHMEM library loads here; the reason names the library and says when it
        is the host emulator (a test double). Does not initialize anything."""
        from memsem.engines.mte._binding import is_test_double

        try:
            _ffi, lib, path = _load(None)
        except MemsemError as exc:
            return Availability(False, str(exc).replace("mte engine unavailable: ", "", 1))
        if is_test_double(lib):
            return Availability(True, f"TEST DOUBLE: memsem shmem host emulator {path} (host memory, no NPU)")
        return Availability(True, f"Ascend SHMEM {path}")

    #: a window in the symmetric heap is NPU memory on hardware: cross-memory attach of its
    #: (device) address would read garbage, so the team's route takes it
    excludes = {"host/cma": "the window lives in the SHMEM symmetric heap (NPU memory on hardware): "
                            "reached through mte, not cross-memory attach"}

    @classmethod
    def reach(cls, me, owner, descriptor, cost):  # noqa: D102 - see Engine.reach
        team = descriptor.field("team", str)
        if me.attrs.get("shmem_team") != team:
            return f"this process is not a PE of SHMEM team {team!r}"
        return ("mte", f"both ends are PEs of SHMEM team {team!r} with MTE reach",
                descriptor.field("mapped", bool, False))

    def __init__(self, team: ShmemTeam | None = None) -> None:
        super().__init__()
        team = team if team is not None else current_team()
        if team is None or team.closed:
            raise NotSupportedError(
                "engine 'mte' needs this process to be a PE of a SHMEM team: call "
                "memsem.engines.mte.init_team(my_pe, n_pes, uniqueid, heap_bytes) before creating "
                "the Runtime")
        self.team = team
        self.location_attrs = {"shmem_team": team.team_id, "shmem_pe": team.my_pe}
        # The engine's stream: an aclrtStream on an NPU, an opaque handle for the emulator.
        self._stream = team.ffi.cast("void *", 0x6D746500 + (id(self) & 0xFFFF) * 16)
        if team.acl is not None:
            team.ensure_thread()
            p = team.acl.ffi.new("void **")
            team.acl.check(team.acl.lib.aclrtCreateStream(p), "aclrtCreateStream")
            self._stream = team.ffi.cast("void *", team.acl.ffi.cast("uintptr_t", p[0]))
        self._regs: dict[int, tuple[SymmetricAllocation | None, int, int]] = {}
        self._lock = threading.Lock()
        team.add_engine(self)

    # -- allocation (collective) -------------------------------------------------------------
    def alloc_array(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """Collective: a zero-filled array in the symmetric heap (``aclshmem_calloc``).

        Every PE must call it with the same shape and dtype in the same order. The block is
        released by :meth:`free` (collective) or at team close, never by garbage collection
        (freeing is a collective call). Where the heap is NPU memory this raises
        NotSupportedError (a numpy array cannot live there): use :meth:`malloc`.
        """
        dt = _dtypes.numpy_dtype(dtype_code(dtype, "dtype", of_buffer=False))
        shape_t = _args.shape(shape, "shape", itemsize=dt.itemsize)
        if not self.team.host_mapped:
            raise NotSupportedError("the symmetric heap of libshmem.so is NPU memory: a numpy array "
                                    "cannot live there; use MteEngine.malloc() and wrap the address "
                                    "as a device tensor")
        nbytes = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
        a = self.team.malloc(max(nbytes, 1), zero=True)
        raw = address_view(a.address, nbytes, a)
        return raw.view(dt).reshape(shape_t)

    def malloc(self, nbytes: int, *, align: int = 0) -> SymmetricAllocation:
        """Collective ``aclshmem_malloc``/``aclshmem_align`` of ``nbytes``; see ShmemTeam.malloc."""
        return self.team.malloc(nbytes, align=align)

    def free(self, obj: Any) -> None:
        """Collective ``aclshmem_free`` of an array from :meth:`alloc_array` or an allocation."""
        if isinstance(obj, SymmetricAllocation):
            a = obj
        else:
            addr = obj.__array_interface__["data"][0] if hasattr(obj, "__array_interface__") else None
            a = self.team.own_allocation(addr) if addr is not None else None
            if a is None:
                raise ValueError("obj is not a block from MteEngine.alloc_array/malloc")
        self.team.free(a)

    # -- owner side --------------------------------------------------------------------------
    def register(self, region: LocalRegion) -> Descriptor | None:
        """Descriptor for a region in the symmetric heap; None for any other memory."""
        t = self.team
        if self.closed or t.closed or not t.in_heap(region.address, region.nbytes):
            return None
        alloc = t.allocation_of(region.address, region.nbytes)
        if alloc is not None:
            with t._lock:
                alloc.registrations += 1
        offset = region.address - t.heap_base
        with self._lock:
            self._regs[offset] = (alloc, -1, 0)
        return Descriptor(self.name, {"team": t.team_id, "pe": t.my_pe, "offset": offset,
                                      "nbytes": region.nbytes, "mapped": t.host_mapped,
                                      "writable": region.writable, "sig_slot": -1, "n_sig": 0})

    def on_publish(self, descriptor: Descriptor, n_tiles: int, gva: int,
                   words: ControlWords | None = None) -> None:
        """Give a tiled window one SHMEM signal slot per tile (``put_tile`` then sends the data
        and the tile's signal in one ``aclshmemx_putmem_signal``)."""
        desc, n = descriptor, int(n_tiles)
        if n == 0:
            return
        slot = self.team.take_slots(n)
        if slot is None:
            log.info("mte: no %d free signal slots for window gva %#x; put_tile falls back to put + "
                     "ready word", n, gva)
            return
        desc.fields["sig_slot"], desc.fields["n_sig"] = slot, n
        offset = desc.field("offset", int)
        with self._lock:
            alloc, _, _ = self._regs.get(offset, (None, -1, 0))
            self._regs[offset] = (alloc, slot, n)

    def deregister(self, descriptor: Descriptor) -> None:
        self._check_descriptor(descriptor)
        with self._lock:
            alloc, slot, n = self._regs.pop(descriptor.field("offset", int), (None, -1, 0))
        if alloc is not None:
            with self.team._lock:
                alloc.registrations = max(0, alloc.registrations - 1)
        if slot >= 0 and not self.team.closed:
            self.team.release_slots(slot, n)

    # -- consumer side -----------------------------------------------------------------------
    def attach(self, descriptor: Descriptor, nbytes: int, credential: bytes = b"") -> RemoteRegion:
        self._check_descriptor(descriptor)
        self._check_usable()
        t = self.team
        d = descriptor
        team = d.field("team", str)
        if team != t.team_id:
            raise NotSupportedError(f"mte: the window belongs to SHMEM team {team!r}; this "
                                    f"process is PE {t.my_pe} of {t.team_id!r}")
        pe, offset = d.field("pe", int), d.field("offset", int)
        if not 0 <= pe < t.n_pes:
            raise EngineError(f"mte: the window's owner PE {pe} is outside team {t.team_id} of "
                              f"{t.n_pes} PEs (aclshmem_ptr would return NULL)", name="aclshmem_ptr")
        if offset < 0 or offset + nbytes > t.heap_bytes:
            raise EngineError(f"mte: range [{offset}, {offset + nbytes}) lies outside the "
                              f"{t.heap_bytes}-byte symmetric heap", name="aclshmem_ptr")
        sym = t.heap_base + offset
        t.ensure_thread()
        p = t.lib.aclshmem_ptr(t.ffi.cast("void *", sym), pe)
        code, msg = t.emu_error()
        if p == t.ffi.NULL:
            raise EngineError(f"mte: the heap of peer PE {pe} is not mapped in this process "
                              f"(aclshmem_ptr returned NULL{': ' + msg if msg else ''})",
                              name="aclshmem_ptr", code=code or None)
        return _MteRemote(self, nbytes, pe, sym, int(t.ffi.cast("uintptr_t", p)),
                          d.field("writable", bool, True), d.field("sig_slot", int, -1), d.field("n_sig", int, 0))

    def view(self, remote: RemoteRegion) -> np.ndarray:
        r = self._remote(remote)
        if not self.team.host_mapped:
            raise NotSupportedError("mte: the window is NPU memory of PE %d; view() needs host-mapped "
                                    "memory (use get())" % r.pe)
        return address_view(r.ptr, r.nbytes, r, readonly=not r.writable)

    # -- data --------------------------------------------------------------------------------
    def _remote(self, remote: RemoteRegion) -> _MteRemote:
        if not isinstance(remote, _MteRemote) or remote.engine is not self:
            raise ValueError("remote was not attached by this mte engine")
        return remote

    def _check_usable(self) -> None:
        if self.closed:
            raise MemsemError("mte engine is closed")
        if self.team.closed:
            raise MemsemError(f"SHMEM team {self.team.team_id} is finalized")

    def _local(self, arr: np.ndarray, func: str) -> Any:
        """cffi pointer to a local buffer; on an NPU it must be NPU memory (the heap)."""
        addr = arr.__array_interface__["data"][0]
        if not self.team.host_mapped and not self.team.in_heap(addr, arr.nbytes):
            raise NotSupportedError(
                f"{func} on libshmem.so needs its local buffer in NPU memory; this one is host memory "
                "(memsem does not stage host buffers through the NPU yet)")
        return self.team.ffi.cast("void *", addr)

    def _post(self, kind: OpKind, r: _MteRemote, offset: int, local: np.ndarray, stream: Any) -> None:
        self._check_range(r, offset, local.nbytes)
        if local.nbytes == 0:
            return
        t = self.team
        sym = t.ffi.cast("void *", r.sym + offset)
        if kind == OpKind.GET:
            func = "aclshmemx_getmem_on_stream"
            t.lib.aclshmemx_getmem_on_stream(self._local(local, func), sym, local.nbytes, r.pe, stream)
        else:
            func = "aclshmemx_putmem_on_stream"
            t.lib.aclshmemx_putmem_on_stream(sym, self._local(local, func), local.nbytes, r.pe, stream)
        t.check(func)

    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        """Copy ``dst.nbytes`` bytes of the window at ``offset`` into ``dst``; returns at completion."""
        self._check_usable()
        self.team.ensure_thread()
        self._post(OpKind.GET, self._remote(remote), offset, dst, self._stream)
        self.team.complete(self._stream)

    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        """Copy ``src`` into the window at ``offset``; returns at remote completion."""
        self._check_usable()
        self.team.ensure_thread()
        self._post(OpKind.PUT, self._remote(remote), offset, src, self._stream)
        self.team.complete(self._stream)

    def submit(self, ops: Sequence[Op]) -> Request:
        """Post every op with ``aclshmem_getmem_nbi``/``putmem_nbi`` (library default stream),
        then complete them all with one ``aclshmemx_quiet_on_stream``; runs on a helper thread.
        Ops whose arguments are refused end FAILED at once; the others DONE after the quiet."""
        req = Request(ops)

        def run() -> None:
            t = self.team
            issued: list[Op] = []
            try:
                self._check_usable()
                t.ensure_thread()
                for op in req.ops:
                    if op.state == OpState.CANCELLED:
                        continue
                    op.state = OpState.RUNNING
                    try:
                        r = self._remote(op.remote)
                        self._check_range(r, op.offset, op.nbytes)
                        if op.nbytes:
                            sym = t.ffi.cast("void *", r.sym + op.offset)
                            if op.kind == OpKind.GET:
                                func = "aclshmem_getmem_nbi"
                                t.lib.aclshmem_getmem_nbi(self._local(op.local, func), sym, op.nbytes, r.pe)
                            else:
                                func = "aclshmem_putmem_nbi"
                                t.lib.aclshmem_putmem_nbi(sym, self._local(op.local, func), op.nbytes, r.pe)
                            t.check(func)
                        issued.append(op)
                    except BaseException as exc:
                        op.error, op.state = exc, OpState.FAILED
                t.complete(t.ffi.NULL)
                for op in issued:
                    op.state = OpState.DONE
            except BaseException as exc:
                for op in req.ops:
                    if not op.state.final:
                        op.error, op.state = exc, OpState.FAILED
            finally:
                req.finish()

        threading.Thread(target=run, daemon=True, name="memsem-mte-submit").start()
        return req

    def fence(self) -> None:
        """Orders earlier puts before later ones: implemented as :meth:`quiet` (stronger)."""
        self.quiet()

    def quiet(self) -> None:
        """Complete everything posted by this engine and on the library's default stream."""
        self._check_usable()
        self.team.ensure_thread()
        self.team.complete(self._stream)
        self.team.complete(self.team.ffi.NULL)

    # -- tile-ready signals ------------------------------------------------------------------
    def can_signal(self, remote: RemoteRegion) -> bool:
        """Whether the window has SHMEM signal words (one per tile)."""
        return self._remote(remote).n_sig > 0

    def put_signal(self, remote: RemoteRegion, offset: int, src: np.ndarray, tile: int, generation: int) -> None:
        """``aclshmemx_putmem_signal``: write ``src`` at ``offset``, then SET tile ``tile``'s signal
        word of the window to ``signal_value(generation)`` (an int32); the target sees the
        signal only after the data. Returns at remote completion.

        Raises:
            NotSupportedError: the window has no signal words. ValueError: bad range or tile.
            EngineError: the library refused (named).
        """
        self._check_usable()
        r = self._remote(remote)
        if r.n_sig <= 0:
            raise NotSupportedError("mte: this window has no SHMEM signal words (published without "
                                    "tiles, or the team's signal slots were used up)")
        if not isinstance(tile, (int, np.integer)) or not 0 <= tile < r.n_sig:
            raise ValueError(f"tile must be an int in [0, {r.n_sig}), got {tile!r}")
        value = signal_value(generation)
        self._check_range(r, offset, src.nbytes)
        t = self.team
        t.ensure_thread()
        func = "aclshmemx_putmem_signal"
        dst = t.ffi.cast("void *", r.sym + offset)
        t.lib.aclshmemx_putmem_signal(dst, self._local(src, func) if src.nbytes else dst, src.nbytes,
                                      t.ffi.cast("void *", t.slot_address(r.sig_slot + int(tile))),
                                      int(value), t.lib.ACLSHMEM_SIGNAL_SET, r.pe)
        t.check(func)
        t.complete(t.ffi.NULL)  # putmem_signal runs on the library's default stream

    def wait_signal(self, descriptor: Descriptor, tile: int, generation: int, timeout: float) -> None:
        """Owner side: block until tile ``tile``'s signal word of this PE's window
        ``descriptor`` says ready for ``generation`` (``aclshmem_signal_wait_until``, CMP_EQ
        ``signal_value(generation)``).

        Bounded: the emulator through its wait bound; on libshmem.so (whose wait has no bound)
        the wait runs on a helper thread and MemsemTimeoutError is raised after ``timeout`` s
        while that native wait continues in the background.

        Raises:
            MemsemTimeoutError: not signalled in time. ValueError: not this PE's window, bad tile.
            NotSupportedError: the window has no signal words.
        """
        self._check_descriptor(descriptor)
        self._check_usable()
        t = self.team
        d = descriptor
        team, pe = d.field("team", str), d.field("pe", int)
        if team != t.team_id or pe != t.my_pe:
            raise ValueError("wait_signal waits on this PE's own windows only "
                             f"(descriptor is PE {pe} of {team!r})")
        n, slot = d.field("n_sig", int, 0), d.field("sig_slot", int, -1)
        if n <= 0:
            raise NotSupportedError("mte: this window has no SHMEM signal words")
        tile = _args.index(tile, "tile", n, of="this window's signal words")
        timeout = _args.timeout(timeout)
        value = signal_value(generation)
        word = t.ffi.cast("int32_t *", t.slot_address(slot + int(tile)))
        what = f"SHMEM signal of tile {tile} (heap offset {d.field('offset', int)})"
        if t.test_double:
            t.lib.aclshmemx_emu_set_wait_timeout_ms(max(1, int(timeout * 1000)))
            t.lib.aclshmem_signal_wait_until(word, t.lib.ACLSHMEM_CMP_EQ, int(value))
            code, msg = t.emu_error()
            if code == t.lib.ACLSHMEM_TIMEOUT_ERROR:
                raise MemsemTimeoutError(f"{what} not {value} after {timeout} s", what=what, timeout=timeout)
            if code:
                raise EngineError(msg, code=code, name="aclshmem_signal_wait_until")
            return
        done = threading.Event()

        def wait() -> None:
            t.ensure_thread()
            t.lib.aclshmem_signal_wait_until(word, t.lib.ACLSHMEM_CMP_EQ, int(value))
            done.set()

        threading.Thread(target=wait, daemon=True, name="memsem-mte-signal-wait").start()
        if not done.wait(timeout):
            raise MemsemTimeoutError(f"{what} not {value} after {timeout} s (the native wait "
                                     "continues in the background)", what=what, timeout=timeout)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Release the engine's stream (NPU). The team stays up: ``ShmemTeam.close()``."""
        if self._closed:
            return
        self._closed = True
        t = self.team
        if t.acl is not None and not t.closed:
            try:
                t.acl.check(t.acl.lib.aclrtDestroyStream(self._stream), "aclrtDestroyStream")
            except MemsemError as exc:
                log.warning("mte: %s", exc)
        with self._lock:
            regs = list(self._regs.values())
            self._regs.clear()
        for alloc, slot, n in regs:
            if alloc is not None:
                with t._lock:
                    alloc.registrations = max(0, alloc.registrations - 1)
            if slot >= 0 and not t.closed:
                t.release_slots(slot, n)


__all__ = ["MteEngine"]
