"""The owner side: publish, republish, write sections, retire, unpublish, alloc, lookup.

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
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memsem import _args, _dtypes, native
from memsem._buffers import BufferInfo, buffer_info, dtype_code
from memsem._errors import (
    AccessDeniedError,
    LeaseHeldError,
    MemsemError,
    MemsemTimeoutError,
    NotSupportedError,
    WindowNotFoundError,
)
from memsem.engines import Descriptor, Engine, LocalRegion
from memsem.gva import (
    PERM_READ,
    PERM_WRITE,
    ControlBlock,
    Mint,
    RefSpec,
    SliceAllocator,
    WindowInfo,
    WindowState,
    inflight,
    key_digest,
    lease as _lease,
    mint_mac,
)
from memsem.gva._control import FIRST_VERSION, W_LATEST, W_NBYTES, W_PERMS, W_SEQ0, W_STATE
from memsem.native import Segment
from memsem.runtime import _translate as tr
from memsem.runtime._liveness import WAIT_SLICE_S

if TYPE_CHECKING:
    from memsem.runtime._core import RuntimeCore

log = logging.getLogger(__name__)


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
    key: bytes
    keepalive: Any
    region: LocalRegion
    regs: list[tuple[Engine, Descriptor]]
    generation: int
    retiring: bool = False
    mint: Mint | None = None

    @property
    def label(self) -> str:
        i = self.info
        return f"window {i.name!r} (gva {i.gva:#x})" if i.name else f"window gva {i.gva:#x}"

    def spec(self) -> RefSpec:
        i = self.info
        return RefSpec(i.gva, self.generation, self.key, i.access, 0, i.nbytes, i.dtype_code, i.shape,
                       i.byte_offset, i.framework, i.name, self.mint)


class Publisher:
    """The windows one runtime owns, and the memory it allocated for them."""

    def __init__(self, core: "RuntimeCore") -> None:
        self._core = core
        self.owned: dict[int, Owned] = {}
        self.names: dict[str, int] = {}
        #: shared segments from ``alloc``, by address (publish finds whether memory is shared)
        self.segments: dict[int, Segment] = {}
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
        # The export holds the mapping for as long as any array derived from it lives; when the
        # last goes, the name is unlinked and this runtime's claim dropped.
        raw = seg.export(0, nbytes)
        holder = raw.base
        weakref.finalize(holder, _drop_segment, weakref.ref(self), seg.address, seg)
        return raw.view(dt).reshape(shape_t)

    def segment_of(self, address: int, nbytes: int) -> Segment | None:
        with self.lock:
            for base, seg in self.segments.items():
                if base <= address and address + nbytes <= base + seg.nbytes:
                    return seg
        return None

    # -- publish ----------------------------------------------------------------------------------
    def publish(self, obj: Any, *, name: str | None = None, access: str | None = None,
                tile_bytes: int | None = None, tiles: int | None = None) -> RefSpec:
        """Publish ``obj`` in place as a window (see ``memsem.Runtime.publish``)."""
        core = self._core
        core.check_open()
        if name is not None and (not isinstance(name, str) or not name or len(name.encode()) > 255):
            raise ValueError(f"name must be a non-empty str of at most 255 bytes, got {name!r}")
        info = buffer_info(obj, "obj")
        if access is None:
            access = "r" if info.readonly else "rw"
        if access not in ("r", "rw"):
            raise ValueError(f"access must be 'r' or 'rw', got {access!r}")
        if access == "rw" and info.readonly:
            raise AccessDeniedError(f"obj is read-only ({type(obj).__name__}); it can only be published access='r'")
        n_ready, tb = tiling(info.nbytes, tile_bytes, tiles)
        with self.lock:
            if name is not None and name in self.names:
                old = self.owned[self.names[name]]
                return self._republish(old, info, access, n_ready, tb)
            gva = self._gva.allocate(info.nbytes)
            return self._publish_at(gva, name or "", info, access, n_ready, tb, cb=None)

    def _publish_at(self, gva: int, name: str, info: BufferInfo, access: str, n_ready: int,
                    tile_bytes: int, cb: ControlBlock | None) -> RefSpec:
        core = self._core
        me = core.identity
        perms = PERM_READ | (PERM_WRITE if access == "rw" else 0)
        seg = self.segment_of(info.address, info.nbytes)
        region = LocalRegion(info.address, info.nbytes, access == "rw",
                             segment=seg.name if seg is not None else None,
                             segment_offset=info.address - seg.address if seg is not None else 0,
                             keepalive=info.keepalive)
        if cb is None:
            cb = ControlBlock.create(owner_pid=me.pid, owner_start=me.start_time, nbytes=info.nbytes,
                                     perms=perms, n_ready=n_ready, tile_bytes=tile_bytes)
        else:
            cb.set_word(W_NBYTES, info.nbytes)
            cb.set_word(W_PERMS, perms)
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
            for eng, desc in regs:
                eng.on_publish(desc, n_ready, gva)
        except BaseException:
            for eng, d in regs:
                eng.deregister(d)
            cb.segment.unlink()
            cb.close()
            raise
        key = secrets.token_bytes(16)
        mint = Mint(0, info.nbytes, access, mint_mac(self.mint_secret, gva, gen, 0, info.nbytes, access))
        winfo = WindowInfo(gva=gva, nbytes=info.nbytes, name=name, generation=gen, access=access,
                           key_digest=key_digest(key), rank=core.rank, owner_pid=me.pid,
                           owner_start=me.start_time, node=me.node, control=cb.segment.name,
                           n_ready=cb.n_ready, tile_bytes=tile_bytes,
                           descriptors={e.name: d for e, d in regs},
                           dtype_code=info.dtype_code, shape=info.shape, byte_offset=info.byte_offset,
                           framework=info.framework)
        owned = Owned(winfo, cb, key, info.keepalive, region, regs, gen, mint=mint)
        cb.set_word(W_STATE, WindowState.LIVE)
        self.owned[gva] = owned
        if name:
            self.names[name] = gva
        d = core.directory
        # Sealed for the job secret: the access key and the whole-window mint's MAC (lookup).
        d.put_window(gva, name, winfo.to_json(), key=key + mint.mac if d.seals_keys else None)
        return owned.spec()

    def _republish(self, old: Owned, info: BufferInfo, access: str, n_ready: int, tile_bytes: int) -> RefSpec:
        self.retire(old, timeout=self._core.timeout, keep_name=True)
        reuse = old.cb if old.cb.n_ready == n_ready and not old.cb.closed else None
        span_ok = info.nbytes <= max(old.info.nbytes, 1)
        if reuse is not None and not span_ok:
            reuse = None
        if reuse is None:
            self._release_cb(old.cb)
        gva = old.info.gva if span_ok else self._gva.allocate(info.nbytes)
        return self._publish_at(gva, old.info.name, info, access, n_ready, tile_bytes, cb=reuse)

    # -- write sections ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def write_section(self, spec_or_name: RefSpec | str) -> Iterator[int]:
        """Owner: change a window's published bytes; yields the version being written.

        While open, the window's sequence word is odd: a reader's seqlock bracket sees it and
        waits (up to its timeout) or retries; no torn byte is returned as valid. Closing it
        publishes version v + 1 (release store) and wakes waiting readers. If the body raises,
        the section stays open (no version is published over half-written bytes) and readers
        keep waiting until the next section completes.
        """
        owned = self.owned_for(spec_or_name)
        cb = owned.cb
        a = cb.addr(W_SEQ0)
        seq = native.load_acquire(a)
        if seq & 1:
            raise MemsemError(f"{owned.label}: a write section is already open")
        v = (seq >> 1) + 1
        native.store_release(a, (v << 1) | 1)
        native.lib.memsem_fence_seq_cst()
        yield v
        native.store_release(a, v << 1)
        native.store_release(cb.addr(W_LATEST), v)
        native.futex_wake(a)
        native.futex_wake(cb.addr(W_LATEST))

    # -- retire -----------------------------------------------------------------------------------
    def retire(self, owned: Owned, *, timeout: float, keep_name: bool = False, force: bool = False) -> None:
        """Run the retire protocol (module docstring). Raises LeaseHeldError (window left LIVE)
        or MemsemTimeoutError (left CLOSING, retry resumes) unless ``force``."""
        core = self._core
        cb = owned.cb
        label = owned.label
        deadline = time.monotonic() + timeout
        d = core.directory
        if not owned.retiring:
            cb.set_word(W_STATE, WindowState.CLOSING)
            while True:
                holders = _lease.blocking_holders(cb)
                if d.holds_leases:  # leases of other nodes (closing: no new ones)
                    holders += d.lease_holders(owned.info.gva, closing=True)
                if not holders:
                    break
                if time.monotonic() >= deadline:
                    if force:
                        warnings.warn(f"{label} closed with leases held by {holders}", ResourceWarning,
                                      stacklevel=3)
                        break
                    cb.set_word(W_STATE, WindowState.LIVE)
                    if d.holds_leases:
                        d.reopen_window(owned.info.gva)
                    raise LeaseHeldError(
                        f"cannot unpublish {label}: {len(holders)} unexpired lease(s) after {timeout} s, "
                        "held by " + ", ".join(f"pid {p} ({_left(left)})" for p, left in holders),
                        holders=holders)
                time.sleep(min(WAIT_SLICE_S, max(0.0, min(h[1] for h in holders)) + 0.001,
                               max(0.0, deadline - time.monotonic()) + 0.001))
            owned.generation = cb.bump_generation()
            owned.retiring = True
        # Drain copies that started under the old generation (they will see it moved). Dead
        # participants' marks are reclaimed by busy_holders.
        while True:
            busy = inflight.busy_holders(cb)
            if not busy:
                break
            if time.monotonic() >= deadline:
                if force:
                    warnings.warn(f"{label} closed with copies in flight by {busy}", ResourceWarning,
                                  stacklevel=3)
                    break
                raise MemsemTimeoutError(
                    f"{label}: copies in flight by live processes did not drain in {timeout} s: "
                    + ", ".join(f"pid {p} ({n} copies)" for p, n in busy)
                    + "; the window is retired (its refs are stale); retry to finish",
                    what=f"in-flight copies on {label}", timeout=timeout)
            time.sleep(0.0005)
        cb.set_word(W_STATE, WindowState.DEAD)
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
            d.remove_window(gva, "" if keep_name else owned.info.name)
        except MemsemError as exc:
            log.warning("removing %s from the directory failed: %s", label, exc)
        core.resolver.drop(gva)
        core.server.evict(gva)
        owned.keepalive = None

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
            self.retire(owned, timeout=t)
            self._release_cb(owned.cb)

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

    def lease_holders(self, spec: RefSpec) -> list[tuple[int, float]]:
        """``(pid, seconds left)`` of unexpired leases of live holders on a window this runtime
        owns (same node, and other nodes where the directory holds leases)."""
        owned = self.owned_for(spec)
        out = _lease.blocking_holders(owned.cb)
        if self._core.directory.holds_leases:
            out += self._core.directory.lease_holders(owned.info.gva)
        return out

    def lookup(self, name: str) -> RefSpec:
        """RefSpec of the window published under ``name`` (see ``memsem.Runtime.lookup``)."""
        core = self._core
        core.check_open()
        gva = self.names.get(name)
        if gva is not None:
            return self.owned[gva].spec()
        d = core.directory
        if d.seals_keys:  # another node's window: its key is sealed for the job secret
            gva = d.lookup(name)
            rec, sealed = d.window_with_key(gva) if gva is not None else (None, None)
            if rec is not None and sealed is not None:
                i = WindowInfo.from_json(rec)
                key, mac = sealed[:16], sealed[16:]
                mint = Mint(0, i.nbytes, i.access, mac) if len(mac) == 16 else None
                return RefSpec(gva, i.generation, key, i.access, 0, i.nbytes, i.dtype_code, i.shape,
                               i.byte_offset, i.framework, name, mint)
        raise WindowNotFoundError(f"no window named {name!r} is published by this runtime; pass the "
                                  "serialized ref (to_bytes) to consumers instead")

    # -- close ------------------------------------------------------------------------------------
    def close(self, deadline: float) -> None:
        """Retire every window (forced: a lease or a copy of a live process cannot keep a closing
        runtime's memory; they are warned about), then release the alloc'd segments' names."""
        with self.lock:
            for owned in list(self.owned.values()):
                try:
                    self.retire(owned, timeout=max(0.0, deadline - time.monotonic()), force=True)
                except MemsemError as exc:
                    log.warning("retiring %s at close failed: %s", owned.label, exc)
                finally:
                    self._release_cb(owned.cb)
            for seg in list(self.segments.values()):
                seg.unlink()
            self.segments.clear()


def _left(seconds: float) -> str:
    return "held until released" if seconds == float("inf") else f"{seconds:.2f} s left"


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
            pub.segments.pop(address, None)
    seg.unlink()  # a no-op in a process forked from the creator
    seg.close()
