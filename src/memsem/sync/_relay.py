"""Weight sync that scales with rollout nodes: rollouts re-serve what they loaded (docs/fanout.md).

The trainer publishes its state dict through a :class:`FanoutSource`
(:mod:`memsem.sync._fanout_source`: the state-dict window plus a digest window holding one
digest of every chunk of ``chunk_bytes`` bytes, for each of the last versions).

Each rollout runs a :class:`Relay` with its ``rank`` among ``world`` rollouts and a plan
(:mod:`memsem.sync._fanout_plan`: star, chain or tree, chosen from ``world`` and a link model).
A relay's background thread follows its *upstream* (its parent relay, or the trainer): for every
new version ``v`` it

1. reads ``v``'s chunk digests from the trainer's digest window (never through a relay);
   finding the trainer, a parent's offer and re-attaching are :mod:`memsem.sync._relay_upstream`;
2. publishes a *data window* of its own for ``v`` (owner-checked, one ready word per chunk) and
   offers it in its *manifest* (``<name>@relay.<rank>``, a double-buffered window listing the
   versions it holds and the read-only refs of their data windows);
3. moves chunks from upstream into that window, ``depth`` at a time: from a relay, after the
   chunk's ready word says the relay holds it (pushed across nodes); from the trainer, a get of
   exactly version ``v``; it checks each chunk's digest, then marks the chunk ready, so its own
   children read chunk ``k`` of ``v`` as soon as it is held: the fan-out is pipelined chunk by
   chunk and the trainer's link carries about one copy per version (chain and tree plans).

With ``delta=True`` (default) a relay that holds an older version ``b`` first builds ``v`` from
it and the delta records of the versions between (:mod:`memsem.sync._relay_delta`: from its
parent, which offers them on, else the trainer's history): the chunks that then match the
trainer's digests are ready at once and only the others are moved in step 3, so a hop moves
about the records' bytes.

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

**A restarted trainer.** After a failure on the trainer's windows the relay looks the name up
again and follows whoever holds it now (a new process after a crash and a restore, or a
republish): it drops the old trainer's versions, offers only the new one's (a manifest names
the trainer its versions are of), says the change (``generation``, ``stats().generations``)
and counts versions from 1 again. A caller waiting for a version of the old trainer gets
``WindowRetiredError`` once the relay follows the new one.

Consumers: ``relay.load(into)`` copies the newest complete version into existing tensors (like
``StateDictRef.load``); ``relay.wait_version(v)`` waits for the trainer's commit of ``v``; so a
follower loop written for a ``StateDictRef`` source uses a relay unchanged. ``relay.hold()``
gives zero-copy numpy views of a held version for as long as the ``with`` block lasts.
"""
from __future__ import annotations

import concurrent.futures as _futures
import contextlib
import dataclasses
import logging
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
    PeerLostError,
    StaleReferenceError,
    VersionGoneError,
    WindowRetiredError,
)
from memsem.core import Wait
from memsem.gva import RefSpec
from memsem.sync._fanout_plan import (
    KINDS,
    TRAINER,
    FanoutPlan,
    LinkModel,
    chunks_in_flight,
    kind_arg,
    link_arg,
    plan as make_plan,
)
from memsem.sync._fanout_source import Digests, digest_of, fanout_name
from memsem.sync._relay_upstream import (
    MANIFEST_BYTES,
    RelayClosing,
    Upstream,
    UpstreamGone,
    Upstreams,
    manifest_bytes,
    manifest_name,
    trainer_identity,
)
from memsem.sync._delta_format import Record
from memsem.sync._relay_delta import (
    KEEP_RECORDS,
    apply as apply_delta,
    fetch_record,
    tiles_of,
    trainer_records,
    worth_it,
)
from memsem.sync._state_dict import StateDictRef
from memsem.refs._tensorref import TensorRef, as_core, usable_core

log = logging.getLogger(__name__)

