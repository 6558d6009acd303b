"""The runtime core: publish, resolve, lease, get/put/xcopy, route selection.

This is the one place that checks generation, lease and permission, and that turns engine
errors into memsem errors. It works on :class:`memsem.gva.RefSpec`; the user-facing
``memsem.Runtime`` (refs layer) wraps specs into TensorRefs.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextvars
import errno as _errno
import logging
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from memsem import _dtypes, native
from memsem._buffers import BufferInfo, address_view, array_address, as_byte_array, buffer_info
from memsem._errors import (
    AccessDeniedError,
    EngineError,
    LeaseExpiredError,
    LeaseHeldError,
    MemsemError,
    MemsemTimeoutError,
    NotSupportedError,
    PeerLostError,
    StaleReferenceError,
    WindowNotFoundError,
)
from memsem.directory import Directory, open_directory
from memsem.engines import Availability, Engine, LocalRegion, engine_class
from memsem.gva import (
    PERM_READ,
    PERM_WRITE,
    ControlBlock,
    RefSpec,
    SliceAllocator,
    WindowInfo,
    WindowState,
    key_digest,
    key_matches,
    lease as _lease,
    ready as _ready,
    split_gva,
)
from memsem.gva._control import W_NBYTES, W_PERMS, W_STATE
from memsem.native import ProcessIdentity, Segment, process_alive
from memsem.runtime._completion import Batch, Completion, RangeResult, State
from memsem.runtime._lease import Lease
from memsem.runtime._state import (
    StagingPool,
    _Owned,
    _Owner,
    _Resolved,
    _Serving,
)
from memsem.runtime._telemetry import Stats, Telemetry
from memsem.topology import Location, Route, choose_route

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
#: liveness of a window's owner is re-checked after transfers of at least this many bytes
LIVENESS_CHECK_BYTES = 1 << 18
#: slice of a blocking wait between liveness checks (seconds)
WAIT_SLICE = 0.05
#: seconds an unpublished window's control block stays mapped for threads still reading it
RETIRED_CB_GRACE = 10.0
#: smaller transfers re-check the owner's liveness when the last check is older than this (s)
LIVENESS_INTERVAL = 0.05

_guarded = native.lib.memsem_guarded_copy
_now = time.perf_counter_ns
_UINT8 = _dtypes.code_of("uint8")
_current: contextvars.ContextVar["RuntimeCore | None"] = contextvars.ContextVar("memsem_runtime", default=None)
_instances: "list[weakref.ref[RuntimeCore]]" = []
# ----------------------------------------------------------------------------------------------
class RuntimeCore:
    """A process's memsem runtime: owns its windows, resolves others', moves bytes.

    Args:
        directory: ``"local"`` (default; or ``MEMSEM_DIRECTORY``) or ``"redis://host:port/db"``.
        engines: engine names to enable; default loopback and host (others by name, e.g.
            ``("loopback", "host", "mte")``). An engine named here that is unavailable raises
            NotSupportedError naming it (never a silent fallback).
        engine_objects: ready engine instances (e.g. a ScriptedEngine for tests), by name;
            they replace the named ones.
        job: namespace of the directory (``MEMSEM_JOB``).
        timeout: default bound in seconds of every blocking call.
        prefer: engine to force for routes (``Runtime.explain`` shows the alternatives).

    Thread safety: all methods may be called from several threads.
    """

    def __init__(self, *, directory: str | None = None, engines: Sequence[str] | None = None,
                 engine_objects: dict[str, Engine] | None = None, job: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, prefer: str | None = None,
                 workers: int = 4) -> None:
        if check_timeout(timeout, "timeout") == 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        self.timeout = float(timeout)
        self.prefer = prefer
        self.identity = ProcessIdentity.current()
        self._closed = False
        self._lock = threading.RLock()
        self.telemetry = Telemetry()
        self._owned: dict[int, _Owned] = {}
        self._names: dict[str, int] = {}
        self._resolved: dict[int, _Resolved] = {}
        self._owners: dict[tuple[int, int], _Owner] = {}
        self._segments: dict[int, Segment] = {}  # alloc'd segments by address
        self._leases: "weakref.WeakSet[Lease]" = weakref.WeakSet()
        self._serving: dict[bytes, _Serving] = {}  # owner side of "owner"-enforced engines (tcp)
        self._serve_lock = threading.Lock()
        #: objects of higher layers (pipelines) closed before this runtime closes
        self._children: "weakref.WeakSet[Any]" = weakref.WeakSet()
        #: control blocks of unpublished windows, unlinked but kept mapped a while: a thread of
        #: this process may still be reading them (a wait_tile notices the generation move within
        #: WAIT_SLICE); unmapped RETIRED_CB_GRACE s later or at close
        self._retired: list[tuple[float, Any]] = []
        self._engines: dict[str, Engine] = {}
        self._available: dict[str, Availability] = {}
        self.location_attrs: dict[str, Any] = {}
        names = list(engines) if engines is not None else ["loopback", "host"]
        objs = dict(engine_objects or {})
        for name in names + [n for n in objs if n not in names]:
            if name in objs:
                eng = objs[name]
                self._engines[name] = eng
                self._available[name] = Availability(True)
                continue
            cls = engine_class(name)
            avail = cls.probe()
            self._available[name] = avail
            if not avail:
                raise NotSupportedError(f"engine {name!r} was requested but is unavailable here: {avail.reason}")
            self._engines[name] = cls() if not hasattr(cls, "from_runtime") else cls.from_runtime(self)
        for eng in self._engines.values():
            attrs = getattr(eng, "location_attrs", None)
            if attrs:
                self.location_attrs.update(attrs)
        from memsem.runtime._gc import collect

        collect(dry_run=False)  # reap segments of dead processes of this user (cheap: one listdir)
        self.directory: Directory = open_directory(directory, job=job, alive=_record_alive)
        rec = {"pid": self.identity.pid, "start": self.identity.start_time, "node": self.identity.node}
        self.rank = self.directory.claim_rank(rec)
        self._gva = SliceAllocator(self.rank)
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="memsem-rt")
        self.staging = StagingPool()
        self._token = None
        _instances.append(weakref.ref(self))
        for eng in self._engines.values():
            hook = getattr(eng, "bind_runtime", None)
            if hook is not None:
                hook(self)

    # -- context ---------------------------------------------------------------------------------
    def __enter__(self):
        self._token = _current.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise MemsemError("runtime is closed")

    @property
    def location(self) -> Location:
        return Location(self.identity.node, self.identity.pid, self.location_attrs)

    def engine(self, name: str) -> Engine:
        try:
            return self._engines[name]
        except KeyError:
            raise NotSupportedError(f"engine {name!r} is not enabled in this runtime "
                                    f"(enabled: {', '.join(self._engines)})") from None

    @property
    def engines(self) -> dict[str, Engine]:
        return dict(self._engines)

    # -- publish ---------------------------------------------------------------------------------
    def alloc_array(self, shape: int | Sequence[int], dtype: Any = np.float32, *,
                    engine: str | None = None) -> np.ndarray:
        """A new zero-filled array of ``shape``/``dtype`` in a shared segment (mode 0600).

        Publishing it gives a window that same-node consumers can ``view()`` zero-copy. The
        segment is unlinked when the array is garbage collected or the runtime closes.

        ``engine`` names an enabled engine whose own memory the array must live in (the engine's
        ``alloc_array``; e.g. ``"mte"``: the SHMEM symmetric heap, a *collective* call that
        every PE makes with the same arguments in the same order). Such memory is released
        by the engine (``MteEngine.free`` or team close), not by garbage collection.

        Raises:
            OutOfMemoryError: the segment directory (or the engine's heap) cannot hold it.
            NotSupportedError: ``engine`` is not enabled or cannot allocate.
        """
        self._check_open()
        if engine is not None:
            alloc = getattr(self.engine(engine), "alloc_array", None)
            if alloc is None:
                raise NotSupportedError(f"engine {engine!r} has no memory of its own to allocate from")
            return alloc(shape, dtype)
        shape_t = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape_t):
            raise ValueError(f"shape must be non-negative, got {shape_t}")
        code = _dtypes.code_of(dtype)
        dt = _dtypes.numpy_dtype(code)
        nbytes = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
        seg = Segment.create("data", max(nbytes, 1))
        with self._lock:
            self._segments[seg.address] = seg
        # The holder under every array derived from this one exports the mmap's buffer, so the
        # mapping outlives close() for as long as any view of it lives; its finalizer (not the
        # returned array's: a reshape or slice would outlive that) drops the segment.
        raw = address_view(seg.address, nbytes, seg.export())
        arr = raw.view(dt).reshape(shape_t)
        weakref.finalize(raw.base, _drop_segment, weakref.ref(self), seg.address)
        return arr

    def _segment_of(self, address: int, nbytes: int) -> Segment | None:
        with self._lock:
            for base, seg in self._segments.items():
                if base <= address and address + nbytes <= base + seg.nbytes:
                    return seg
        return None

    def publish_spec(self, obj: Any, *, name: str | None = None, access: str | None = None,
                     tile_bytes: int | None = None, tiles: int | None = None) -> RefSpec:
        """Publish ``obj`` in place (no staging copy) as a window; return its RefSpec.

        See ``memsem.Runtime.publish`` for the argument contract.
        """
        self._check_open()
        if name is not None and (not isinstance(name, str) or not name or len(name.encode()) > 255):
            raise ValueError(f"name must be a non-empty str of at most 255 bytes, got {name!r}")
        info = buffer_info(obj, "obj")
        if access is None:
            access = "r" if info.readonly else "rw"
        if access not in ("r", "rw"):
            raise ValueError(f"access must be 'r' or 'rw', got {access!r}")
        if access == "rw" and info.readonly:
            raise AccessDeniedError(f"obj is read-only ({type(obj).__name__}); it can only be published access='r'")
        n_ready, tb = _tiling(info.nbytes, tile_bytes, tiles)
        with self._lock:
            if name is not None and name in self._names:
                old = self._owned[self._names[name]]
                return self._republish(old, info, access, n_ready, tb)
            gva = self._gva.allocate(info.nbytes)
            return self._publish_at(gva, name or "", info, access, n_ready, tb, cb=None)

    def _publish_at(self, gva: int, name: str, info: BufferInfo, access: str, n_ready: int,
                    tile_bytes: int, cb: ControlBlock | None) -> RefSpec:
        me = self.identity
        perms = PERM_READ | (PERM_WRITE if access == "rw" else 0)
        seg = self._segment_of(info.address, info.nbytes)
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
        gen = cb.generation
        descriptors = {}
        engines = []
        try:
            for ename, eng in self._engines.items():
                desc = eng.register(region)
                if desc is None:
                    continue  # this engine cannot reach such memory: no route through it
                descriptors[ename] = desc
                engines.append(eng)
                self.telemetry.registrations[ename] += 1
        except BaseException:
            for eng, d in zip(engines, descriptors.values()):
                eng.deregister(d)
            raise
        key = secrets.token_bytes(16)
        winfo = WindowInfo(gva=gva, nbytes=info.nbytes, name=name, generation=gen, access=access,
                           key_digest=key_digest(key), rank=self.rank, owner_pid=me.pid,
                           owner_start=me.start_time, node=me.node, control=cb.segment.name,
                           n_ready=cb.n_ready, tile_bytes=tile_bytes, descriptors=descriptors,
                           dtype_code=info.dtype_code, shape=info.shape, byte_offset=info.byte_offset,
                           framework=info.framework)
        owned = _Owned(winfo, cb, key, info.keepalive, region, engines, gen)
        cb.set_word(W_STATE, WindowState.LIVE)
        self._owned[gva] = owned
        if name:
            self._names[name] = gva
        for hook in self._publish_hooks():
            hook(owned)
        if getattr(self.directory, "seals_keys", False):
            self.directory.put_window(gva, name, winfo.to_json(), key=key)  # sealed for the job secret
        else:
            self.directory.put_window(gva, name, winfo.to_json())
        return RefSpec(gva, gen, key, access, 0, info.nbytes, info.dtype_code, info.shape,
                       info.byte_offset, info.framework, name)

    def _publish_hooks(self) -> list:
        return [h for e in self._engines.values() if (h := getattr(e, "on_publish", None))]

    def _republish(self, old: _Owned, info: BufferInfo, access: str, n_ready: int, tile_bytes: int) -> RefSpec:
        self._retire(old, timeout=self.timeout, keep_name=True)
        reuse = old.cb if old.cb.n_ready == n_ready and not old.cb.closed else None
        if reuse is None:
            self._close_cb(old.cb)
        span_ok = info.nbytes <= max(old.info.nbytes, 1)
        gva = old.info.gva if span_ok else self._gva.allocate(info.nbytes)
        if reuse is not None and not span_ok:
            self._close_cb(reuse)
            reuse = None
        return self._publish_at(gva, old.info.name, info, access, n_ready, tile_bytes, cb=reuse)

    def _retire(self, owned: _Owned, *, timeout: float, keep_name: bool = False, force: bool = False) -> None:
        """Close a window: refuse new leases, wait out leases, bump generation, drain in-flight
        copies, deregister. Raises LeaseHeldError (window left LIVE) when leases outlast
        ``timeout`` and not ``force``."""
        cb = owned.cb
        label = f"window {owned.info.name!r} (gva {owned.info.gva:#x})" if owned.info.name else f"window gva {owned.info.gva:#x}"
        cb.set_word(W_STATE, WindowState.CLOSING)
        deadline = time.monotonic() + timeout
        remote_holders = getattr(self.directory, "lease_holders", None)
        while True:
            holders = _lease.blocking_holders(cb)
            if remote_holders is not None:  # leases of other nodes (closing: no new ones)
                holders += remote_holders(owned.info.gva, closing=True)
            if not holders:
                break
            if time.monotonic() >= deadline:
                if force:
                    warnings.warn(f"{label} closed with leases held by {holders}", ResourceWarning, stacklevel=3)
                    break
                cb.set_word(W_STATE, WindowState.LIVE)
                if remote_holders is not None:
                    self.directory.reopen_window(owned.info.gva)
                raise LeaseHeldError(
                    f"cannot unpublish {label}: {len(holders)} unexpired lease(s) after {timeout} s, "
                    f"held by " + ", ".join(f"pid {p} ({left:.2f} s left)" for p, left in holders),
                    holders=holders)
            time.sleep(min(WAIT_SLICE, max(0.0, min(h[1] for h in holders)) + 0.001))
        cb.bump_generation()
        # Drain copies that started under the old generation (they will see it moved).
        while native.load_acquire(cb.inflight_addr):
            if time.monotonic() >= deadline + 1.0:
                if not force:
                    raise MemsemTimeoutError(f"{label}: in-flight transfers did not drain in {timeout} s",
                                             what="in-flight transfers", timeout=timeout)
                break
            time.sleep(0.0005)
        cb.set_word(W_STATE, WindowState.DEAD)
        for eng, d in zip(owned.engines, owned.info.descriptors.values()):
            try:
                eng.deregister(d)
            except MemsemError as exc:
                log.warning("deregistering %s from engine %s failed: %s", label, eng.name, exc)
        self._owned.pop(owned.info.gva, None)
        if owned.info.name and not keep_name:
            self._names.pop(owned.info.name, None)
        self.directory.remove_window(owned.info.gva, "" if keep_name else owned.info.name)
        self._resolved.pop(owned.info.gva, None)
        owned.keepalive = None

    def _close_cb(self, cb: ControlBlock, *, now: bool = False) -> None:
        try:
            cb.segment.unlink()
        finally:
            if now:
                cb.close()
            else:
                self._defer_close(cb.close)

    def _defer_close(self, fn: Any) -> None:
        """Run ``fn`` (an unmap) RETIRED_CB_GRACE s from now, or at close: another thread of this
        process may still be copying through, or waiting on, the mapping it releases."""
        t = time.monotonic()
        due = [f for since, f in self._retired if t - since > RETIRED_CB_GRACE]
        self._retired = [(since, f) for since, f in self._retired if t - since <= RETIRED_CB_GRACE]
        self._retired.append((t, fn))
        for f in due:
            f()

    def _flush_retired(self) -> None:
        retired, self._retired = self._retired, []
        for _, f in retired:
            f()

    def unpublish_spec(self, spec_or_name: RefSpec | str, *, timeout: float | None = None) -> None:
        """Unpublish a window this runtime owns (see ``memsem.Runtime.unpublish``)."""
        self._check_open()
        with self._lock:
            owned = self._owned_for(spec_or_name)
            self._retire(owned, timeout=self.timeout if timeout is None else check_timeout(timeout, "timeout"))
            self._close_cb(owned.cb)

    def _owned_for(self, spec_or_name: RefSpec | str) -> _Owned:
        if isinstance(spec_or_name, str):
            gva = self._names.get(spec_or_name)
            if gva is None:
                raise WindowNotFoundError(f"this runtime publishes no window named {spec_or_name!r}")
        else:
            gva = spec_or_name.gva
        owned = self._owned.get(gva)
        if owned is None:
            raise WindowNotFoundError(f"this runtime does not own window gva {gva:#x}")
        if not isinstance(spec_or_name, str) and spec_or_name.generation != owned.generation:
            raise self._stale(spec_or_name, owned.generation)
        return owned

    def lookup_spec(self, name: str) -> RefSpec:
        """RefSpec of the window published under ``name`` (any process of the job).

        Only the owner knows the access key; a lookup by name therefore works within this
        runtime, or where the directory entry carries a key for the caller (see refs layer).

        Raises:
            WindowNotFoundError: no such name.
        """
        self._check_open()
        gva = self._names.get(name)
        if gva is not None:
            o = self._owned[gva]
            return RefSpec(gva, o.generation, o.key, o.info.access, 0, o.info.nbytes, o.info.dtype_code,
                           o.info.shape, o.info.byte_offset, o.info.framework, name)
        sealed = getattr(self.directory, "window_with_key", None)
        if sealed is not None:  # another node's window: its key is sealed for the job secret
            gva = self.directory.lookup(name)
            rec, key = sealed(gva) if gva is not None else (None, None)
            if rec is not None and key is not None:
                i = WindowInfo.from_json(rec)
                return RefSpec(gva, i.generation, key, i.access, 0, i.nbytes, i.dtype_code, i.shape,
                               i.byte_offset, i.framework, name)
        raise WindowNotFoundError(f"no window named {name!r} is published by this runtime; pass the "
                                  "serialized ref (to_bytes) to consumers instead")

    # -- owner side of engines that enforce generations at the owner (tcp) ------------------------
    def serve_check(self, credential: bytes, put: bool, offset: int, nbytes: int) -> "_Serving":
        """Validate a request of a remote consumer for a window this runtime owns.

        ``credential`` is the consumer's serialized RefSpec; ``offset``/``nbytes`` the byte
        range inside the window; ``put`` the direction. Checks, before a byte moves: the window
        is owned here and LIVE at the credential's generation, the access key matches, the
        range lies inside the window, a put has a writable ref to a writable window. Returns a
        grant whose ``enter()``/``leave()`` bracket the copy with the window's in-flight count
        and a generation re-check (seqlock: ``leave()`` False means the bytes are not valid).
        Validations are cached per credential; the generation is re-read on every call.

        Raises:
            WindowNotFoundError, StaleReferenceError, AccessDeniedError, ValueError (range).
        """
        with self._serve_lock:
            g = self._serving.get(credential)
            if g is None or g.current() != g.generation:
                g = self._serve_grant(credential)
        if offset < 0 or nbytes < 0 or offset + nbytes > g.nbytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) lies outside window gva {g.gva:#x} "
                             f"of {g.nbytes} bytes")
        if put and not g.writable:
            raise AccessDeniedError(f"put to window gva {g.gva:#x}: the ref or the window is read-only")
        return g

    def _serve_grant(self, credential: bytes) -> "_Serving":
        old = self._serving.pop(credential, None)
        if old is not None:
            old.cb.unpin()
        try:
            spec = RefSpec.from_bytes(credential)
        except (ValueError, KeyError) as exc:
            raise AccessDeniedError(f"malformed credential: {exc}") from None
        owned = self._owned.get(spec.gva)
        if owned is None:
            raise WindowNotFoundError(f"{spec.label} is not published by this runtime (unpublished, "
                                      "or never): the ref is stale", window=spec.name, expected=spec.generation)
        if not key_matches(spec.key, owned.info.key_digest):
            if spec.generation != owned.generation:
                raise self._stale(spec, owned.generation)
            raise AccessDeniedError(f"wrong access key for {spec.label}: the ref was not minted by its owner")
        cb = owned.cb
        try:
            cb.pin()  # the grant reads the control block until evicted, whatever retire does
        except ValueError:
            raise self._stale(spec, None) from None
        gen = cb.generation
        if gen != spec.generation or cb.word(W_STATE) not in (WindowState.LIVE, WindowState.CLOSING):
            cb.unpin()
            raise self._stale(spec, gen)
        if len(self._serving) >= 4096:
            self._serve_evict(all_=True)
        g = _Serving(spec.gva, spec.generation, cb, address_view(owned.region.address, owned.info.nbytes,
                                                                 owned.keepalive),
                     spec.writable and owned.info.access == "rw")
        self._serving[credential] = g
        return g

    def serve_sweep(self) -> None:
        """Drop cached grants of windows whose generation moved (unpinning their control
        blocks). Called now and then by serving engines."""
        with self._serve_lock:
            self._serve_evict(all_=False)

    def _serve_evict(self, *, all_: bool) -> None:
        for cred, g in list(self._serving.items()):
            if all_ or g.current() != g.generation:
                del self._serving[cred]
                g.cb.unpin()

    # -- resolve ---------------------------------------------------------------------------------
    def _stale(self, spec: RefSpec, found: int | None) -> StaleReferenceError:
        self.telemetry.count_error("stale")
        return StaleReferenceError(
            f"{spec.label} moved from generation {spec.generation} to {found}: the ref is stale "
            "(unpublished, republished or reused); no byte of it is valid",
            window=spec.name, expected=spec.generation, found=found)

    def _stale_during(self, spec: RefSpec, found: int | None, lease: Lease | None) -> MemsemError:
        """The error for a generation that moved under a transfer: LeaseExpiredError when the
        caller's lease ran out (the owner reclaimed the window because of it), else stale."""
        if lease is not None and lease.expired():
            self.telemetry.count_error("lease_expired")
            return LeaseExpiredError(f"lease on {spec.label} expired during the transfer and the owner "
                                     "reclaimed the window; the bytes moved are not valid")
        return self._stale(spec, found)

    def _owner(self, pid: int, start: int, node: str, rank: int = -1) -> _Owner:
        key = (pid, start)
        o = self._owners.get(key)
        if o is None or o.node != node:
            o = _Owner(pid, start, node)
            check = getattr(self.directory, "owner_alive", None)
            if node != native.node_id() and check is not None and rank >= 0:
                o.remote = lambda: check(rank, pid, start, node)
            self._owners[key] = o
        return o

    def peer_alive(self, pid: int, start: int, node: str, rank: int = -1) -> bool:
        """Whether the process ``pid``/``start`` on ``node`` (holding ``rank``) is alive: same
        node by pid, other nodes by the directory's heartbeat (True when nobody can tell)."""
        return self._owner(pid, start, node, rank).alive()

    def _resolve(self, spec: RefSpec) -> _Resolved:
        self._check_open()
        res = self._resolved.get(spec.gva)
        if res is not None and res.info.generation == spec.generation and res.key == spec.key:
            return res
        with self._lock:
            res = self._resolved.get(spec.gva)
            if res is not None and res.info.generation == spec.generation:
                if res.key == spec.key:
                    return res
                # A cached resolution serves only the key it was verified with: a forged ref
                # with a known GVA and generation must not ride on someone else's resolution.
                if not key_matches(spec.key, res.info.key_digest):
                    raise AccessDeniedError(f"wrong access key for {spec.label}: the ref was not "
                                            "minted by its owner")
                return res
            if res is not None:
                self._drop_resolved(spec.gva)
            res = self._resolve_uncached(spec)
            res.key = spec.key
            tel = self.telemetry
            res.counter = tel.route_counter(res.route.kind)
            res.lat_get, res.lat_put = tel.latency_sink("get"), tel.latency_sink("put")
            self._resolved[spec.gva] = res
            return res

    def _resolve_uncached(self, spec: RefSpec) -> _Resolved:
        owned = self._owned.get(spec.gva)
        if owned is not None:
            info, cb, own_cb = owned.info, owned.cb, True
        else:
            rec = self.directory.get_window(spec.gva)
            if rec is None:
                rank, _ = split_gva(spec.gva)
                rrec = self.directory.rank_record(rank)
                if rrec is not None and not _record_alive(rrec):
                    raise PeerLostError(f"the owner of {spec.label} (rank {rank}, pid {rrec.get('pid')}) is dead")
                raise WindowNotFoundError(f"{spec.label} is not published (unpublished, or its owner "
                                          "exited): the ref is stale", window=spec.name,
                                          expected=spec.generation)
            info = WindowInfo.from_json(rec)
            cb, own_cb = None, False
        if not key_matches(spec.key, info.key_digest):
            if info.generation != spec.generation:  # republished: new generation, new key
                raise self._stale(spec, info.generation)
            raise AccessDeniedError(f"wrong access key for {spec.label}: the ref was not minted by its owner")
        if spec.offset < 0 or spec.offset + spec.nbytes > info.nbytes:
            raise ValueError(f"ref range [{spec.offset}, {spec.offset + spec.nbytes}) lies outside "
                             f"{spec.label} of {info.nbytes} bytes")
        owner = self._owner(info.owner_pid, info.owner_start, info.node, info.rank)
        if not owned and not owner.alive():
            raise PeerLostError(f"the owner of {spec.label} (pid {info.owner_pid} on {info.node}) is dead")
        if info.generation != spec.generation:
            raise self._stale(spec, info.generation)
        if cb is None and info.node == self.identity.node and info.control:
            try:
                cb = ControlBlock.attach(info.control)
            except WindowNotFoundError:
                raise self._stale(spec, None) from None
            if cb.generation != spec.generation:
                found = cb.generation
                cb.close()
                raise self._stale(spec, found)
        route = choose_route(self.location, Location(info.node, info.owner_pid), info.descriptors,
                             self._available, nbytes=info.nbytes, prefer=self.prefer)
        eng = self._engines[route.engine]
        try:
            cred = spec.to_bytes() if eng.enforces_generation == "owner" else b""
            remote = eng.attach(info.descriptors[route.engine], info.nbytes, cred)
        except EngineError as exc:
            if cb is not None and not own_cb:
                cb.close()
            raise _chain(self._translate(exc, spec, owner), exc)
        except WindowNotFoundError:
            if cb is not None and not own_cb:
                cb.close()
            raise self._stale(spec, None) from None
        return _Resolved(info, cb, remote, route, eng, owner, own_cb)

    def _drop_resolved(self, gva: int) -> None:
        res = self._resolved.pop(gva, None)
        if res is not None:
            if res.pins:
                res.dropped = True  # views still map it: unmapped when the last one goes
                return
            # Another thread may be copying through this mapping right now (it resolved before
            # the drop): unmap after a grace period, never under it.
            self._defer_close(lambda: _close_resolved(res))

    def route_of(self, spec: RefSpec) -> Route:
        """The route this runtime uses for ``spec`` (resolving it if needed)."""
        return self._resolve(spec).route

    # -- errors ----------------------------------------------------------------------------------
    def _translate(self, exc: BaseException, spec: RefSpec, owner: _Owner | None) -> MemsemError:
        if isinstance(exc, MemsemError) and not isinstance(exc, EngineError):
            return exc
        err = getattr(exc, "errno", None)
        if owner is not None and (err == _errno.ESRCH or not owner.alive()):
            self.telemetry.count_error("peer_lost")
            return PeerLostError(f"the owner of {spec.label} (pid {owner.pid}) died during the transfer")
        if isinstance(exc, EngineError):
            return exc
        return EngineError(f"transfer on {spec.label} failed: {exc}")

    # -- data movement ---------------------------------------------------------------------------
    def transfer(self, spec: RefSpec, kind: str, offset: int, local: np.ndarray, *,
                 lease: Lease | None = None, signal_tile: int | None = None) -> None:
        """Move ``local.nbytes`` bytes between ``local`` (flat uint8) and the window at
        ``spec.offset + offset``; ``kind`` is "get" or "put". Blocking, remote completion.

        Generation is checked before and after the copy (seqlock); the lease, when given, too.
        ``signal_tile`` (puts only): where the route's engine can signal the window's tiles
        (mte: ``aclshmemx_putmem_signal``), it also sets that tile's signal word, after the data,
        to a value derived from the generation. Elsewhere it is ignored: the caller marks the
        ready word itself (``TensorRef.put_tile`` does both).
        """
        n = local.nbytes
        self._transfer(spec, kind == "put", offset, array_address(local) if n else 0, n, local, lease,
                       signal_tile)

    def _transfer(self, spec: RefSpec, put: bool, offset: int, addr: int, n: int, local: Any,
                  lease: Lease | None, signal_tile: int | None = None) -> None:
        t0 = _now()
        if offset < 0 or offset + n > spec.nbytes:
            raise ValueError(f"range [{offset}, {offset + n}) lies outside the ref's {spec.nbytes} bytes")
        res = self._resolved.get(spec.gva)
        if res is None or res.info.generation != spec.generation or res.key != spec.key:
            res = self._resolve(spec)
        at = spec.offset + offset
        if at < 0 or at + n > res.nbytes:
            # The resolution is cached per window: a ref's own range is checked on every use.
            raise ValueError(f"ref range [{at}, {at + n}) lies outside {spec.label} of {res.nbytes} bytes")
        if put:
            if not spec.writable:
                raise AccessDeniedError(f"put through a read-only ref to {spec.label}")
            if not res.writable:
                raise AccessDeniedError(f"{spec.label} was published read-only")
        if lease is not None:
            if lease.spec.gva != spec.gva:
                raise ValueError(f"lease is for {lease.spec.label}, not {spec.label}")
            lease.check("before the transfer")
        at += res.base
        if res.direct:
            if put:
                if res.put_method == native.COPY_VM_WRITE and not res.owner.alive():
                    # Never write by pid into a process that may not be the owner any more.
                    raise PeerLostError(f"the owner of {spec.label} (pid {res.owner.pid}) is dead")
                rc = _guarded(res.gen_addr, spec.generation, res.inflight_addr, res.put_method, res.pid, at, addr, n)
            else:
                rc = _guarded(res.gen_addr, spec.generation, res.inflight_addr, res.get_method, res.pid, addr, at, n)
            if rc != 0:
                cb = res.cb
                if rc == native.GUARD_BEFORE or rc == native.GUARD_AFTER:
                    raise self._stale_during(spec, cb.generation, lease)
                exc = EngineError(f"{'put' if put else 'get'} on {spec.label}", errno=-rc)
                if cb.generation != spec.generation:
                    raise self._stale_during(spec, cb.generation, lease) from exc
                raise _chain(self._translate(exc, spec, res.owner), exc)
        else:
            flat = local if isinstance(local, np.ndarray) and local.dtype == np.uint8 and local.ndim == 1 \
                else address_view(addr, n, local)
            try:
                self._engine_transfer(res, spec, "put" if put else "get", spec.offset + offset, flat,
                                      signal_tile if put else None)
            except StaleReferenceError as exc:
                err = self._stale_during(spec, exc.found, lease)
                if err is not None and not isinstance(err, StaleReferenceError):
                    raise err from exc
                raise
        if lease is not None:
            lease.check("during the transfer; the bytes moved are not valid")
        if not res.own_cb and (n >= LIVENESS_CHECK_BYTES or time.monotonic() - res.owner.checked >= LIVENESS_INTERVAL) \
                and not res.owner.alive():
            self.telemetry.count_error("peer_lost")
            raise PeerLostError(f"the owner of {spec.label} (pid {res.owner.pid}) died during the transfer")
        c = res.counter
        c[0] += 1
        c[1] += n
        (res.lat_put if put else res.lat_get)(_now() - t0)

    def _engine_transfer(self, res: _Resolved, spec: RefSpec, kind: str, at: int, local: np.ndarray,
                         signal_tile: int | None = None) -> None:
        cb = res.cb
        enforced = res.engine.enforces_generation
        if cb is None and not enforced:
            raise NotSupportedError(f"route {res.route.kind} to {spec.label} cannot check the window's "
                                    "generation (no control block here and the engine does not enforce it)")
        if cb is not None:
            native.fetch_add(cb.inflight_addr, 1)
        try:
            if cb is not None and cb.generation != spec.generation:
                raise self._stale(spec, cb.generation)
            try:
                if kind == "get":
                    res.engine.get(res.remote, at, local)
                elif signal_tile is not None and getattr(res.engine, "can_signal", None) is not None \
                        and res.engine.can_signal(res.remote):
                    res.engine.put_signal(res.remote, at, local, signal_tile, spec.generation)
                else:
                    res.engine.put(res.remote, at, local)
            except MemsemError as exc:
                if cb is not None and cb.generation != spec.generation:
                    raise self._stale(spec, cb.generation) from exc
                if cb is None and isinstance(exc, EngineError):
                    # Device- or owner-enforced routes: a moved generation shows up as an access
                    # fault; the directory tells which it was.
                    rec = self.directory.get_window(spec.gva)
                    if rec is None or int(rec.get("generation", -1)) != spec.generation:
                        self._resolved.pop(spec.gva, None)
                        raise self._stale(spec, None if rec is None else int(rec["generation"])) from exc
                raise _chain(self._translate(exc, spec, res.owner), exc)
            if cb is not None and cb.generation != spec.generation:
                raise self._stale(spec, cb.generation)
        finally:
            if cb is not None:
                native.fetch_sub(cb.inflight_addr, 1)

    def get_spec(self, spec: RefSpec, out: Any = None, *, lease: Lease | None = None) -> np.ndarray:
        """Blocking get of the whole ref into ``out`` (or a new array); returns the numpy array
        of shape ``spec.shape`` and the ref's dtype (``out``'s own array when given)."""
        if out is None:
            out = np.empty(spec.shape, _dtypes.numpy_dtype(spec.dtype_code))
        elif not (type(out) is np.ndarray and (f := out.flags).c_contiguous and f.writeable):
            flat, info = as_byte_array(out, "out", writable=True)
            if info.nbytes != spec.nbytes:
                raise ValueError(f"out holds {info.nbytes} bytes; the ref is {spec.nbytes} bytes "
                                 f"({spec.shape} {_dtypes.name_of(spec.dtype_code)})")
            self._transfer(spec, False, 0, info.address, info.nbytes, flat, lease)
            return out
        n = out.nbytes
        if n != spec.nbytes:
            raise ValueError(f"out holds {n} bytes; the ref is {spec.nbytes} bytes "
                             f"({spec.shape} {_dtypes.name_of(spec.dtype_code)})")
        self._transfer(spec, False, 0, array_address(out) if n else 0, n, out, lease)
        return out

    def put_spec(self, spec: RefSpec, src: Any, *, lease: Lease | None = None) -> None:
        """Blocking put of ``src`` (exactly the ref's bytes) into the window."""
        if type(src) is np.ndarray and src.flags.c_contiguous:
            n, code = src.nbytes, _dtypes.code_of(src.dtype)
            addr = array_address(src) if n else 0
        else:
            flat, info = as_byte_array(src, "src", writable=False)
            n, code, addr, src = info.nbytes, info.dtype_code, info.address, flat
        if n != spec.nbytes:
            raise ValueError(f"src holds {n} bytes; the ref is {spec.nbytes} bytes")
        if code != spec.dtype_code and spec.dtype_code != _UINT8 and code != _UINT8:
            raise TypeError(f"src dtype {_dtypes.name_of(code)} differs from the ref's "
                            f"{_dtypes.name_of(spec.dtype_code)}; view it as uint8 to copy raw bytes")
        self._transfer(spec, True, 0, addr, n, src, lease)

    def submit(self, what: str, fn) -> Completion:
        self._check_open()
        return Completion.run(self._pool, what, fn, timeout=self.timeout)

    def xcopy_specs(self, pairs: Sequence[tuple[Any, Any]], *, lease: Lease | None = None) -> Batch:
        """Start a batch of copies. Each pair is ``(src, dst)``; each side is a RefSpec (a
        window range) or a local buffer; at least one side is a RefSpec. Ranges fail
        independently; the Batch gives every range a final state."""
        self._check_open()
        jobs = []
        results = []
        for i, pair in enumerate(pairs):
            try:
                src, dst = pair
            except (TypeError, ValueError):
                raise TypeError(f"pairs[{i}] must be a (src, dst) pair, got {pair!r}") from None
            r = RangeResult(i, getattr(src, "nbytes", 0) if isinstance(src, RefSpec) else getattr(dst, "nbytes", 0))
            results.append(r)
            jobs.append((r, src, dst))
        batch = Batch(results, timeout=self.timeout)

        def run(r: RangeResult, src: Any, dst: Any) -> None:
            r.state = State.RUNNING
            try:
                self._copy_one(src, dst, lease)
            except BaseException as exc:
                batch._settle(r, State.FAILED, exc)
            else:
                batch._settle(r, State.DONE)

        for r, src, dst in jobs:
            fut = self._pool.submit(run, r, src, dst)
            # Dropped by the pool (runtime closing) before it ran: the range ends CANCELLED.
            fut.add_done_callback(lambda f, r=r: batch._settle(r, State.CANCELLED) if f.cancelled() else None)
            batch._futures.append(fut)
        return batch

    def _copy_one(self, src: Any, dst: Any, lease: Lease | None) -> None:
        t0 = time.perf_counter_ns()

        def lease_for(spec: RefSpec) -> Lease | None:
            # The lease is checked for the ranges of its own window only.
            return lease if lease is not None and lease.spec.gva == spec.gva else None

        if isinstance(src, RefSpec) and isinstance(dst, RefSpec):
            if src.nbytes != dst.nbytes:
                raise ValueError(f"xcopy sizes differ: src {src.nbytes} bytes, dst {dst.nbytes} bytes")
            if not dst.writable:
                raise AccessDeniedError(f"xcopy into read-only ref {dst.label}")
            rs = self._resolve(src)
            if rs.route.zero_copy and rs.cb is not None:
                # Source mappable: copy straight from its memory (read guarded after the put).
                view = rs.engine.view(rs.remote)[src.offset:src.offset + src.nbytes]
                src_lease = lease_for(src)
                native.fetch_add(rs.cb.inflight_addr, 1)
                try:
                    if src_lease is not None:
                        src_lease.check("before the transfer")
                    if rs.cb.generation != src.generation:
                        raise self._stale(src, rs.cb.generation)
                    self.transfer(dst, "put", 0, view, lease=lease_for(dst))
                    if rs.cb.generation != src.generation:
                        raise self._stale_during(src, rs.cb.generation, src_lease)
                    if src_lease is not None:
                        src_lease.check("during the transfer; the bytes moved are not valid")
                finally:
                    native.fetch_sub(rs.cb.inflight_addr, 1)
            else:
                bounce = np.empty(src.nbytes, np.uint8)
                self.transfer(src, "get", 0, bounce, lease=lease_for(src))
                self.transfer(dst, "put", 0, bounce, lease=lease_for(dst))
                self.telemetry.bounce_bytes += src.nbytes
        elif isinstance(src, RefSpec):
            flat, info = as_byte_array(dst, "dst", writable=True)
            if info.nbytes != src.nbytes:
                raise ValueError(f"xcopy sizes differ: src ref {src.nbytes} bytes, dst {info.nbytes} bytes")
            self.transfer(src, "get", 0, flat, lease=lease_for(src))
        elif isinstance(dst, RefSpec):
            flat, info = as_byte_array(src, "src", writable=False)
            if info.nbytes != dst.nbytes:
                raise ValueError(f"xcopy sizes differ: src {info.nbytes} bytes, dst ref {dst.nbytes} bytes")
            self.transfer(dst, "put", 0, flat, lease=lease_for(dst))
        else:
            raise TypeError("xcopy: at least one side of each pair must be a ref")
        self.telemetry.record("xcopy", "xcopy", getattr(src, "nbytes", 0), time.perf_counter_ns() - t0)

    def view_spec(self, spec: RefSpec, *, lease: Lease | None = None) -> np.ndarray:
        """Zero-copy array over the window itself (see ``memsem.TensorRef.view``)."""
        t0 = time.perf_counter_ns()
        res = self._resolve(spec)
        if not res.own_cb and not res.owner.alive():  # a cached resolution may outlive its owner
            raise PeerLostError(f"the owner of {spec.label} (pid {res.owner.pid}) is dead: no view")
        if not res.route.zero_copy:
            raise NotSupportedError(f"view() of {spec.label} is not possible on route {res.route.kind} "
                                    f"({res.route.reason}); use get()")
        own_lease = lease is None
        if own_lease:
            lease = Lease(self, spec, None).acquire()
        elif lease.spec.gva != spec.gva:
            raise ValueError(f"lease is for {lease.spec.label}, not {spec.label}")
        try:
            lease.check("at view()")
            raw = res.engine.view(res.remote)
            if res.cb is not None and res.cb.generation != spec.generation:
                raise self._stale(spec, res.cb.generation)
            dt = _dtypes.numpy_dtype(spec.dtype_code)
            flat = raw[spec.offset:spec.offset + spec.nbytes]
            if not spec.writable and flat.flags.writeable:
                flat = flat.view()
                flat.flags.writeable = False
            arr = flat.view(dt).reshape(spec.shape)
        except BaseException:
            if own_lease:
                lease.release()
            raise
        with lease._lock:
            lease._views += 1
        with self._lock:
            res.pins += 1
        owned = self._owned.get(spec.gva)
        # The finalizer holds the mapping (res) and, for a window of this runtime, the published
        # object itself: a view never outlives the memory it shows, even past a forced close.
        # Tie the lease to the holder under every array derived from this view (a slice or reshape
        # of ``arr`` outlives ``arr`` itself, and must keep the lease and the mapping).
        holder = raw.base if raw.base is not None and not isinstance(raw.base, np.ndarray) else raw
        weakref.finalize(holder, _view_gone, lease, own_lease, res, None if owned is None else owned.keepalive)
        self.telemetry.record("view", res.route.kind, 0, time.perf_counter_ns() - t0)
        return arr

    # -- tile-ready words ------------------------------------------------------------------------
    def _ready_cb(self, spec: RefSpec) -> tuple[_Resolved, ControlBlock]:
        res = self._resolve(spec)
        if res.cb is None:
            raise NotSupportedError(f"ready words of {spec.label} live in its control block, which is not "
                                    f"mapped on route {res.route.kind} (owner on another node)")
        if res.cb.n_ready == 0:
            raise ValueError(f"{spec.label} was published without tiles (pass tile_bytes= or tiles= to publish)")
        return res, res.cb

    def _ready_writer(self, spec: RefSpec, tile: int, what: str) -> ControlBlock:
        if not spec.writable:
            raise AccessDeniedError(f"{what} through a read-only ref to {spec.label}: readiness is "
                                    "the producer's to set")
        res, cb = self._ready_cb(spec)
        _check_tile(tile, cb.n_ready, spec)
        if cb.generation != spec.generation:
            raise self._stale(spec, cb.generation)
        return cb

    def mark_ready(self, spec: RefSpec, tile: int) -> None:
        """Release-store tile ``tile``'s ready word with the ref's generation and wake waiters.

        Raises:
            AccessDeniedError: ``spec`` is read-only. StaleReferenceError: generation moved.
        """
        _ready.mark(self._ready_writer(spec, tile, "mark_ready"), tile, spec.generation)

    def clear_ready(self, spec: RefSpec, tile: int) -> None:
        """Clear tile ``tile``'s ready word, only if it holds this ref's generation (a stale ref
        never clears a mark of the new generation)."""
        cb = self._ready_writer(spec, tile, "clear_ready")
        native.compare_exchange(cb.ready_addr(tile), spec.generation, 0)

    def is_ready(self, spec: RefSpec, tile: int) -> bool:
        res, cb = self._ready_cb(spec)
        _check_tile(tile, cb.n_ready, spec)
        return _ready.is_ready(cb, tile, spec.generation)

    def ready_tiles(self, spec: RefSpec) -> list[int]:
        res, cb = self._ready_cb(spec)
        if cb.generation != spec.generation:
            raise self._stale(spec, cb.generation)
        return _ready.ready_tiles(cb, spec.generation)

    def wait_tile(self, spec: RefSpec, tile: int, timeout: float | None = None) -> None:
        """Block until tile ``tile`` is marked ready for the ref's generation.

        Raises:
            MemsemTimeoutError: not ready within ``timeout`` s (names the window and tile).
            PeerLostError: the owner died while waiting (detected within WAIT_SLICE s).
            StaleReferenceError: the generation moved while waiting.
        """
        timeout = self.timeout if timeout is None else check_timeout(timeout, "timeout")
        res, cb = self._ready_cb(spec)
        _check_tile(tile, cb.n_ready, spec)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if _ready.wait_slice(cb, tile, spec.generation, max(0.0, min(WAIT_SLICE, left))):
                return
            if cb.generation != spec.generation:
                raise self._stale(spec, cb.generation)
            if not res.own_cb and not res.owner.alive():
                raise PeerLostError(f"the owner of {spec.label} (pid {res.owner.pid}) died while "
                                    f"tile {tile} was awaited")
            if time.monotonic() >= deadline:
                raise MemsemTimeoutError(f"tile {tile} of {spec.label} not ready after {timeout} s",
                                         what=f"tile {tile} of {spec.label}", timeout=timeout)

    # -- telemetry & lifetime --------------------------------------------------------------------
    def stats(self) -> Stats:
        """A snapshot of this runtime's telemetry."""
        return self.telemetry.snapshot(len(self._owned), leases=len(self._leases))

    def close(self, timeout: float | None = None) -> None:
        """Unpublish every window (waiting up to ``timeout`` for leases, then warning and
        retiring anyway: the memory is going away), release leases, close engines and the
        directory, unlink this runtime's segments. Safe twice."""
        if self._closed:
            return
        timeout = min(self.timeout, 5.0) if timeout is None else check_timeout(timeout, "timeout")
        for child in list(self._children):
            try:
                child.close()
            except Exception:
                log.warning("closing %r failed", child, exc_info=True)
        with self._lock:
            for lease in list(self._leases):
                with lease._lock:
                    lease._views = 0
                    lease.release()
            deadline = time.monotonic() + timeout  # one bound for all windows, not one each
            for owned in list(self._owned.values()):
                try:
                    self._retire(owned, timeout=max(0.0, deadline - time.monotonic()), force=True)
                finally:
                    self._close_cb(owned.cb)
            for gva in list(self._resolved):
                self._drop_resolved(gva)
            for o in self._owners.values():
                o.close()
            self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._flush_retired()  # no copy of this runtime runs any more
            for eng in reversed(list(self._engines.values())):
                eng.close()
            with self._serve_lock:
                self._serve_evict(all_=True)
            try:
                self.directory.release_rank(self.rank)
            finally:
                self.directory.close()
            for seg in self._segments.values():
                seg.unlink()
                seg.close()
            self._segments.clear()
            self._flush_retired()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_owned", None):
            warnings.warn(f"memsem runtime (rank {self.rank}) was not closed; call close() or use "
                          "'with'", ResourceWarning, stacklevel=2)


# ----------------------------------------------------------------------------------------------
def check_timeout(value: Any, name: str) -> float:
    """A finite, non-negative number of seconds, else ValueError/TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    v = float(value)
    if not (0.0 <= v < float("inf")):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return v


def _chain(translated: BaseException, cause: BaseException) -> BaseException:
    """``raise _chain(t, exc)``: chain ``t`` to ``exc`` unless they are the same error (then its
    own cause, e.g. an engine's status, stays)."""
    if translated is not cause:
        translated.__cause__ = cause
    return translated


def _record_alive(rec: dict[str, Any]) -> bool:
    node = rec.get("node")
    if node is not None and node != native.node_id():
        return True  # another node: its directory liveness (heartbeats) decides, not our pids
    pid = int(rec.get("pid", 0))
    if pid == -1:
        return True
    return process_alive(pid, int(rec.get("start", 0)))


def _tiling(nbytes: int, tile_bytes: int | None, tiles: int | None) -> tuple[int, int]:
    def positive_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0

    if tile_bytes is not None and tiles is not None:
        raise ValueError("pass tile_bytes or tiles, not both")
    if tile_bytes is not None:
        if not positive_int(tile_bytes):
            raise ValueError(f"tile_bytes must be a positive int, got {tile_bytes!r}")
        return max(1, -(-nbytes // int(tile_bytes))), int(tile_bytes)
    if tiles is not None:
        if not positive_int(tiles) or tiles > max(nbytes, 1):
            raise ValueError(f"tiles must be an int in [1, {max(nbytes, 1)}] (at least one byte per "
                             f"tile), got {tiles!r}")
        return int(tiles), -(-nbytes // int(tiles)) if nbytes else 0
    return 0, 0


def _check_tile(tile: int, n: int, spec: RefSpec) -> None:
    if not isinstance(tile, (int, np.integer)) or isinstance(tile, bool) or not 0 <= tile < n:
        raise ValueError(f"tile must be an int in [0, {n}) for {spec.label}, got {tile!r}")


def _view_gone(lease: Lease, own: bool, res: _Resolved, keepalive: Any) -> None:
    with lease._lock:
        lease._views = max(0, lease._views - 1)
    if own and not lease.runtime.closed:
        try:
            lease.release()
        except MemsemError:
            pass
    with lease.runtime._lock:
        res.pins -= 1
        close = res.pins <= 0 and res.dropped
    if close:
        _close_resolved(res)


def _close_resolved(res: _Resolved) -> None:
    res.remote.close()
    if res.cb is not None and not res.own_cb:
        res.cb.close()


def _drop_segment(rt_ref: "weakref.ref[RuntimeCore]", address: int) -> None:
    rt = rt_ref()
    if rt is None:
        return
    with rt._lock:
        seg = rt._segments.pop(address, None)
    if seg is not None:
        seg.unlink()
        seg.close()


def current_core() -> RuntimeCore | None:
    """The runtime of the innermost ``with Runtime()`` block of this context, else the most
    recently created open runtime of this process, else None."""
    rt = _current.get()
    if rt is not None and not rt.closed:
        return rt
    for ref in reversed(list(_instances)):
        r = ref()
        if r is not None and not r.closed:
            return r
    return None
