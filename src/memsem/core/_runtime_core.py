"""The runtime core: one process's memsem runtime, composed of one part per concern.

=================  =========================================================================
part               concern (module)
=================  =========================================================================
``publisher``      owned windows: publish, write sections, retire, unpublish, alloc (_publish)
``names``          names: one owner each (claims), lookups that wait for a name (_names)
``resolver``       resolutions of windows and their lifetimes (_resolve)
``transfers``      get / put / xcopy / async (_transfer)
``readiness``      tile-ready words (_readiness)
``server``         owner side of owner-checked engines: grants (_serve)
``peers``          liveness of owners (_liveness)
``telemetry``      counters (_telemetry)
=================  =========================================================================

The core works on :class:`memsem.gva.RefSpec`. ``memsem.Runtime`` (on top of every layer) is
this class plus the entry points of the layers above core (refs, pipelines, state dicts,
followers), each a call into its layer with the runtime itself: one object that users hold and
parts receive. Every runtime memsem makes for a user is of that class: the default runtime is
made by the class ``memsem.Runtime`` registers here when imported (``set_runtime_class``; the
layers below it never import it). This is the one place that checks generation, lease and
permission; engine errors become memsem errors in ``_translate``.

Lifetimes: closing waits (within its timeout) for copies running through this runtime's
resolutions and releases each mapping when its last user is done, never under it; queued
asynchronous work ends CANCELLED; later calls raise ``RuntimeClosedError``. After ``fork()``
the child owns nothing of its parent: an inherited runtime is unusable there (its calls raise
``RuntimeClosedError``, its close and finalizers touch nothing shared), so a child never unlinks,
retires or bumps its parent's windows.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextvars
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from memsem import _args
from memsem._errors import MemsemError, NotSupportedError, RuntimeClosedError
from memsem.directory import Directory, open_directory
from memsem.engines import Availability, Engine, EngineContext, engine_class
from memsem.gva import RefSpec
from memsem.native import ProcessIdentity
from memsem.core._completion import Completion
from memsem.core._lease import Lease
from memsem.core._liveness import Peers, record_alive
from memsem.core._names import Names
from memsem.core._publish import Publisher
from memsem.core._async import AsyncWordWaiter
from memsem.core._readiness import Readiness
from memsem.core._remote import RemoteWords
from memsem.core._resolve import Resolution, Resolver
from memsem.core._serve import Grant, Server
from memsem.core._staging import StagingPool
from memsem.core._telemetry import Stats, Telemetry
from memsem.core._transfer import Transfers
from memsem.core._versions import Versions
from memsem.core._view import view as _view
from memsem.topology import Location, Route

log = logging.getLogger(__name__)

#: default bound in seconds of every blocking call of a runtime
DEFAULT_TIMEOUT = _args.DEFAULT_TIMEOUT_S
#: default bound of ``close()``: copies in flight and leases get this long to end
CLOSE_TIMEOUT = 5.0

_current: contextvars.ContextVar["RuntimeCore | None"] = contextvars.ContextVar("memsem_runtime", default=None)
_instances: "weakref.WeakSet[RuntimeCore]" = weakref.WeakSet()
_order = 0


class _Context(EngineContext):
    """What the runtime shows its engines (see ``Engine.bind``)."""

    def __init__(self, core: "RuntimeCore") -> None:
        self._core = weakref.ref(core)
        self.directory = core.directory
        self.timeout = core.timeout
        self.identity = core.identity
        self.rank = core.rank

    def _c(self) -> "RuntimeCore":
        c = self._core()
        if c is None:
            raise RuntimeClosedError("the runtime of this engine is gone")
        return c

    def serve_open(self, token: bytes, challenge: bytes, proof: bytes) -> Grant:
        c = self._c()
        c.check_open()
        return c.server.open(token, challenge, proof)

    def peer_alive(self, pid: int, start: int, node: str, rank: int = -1) -> bool:
        return self._c().peers.alive(pid, start, node, rank)


class _Timeout:
    """``RuntimeCore.timeout``: read as a plain attribute (no call: every resolution and wait
    reads it), checked when set (seconds > 0, else TypeError / ValueError naming it). A data
    descriptor with no ``__get__``: reads find the instance's own value."""

    def __set__(self, obj: Any, value: float) -> None:
        vars(obj)["timeout"] = _args.timeout(value, "timeout", positive=True)


