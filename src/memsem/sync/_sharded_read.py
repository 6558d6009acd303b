"""Sharded state dicts, the reader's side: a reader reads exactly its slice of every tensor from
every trainer rank that holds some of it, at one version across ranks.

A reader (:func:`lookup_sharded`, any process of the job, any node) finds the ranks and their
placements (``memsem.sync._sharded``: one state-dict window and one placement record per rank),
states its target layout (``memsem.sync.Target``: tensor-parallel slices, fused ``qkv_proj`` /
``gate_up_proj``, renamed tensors, fp8 on read) and gets a :class:`ShardedReader` bound to a
plan computed once (``memsem.sync.plan_reshard``). Each load:

1. takes the newest version ``v`` every rank has committed (at least the one asked for);
2. pins ``v`` on every rank it reads from (a lease at each owner: no rank overwrites ``v``
   while the load runs; a rank already two versions on, whose ``v`` is gone, makes the load
   wait for the next common version instead);
3. reads, rank by rank, exactly the plan's byte ranges of version ``v`` (one native bracket per
   rank on one node; owner-checked reads across nodes) straight into the reader's tensors;
4. releases the pins and returns ``v``.

So a reader never mixes versions across ranks, and only its own bytes move: nothing is gathered
on a trainer rank, nothing is staged (but for a target converted on read). A rank that dies
(mid-commit or not) ends the wait or load with ``PeerLostError`` naming the rank; the version it
was committing never exists, and the reader's tensors keep the last version loaded whole.

The reader is *followable*: ``rt.follow(reader, into=reader.empty())`` yields each new version.
"""
from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from memsem import _args, _dtypes
from memsem._buffers import address_view, buffer_info, empty_arena
from memsem._errors import MemsemError, MemsemTimeoutError, NotSupportedError, VersionGoneError
from memsem.core import Lease, RuntimeCore
from memsem.sync._state_dict import StateDictRef, lookup_state_dict
from memsem.sync._dtype import convert, scale_shape
from memsem.sync._reshard import (
    MAX_DIMS,
    ReshardPlan,
    ShardedLayout,
    SourceShard,
    SourceTensor,
    Target,
    check_tiling,
    placement,
    plan_reshard,
)
from memsem.sync._sharded import MAX_RANKS, META_MAGIC, core_of, meta_name, shard_name
from memsem.sync._delta import delta_pays, record_heads
from memsem.sync._sharded_delta import Held, RankDelta, apply, rank_delta

#: ``delta_wait=None``: the most seconds a delta load waits for each rank's record
DELTA_WAIT_S = 0.25
#: the clock that times full and delta loads (``delta_wait=None`` compares them)
_clock = time.perf_counter

#: the largest placement record a reader accepts (bytes)
MAX_META_BYTES = 64 << 20
#: seconds a wait for a version waits on one rank before looking at the others again (a dead
#: rank is named within about this long plus the runtime's liveness check)
RANK_SLICE_S = 1.0
_UINT8 = _dtypes.code_of("uint8")


