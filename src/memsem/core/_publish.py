"""The owner side: publish, republish, retire, unpublish, alloc, lookup.

A window's owner is the runtime that published it. Retiring a window (unpublish, republish,
close) runs one protocol:

1. state CLOSING: no new leases;
2. wait for unexpired leases of live holders (``LeaseHeldError`` naming them after the
   timeout; the window stays LIVE) - dead holders' leases are reaped;
3. bump the generation: every outstanding ref is stale, copies starting now fail;
4. drain in-flight copies: wait until every live participant's in-flight slot reads 0 (slots of
   dead participants are reclaimed, so no death at any instant can wedge the window). A live
   participant that outlasts the timeout gives ``MemsemTimeoutError`` naming it; the window
   stays CLOSING at its new generation and a retry resumes here;
5. DEAD, deregister from every engine, remove the directory record, release the memory's owner
   object and the control block (unmapped when its last holder lets go).

Write sections (versions within one generation) live in ``_sections``; this module holds the
owner's windows (``Owned``) they write.

One module, over 600 lines, because it is one protocol: publish and the retire protocol share the
owner's index of windows under one lock; write sections, names and serving already have modules
of their own (_sections, _names, _serve).
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import os
import secrets
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import _args, _dtypes, native
from memsem._buffers import BufferInfo, address_view, buffer_info, dtype_code
from memsem._errors import (
    AccessDeniedError,
    LeaseHeldError,
    MemsemError,
    MemsemTimeoutError,
    NameHeldError,
    WindowNotFoundError,
)
from memsem.engines import ControlWords, Descriptor, Engine, LocalRegion
from memsem.gva import (
    PERM_READ,
    PERM_WRITE,
    ControlBlock,
    Mint,
    RefSpec,
    SliceAllocator,
    WindowInfo,
    WindowState,
    inflight_slots,
    key_digest,
    lease_slots as _lease,
    mint_mac,
)
from memsem.gva._control_block import (
    FIRST_VERSION,
    HEADER_WORDS,
    W_LATEST,
    W_NBYTES,
    W_PERMS,
    W_SEQ0,
    W_STATE,
    W_WRITER,
)
from memsem.native import Segment
from memsem.core import _translate as tr
from memsem.core._sections import CommitWatch, CommittedSlots, WriteSection, format_left, open_sections
from memsem.core._wait import Wait

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore

log = logging.getLogger(__name__)

#: page size: double-buffered slots start on page boundaries (mprotect of a write guard)
PAGE = os.sysconf("SC_PAGE_SIZE")
#: ``Owned.section_thread`` while a retire holds the section lock (no thread ident is negative)
RETIRE_HOLDS = -1

#: write guards: None (off), "protect" (mprotect between sections), "checksum" (crc32)
WRITE_GUARDS = (None, "protect", "checksum")


def _default_guard() -> str | None:
    """``MEMSEM_WRITE_GUARD`` (``protect``, ``checksum``, or empty/``0``/``off``: none)."""
    raw = os.environ.get("MEMSEM_WRITE_GUARD", "").strip().lower()
    if raw in ("", "0", "off", "none"):
        return None
    if raw not in ("protect", "checksum"):
        raise ValueError(f"MEMSEM_WRITE_GUARD must be 'protect', 'checksum' or empty, got {raw!r}")
    return raw


@dataclasses.dataclass
class Owned:
    """Owner-side state of one window.

    Attributes:
        info: the directory record. cb: the control block (created by this runtime).
        key: the 128-bit access key. keepalive: the published object (its memory).
        region: what was registered. regs: ``(engine, descriptor)`` of every registration.
        generation: the live generation. retiring: the generation was bumped by a retire that
            has not finished (a retry resumes draining). mint: the whole-window mint of the
            refs this owner hands out (see ``memsem.gva.RefSpec``).
    """

    info: WindowInfo
    cb: ControlBlock
    #: never in repr (a capability; logs and tracebacks must not show it)
    key: bytes = dataclasses.field(repr=False)
    keepalive: Any = dataclasses.field(repr=False)
    region: LocalRegion
    regs: list[tuple[Engine, Descriptor]]
    generation: int
    retiring: bool = False
    mint: Mint | None = dataclasses.field(default=None, repr=False)
    #: data slots (1: in place; 2: double-buffered versions in memory memsem allocated)
    n_slots: int = 1
    #: bytes from one slot to the next (0 with one slot)
    stride: int = 0
    #: the double-buffered windows' segment (memsem's own memory), unlinked at retire
    slots_segment: Segment | None = None
    #: write guard: None, "protect" or "checksum"
    guard: str | None = None
    #: crc32 of each slot's committed bytes (guard "checksum"), by slot
    sums: dict = dataclasses.field(default_factory=dict)
    #: held while a write section is open on the window (one writer at a time), and by a retire
    #: (which waits for an open section to close before it releases the window's memory)
    section_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    #: ``threading.get_ident()`` of the thread whose write section is open (0: none;
    #: ``RETIRE_HOLDS``: a retire holds the section lock)
    section_thread: int = 0
    #: the last section's body raised: its slot's sequence word is left odd
    aborted: bool = False
    #: telemetry: sections committed and seconds writers waited for pinned leases
    sections: int = 0
    blocked_s: float = 0.0
    #: what watches its commits (``CommitWatch``: a state dict's delta history), told at retire
    watchers: list = dataclasses.field(default_factory=list)
    #: its record is in the directory (False: ``publish(listed=False)``, the record travels with
    #: its refs instead: no directory call at publish or retire, no leases of other nodes)
    listed: bool = True

    @property
    def label(self) -> str:
        i = self.info
        return f"window {i.name!r} (gva {i.gva:#x})" if i.name else f"window gva {i.gva:#x}"

    def spec(self) -> RefSpec:
        i = self.info
        return RefSpec(i.gva, self.generation, self.key, i.access, 0, i.nbytes, i.dtype_code, i.shape,
                       i.byte_offset, i.framework, i.name, self.mint)

    def slot_address(self, slot: int) -> int:
        """Address here of data slot ``slot``'s first byte."""
        return self.region.address + slot * self.stride

    def slot_array(self, slot: int) -> np.ndarray:
        """The window's bytes in data slot ``slot`` as an array of its dtype and shape (over the
        memory itself: writing it changes the slot)."""
        i = self.info
        raw = address_view(self.slot_address(slot), i.nbytes, self.keepalive)
        return raw.view(_dtypes.numpy_dtype(i.dtype_code)).reshape(i.shape)

    def _guard_span(self) -> int:
        return -(-max(self.info.nbytes, 1) // PAGE) * PAGE

    def protect(self, slot: int, writable: bool) -> None:
        if self.guard == "protect" and self.info.nbytes:
            native.protect(self.slot_address(slot), self._guard_span(), writable)

    def checksum(self, slot: int) -> int:
        return zlib.crc32(address_view(self.slot_address(slot), self.info.nbytes, self.keepalive))


#: retired windows a runtime remembers (``Publisher.retired``)
RETIRED_KEPT = 4096


class Publisher:
    """The windows one runtime owns, and the memory it allocated for them."""

    def __init__(self, core: "RuntimeCore") -> None:
        self._core = core
        self.owned: dict[int, Owned] = {}
        self.names: dict[str, int] = {}
        #: (gva, generation) of windows this runtime retired, newest last (at most
        #: ``RETIRED_KEPT``): a stale ref of one is told it was unpublished here
        self.retired: dict[tuple[int, int], None] = {}
        #: shared segments from ``alloc``, by address (publish finds whether memory is shared),
        #: and their addresses in order (``segment_of`` bisects: O(log n) with 10,000 segments)
        self.segments: dict[int, Segment] = {}
        self._bases: list[int] = []
        self.lock = threading.RLock()
        self._gva = SliceAllocator(core.rank)
        #: the secret this owner's mints are MACed with (never leaves this process)
        self.mint_secret = secrets.token_bytes(32)

    # -- memory -----------------------------------------------------------------------------------
    def alloc(self, shape: int | Sequence[int], dtype: Any = np.float32, *, engine: str | None = None) -> np.ndarray:
        """See ``memsem.Runtime.alloc``."""
        core = self._core
        core.check_open()
        if engine is not None:
            return core.engine(engine).alloc_array(shape, dtype)
        dt = _dtypes.numpy_dtype(dtype_code(dtype, "dtype", of_buffer=False))
        shape_t = _args.shape(shape, "shape", itemsize=dt.itemsize)
        nbytes = math.prod(shape_t) * dt.itemsize
        if nbytes == 0:
            return np.zeros(shape_t, dt)  # nothing to share; publishable all the same
        seg = Segment.create("data", nbytes)
        with self.lock:
            self.segments[seg.address] = seg
            bisect.insort(self._bases, seg.address)
        # The export holds the mapping for as long as any array derived from it lives; when the
        # last goes, the name is unlinked and this runtime's claim dropped.
        raw = seg.export(0, nbytes)
        holder = raw.base
        weakref.finalize(holder, _drop_segment, weakref.ref(self), seg.address, seg)
        return raw.view(dt).reshape(shape_t)

    def segment_of(self, address: int, nbytes: int) -> Segment | None:
        """The ``alloc`` segment holding ``[address, address + nbytes)``, or None."""
        with self.lock:
            i = bisect.bisect_right(self._bases, address) - 1
            if i < 0:
                return None
            seg = self.segments[self._bases[i]]
            return seg if address + nbytes <= seg.address + seg.nbytes else None

    def forget_base(self, address: int) -> None:
        """(Under ``lock``) drop an ``alloc`` segment's address from the index."""
        i = bisect.bisect_left(self._bases, address)
        if i < len(self._bases) and self._bases[i] == address:
            del self._bases[i]

    # -- publish ----------------------------------------------------------------------------------
    def publish(self, obj: Any, *, name: str | None = None, access: str | None = None,
                tile_bytes: int | None = None, tiles: int | None = None, slots: int = 1,
                write_guard: str | None = None, replace: bool = False, listed: bool = True) -> RefSpec:
        """Publish ``obj`` as a window (see ``memsem.Runtime.publish``): in place with
        ``slots=1``; with ``slots=2`` its bytes are copied into version 1 of a double-buffered
        window memsem allocates (the owner changes it through write sections only). A name is
        claimed (``_names``) before anything is created.

        ``listed=False``: the window's record is not written to the directory (nor removed at
        retire): a consumer resolves it from the record its owner hands out with the ref
        (``record``; ``Resolver.carry``), with no directory call on either side. Such a window
        has no name and no leases of other nodes (the directory holds those); its generation is
        checked as any window's (its control block on this node, its owner on another)."""
        core = self._core
        core.check_open()
        if not isinstance(listed, bool):
            raise TypeError(f"listed must be True or False, got {listed!r}")
        if name is not None:
            if not listed:
                raise ValueError(f"a named window is listed in the directory: name={name!r} with listed=False")
            name = _args.window_name(name, "name")
        if not isinstance(replace, bool):
            raise TypeError(f"replace must be True or False, got {replace!r}")
        if isinstance(slots, bool) or slots not in (1, 2):
            raise ValueError(f"slots must be 1 (in place) or 2 (double-buffered versions), got {slots!r}")
        if write_guard not in WRITE_GUARDS:
            raise ValueError(f"write_guard must be None, 'protect' or 'checksum', got {write_guard!r}")
        info = buffer_info(obj, "obj")
        if info.nbytes == 0 and not info.address:
            # An empty tensor may have no memory at all (torch.empty(0).data_ptr() == 0): the
            # window gets a byte of its own, so every route maps something (it moves 0 bytes).
            spare = np.zeros(1, np.uint8)
            info = dataclasses.replace(info, address=spare.ctypes.data, keepalive=(info.keepalive, spare))
        if access is None:
            access = "r" if (info.readonly or slots == 2) else "rw"
        if access not in ("r", "rw"):
            raise ValueError(f"access must be 'r' or 'rw', got {access!r}")
        if access == "rw" and info.readonly:
            raise AccessDeniedError(f"obj is read-only ({type(obj).__name__}); it can only be published access='r'")
        if access == "rw" and slots == 2:
            raise ValueError("a double-buffered window (slots=2) is published access='r': only its owner "
                             "changes it, inside write sections")
        n_ready, tb = tiling(info.nbytes, tile_bytes, tiles)
        if name is not None and replace:  # a republish retires the old window: its sections first
            with self.lock:
                old = self.owned.get(self.names.get(name, -1))
            if old is not None:
                self._await_sections(old, core.timeout)
        with self.lock:
            if name is not None and name in self.names:
                old = self.owned.get(self.names[name])
                if old is not None and core.names.holds(name, old.info.gva):
                    if not replace:
                        core.telemetry.count_error("name_held")
                        raise NameHeldError(
                            f"name {name!r} is held by this runtime (window gva {old.info.gva:#x}, generation "
                            f"{old.info.generation}); a name has one owner, this runtime included: pass "
                            "replace=True to republish it (the old window is retired, its refs become stale), "
                            "or unpublish it first",
                            name=name, holder=dict(core.names.holder, gva=hex(old.info.gva)))
                    return self._republish(old, info, access, n_ready, tb, slots, write_guard)
                # another publisher took the name over (replace=True): our window keeps its refs,
                # the name is claimed anew (refused while that publisher lives, unless replace)
                self.names.pop(name)
            gva = self._gva.allocate(info.nbytes)
            return self._publish_at(gva, name or "", info, access, n_ready, tb, cb=None, slots=slots,
                                    write_guard=write_guard, replace=replace, listed=listed)

    def _publish_at(self, gva: int, name: str, info: BufferInfo, access: str, n_ready: int,
                    tile_bytes: int, cb: ControlBlock | None, slots: int = 1,
                    write_guard: str | None = None, replace: bool = False, listed: bool = True) -> RefSpec:
        core = self._core
        if name:
            core.names.claim(name, gva, replace=replace)  # NameHeldError before anything exists
        try:
            return self._create(gva, name, info, access, n_ready, tile_bytes, cb, slots, write_guard, listed)
        except BaseException:
            if name:
                try:
                    core.names.release(name, gva)
                except Exception:  # noqa: BLE001 - the publish's own error is the one to raise
                    log.warning("releasing the name %r after a failed publish failed", name, exc_info=True)
            raise

    def _create(self, gva: int, name: str, info: BufferInfo, access: str, n_ready: int, tile_bytes: int,
                cb: ControlBlock | None, slots: int, write_guard: str | None, listed: bool = True) -> RefSpec:
        core = self._core
        me = core.identity
        perms = PERM_READ | (PERM_WRITE if access == "rw" else 0)
        slots_seg = None
        stride = 0
        if slots == 2:
            # memsem's own memory: two page-aligned slots, version 1 (slot 1) = obj's bytes
            stride = -(-max(info.nbytes, 1) // PAGE) * PAGE
            slots_seg = Segment.create("data", 2 * stride)
            if info.nbytes:
                native.memcpy(slots_seg.address + stride, info.address, info.nbytes)
            keep = slots_seg.export(0, 2 * stride)
            region = LocalRegion(slots_seg.address, 2 * stride, False, segment=slots_seg.name,
                                 segment_offset=0, keepalive=keep)
            seg = slots_seg
        else:
            seg = self.segment_of(info.address, info.nbytes)
            region = LocalRegion(info.address, info.nbytes, access == "rw",
                                 segment=seg.name if seg is not None else None,
                                 segment_offset=info.address - seg.address if seg is not None else 0,
                                 keepalive=info.keepalive)
        guard = write_guard
        if guard is None:
            guard = _default_guard()
            if guard == "protect" and not _protectable(slots, seg, info):
                guard = "checksum"  # the environment asks for a guard: the one this memory allows
        elif guard == "protect" and not _protectable(slots, seg, info):
            if slots_seg is not None:
                slots_seg.unlink()
                slots_seg.close()
            raise ValueError("write_guard='protect' needs page-aligned memory memsem allocated: publish "
                             "with slots=2, or publish a whole array from Runtime.alloc(); "
                             "write_guard='checksum' works for any memory")
        if cb is None:
            try:
                cb = ControlBlock.create(owner_pid=me.pid, owner_start=me.start_time, nbytes=info.nbytes,
                                         perms=perms, n_ready=n_ready, tile_bytes=tile_bytes,
                                         n_slots=slots, slot_stride=stride)
            except BaseException:
                if slots_seg is not None:
                    slots_seg.unlink()
                    slots_seg.close()
                raise
        else:
            cb.set_word(W_NBYTES, info.nbytes)
            cb.set_word(W_PERMS, perms)
            cb.set_word(W_WRITER, 0)
            cb.set_word(W_LATEST, FIRST_VERSION)
            cb.set_word(W_SEQ0, FIRST_VERSION << 1)
        gen = cb.generation
        regs: list[tuple[Engine, Descriptor]] = []
        try:
            for ename, eng in core.engines.items():
                desc = eng.register(region)
                if desc is None:
                    continue  # this engine cannot reach such memory: no route through it
                regs.append((eng, desc))
                core.telemetry.registrations[ename] += 1
            words = control_words(cb)
            for eng, desc in regs:
                eng.on_publish(desc, n_ready, gva, words)
        except BaseException:
            for eng, d in regs:
                eng.deregister(d)
            cb.segment.unlink()
            cb.close()
            if slots_seg is not None:
                slots_seg.unlink()
                slots_seg.close()
            raise
        key = secrets.token_bytes(16)
        mint = Mint(0, info.nbytes, access, mint_mac(self.mint_secret, gva, gen, 0, info.nbytes, access))
        winfo = WindowInfo(gva=gva, nbytes=info.nbytes, name=name, generation=gen, access=access,
                           key_digest=key_digest(key), rank=core.rank, owner_pid=me.pid,
                           owner_start=me.start_time, node=me.node, control=cb.segment.name,
                           n_ready=cb.n_ready, tile_bytes=tile_bytes,
                           descriptors={e.name: d for e, d in regs},
                           dtype_code=info.dtype_code, shape=info.shape, byte_offset=info.byte_offset,
                           framework=info.framework,
                           extra=({"slots": slots, "slot_stride": stride} if slots > 1 else {})
                           | ({} if listed else {"listed": False}))
        owned = Owned(winfo, cb, key, region.keepalive, region, regs, gen, n_slots=slots, stride=stride,
                      slots_segment=slots_seg, guard=guard, mint=mint, listed=listed)
        first = cb.slot_of(FIRST_VERSION)
        if guard == "checksum":
            owned.sums[first] = owned.checksum(first)
        for sl in range(slots):
            owned.protect(sl, False)
        cb.set_word(W_STATE, WindowState.LIVE)
        self.owned[gva] = owned
        if name:
            self.names[name] = gva
        # A named window's key goes to the directory for the job's members (sealed with the
        # job secret where there is one; docs/threat-model.md): they look it up by name. With it,
        # the MAC of the whole-window mint, so a ref looked up works on owner-checked routes.
        # (the name's record, claimed before, already points here)
        if listed:
            core.directory.put_window(gva, "", winfo.to_json(), key=key + mint.mac if name else None)
        return owned.spec()

    def _republish(self, old: Owned, info: BufferInfo, access: str, n_ready: int, tile_bytes: int,
                   slots: int = 1, write_guard: str | None = None) -> RefSpec:
        self.retire(old, timeout=self._core.timeout, keep_name=True)
        reuse = old.cb if (old.cb.n_ready == n_ready and not old.cb.closed and slots == 1
                           and old.n_slots == 1) else None
        span_ok = info.nbytes <= max(old.info.nbytes, 1)
        if reuse is not None and not span_ok:
            reuse = None
        if reuse is None:
            self._release_cb(old.cb)
        gva = old.info.gva if span_ok else self._gva.allocate(info.nbytes)
        return self._publish_at(gva, old.info.name, info, access, n_ready, tile_bytes, cb=reuse, slots=slots,
                                write_guard=write_guard)

    # -- write sections (memsem.core._sections) ----------------------------------------------
    def open_section(self, specs_or_names: Sequence[RefSpec | str], *, copy: bool = True,
                     timeout: float | None = None, counted: bool = True) -> WriteSection:
        """Open a write section on one or more windows this runtime owns (see
        :class:`memsem.core._sections.WriteSection`). Blocking: waits up to ``timeout`` s
        (default the runtime's) for leases pinning versions the section overwrites.

        Raises:
            LeaseHeldError: a pinned lease outlasted ``timeout`` (nothing was opened).
            OwnerWriteError: the checksum guard found the latest version's bytes changed.
            MemsemError: a section is already open on one of the windows.
            WindowNotFoundError / StaleReferenceError: not a window this runtime owns.
        """
        core = self._core
        core.check_open()
        if not isinstance(copy, bool):
            raise TypeError(f"copy must be True or False, got {copy!r}")
        t = _args.timeout_or(timeout, core.timeout)
        owned = []
        seen = set()
        for i, x in enumerate(specs_or_names):
            if not isinstance(x, (RefSpec, str)):
                raise TypeError(f"windows[{i}] must be a ref or a window name, got {type(x).__name__}")
            o = self.owned_for(x)
            if o.info.gva in seen:
                raise ValueError(f"windows[{i}]: {o.label} appears twice")
            seen.add(o.info.gva)
            owned.append(o)
        return open_sections(owned, copy=copy, timeout=t, telemetry=core.telemetry, counted=counted)

    def write_section(self, spec_or_name: RefSpec | str | Sequence[RefSpec | str], *, copy: bool = True,
                      timeout: float | None = None, counted: bool = True) -> WriteSection:
        """A :class:`WriteSection` (context manager) on one window or a set of windows."""
        if isinstance(spec_or_name, (RefSpec, str)):
            return self.open_section([spec_or_name], copy=copy, timeout=timeout, counted=counted)
        return self.open_section(list(spec_or_name), copy=copy, timeout=timeout, counted=counted)

    # -- retire ---------------------------------------------------------------------------------
    def retire(self, owned: Owned, *, timeout: float, keep_name: bool = False, force: bool = False) -> None:
        """Run the retire protocol (module docstring). Raises LeaseHeldError (window left LIVE)
        or MemsemTimeoutError (left CLOSING, retry resumes) unless ``force``.

        A write section open on the window is waited for first (within the same deadline): the
        retire never releases memory a section is writing (it was a SIGSEGV in the section's
        commit when another thread unpublished under it). A section open by the calling thread
        itself cannot close while it waits: MemsemError at once (``force``: the retire goes on
        and the section's commit raises WindowRetiredError; the section keeps the memory mapped
        until it closes)."""
        core = self._core
        label = owned.label
        # one deadline for the three waits: an open section, the leases, the copies in flight
        wait = Wait(f"the retire of {label}", timeout, telemetry=core.telemetry)
        locked = self._hold_sections(owned, wait, force=force)
        try:
            self._retire(owned, wait, timeout=timeout, keep_name=keep_name, force=force)
        finally:
            if locked:
                owned.section_thread = 0
                owned.section_lock.release()

    def _hold_sections(self, owned: Owned, wait: Wait, *, force: bool) -> bool:
        """Take the window's section lock for a retire (no section opens or stays open under it).
        True when taken; False only under ``force`` when a section stayed open."""
        lock = owned.section_lock
        if lock.acquire(blocking=False):
            owned.section_thread = RETIRE_HOLDS
            return True
        if owned.section_thread == threading.get_ident():
            if force:
                return False
            raise self._own_section_error(owned)
        if lock.acquire(timeout=wait.left()):
            owned.section_thread = RETIRE_HOLDS
            return True
        if force:
            warnings.warn(f"{owned.label} closed with a write section open in another thread "
                          f"({owned.section_thread}): its commit will raise", ResourceWarning, stacklevel=4)
            return False
        raise self._section_timeout(owned, wait.timeout)

    def _retire(self, owned: Owned, wait: Wait, *, timeout: float, keep_name: bool, force: bool) -> None:
        core = self._core
        cb = owned.cb
        label = owned.label
        d = core.directory
        if not owned.retiring:
            cb.set_word(W_STATE, WindowState.CLOSING)
            holders = self._wait_unleased(owned, wait, closing=True)
            if holders:
                if force:
                    warnings.warn(f"{label} closed with leases held by {holders}", ResourceWarning, stacklevel=3)
                else:
                    cb.set_word(W_STATE, WindowState.LIVE)
                    if d.holds_leases and owned.listed:
                        d.reopen_window(owned.info.gva)
                    raise LeaseHeldError(
                        f"cannot unpublish {label}: {len(holders)} unexpired lease(s) after {timeout} s, "
                        "held by " + ", ".join(f"pid {p} ({format_left(left)})" for p, left in holders),
                        holders=holders)
            watchers, owned.watchers = owned.watchers, []
            for w in watchers:  # they stop reading the slots and control words now
                try:
                    w.retiring()
                except Exception:  # noqa: BLE001 - the retire goes on
                    log.exception("%s: a commit watcher failed at retire", label)
            self.retired[(owned.info.gva, owned.generation)] = None  # the generation its refs hold
            if len(self.retired) > RETIRED_KEPT:
                del self.retired[next(iter(self.retired))]
            owned.generation = cb.bump_generation()
            owned.retiring = True
            native.futex_wake(cb.latest_addr)  # version waiters see the generation move now
        # Drain copies that started under the old generation (they will see it moved, and the
        # native copy wakes us as it leaves). Dead participants' marks are reclaimed.
        while True:
            busy = inflight_slots.busy_counts(cb)
            if not busy:
                break
            if wait.expired:
                if force:
                    warnings.warn(f"{label} closed with copies in flight by {busy}", ResourceWarning,
                                  stacklevel=3)
                    break
                raise MemsemTimeoutError(
                    f"{label}: copies in flight by live processes did not drain in {timeout} s: "
                    + ", ".join(f"pid {p} ({n} copies)" for p, n, _ in busy)
                    + "; the window is retired (its refs are stale); retry to finish",
                    what=f"in-flight copies on {label}", timeout=timeout)
            _pid, n, a = busy[0]
            wait.nap(lambda sl, a=a, n=n: native.futex_wait(a, n & 0xFFFFFFFF, sl))
        cb.set_word(W_STATE, WindowState.DEAD)
        if owned.guard == "protect":
            for sl in range(owned.n_slots):
                try:
                    owned.protect(sl, True)  # the memory may outlive the window (alloc'd arrays)
                except MemsemError:
                    pass
        for eng, desc in owned.regs:
            try:
                eng.deregister(desc)
            except MemsemError as exc:
                log.warning("deregistering %s from engine %s failed: %s", label, eng.name, exc)
        gva = owned.info.gva
        self.owned.pop(gva, None)
        if owned.info.name and not keep_name:
            self.names.pop(owned.info.name, None)
        try:
            if owned.listed:
                dwait = Wait(f"the removal of {label}'s records from {d.url}", core.timeout, telemetry=core.telemetry)
                d.remove_window(gva, "" if keep_name else owned.info.name, pause=dwait.pause)
        except (MemsemError, OSError, ValueError) as exc:  # the retire goes on: the records are gc's
            log.warning("removing %s from the directory failed: %s", label, exc)
        core.resolver.drop(gva)
        core.server.evict(gva)
        owned.keepalive = None
        if owned.slots_segment is not None:
            owned.slots_segment.unlink()
            owned.slots_segment.close()  # unmapped when the last export/holder lets go
            owned.slots_segment = None

    def _wait_unleased(self, owned: Owned, wait: Wait, *, closing: bool = False) -> list[tuple[int, float]]:
        """Wait (within ``wait``'s deadline) until no live process holds an unexpired lease on
        ``owned``'s window: asleep on the id word of the lease ending first (its release wakes
        us; its expiry bounds the sleep), or for leases held in another node's directory a
        plain slice (no word here). Returns the holders left at the deadline (empty: none)."""
        cb, d = owned.cb, self._core.directory
        while True:
            leases = _lease.blocking_leases(cb)
            holders = [(pid, left) for pid, left, _ in leases]
            if d.holds_leases and owned.listed:  # leases of other nodes (closing: no new ones)
                holders += d.lease_holders(owned.info.gva, closing=closing)
            if not holders:
                return []
            if leases:
                _pid, left, a = min(leases, key=lambda h: h[1])
                v = native.load_acquire(a)
                slept = wait.nap(lambda sl: native.futex_wait(a, v & 0xFFFFFFFF, min(sl, left + 1e-3)) if v else None)
            else:
                slept = wait.nap(time.sleep)
            if not slept:
                return holders

    def wait_unleased(self, spec: RefSpec, timeout: float) -> list[tuple[int, float]]:
        """Owner: wait up to ``timeout`` s until no live process holds an unexpired lease on
        ``spec``'s window (without closing it to new leases). Returns ``(pid, seconds left)``
        of the leases still held at the deadline (empty: none)."""
        owned = self.owned_for(spec)
        return self._wait_unleased(owned, Wait(f"the leases on {owned.label}", timeout,
                                               telemetry=self._core.telemetry))

    def _release_cb(self, cb: ControlBlock) -> None:
        try:
            cb.segment.unlink()
        finally:
            cb.close()  # unmapped when the last holder (a lease, a resolution) lets go

    def unpublish(self, spec_or_name: RefSpec | str, *, timeout: float | None = None) -> None:
        """See ``memsem.Runtime.unpublish``."""
        core = self._core
        core.check_open()
        t = _args.timeout_or(timeout, core.timeout)
        with self.lock:
            owned = self.owned_for(spec_or_name, allow_retiring=True)
        t = self._await_sections(owned, t)
        with self.lock:
            owned = self.owned_for(spec_or_name, allow_retiring=True)
            self.retire(owned, timeout=t)
            self._release_cb(owned.cb)

    def _await_sections(self, owned: Owned, timeout: float) -> float:
        """Before a retire takes the publisher's lock: wait up to ``timeout`` s until no write
        section is open on ``owned`` in another thread (a section's body may need that lock: a
        retire holding it while it waits would wait for nothing). Returns the seconds left of
        ``timeout`` (a section opened since is the retire's to wait for, within them).

        Raises:
            MemsemError: the section is open in the calling thread (it could never close).
            MemsemTimeoutError: it stayed open in another thread for ``timeout`` s (the window
                stays live).
        """
        if owned.section_thread == threading.get_ident():
            raise self._own_section_error(owned)
        t0 = time.monotonic()
        lock = owned.section_lock
        if not lock.acquire(timeout=timeout):
            raise self._section_timeout(owned, timeout)
        lock.release()
        return max(0.0, timeout - (time.monotonic() - t0))

    @staticmethod
    def _own_section_error(owned: Owned) -> MemsemError:
        return MemsemError(
            f"cannot retire {owned.label} inside a write section open on it in this thread: "
            "commit or abort the section first (leave its with block), then unpublish")

    def _section_timeout(self, owned: Owned, timeout: float) -> MemsemTimeoutError:
        self._core.telemetry.count_error("timeout")
        return MemsemTimeoutError(
            f"cannot retire {owned.label}: a write section open on it in another thread did not "
            f"close in {timeout:g} s; the window stays live",
            what=f"the open write section on {owned.label}", timeout=timeout)

    def owned_for(self, spec_or_name: RefSpec | str, *, allow_retiring: bool = False) -> Owned:
        if isinstance(spec_or_name, str):
            gva = self.names.get(spec_or_name)
            if gva is None:
                raise WindowNotFoundError(f"this runtime publishes no window named {spec_or_name!r}")
        else:
            gva = spec_or_name.gva
        owned = self.owned.get(gva)
        if owned is None:
            raise WindowNotFoundError(f"this runtime does not own window gva {gva:#x}")
        if owned.retiring and not allow_retiring:
            raise tr.stale(owned.spec(), owned.generation)
        if not isinstance(spec_or_name, str) and spec_or_name.generation != owned.generation \
                and not (allow_retiring and owned.retiring):
            raise tr.stale(spec_or_name, owned.generation)
        return owned

    def record(self, spec: RefSpec) -> dict[str, Any]:
        """The record of a live window this runtime owns, as the directory would hold it (no
        key): what a consumer of an unlisted window resolves it with (``Resolver.carry``).

        Raises:
            WindowNotFoundError / StaleReferenceError: not a live window of this runtime.
        """
        with self.lock:
            return self.owned_for(spec).info.to_json()

    def watch_commits(self, spec: RefSpec, watcher: CommitWatch) -> CommittedSlots:
        """Tell ``watcher`` every commit of ``spec``'s window (this runtime owns it) from now on,
        and its retire; returns the view of its committed slots the watcher reads.

        Raises:
            WindowNotFoundError / StaleReferenceError: not a live window of this runtime.
        """
        with self.lock:
            owned = self.owned_for(spec)
            owned.watchers.append(watcher)
        return CommittedSlots(owned)

    def lease_holders(self, spec: RefSpec) -> list[tuple[int, float]]:
        """``(pid, seconds left)`` of unexpired leases of live holders on a window this runtime
        owns (same node, and other nodes where the directory holds leases)."""
        owned = self.owned_for(spec)
        out = _lease.blocking_holders(owned.cb)
        if self._core.directory.holds_leases and owned.listed:
            out += self._core.directory.lease_holders(owned.info.gva)
        return out

    # -- close ------------------------------------------------------------------------------------
    def close(self, deadline: float) -> None:
        """Retire every window (forced: a lease or a copy of a live process cannot keep a closing
        runtime's memory; they are warned about), then release the alloc'd segments' names."""
        with self.lock:
            for owned in list(self.owned.values()):
                try:
                    self.retire(owned, timeout=max(0.0, deadline - time.monotonic()), force=True)
                except Exception as exc:  # noqa: BLE001 - close finishes whatever fails in it
                    log.warning("retiring %s at close failed: %s", owned.label, exc, exc_info=True)
                    self.owned.pop(owned.info.gva, None)
                    if owned.slots_segment is not None:
                        owned.slots_segment.unlink()
                        owned.slots_segment.close()
                        owned.slots_segment = None
                finally:
                    try:
                        self._release_cb(owned.cb)
                    except Exception:  # noqa: BLE001
                        log.warning("releasing the control block of %s failed", owned.label, exc_info=True)
            self.names.clear()
            for seg in list(self.segments.values()):
                try:
                    seg.unlink()
                except Exception:  # noqa: BLE001
                    log.warning("unlinking segment %s failed", seg.name, exc_info=True)
            self.segments.clear()
            self._bases.clear()


def control_words(cb: ControlBlock) -> ControlWords:
    """The control words of ``cb`` an engine may make remotely readable (``Engine.on_publish``):
    its header words and its ready words, never lease or in-flight slots. The regions keep the
    block's mapping alive; the runtime deregisters every engine before it releases the block."""
    header = LocalRegion(cb.base, 8 * HEADER_WORDS, False, keepalive=cb)
    ready = LocalRegion(cb.ready_addr(0), 8 * cb.n_ready, False, keepalive=cb) if cb.n_ready else None
    return ControlWords(header, ready)


def _protectable(slots: int, seg: Segment | None, info: BufferInfo) -> bool:
    """mprotect needs whole pages no one else uses: memsem's own slots, or an alloc'd segment
    published from its start."""
    if slots == 2:
        return True
    return seg is not None and info.address == seg.address and info.address % PAGE == 0


def tiling(nbytes: int, tile_bytes: int | None, tiles: int | None) -> tuple[int, int]:
    """``(ready words, tile bytes)`` from publish's tiling arguments."""
    if tile_bytes is not None and tiles is not None:
        raise ValueError(f"pass tile_bytes or tiles, not both (got tile_bytes={tile_bytes!r}, tiles={tiles!r})")
    if tile_bytes is not None:
        tb = _args.count(tile_bytes, "tile_bytes", minimum=1, unit="bytes")
        return max(1, -(-nbytes // tb)), tb
    if tiles is not None:
        n = _args.count(tiles, "tiles", minimum=1, maximum=max(nbytes, 1))
        return n, -(-nbytes // n) if nbytes else 0
    return 0, 0


def _drop_segment(pub_ref: "weakref.ref[Publisher]", address: int, seg: Segment) -> None:
    """The last array over an alloc'd segment is gone: unlink its name (creator process only)
    and drop the runtime's claim (the mapping goes with the last holder)."""
    pub = pub_ref()
    if pub is not None:
        with pub.lock:
            if pub.segments.pop(address, None) is not None:
                pub.forget_base(address)
    seg.unlink()  # a no-op in a process forked from the creator
    seg.close()