#: the follower thread's pause after an error before it tries again (seconds; a close ends it)
RETRY_S = 0.5
#: the most chunks in flight upstream that ``depth=None`` picks (see ``Relay``)
MAX_AUTO_DEPTH = 8

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
        deltas: versions built from the version held before and delta records
            (``memsem.sync._relay_delta``), in order.
        delta_bytes: bytes of delta records received (counted in ``bytes_received`` too).
        records: delta records received, by upstream rank (-1: the trainer's history).
        generations: the generation of the trainer's state-dict window for each trainer
            followed, in order: one more each time a new publisher of the name (a restarted
            trainer) or a republish was followed (``Relay.generation`` is the last one).
    """

    versions: list[int] = dataclasses.field(default_factory=list)
    chunks: dict[int, int] = dataclasses.field(default_factory=dict)
    bytes_received: int = 0
    reattached: list[tuple[int, int, int, str]] = dataclasses.field(default_factory=list)
    faults: list[DigestMismatchError] = dataclasses.field(default_factory=list)
    dropped: list[int] = dataclasses.field(default_factory=list)
    digest_s: float = 0.0
    generations: list[int] = dataclasses.field(default_factory=list)
    deltas: list[int] = dataclasses.field(default_factory=list)
    delta_bytes: int = 0
    records: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Held:
    version: int
    buf: np.ndarray
    spec: RefSpec  # the owner's ref of the data window
    offer: str  # hex of the read-only ref handed to children
    gen: tuple[int, int]  # the trainer it is a version of (trainer_identity)
    sd: StateDictRef  # that trainer's state dict (its layout)
    dg: Digests | None = None  # the trainer's digests of the version
    have: set[int] = dataclasses.field(default_factory=set)
    complete: bool = False
    holds: int = 0


@dataclasses.dataclass
class _Offered:
    """A delta record this relay got and offers on: version ``record.version``'s, of ``gen``."""

    record: Record
    spec: RefSpec
    offer: str
    gen: tuple[int, int]


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
        link: a :class:`LinkModel` of the rollouts' links: picks the plan when ``plan="auto"``,
            and the chunks in flight when ``depth`` is not given.
        slots: versions held (and served) at once (>= 2, so a version being fanned out is not
            dropped when the next one starts).
        depth: chunks moved at once (requests in flight upstream). Default: with ``link``, the
            fewest that keep the link busy, ``1 + ceil(hop_latency / chunk time)`` (2 to
            ``MAX_AUTO_DEPTH``): each chunk more in flight adds one chunk's transfer time to
            every hop of a chain (the parent's link sends the requests in turn), so on a link
            whose chunk time exceeds a round trip, 2; without ``link``, 4 (``chunks_in_flight``).
        attach_timeout: seconds to wait for a parent that is not there (not started, or gone
            without its record expiring yet) before passing over it to the rank above.
        timeout: bound of each blocking step (seconds, default the runtime's).
        on_mismatch: "raise" (default): a relay caught serving wrong bytes makes the next
            ``load`` raise :class:`DigestMismatchError` (once; the version itself is completed
            from upstream); "bypass": only recorded (``stats().faults``) and logged.
        delta: build a version from the one held before and the delta records of the versions
            between (from the parent relay, else the trainer's delta history), moving only the
            records and the chunks they do not cover; every chunk is still checked against the
            trainer's digest (``memsem.sync._relay_delta``). Default True; False: every chunk
            of every version is moved.
        delta_wait: the most seconds to wait for the trainer to have recorded a version's delta
            (its records are made after the commit, off the trainer's path) before moving
            that version in full; no wait while the trainer's last record came later than
            that after its commit (a trainer whose records come late costs no latency).
        follow: start the follower thread now (default); else call :meth:`start`.

    A relay holds native state (windows, a thread): ``close()`` it, or use ``with``.
    """

    def __init__(self, runtime: Any, name: str, *, rank: int, world: int, plan: FanoutPlan | str = "auto",
                 link: LinkModel | None = None, slots: int = 2, depth: int | None = None, attach_timeout: float = 10.0,
                 timeout: float | None = None, on_mismatch: str = "raise", follow: bool = True,
                 delta: bool = True, delta_wait: float = 2.0) -> None:
        core = usable_core(as_core(runtime))
        name = fanout_name(name)
        world = _args.count(world, "world", minimum=1)
        self.rank = _args.index(rank, "rank", world, of=f"{world} rollouts")
        auto_link: LinkModel | None = None
        self._link = None if link is None else link_arg(link)
        if isinstance(plan, str):
            kind_arg(plan, ("auto",) + KINDS, "plan")
            if plan == "auto" and link is not None:
                auto_link = link  # the plan is made once the trainer's sizes are known
                plan = make_plan(world, kind="chain")
            else:
                plan = make_plan(world, kind=plan)
        elif not isinstance(plan, FanoutPlan):
            raise TypeError(f"plan must be a kind ('auto', 'star', 'chain', 'tree') or a memsem.FanoutPlan, got "
                            f"{plan!r:.80} ({type(plan).__name__})")
        if plan.world != world:
            raise ValueError(f"plan must be a plan of world={world} ranks, got {plan!r}")
        if not isinstance(on_mismatch, str) or on_mismatch not in ("raise", "bypass"):
            raise ValueError(f"on_mismatch must be 'raise' or 'bypass', got {on_mismatch!r}")
        if not isinstance(follow, bool):
            raise TypeError(f"follow must be True or False, got {follow!r}")
        if not isinstance(delta, bool):
            raise TypeError(f"delta must be True or False, got {delta!r}")
        self.delta = delta
        self.delta_wait = _args.timeout(delta_wait, "delta_wait")
        self.name = name
        self.world = world
        self.slots = _args.count(slots, "slots", minimum=2, maximum=16)
        self.depth = None if depth is None else _args.count(depth, "depth", minimum=1, maximum=64)
        self.attach_timeout = _args.timeout(attach_timeout, "attach_timeout", positive=True)
        self.timeout = _args.timeout_or(timeout, core.timeout)
        self.on_mismatch = on_mismatch
        self._core = core
        self._label = f"rank {self.rank} of {name!r}"
        self._cond = threading.Condition()
        self._held: dict[int, _Held] = {}
        self._records: dict[int, _Offered] = {}  # delta records offered on, by version
        self._free: list[np.ndarray] = []
        self._stats = RelayStats()
        #: the follower's last error (it retries): ``(serial, error)``; a call reports only the
        #: ones of attempts made while it waited, and only as the cause of its own timeout
        self._error: tuple[int, BaseException] | None = None
        self._errors = 0  # serial of the follower's errors
        self._fatal: BaseException | None = None  # the follower stopped (a bug): every call raises it
        self._gen: tuple[int, int] | None = None  # the trainer followed (trainer_identity), set by the follower
        self._pending: DigestMismatchError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._up = Upstreams(core, name, rank=self.rank, world=world, plan=plan, auto_link=auto_link,
                             attach_timeout=self.attach_timeout, timeout=self.timeout, stop=self._check_stop,
                             on_reattach=self._note_reattach)
        self._pool = _futures.ThreadPoolExecutor(self.depth or MAX_AUTO_DEPTH, thread_name_prefix=f"memsem-relay{self.rank}")
        buf = np.zeros(MANIFEST_BYTES, np.uint8)
        self._manifest = TensorRef(core.publish_spec(buf, name=manifest_name(name, self.rank), access="r", slots=2),
                                   core)
        core.children.add(self)  # the runtime's close() closes this relay first: its waiters wake at once
        if follow:
            self.start()

    # -- public --------------------------------------------------------------------------------------
    @property
    def plan(self) -> FanoutPlan:
        """The fan-out plan (final once the trainer is found: ``plan="auto"`` with ``link``)."""
        return self._up.plan

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
                                       reattached=list(s.reattached), faults=list(s.faults), dropped=list(s.dropped),
                                       generations=list(s.generations), deltas=list(s.deltas),
                                       records=dict(s.records))

    @property
    def generation(self) -> int | None:
        """The generation of the trainer's state-dict window this relay follows (None until
        it found one). It changes when a new publisher of the name (a restarted trainer)
        or a republish is followed: versions count from 1 again."""
        g = self._gen
        return None if g is None else g[1]

    def held(self) -> list[int]:
        """Versions this relay holds complete (and serves), oldest first."""
        with self._cond:
            return sorted(v for v, h in self._held.items() if h.complete and h.gen == self._gen)

    def prepare(self, timeout: float | None = None) -> None:
        """Look the trainer's windows up now (waiting for them up to ``timeout`` s), so the first
        version starts without that delay. Raises as ``lookup``; RuntimeClosedError: the relay
        or its runtime is closed (also while waiting)."""
        t = _args.timeout_or(timeout, self.timeout)
        self._check_stop()
        self._up.trainer(t)

    def version(self) -> int:
        """The trainer's latest committed version (with digests). Raises as ``TensorRef.version``;
        RuntimeClosedError: the relay or its runtime is closed."""
        self._check_stop()
        return self._up.trainer(self.timeout)[1].version()

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        """Block until the trainer committed ``version`` (or a newer one); returns it.

        Raises:
            As ``TensorRef.wait_version``. RuntimeClosedError: the relay or its runtime is
            closed (at once, or within a slice of the wait). WindowRetiredError: the trainer
            was replaced (restarted, or republished) while waited for, raised once the relay
            follows the new one (``generation`` says which; its versions count from 1 again).
            MemsemTimeoutError: no such commit (nor a new trainer) within ``timeout`` s.
        """
        version = _args.version(version)
        t = _args.timeout_or(timeout, self.timeout)
        self._check_stop()
        wait = Wait(f"version {version} of {self.name!r} (the trainer's commit, seen by relay {self._label})", t,
                    telemetry=self._core.telemetry, state="not committed")
        gen0 = self._gen
        try:
            sd, dg = self._up.trainer(max(wait.left(), 1e-3))
            if gen0 is not None and trainer_identity(sd) != gen0:  # found another trainer: once followed, say so
                self._await_new_trainer(gen0, wait, f"version {version} was awaited", None)
            gen0 = gen0 or trainer_identity(sd)
            try:
                return self._core.wait_version(dg.spec, version, wait.left(), stop=self._check_stop)
            except (StaleReferenceError, PeerLostError) as exc:  # that trainer's windows are going
                self._up.forget_trainer_if_gone()
                self._await_new_trainer(gen0, wait, f"version {version} was awaited", exc)
                raise AssertionError("unreachable") from exc  # pragma: no cover
        except MemsemTimeoutError as exc:
            raise wait.error() from exc  # one error naming this call's wait, whichever step ran out

    def load(self, into: Mapping[str, Any] | None = None, *, version: int = 0, timeout: float | None = None) -> int:
        """Block until this relay holds a version ``>= version`` (0: the trainer's latest now),
        checked chunk by chunk; copy the newest such version into ``into`` (if given: existing
        tensors, like ``StateDictRef.load``); return it.

        The version is bit-exact (every chunk matched the trainer's digest); it may be newer
        than ``version`` when the trainer committed meanwhile.

        Raises:
            KeyError / ValueError / TypeError: ``into`` does not fit the state dict (before any
                wait). DigestMismatchError: a relay upstream served wrong bytes (``on_mismatch=
                "raise"``; raised once, naming it).
            MemsemTimeoutError: no such version within ``timeout`` s (default the relay's),
                naming the version; when the relay's follower failed while the call waited (the
                trainer not there yet, or gone: ``PeerLostError``), its last error is the
                cause and the message's last words. The follower retries its failures; a call
                never raises one made before it.
            WindowRetiredError: ``version`` was one of a trainer that was replaced (restarted)
                while waited for: the relay follows the new one (``generation``), whose
                versions count from 1 again.
            RuntimeClosedError: the relay or its runtime is closed: at once for a call made
                after the close, and for a call waiting when it closes (the runtime's
                ``close()`` closes its relays first, which wakes their waiters).
        """
        t = _args.timeout_or(timeout, self.timeout)
        version = _args.version(version)
        scatter = self._scatter(into) if into is not None else None
        h = self._acquire(version, t)
        try:
            if scatter is not None:
                if scatter[2] is not h.sd:  # a version of a restarted trainer: its own layout
                    scatter = self._scatter(into, h.sd)
                ranges, _keep, _ = scatter
                base = array_address(h.buf)
                for off, n, addr in ranges:
                    if n:
                        native.memcpy(addr, base + off, n)
        finally:
            self._release(h)
        return h.version

    @contextlib.contextmanager
    def hold(self, version: int = 0, timeout: float | None = None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """``with relay.hold() as (v, tensors):`` numpy views (name -> array) of the newest held
        version ``>= version``, valid inside the block (the relay does not reuse that memory
        meanwhile; it allocates another buffer if it must). Zero-copy; read-only by contract.

        The version is chosen and held in one step, so what the block sees is always a
        complete version whose every chunk matched the trainer's digest, whatever the relay
        does meanwhile (it may complete newer versions and drop older ones; never this one).

        Raises:
            As :meth:`load`.
        """
        t = _args.timeout_or(timeout, self.timeout)
        h = self._acquire(_args.version(version), t)
        try:
            lay = h.sd.layout
            hb = lay.header_bytes
            yield h.version, {e.name: h.buf[hb + e.offset:hb + e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
                              for e in lay.entries}
        finally:
            self._release(h)

    def _acquire(self, version: int, t: float) -> _Held:
        """Wait (up to ``t`` s) until a complete version ``>= version`` (0: the trainer's latest
        now) is held, and hold the newest such one (its memory is not reused until
        :meth:`_release`): the choice and the hold are one step under the relay's lock.

        The call fails for its own reasons only: the relay or its runtime closed, a pending
        digest mismatch, a follower that stopped, or its own deadline (a MemsemTimeoutError
        naming the version; the follower's last error of an attempt made meanwhile is its
        cause and its last words). Errors of the follower's attempts are retried by the
        follower, never raised by a later call.
        """
        self._check_stop()
        with self._cond:
            seen = self._errors
        what = f"version {version}" if version else "the latest version"
        wait = Wait(f"{what} at relay {self._label}", t, telemetry=self._core.telemetry, state="not held",
                    detail=lambda: self._detail(seen), stop=self._check_stop)
        gen0 = self._gen  # an explicit version is one of this trainer's (None: of the first one found)
        target, tgen = version, None
        try:
            while True:
                if not version and (tgen is None or tgen != self._gen):
                    try:  # the latest version of the trainer that holds the name now
                        tgen, target = self._latest(wait)
                    except (StaleReferenceError, PeerLostError):  # gone: the next holder, when there is one
                        self._up.forget_trainer_if_gone()
                        tgen = None
                        wait.sleep(self._stop.wait)
                        continue
                with self._cond:
                    if self._pending is not None:
                        err, self._pending = self._pending, None
                        raise err
                    if version and gen0 is not None and self._gen != gen0:
                        raise self._replaced(gen0, f"version {version} was awaited")
                    want = tgen if not version else self._gen
                    ok = [h for v, h in self._held.items() if h.complete and h.gen == want and v >= target]
                    if ok:
                        h = max(ok, key=lambda x: x.version)
                        h.holds += 1
                        break
                    if self._fatal is not None:
                        raise self._fatal
                    self._check_stop()
                    wait.sleep(self._cond.wait)  # woken by a version completed, an error, close()
        except MemsemTimeoutError as exc:
            if exc.what == wait.what:
                raise self._with_cause(exc, seen)
            raise self._with_cause(wait.error(), seen) from exc  # a step of this call ran out: its deadline
        try:
            self._on_event("held", h.version, -1, None)
        except BaseException:
            self._release(h)
            raise
        return h

    def _latest(self, wait: Wait) -> tuple[tuple[int, int], int]:
        """The trainer that holds the name (its windows looked up within ``wait``'s deadline)
        and its latest version."""
        sd, dg = self._up.trainer(max(wait.left(), 1e-3))
        return trainer_identity(sd), self._core.latest_version(dg.spec)

    def _replaced(self, gen0: tuple[int, int], during: str, cause: BaseException | None = None) -> WindowRetiredError:
        new = self._gen
        return WindowRetiredError(
            f"the trainer of {self.name!r} followed by relay {self._label} was replaced while {during} "
            f"(its state-dict window's generation {gen0[1]} -> {new[1] if new else None}"
            + (f"; {type(cause).__name__}: {cause}" if cause is not None else "")
            + "): the relay follows the new trainer, whose versions count from 1 again (relay.generation)",
            window=self.name, generation=gen0[1], found=new[1] if new else None)

    def _await_new_trainer(self, gen0: tuple[int, int], wait: Wait, during: str, cause: BaseException | None) -> None:
        """The trainer ``gen0``'s windows are gone: wait (within ``wait``) until the follower
        follows another one, then raise WindowRetiredError; at the deadline, the wait's
        timeout (its cause: ``cause``)."""
        with self._cond:
            while self._gen == gen0 or self._gen is None:
                self._check_stop()
                try:
                    wait.sleep(self._cond.wait)  # woken when the follower follows a new trainer
                except MemsemTimeoutError as exc:
                    raise exc from cause
        raise self._replaced(gen0, during, cause)

    def _detail(self, seen: int) -> str:
        with self._cond:
            held = sorted(self._held)
            err = self._error
        more = ""
        if err is not None and err[0] > seen:
            more = f"; the relay's last attempt: {type(err[1]).__name__}: {err[1]}"
        return f"holds {held}{more}"

    def _with_cause(self, exc: MemsemTimeoutError, seen: int) -> MemsemTimeoutError:
        with self._cond:
            err = self._error
        if exc.__cause__ is None and err is not None and err[0] > seen:
            exc.__cause__ = err[1]
        return exc

    def _release(self, h: _Held) -> None:
        with self._cond:
            h.holds -= 1
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Stop following, retire this relay's windows (its children re-attach upstream), join
        its threads; ``timeout``: seconds to wait for each window's readers (default the
        relay's). Safe twice."""
        timeout = _args.timeout_or(timeout, self.timeout)
        if self._stop.is_set() and self._pool is None:
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self.timeout + 2 * RETRY_S)
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
        for o in list(self._records.values()):
            with contextlib.suppress(MemsemError):
                core.unpublish_spec(o.spec, timeout=timeout)
        self._records.clear()
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
        and ``"complete"``; and on a consumer's thread at ``"held"`` (``load`` or ``hold`` chose
        and holds ``version``, before it copies or yields it). Tests override it (to stop, block
        or corrupt); nothing else should."""

    # -- the follower ------------------------------------------------------------------------------------
    def _check_stop(self) -> None:
        """The stop check of every wait of the relay, its follower's and its callers' (handed
        to ``Upstreams`` and each wait): the relay or its runtime closed (RuntimeClosedError)."""
        if self._stop.is_set() or self._core.closed:
            raise RelayClosing(f"relay {self._label} is closed"
                               + (" (its runtime is closed)" if self._core.closed else ""))

    def _scatter(self, into: Mapping[str, Any],
                 tr: StateDictRef | None = None) -> tuple[list[tuple[int, int, int]], list, StateDictRef]:
        tr = tr or self._up.trainer(self.timeout)[0]
        if not isinstance(into, Mapping):
            raise TypeError(f"into must be a mapping of name to tensor, got {type(into).__name__}")
        ranges, keep = tr.ranges(into, tr.layout.entries, "into")
        return ranges, keep, tr

    def _follow(self) -> None:
        last = 0
        while not self._stop.is_set():
            try:
                if self._adopt():
                    last = 0  # a new trainer: its versions count from 1
                last = self._one(last)
            except RelayClosing:
                return
            except MemsemError as exc:  # the trainer is gone or unreachable: retried (load() waits)
                if self._stop.is_set() or self._core.closed:
                    return
                log.debug("relay %s: %s", self._label, exc)
                if isinstance(exc, (StaleReferenceError, PeerLostError)):
                    self._up.forget_trainer_if_gone()  # the next attempt follows whoever holds the name
                with self._cond:
                    self._errors += 1
                    self._error = (self._errors, exc)
                    self._cond.notify_all()
                self._stop.wait(RETRY_S)  # a pause on the stop event: close() ends it
            except Exception as exc:  # a bug: say it to load() and stop
                log.exception("relay %s stopped", self._label)
                with self._cond:
                    self._fatal = MemsemError(f"relay {self._label} stopped: {type(exc).__name__}: {exc}")
                    self._cond.notify_all()
                return

    def _adopt(self) -> bool:
        """Find the trainer (waiting ``attach_timeout`` for its name); when it is another one
        than the trainer followed so far (restarted, or republished), follow it: the versions
        of the old one are dropped (unoffered and retired: their readers get
        StaleReferenceError; a consumer's explicit version of it raises WindowRetiredError).
        Returns whether it changed."""
        sd, _ = self._up.trainer(self.attach_timeout)
        ident = trainer_identity(sd)
        if ident == self._gen:
            return False
        with self._cond:
            old, self._gen = self._gen, ident
            self._stats.generations.append(ident[1])
            stale = [v for v, h in self._held.items() if h.gen != ident]
            self._cond.notify_all()
        for v in stale:
            self._drop(v, complete=True)
        self._forget_records(lambda o: o.gen != ident)
        if old is None:
            return False
        log.info("relay %s: follows a new trainer of %r (its window's generation %d -> %d)", self._label, self.name,
                 old[1], ident[1])
        return True

    def _one(self, last: int) -> int:
        """Get the newest version > ``last`` its upstream offers; returns the version held."""
        gen = self._gen
        while True:
            self._check_stop()
            up, v = self._up.attach(last + 1)
            try:
                dg = self._up.digests(v)
            except VersionGoneError:
                last = max(last, v)  # too old already: a newer one is there
                continue
            sd = self._up.trainer(self.timeout)[0]
            if trainer_identity(sd) != gen:  # looked up again meanwhile: another trainer
                raise WindowRetiredError(f"relay {self._label}: the trainer of {self.name!r} changed",
                                         window=self.name, generation=gen[1] if gen else None)
            base = self._base(v, gen) if self.delta and sd.layout.delta is not None else None
            try:
                recs = self._delta_records(up, base, v, sd) if base is not None else None
                h = self._start(v, dg, sd)
                try:
                    if recs is not None:  # the chunks the records rebuild are held before any is moved
                        self._apply_delta(h, base, recs)
                except BaseException:
                    self._drop(v, complete=False)
                    raise
            finally:
                if base is not None:
                    self._release(base)
            try:
                self._fill(h, up, dg)
            except UpstreamGone:
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
    def _note_reattach(self, v: int, frm: int, to: int, reason: str) -> None:
        with self._cond:
            self._stats.reattached.append((v, frm, to, reason))
        log.info("relay %s: version %d: re-attached from rank %d to %s (%s)", self._label, v, frm,
                 "the trainer" if to == TRAINER else f"rank {to}", reason)

    # -- holding versions ------------------------------------------------------------------------------------
    def _start(self, v: int, dg: Digests, sd: StateDictRef) -> _Held:
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
        h = _Held(v, buf, spec, ro.to_bytes().hex(), trainer_identity(sd), sd, dg)
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
            gen = self._gen
            offers = sorted((v, h.offer) for v, h in self._held.items() if h.gen == gen)
            records = sorted((v, o.offer) for v, o in self._records.items() if o.gen == gen)
        raw = manifest_bytes(self.rank, offers, gen, records)
        with self._core.write_section(self._manifest.spec, copy=False) as sec:
            arr = sec.array().reshape(-1).view(np.uint8)
            arr[:len(raw)] = np.frombuffer(raw, np.uint8)
            arr[len(raw):] = 0

    # -- deltas (memsem.sync._relay_delta) -------------------------------------------------------------------------
    def _base(self, v: int, gen: tuple[int, int] | None) -> _Held | None:
        """The newest complete version older than ``v`` of the trainer ``gen``, held (released
        by the caller), or None."""
        with self._cond:
            ok = [h for h in self._held.values() if h.complete and h.gen == gen and h.version < v and h.dg is not None]
            if not ok:
                return None
            h = max(ok, key=lambda x: x.version)
            h.holds += 1
            return h

    def _delta_records(self, up: Upstream, base: _Held, v: int, sd: StateDictRef) -> list[Record] | None:
        """The records of versions ``base.version + 1`` to ``v``: those ``up`` offers, the rest
        from the trainer's delta history; offered on from here. None: one is missing, or they
        move more than ``DELTA_MAX`` of the window's bytes (the version is moved in full)."""
        tiles, _ = tiles_of(sd)
        want = range(base.version + 1, v + 1)
        got: dict[int, Record] = {}
        with self._cond:
            for u in want:
                o = self._records.get(u)
                if o is not None and o.gen == base.gen:
                    got[u] = o.record
        for u in want:
            hexref = up.records.get(u)
            if u in got or hexref is None:
                continue
            try:
                rec = fetch_record(self._core, RefSpec.from_bytes(bytes.fromhex(hexref)), u, tiles)
            except (MemsemError, ValueError) as exc:  # gone meanwhile, or not a record: the trainer's
                log.debug("relay %s: record of version %d from %s: %s", self._label, u, up.label, exc)
                continue
            if rec.base == u - 1:
                got[u] = rec
                self._count_record(up.rank, rec)
        missing = [u for u in want if u not in got]
        if missing:
            more = trainer_records(sd, missing, self.delta_wait)
            for u in missing:
                if u in more:
                    got[u] = more[u]
                    self._count_record(TRAINER, more[u])
        for u in want:
            if u in got:
                self._offer_record(got[u], base.gen)
        recs = [got.get(u) for u in want]
        if any(r is None for r in recs) or not worth_it(recs, base.buf.nbytes):
            return None
        return recs

    def _count_record(self, rank: int, rec: Record) -> None:
        with self._cond:
            s = self._stats
            s.records[rank] = s.records.get(rank, 0) + 1
            s.delta_bytes += rec.raw.nbytes
            s.bytes_received += rec.raw.nbytes

    def _offer_record(self, rec: Record, gen: tuple[int, int]) -> None:
        """Publish ``rec`` (read-only) for this relay's children; the oldest beyond
        ``KEEP_RECORDS`` are retired."""
        with self._cond:
            if rec.version in self._records:
                return
        spec = self._core.publish_spec(rec.raw, access="r")
        with self._cond:
            self._records[rec.version] = _Offered(rec, spec, spec.to_bytes().hex(), gen)
        self._forget_records(lambda o: o.record.version <= max(self._records) - KEEP_RECORDS)

    def _forget_records(self, which: Any) -> None:
        with self._cond:
            gone = [self._records.pop(v) for v, o in list(self._records.items()) if which(o)]
        for o in gone:
            with contextlib.suppress(MemsemError):
                self._core.unpublish_spec(o.spec, timeout=self.timeout)

    def _apply_delta(self, h: _Held, base: _Held, recs: list[Record]) -> None:
        """Build ``h`` from ``base`` and ``recs``: the chunks that then match the trainer's
        digests are marked ready (the rest are moved by ``_fill``)."""
        native.memcpy(array_address(h.buf), array_address(base.buf), h.buf.nbytes)
        t0 = time.perf_counter()
        good, _checked = apply_delta(h.buf, h.sd, recs, h.dg)
        dt = time.perf_counter() - t0
        for k in good:
            self._core.mark_ready(h.spec, k)
        with self._cond:
            h.have.update(good)
            self._stats.deltas.append(h.version)
            self._stats.digest_s += dt

    # -- moving chunks -------------------------------------------------------------------------------------------
    def _fill(self, h: _Held, up: Upstream, dg: Digests) -> None:
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

            for _ in range(self.depth or chunks_in_flight(self._link, dg.chunk_bytes, MAX_AUTO_DEPTH)):
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

    def _recover(self, err: BaseException, up: Upstream, v: int) -> Upstream:
        if isinstance(err, (RelayClosing, UpstreamGone)):
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
            return self._up.reattach(up, v, f"DigestMismatchError: chunk {err.chunk}")
        if not isinstance(err, MemsemError):
            raise err
        if up.rank == TRAINER:
            if isinstance(err, StaleReferenceError):
                raise UpstreamGone() from err  # the trainer's version v was overwritten
            raise err
        if isinstance(err, StaleReferenceError):
            # retired by its relay (which moved on) or the relay is gone: its manifest says which
            try:
                if not self._up.offers(up.rank, v):
                    raise UpstreamGone() from err
            except MemsemError:
                pass
        return self._up.reattach(up, v, f"{type(err).__name__}: {err}")

    def _fetch(self, up: Upstream, h: _Held, k: int, dg: Digests) -> None:
        c = dg.chunk_bytes
        dst = h.buf[k * c:min((k + 1) * c, dg.nbytes)]
        core = self._core
        self._check_stop()
        self._on_event("fetch", h.version, k, None)
        if up.spec is None:
            core.transfer(h.sd.spec, "get", k * c, dst, version=h.version)  # the trainer whose version h is
        else:
            core.wait_tile(up.spec, k, self.timeout, stop=self._check_stop)  # its ready word: the parent holds it
            core.transfer(up.spec, "get", k * c, dst)
        t0 = time.perf_counter()
        got = digest_of(dg.algo, dst, dg.size)
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


__all__ = ["Relay", "RelayStats"]
