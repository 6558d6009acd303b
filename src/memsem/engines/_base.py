"""The engine interface: engines move bytes; the runtime owns policy.

An engine knows regions, descriptors and byte ranges. It knows nothing of generations, leases or
permissions beyond the narrowest access flags a registration asks for: the runtime checks those
before and after every call. Engines raise :class:`memsem.EngineError` (with errno / status name)
or :class:`memsem.NotSupportedError`; the runtime translates them at one boundary.

Life cycle (pyverbs-style ownership: the runtime owns engines, engines own registrations and
attachments, ``close()`` releases children first):

wiring:         ``bind(context)``: the runtime hands over what an engine may ask of it
                (:class:`EngineContext`: directory, timeout, identity, owner-side checks)
owner side:     ``register(region) -> Descriptor`` ... ``deregister(descriptor)``;
                ``on_publish(descriptor, n_tiles, gva, words)`` once the window's tiling is known
                (``words``: the window's control words as :class:`ControlWords`, which engines
                that read them one-sidedly register; they move words, never interpret them)
consumer side:  ``attach(descriptor) -> RemoteRegion`` ... ``detach(remote)``
data:           ``get(remote, offset, dst)`` / ``put(remote, offset, src)`` (blocking, remote
                completion) and ``submit(ops) -> Request`` (a batch; engines with real
                asynchronous hardware set ``batches = True`` and the runtime's xcopy hands them
                whole batches: RDMA posts one WQE list, MTE one ``_nbi`` burst and one quiet)
topology:       ``reach(me, owner, descriptor, costs)``: the engine's own rule of when it reaches
                a window and at what modeled cost (used by :mod:`memsem.topology`)
capabilities:   ``location_attrs``, ``alloc_array``, ``can_signal``/``put_signal``: defaults
                here say "none"; engines that have them override.

One module, over 600 lines, because it is one interface: the engine ABC and the small value types
its methods take and return (descriptors, regions, requests, outcomes); splitting them would make
an engine author read several files for one contract.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from memsem import _args
from memsem._errors import EngineError, MemsemError, MemsemTimeoutError, NotSupportedError


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether an engine can run here. ``reason`` says why not (printed by ``memsem topo``)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


_MISSING: Any = object()


def typed_field(record: Any, name: str, kind: type | tuple[type, ...], what: str, default: Any = _MISSING) -> Any:
    """``record[name]`` checked to be a ``kind`` (``bool`` is never an ``int``).

    ``what`` names the record in the message (e.g. ``"host descriptor"``). With ``default``, a
    missing field (or a JSON null) gives ``default`` instead of an error.

    Raises:
        ValueError: ``record`` is not a mapping, the field is missing or has another type; the
            message names the record, the field, the type wanted and the type found.
    """
    if not isinstance(record, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(record).__name__}")
    v = record.get(name)
    if v is None:
        if default is not _MISSING:
            return default
        present = ", ".join(sorted(map(str, record))) or "none"
        raise ValueError(f"{what} has no field {name!r} (fields: {present})")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"{what} field {name!r} must be {want}, got {type(v).__name__} {v!r:.60}")
    return v


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """How one engine reaches a window: engine-tagged, JSON-serializable ``fields``.

    A descriptor is only ever interpreted by the engine named in ``engine``; handing it to another
    engine raises ``ValueError`` (never reinterpreted). Engines read their fields through
    :meth:`field`, so a descriptor with the right tag but missing or mistyped fields (another
    engine's, a corrupted directory record) is a ValueError naming the field, never a KeyError.
    """

    engine: str
    fields: dict[str, Any]

    def field(self, name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        """Field ``name`` of this descriptor, checked to be a ``kind`` (see :func:`typed_field`).

        Raises:
            ValueError: missing (and no ``default``) or of another type; names engine and field.
        """
        return typed_field(self.fields, name, kind, f"{self.engine} descriptor", default)

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "fields": self.fields}

    @classmethod
    def from_json(cls, data: Any) -> "Descriptor":
        """Parse ``to_json`` output.

        Raises:
            ValueError: not an object with a str ``engine`` and an object ``fields``.
        """
        engine = typed_field(data, "engine", str, "descriptor")
        fields = typed_field(data, "fields", dict, f"{engine} descriptor")
        return cls(engine, dict(fields))


@dataclasses.dataclass
class LocalRegion:
    """Owner-side memory to make reachable.

    Attributes:
        address: first byte in the owner's address space.
        nbytes: size in bytes.
        writable: whether remote writes may be allowed (MR flags, mapping protection).
        segment: name of the shared segment holding the memory, if any.
        segment_offset: byte offset of ``address`` inside ``segment``.
        keepalive: object owning the memory.
    """

    address: int
    nbytes: int
    writable: bool
    segment: str | None = None
    segment_offset: int = 0
    keepalive: Any = None


@dataclasses.dataclass(frozen=True)
class ControlWords:
    """Owner memory holding a window's control words (64-bit words), handed to ``on_publish``.

    An engine that lets consumers on other nodes read these words one-sidedly (``can_watch``
    "read") makes them reachable read-only; it never writes or interprets them.

    Attributes:
        header: the header words (``header.nbytes // 8`` words, word 0 first).
        ready: the tile-ready words, one per tile (None when the window has no tiles).
    """

    header: LocalRegion
    ready: LocalRegion | None = None


@dataclasses.dataclass(frozen=True)
class DirectAccess:
    """A remote region that the CPU of this process can reach with one native copy call.

    ``method`` is ``memsem.native.COPY_MEMCPY`` (``address`` mapped here) or ``COPY_VM_READ`` /
    ``COPY_VM_WRITE`` selection by direction (``address`` in ``pid``'s address space).
    """

    cma: bool
    pid: int
    address: int


class Credential:
    """What a consumer shows an owner whose runtime checks every request (``enforces_generation
    == "owner"``): a public ``token`` (sent as is) and ``prove(challenge)``, a proof of the
    capability the token names computed from the owner's challenge, so the secret behind it
    never crosses the wire. Engines carry both and interpret neither; the owner's runtime
    checks them (``EngineContext.serve_open``).
    """

    __slots__ = ("token", "_prove")

    def __init__(self, token: bytes, prove: Callable[[bytes], bytes]) -> None:
        self.token = bytes(token)
        self._prove = prove

    def prove(self, challenge: bytes) -> bytes:
        return self._prove(bytes(challenge))

    def __repr__(self) -> str:
        return f"<Credential {len(self.token)} B token>"


#: what a watch names: a header word of the window's control block (index = the word), or a
#: range of its ready words (index = first tile, count = tiles)
WATCH_HEADER = 0
WATCH_READY = 1


class RemoteRegion:
    """Consumer-side handle on a window's memory, created by ``Engine.attach``.

    A remote region owns what it mapped (a shared segment, a connection's registration) and
    holds the memory's owner object where the window lives in this process (loopback), so the
    memory outlives every copy made through it. ``close`` releases them (``Engine.detach``); the
    runtime closes a region only when no copy, view or lease uses it any more.

    Attributes:
        engine: the engine that made it.
        nbytes: size in bytes.
        direct: set when a native CPU copy can reach it (the runtime's one-call fast path).
        writable: whether the mapping/descriptor allows writes.
        segment: the shared segment mapped for it (host/shm), else None.
        keepalive: the object owning the memory (loopback), else None.
    """

    def __init__(self, engine: "Engine", nbytes: int, direct: DirectAccess | None = None, *,
                 writable: bool = True, segment: Any = None, keepalive: Any = None) -> None:
        self.engine = engine
        self.nbytes = nbytes
        self.direct = direct
        self.writable = writable
        self.segment = segment
        self.keepalive = keepalive
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.detach(self)


class OpKind(enum.IntEnum):
    GET = 1  #: remote -> local
    PUT = 2  #: local -> remote


class OpState(enum.IntEnum):
    """State of one operation or range. Final states: DONE, FAILED, CANCELLED."""

    PENDING = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4

    @property
    def final(self) -> bool:
        return self >= OpState.DONE


@dataclasses.dataclass
class Op:
    """One byte-range transfer between a remote region and a local uint8 array."""

    kind: OpKind
    remote: RemoteRegion
    offset: int  # bytes into the remote region
    local: np.ndarray  # flat uint8, C-contiguous; written for GET, read for PUT
    state: OpState = OpState.PENDING
    error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return int(self.local.nbytes)


class Request:
    """A submitted batch of ops. ``wait`` blocks until every op has a final state.

    The default implementation runs the ops on a thread (numpy/native copies release the GIL);
    engines with real asynchronous hardware (CQs, streams) subclass it.
    """

    def __init__(self, ops: Sequence[Op]) -> None:
        self.ops = list(ops)
        self._done = threading.Event()

    def finish(self) -> None:
        """(Engines') every op of the request reached a final state: wake its waiters."""
        self._done.set()

    def poll(self) -> bool:
        """True when every op has a final state. Never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float) -> None:
        """Block until every op is final, at most ``timeout`` seconds.

        Raises:
            MemsemTimeoutError: the ops did not finish in time (they keep running; poll again).
            TypeError / ValueError: ``timeout`` is not a finite number of seconds >= 0.
        """
        timeout = _args.timeout(timeout)
        if not self._done.wait(timeout):
            raise MemsemTimeoutError(
                f"engine request of {len(self.ops)} ops not complete after {timeout} s",
                what="engine request", timeout=timeout)

    def cancel(self) -> None:
        """Best effort: ops not started yet end CANCELLED."""
        for op in self.ops:
            if op.state == OpState.PENDING:
                op.state = OpState.CANCELLED


class GenerationCheck(str, enum.Enum):
    """Who keeps a stale handle from touching a window's memory when the consumer's runtime
    cannot map the window's control block (the owner is on another node)."""

    #: nobody: the route needs the control block mapped here (same-node engines)
    NONE = ""
    #: the hardware: the owner deregisters the region at each generation bump, so old handles
    #: fault (a revoked rkey; rdma)
    DEVICE = "device"
    #: the owner's runtime checks a credential with every request (tcp; see ``attach``)
    OWNER = "owner"


class WatchMode(str, enum.Enum):
    """How an engine keeps the control words of a remote window current on the consumer's side
    (``Engine.can_watch``). Falsy when it cannot."""

    #: it cannot: waits on those words are NotSupportedError
    NONE = ""
    #: the owner sends every change (``watch``)
    PUSH = "push"
    #: the consumer reads them one-sidedly (``read_words``)
    READ = "read"


class RemoteOutcome(EngineError):
    """The owner's runtime did not complete a request of an owner-checked engine: ``status`` is
    the owner's native outcome (a ``MEMSEM_RC_*`` status of ``native/memsem_native.h``: a moved
    generation, a version gone, an open write section, a range or permission refusal...) and
    ``value`` its value (the generation or version found). Engines carry both from the owner
    and never interpret them; the runtime turns them into memsem errors exactly as it turns a
    local native outcome (``memsem.core._bracket``).
    """

    def __init__(self, message: str, *, status: int, value: int = 0) -> None:
        super().__init__(message, code=status)
        self.status = status
        self.value = value


class Engine(abc.ABC):
    """Base class of every engine. Subclasses set ``name`` and implement the abstract methods.

    Thread safety: ``get``/``put``/``submit`` may be called from several threads at once.
    """

    name: ClassVar[str] = "?"
    #: True when ``submit`` hands a batch to asynchronous hardware in one go (RDMA WQE lists,
    #: SHMEM ``_nbi`` + one quiet): the runtime's xcopy then submits whole batches to it.
    batches: ClassVar[bool] = False
    #: How a stale handle is kept from touching memory when the runtime cannot map the window's
    #: control block (consumer on another node): see :class:`GenerationCheck`.
    enforces_generation: ClassVar[GenerationCheck] = GenerationCheck.NONE
    #: True when the owner checks versions for this engine: it implements ``get_version`` and
    #: ``put_version`` (the owner brackets each request and says which version it moved)
    versions: ClassVar[bool] = False
    #: True when the owner holds reservations of versions for this engine's consumers
    #: (``reserve_version`` / ``drop_reservation``): what a pin of a remote window is
    reserves: ClassVar[bool] = False

    @classmethod
    def probe(cls) -> Availability:
        """Whether this engine can run on this machine (no side effects)."""
        return Availability(True)

    def __init__(self) -> None:
        self._closed = False
        self.context: EngineContext | None = None
        #: fabric facts merged into this process's :class:`memsem.topology.Location` (a SHMEM
        #: team id, an active RDMA port); engines that have some set them
        self.location_attrs: dict[str, Any] = {}

    @classmethod
    def create(cls) -> "Engine":
        """The instance a runtime enables when asked for this engine by name (default: ``cls()``;
        engines needing process-wide setup, such as a SHMEM team, find it here)."""
        return cls()

    # -- wiring ---------------------------------------------------------------------------------
    def bind(self, context: "EngineContext") -> None:
        """Called once by the runtime that enabled this engine, after its directory is open."""
        self.context = context

    @classmethod
    def reach(cls, me: Any, owner: Any, descriptor: Descriptor,
              cost: tuple[float, float] | None) -> tuple[str, str, bool] | str:
        """This engine's topology rule: whether it reaches a window described by ``descriptor``
        from ``me`` (a Location) when the owner is at ``owner``.

        Returns ``(route kind, reason, zero_copy)`` when it does, else a string saying why not.
        The default (third-party engines): it reaches every window it made a descriptor for.
        """
        return (cls.name, "third-party engine", False)

    #: route kinds this engine's routes rule out for the same window, with the reason (mte
    #: excludes host/cma: the symmetric heap is NPU memory on hardware)
    excludes: ClassVar[dict[str, str]] = {}

    def alloc_array(self, shape: Any, dtype: Any) -> np.ndarray:
        """A zero-filled array in the engine's own memory (e.g. a SHMEM symmetric heap)."""
        raise NotSupportedError(f"engine {self.name!r} has no memory of its own to allocate from")

    # -- owner side -----------------------------------------------------------------------------
    @abc.abstractmethod
    def register(self, region: LocalRegion) -> Descriptor | None:
        """Make ``region`` reachable; return the descriptor consumers attach with, or None when
        this engine cannot reach such memory (e.g. not in its symmetric heap): the window then
        simply has no route through this engine."""

    def deregister(self, descriptor: Descriptor) -> None:
        """Undo ``register``. Safe for descriptors this engine made; others raise ValueError."""
        self._check_descriptor(descriptor)

    def on_publish(self, descriptor: Descriptor, n_tiles: int, gva: int,
                   words: ControlWords | None = None) -> None:
        """Called after ``register`` once the window's tiling is known (``n_tiles`` ready
        words; 0 when untiled). ``words`` is the window's control words (owner memory that
        lives until ``deregister``). An engine may add fields to ``descriptor`` here (mte gives
        each tile a SHMEM signal slot; rdma registers ``words`` read-only and names them).
        Whatever it sets up here ``deregister`` releases. Default: nothing."""

    # -- consumer side --------------------------------------------------------------------------
    @abc.abstractmethod
    def attach(self, descriptor: Descriptor, nbytes: int, credential: bytes = b"") -> RemoteRegion:
        """Open the window described by ``descriptor`` (made by this engine type elsewhere).

        ``credential`` is an opaque token the runtime hands to engines whose
        ``enforces_generation`` is "owner": they send it with each request and the owner's
        runtime validates it (the engine never interprets it)."""

    def detach(self, remote: RemoteRegion) -> None:
        """Release what ``attach`` opened (called by ``RemoteRegion.close``)."""

    def view(self, remote: RemoteRegion) -> np.ndarray:
        """A flat uint8 array over the remote memory itself, or NotSupportedError."""
        raise NotSupportedError(f"engine {self.name!r} cannot map remote memory for view()")

    # -- data -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        """Copy ``dst.nbytes`` bytes from ``remote`` at ``offset`` into ``dst``; returns when the
        bytes are in ``dst``."""

    @abc.abstractmethod
    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        """Copy ``src`` into ``remote`` at ``offset``; returns when the bytes are visible at the
        target (remote completion), not merely when ``src`` may be reused."""

    def get_version(self, remote: RemoteRegion, offset: int, dst: np.ndarray, version: int, *,
                    deadline: float | None = None) -> int:
        """``get`` of exactly version ``version`` (0: the latest committed one), checked by the
        owner (engines with ``versions``); returns the version whose bytes are in ``dst``.
        ``deadline`` (``time.monotonic()``): the caller's bound of the whole request, retries
        included (None: the engine's timeout from now).

        Raises:
            RemoteOutcome: the owner refused (its native outcome: a moved generation, a version
                gone, a write section that stayed open...). NotSupportedError: not this engine.
        """
        raise NotSupportedError(f"engine {self.name!r} has no owner that checks versions")

    def put_version(self, remote: RemoteRegion, offset: int, src: np.ndarray, *,
                    deadline: float | None = None) -> int:
        """``put`` checked by the owner (engines with ``versions``); returns, at remote
        completion, the version whose bytes were overwritten. ``deadline``: as ``get_version``.

        Raises:
            RemoteOutcome: the owner refused. NotSupportedError: not this engine.
        """
        raise NotSupportedError(f"engine {self.name!r} has no owner that checks versions")

    def kept(self, remote: RemoteRegion, nbytes: int) -> Any:
        """A small-request path for the next gets and puts of ``nbytes`` bytes of ``remote``
        made by this thread, which a ref keeps (owner-checked engines; tcp: this thread's
        connection and its handle for the credential, ``memsem.engines.tcp._client.KeptRequests``),
        or None (the default: the engine has none, or none is open now). The owner checks
        every request made through it as any other; the runtime brackets each one."""
        return None

    def reserve_version(self, remote: RemoteRegion, version: int, ttl: float) -> int:
        """Ask the owner to hold version ``version`` (0: its latest) of ``remote``'s window for
        ``ttl`` seconds at most (its writer does not overwrite it meanwhile; the owner caps the
        ttl): a reservation of this engine's session with the owner, gone with it. Returns the
        version held. Blocking, bounded by the engine's timeout (the owner may wait for a write
        section that is overwriting the version to commit).

        Raises:
            RemoteOutcome: the owner's outcome (the version is gone, the generation moved, a
                write section stayed open). NotSupportedError: not this engine.
        """
        raise NotSupportedError(f"engine {self.name!r} cannot reserve versions at the owner")

    def drop_reservation(self, remote: RemoteRegion, version: int) -> None:
        """Give back a reservation of ``reserve_version`` (does not wait for an answer)."""
        raise NotSupportedError(f"engine {self.name!r} cannot reserve versions at the owner")

    def digest_version(self, remote: RemoteRegion, runs: Sequence[tuple[int, int]], version: int) -> tuple[int, bytes]:
        """Ask the owner for :func:`run_digest` of the bytes of ``runs`` (``(offset, nbytes)``
        into ``remote``'s range, in that order, concatenated) of exactly version ``version``
        (0: its latest): ``(the version digested, RUN_DIGEST_BYTES bytes)``. Only the digest
        crosses the link. Blocking, bounded by the engine's timeout.

        Raises:
            RemoteOutcome: the owner's outcome (the version is gone, the generation moved).
            NotSupportedError: not this engine.
        """
        raise NotSupportedError(f"engine {self.name!r} cannot digest byte runs at the owner")

    def can_signal(self, remote: RemoteRegion) -> bool:
        """Whether ``put_signal`` can set the window's tile signal words with the data."""
        return False

    def put_signal(self, remote: RemoteRegion, offset: int, src: np.ndarray, tile: int, generation: int) -> None:
        """A put that also sets tile ``tile``'s signal word after the data (mte)."""
        raise NotSupportedError(f"engine {self.name!r} cannot signal tiles with the data")

    # -- control words of a remote window (tile-ready words, version words) ---------------------
    def can_watch(self, remote: RemoteRegion) -> WatchMode:
        """How this engine keeps control words of ``remote``'s window current here
        (:class:`WatchMode`: PUSH, the owner sends every change, ``watch``; READ, one-sided
        reads, ``read_words``; NONE, it cannot)."""
        return WatchMode.NONE

    def watch(self, remote: RemoteRegion, targets: Sequence[tuple[int, int, int]],
              on_update: Callable[[list[tuple[int, int, int]]], None], on_lost: Callable[[str], None],
              timeout: float) -> Any:
        """Subscribe to control words of ``remote``'s window: ``targets`` are ``(kind, index,
        count)`` (``WATCH_HEADER``/``WATCH_READY``). ``on_update(changes)`` gets ``(kind, index,
        value)`` triples, first the words' current values (before ``watch`` returns), then every
        change, in order, from the engine's thread; ``on_lost(reason)`` once when the
        subscription ends without ``close``. Returns a handle with ``close()`` and
        ``sync(timeout)``, which returns once every change the owner made before the call was
        passed to ``on_update`` (so a consumer that wrote a word through ``set_ready`` or
        ``add_rows`` reads its own write). Blocks at most ``timeout`` s for the owner's first
        answer."""
        raise NotSupportedError(f"engine {self.name!r} cannot watch control words of a remote window")

    def read_words(self, remote: RemoteRegion, kind: int, index: int, count: int) -> list[int]:
        """One-sided read of ``count`` control words of ``remote``'s window (``kind`` as in
        ``watch``: header words from word ``index``, or ready words from tile ``index``).
        Blocking; returns the words' values (64-bit unsigned ints) when they are here."""
        raise NotSupportedError(f"engine {self.name!r} cannot read control words of a remote window")

    def set_ready(self, remote: RemoteRegion, tile: int, ready: bool) -> None:
        """Mark (or clear) tile ``tile``'s ready word at the owner; the owner's runtime checks
        the credential's write access and writes the word as its own ``mark_ready`` does."""
        raise NotSupportedError(f"engine {self.name!r} cannot mark tiles of a remote window")

    def add_rows(self, remote: RemoteRegion, tile: int, rows: int, total: int) -> int:
        """Count ``rows`` written rows of tile ``tile`` (of ``total``) at the owner, whose runtime
        marks the tile ready when the count completes it; returns the rows written so far."""
        raise NotSupportedError(f"engine {self.name!r} cannot count the rows of a remote window's tiles: "
                                "write whole tiles, or mark them with mark_rows once complete")

    def submit(self, ops: Sequence[Op]) -> Request:
        """Start a batch. Every op ends DONE or FAILED (with ``error``); never raises for an op.

        The default runs the ops one after the other on the calling thread (the runtime calls it
        from its worker pool); engines with asynchronous hardware post the batch at once."""
        req = Request(ops)
        self._run_ops(req)
        return req

    def _run_ops(self, req: Request) -> None:
        try:
            for op in req.ops:
                if op.state == OpState.CANCELLED:
                    continue
                op.state = OpState.RUNNING
                try:
                    if op.kind == OpKind.GET:
                        self.get(op.remote, op.offset, op.local)
                    else:
                        self.put(op.remote, op.offset, op.local)
                    op.state = OpState.DONE
                except BaseException as exc:  # recorded per op, reported by the runtime
                    op.error = exc
                    op.state = OpState.FAILED
        finally:
            req.finish()

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release every native resource; safe twice."""
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_descriptor(self, descriptor: Descriptor) -> None:
        if descriptor.engine != self.name:
            raise ValueError(
                f"descriptor is tagged for engine {descriptor.engine!r}, not {self.name!r}; "
                "descriptors are never reinterpreted across engines")

    @staticmethod
    def _check_range(remote: RemoteRegion, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > remote.nbytes:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) lies outside the region of {remote.nbytes} bytes")


class EngineContext(abc.ABC):
    """What an engine may ask of the runtime that enabled it (handed over by ``Engine.bind``).

    Engines never see the runtime itself: this small interface is all of it they use.

    Attributes:
        directory: the runtime's directory (rendezvous entries, e.g. RDMA QP numbers).
        timeout: the runtime's default bound of blocking calls, in seconds.
        identity: this process (:class:`memsem.native.ProcessIdentity`).
        rank: the runtime's rank.
    """

    directory: Any
    timeout: float
    identity: Any
    rank: int

    @abc.abstractmethod
    def serve_open(self, token: bytes, challenge: bytes, proof: bytes) -> Any:
        """Owner side of engines whose ``enforces_generation`` is "owner": a remote consumer
        shows ``token`` (a :class:`Credential`'s) and ``proof`` (its ``prove(challenge)``) for
        the ``challenge`` this engine issued on that connection. Returns a new grant for that
        session, which the engine closes when the session ends or closes the handle (see
        ``memsem.core._serve.Grant``: ``check``/``check_tile``, ``copy`` and ``move`` (one
        bracket around one non-blocking call, yielding the owner's native outcome),
        ``set_ready``, ``watch``, ``on_commit``, ``close``), or raises AccessDeniedError (the
        credential is refused; nothing about the window is said) or another MemsemError."""

    @abc.abstractmethod
    def peer_alive(self, pid: int, start: int, node: str, rank: int = -1) -> bool:
        """Whether a process (on this node by pid, elsewhere by the directory's heartbeat) lives."""


#: bytes of a digest of byte runs (:func:`run_digest`)
RUN_DIGEST_BYTES = 16


def run_digest() -> Any:
    """A new hash of byte runs, the one both an owner answering ``digest_version`` and a
    consumer checking bytes it holds use (blake2b of ``RUN_DIGEST_BYTES`` bytes)."""
    return hashlib.blake2b(digest_size=RUN_DIGEST_BYTES)


__all__ = [
    "RUN_DIGEST_BYTES", "run_digest",
    "Availability", "ControlWords", "Credential", "Descriptor", "DirectAccess", "Engine", "EngineContext", "LocalRegion", "Op",
    "WATCH_HEADER", "WATCH_READY",
    "OpKind", "OpState", "RemoteRegion", "Request", "MemsemError", "GenerationCheck", "RemoteOutcome", "WatchMode",
]