class ShardedStateDictRef:
    """A reader's view of a sharded state dict (:func:`lookup_sharded`): every rank's window
    and placement.

    Attributes:
        name: the sharded state dict's name. world_size / mesh_shape: the trainer's ranks and
        mesh. refs: each rank's :class:`memsem.StateDictRef`, by rank. layout: the
        :class:`memsem.sync.ShardedLayout` (global shapes, dtypes, placements, every rank's box).
    """

    def __init__(self, core: RuntimeCore, name: str, refs: tuple[StateDictRef, ...], layout: ShardedLayout) -> None:
        self._core = core
        self.name = name
        self.refs = refs
        self.layout = layout
        self.world_size = layout.world_size
        self.mesh_shape = layout.mesh_shape

    def __repr__(self) -> str:
        return (f"<ShardedStateDictRef {self.name!r}: {len(self.layout.tensors)} tensors over {self.world_size} "
                f"ranks (mesh {self.mesh_shape})>")

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors' names, in publish order."""
        return tuple(self.layout.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> global shape (elements)."""
        return {n: t.shape for n, t in self.layout.tensors.items()}

    def _rank_error(self, r: int, exc: MemsemError, doing: str) -> MemsemError:
        """``exc`` of rank ``r``'s window, said of the rank: a copy of the same type and
        attributes (a memsem error copies whatever its constructor), its message prefixed."""
        new = copy.copy(exc)
        new.args = (f"trainer rank {r} of sharded state dict {self.name!r} ({doing}): {exc}",)
        return new

    def latest(self) -> list[int]:
        """Every rank's latest committed version, by rank. Raises as :meth:`version`."""
        out = []
        for r, ref in enumerate(self.refs):
            try:
                out.append(ref.version())
            except MemsemError as exc:
                raise self._rank_error(r, exc, "reading its latest version") from exc
        return out

    def version(self) -> int:
        """The latest version of the sharded state dict: the newest one every rank has
        committed (a snapshot).

        Raises:
            StaleReferenceError: a rank's window was retired or republished (names the rank).
            PeerLostError: a rank's owner is unreachable (names the rank).
        """
        return min(self.latest())

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        """Block until every rank has committed ``version`` or a newer one; returns the
        sharded state dict's version then (``>= version``). Futex waits on each lagging
        rank's version word (``RANK_SLICE_S`` at a time, so a dead rank is noticed while
        another one is waited for).

        Raises:
            MemsemTimeoutError: not reached within ``timeout`` s (default the runtime's); names
                the ranks that had not committed it. PeerLostError: a rank's owner died (names
                the rank: e.g. killed mid-commit, its version never exists).
                StaleReferenceError: a rank's window was retired (names the rank).
        """
        version = _args.version(version, "version")
        t = _args.timeout_or(timeout, self._core.timeout)
        deadline = time.monotonic() + t
        while True:
            latest = self.latest()
            behind = sorted((v, r) for r, v in enumerate(latest) if v < version)
            if not behind:
                return min(latest)
            left = deadline - time.monotonic()
            if left <= 0:
                raise MemsemTimeoutError(
                    f"version {version} of sharded state dict {self.name!r}: ranks {[r for _, r in behind]} had not "
                    f"committed it within {t} s (their latest: {[v for v, _ in behind]})",
                    what=f"version {version} of sharded state dict {self.name!r}", timeout=t)
            for _, r in behind:
                try:
                    self._core.wait_version(self.refs[r].spec, version, max(1e-3, min(RANK_SLICE_S, left)))
                except MemsemTimeoutError:
                    pass  # looks at the other ranks (a dead one is named) until the deadline
                except MemsemError as exc:
                    raise self._rank_error(r, exc, f"waiting for version {version}") from exc
                left = deadline - time.monotonic()
                if left <= 0:
                    break

    def plan(self, targets: Mapping[str, Target], *, reader: int = 0) -> ReshardPlan:
        """A reader's plan (see ``memsem.sync.plan_reshard``), computed once."""
        return plan_reshard(self.layout, targets, reader=reader)

    def reader(self, targets: Mapping[str, Target] | ReshardPlan, *, reader: int = 0,
               pin_ttl: float | None = 10.0, delta: bool = True, delta_wait: float | None = None) -> "ShardedReader":
        """A :class:`ShardedReader` loading ``targets`` (or a plan made of this state dict's
        layout) version after version; followable (``rt.follow(reader, into=reader.empty())``).
        ``delta`` / ``delta_wait``: see :class:`ShardedReader`."""
        if isinstance(targets, ReshardPlan):
            return ShardedReader(self, targets, pin_ttl=pin_ttl, delta=delta, delta_wait=delta_wait)
        return ShardedReader(self, self.plan(targets, reader=reader), pin_ttl=pin_ttl, targets=targets, delta=delta,
                             delta_wait=delta_wait)

    def relay_reader(self, targets: Mapping[str, Target] | ReshardPlan, *, relay: str, reader: int = 0,
                     timeout: float = 0.0) -> Any:
        """A :class:`memsem.sync.ShardedRelayReader`: loads ``targets`` (or a plan of this
        layout) from the relay of sharded slices ``relay`` (a :class:`memsem.sync.ShardedRelay`
        of the same plan), each version checked against the trainer ranks' digests of it.
        ``timeout``: seconds to wait for the relay's window. Raises ValueError when the relay's
        plan differs (names both)."""
        from memsem.sync._sharded_relay import relay_reader

        return relay_reader(self, targets, relay=relay, reader=reader, timeout=timeout)


class ShardedReader:
    """Loads one plan of a sharded state dict, version after version (see the module docstring).

    Attributes:
        sharded: the :class:`ShardedStateDictRef`. plan: the :class:`memsem.sync.ReshardPlan`.
        targets: the targets it was planned from (None when made from a plan). loads: versions
        loaded. window_bytes: bytes the loads read from the ranks' windows (``plan.nbytes``
        each in full; for a delta, the tiles read whole). record_bytes: bytes of delta
        history read (indexes, records' digests and counts, the patches: element indices and
        values). bytes_moved: the two together. retries: loads started again (a rank's
        version gone before it was pinned). deltas: loads made as deltas.

    Args:
        delta: a load into the tensors the last load filled, which still hold what it left
            there, moves only what changed since (``memsem.sync._sharded_delta``): each rank's
            delta records of the versions since, their patches applied element by element
            through the plan (changed elements of 2-byte tensors: 4 bytes each moved, index
            and value), the tiles recorded whole read at the new version where the reader
            holds them; targets converted on read (fp8) read the changed tiles' bytes whole.
            Checked by a digest of every 64 KiB the reader holds (one read of its tensors per
            load, on the CPU threads); else, or when a rank's history does not cover the
            versions, in full. Default True.
        delta_wait: the most seconds a delta load waits for each rank to have recorded the
            version (its records are made after the commit, off the trainer's path) before it
            loads in full. None (default): at most ``DELTA_WAIT_S`` (0.25 s), and a delta only
            where it pays: while the last delta load here took longer than the last full load
            (on one node a delta's digests of the reader's tensors cost about what the copy
            does), loads are full and one in ``PROBE_EVERY`` (16) tries a delta again. A number:
            that wait, and a delta whenever the histories allow one.

    Followable (``version``, ``wait_version``, ``load``): ``rt.follow(reader, into=...)``.
    Thread safety: one load at a time per reader.
    """

    def __init__(self, sharded: ShardedStateDictRef, plan: ReshardPlan, *, pin_ttl: float | None = 10.0,
                 targets: Mapping[str, Target] | None = None, delta: bool = True, delta_wait: float | None = None) -> None:
        if not isinstance(delta, bool):
            raise TypeError(f"delta must be True or False, got {delta!r}")
        self.sharded = sharded
        self.plan = plan
        self.targets = dict(targets) if targets is not None else None
        self.pin_ttl = _args.ttl(pin_ttl, "pin_ttl")
        self.name = sharded.name
        self.loads = 0
        self.window_bytes = 0
        self.record_bytes = 0
        self.retries = 0
        self.deltas = 0
        self.delta = delta
        #: deltas only where they pay (``delta_wait=None``)
        self.adaptive = delta_wait is None
        self.delta_wait = DELTA_WAIT_S if delta_wait is None else _args.timeout(delta_wait, "delta_wait")
        self._held: Held | None = None
        #: seconds the last full and the last delta load took here (their waits excluded), and
        #: the loads made in full since because deltas were slower (one in ``PROBE_EVERY`` tries
        #: a delta again: the figures move)
        self._full_s: float | None = None
        self._delta_s: float | None = None
        self._full_since = 0
        self._pin = True
        self._staging: dict[int, np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"<ShardedReader of {self.name!r}: {self.plan!r}>"

    @property
    def bytes_moved(self) -> int:
        """Bytes the loads moved: ``window_bytes + record_bytes``."""
        return self.window_bytes + self.record_bytes

    def version(self) -> int:
        """The sharded state dict's latest version (every rank committed it)."""
        return self.sharded.version()

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        """See :meth:`ShardedStateDictRef.wait_version`."""
        return self.sharded.wait_version(version, timeout)

    def outputs(self) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        """``(name, shape, numpy dtype)`` of every tensor ``into`` holds: the targets (fp8 where
        converted on read) and the converted targets' scales (float32), in plan order."""
        p = self.plan
        out = []
        for n, s, d, t, parts in zip(p.names, p.shapes, p.dtypes, p.converts, p.part_shapes):
            if t is None:
                out.append((n, s, d))
                continue
            out.append((n, s, _dtypes.numpy_dtype(_dtypes.code_of(t.dtype))))
            out.append((t.scale_name(n), scale_shape(parts, t.block, t.cat_dim), np.dtype(np.float32)))
        return out

    def empty(self, framework: str = "torch") -> dict[str, Any]:
        """New uninitialized tensors for ``into`` (``outputs()``; one huge-page arena, in plan
        order: runs of consecutive targets coalesce), ``framework`` "torch" or "numpy"."""
        if framework not in ("numpy", "torch"):
            raise ValueError(f"framework must be 'numpy' or 'torch', got {framework!r}")
        outs = self.outputs()
        arrs = empty_arena([(np.uint8, (math.prod(s) * d.itemsize,)) for _, s, d in outs])
        if framework == "numpy":
            return {n: a.view(d).reshape(s) for (n, s, d), a in zip(outs, arrs)}
        import torch

        return {n: torch.from_numpy(a).view(_dtypes.torch_dtype(_dtypes.code_of(d))).reshape(s)
                for (n, s, d), a in zip(outs, arrs)}

    def bind(self, into: Mapping[str, Any]) -> tuple[list[int], list, list[np.ndarray]]:
        """``into`` bound to the plan: ``(bases, keep, views)``: the address each target is
        read to (``into``'s tensor, or the staging buffer of a target converted on read), what
        keeps them alive, and each target's bytes (flat uint8 views), in plan order.

        Raises:
            KeyError / ValueError / TypeError: ``into`` does not fit the plan (names the tensor).
        """
        if not isinstance(into, Mapping):
            raise TypeError(f"into must be a mapping of target name to tensor, got {type(into).__name__}")
        p = self.plan
        addr: dict[str, int] = {}
        views: dict[str, np.ndarray] = {}
        keep: list = []
        for n, s, d in self.outputs():
            if n not in into:
                raise KeyError(f"into has no tensor {n!r} (the plan has {len(p.names)} targets)")
            info = buffer_info(into[n], f"into[{n!r}]")
            code = _dtypes.code_of(d)
            if info.readonly:
                raise ValueError(f"into[{n!r}] is read-only")
            if info.dtype_code != code or tuple(info.shape) != s:
                raise ValueError(f"into[{n!r}] is {tuple(info.shape)} {_dtypes.name_of(info.dtype_code)}; the target "
                                 f"is {s} {_dtypes.name_of(code)}")
            addr[n] = info.address
            views[n] = address_view(info.address, info.nbytes, info.keepalive)
            keep.append(info.keepalive)
        if any(t is not None for t in p.converts) and self._staging is None:
            self._staging = {i: np.empty(math.prod(s) * d.itemsize, np.uint8)
                             for i, (s, d, t) in enumerate(zip(p.shapes, p.dtypes, p.converts)) if t is not None}
        stage = self._staging or {}
        bases = [stage[i].ctypes.data if i in stage else addr[n] for i, n in enumerate(p.names)]
        keep.append(stage)
        return bases, keep, [stage[i] if i in stage else views[n] for i, n in enumerate(p.names)]

    def _convert(self, into: Mapping[str, Any]) -> None:
        """The targets converted on read, from their staging buffers into ``into``."""
        import torch

        p = self.plan
        for i, stage in (self._staging or {}).items():
            t, n = p.converts[i], p.names[i]
            src = torch.from_numpy(stage).view(_dtypes.torch_dtype(_dtypes.code_of(p.dtypes[i]))).reshape(p.shapes[i])
            convert(src, p.part_shapes[i], t.block, t.cat_dim, _as_torch(into[n]), _as_torch(into[t.scale_name(n)]))

    def load(self, into: Mapping[str, Any] | None = None, *, version: int = 0, timeout: float | None = None) -> int:
        """Load the newest version every rank has committed (at least ``version``; 0: the
        latest now) into ``into``'s tensors, through the plan; returns the version loaded.
        Blocking; bit-exact; one version across every rank.

        Args:
            into: target name -> tensor (numpy or CPU torch, C-contiguous, writable, the
                target's dtype and shape; a target converted on read also needs its scales:
                ``outputs()``), e.g. ``reader.empty()``.
            version: the oldest version acceptable (waits for it; a newer one may be loaded).
            timeout: seconds for the whole load (waits included), default the runtime's.

        Exactly ``plan.nbytes`` bytes move (a delta load: the patches of the elements that
        changed and the tiles recorded whole, see ``delta``), from each rank only its part,
        straight into ``into`` (a target converted on read goes through a staging buffer of
        its own size, converted after the version's pins are released:
        ``memsem.sync.to_fp8``). On an error ``into``'s contents are unspecified (a version
        of a rank may have been copied): load again.

        Raises:
            KeyError / ValueError / TypeError: ``into`` does not fit the plan (before any wait).
            PeerLostError: a rank's owner died (names the rank). MemsemTimeoutError: no such
            version within ``timeout`` (names the ranks behind). StaleReferenceError: a rank's
            window was retired (names the rank).
        """
        if into is None:
            raise ValueError("into is needed: the tensors to load into (reader.empty())")
        bases, keep, views = self.bind(into)
        want = _args.version(version, "version") or 1
        sd = self.sharded
        core = sd._core
        t = _args.timeout_or(timeout, core.timeout)
        deadline = time.monotonic() + t
        ranges = self.plan.ranges(bases)
        held, self._held = self._held, None  # what the last load left; none until this one ends
        t_check = _clock()
        if held is not None and (not self.delta or held.key != tuple(bases) or not held.intact()):
            held = None
        t_check = _clock() - t_check
        while True:
            v = sd.wait_version(want, max(1e-3, deadline - time.monotonic()))
            t0 = _clock()
            moving = self._changed(held, v, bases, deadline) if held is not None else None
            pins: dict[int, Lease] = {}
            try:
                try:
                    pins = self._pin_all(v, deadline)
                except VersionGoneError:
                    # a rank is two versions on (its v overwritten): the next common version
                    self.retries += 1
                    want = v + 1
                    continue
                reads = ranges if moving is None else {r: d.reads for r, d in moving.items()}
                for r, rr in reads.items():
                    lease = pins.get(r)
                    try:
                        if rr:
                            core.gather(sd.refs[r].spec, rr, version=v, lease=lease, keep=keep)
                    except VersionGoneError:
                        raise
                    except MemsemError as exc:
                        raise sd._rank_error(r, exc, f"loading version {v}") from exc
            except VersionGoneError:
                if pins:
                    raise
                self.retries += 1  # unpinned route: a rank overwrote v under the load
                want = v + 1
                held = None  # part of v may be in the tensors: the next try loads in full
                continue
            finally:
                for lease in pins.values():
                    lease.release()
            self.window_bytes += sum(n for rr in reads.values() for _, n, _ in rr)
            if moving is not None:
                ok, wrote = apply(core, moving, views)
                if not ok:  # a whole tile is not the writer's v after the patches: load v in full
                    held, want = None, v
                    continue
            self.loads += 1
            if moving is None:
                self._full_s = _clock() - t0
            else:
                self.deltas += 1
                held.moved(v, [x for rr in reads.values() for x in rr], wrote)
                self._delta_s = _clock() - t0 + t_check
                self._full_since = 0
            if self.delta and self._delta_next():  # what a delta next time checks against
                if moving is None:
                    sizes = [math.prod(sh) * d.itemsize for sh, d in zip(self.plan.shapes, self.plan.dtypes)]
                    held = Held(core, bases, sizes, v)
                self._held = held
            if self._staging:
                self._convert(into)  # after the pins went: the trainer never waits for it
            return v

    def _delta_next(self) -> bool:
        """Whether the next load tries a delta: unless the last delta load here took longer than
        the last full load (then one load in ``PROBE_EVERY`` tries it again), with
        ``delta_wait=None``. Called once per load made while ``delta`` is on."""
        if not self.adaptive:
            return True
        pays, self._full_since = delta_pays(self._delta_s, self._full_s, self._full_since)
        return pays

    def _changed(self, held: Held, v: int, bases: list[int], deadline: float) -> dict[int, RankDelta] | None:
        """What each rank's delta records from ``held.version`` to ``v`` make this reader move
        (its records read, the patches it needs among them), or None: a rank's history does
        not cover the versions, or a record is in doubt (load in full)."""
        if held.version > v:
            return None
        p = self.plan
        out: dict[int, RankDelta] = {}
        if held.version == v:
            return {r: RankDelta.nothing() for r in p.runs}
        base = np.asarray(bases, np.int64)
        conv = np.array([t is not None for t in p.converts], bool)
        for r, runs in p.runs.items():
            wait = max(1e-3, min(self.delta_wait, deadline - time.monotonic()))
            heads = None
            if self.sharded.refs[r].layout.delta is not None:
                heads = record_heads(self.sharded.refs[r], held.version, v, wait)
            if heads is None:
                return None
            try:
                d = rank_delta(heads, runs, base, conv)
            except (MemsemError, ValueError):
                d = None  # a record gone while its patches were read: the full load
            self.record_bytes += heads.nbytes
            if d is None:
                return None
            out[r] = d
        return out

    def _pin_all(self, v: int, deadline: float) -> dict[int, Lease]:
        """Pin version ``v`` on every rank the plan reads ({} where the route offers no pins)."""
        if not self._pin:
            return {}
        sd = self.sharded
        pins: dict[int, Lease] = {}
        try:
            for r in self.plan.ranks:
                try:
                    pins[r] = sd._core.pin_version(sd.refs[r].spec, version=v, ttl=self.pin_ttl,
                                                   timeout=max(1e-3, deadline - time.monotonic()))
                except NotSupportedError:
                    self._pin = False
                    for lease in pins.values():
                        lease.release()
                    return {}
                except VersionGoneError:
                    raise
                except MemsemError as exc:
                    raise sd._rank_error(r, exc, f"pinning version {v}") from exc
        except BaseException:
            for lease in pins.values():
                lease.release()
            raise
        return pins


def _as_torch(x: Any) -> Any:
    """A torch view of a torch tensor or numpy array (fp8 through its bytes)."""
    if hasattr(x, "numpy") and hasattr(x, "dtype") and not isinstance(x, np.ndarray):
        return x
    import torch

    code = _dtypes.code_of(x.dtype)
    return torch.from_numpy(x.view(np.uint8)).view(_dtypes.torch_dtype(code)).reshape(x.shape)


def lookup_sharded(rt: Any, name: str, *, timeout: float = 0.0) -> ShardedStateDictRef:
    """The sharded state dict ``name`` (any process of the job): every rank's window and
    placement, read and checked now.

    Args:
        rt: this process's ``memsem.Runtime``.
        timeout: seconds to wait for every rank to have published (0: they must exist now).

    Raises:
        WindowNotFoundError / MemsemTimeoutError: a rank's window is not there (in time).
        ValueError: a placement record that is malformed, disagrees between ranks, or whose
            boxes do not tile a tensor (names the rank and tensor).
    """
    core = core_of(rt)
    name = _args.window_name(name, "name")
    t = _args.timeout(timeout, "timeout")
    deadline = time.monotonic() + t

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    def meta_of(r: int) -> dict:
        spec = core.lookup_spec(meta_name(name, r), left())
        if spec.dtype_code != _UINT8 or spec.nbytes > MAX_META_BYTES:
            raise ValueError(f"{meta_name(name, r)!r} is not a sharded state dict's placement record")
        raw = core.get_spec(spec).tobytes()
        try:
            m = json.loads(raw)
        except ValueError:
            raise ValueError(f"{meta_name(name, r)!r}: the placement record is not valid JSON") from None
        if not isinstance(m, dict) or m.get("magic") != META_MAGIC:
            raise ValueError(f"{meta_name(name, r)!r} is not a sharded state dict's placement record")
        return m

    m0 = meta_of(0)
    world, mesh = m0.get("world_size"), m0.get("mesh_shape")
    if (not isinstance(world, int) or not 1 <= world <= MAX_RANKS or not isinstance(mesh, list)
            or not all(isinstance(x, int) and x >= 1 for x in mesh) or math.prod(mesh) != world):
        raise ValueError(f"sharded state dict {name!r}: rank 0 states world_size {world!r} and mesh {mesh!r}")
    metas = [m0] + [meta_of(r) for r in range(1, world)]
    refs = tuple(lookup_state_dict(core, shard_name(name, r), timeout=left()) for r in range(world))
    layout = _layout_of(name, metas, refs, tuple(mesh))
    return ShardedStateDictRef(core, name, refs, layout)


def _layout_of(name: str, metas: list[dict], refs: tuple[StateDictRef, ...], mesh: tuple[int, ...]) -> ShardedLayout:
    """The sharded layout the ranks' records and windows state, every number bounded and every
    tensor's boxes checked to tile it."""
    world = len(metas)
    tensors: dict[str, dict] = {}
    for r, (m, ref) in enumerate(zip(metas, refs)):
        where = f"sharded state dict {name!r}, rank {r}"
        if m.get("rank") != r or m.get("world_size") != world or m.get("mesh_shape") != list(mesh):
            raise ValueError(f"{where}: its record says rank {m.get('rank')!r} of {m.get('world_size')!r} "
                             f"(mesh {m.get('mesh_shape')!r}); rank 0 says {world} (mesh {list(mesh)})")
        entries = ref.layout.index()
        h = ref.layout.header_bytes
        recs = m.get("tensors")
        if not isinstance(recs, list) or len(recs) != len(entries):
            raise ValueError(f"{where}: its record lists {len(recs) if isinstance(recs, list) else recs!r} tensors, "
                             f"its window {len(entries)}")
        for rec in recs:
            if not (isinstance(rec, list) and len(rec) == 4 and isinstance(rec[0], str) and rec[0] in entries):
                raise ValueError(f"{where}: a tensor record {str(rec)[:80]} is malformed or not in its window")
            k, gshape, pl, off = rec
            e = entries[k]
            ok = (isinstance(gshape, list) and isinstance(off, list) and isinstance(pl, list)
                  and len(gshape) == len(off) == len(e.shape) <= MAX_DIMS
                  and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in gshape + off)
                  and all(isinstance(p, str) for p in pl) and len(pl) == len(mesh))
            if not ok:
                raise ValueError(f"{where}: tensor {k!r} has a malformed record {str(rec)[:120]}")
            d = tensors.setdefault(k, {"shape": tuple(gshape), "dtype": e.dtype, "pl": tuple(pl), "shards": []})
            if d["shape"] != tuple(gshape) or d["dtype"] != e.dtype or d["pl"] != tuple(pl):
                raise ValueError(f"{where}: tensor {k!r} is {tuple(gshape)} {e.dtype} {pl}; rank "
                                 f"{d['shards'][0].rank if d['shards'] else 0} says {d['shape']} {d['dtype']} "
                                 f"{list(d['pl'])}")
            if math.prod(e.shape):
                d["shards"].append(SourceShard(r, tuple(off), e.shape, h + e.offset))
    out = {}
    for k, d in tensors.items():
        for p in d["pl"]:
            placement(p, f"tensor {k!r}'s placement")
        src = SourceTensor(k, d["shape"], d["dtype"], d["pl"], tuple(d["shards"]))
        check_tiling(src)
        out[k] = src
    return ShardedLayout(out, world, mesh)


__all__ = ["MAX_META_BYTES", "RANK_SLICE_S", "ShardedReader", "ShardedStateDictRef", "lookup_sharded"]
