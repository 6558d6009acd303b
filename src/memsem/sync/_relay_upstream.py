"""A relay's upstream side (docs/fanout.md): the relays' manifests, and finding the nearest
upstream that offers a version.

Each relay offers the versions it holds in its *manifest* (``<name>@relay.<rank>``, a
double-buffered window: JSON listing each version and the read-only ref of its data window).
:class:`Upstreams` finds, for one relay, the trainer's windows (the state dict and its digest
window, and the plan when it is chosen by the trainer's sizes), waits for a parent's offer and
re-attaches above a parent that failed. Every wait here is a wait of the runtime's one wait
primitive (a name looked up with a timeout, a version of a window waited for on its word),
handed the relay's stop check, so a relay that closes ends each of them within a slice.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

import numpy as np

from memsem._buffers import array_address
from memsem._errors import MemsemError, MemsemTimeoutError, RuntimeClosedError, StaleReferenceError
from memsem.core import RuntimeCore, Wait
from memsem.gva import RefSpec
from memsem.sync._fanout_plan import TRAINER, FanoutPlan, LinkModel, plan as make_plan
from memsem.sync._fanout_source import Digests, digests_name, read_digests, read_sizes
from memsem.sync._state_dict import StateDictRef, lookup_state_dict
from memsem.refs._tensorref import TensorRef

log = logging.getLogger("memsem.sync._relay")

#: bytes of a relay's manifest window
MANIFEST_BYTES = 16 << 10


def manifest_name(name: str, rank: int) -> str:
    """The manifest window's name of relay ``rank`` of the state dict ``name``."""
    return f"{name}@relay.{rank}"


def trainer_identity(sd: StateDictRef) -> tuple[int, int]:
    """Which trainer a state-dict ref belongs to: its window's ``(gva, generation)`` (a
    restarted trainer, or a republish, is another window: versions count from 1 again)."""
    return sd.spec.gva, sd.spec.generation


def manifest_bytes(rank: int, offers: list[tuple[int, str]], trainer: tuple[int, int] | None = None,
                   records: list[tuple[int, str]] | None = None) -> bytes:
    """The manifest of relay ``rank`` offering ``(version, hex of the data window's ref)`` of
    the trainer ``trainer`` (:func:`trainer_identity`), and ``records``: ``(version, hex of the
    ref of a window holding that version's delta record)`` (``memsem.sync._relay_delta``)."""
    raw = json.dumps({"rank": rank, "offers": offers, "trainer": list(trainer) if trainer else None,
                      "records": records or []}, separators=(",", ":")).encode()
    if len(raw) > MANIFEST_BYTES:
        raise MemsemError(f"relay rank {rank}: manifest of {len(raw)} bytes exceeds {MANIFEST_BYTES}")
    return raw


class UpstreamGone(Exception):
    """Version ``v`` can no longer be had upstream: follow the newest one instead."""


class RelayClosing(RuntimeClosedError):
    """The relay (or its runtime) is closing: every wait of its follower ends with this."""


class Upstream:
    """Where chunks come from: the trainer (``rank`` -1) or a relay's data window of one version."""

    def __init__(self, rank: int, label: str, spec: RefSpec | None, records: dict[int, str] | None = None) -> None:
        self.rank = rank
        self.label = label
        self.spec = spec  # the relay's data window of the version (None: the trainer)
        self.records = records or {}  # version -> hex of its delta record's window, as the relay offers


