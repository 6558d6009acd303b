"""Resolutions: a consumer's view of one window generation, and the cache that holds them.

A :class:`Resolution` owns everything a consumer needs to reach a window: the engine's remote
region (a mapped segment, a connection), the mapped control block, a claimed in-flight slot in
it, the owner's liveness handle, and the native *plan* the hot path copies with. Its lifetime
is one rule (the use word at the head of the plan):

* the cache holds the opener's claim; every copy through the resolution is counted while it
  runs (the native copy enters and leaves the word itself; engine routes bracket their call);
* dropping the resolution (republish seen, cache bound, runtime close) closes the word;
* whoever leaves a closed word last (the dropper when nothing ran) releases the mappings.

So a mapping is released when the last copy that uses it has finished, never on a timer and
never under a running copy. Views and leases hold their own pins on the segments they read
(they outlive the resolution safely).

The cache is bounded, and its bound follows the working set. It starts at ``RESOLUTION_LIMIT``
resolutions; the ones dropped for the bound are remembered (their GVA and generation, not their
mappings: a *ghost*, as in ARC), and each time a ghost is resolved again the bound doubles, up
to ``RESOLUTION_CAP`` (a quarter of ``vm.max_map_count``: a resolution maps two segments). So a
consumer touching thousands of short-lived windows, each resolved once, keeps a constant number
of mappings, while one that reads 10,000 live windows in turn stops re-resolving them on every
get after two passes (docs/performance.md, "Cost as the work grows"). The ghosts are at most
``RESOLUTION_CAP``: a working set too large for them never grows the bound, and would miss on
every get at any bound (in turn, the oldest is always the next one read). The bound never
shrinks in a runtime's life; windows that retire are dropped by the sweep (``SWEEP_PER_RESOLVE``).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from memsem import native
from memsem._errors import (
    EngineError,
    MemsemError,
    PeerLostError,
    RuntimeClosedError,
    WindowNotFoundError,
)
from memsem.directory.local import job_is_derived
from memsem.engines import Credential, Engine, GenerationCheck, RemoteRegion
from memsem.gva import (
    ControlBlock,
    RefSpec,
    WindowInfo,
    credential_proof,
    credential_token,
    inflight_slots,
    key_matches,
    split_gva,
)
from memsem.gva._control_block import FIRST_VERSION, I_COUNT, identity_word
from memsem.native import UseWord
from memsem.core import _translate as tr
from memsem.core._liveness import LIVENESS_CHECK_BYTES, LIVENESS_INTERVAL_S, Peer, record_alive
from memsem.core._routes import CopyRoute, route_for
from memsem.topology import Location, Route, choose_route

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore

#: resolutions a runtime keeps cached at first; older ones are dropped (and released when idle)
RESOLUTION_LIMIT = 128


def _resolution_cap() -> int:
    """The most resolutions a runtime's cache grows to: 16,384, or a quarter of the kernel's
    limit of mappings per process (``/proc/sys/vm/max_map_count``, 65,530 by default) where that
    is less (each resolution maps a control block and a data segment)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            maps = int(f.read())
    except (OSError, ValueError):
        maps = 65530
    return max(RESOLUTION_LIMIT, min(16384, maps // 4))


#: resolutions a runtime's cache grows to at most, while windows it dropped are asked for again
RESOLUTION_CAP = _resolution_cap()
#: remote regions a resolution keeps for refs of other mints (owner-checked routes)
MINT_REMOTES_LIMIT = 64
#: cached resolutions checked for a moved generation (and dropped) per new resolution: a
#: consumer of many short-lived windows keeps no mapping of a retired one for long
SWEEP_PER_RESOLVE = 8

_ffi = native.ffi


class Resolution:
    """One window generation as this runtime reaches it (see the module docstring).

    Attributes:
        info: the window's directory record. generation, key: what it was verified with (a cached
            resolution serves only refs with exactly this key). route, engine, remote: how.
        cb: the window's control block mapped here, or None (another node). own_cb: it is this
            runtime's own window. peer: the owner's liveness. plan: the native plan (cdata);
            addr: its address (for ``memsem._hot.copy``; valid while this object lives).
        direct: the hot path copies natively (same node). writable: published access "rw".
        strategy: the :class:`~memsem.core._routes.CopyRoute` its copies take (chosen once, here).
        memo: facts the layers above derive from this resolution alone (a pipeline's default
            tiling per range), dropped with it; bounded by its users.
    """

    __slots__ = ("info", "gva", "generation", "key", "route", "engine", "remote", "cb", "own_cb",
                 "peer", "plan", "addr", "use", "direct", "writable", "nbytes", "slot", "mint", "_remotes",
                 "resolver", "telemetry", "timeout", "strategy", "memo", "keeper", "seen", "_core", "_released",
                 "__weakref__")

    def __init__(self, core: "RuntimeCore", info: WindowInfo, key: bytes, route: Route, engine: Engine,
                 remote: RemoteRegion, cb: ControlBlock | None, own_cb: bool, peer: Peer,
                 mint: object = None) -> None:
        self._core = core
        #: the resolver that made (and drops) this resolution, the runtime's counters, and its
        #: default bound in seconds: what the bracket's translation and the waits use
        self.resolver = core.resolver
        self.telemetry = core.telemetry
        self.timeout = core.timeout
        self.mint = mint
        self.memo: dict[object, object] = {}
        self._remotes: dict[object, RemoteRegion] = {}
        self.info = info
        self.gva = info.gva
        self.generation = info.generation
        self.key = key
        self.route, self.engine, self.remote = route, engine, remote
        self.cb, self.own_cb, self.peer = cb, own_cb, peer
        self.writable = info.access == "rw"
        self.nbytes = info.nbytes
        self.slot = -1
        self._released = False
        #: ``[self]`` while this resolution is unreleased, ``[None]`` after (``release``): what a
        #: ref's route holds instead of it (``memsem.core._routes.PlanRoute``), so a ref never
        #: keeps it past its release
        self.keeper: list[Resolution | None] = [self]
        #: the newest version a copy through this resolution returned (another node's window:
        #: what its version words' mirror may not show yet; ``Versions.latest`` never reports
        #: less, so a label is never older than bytes already returned)
        self.seen = 0
        plan = self.plan = _ffi.new("memsem_plan *")
        self.addr = int(_ffi.cast("uintptr_t", plan))  # the plan's address, for memsem._hot.copy
        self.use = UseWord(_ffi.addressof(plan, "use"))
        self.use.enter()  # the cache's claim, dropped by close()
        plan.generation = info.generation
        plan.nbytes = info.nbytes
        plan.flags = native.lib.MEMSEM_PLAN_WRITABLE if self.writable else 0
        plan.local_gen = info.generation
        plan.local_seq = FIRST_VERSION << 1
        if cb is not None:
            plan.gen_addr = cb.generation_addr
            plan.seq_addr = cb.seq_addr
            plan.latest_addr = cb.latest_addr
            plan.nslots = cb.n_slots
            try:
                self.slot = inflight_slots.claim(cb, self.resolver.me)
            except inflight_slots.InflightSlotsFull as exc:
                raise MemsemError(f"window gva {info.gva:#x}: all {cb.n_inflight} in-flight slots are "
                                  f"held by live processes (pids {exc.holders}); a window serves at most "
                                  f"{cb.n_inflight} same-node participants at once") from None
            plan.inflight_addr = cb.inflight_slot_addr(self.slot) + I_COUNT  # the slot's count
            plan.slot_stride = cb.slot_stride
        else:
            plan.gen_addr = int(_ffi.cast("uintptr_t", _ffi.addressof(plan, "local_gen")))
            plan.seq_addr = int(_ffi.cast("uintptr_t", _ffi.addressof(plan, "local_seq")))
            plan.nslots = 1
        d = remote.direct
        self.direct = d is not None and cb is not None
        self.strategy: CopyRoute = route_for(self)
        if self.direct:
            plan.base = d.address
            plan.pid = d.pid
            plan.method = native.COPY_VM if d.cma else native.COPY_MEMCPY
        if not own_cb and not peer.is_self:
            plan.checked_addr = peer.checked_addr  # the owner's word, kept alive by self.peer
            plan.check_every_ns = int(LIVENESS_INTERVAL_S * 1e9)
            plan.check_bytes = LIVENESS_CHECK_BYTES
        if own_cb:
            cb.pin()  # the owner's block: held for as long as this resolution
        core.telemetry.track(self)
        peer.watchers[id(self)] = weakref.ref(self)

    # -- lifetime ---------------------------------------------------------------------------------
    def enter(self) -> bool:
        """Count a copy made outside ``memsem_plan_copy`` (engine routes). False when closed."""
        return self.use.enter()

    def wait_sequence(self, version: int, slice_s: float) -> bool:
        """Sleep at most ``slice_s`` s on the word an open write section (or the commit of the
        version asked for) will move: the sequence word of ``version``'s slot, or with two slots
        and ``version`` 0 (the latest) the latest-version word; a futex wait, woken by the
        section's close. Held while waiting, so nothing unmaps the word. False when there is no
        word to wait on (no control block here, or the resolution is closed): nothing was
        waited."""
        cb = self.cb
        if cb is None or not self.enter():
            return False
        try:
            if cb.n_slots > 1 and not version:
                a = cb.latest_addr
            else:
                a = cb.seq_addr + 8 * ((version % cb.n_slots) if cb.n_slots > 1 else 0)
            native.futex_wait(a, native.load_acquire(a) & 0xFFFFFFFF, slice_s)
        finally:
            self.leave()
        return True

    def leave(self) -> None:
        if self.use.leave():
            self.release()

    def close(self) -> None:
        """Drop the cache's claim; released now, or by the last running copy."""
        if self.use.close() == 2:
            return
        if self.use.leave():
            self.release()

    @property
    def closed(self) -> bool:
        return self.use.closed

    def release(self) -> None:
        """Release what the resolution holds. Called exactly once, when closed and idle."""
        if self._released:
            return
        self._released = True
        self.keeper[0] = None  # refs keeping this route let go of it (its plan is closed)
        self._core.telemetry.absorb(self)
        self.peer.watchers.pop(id(self), None)
        cb = self.cb
        for r in [self.remote, *self._remotes.values()]:
            try:
                r.close()
            except MemsemError:
                pass
        self._remotes.clear()
        if cb is not None:
            if self.slot >= 0:
                inflight_slots.release(cb, self.slot, self.resolver.me)
            if self.own_cb:
                cb.unpin()
            else:
                cb.close()

    def remote_for(self, spec: RefSpec) -> RemoteRegion:
        """The remote region to move ``spec``'s bytes through: on owner-checked routes each mint
        has its own credential (the owner serves each only its minted range), so a ref of
        another mint than the one this resolution was made with gets a region of its own."""
        m = spec.mint
        if m is self.mint or m == self.mint or self.engine.enforces_generation != GenerationCheck.OWNER:
            return self.remote
        r = self._remotes.get(spec.mint)
        if r is None:
            if len(self._remotes) >= MINT_REMOTES_LIMIT:
                old = self._remotes.pop(next(iter(self._remotes)))
                old.close()
            r = self._remotes[spec.mint] = self.engine.attach(self.info.descriptors[self.route.engine],
                                                              self.info.nbytes, owner_credential(spec))
        return r

    # -- hot-path helpers -------------------------------------------------------------------------
    def peer_checked(self) -> None:
        """The plan asked for a liveness re-check: do it (raises PeerLostError when dead). The
        plan reads the time of the owner's last check from the owner's word (``Peer``), so
        one check answers for every window of that owner."""
        peer = self.peer
        ok = peer.alive()
        if not ok:
            raise peer.lost(self.info_label())

    def info_label(self) -> str:
        i = self.info
        return f"window {i.name!r} (gva {i.gva:#x})" if i.name else f"window gva {i.gva:#x}"

    def __repr__(self) -> str:
        return f"<Resolution {self.info_label()} gen {self.generation} {self.route.kind}{' closed' if self.closed else ''}>"


class Resolver:
    """The runtime's cache of resolutions, by GVA (one generation each), bounded by ``limit``,
    which follows the working set from ``limit`` up to ``cap`` (see the module docstring).

    Attributes:
        limit: the bound now (resolutions). cap: the most it grows to. grown: how many times
            it doubled (each time a window it dropped for the bound was resolved again).
    """

    def __init__(self, core: "RuntimeCore", limit: int = RESOLUTION_LIMIT, cap: int = RESOLUTION_CAP) -> None:
        self._core = core
        #: this runtime's segment directory and place, read once (``segment_dir()``, ``core.location``)
        self._folder = native.segment_dir()
        self._here = core.location
        #: this process's identity word (what its in-flight slots hold)
        self.me = identity_word(core.identity.pid, core.identity.start_time)
        self.limit = limit
        self.cap = max(cap, limit)
        self.grown = 0
        #: gva -> Resolution, in insertion order (the oldest is dropped first past ``limit``)
        self.cache: dict[int, Resolution] = {}
        #: (gva, generation) of resolutions dropped for the bound, oldest first (at most ``cap``)
        self._ghosts: dict[tuple[int, int], None] = {}
        #: (gva, generation) -> the owner of a window this runtime dropped (bounded): when its
        #: record is gone, a re-resolve asks that owner again (a re-check, never a remembered
        #: verdict) and says PeerLostError for a lost one, not WindowNotFoundError. Keyed by
        #: generation too: a new owner may reuse the GVA.
        self._owners: dict[tuple[int, int], Peer] = {}
        #: (gva, generation) -> [record, holders]: records handed out with refs (an unlisted
        #: window's, ``carry``), resolved from instead of the directory while a holder runs
        self._carried: dict[tuple[int, int], list] = {}
        self._lock = threading.RLock()

    def resolve(self, spec: RefSpec, info: WindowInfo | None = None) -> Resolution:
        """The resolution for ``spec`` (cached, or made now). ``info``: the window's directory
        record as the caller just read and parsed it (a lookup), used instead of reading and
        checking it again.

        Raises:
            RuntimeClosedError, WindowNotFoundError / StaleReferenceError, AccessDeniedError,
            PeerLostError, ValueError (the ref's range lies outside the window), NotSupportedError
            (no route).
        """
        core = self._core
        if core.closed:
            core.check_open()
        res = self.cache.get(spec.gva)
        if res is not None and res.generation == spec.generation and res.key == spec.key and not res.closed:
            return res
        with self._lock:
            if core.closed:
                core.check_open()
            res = self.cache.get(spec.gva)
            if res is not None and not res.closed and res.generation == spec.generation:
                if res.key == spec.key:
                    return res
                # A cached resolution serves only the key it was verified with: a forged ref
                # with a known GVA and generation must not ride on someone else's resolution.
                if not key_matches(spec.key, res.info.key_digest):
                    raise tr.wrong_key(spec)
                return res
            if res is not None:
                self.drop(spec.gva)
            res = self._make(spec, info=info)
            if self.cache:
                self._sweep(SWEEP_PER_RESOLVE)
            self.cache[spec.gva] = res
            if self._ghosts.pop((spec.gva, spec.generation), 0) is None and self.limit < self.cap:
                self.limit = min(self.cap, 2 * self.limit)  # the working set is larger than the bound
                self.grown += 1
            while len(self.cache) > self.limit:
                oldest = next(iter(self.cache))
                gen = self.cache[oldest].generation
                self.drop(oldest)
                self._ghosts[(oldest, gen)] = None
                if len(self._ghosts) > self.cap:
                    del self._ghosts[next(iter(self._ghosts))]
            return res

    @contextlib.contextmanager
    def carry(self, spec: RefSpec, record: Any) -> Iterator[WindowInfo]:
        """While the block runs, ``spec``'s window resolves from ``record`` (the window's record
        as its owner handed it out with the ref: ``Publisher.record``; an unlisted window has no
        other) instead of a directory read. The record is checked as a directory's would be:
        the ref's key against its digest, the generation against the window's control block
        (this node) or its owner (another node), the owner's liveness. Blocks may nest and run
        in several threads at once; a resolution made inside one outlives it (cached as any).

        Yields:
            The parsed record.

        Raises:
            ValueError: ``record`` does not parse (naming the field), or is not the record of
                ``spec``'s window at ``spec``'s generation.
        """
        info = WindowInfo.from_json(record)
        if (info.gva, info.generation) != (spec.gva, spec.generation):
            raise ValueError(f"record is of window gva {info.gva:#x} generation {info.generation}, not of "
                             f"{spec.label} (generation {spec.generation})")
        k = (spec.gva, spec.generation)
        with self._lock:
            held = self._carried.setdefault(k, [info, 0])
            held[1] += 1
        try:
            yield info
        finally:
            with self._lock:
                held[1] -= 1
                if held[1] <= 0 and self._carried.get(k) is held:
                    del self._carried[k]

    def resolve_direct(self, spec: RefSpec) -> Resolution:
        """A new resolution of ``spec`` whose plan reaches the window's memory from this process
        (``direct``), made without the runtime's ``prefer`` (which may force this process's own
        window onto the tcp route): what the owner's side of an owner-checked engine (tcp)
        serves through. Never cached: the caller owns it and closes it (no cache bound or
        eviction closes it under a copy).

        Raises:
            As ``resolve``; MemsemError when the window cannot be reached directly from here.
        """
        with self._lock:
            self._core.check_open()
            d = self._make(spec, prefer=None)
        if not d.direct:
            d.close()
            raise MemsemError(f"{spec.label}: no direct route from its owner's own process "
                              f"(route {d.route.kind}); cannot serve it")
        return d

    def generation_now(self, spec: RefSpec) -> int | None:
        """The generation the directory records for ``spec``'s window now (None: not published):
        what tells a moved generation from another failure on routes that cannot read the
        window's control block (another node)."""
        rec = self._core.directory.get_window(spec.gva)
        if rec is None:
            return None
        g = rec.get("generation")
        return g if type(g) is int else None

    def _sweep(self, n: int) -> None:
        """Drop up to ``n`` of the oldest cached resolutions whose window moved on (retired or
        republished): their mappings would only keep unlinked memory alive."""
        for gva, r in list(itertools.islice(self.cache.items(), n)):  # the oldest n, not a copy of all
            cb = r.cb
            if cb is None or not r.enter():
                continue
            try:
                moved = cb.generation != r.generation
            finally:
                r.leave()
            if moved:
                self.drop(gva, r)

    def drop(self, gva: int, res: Resolution | None = None) -> None:
        """Forget the resolution of ``gva`` (only ``res`` if given); it is released when idle."""
        with self._lock:
            cur = self.cache.get(gva)
            if cur is None or (res is not None and cur is not res):
                return
            del self.cache[gva]
            if not cur.own_cb and not cur.peer.is_self:
                self._owners[(gva, cur.generation)] = cur.peer
                while len(self._owners) > 4 * self.limit:
                    del self._owners[next(iter(self._owners))]
        cur.close()

    def close(self, timeout: float) -> list[Resolution]:
        """Drop every resolution and wait up to ``timeout`` s for copies running through them;
        returns the ones still busy (they release themselves when their last copy ends)."""
        with self._lock:
            all_ = list(self.cache.values())
            self.cache.clear()
            self._ghosts.clear()
        for r in all_:
            r.close()
        deadline = native.monotonic_ns() + int(timeout * 1e9)
        busy = []
        for r in all_:
            left = max(0.0, (deadline - native.monotonic_ns()) / 1e9)
            if not r.use.wait_idle(left):
                busy.append(r)
        return busy

    # -- making one -------------------------------------------------------------------------------
    def _missing(self, spec: RefSpec) -> MemsemError:
        """The error for ``spec``'s window, whose record is not in the directory: its owner died
        (PeerLostError), or it is not published (WindowNotFoundError, with a hint when the job
        name may differ between processes)."""
        core = self._core
        rank, _ = split_gva(spec.gva)
        owner = self._owners.get((spec.gva, spec.generation))
        if owner is not None and not owner.alive():  # asked again, not remembered
            return owner.lost(spec.label)
        rrec = core.directory.rank_record(rank)
        if rrec is not None and not record_alive(rrec):
            return PeerLostError(f"the owner of {spec.label} (rank {rank}, pid {rrec.get('pid')}) is dead")
        if (spec.gva, spec.generation) in core.publisher.retired:  # unpublished here: no job question
            return WindowNotFoundError(f"{spec.label} is not published: this runtime (rank {rank}) "
                                       "unpublished it; the ref is stale", window=spec.name,
                                       expected=spec.generation)
        d = core.directory
        hint = (f"; or it is published in another job (this runtime's job {d.job!r} was derived "
                "from its process group: set MEMSEM_JOB to the same name in every process that "
                "shares refs)") if job_is_derived(getattr(d, "job", "")) else ""
        return WindowNotFoundError(f"{spec.label} is not published (unpublished, or its owner "
                                   f"exited): the ref is stale{hint}", window=spec.name,
                                   expected=spec.generation)

    def _make(self, spec: RefSpec, prefer: str | None | bool = True, info: WindowInfo | None = None) -> Resolution:
        """A new resolution; ``prefer`` True takes the runtime's preference, else that one;
        ``info``: the window's directory record, read and parsed by the caller just now."""
        core = self._core
        owned = core.publisher.owned.get(spec.gva)
        if owned is not None:
            info, cb, own_cb = owned.info, owned.cb, True
        else:
            if info is None:
                held = self._carried.get((spec.gva, spec.generation))
                info = held[0] if held is not None else None
            if info is None:
                rec = core.directory.get_window(spec.gva)
                if rec is None:  # its owner may be re-claiming its rank after a directory outage
                    rec = core.peers.reread(split_gva(spec.gva)[0], lambda: core.directory.get_window(spec.gva))
                    if rec is None:
                        raise self._missing(spec)
                info = WindowInfo.from_json(rec)  # ValueError naming the field of a corrupt record
            cb, own_cb = None, False
        if not key_matches(spec.key, info.key_digest):
            if info.generation != spec.generation:  # republished: new generation, new key
                raise tr.stale(spec, info.generation)
            raise tr.wrong_key(spec)
        if spec.offset < 0 or spec.offset + spec.nbytes > info.nbytes:
            raise tr.out_of_range(spec, spec.offset, spec.offset + spec.nbytes, info.nbytes)
        peer = core.peers.get(info.owner_pid, info.owner_start, info.node, info.rank, what=spec)
        if info.generation != spec.generation:
            raise tr.stale(spec, info.generation)
        if cb is None and info.node == core.identity.node and info.control:
            try:
                cb = ControlBlock.attach(info.control, self._folder)
            except WindowNotFoundError:
                raise tr.stale(spec, None) from None
            except (ValueError, EngineError) as exc:
                raise WindowNotFoundError(f"{spec.label}: its control block is unusable ({exc})",
                                          window=spec.name, expected=spec.generation) from None
            if cb.generation != spec.generation:
                found = cb.generation
                cb.close()
                raise tr.stale(spec, found)
        try:
            route = choose_route(self._here, Location(info.node, info.owner_pid), info.descriptors,
                                 core.available, nbytes=info.nbytes, prefer=core.prefer if prefer is True else prefer)
            eng = core.engines[route.engine]
            cred = owner_credential(spec) if eng.enforces_generation == GenerationCheck.OWNER else b""
            # a double-buffered window's registration spans its slots (nbytes is one slot)
            span = remote_span(info) if cb is None else max(info.nbytes, cb.n_slots * cb.slot_stride)
            try:
                remote = eng.attach(info.descriptors[route.engine], span, cred)
            except WindowNotFoundError:
                raise tr.stale(spec, None) from None
            except EngineError as exc:
                raise tr.chain(tr.engine_failure(exc, spec, peer, "attach"), exc)
            try:
                return Resolution(core, info, spec.key, route, eng, remote, cb, own_cb, peer, spec.mint)
            except BaseException:
                remote.close()
                raise
        except BaseException:
            if cb is not None and not own_cb:
                cb.close()
            raise


def remote_span(info: WindowInfo) -> int:
    """Bytes a route to ``info``'s window on another node reaches: one data slot, or both slots
    of a double-buffered window (its record says ``slots`` and ``slot_stride``).

    Raises:
        ValueError: the record's slot fields are malformed (a corrupted directory record).
    """
    slots = info.extra.get("slots", 1)
    if slots == 1:
        return info.nbytes
    stride = info.extra.get("slot_stride", 0)
    if (type(slots) is not int or type(stride) is not int or slots != 2
            or not info.nbytes <= stride <= info.nbytes + (1 << 16)):
        raise ValueError(f"window record of gva {info.gva:#x}: malformed slots {slots!r} / slot_stride "
                         f"{stride!r} for a window of {info.nbytes} bytes")
    return 2 * stride


def owner_credential(spec: RefSpec) -> Credential:
    """The credential an owner-checked route shows for ``spec``: its token (window and mint) and
    proofs of its access key for the owner's challenges (the key itself is never sent)."""
    token = credential_token(spec)
    key = spec.key
    return Credential(token, lambda challenge: credential_proof(key, challenge, token))


__all__ = ["RESOLUTION_CAP", "RESOLUTION_LIMIT", "Resolution", "Resolver", "RuntimeClosedError", "owner_credential"]
