"""Weight sync that scales with rollout nodes: rollouts re-serve what they loaded (docs/fanout.md).

The trainer publishes its state dict through a :class:`FanoutSource`: the usual versioned
state-dict window (``publish_state_dict``) plus a small *digest window* named ``<name>@digests``
holding, for each of the last ``history`` versions, one digest (sha256 by default) of every
*chunk* of ``chunk_bytes`` bytes of the state-dict window. Every commit writes the data version
``v`` and then its digests as version ``v`` of the digest window, so the two stay in step.

Each rollout runs a :class:`Relay` with its ``rank`` among ``world`` rollouts and a plan
(:mod:`memsem.refs._fanout_plan`: star, chain or tree, chosen from ``world`` and a link model).
A relay's background thread follows its *upstream* (its parent relay, or the trainer): for every
new version ``v`` it

1. reads ``v``'s chunk digests from the trainer's digest window (never through a relay);
2. publishes a *data window* of its own for ``v`` (owner-checked, one ready word per chunk) and
   offers it in its *manifest* (``<name>@relay.<rank>``, a double-buffered window listing the
   versions it holds and the read-only refs of their data windows);
3. moves chunks from upstream into that window, ``depth`` at a time: from a relay, after the
   chunk's ready word says the relay holds it (pushed across nodes); from the trainer, a get of
   exactly version ``v``; it checks each chunk's digest, then marks the chunk ready, so its own
   children read chunk ``k`` of ``v`` as soon as it is held: the fan-out is pipelined chunk by
   chunk and the trainer's link carries about one copy per version (chain and tree plans).

A data window lives for one version: its generation *is* the version's identity, so a ready
word of one version never satisfies a wait on another, and a relay that moves on (it keeps
``slots`` versions) retires the oldest window: readers still on it get ``StaleReferenceError``
and follow the newer version. Every chunk is checked against the trainer's digest of version
``v``, so no rollout ever holds a mixture of versions, and a relay that serves wrong bytes is
caught and named (:class:`memsem.DigestMismatchError`).

**Failure.** A relay whose parent dies (its connection ends, or its directory record expires)
re-attaches to the next rank above it in the plan (the parent's parent, ..., the trainer) and
goes on with the chunks it lacks: chunks already held were checked against ``v``'s digests, so
they stay. A parent that does not appear within ``attach_timeout`` is passed over the same way
(and tried again for the next version). A relay that served a chunk whose digest does not match
is passed over for the rest of the version; the error is recorded (``stats().faults``) and, with
``on_mismatch="raise"`` (default), raised by the next ``load``. If the trainer's version ``v``
is overwritten before a relay got it (the trainer committed twice meanwhile), the relay drops
``v`` and follows the newest version instead.

Consumers: ``relay.load(into)`` copies the newest complete version into existing tensors (like
``StateDictRef.load``); ``relay.wait_version(v)`` waits for the trainer's commit of ``v``; so a
follower loop written for a ``StateDictRef`` source uses a relay unchanged. ``relay.hold()``
gives zero-copy numpy views of a held version for as long as the ``with`` block lasts.
"""
from __future__ import annotations

import concurrent.futures as _futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from memsem import _args, native
from memsem._buffers import array_address
from memsem._errors import (
    DigestMismatchError,
    MemsemError,
    MemsemTimeoutError,
    RuntimeClosedError,
    StaleReferenceError,
    WindowNotFoundError,
)
from memsem.gva import RefSpec
from memsem.refs._fanout_plan import TRAINER, FanoutPlan, LinkModel, plan as make_plan
from memsem.refs._state_dict import (
    DEFAULT_ALIGN,
    DEFAULT_BUCKET_BYTES,
    StateDictRef,
    StateDictSection,
    lookup_state_dict,
    publish_state_dict,
)
from memsem.refs._tensorref import TensorRef, as_core, usable_core

log = logging.getLogger(__name__)

#: default bytes per chunk (the unit of digests, ready words and pipelining)
DEFAULT_CHUNK_BYTES = 2 << 20
#: versions whose digests the digest window keeps
DEFAULT_HISTORY = 8
#: digest algorithms (hashlib names): sha256 is the fastest cryptographic one here (SHA
#: extensions; docs/fanout.md has the figures), blake2b where those are absent
DIGESTS = ("sha256", "blake2b", "sha1")
DIGEST_MAGIC = b"MSFDIG01"
_DHEAD = struct.Struct("<8sQQQII16s")  # magic, chunk_bytes, n_chunks, window bytes, digest size, history, algo
MANIFEST_BYTES = 16 << 10
#: a slice of every blocking wait of the follower thread (seconds): how quickly close() is seen
SLICE_S = 0.5


def _suffix_digests(name: str) -> str:
    return f"{name}@digests"


def _suffix_relay(name: str, rank: int) -> str:
    return f"{name}@relay.{rank}"


