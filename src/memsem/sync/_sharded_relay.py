"""Relays of sharded slices: a rollout rank passes the slices it loaded on to the ranks of other
replicas that hold the same slices.

Rollout replica 2's TP rank ``r`` holds exactly what replica 1's TP rank ``r`` holds (the same
targets, the same plan). Instead of reading its slices from every trainer shard again, it reads
them from replica 1's rank ``r``:

* **The relay** (:class:`ShardedRelay`, on replica 1's rank ``r``) loads each version ``v``
  through its :class:`memsem.sync.ShardedReader` into its own tensors, then copies them into a
  double-buffered state-dict window of its own inside a write section whose header labels the
  bytes with the trainer's all-rank version ``v`` and the plan's digest. A child never reads a
  half-filled version (the section commits it whole; the window's other slot holds the version
  before).
* **The child** (:class:`ShardedRelayReader`) copies one version of the relay's window
  (one seqlock bracket on one node, owner-checked reads across nodes), then checks it against
  the trainer: each trainer rank its plan reads from gives the digest of exactly the byte runs
  the plan reads from it, of version ``v`` (``RuntimeCore.digest_runs``: tcp's DIGEST request,
  computed and bracketed at the trainer rank's owner, so only 16 bytes cross the link; on one
  node over the mapped window). The child digests the same runs of what it got, in the same
  order: a relay that serves wrong bytes, or another version's under the label ``v``, fails the
  check and is named (:class:`memsem.DigestMismatchError`); its bytes are not returned as ``v``.
  No pin is taken at the trainer: its write path never waits for a child.
* **A version gone** at the trainer (it committed twice since ``v``: ``v`` can no longer be
  checked) is not the relay's fault: the child loads from the trainer ranks themselves (its own
  :class:`ShardedReader` of the same plan), counted in ``fallbacks`` with the reason.
* **Plans must match**: the relay's header carries its plan's digest (targets, shapes, dtypes,
  every run of every trainer rank); a child whose plan differs is refused (ValueError naming
  the relay and both plans), before anything is loaded.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from memsem import _args
from memsem._errors import (
    DigestMismatchError,
    MemsemTimeoutError,
    NotSupportedError,
    VersionGoneError,
)
from memsem.core import RuntimeCore
from memsem.engines import run_digest
from memsem.sync._reshard import ReshardPlan
from memsem.sync._sharded import core_of
from memsem.sync._sharded_read import ShardedReader, ShardedStateDictRef
from memsem.sync._state_dict import StateDictRef, lookup_state_dict, publish_state_dict

#: the name of the relay window's header tensor (uint8, ``HEADER_BYTES``)
HEADER = "__memsem_relay__"
_MAGIC = b"memsem-shrelay/1"
#: magic (16), the trainer's version (8, little-endian), the plan's digest (16), reserved (24)
HEADER_BYTES = 64
#: the most runs one digest request asks for (a column slice reads one run per row: a plan's
#: runs of one trainer rank are asked for in groups)
DIGEST_RUNS = 1 << 14


def plan_digest(sharded_name: str, plan: ReshardPlan) -> bytes:
    """16 bytes naming a plan of a sharded state dict: its name, every target's name, shape and
    dtype, and every run of every trainer rank (two readers with equal digests read the same
    bytes from the same places into the same targets)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(sharded_name.encode() + b"\0")
    for n, s, d in zip(plan.names, plan.shapes, plan.dtypes):
        h.update(f"{n}\0{list(s)}\0{np.dtype(d).str}\0".encode())
    for r in plan.ranks:
        h.update(f"rank {r}\0".encode())
        h.update(np.ascontiguousarray(plan.runs[r], np.int64).tobytes())
    return h.digest()


def _header(version: int, pd: bytes) -> np.ndarray:
    out = np.zeros(HEADER_BYTES, np.uint8)
    out[:16] = np.frombuffer(_MAGIC, np.uint8)
    out[16:24] = np.frombuffer(int(version).to_bytes(8, "little"), np.uint8)
    out[24:40] = np.frombuffer(pd, np.uint8)
    return out


def _parse(hdr: np.ndarray, relay: str) -> tuple[int, bytes]:
    """``(the trainer's version, the plan's digest)`` of a relay window's header."""
    raw = np.asarray(hdr, np.uint8).tobytes()
    if len(raw) != HEADER_BYTES or raw[:16] != _MAGIC:
        raise ValueError(f"window {relay!r} is not a relay of sharded slices (no relay header)")
    return int.from_bytes(raw[16:24], "little"), raw[24:40]