class Upstreams:
    """One relay's view upwards: the trainer's windows, the manifests of the ranks above it.

    Args:
        core: the relay's runtime core. name / rank / world: as ``Relay``.
        plan: the plan; with ``auto_link``, replaced once by the plan the trainer's sizes give.
        attach_timeout / timeout: as ``Relay``.
        stop: the relay's stop check (raises :class:`RelayClosing`), handed to every wait.
        on_reattach: called ``(version, from rank, to rank, reason)`` for each re-attachment.
    """

    def __init__(self, core: RuntimeCore, name: str, *, rank: int, world: int, plan: FanoutPlan,
                 auto_link: LinkModel | None, attach_timeout: float, timeout: float,
                 stop: Callable[[], None], on_reattach: Callable[[int, int, int, str], None]) -> None:
        self._core = core
        self.name = name
        self.rank = rank
        self.world = world
        self.plan = plan
        self._auto_link = auto_link
        self.attach_timeout = attach_timeout
        self.timeout = timeout
        self.stop = stop
        self._on_reattach = on_reattach
        self._label = f"rank {rank} of {name!r}"
        self._lock = threading.Lock()  # one lookup of the trainer's windows (and the auto plan)
        self._trainer: tuple[StateDictRef, TensorRef] | None = None
        self._manifests: dict[int, TensorRef] = {}

    # -- the trainer ----------------------------------------------------------------------------
    def identity(self) -> tuple[int, int] | None:
        """The trainer found (:func:`trainer_identity`), or None (not yet, or forgotten)."""
        found = self._trainer
        return None if found is None else trainer_identity(found[0])

    def forget_trainer_if_gone(self) -> bool:
        """After a failure on the trainer's windows: look its name up again (no wait); when no
        live window holds it any more, or another one does (a restarted trainer), forget the
        windows found, so the next :meth:`trainer` looks them up (waiting for the new holder).
        Returns whether they were forgotten."""
        if not self._lock.acquire(timeout=self.timeout):  # a lookup runs: it finds the holder now
            return False
        try:
            found = self._trainer
            if found is None:
                return False
            try:  # both windows: a trainer that closes retires its digest window first
                sd = self._core.lookup_spec(self.name, 0.0)
                dg = self._core.lookup_spec(digests_name(self.name), 0.0)
                same = ((sd.gva, sd.generation) == trainer_identity(found[0])
                        and (dg.gva, dg.generation) == (found[1].spec.gva, found[1].spec.generation))
            except MemsemError:
                same = False  # not found, retired, or its holder is dead
            if not same:
                self._trainer = None
            return not same
        finally:
            self._lock.release()

    def trainer(self, t: float) -> tuple[StateDictRef, TensorRef]:
        """The trainer's state-dict and digest windows, looked up once (waiting up to ``t`` s
        for them). Raises as ``lookup``; RelayClosing."""
        found = self._trainer
        if found is not None:
            return found
        core = self._core
        wait = Wait(f"the fan-out windows of {self.name!r}", t, telemetry=core.telemetry, state="not found")
        # prepare(), the callers and the follower thread look up once, make the plan once; each
        # waits for the others' lookup within its own deadline
        if not self._lock.acquire(timeout=t):
            raise wait.error()
        try:
            if self._trainer is None:
                sd = lookup_state_dict(core, self.name, timeout=max(wait.left(), 1e-3), stop=self.stop)
                dg = TensorRef(core.lookup_spec(digests_name(self.name), wait.left(), stop=self.stop), core)
                if self._auto_link is not None:  # every rank computes the same plan from the same sizes
                    chunk, nbytes = read_sizes(core, dg.spec)
                    self.plan = make_plan(self.world, kind="auto", model_bytes=max(1, nbytes),
                                          chunk_bytes=max(1, chunk), link=self._auto_link)
                    self._auto_link = None
                self._trainer = (sd, dg)
            return self._trainer
        finally:
            self._lock.release()

    def trainer_version(self, at_least: int) -> int:
        """Wait for the trainer's commit of a version ``>= at_least``: a word wait on its digest
        window, for as long as the relay runs (renewed every ``timeout`` s; the stop check ends
        it)."""
        dg = self.trainer(self.timeout)[1]
        while True:
            try:
                return self._core.wait_version(dg.spec, at_least, self.timeout, stop=self.stop)
            except MemsemTimeoutError:
                continue  # no commit within a timeout: a follower waits for the next version

    def digests(self, version: int) -> Digests:
        """The trainer's digests of ``version`` (waited for up to ``timeout`` s). Raises
        VersionGoneError: overwritten already."""
        return read_digests(self._core, self.trainer(self.timeout)[1].spec, version, self.timeout, self.stop)

    # -- the relays above -------------------------------------------------------------------------
    def manifest(self, rank: int, timeout: float) -> TensorRef:
        """Relay ``rank``'s manifest window (looked up waiting up to ``timeout`` s; kept)."""
        m = self._manifests.get(rank)
        if m is None:
            core = self._core
            m = TensorRef(core.lookup_spec(manifest_name(self.name, rank), timeout, stop=self.stop), core)
            self._manifests[rank] = m
        return m

    def read_manifest(self, m: TensorRef) -> tuple[int, dict[int, str], dict[int, str]]:
        """``(manifest version, {version: hex of its data window's ref}, {version: hex of its
        delta record's ref})``: only offers of the trainer this relay follows (a relay that
        still follows a trainer gone since, or has already followed a restarted one, offers
        nothing to this one)."""
        out = np.empty(MANIFEST_BYTES, np.uint8)
        mv = self._core.gather(m.spec, [(0, MANIFEST_BYTES, array_address(out))], keep=out)
        raw = out.tobytes().rstrip(b"\0")
        if not raw:
            return mv, {}, {}
        try:
            d = json.loads(raw)
            offers = {int(v): str(r) for v, r in d["offers"]}
            records = {int(v): str(r) for v, r in d.get("records", [])}
            theirs = d.get("trainer")
            theirs = None if theirs is None else (int(theirs[0]), int(theirs[1]))
        except (ValueError, KeyError, TypeError):
            raise MemsemError(f"relay manifest {m.spec.label} is malformed") from None
        if theirs is None or theirs != self.identity():
            return mv, {}, {}
        return mv, offers, records

    def offers(self, rank: int, version: int) -> bool:
        """Whether relay ``rank`` still offers ``version`` (its manifest, read once it is found
        within ``attach_timeout``). Raises MemsemError: it cannot be read."""
        return version in self.read_manifest(self.manifest(rank, self.attach_timeout))[1]

    def offer_of(self, rank: int, at_least: int, exact: bool, timeout: float) -> tuple[Upstream, int]:
        """Attach to relay ``rank``: wait (up to ``timeout`` s in all) for it to offer a version
        ``>= at_least`` (``exact``: exactly ``at_least``); returns it and the version. The wait
        is on the manifest's version word (a relay commits its manifest for every offer).

        Raises:
            UpstreamGone: ``exact`` and it offers only newer ones. MemsemTimeoutError (naming the
            offer), PeerLostError, StaleReferenceError...: it is not usable. RelayClosing.
        """
        what = f"an offer of version {'' if exact else '>= '}{at_least} by relay rank {rank} of {self.name!r}"
        wait = Wait(what, timeout, telemetry=self._core.telemetry, state="not made")
        try:
            m = self.manifest(rank, timeout)
            while True:
                wait.check()
                self.stop()
                mv, offers, records = self.read_manifest(m)
                good = [v for v in offers if (v == at_least if exact else v >= at_least)]
                if good:
                    v = max(good)
                    spec = RefSpec.from_bytes(bytes.fromhex(offers[v]))
                    return Upstream(rank, f"rank {rank} of {self.name!r}", spec, records), v
                if exact and any(v > at_least for v in offers):
                    raise UpstreamGone()
                self._core.wait_version(m.spec, mv + 1, wait.left(), stop=self.stop)
        except StaleReferenceError:
            self._manifests.pop(rank, None)  # republished (a restarted relay): looked up again next time
            raise
        except MemsemTimeoutError as exc:
            if exc.what == what:
                raise
            raise wait.error() from exc  # one error naming the offer, whichever wait ran out

    def attach(self, at_least: int) -> tuple[Upstream, int]:
        """The nearest usable upstream offering a version ``>= at_least``, and its newest one.
        A parent is waited for (``attach_timeout``) only once the trainer committed one."""
        newest = self.trainer_version(at_least)
        passed: tuple[int, str] | None = None  # the first rank passed over, and why
        for r in self.plan.upstream(self.rank):
            try:
                if r == TRAINER:
                    up, v = Upstream(TRAINER, "the trainer", None), newest
                else:
                    up, v = self.offer_of(r, at_least, False, self.attach_timeout)
            except (RelayClosing, UpstreamGone):
                raise
            except MemsemError as exc:
                log.debug("relay %s: rank %d not usable: %s", self._label, r, exc)
                passed = passed or (r, f"{type(exc).__name__}: {exc}")
                continue
            if passed is not None:
                self._on_reattach(v, passed[0], r, passed[1])
            return up, v
        raise AssertionError("unreachable: the plan ends at the trainer")  # pragma: no cover

    def reattach(self, failed: Upstream, v: int, reason: str) -> Upstream:
        """The next upstream above ``failed`` that offers exactly version ``v``."""
        if failed.rank == TRAINER:
            raise MemsemError(f"relay {self._label}: nothing above the trainer ({reason})")
        chain = self.plan.upstream(self.rank)
        for r in chain[chain.index(failed.rank) + 1:]:
            self.stop()
            if r == TRAINER:
                self._on_reattach(v, failed.rank, TRAINER, reason)
                return Upstream(TRAINER, "the trainer", None)
            try:
                up, _ = self.offer_of(r, v, True, self.attach_timeout)
                self._on_reattach(v, failed.rank, r, reason)
                return up
            except (RelayClosing, UpstreamGone):
                raise
            except MemsemError as exc:
                reason = f"{reason}; rank {r}: {type(exc).__name__}"
        raise AssertionError("unreachable: the plan ends at the trainer")  # pragma: no cover


__all__ = ["MANIFEST_BYTES", "RelayClosing", "Upstream", "UpstreamGone", "Upstreams", "manifest_bytes",
           "manifest_name", "trainer_identity"]