def _digest(algo: str, data: Any, size: int) -> bytes:
    return hashlib.new(algo, data).digest()[:size]


def _chunks(nbytes: int, chunk: int) -> int:
    return max(1, -(-nbytes // chunk))


# ------------------------------------------------------------------------------------------------
class FanoutSource:
    """The trainer's side: a state dict published for fan-out (data window plus digests).

    Args:
        runtime: the trainer's ``memsem.Runtime``.
        state_dict: name -> tensor (see ``Runtime.publish_state_dict``); its values are version 1.
        name: the state dict's window name (relays find it and ``<name>@digests`` by name).
        chunk_bytes: bytes per chunk: the unit of digests, of relays' ready words and of the
            pipelining (smaller: the last rollout finishes sooner after the first; larger:
            fewer requests). slots / align / bucket_bytes / write_guard: as
            ``publish_state_dict``.
        digest: a hashlib algorithm of :data:`DIGESTS`. history: versions whose digests are
            kept (a relay that starts a version more than ``history`` commits late drops it).

    Commit versions with :meth:`update` or :meth:`write_section` (not with ``ref.update``:
    the digests would not follow). Blocking like ``StateDictRef.update``, plus the digests
    (computed in parallel threads; docs/fanout.md gives their cost).

    Raises:
        ValueError / TypeError: as ``publish_state_dict``; a bad chunk_bytes, digest or history.
    """

    def __init__(self, runtime: Any, state_dict: Mapping[str, Any], *, name: str,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, digest: str = "sha256", history: int = DEFAULT_HISTORY,
                 slots: int = 2, align: int = DEFAULT_ALIGN, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 write_guard: str | None = None) -> None:
        core = usable_core(as_core(runtime))
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.chunk_bytes = _args.count(chunk_bytes, "chunk_bytes", minimum=4096, unit="bytes")
        if digest not in DIGESTS:
            raise ValueError(f"digest must be one of {DIGESTS}, got {digest!r}")
        self.history = _args.count(history, "history", minimum=2, maximum=1024)
        self.digest = digest
        self.digest_size = min(32, hashlib.new(digest).digest_size)
        self._core = core
        self.ref: StateDictRef = publish_state_dict(core, state_dict, name=name, slots=slots, align=align,
                                                    bucket_bytes=bucket_bytes, write_guard=write_guard)
        self.name = name
        self.nbytes = self.ref.spec.nbytes
        self.n_chunks = _chunks(self.nbytes, self.chunk_bytes)
        self._rec = 8 + -(-self.n_chunks * self.digest_size // 8) * 8
        self._pool = _futures.ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)),
                                                 thread_name_prefix="memsem-digest")
        self.digest_s = 0.0  #: seconds the last version's digests took
        try:
            first = np.empty(self.nbytes, np.uint8)
            core.transfer(self.ref.spec, "get", 0, first)  # the window's bytes, padding included
            buf = np.zeros(_DHEAD.size + self.history * self._rec, np.uint8)
            buf[:_DHEAD.size] = np.frombuffer(_DHEAD.pack(DIGEST_MAGIC, self.chunk_bytes, self.n_chunks, self.nbytes,
                                                          self.digest_size, self.history, digest.encode()), np.uint8)
            v = self.ref.version()
            self._write_record(buf, v, self._digest_all(first))
            del first
            self.digests = TensorRef(core.publish_spec(buf, name=_suffix_digests(name), access="r", slots=2), core)
        except BaseException:
            self._pool.shutdown()
            core.unpublish_spec(self.ref.spec)
            raise

    def _digest_all(self, flat: np.ndarray) -> list[bytes]:
        t0 = time.perf_counter()
        c, ds, algo = self.chunk_bytes, self.digest_size, self.digest
        out = list(self._pool.map(lambda k: _digest(algo, flat[k * c:(k + 1) * c], ds), range(self.n_chunks)))
        self.digest_s = time.perf_counter() - t0
        return out

    def _write_record(self, arr: np.ndarray, version: int, digests: list[bytes]) -> None:
        off = _DHEAD.size + (version % self.history) * self._rec
        arr[off:off + 8] = np.frombuffer(struct.pack("<Q", version), np.uint8)
        body = b"".join(digests)
        arr[off + 8:off + 8 + len(body)] = np.frombuffer(body, np.uint8)

    def _publish_digests(self, version: int, digests: list[bytes]) -> None:
        with self._core.write_section(self.digests.spec, copy=True) as sec:
            self._write_record(sec.array().reshape(-1).view(np.uint8), version, digests)
        if sec.version != version:
            raise MemsemError(f"{self.name}@digests is at version {sec.version}, its state dict at {version}: "
                              "a version was committed without FanoutSource (ref.update): relays cannot check it")

    def version(self) -> int:
        """The latest committed version (with its digests)."""
        return self.digests.version()

    def update(self, state_dict: Mapping[str, Any], *, timeout: float | None = None) -> int:
        """Publish ``state_dict``'s values as the next version, then its digests; returns the
        version. Raises as ``StateDictRef.update``."""
        srcs = self.ref.sources(state_dict)
        with self.ref.write_section(copy=False, timeout=timeout) as sec:
            self.ref.fill(sec, srcs)
            digests = self._digest_all(sec.flat)
        self._publish_digests(sec.version, digests)
        return sec.version

    @contextlib.contextmanager
    def write_section(self, *, copy: bool = True, timeout: float | None = None) -> Iterator[StateDictSection]:
        """A write section on the state dict (``StateDictRef.write_section``): change
        ``section.tensors`` in place; leaving the block digests the slot, commits the version,
        then its digests. A body that raises commits nothing."""
        sec = self.ref.write_section(copy=copy, timeout=timeout)
        try:
            yield sec
            digests = self._digest_all(sec.flat)
        except BaseException:
            sec.abort()
            raise
        v = sec.version
        sec.commit()
        self._publish_digests(v, digests)

    def close(self, timeout: float | None = None) -> None:
        """Unpublish both windows (relays then see the trainer gone). Safe twice."""
        if self._pool is None:
            return
        self._pool.shutdown()
        self._pool = None
        for spec in (self.digests.spec, self.ref.spec):
            with contextlib.suppress(MemsemError):
                self._core.unpublish_spec(spec, timeout=timeout)

    def __enter__(self) -> "FanoutSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RelayStats:
    """What a relay did (counted since it started).

    Attributes:
        versions: versions it completed (held and checked), in order.
        chunks: chunks received, by upstream rank (-1: the trainer).
        bytes_received: bytes of chunks received (and checked).
        reattached: ``(version, from rank, to rank, reason)`` for each re-attachment.
        faults: the :class:`DigestMismatchError` of every chunk a relay served wrong.
        dropped: versions it dropped before completing them (gone upstream).
        digest_s: seconds spent checking digests.
    """

    versions: list[int] = dataclasses.field(default_factory=list)
    chunks: dict[int, int] = dataclasses.field(default_factory=dict)
    bytes_received: int = 0
    reattached: list[tuple[int, int, int, str]] = dataclasses.field(default_factory=list)
    faults: list[DigestMismatchError] = dataclasses.field(default_factory=list)
    dropped: list[int] = dataclasses.field(default_factory=list)
    digest_s: float = 0.0