def _window_tensors(plan: ReshardPlan) -> dict[str, np.ndarray]:
    if any(t is not None for t in plan.converts):
        raise NotSupportedError("a relay of targets converted on read (dtype=) is not supported: relay the "
                                "targets in the trainer's dtype and convert on each rank")
    if HEADER in plan.names:
        raise ValueError(f"a target may not be named {HEADER!r} (the relay window's header)")
    out = {n: np.zeros(s, d) for n, s, d in zip(plan.names, plan.shapes, plan.dtypes)}
    out[HEADER] = np.zeros(HEADER_BYTES, np.uint8)
    return out


class ShardedRelay:
    """A rollout rank that loads its slices from the trainer ranks and serves them on to the
    ranks of other replicas with the same plan (see the module docstring).

    Args:
        rt: this rank's ``memsem.Runtime``.
        reader: its :class:`ShardedReader` (targets in the trainer's dtypes: no ``dtype=``).
        name: the relay window's name (children's ``relay=``), e.g. ``"policy@tp0"``.
        replace: take the name over from a previous owner.

    Attributes:
        ref: the relay window (a double-buffered :class:`memsem.StateDictRef`: the targets and
        ``HEADER``). version: the trainer's version it serves (0: none yet). plan_digest.

    Raises:
        NotSupportedError: a plan with targets converted on read.
    """

    def __init__(self, rt: Any, reader: ShardedReader, *, name: str, replace: bool = False) -> None:
        if not isinstance(reader, ShardedReader):
            raise TypeError(f"reader must be a ShardedReader, got {type(reader).__name__}")
        self._core = core_of(rt)
        self.reader = reader
        self.name = _args.window_name(name, "name")
        self.plan_digest = plan_digest(reader.sharded.name, reader.plan)
        tensors = _window_tensors(reader.plan)
        tensors[HEADER] = _header(0, self.plan_digest)  # version 0 of the trainer: none yet
        self.ref = publish_state_dict(self._core, tensors, name=self.name, replace=replace)
        self.version = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"<ShardedRelay {self.name!r} of {self.reader.sharded.name!r} at version {self.version}>"

    def load(self, into: Mapping[str, Any], *, version: int = 0, timeout: float | None = None) -> int:
        """Load the newest version every trainer rank committed (at least ``version``) into
        ``into`` (``ShardedReader.load``), then serve it: one write section copies ``into``'s
        targets into the relay window and labels them with that version (children see it once
        the section commits; until then, the version before). Returns the version. Blocking:
        the load, then one copy of the targets' bytes (``plan.target_bytes()``).

        Raises:
            As ``ShardedReader.load`` and ``StateDictRef.write_section``.
        """
        v = self.reader.load(into, version=version, timeout=timeout)
        srcs = self.ref.sources({**{n: into[n] for n in self.reader.plan.names}, HEADER: _header(v, self.plan_digest)})
        with self.ref.write_section(copy=False, timeout=timeout) as sec:
            self.ref.fill(sec, srcs)
        self.version = v
        return v

    def close(self, timeout: float | None = None) -> None:
        """Unpublish the relay window (children's later loads fail). Safe twice; a close that
        raised (leases held past ``timeout``) may be retried."""
        if not self._closed:
            self._core.unpublish_spec(self.ref.spec, timeout=timeout)
            self._closed = True

    def __enter__(self) -> "ShardedRelay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardedRelayReader:
    """A rollout rank that loads its slices from a :class:`ShardedRelay` of the same plan and
    checks them against the trainer ranks' digests (see the module docstring). Followable
    (``version``, ``wait_version``, ``load``): ``rt.follow(child, into=child.empty())``.

    Args:
        sharded: the trainer's :class:`ShardedStateDictRef`. plan: this rank's plan (equal to
            the relay's). relay: the relay window's name. timeout: seconds to wait for the relay
            window to be published (0: it must exist now). pin_ttl: the pins of a load made from
            the trainer ranks (``ShardedReader``).

    Attributes:
        sharded, plan, relay (the relay window's name), loads, fallbacks (``(version, reason)``
        of each load made from the trainer ranks instead), relay_bytes (bytes copied from the
        relay), digest_s (seconds the checks took), trainer_reader (the :class:`ShardedReader`
        of the fallbacks).

    Thread safety: one load at a time per reader. A relay that is republished (restarted) is
    not followed: make a new reader (its window's old ref raises ``StaleReferenceError``).

    Raises (constructor):
        ValueError: the relay's plan is not this plan (names the relay and both plan digests),
        or its window is not a relay of these targets. WindowNotFoundError / MemsemTimeoutError:
        no relay of that name (within ``timeout``). NotSupportedError: targets converted on read.
    """

    def __init__(self, sharded: ShardedStateDictRef, plan: ReshardPlan, *, relay: str, timeout: float = 0.0,
                 pin_ttl: float | None = 10.0) -> None:
        self.sharded = sharded
        self.plan = plan
        self.relay = _args.window_name(relay, "relay")
        self._core: RuntimeCore = sharded._core
        self.plan_digest = plan_digest(sharded.name, plan)
        want = _window_tensors(plan)
        self.ref: StateDictRef = lookup_state_dict(self._core, self.relay, timeout=_args.timeout(timeout, "timeout"))
        have = self.ref.layout.index()
        for n, a in want.items():
            e = have.get(n)
            if e is None or e.shape != a.shape or e.dtype != a.dtype:
                got = None if e is None else f"{e.shape} {e.dtype}"
                raise ValueError(f"relay {self.relay!r} does not serve this plan: target {n!r} is {got} there, "
                                 f"{a.shape} {a.dtype} here")
        if len(have) != len(want):
            raise ValueError(f"relay {self.relay!r} serves {len(have) - 1} targets; this plan has {len(want) - 1}")
        self._hdr = np.zeros(HEADER_BYTES, np.uint8)
        self._check_plan(self._read_header()[1])
        self.trainer_reader = ShardedReader(sharded, plan, pin_ttl=pin_ttl, delta=False)
        # per trainer rank: the runs the plan reads (source order, merged where the source
        # continues) in groups of at most DIGEST_RUNS (one digest each), and where each piece
        # of a group lands here (target index, byte offset, nbytes)
        self._runs: dict[int, list[tuple[list[tuple[int, int]], list[tuple[int, int, int]]]]] = {}
        for r in plan.ranks:
            rows = plan.runs[r][np.argsort(plan.runs[r][:, 0], kind="stable")]
            groups: list[tuple[list[tuple[int, int]], list[tuple[int, int, int]]]] = []
            for off, ti, toff, n in rows.tolist():
                src = groups[-1][0] if groups else None
                if src and src[-1][0] + src[-1][1] == off:
                    src[-1] = (src[-1][0], src[-1][1] + n)
                else:
                    if src is None or len(src) >= DIGEST_RUNS:
                        groups.append(([], []))
                    groups[-1][0].append((off, n))
                groups[-1][1].append((ti, toff, n))
            self._runs[r] = groups
        self.loads = 0
        self.relay_bytes = 0
        self.digest_s = 0.0
        self.fallbacks: list[tuple[int, str]] = []

    def __repr__(self) -> str:
        return f"<ShardedRelayReader of {self.sharded.name!r} through relay {self.relay!r}: {self.plan!r}>"

    def _check_plan(self, pd: bytes) -> None:
        if pd != self.plan_digest:
            raise ValueError(f"relay {self.relay!r} serves plan {pd.hex()} of {self.sharded.name!r}; this reader's "
                             f"plan is {self.plan_digest.hex()} (another layout, rank or trainer layout): read "
                             "from a relay of the same targets and rank")

    def _read_header(self) -> tuple[int, bytes]:
        self.ref.load({HEADER: self._hdr}, strict=False)
        return _parse(self._hdr, self.relay)

    def empty(self, framework: str = "torch") -> dict[str, Any]:
        """New tensors for ``into`` (as ``ShardedReader.empty``)."""
        return self.trainer_reader.empty(framework)

    def version(self) -> int:
        """The trainer's version the relay serves now (0: none yet)."""
        return self._read_header()[0]

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        """Block until the relay serves ``version`` or a newer one; returns it.

        Raises:
            MemsemTimeoutError: the relay did not serve it within ``timeout`` s (default the
                runtime's; names the relay and the version it serves). As ``StateDictRef``'s waits.
        """
        version = _args.version(version, "version")
        t = _args.timeout_or(timeout, self._core.timeout)
        deadline = time.monotonic() + t
        while True:
            rv = self.ref.version()
            v = self._read_header()[0]
            if v >= version:
                return v
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise MemsemTimeoutError("", what="", timeout=t)
                self._core.wait_version(self.ref.spec, rv + 1, left)
            except MemsemTimeoutError:
                raise MemsemTimeoutError(
                    f"relay {self.relay!r} of {self.sharded.name!r} serves version {v}, not {version}, after {t} s "
                    "(the relay is behind: it loads a version after the trainer commits it)",
                    what=f"version {version} from relay {self.relay!r}", timeout=t) from None

    def load(self, into: Mapping[str, Any] | None = None, *, version: int = 0, timeout: float | None = None) -> int:
        """Load the version the relay serves (at least ``version``: waits for the relay to serve
        it) into ``into``, checked against the trainer ranks' digests of it; returns the version.
        Blocking; bit-exact; never a mix of versions. ``into``: as ``ShardedReader.load``.

        When the trainer no longer holds that version (it committed twice since: nothing to
        check against), the load is made from the trainer ranks instead (``fallbacks``).

        Raises:
            DigestMismatchError: the relay's bytes are not the trainer's version they are
                labelled with (``relay``: the relay's name; ``into`` holds them: load again).
            MemsemTimeoutError: the relay did not serve ``version`` within ``timeout``.
            ValueError: the relay's plan is no longer this plan. As ``ShardedReader.load``.
        """
        if into is None:
            raise ValueError("into is needed: the tensors to load into (reader.empty())")
        want = _args.version(version, "version") or 1
        t = _args.timeout_or(timeout, self._core.timeout)
        deadline = time.monotonic() + t
        _, _, views = self.trainer_reader.bind(into)
        dst = {n: into[n] for n in self.plan.names}
        while True:
            self.wait_version(want, max(1e-3, deadline - time.monotonic()))
            self.ref.load({**dst, HEADER: self._hdr})
            v, pd = _parse(self._hdr, self.relay)
            self._check_plan(pd)
            if v < want:  # the relay moved back (a restarted relay): wait again
                continue
            self.relay_bytes += self.plan.target_bytes()
            why = self._check(v, views)
            if why is None:
                self.loads += 1
                return v
            self.fallbacks.append((v, why))
            got = self.trainer_reader.load(into, version=want, timeout=max(1e-3, deadline - time.monotonic()))
            self.loads += 1
            return got

    def _check(self, v: int, views: list[np.ndarray]) -> str | None:
        """Check what ``views`` hold against every trainer rank's digest of its runs of version
        ``v``: None when they match; the reason when ``v`` can no longer be checked (the
        trainer's version is gone). Raises DigestMismatchError naming the relay."""
        t0 = time.perf_counter()
        try:
            latest = self.sharded.version()
            if v > latest:
                raise DigestMismatchError(
                    f"relay {self.relay!r} labels its bytes version {v} of {self.sharded.name!r}; the trainer ranks "
                    f"have committed only up to {latest}", relay=self.relay, version=v)
            for r, groups in self._runs.items():
                for src, pieces in groups:
                    try:
                        _, theirs = self._core.digest_runs(self.sharded.refs[r].spec, src, version=v)
                    except VersionGoneError:
                        return f"trainer rank {r} no longer holds version {v} (committed twice since): not checkable"
                    except NotSupportedError as exc:  # a route that cannot digest at its owner
                        return f"trainer rank {r}'s route cannot digest runs ({exc}): not checkable"
                    h = run_digest()
                    for ti, off, n in pieces:
                        h.update(views[ti].data[off:off + n])
                    if h.digest() != theirs:
                        raise DigestMismatchError(
                            f"relay {self.relay!r} served bytes of trainer rank {r}'s slices of {self.sharded.name!r} "
                            f"that are not version {v}'s (the trainer rank's digest of them differs)",
                            relay=self.relay, version=v)
            return None
        finally:
            self.digest_s += time.perf_counter() - t0


def relay_reader(sharded: ShardedStateDictRef, targets: Any, *, relay: str, reader: int = 0,
                 timeout: float = 0.0) -> ShardedRelayReader:
    """A :class:`ShardedRelayReader` of ``targets`` (or a plan of ``sharded``'s layout, for
    reader index ``reader``) through the relay window ``relay``, waiting ``timeout`` s for it
    (see ``ShardedStateDictRef.relay_reader``). Raises as the reader's constructor."""
    plan = targets if isinstance(targets, ReshardPlan) else sharded.plan(targets, reader=reader)
    return ShardedRelayReader(sharded, plan, relay=relay, timeout=timeout)


__all__ = ["DIGEST_RUNS", "HEADER", "HEADER_BYTES", "ShardedRelay", "ShardedRelayReader", "plan_digest", "relay_reader"]
