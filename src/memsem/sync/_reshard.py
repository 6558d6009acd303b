"""Reshard on read: where every byte of a reader's target layout lies in a sharded state dict.

A trainer publishes a sharded state dict (``memsem.sync._sharded``): each rank holds one box
of every tensor (DTensor placements over a device mesh: ``Shard(dim)`` splits a dimension as
``torch.chunk`` does, uneven shards included; ``Replicate`` keeps it whole). A reader (a rollout
rank) states what it holds, tensor by tensor, as :class:`Target`\\ s: the slice ``rank`` of
``degree`` along ``dim`` of one source tensor (tensor parallel), or the concatenation of such
slices of several sources (fused ``qkv_proj`` from q, k and v; ``gate_up_proj`` from gate and
up), under a name of its own (a name map). :func:`plan_reshard` turns the two layouts into a
:class:`ReshardPlan` once: for every source rank, the runs ``(source byte offset, target,
target byte offset, nbytes)`` that move exactly the reader's bytes, each as long as both
layouts allow (a row-split source to a row-split target is one run per tensor; a column slice
is one run per row, read in place from the source, never staged).

Everything here is pure (numpy index arithmetic over the layouts): no runtime, no I/O. Planning
1,000 tensors takes milliseconds; each version then loads through the same plan.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from memsem import _dtypes
from memsem._errors import NotSupportedError

#: the most dimensions a sharded tensor may have
MAX_DIMS = 16


@dataclasses.dataclass(frozen=True)
class Shard:
    """A placement: the tensor's dimension ``dim`` is split over one mesh dimension, as
    ``torch.chunk`` splits it (chunks of ``ceil(n / parts)`` elements; the last ones may be
    shorter or empty): torch's ``Shard(dim)``."""

    dim: int

    def __str__(self) -> str:
        return f"S{self.dim}"


@dataclasses.dataclass(frozen=True)
class Replicate:
    """A placement: every rank of the mesh dimension holds the whole extent (torch's
    ``Replicate()``)."""

    def __str__(self) -> str:
        return "R"


Placement = Shard | Replicate


def placement(p: Any, argname: str = "placement") -> Placement:
    """memsem's placement for ``p``: a :class:`Shard` / :class:`Replicate`, torch's
    ``Shard(dim)`` / ``Replicate()`` (DTensor placements), or their text form ``"S0"`` / ``"R"``.

    Raises:
        NotSupportedError: a placement memsem cannot read from (``Partial``: the values are
            pending a reduction; torch's strided shard). TypeError / ValueError: anything else.
    """
    if isinstance(p, (Shard, Replicate)):
        return p
    if isinstance(p, str):
        if p == "R":
            return Replicate()
        if p[:1] == "S" and p[1:].isdigit():
            return Shard(int(p[1:]))
        raise ValueError(f"{argname} must be 'R' or 'S<dim>', got {p!r}")
    kind = type(p).__name__
    if kind == "Replicate":
        return Replicate()
    if kind == "Shard" and isinstance(getattr(p, "dim", None), int):
        return Shard(int(p.dim))
    if kind in ("Partial", "_StridedShard", "_Partial"):
        raise NotSupportedError(f"{argname} {p!r}: a {kind} placement cannot be read shard by shard "
                                "(reduce it, or redistribute to Shard/Replicate, before publishing)")
    raise TypeError(f"{argname} must be Shard(dim), Replicate() (memsem's or torch's) or 'S<dim>'/'R', got {p!r}")