class _Gone(Exception):
    """Version ``v`` can no longer be had upstream: follow the newest one instead."""


class _Closed(Exception):
    """The relay is closing."""


@dataclasses.dataclass
class _Held:
    version: int
    buf: np.ndarray
    spec: RefSpec  # the owner's ref of the data window
    offer: str  # hex of the read-only ref handed to children
    have: set[int] = dataclasses.field(default_factory=set)
    complete: bool = False
    holds: int = 0


class _Upstream:
    """Where chunks come from: the trainer (``rank`` -1) or a relay's data window of one version."""

    def __init__(self, rank: int, label: str, spec: RefSpec | None) -> None:
        self.rank = rank
        self.label = label
        self.spec = spec  # the relay's data window of the version (None: the trainer)


@dataclasses.dataclass
class _Digests:
    version: int
    chunk_bytes: int
    n_chunks: int
    nbytes: int
    algo: str
    size: int
    values: list[bytes]


class Relay:
    """A rollout's side of the fan-out: follows the trainer's versions through its upstream and
    serves what it holds to the ranks below it (see the module docstring).

    Args:
        runtime: this rollout's ``memsem.Runtime`` (its engines must reach the trainer and the
            other rollouts: ``tcp`` across nodes).
        name: the trainer's state-dict name (a :class:`FanoutSource`).
        rank / world: this rollout's rank among ``world`` rollouts (numbered so that the
            rollouts of one node are consecutive).
        plan: a :class:`FanoutPlan`, or a kind ("auto", "star", "chain", "tree"); "auto" with
            ``link`` picks by the model for the trainer's sizes (read when the trainer is
            found: ``plan`` is final after ``prepare``); without ``link``, a chain. All ranks
            must use the same plan.
        link: a :class:`LinkModel` for ``plan="auto"``.
        slots: versions held (and served) at once (>= 2, so a version being fanned out is not
            dropped when the next one starts).
        depth: chunks moved at once (requests in flight upstream).
        attach_timeout: seconds to wait for a parent that is not there (not started, or gone
            without its record expiring yet) before passing over it to the rank above.
        timeout: bound of each blocking step (seconds, default the runtime's).
        on_mismatch: "raise" (default): a relay caught serving wrong bytes makes the next
            ``load`` raise :class:`DigestMismatchError` (once; the version itself is completed
            from upstream); "bypass": only recorded (``stats().faults``) and logged.
        follow: start the follower thread now (default); else call :meth:`start`.

    A relay holds native state (windows, a thread): ``close()`` it, or use ``with``.
    """

    def __init__(self, runtime: Any, name: str, *, rank: int, world: int, plan: FanoutPlan | str = "auto",
                 link: LinkModel | None = None, slots: int = 2, depth: int = 4, attach_timeout: float = 10.0,
                 timeout: float | None = None, on_mismatch: str = "raise", follow: bool = True) -> None:
        core = usable_core(as_core(runtime))
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        world = _args.count(world, "world", minimum=1)
        self.rank = _args.index(rank, "rank", world, of=f"{world} rollouts")
        self._auto_link: LinkModel | None = None
        if plan == "auto" and link is not None:
            if not isinstance(link, LinkModel):
                raise TypeError(f"link must be a memsem.LinkModel, got {type(link).__name__}")
            self._auto_link = link  # the plan is made once the trainer's sizes are known
            plan = make_plan(world, kind="chain")
        elif isinstance(plan, str):
            plan = make_plan(world, kind=plan)
        if not isinstance(plan, FanoutPlan) or plan.world != world:
            raise ValueError(f"plan must be a kind or a FanoutPlan of {world} ranks, got {plan!r}")
        if on_mismatch not in ("raise", "bypass"):
            raise ValueError(f"on_mismatch must be 'raise' or 'bypass', got {on_mismatch!r}")
        self.name = name
        self.world = world
        self.plan = plan
        self.slots = _args.count(slots, "slots", minimum=2, maximum=16)
        self.depth = _args.count(depth, "depth", minimum=1, maximum=64)
        self.attach_timeout = _args.timeout(attach_timeout, "attach_timeout", positive=True)
        self.timeout = _args.timeout_or(timeout, core.timeout)
        self.on_mismatch = on_mismatch
        self._core = core
        self._label = f"rank {self.rank} of {name!r}"
        self._cond = threading.Condition()
        self._held: dict[int, _Held] = {}
        self._free: list[np.ndarray] = []
        self._stats = RelayStats()
        self._error: BaseException | None = None
        self._pending: DigestMismatchError | None = None
        self._stop = threading.Event()
        self._refs_lock = threading.Lock()  # one lookup of the trainer's windows (and the auto plan)
        self._thread: threading.Thread | None = None
        self._trainer: StateDictRef | None = None
        self._digests_ref: TensorRef | None = None
        self._mrefs: dict[int, TensorRef] = {}
        self._pool = _futures.ThreadPoolExecutor(self.depth, thread_name_prefix=f"memsem-relay{self.rank}")
        self._layout_scatter: Any = None
        buf = np.zeros(MANIFEST_BYTES, np.uint8)
        self._manifest = TensorRef(core.publish_spec(buf, name=_suffix_relay(name, self.rank), access="r", slots=2),
                                   core)
        if follow:
            self.start()

    # -- public --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start following (a no-op when already started)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name=f"memsem-relay{self.rank}", daemon=True)
            self._thread.start()

    def stats(self) -> RelayStats:
        """A copy of the counters (:class:`RelayStats`)."""
        with self._cond:
            s = self._stats
            return dataclasses.replace(s, versions=list(s.versions), chunks=dict(s.chunks),
                                       reattached=list(s.reattached), faults=list(s.faults), dropped=list(s.dropped))

    def held(self) -> list[int]:
        """Versions this relay holds complete (and serves), oldest first."""
        with self._cond:
            return sorted(v for v, h in self._held.items() if h.complete)

    def prepare(self, timeout: float | None = None) -> None:
        """Look the trainer's windows up now (waiting for them up to ``timeout`` s), so the first
        version starts without that delay. Raises as ``lookup``."""
        self._trainer_refs(_args.timeout_or(timeout, self.timeout))

    def version(self) -> int:
        """The trainer's latest committed version (with digests). Raises as ``TensorRef.version``."""
        return self._trainer_refs(self.timeout)[1].version()

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        """Block until the trainer committed ``version`` (or a newer one); returns it. Raises as
        ``TensorRef.wait_version``."""
        return self._trainer_refs(self.timeout)[1].wait_version(version, timeout)

    def load(self, into: Mapping[str, Any] | None = None, *, version: int = 0, timeout: float | None = None) -> int:
        """Block until this relay holds a version ``>= version`` (0: the trainer's latest now),
        checked chunk by chunk; copy the newest such version into ``into`` (if given: existing
        tensors, like ``StateDictRef.load``); return it.

        The version is bit-exact (every chunk matched the trainer's digest); it may be newer
        than ``version`` when the trainer committed meanwhile.

        Raises:
            KeyError / ValueError / TypeError: ``into`` does not fit the state dict (before any
                wait). DigestMismatchError: a relay upstream served wrong bytes (``on_mismatch=
                "raise"``; raised once, naming it). PeerLostError: the trainer is gone.
            MemsemTimeoutError: no such version within ``timeout`` s (default the relay's).
        """
        t = _args.timeout_or(timeout, self.timeout)
        deadline = time.monotonic() + t
        scatter = self._scatter(into) if into is not None else None
        target = _args.count(version, "version") or self.version()
        with self._cond:
            while True:
                if self._pending is not None:
                    err, self._pending = self._pending, None
                    raise err
                ok = [h for v, h in self._held.items() if h.complete and v >= target]
                if ok:
                    h = max(ok, key=lambda x: x.version)
                    h.holds += 1
                    break
                if self._error is not None:
                    raise self._error
                if self._stop.is_set():
                    raise RuntimeClosedError(f"relay {self._label} is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MemsemTimeoutError(f"relay {self._label}: version {target} not held after {t} s "
                                             f"(holds {sorted(self._held)})",
                                             what=f"version {target} at relay {self._label}", timeout=t)
                self._cond.wait(min(left, SLICE_S))
        try:
            if scatter is not None:
                ranges, _keep = scatter
                base = array_address(h.buf)
                for off, n, addr in ranges:
                    if n:
                        native.memcpy(addr, base + off, n)
        finally:
            with self._cond:
                h.holds -= 1
                self._cond.notify_all()
        return h.version

    @contextlib.contextmanager
    def hold(self, version: int = 0, timeout: float | None = None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """``with relay.hold() as (v, tensors):`` numpy views (name -> array) of the newest held
        version ``>= version``, valid inside the block (the relay does not reuse that memory
        meanwhile; it allocates another buffer if it must). Zero-copy; read-only by contract."""
        t = _args.timeout_or(timeout, self.timeout)
        v = self.load(None, version=version, timeout=t)
        with self._cond:
            h = self._held.get(v)
            if h is None:  # dropped between load and here: a newer one is held
                h = self._held[max(self._held)]
            h.holds += 1
        try:
            lay = self._trainer_refs(t)[0].layout
            hb = lay.header_bytes
            yield h.version, {e.name: h.buf[hb + e.offset:hb + e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
                              for e in lay.entries}
        finally:
            with self._cond:
                h.holds -= 1
                self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Stop following, retire this relay's windows (its children re-attach upstream), join
        its threads. Safe twice."""
        if self._stop.is_set() and self._pool is None:
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self.timeout + 2 * SLICE_S)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        core = self._core
        if core.closed:
            return
        for h in list(self._held.values()):
            with contextlib.suppress(MemsemError):
                core.unpublish_spec(h.spec, timeout=timeout)
        self._held.clear()
        with contextlib.suppress(MemsemError):
            core.unpublish_spec(self._manifest.spec, timeout=timeout)

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<memsem.Relay {self._label}, {self.plan.kind} plan, holds {self.held()}>"

    # -- testing hook ----------------------------------------------------------------------------------
    def _on_event(self, event: str, version: int, chunk: int, data: np.ndarray | None) -> None:
        """Called by the follower at ``"fetch"`` (before chunk ``chunk`` of ``version`` is asked
        for), ``"serve"`` (a checked chunk in ``data``, just before its ready word is marked)
        and ``"complete"``. Tests override it (to stop, block or corrupt); nothing else should."""

    # -- the follower ------------------------------------------------------------------------------------
    def _check_stop(self) -> None:
        if self._stop.is_set() or self._core.closed:
            raise _Closed()

    def _trainer_refs(self, t: float) -> tuple[StateDictRef, TensorRef]:
        if self._trainer is None:
            with self._refs_lock:  # prepare() and the follower thread look up once, make the plan once
                return self._lookup_trainer(t)
        return self._trainer, self._digests_ref  # type: ignore[return-value]

    def _lookup_trainer(self, t: float) -> tuple[StateDictRef, TensorRef]:
        if self._trainer is None:
            deadline = time.monotonic() + t
            while True:
                try:
                    tr = lookup_state_dict(self._core, self.name)
                    dg = TensorRef(self._core.lookup_spec(_suffix_digests(self.name)), self._core)
                    break
                except WindowNotFoundError:
                    if time.monotonic() >= deadline:
                        raise
                    if self._stop.wait(0.05):
                        raise RuntimeClosedError(f"relay {self._label} is closed") from None
            if self._auto_link is not None:  # every rank computes the same plan from the same sizes
                head = np.empty(_DHEAD.size, np.uint8)
                self._core.transfer(dg.spec, "get", 0, head)
                _, chunk, _, nbytes, _, _, _ = _DHEAD.unpack(head.tobytes())
                self.plan = make_plan(self.world, kind="auto", model_bytes=max(1, nbytes), chunk_bytes=max(1, chunk),
                                      link=self._auto_link)
                self._auto_link = None
            self._trainer, self._digests_ref = tr, dg
        return self._trainer, self._digests_ref  # type: ignore[return-value]

    def _scatter(self, into: Mapping[str, Any]) -> tuple[list[tuple[int, int, int]], list]:
        tr = self._trainer_refs(self.timeout)[0]
        if not isinstance(into, Mapping):
            raise TypeError(f"into must be a mapping of name to tensor, got {type(into).__name__}")
        return tr.ranges(into, tr.layout.entries, "into")

    def _follow(self) -> None:
        last = 0
        while not self._stop.is_set():
            try:
                last = self._one(last)
                with self._cond:
                    self._error = None
            except _Closed:
                return
            except MemsemError as exc:  # the trainer is gone or unreachable: said by load(); retried
                if self._stop.is_set() or self._core.closed:
                    return
                log.debug("relay %s: %s", self._label, exc)
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                self._stop.wait(SLICE_S)
            except Exception as exc:  # a bug: say it to load() and stop
                log.exception("relay %s stopped", self._label)
                with self._cond:
                    self._error = MemsemError(f"relay {self._label} stopped: {type(exc).__name__}: {exc}")
                    self._cond.notify_all()
                return

    def _one(self, last: int) -> int:
        """Get the newest version > ``last`` its upstream offers; returns the version held."""
        self._trainer_refs(self.attach_timeout)
        while True:
            self._check_stop()
            up, v = self._attach(last + 1)
            try:
                dg = self._read_digests(v)
            except _Gone:
                last = max(last, v)  # too old already: a newer one is there
                continue
            h = self._start(v, dg)
            try:
                self._fill(h, up, dg)
            except _Gone:
                self._drop(v, complete=False)
                continue
            except BaseException:
                self._drop(v, complete=False)
                raise
            with self._cond:
                h.complete = True
                self._stats.versions.append(v)
                self._cond.notify_all()
            self._on_event("complete", v, -1, None)
            return v

    # -- upstream ------------------------------------------------------------------------------------------
    def _manifest_ref(self, rank: int, wait: float) -> TensorRef:
        m = self._mrefs.get(rank)
        if m is not None:
            return m
        deadline = time.monotonic() + wait
        while True:
            self._check_stop()
            try:
                m = TensorRef(self._core.lookup_spec(_suffix_relay(self.name, rank)), self._core)
                break
            except WindowNotFoundError:
                if time.monotonic() >= deadline:
                    raise
                self._stop.wait(0.05)
        self._mrefs[rank] = m
        return m

    def _read_manifest(self, m: TensorRef) -> tuple[int, dict[int, str]]:
        out = np.empty(MANIFEST_BYTES, np.uint8)
        mv = self._core.gather(m.spec, [(0, MANIFEST_BYTES, array_address(out))], keep=out)
        raw = out.tobytes().rstrip(b"\0")
        if not raw:
            return mv, {}
        try:
            d = json.loads(raw)
            return mv, {int(v): str(r) for v, r in d["offers"]}
        except (ValueError, KeyError, TypeError):
            raise MemsemError(f"relay manifest {m.spec.label} is malformed") from None

    def _offer_of(self, rank: int, at_least: int, exact: bool, wait: float) -> tuple[_Upstream, int]:
        """Attach to relay ``rank``: wait (up to ``wait`` s) for it to offer a version
        ``>= at_least`` (``exact``: exactly ``at_least``); returns it and the version.

        Raises:
            _Gone: ``exact`` and it offers only newer ones. MemsemTimeoutError, PeerLostError,
            StaleReferenceError...: it is not usable.
        """
        deadline = time.monotonic() + wait
        m = self._manifest_ref(rank, wait)
        try:
            while True:
                self._check_stop()
                mv, offers = self._read_manifest(m)
                good = [v for v in offers if (v == at_least if exact else v >= at_least)]
                if good:
                    v = max(good)
                    spec = RefSpec.from_bytes(bytes.fromhex(offers[v]))
                    return _Upstream(rank, f"rank {rank} of {self.name!r}", spec), v
                if exact and any(v > at_least for v in offers):
                    raise _Gone()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MemsemTimeoutError(f"relay rank {rank} of {self.name!r} offered no version "
                                             f"{'' if exact else '>= '}{at_least} within {wait} s",
                                             what=f"an offer of rank {rank}", timeout=wait)
                with contextlib.suppress(MemsemTimeoutError):
                    self._core.wait_version(m.spec, mv + 1, min(left, SLICE_S))
        except StaleReferenceError:
            self._mrefs.pop(rank, None)  # republished (a restarted relay): looked up again next time
            raise

    def _trainer_version(self, at_least: int) -> int:
        """Wait for the trainer's commit of a version ``>= at_least`` (as long as the relay
        runs: a follower waits for the next version), sliced to see close()."""
        dg = self._trainer_refs(self.timeout)[1]
        while True:
            self._check_stop()
            with contextlib.suppress(MemsemTimeoutError):
                return self._core.wait_version(dg.spec, at_least, SLICE_S)

    def _attach(self, at_least: int) -> tuple[_Upstream, int]:
        """The nearest usable upstream offering a version ``>= at_least``, and its newest one.
        A parent is waited for (``attach_timeout``) only once the trainer committed one."""
        newest = self._trainer_version(at_least)
        passed: tuple[int, str] | None = None  # the first rank passed over, and why
        for r in self.plan.upstream(self.rank):
            try:
                if r == TRAINER:
                    up, v = _Upstream(TRAINER, "the trainer", None), newest
                else:
                    up, v = self._offer_of(r, at_least, False, self.attach_timeout)
            except (_Closed, _Gone):
                raise
            except MemsemError as exc:
                log.debug("relay %s: rank %d not usable: %s", self._label, r, exc)
                passed = passed or (r, f"{type(exc).__name__}: {exc}")
                continue
            if passed is not None:
                self._note_reattach(v, passed[0], r, passed[1])
            return up, v
        raise AssertionError("unreachable: the plan ends at the trainer")  # pragma: no cover

    def _reattach(self, failed: _Upstream, v: int, reason: str) -> _Upstream:
        """The next upstream above ``failed`` that offers exactly version ``v``."""
        if failed.rank == TRAINER:
            raise MemsemError(f"relay {self._label}: nothing above the trainer ({reason})")
        chain = self.plan.upstream(self.rank)
        for r in chain[chain.index(failed.rank) + 1:]:
            self._check_stop()
            if r == TRAINER:
                self._note_reattach(v, failed.rank, TRAINER, reason)
                return _Upstream(TRAINER, "the trainer", None)
            try:
                up, _ = self._offer_of(r, v, True, self.attach_timeout)
                self._note_reattach(v, failed.rank, r, reason)
                return up
            except (_Closed, _Gone):
                raise
            except MemsemError as exc:
                reason = f"{reason}; rank {r}: {type(exc).__name__}"
        raise AssertionError("unreachable: the plan ends at the trainer")  # pragma: no cover

    def _note_reattach(self, v: int, frm: int, to: int, reason: str) -> None:
        with self._cond:
            self._stats.reattached.append((v, frm, to, reason))
        log.info("relay %s: version %d: re-attached from rank %d to %s (%s)", self._label, v, frm,
                 "the trainer" if to == TRAINER else f"rank {to}", reason)

    def _read_digests(self, v: int) -> _Digests:
        dg = self._trainer_refs(self.timeout)[1]
        self._core.wait_version(dg.spec, v, self.timeout)
        head = np.empty(_DHEAD.size, np.uint8)
        self._core.transfer(dg.spec, "get", 0, head)
        magic, chunk, n, nbytes, ds, hist, algo = _DHEAD.unpack(head.tobytes())
        algo_s = algo.rstrip(b"\0").decode("ascii", "replace")
        if magic != DIGEST_MAGIC or algo_s not in DIGESTS or not 0 < ds <= 64 or not 0 < n <= 1 << 24:
            raise MemsemError(f"{dg.spec.label} is not a fan-out digest window")
        rec = 8 + -(-n * ds // 8) * 8
        body = np.empty(rec, np.uint8)
        self._core.transfer(dg.spec, "get", _DHEAD.size + (v % hist) * rec, body)
        tag = struct.unpack("<Q", body[:8].tobytes())[0]
        if tag != v:
            raise _Gone()  # overwritten by a version ``history`` commits later
        raw = body[8:8 + n * ds].tobytes()
        return _Digests(v, chunk, n, nbytes, algo_s, ds, [raw[k * ds:(k + 1) * ds] for k in range(n)])

    # -- holding versions ------------------------------------------------------------------------------------
    def _start(self, v: int, dg: _Digests) -> _Held:
        """Allocate (or reuse) memory for version ``v``, publish its data window, offer it."""
        core = self._core
        victims = []
        with self._cond:
            if len(self._held) >= self.slots:
                free = sorted((h for h in self._held.values() if h.holds == 0), key=lambda h: h.version)
                victims = free[:len(self._held) - self.slots + 1]
        for h in victims:
            self._drop(h.version, complete=h.complete)
        with self._cond:
            buf = self._free.pop() if self._free and self._free[-1].nbytes == dg.nbytes else None
        if buf is None:
            buf = np.empty(dg.nbytes, np.uint8)
        spec = core.publish_spec(buf, access="rw", tile_bytes=dg.chunk_bytes)
        ro = core.server.mint(dataclasses.replace(spec, access="r", mint=None))
        h = _Held(v, buf, spec, ro.to_bytes().hex())
        with self._cond:
            self._held[v] = h
        self._commit_manifest()
        return h

    def _drop(self, v: int, *, complete: bool) -> None:
        with self._cond:
            h = self._held.pop(v, None)
            if h is None:
                return
            if not complete:
                self._stats.dropped.append(v)
        with contextlib.suppress(MemsemError):
            self._commit_manifest()
        with contextlib.suppress(MemsemError):
            self._core.unpublish_spec(h.spec, timeout=self.timeout)
        with self._cond:
            if h.holds == 0 and len(self._free) < self.slots:
                self._free.append(h.buf)

    def _commit_manifest(self) -> None:
        with self._cond:
            offers = sorted((v, h.offer) for v, h in self._held.items())
        raw = json.dumps({"rank": self.rank, "offers": offers}, separators=(",", ":")).encode()
        if len(raw) > MANIFEST_BYTES:
            raise MemsemError(f"relay {self._label}: manifest of {len(raw)} bytes exceeds {MANIFEST_BYTES}")
        with self._core.write_section(self._manifest.spec, copy=False) as sec:
            arr = sec.array().reshape(-1).view(np.uint8)
            arr[:len(raw)] = np.frombuffer(raw, np.uint8)
            arr[len(raw):] = 0

    # -- moving chunks -------------------------------------------------------------------------------------------
    def _fill(self, h: _Held, up: _Upstream, dg: _Digests) -> None:
        """Move every chunk ``h`` lacks, ``depth`` at a time, re-attaching when ``up`` fails."""
        while True:
            todo = [k for k in range(dg.n_chunks) if k not in h.have]
            if not todo:
                return
            it = iter(todo)
            futs: dict[_futures.Future, int] = {}
            err: BaseException | None = None

            def submit() -> None:
                k = next(it, None)
                if k is not None:
                    futs[self._pool.submit(self._fetch, up, h, k, dg)] = k

            for _ in range(self.depth):
                submit()
            while futs:
                done, _ = _futures.wait(futs, timeout=self.timeout + 1.0, return_when=_futures.FIRST_COMPLETED)
                for f in done:
                    futs.pop(f)
                    e = f.exception()
                    if e is not None and err is None:
                        err = e
                    if err is None:
                        submit()
            if err is None:
                continue
            up = self._recover(err, up, h.version)

    def _recover(self, err: BaseException, up: _Upstream, v: int) -> _Upstream:
        if isinstance(err, (_Closed, _Gone)):
            raise err
        if isinstance(err, DigestMismatchError):
            with self._cond:
                self._stats.faults.append(err)
                if self.on_mismatch == "raise":
                    self._pending = err
                self._cond.notify_all()
            log.warning("%s", err)
            if up.rank == TRAINER:
                raise err
            return self._reattach(up, v, f"DigestMismatchError: chunk {err.chunk}")
        if not isinstance(err, MemsemError):
            raise err
        if up.rank == TRAINER:
            if isinstance(err, StaleReferenceError):
                raise _Gone() from err  # the trainer's version v was overwritten
            raise err
        if isinstance(err, StaleReferenceError):
            # retired by its relay (which moved on) or the relay is gone: its manifest says which
            try:
                _, offers = self._read_manifest(self._manifest_ref(up.rank, self.attach_timeout))
                if v not in offers:
                    raise _Gone() from err
            except MemsemError:
                pass
        return self._reattach(up, v, f"{type(err).__name__}: {err}")

    def _fetch(self, up: _Upstream, h: _Held, k: int, dg: _Digests) -> None:
        c = dg.chunk_bytes
        dst = h.buf[k * c:min((k + 1) * c, dg.nbytes)]
        core = self._core
        self._check_stop()
        self._on_event("fetch", h.version, k, None)
        if up.spec is None:
            core.transfer(self._trainer_refs(self.timeout)[0].spec, "get", k * c, dst, version=h.version)
        else:
            deadline = time.monotonic() + self.timeout
            while True:
                self._check_stop()
                left = deadline - time.monotonic()
                try:
                    core.wait_tile(up.spec, k, min(SLICE_S, max(left, 0.0)))
                    break
                except MemsemTimeoutError:
                    if left <= 0:
                        raise
            core.transfer(up.spec, "get", k * c, dst)
        t0 = time.perf_counter()
        got = _digest(dg.algo, dst, dg.size)
        dt = time.perf_counter() - t0
        if got != dg.values[k]:
            raise DigestMismatchError(
                f"chunk {k} of version {h.version} of {self.name!r} from {up.label} does not match the trainer's "
                f"{dg.algo} digest: {up.label} served wrong bytes (none were accepted)",
                relay=up.label, version=h.version, chunk=k)
        self._on_event("serve", h.version, k, dst)
        core.mark_ready(h.spec, k)
        with self._cond:
            h.have.add(k)
            s = self._stats
            s.chunks[up.rank] = s.chunks.get(up.rank, 0) + 1
            s.bytes_received += dst.nbytes
            s.digest_s += dt


__all__ = ["DEFAULT_CHUNK_BYTES", "DIGESTS", "FanoutSource", "Relay", "RelayStats"]