class RuntimeCore:
    """A process's memsem runtime: owns its windows, resolves others', moves bytes. Users hold
    its subclass ``memsem.Runtime`` (the same object, with the entry points of the layers above).

    Args:
        directory: ``"local"`` (default; or ``MEMSEM_DIRECTORY``) or ``"redis://host:port/db"``.
        engines: engine names to enable; default ``MEMSEM_ENGINES`` (comma-separated) or
            loopback and host (others by name, e.g. ``("loopback", "host", "mte")``). An engine named here that is unavailable raises
            NotSupportedError naming it (never a silent fallback).
        engine_objects: ready engine instances (e.g. a ScriptedEngine for tests), by name;
            they replace the named ones.
        job: namespace of the directory (``MEMSEM_JOB``).
        timeout: default bound in seconds of every blocking call (> 0).
        prefer: engine to force for routes (``explain`` shows the alternatives).
        workers: threads of the pool that runs asynchronous transfers.

    Thread safety: all methods may be called from several threads.
    """

    def __init__(self, *, directory: str | None = None, engines: Sequence[str] | None = None,
                 engine_objects: dict[str, Engine] | None = None, job: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, prefer: str | None = None, workers: int = 4) -> None:
        global _order
        self.timeout = timeout
        workers = _args.count(workers, "workers", minimum=1, maximum=256)
        if prefer is not None and not isinstance(prefer, str):
            raise TypeError(f"prefer must be an engine name or None, got {prefer!r}")
        self.prefer = prefer
        self.identity = ProcessIdentity.current()
        self._pid = os.getpid()
        #: True once closed, and in a process forked from the one that made this runtime (plain
        #: attributes: the hot path of every get reads ``closed``)
        self.closed = False
        #: True in a process forked from the one that made this runtime (it owns nothing here)
        self.forked = False
        self._lock = threading.RLock()
        self.telemetry = Telemetry()
        self.leases: "weakref.WeakSet[Lease]" = weakref.WeakSet()
        #: objects of higher layers (pipelines) closed before this runtime closes
        self.children: "weakref.WeakSet[Any]" = weakref.WeakSet()
        #: one object per runtime of a higher layer, by name (``part``), closed like children
        self._parts: dict[str, Any] = {}
        #: threads for CPU work that drops the GIL (``cpu_map``), made on first use
        self._cpu: cf.ThreadPoolExecutor | None = None
        self.engines: dict[str, Engine] = {}
        self.available: dict[str, Availability] = {}
        names = list(engines) if engines is not None else default_engines(directory)
        objs = dict(engine_objects or {})
        for name in names + [n for n in objs if n not in names]:
            if name in objs:
                self.engines[name] = objs[name]
                self.available[name] = Availability(True)
                continue
            cls = engine_class(name)
            avail = cls.probe()
            self.available[name] = avail
            if not avail:
                raise NotSupportedError(f"engine {name!r} was requested but is unavailable here: {avail.reason}")
            self.engines[name] = cls.create()
        self.location_attrs: dict[str, Any] = {}
        for eng in self.engines.values():
            self.location_attrs.update(eng.location_attrs)
        from memsem.core._gc import collect

        collect(dry_run=False)  # reap segments of dead processes of this user (cheap: one listdir)
        self.directory: Directory = open_directory(directory, job=job, alive=record_alive)
        rec = {"pid": self.identity.pid, "start": self.identity.start_time, "node": self.identity.node}
        self.rank = self.directory.claim_rank(rec)
        self.peers = Peers(self.directory)
        self.resolver = Resolver(self)
        self.names = Names(self)
        self.publisher = Publisher(self)
        self.server = Server(self)
        self.mirrors = RemoteWords(self)
        self.readiness = Readiness(self, self.mirrors)
        self.versions = Versions(self)
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="memsem-rt")
        #: an object unique to this runtime that keeps nothing alive: what a ref's kept route
        #: (``memsem.core._routes.PlanRoute``) compares with, by identity, to know it was made here
        self.token = object()
        self.transfers = Transfers(self, self.resolver, self._pool, self.mirrors, workers)
        self._word_waiter: AsyncWordWaiter | None = None
        self.staging = StagingPool()
        self._token: contextvars.Token | None = None
        _order += 1
        self._order = _order
        _instances.add(self)
        ctx = _Context(self)
        for eng in self.engines.values():
            eng.bind(ctx)

    # -- context ---------------------------------------------------------------------------------
    def __enter__(self) -> Any:
        self._token = _current.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            try:
                _current.reset(self._token)
            except ValueError:  # exited in another context (a generator, a thread)
                pass
            self._token = None
        self.close()

    #: the default bound in seconds of this runtime's blocking calls (settable, > 0)
    timeout = _Timeout()

    def check_open(self) -> None:
        """Raise RuntimeClosedError when closed (or inherited through fork)."""
        if self.closed:
            if self.forked:
                raise RuntimeClosedError(
                    f"this memsem runtime (rank {self.rank}) belongs to pid {self._pid}; this process "
                    f"(pid {os.getpid()}) was forked from it and owns nothing of it: create a new "
                    "Runtime here (refs bound to the parent's runtime use this process's default one)")
            raise RuntimeClosedError(f"memsem runtime (rank {self.rank}) is closed")

    @property
    def location(self) -> Location:
        return Location(self.identity.node, self.identity.pid, self.location_attrs)

    def engine(self, name: str) -> Engine:
        """The enabled engine ``name`` (``engines`` maps every enabled one by name).

        Raises:
            NotSupportedError: ``name`` is not enabled here.
        """
        try:
            return self.engines[name]
        except KeyError:
            raise NotSupportedError(f"engine {name!r} is not enabled in this runtime "
                                    f"(enabled: {', '.join(self.engines)})") from None

    # -- owner side (publisher) --------------------------------------------------------------------
    def alloc(self, shape: int | Sequence[int], dtype: Any = np.float32, *,
              engine: str | None = None) -> np.ndarray:
        """A zero-filled array in a shared segment (mode 0600, unguessable name), ready to be
        published for zero-copy ``view()`` by same-node consumers.

        ``engine="mte"`` allocates from the SHMEM symmetric heap instead (a collective call:
        every PE of the team makes it with the same shape and dtype in the same order); its
        windows are reached by the PEs of the team through route ``mte``. That memory is
        released by ``rt.engine("mte").free(arr)`` (collective) or when the team closes.

        Raises:
            OutOfMemoryError: the segment directory (tmpfs) cannot hold ``shape`` x itemsize bytes;
                checked now, so no SIGBUS happens later (or the symmetric heap is full).
            NotSupportedError: ``engine`` is not enabled here or cannot allocate memory.
        """
        return self.publisher.alloc(shape, dtype, engine=engine)

    def publish_spec(self, obj: Any, *, name: str | None = None, access: str | None = None,
                     tile_bytes: int | None = None, tiles: int | None = None, slots: int = 1,
                     write_guard: str | None = None, replace: bool = False, listed: bool = True) -> RefSpec:
        """``listed=False``: no directory record (``Publisher.publish``)."""
        return self.publisher.publish(obj, name=name, access=access, tile_bytes=tile_bytes, tiles=tiles,
                                      slots=slots, write_guard=write_guard, replace=replace, listed=listed)

    def unpublish_spec(self, spec_or_name: RefSpec | str, *, timeout: float | None = None) -> None:
        self.publisher.unpublish(spec_or_name, timeout=timeout)

    def lookup_spec(self, name: str, timeout: float = 0.0, *, stop: Callable[[], None] | None = None) -> RefSpec:
        """``stop``: the caller's check after every slice of the wait (``Wait``'s ``stop``)."""
        return self.names.lookup(name, timeout, stop=stop)

    def write_section(self, ref: Any, *, copy: bool = True, timeout: float | None = None,
                      counted: bool = True) -> Any:
        """Owner: open a write section on a window (a ref or a name) or a set of windows (a list
        of them); a context manager giving a :class:`memsem.core.WriteSection`.

        While it is open no reader returns bytes of the version being written as valid: on a
        single-slot window readers wait (up to their timeout) for the close, or retry a copy it
        tore; on a double-buffered window (``slots=2``) they keep reading the latest version,
        untouched. Leaving the block publishes the next version of each window (release
        store, readers and ``wait_version`` waiters woken). A body that raises publishes
        nothing (see ``WriteSection``).

        ``section.array()`` is the memory to write: the window's own memory (single slot; the
        published object itself may be written as well) or the target slot (double-buffered;
        filled with the latest version's bytes first when ``copy``, so in-place updates work;
        ``copy=False`` when every byte is rewritten).

        Blocking: opening waits (up to ``timeout`` s, default the runtime's) for leases that
        pin a version the section overwrites (``TensorRef.pin``): never longer than they last.

        An open section holds its window's memory: an ``unpublish`` or republish from another
        thread waits for it to close (within its own timeout), one from the section's own
        thread is refused, and a runtime closed under it keeps the memory until the section
        ends, whose commit then raises ``WindowRetiredError`` (nothing published).

        Writes by the owner outside a write section are invisible to readers' checks: a reader
        may then get a mixture of old and new bytes with no error. The ``write_guard`` of
        ``publish`` makes such writes loud in debug and tests.

        Args:
            ref: a ``TensorRef`` (or its ``RefSpec``), a window name, or a list of them.
            counted: False for memsem's own bookkeeping (not counted in
                ``stats().write_sections``).

        Raises:
            LeaseHeldError: pinned leases outlasted ``timeout``. OwnerWriteError: the checksum
            guard found the latest version changed outside a section. WindowNotFoundError: this
            runtime owns no such window. StaleReferenceError: an old ref (WindowRetiredError:
            the window is being retired). MemsemError: a section is already open on it.
            TypeError: ``ref`` is none of the above.
        """
        if isinstance(ref, (list, tuple)):
            target: Any = [window_of(r, f"ref[{i}]") for i, r in enumerate(ref)]
        else:
            target = window_of(ref, "ref")
        self.check_open()
        return self.publisher.write_section(target, copy=copy, timeout=timeout, counted=counted)

    def watch_commits(self, spec: RefSpec, watcher: Any) -> Any:
        """Owner: tell ``watcher`` (a ``memsem.core.CommitWatch``) every commit of ``spec``'s
        window and its retire; returns the window's ``CommittedSlots``."""
        self.check_open()
        return self.publisher.watch_commits(spec, watcher)

    # -- parts of higher layers, and CPU work -------------------------------------------------------
    def part(self, name: str, make: Callable[[], Any]) -> Any:
        """The one object ``name`` of a higher layer this runtime holds (``make()`` on first
        use); closed (``close()``) before this runtime closes, like ``children``."""
        with self._lock:
            self.check_open()
            obj = self._parts.get(name)
            if obj is None:
                obj = self._parts[name] = make()
            return obj

    def cpu_map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]`` on this runtime's CPU threads (``os.cpu_count()``, at most
        16; made on first use), for native work that drops the GIL (digests of tiles). Blocking;
        the first error is raised after every call ended. Never call it from inside ``fn``."""
        if len(items) <= 1:
            return [fn(x) for x in items]
        with self._lock:
            self.check_open()
            if self._cpu is None:
                self._cpu = cf.ThreadPoolExecutor(max_workers=cpu_threads(), thread_name_prefix="memsem-cpu")
            pool = self._cpu
        futs = [pool.submit(fn, x) for x in items]
        cf.wait(futs)
        return [f.result() for f in futs]

    # -- versions (consumer side: _versions) -------------------------------------------------------
    def latest_version(self, spec: RefSpec) -> int:
        return self.versions.latest(spec)

    def wait_version(self, spec: RefSpec, at_least: int, timeout: float | None = None, *,
                     stop: Callable[[], None] | None = None) -> int:
        """The one consumer-side version wait (cross-node routes plug in behind it)."""
        return self.versions.wait(spec, at_least, timeout, stop=stop)

    async def wait_version_async(self, spec: RefSpec, at_least: int, timeout: float | None = None) -> int:
        return await self.versions.wait_async(spec, at_least, timeout)

    def pin_version(self, spec: RefSpec, *, version: int = 0, ttl: float | None = 10.0,
                    timeout: float | None = None) -> Lease:
        return self.versions.pin(spec, version=version, ttl=ttl, timeout=timeout)

    def gather(self, spec: RefSpec, ranges: Any, *, version: int = 0, lease: Lease | None = None,
               keep: Any = None) -> int:
        return self.versions.gather(spec, ranges, version=version, lease=lease, keep=keep)

    def digest_runs(self, spec: RefSpec, runs: Any, *, version: int = 0,
                    lease: Lease | None = None) -> tuple[int, bytes]:
        """``(version, digest)`` of byte runs of one version, computed where the window lives
        (``Versions.digest``: only the digest crosses a link)."""
        return self.versions.digest(spec, runs, version=version, lease=lease)

    def lease_holders(self, ref: Any) -> list[tuple[int, float]]:
        """Owner: ``(pid, seconds left)`` of the unexpired leases live processes hold on a window
        this runtime owns (``ref``: a ``TensorRef``, its ``RefSpec`` or the window's name)."""
        target = window_of(ref, "ref")
        self.check_open()
        return self.publisher.lease_holders(self.names.lookup(target) if isinstance(target, str) else target)

    def wait_unleased(self, spec: RefSpec, timeout: float) -> list[tuple[int, float]]:
        """Owner: wait up to ``timeout`` s for every lease on ``spec``'s window to end; returns
        the holders left (``(pid, seconds left)``; empty: none). The window stays open to new
        leases."""
        self.check_open()
        return self.publisher.wait_unleased(spec, _args.timeout(timeout, "timeout"))

    # -- consumer side ---------------------------------------------------------------------------
    def resolve(self, spec: RefSpec) -> Resolution:
        return self.resolver.resolve(spec)

    def route_of(self, spec: RefSpec) -> Route:
        """The route this runtime uses for ``spec`` (resolving it if needed)."""
        return self.resolver.resolve(spec).route

    def get_spec(self, spec: RefSpec, out: Any = None, *, lease: Lease | None = None, version: int = 0) -> np.ndarray:
        return self.transfers.get(spec, out, lease=lease, version=version)

    def transfer(self, spec: RefSpec, kind: str, offset: int, local: np.ndarray, *,
                 lease: Lease | None = None, signal_tile: int | None = None, version: int = 0) -> int:
        """Move ``local.nbytes`` bytes between ``local`` (flat uint8) and the window at
        ``spec.offset + offset``; ``kind`` is "get" or "put". Blocking, remote completion;
        returns the version read or overwritten."""
        return self.transfers.transfer_array(spec, kind == "put", offset, local, lease=lease, version=version,
                                             signal_tile=signal_tile)

    def submit(self, what: str, fn: Any) -> Completion:
        return self.transfers.submit(what, fn)

    def view_spec(self, spec: RefSpec, *, lease: Lease | None = None) -> np.ndarray:
        return _view(self, spec, lease=lease)

    def lease(self, ref: Any, ttl: float | None = 10.0, *, version: int = 0) -> Lease:
        """A lease on ``ref``'s window (a ``TensorRef`` or its ``RefSpec``), acquired on
        ``with`` entry or by ``acquire()``.

        Args:
            ttl: seconds until expiry unless renewed; None holds until release (reaped if this
                process dies).
            version: a version the lease pins (the owner's write sections do not overwrite it
                while the lease lasts); 0 pins none. ``TensorRef.pin`` pins the latest one.
        """
        return Lease(self, window_of(ref, "ref", names=False), ttl, version=version)

    # -- readiness -------------------------------------------------------------------------------
    def mark_ready(self, spec: RefSpec, tile: int) -> None:
        self.readiness.mark(spec, tile)

    def is_ready(self, spec: RefSpec, tile: int) -> bool:
        return self.readiness.is_ready(spec, tile)

    def ready_tiles(self, spec: RefSpec) -> list[int]:
        return self.readiness.ready_tiles(spec)

    def wait_tile(self, spec: RefSpec, tile: int, timeout: float | None = None, *,
                  stop: Callable[[], None] | None = None) -> None:
        self.readiness.wait(spec, tile, timeout, stop=stop)

    async def wait_tile_async(self, spec: RefSpec, tile: int, timeout: float | None = None) -> None:
        await self.readiness.wait_async(spec, tile, timeout)

    # -- the owner's windows ---------------------------------------------------------------------
    def owns(self, spec: RefSpec) -> bool:
        """Whether this runtime publishes ``spec``'s window (any generation)."""
        return spec.gva in self.publisher.owned

    def window_memory(self, spec: RefSpec) -> np.ndarray:
        """Owner: the memory of a single-slot window this runtime publishes, as a flat uint8
        array over it (no copy): what its write sections change in place.

        Raises:
            WindowNotFoundError / WindowRetiredError: not a live window of this runtime.
            ValueError: a double-buffered window (its versions alternate between two slots).
        """
        self.check_open()
        owned = self.publisher.owned_for(spec)
        if owned.n_slots != 1:
            raise ValueError(f"{owned.label} is double-buffered (slots=2): its memory alternates between "
                             "two slots; publish it with slots=1 to change it in place")
        return owned.slot_array(0).reshape(-1).view(np.uint8)

    def mint(self, spec: RefSpec) -> RefSpec:
        """``spec`` minted by its owner (this runtime) for its own range and access: the
        capability an owner-checked route serves (see ``Server.mint``)."""
        return self.server.mint(spec)

    def word_waiter(self) -> AsyncWordWaiter:
        """This runtime's native word waiter for asyncio waits (one background thread for all
        awaited words), made on first use and closed by ``close`` before anything is unmapped.

        Raises:
            MemsemError: the runtime is closed.
        """
        with self._lock:
            if self.closed:
                raise MemsemError("runtime is closed")
            w = self._word_waiter
            if w is None or w.closed:
                w = self._word_waiter = AsyncWordWaiter()
                self.children.add(w)  # closed by close() before it unmaps anything
            return w

    # -- telemetry & lifetime --------------------------------------------------------------------
    def stats(self) -> Stats:
        """A snapshot of this runtime's telemetry."""
        return self.telemetry.snapshot(len(self.publisher.owned), len(self.leases), len(self.resolver.cache))

    def close(self, timeout: float | None = None) -> None:
        """Close: stop new work, cancel queued work (it ends CANCELLED), retire every window
        (waiting up to ``timeout`` for leases and copies, then warning: the memory is going
        away), release this runtime's leases, wait (within the same bound) for copies still
        running through its resolutions, close engines and the directory. A mapping still used
        by a copy or a view is released by its last user. Safe twice; in a forked child it only
        marks the inherited runtime closed.
        """
        if self.closed:
            return  # closed before, or inherited through fork (a child touches nothing shared)
        t = CLOSE_TIMEOUT if timeout is None else _args.timeout(timeout, "timeout")
        t = min(t, self.timeout) if timeout is None else t
        deadline = time.monotonic() + t
        with self._lock:
            parts, self._parts = list(self._parts.values()), {}
        for child in parts + list(self.children):
            try:
                child.close()
            except Exception:
                log.warning("closing %r failed", child, exc_info=True)
        with self._lock:
            self.closed = True
            # Every step runs whatever the ones before it met (a failure is logged, never a
            # reason to leave segments, records or threads behind).
            self._pool.shutdown(wait=False, cancel_futures=True)  # queued work ends CANCELLED
            if self._cpu is not None:
                self._cpu.shutdown(wait=False)
            # Running tasks get the close deadline to finish; later, each holds what it uses
            # (its resolution's mappings) and fails with RuntimeClosedError at its next step.
            _step("waiting for running tasks", lambda: self.transfers.wait_idle(max(0.0, deadline - time.monotonic())))
            for lease in list(self.leases):
                _step(f"releasing {lease!r}", lambda lease=lease: lease.release(force=True))
            _step("retiring the windows", lambda: self.publisher.close(deadline))
            _step("closing the server", self.server.close)
            busy = _step("closing the resolutions",
                         lambda: self.resolver.close(max(0.0, deadline - time.monotonic()))) or []
            if busy:
                log.info("memsem runtime (rank %d) closed with %d resolution(s) still in use; each is "
                         "released by its last copy", self.rank, len(busy))
            for eng in reversed(list(self.engines.values())):
                _step(f"closing engine {eng.name}", eng.close)
            _step("clearing the staging buffers", self.staging.clear)
            _step(f"releasing rank {self.rank}", lambda: self.directory.release_rank(self.rank))
            _step("closing the directory", self.directory.close)

    def __del__(self) -> None:
        if getattr(self, "closed", True):
            return
        pub = getattr(self, "publisher", None)
        if pub is not None and pub.owned:
            warnings.warn(f"memsem runtime (rank {self.rank}) was not closed; call close() or use "
                          "'with'", ResourceWarning, stacklevel=2)


def window_of(ref: Any, argname: str, *, names: bool = True) -> RefSpec | str:
    """The window a call names: a ref's ``spec`` (any kind of ref), a ``RefSpec``, or (where
    ``names``) a window name.

    Raises:
        TypeError: ``ref`` is none of these (the message names ``argname``).
    """
    if isinstance(ref, RefSpec) or (names and isinstance(ref, str)):
        return ref
    spec = getattr(ref, "spec", None)
    if isinstance(spec, RefSpec):
        return spec
    raise TypeError(f"{argname} must be a TensorRef{' or a window name' if names else ''}, got {type(ref).__name__}")


def _step(what: str, fn: Any) -> Any:
    """One step of ``close``: run it; a failure is logged (with its traceback) and the close
    goes on. Returns what ``fn`` returned (None after a failure)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - close finishes whatever fails inside it
        log.warning("memsem close: %s failed", what, exc_info=True)
        return None


def cpu_threads() -> int:
    """Threads of a runtime's CPU pool (``cpu_map``): the CPUs this process may run on, 1 to 16."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(16, n))


def default_engines(directory: str | None = None) -> list[str]:
    """Engines a Runtime enables when none are named: ``MEMSEM_ENGINES`` (comma-separated, e.g.
    ``loopback,host,tcp`` to reach other nodes from code that does not name engines), else
    loopback and host, and tcp too where the directory is ``ray`` (named, or chosen because
    this process runs inside a Ray job: its other nodes are reached over tcp)."""
    raw = os.environ.get("MEMSEM_ENGINES", "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if names:
        return names
    from memsem.directory import choose_url

    return ["loopback", "host", "tcp"] if choose_url(directory)[0] == "ray" else ["loopback", "host"]


def current_runtime() -> RuntimeCore | None:
    """The runtime of the innermost ``with Runtime()`` block of this context, else the most
    recently created open runtime of this process, else None."""
    rt = _current.get()
    if rt is not None and not rt.closed:
        return rt
    best = None
    for r in list(_instances):
        if not r.closed and (best is None or r._order > best._order):
            best = r
    return best


_default: RuntimeCore | None = None
_default_lock = threading.Lock()
#: the class of the runtimes memsem makes for users (the default runtime): ``memsem.Runtime``,
#: registered by ``set_runtime_class`` when it is imported (the layers below it never import it)
_runtime_class: type[RuntimeCore] = RuntimeCore


def set_runtime_class(cls: type[RuntimeCore]) -> None:
    """Make ``cls`` (a subclass of RuntimeCore: ``memsem.Runtime``, which registers itself when
    imported) the class of the default runtime, so that a runtime memsem makes for a user (a
    ref deserialized without one, a ref used in a forked child) offers every layer's calls.

    Raises:
        TypeError: ``cls`` is not a subclass of RuntimeCore.
    """
    global _runtime_class
    if not (isinstance(cls, type) and issubclass(cls, RuntimeCore)):
        raise TypeError(f"cls must be a subclass of RuntimeCore, got {cls!r}")
    _runtime_class = cls


def default_runtime() -> RuntimeCore:
    """The process's default runtime (a ``memsem.Runtime``, created on first use, closed at
    exit). Used by refs that were deserialized without an explicit runtime (e.g. unpickled in a
    worker), and in a forked child by refs bound to a runtime the parent made."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = _runtime_class()
            atexit.register(_default.close)
        return _default


def _after_fork_in_child() -> None:
    global _default, _default_lock
    _default = None  # the parent's (closed in the child): a new one on first use
    _default_lock = threading.Lock()  # it may have been held by another thread at fork time
    # Only flags (other threads of the parent may have held locks at fork time): every inherited
    # runtime becomes closed-and-forked, so the child never retires, unlinks or bumps anything.
    for r in list(_instances):
        r.forked = True
        r.closed = True
    _current.set(None)


os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["CLOSE_TIMEOUT", "DEFAULT_TIMEOUT", "RuntimeCore", "current_runtime", "default_runtime", "set_runtime_class",
           "window_of"]