def chunk(n: int, parts: int, k: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``k`` of ``parts`` of ``n`` elements, as ``torch.chunk`` (and
    DTensor's ``Shard``) cut them: chunks of ``ceil(n / parts)``, the last ones shorter or empty."""
    size = -(-n // parts) if parts else 0
    start = min(k * size, n)
    return start, min(start + size, n)


def local_box(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
              placements: Sequence[Placement]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, shape)`` of the box of a tensor of global ``shape`` that the rank at
    ``coordinate`` of a mesh of ``mesh_shape`` holds under ``placements`` (one per mesh
    dimension, applied in mesh order: a dimension sharded twice is split again within its
    chunk), as DTensor computes a local shard."""
    off = [0] * len(shape)
    size = list(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            a, b = chunk(size[p.dim], mesh_shape[i], coordinate[i])
            off[p.dim] += a
            size[p.dim] = b - a
    return tuple(off), tuple(size)


@dataclasses.dataclass(frozen=True)
class SourceShard:
    """One rank's box of one source tensor.

    Attributes:
        rank: the trainer rank holding it. offset: the box's first element, per dimension, in
        the global tensor. shape: the box's extent (elements per dimension; the local tensor's
        shape). window_offset: bytes from the start of the rank's window to the local tensor
        (C-contiguous).
    """

    rank: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    window_offset: int


@dataclasses.dataclass(frozen=True)
class SourceTensor:
    """A tensor of a sharded state dict: its global ``shape``, ``dtype`` (numpy), placements
    (text, for display) and the ranks' boxes of it (``shards``: empty boxes left out)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    placements: tuple[str, ...]
    shards: tuple[SourceShard, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    """Where every tensor of a sharded state dict lies across its ranks (what a reader plans
    against). ``tensors``: name -> :class:`SourceTensor`, in publish order. ``world_size``:
    ranks. ``mesh_shape``: the trainer's device mesh."""

    tensors: Mapping[str, SourceTensor]
    world_size: int
    mesh_shape: tuple[int, ...]

    @classmethod
    def synthetic(cls, tensors: Mapping[str, tuple[Sequence[int], Any]], mesh_shape: Sequence[int],
                  placements: Mapping[str, Sequence[Any]], *, align: int = 64) -> "ShardedLayout":
        """The layout ``tensors`` (name -> (global shape, dtype)) would have, placed by
        ``placements`` (name -> one per mesh dimension; missing: replicated) over a mesh of
        ``mesh_shape`` with row-major rank numbering, each rank packing its local tensors at
        ``align``-byte offsets from 0 in publish order (a model of the windows, for planning
        and tests without a trainer)."""
        mesh = tuple(int(m) for m in mesh_shape)
        world = math.prod(mesh)
        ends = [0] * world
        out: dict[str, SourceTensor] = {}
        for name, (shape, dt) in tensors.items():
            shape = tuple(int(s) for s in shape)
            dtype = np.dtype(_dtypes.numpy_dtype(_dtypes.code_of(dt)))
            pl = tuple(placement(p) for p in placements.get(name, [Replicate()] * len(mesh)))
            shards = []
            for r, coord in enumerate(np.ndindex(*mesh)):
                off, size = local_box(shape, mesh, coord, pl)
                at = -(-ends[r] // align) * align
                ends[r] = at + math.prod(size) * dtype.itemsize
                if math.prod(size):
                    shards.append(SourceShard(r, off, size, at))
            out[name] = SourceTensor(name, shape, dtype, tuple(str(p) for p in pl), tuple(shards))
        return cls(out, world, mesh)


@dataclasses.dataclass(frozen=True)
class Target:
    """One tensor a reader holds: the concatenation along ``cat_dim`` of, for each source
    tensor in ``sources``, its slice ``rank`` of ``degree`` along ``dim`` (``torch.chunk``'s
    cut: vLLM's even split when ``degree`` divides the extent).

    ``Target("w")``: the whole of ``w`` (replicated). ``Target("w", dim=0, degree=2, rank=1)``:
    the second half of the rows (column-parallel). ``Target(("q", "k", "v"), dim=0, degree=2,
    rank=1)``: the fused ``qkv_proj`` of TP rank 1, ``[q_1; k_1; v_1]`` (each source split on
    its own, then concatenated: the layout vLLM's fused linear layers load). The sources must
    have one dtype and equal extents in every dimension but ``cat_dim``.

    ``dtype="float8_e4m3fn"`` converts on read (``memsem.sync.to_fp8``: torch's conversion of
    each source, sliced): with ``block=(rows, cols)`` (2-d weights, slice edges on block edges)
    the target comes with per-block scales, ``"<name>_scale_inv"`` (vLLM's block fp8); without,
    per-tensor scales ``"<name>_scale"`` (one per source; each source read whole).
    """

    sources: tuple[str, ...]
    dim: int | None = None
    degree: int = 1
    rank: int = 0
    cat_dim: int = 0
    dtype: str | None = None
    block: tuple[int, int] | None = None

    def __init__(self, sources: str | Sequence[str], *, dim: int | None = None, degree: int = 1, rank: int = 0,
                 cat_dim: int = 0, dtype: str | None = None, block: Sequence[int] | None = None) -> None:
        srcs = (sources,) if isinstance(sources, str) else tuple(sources)
        if not srcs or not all(isinstance(s, str) and s for s in srcs):
            raise ValueError(f"sources must be a tensor name or a non-empty sequence of them, got {sources!r}")
        for v, what, lo in ((degree, "degree", 1), (rank, "rank", 0), (cat_dim, "cat_dim", 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
        if rank >= degree:
            raise ValueError(f"rank must be in [0, degree={degree}), got {rank}")
        if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim < 0):
            raise ValueError(f"dim must be None (not sharded) or an int >= 0, got {dim!r}")
        object.__setattr__(self, "sources", srcs)
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "degree", degree)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "cat_dim", cat_dim)
        if dtype not in (None, "float8_e4m3fn"):
            raise ValueError(f"dtype must be None (the source's) or 'float8_e4m3fn', got {dtype!r}")
        if block is not None:
            block = tuple(block)
            if dtype is None or len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
                raise ValueError(f"block must be (rows, cols) of ints >= 1, with dtype='float8_e4m3fn', got {block!r}")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "block", block)

    def scale_name(self, name: str) -> str | None:
        """The name of target ``name``'s scales (None when it is not converted)."""
        if self.dtype is None:
            return None
        return f"{name}_scale_inv" if self.block is not None else f"{name}_scale"


def tp_targets(names: Sequence[str], *, degree: int, rank: int, column: Sequence[str] = (),
               row: Sequence[str] = (), fused: Mapping[str, Sequence[str]] | None = None,
               rename: Mapping[str, str] | None = None) -> dict[str, Target]:
    """A tensor-parallel reader's targets, vLLM style (rank ``rank`` of ``degree``).

    Args:
        names: the source tensors' names (``ShardedStateDictRef.names``).
        column: name suffixes split along dim 0 (column-parallel weights and their biases:
            q/k/v, gate/up, embeddings, lm_head).
        row: name suffixes split along dim 1 (row-parallel weights: o_proj, down_proj).
        fused: ``{fused suffix: [source suffixes]}``, e.g. ``{"qkv_proj.weight":
            ["q_proj.weight", "k_proj.weight", "v_proj.weight"]}``: sources with the same
            prefix become one target ``prefix + fused suffix``, split like ``column`` (each
            source split on its own, then concatenated along dim 0).
        rename: ``{source prefix: target prefix}`` applied to every target name (the name map).

    Every other tensor is replicated (whole). Returns target name -> :class:`Target`.
    """
    fused = dict(fused or {})
    rename = dict(rename or {})
    by_part = {s: f for f, parts in fused.items() for s in parts}
    out: dict[str, Target] = {}
    done: set[str] = set()

    def mapped(n: str) -> str:
        for a, b in rename.items():
            if n.startswith(a):
                return b + n[len(a):]
        return n

    def split_dim(n: str) -> int | None:
        if any(n.endswith(s) for s in column):
            return 0
        if any(n.endswith(s) for s in row):
            return 1
        return None

    for n in names:
        if n in done:
            continue
        part = next((s for s in by_part if n.endswith(s)), None)
        if part is not None:
            prefix = n[:len(n) - len(part)]
            f = by_part[part]
            srcs = [prefix + s for s in fused[f]]
            if all(s in names for s in srcs):
                out[mapped(prefix + f)] = Target(srcs, dim=0, degree=degree, rank=rank)
                done.update(srcs)
                continue
        d = split_dim(n)
        out[mapped(n)] = Target(n) if d is None else Target(n, dim=d, degree=degree, rank=rank)
        done.add(n)
    return out


class ReshardPlan:
    """A reader's plan (:func:`plan_reshard`): for each source rank, the runs that move exactly
    the reader's bytes.

    Attributes:
        names: the targets, in order. shapes / dtypes: each target's shape (elements) and
        numpy dtype. runs: source rank -> int64 array of rows ``(source byte offset in the
        rank's window, target index, byte offset in the target, nbytes)``, each run as long as
        both layouts allow. nbytes: bytes a load moves (== the
        targets' bytes: every byte once). sources: source tensor names the plan reads.
        converts: per target, its :class:`Target` when it is converted on read (``dtype``),
        else None; ``shapes`` / ``dtypes`` are then what is read (the source's dtype).
        part_shapes: per target, the shape of each source's slice in it (in ``sources`` order).

    Immutable; share it between loads (and threads). ``ranges(into)`` binds it to tensors.
    """

    def __init__(self, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...], dtypes: tuple[np.dtype, ...],
                 runs: dict[int, np.ndarray], sources: tuple[str, ...],
                 converts: tuple[Target | None, ...] | None = None,
                 part_shapes: tuple[tuple[tuple[int, ...], ...], ...] | None = None) -> None:
        self.names = names
        self.converts = converts if converts is not None else (None,) * len(names)
        self.part_shapes = part_shapes if part_shapes is not None else tuple((s,) for s in shapes)
        self.shapes = shapes
        self.dtypes = dtypes
        self.runs = runs
        self.sources = sources
        self.nbytes = int(sum(int(r[:, 3].sum()) for r in runs.values()))
        self._bound: tuple[tuple[int, ...], dict[int, list[tuple[int, int, int]]]] | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The source ranks a load reads from (ascending)."""
        return tuple(sorted(self.runs))

    @property
    def n_runs(self) -> int:
        return sum(len(r) for r in self.runs.values())

    def target_bytes(self) -> int:
        """Bytes of every target together (what the reader holds)."""
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    def __repr__(self) -> str:
        return (f"<ReshardPlan {len(self.names)} targets, {self.nbytes} bytes from ranks {list(self.ranks)} "
                f"in {self.n_runs} runs>")

    def ranges(self, bases: Sequence[int]) -> dict[int, list[tuple[int, int, int]]]:
        """The plan bound to target memory: ``bases[i]`` is the address of target ``i``'s
        first byte (C-contiguous). Returns source rank -> ``(source offset, nbytes, address)``,
        runs whose source and destination both continue merged (targets adjacent in memory
        coalesce across tensors). Cached for the last ``bases``."""
        key = tuple(bases)
        b = self._bound
        if b is not None and b[0] == key:
            return b[1]
        base = np.asarray(key, dtype=np.int64)
        out: dict[int, list[tuple[int, int, int]]] = {}
        for r, runs in self.runs.items():
            src, dst, n = runs[:, 0], base[runs[:, 1]] + runs[:, 2], runs[:, 3]
            src, dst, n = _merge(src, dst, n)
            out[r] = list(zip(src.tolist(), n.tolist(), dst.tolist()))
        self._bound = (key, out)
        return out


def _merge(src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs sorted by source, merged where both source and destination continue."""
    if len(src) < 2:
        return src, dst, n
    order = np.argsort(src, kind="stable")
    src, dst, n = src[order], dst[order], n[order]
    cont = (src[:-1] + n[:-1] == src[1:]) & (dst[:-1] + n[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    total = np.add.reduceat(n, starts)
    return src[starts], dst[starts], total


def _runs(s: SourceShard, lo: list[int], hi: list[int], dshape: tuple[int, ...], dlo: list[int],
          itemsize: int) -> tuple[Any, Any, int]:
    """Byte offsets (source window, target) of the runs copying the global box ``[lo, hi)`` from
    the shard ``s`` to a target of shape ``dshape`` where ``lo`` lands at ``dlo``; and the run
    length in bytes. A run spans the innermost dimensions that both sides cover whole. Plain
    ints for the few numbers of a box (numpy's per-call cost dominates at this size), numpy
    only for the offsets of many runs."""
    nd = len(dshape)
    if nd == 0:
        return (s.window_offset,), (0,), itemsize
    ext = [h - l for h, l in zip(hi, lo)]
    sshape = s.shape
    k = nd - 1
    while k > 0 and ext[k] == sshape[k] == dshape[k]:
        k -= 1
    sstr = [1] * nd
    dstr = [1] * nd
    for j in range(nd - 2, -1, -1):
        sstr[j] = sstr[j + 1] * sshape[j + 1]
        dstr[j] = dstr[j + 1] * dshape[j + 1]
    run = math.prod(ext[k:]) * itemsize
    so0 = sum((a - o) * st for a, o, st in zip(lo, s.offset, sstr)) * itemsize + s.window_offset
    do0 = sum(a * st for a, st in zip(dlo, dstr)) * itemsize
    if k == 0:
        return (so0,), (do0,), run
    so = np.array([so0], np.int64)
    do = np.array([do0], np.int64)
    for j in range(k - 1, -1, -1):  # one more outer dimension: every index of it
        steps = np.arange(ext[j], dtype=np.int64)
        so = (so[None, :] + (steps * (sstr[j] * itemsize))[:, None]).reshape(-1)
        do = (do[None, :] + (steps * (dstr[j] * itemsize))[:, None]).reshape(-1)
    return so, do, run


def plan_reshard(layout: ShardedLayout, targets: Mapping[str, Target], *, reader: int = 0) -> ReshardPlan:
    """Plan how a reader fills ``targets`` from the sharded state dict ``layout``, once.

    Args:
        layout: the source layout (``ShardedStateDictRef.layout``, or ``ShardedLayout.synthetic``).
        targets: target name -> :class:`Target`, in the order the reader holds them.
        reader: spreads reads of replicated boxes (several ranks hold the same bytes): each box
            is read from the ``reader % copies``-th rank holding it, so readers of one layout
            do not all read from rank 0. Any int >= 0.

    Returns:
        A :class:`ReshardPlan` whose loads move exactly the targets' bytes, each from one rank.

    Raises:
        KeyError: a source name not in the layout. ValueError: sources of one target with
            different dtypes or extents, a ``dim`` / ``cat_dim`` the sources do not have, two
            ranks' boxes that overlap without being equal (not a DTensor layout).
    """
    if not isinstance(targets, Mapping) or not targets:
        raise ValueError("targets must be a non-empty mapping of target name to Target")
    if not isinstance(reader, int) or isinstance(reader, bool) or reader < 0:
        raise ValueError(f"reader must be an int >= 0, got {reader!r}")
    names, shapes, dtypes, converts, part_shapes = [], [], [], [], []
    acc: dict[int, list[tuple[np.ndarray, np.ndarray, int, int]]] = {}
    used: list[str] = []
    for ti, (tname, t) in enumerate(targets.items()):
        if not isinstance(t, Target):
            raise TypeError(f"targets[{tname!r}] must be a Target, got {type(t).__name__}")
        srcs = []
        for s in t.sources:
            if s not in layout.tensors:
                raise KeyError(f"targets[{tname!r}]: the sharded state dict has no tensor {s!r}")
            srcs.append(layout.tensors[s])
        first = srcs[0]
        nd = len(first.shape)
        for src in srcs:
            if src.dtype != first.dtype or len(src.shape) != nd:
                raise ValueError(f"targets[{tname!r}]: sources {first.name!r} ({first.dtype}, {first.shape}) and "
                                 f"{src.name!r} ({src.dtype}, {src.shape}) cannot be fused")
            if any(a != b for i, (a, b) in enumerate(zip(src.shape, first.shape)) if i != t.cat_dim):
                raise ValueError(f"targets[{tname!r}]: sources {first.name!r} {first.shape} and {src.name!r} "
                                 f"{src.shape} differ outside cat_dim {t.cat_dim}")
        if t.dim is not None and t.dim >= nd:
            raise ValueError(f"targets[{tname!r}]: dim {t.dim} but {first.name!r} has {nd} dimensions")
        if len(srcs) > 1 and t.cat_dim >= nd:
            raise ValueError(f"targets[{tname!r}]: cat_dim {t.cat_dim} but {first.name!r} has {nd} dimensions")
        if t.dtype is not None:
            _check_convert(tname, t, srcs)
        # every source's part: its slice box, and where it starts along cat_dim in the target
        parts = []
        at = 0
        for src in srcs:
            plo = [0] * nd
            phi = list(src.shape)
            if t.dim is not None:
                plo[t.dim], phi[t.dim] = chunk(src.shape[t.dim], t.degree, t.rank)
            parts.append((src, plo, phi, at))
            if nd:
                at += phi[t.cat_dim] - plo[t.cat_dim]
        dshape = tuple(h - l for h, l in zip(parts[0][2], parts[0][1]))
        if nd and len(srcs) > 1:
            dshape = dshape[:t.cat_dim] + (at,) + dshape[t.cat_dim + 1:]
        got = 0
        for src, plo, phi, cat_at in parts:
            used.append(src.name)
            for s in _chosen(src, reader):
                lo = [max(a, b) for a, b in zip(plo, s.offset)]
                hi = [min(a, b + n) for a, b, n in zip(phi, s.offset, s.shape)]
                if any(h <= l for h, l in zip(hi, lo)):
                    continue
                dlo = [a - b for a, b in zip(lo, plo)]
                if nd and len(srcs) > 1:
                    dlo[t.cat_dim] += cat_at
                so, do, run = _runs(s, lo, hi, dshape, dlo, first.dtype.itemsize)
                acc.setdefault(s.rank, []).append((so, do, run, ti))
                got += len(so) * run
        want = math.prod(dshape) * first.dtype.itemsize
        if got != want:  # boxes checked by check_tiling never get here
            raise ValueError(f"targets[{tname!r}]: the ranks' boxes hold {got} of its {want} bytes")
        names.append(tname)
        shapes.append(dshape)
        dtypes.append(first.dtype)
        converts.append(t if t.dtype is not None else None)
        part_shapes.append(tuple(tuple(h - l for h, l in zip(phi, plo)) for _, plo, phi, _ in parts))
    # Runs of one piece never merge (each spans every dimension both sides cover whole);
    # pieces that happen to continue each other merge when the plan is bound (``ranges``).
    runs: dict[int, np.ndarray] = {}
    for r, pieces in acc.items():
        counts = [len(so) for so, _, _, _ in pieces]
        m = np.empty((sum(counts), 4), np.int64)
        m[:, 0] = np.concatenate([so for so, _, _, _ in pieces])
        m[:, 1] = np.repeat([ti for _, _, _, ti in pieces], counts)
        m[:, 2] = np.concatenate([do for _, do, _, _ in pieces])
        m[:, 3] = np.repeat([run for _, _, run, _ in pieces], counts)
        m = m[m[:, 3] > 0]
        if len(m):
            runs[r] = m
    return ReshardPlan(tuple(names), tuple(shapes), tuple(dtypes), runs, tuple(dict.fromkeys(used)), tuple(converts),
                       tuple(part_shapes))


def _check_convert(tname: str, t: Target, srcs: list[SourceTensor]) -> None:
    """A conversion the reader can do from its own bytes, bit-exact with the full tensor's."""
    if srcs[0].dtype.name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"targets[{tname!r}]: {t.dtype} from {srcs[0].dtype} (a float dtype is needed)")
    if t.block is None:
        if t.dim is not None:
            raise NotSupportedError(f"targets[{tname!r}]: a per-tensor scale of a slice needs the whole tensor's "
                                    "amax; read it whole, or ask for block scales (block=(rows, cols))")
        return
    for src in srcs:
        if len(src.shape) != 2:
            raise ValueError(f"targets[{tname!r}]: block scales are for 2-d weights, {src.name!r} is {src.shape}")
        if t.dim is not None:
            a, b = chunk(src.shape[t.dim], t.degree, t.rank)
            bs = t.block[t.dim]
            if a % bs or (b % bs and b != src.shape[t.dim]):
                raise ValueError(f"targets[{tname!r}]: slice [{a}, {b}) of {src.name!r} along dim {t.dim} does not "
                                 f"start and end on {bs}-element block edges (its scales would mix with another "
                                 "rank's)")
        if len(srcs) > 1 and src is not srcs[-1]:
            a, b = chunk(src.shape[t.dim], t.degree, t.rank) if t.dim == t.cat_dim else (0, src.shape[t.cat_dim])
            if (b - a) % t.block[t.cat_dim]:
                raise ValueError(f"targets[{tname!r}]: {src.name!r}'s {b - a} elements along cat_dim are not a "
                                 f"multiple of the block {t.block[t.cat_dim]}: fused scales would straddle sources")


def _chosen(src: SourceTensor, reader: int) -> list[SourceShard]:
    """One shard per distinct box of ``src``: of replicas, the ``reader % copies``-th."""
    boxes: dict[tuple, list[SourceShard]] = {}
    for s in src.shards:
        boxes.setdefault((s.offset, s.shape), []).append(s)
    return [reps[reader % len(reps)] for reps in boxes.values()]


def check_tiling(src: SourceTensor) -> None:
    """Check that the distinct boxes of ``src`` tile its global shape exactly (a grid: along
    every dimension the boxes' intervals partition the extent, and every combination is one
    box), as DTensor placements do. Raises ValueError naming the tensor and the ranks."""
    boxes: dict[tuple, int] = {}
    for s in src.shards:
        if len(s.offset) != len(src.shape) or len(s.shape) != len(src.shape):
            raise ValueError(f"{src.name!r}: rank {s.rank}'s box has {len(s.shape)} dimensions, the tensor "
                             f"{len(src.shape)}")
        if any(o < 0 or n < 1 or o + n > g for o, n, g in zip(s.offset, s.shape, src.shape)):
            raise ValueError(f"{src.name!r}: rank {s.rank}'s box {s.offset}+{s.shape} lies outside {src.shape}")
        boxes.setdefault((s.offset, s.shape), s.rank)
    if math.prod(src.shape) == 0:
        return
    if not boxes:
        raise ValueError(f"{src.name!r}: no rank holds any of its {src.shape} elements")
    count = 1
    for d, g in enumerate(src.shape):
        ivs = sorted({(o[d], n[d]) for o, n in boxes})
        end = 0
        for o, n in ivs:
            if o != end:
                raise ValueError(f"{src.name!r}: the ranks' boxes leave a gap or overlap along dimension {d} at "
                                 f"{min(o, end)} (ranks {sorted(set(boxes.values()))})")
            end = o + n
        if end != g:
            raise ValueError(f"{src.name!r}: the ranks' boxes cover {end} of {g} elements along dimension {d}")
        count *= len(ivs)
    if count != len(boxes):
        raise ValueError(f"{src.name!r}: {len(boxes)} distinct boxes do not form the grid of {count} a placement "
                         "makes")


__all__ = ["MAX_DIMS", "Placement", "Replicate", "ReshardPlan", "Shard", "ShardedLayout", "SourceShard",
           "SourceTensor", "Target", "check_tiling", "chunk", "local_box", "placement", "plan_reshard", "tp_targets"]
