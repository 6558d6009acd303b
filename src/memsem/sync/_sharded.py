"""Sharded state dicts, the trainer's side: every trainer rank publishes its own shards.

A trainer sharded by FSDP2 / DTensor holds, on each rank, one box of each tensor (placements
over a device mesh). :func:`publish_sharded` publishes rank ``r``'s local tensors as one
double-buffered state-dict window ``"<name>#shard<r>"`` and their placement (global shape, mesh,
placements, the box's offset) as a small read-only window ``"<name>#shard<r>.meta"``. Each
rank's ``update`` commits its own next version; the sharded state dict's version ``v`` exists
once **every** rank has committed ``v`` (the smallest latest version over the ranks). The
reader's side (one version across ranks, exactly its bytes) is ``memsem.sync._sharded_read``.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from memsem import _args
from memsem._buffers import buffer_info
from memsem._errors import NotSupportedError, StaleReferenceError
from memsem.core import RuntimeCore
from memsem.sync._state_dict import StateDictRef, publish_state_dict
from memsem.refs._tensorref import as_core
from memsem.sync._reshard import MAX_DIMS, Placement, Shard, local_box, placement

META_MAGIC = "memsem-sharded/1"
#: the most ranks a sharded state dict may have
MAX_RANKS = 1 << 16


def shard_name(name: str, rank: int) -> str:
    """The name of rank ``rank``'s state-dict window of the sharded state dict ``name``."""
    return f"{name}#shard{rank}"


def meta_name(name: str, rank: int) -> str:
    """The name of rank ``rank``'s placement window of the sharded state dict ``name``."""
    return f"{name}#shard{rank}.meta"


def core_of(rt: Any) -> RuntimeCore:
    """The RuntimeCore of ``rt`` (a ``memsem.Runtime``, or a core). Raises TypeError."""
    core = as_core(rt, "rt")
    if core is None:
        raise TypeError("rt must be a memsem.Runtime, got None")
    return core


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: Any) -> Any:
    """The local tensor of a DTensor (contiguous, detached), else ``t``."""
    if _is_dtensor(t):
        t = t.to_local()
    if hasattr(t, "detach"):
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
    return t


class ShardedPublisher:
    """One trainer rank's side of a sharded state dict (:func:`publish_sharded`).

    Attributes:
        name: the sharded state dict's name. rank / world_size: this rank, of how many.
        ref: the :class:`memsem.StateDictRef` of this rank's local tensors.
        placements: name -> (global shape, placements, box offset, box shape) of each tensor.
        blocked_s: seconds the last ``update`` waited for readers' pins of the version it
            overwrote (0.0 when none held it).
    """

    def __init__(self, core: RuntimeCore, name: str, rank: int, world_size: int, ref: StateDictRef, meta_spec: Any,
                 placements: dict[str, tuple]) -> None:
        self._core = core
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.ref = ref
        self._meta = meta_spec
        self.placements = placements
        self.blocked_s = 0.0
        self._closed = False

    def __repr__(self) -> str:
        return f"<ShardedPublisher {self.name!r} rank {self.rank}/{self.world_size}>"

    def version(self) -> int:
        """This rank's latest committed version (the sharded version may still lag behind)."""
        return self.ref.version()

    def local_tensors(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict``'s local tensors (DTensors' local shards), checked against the shapes
        published. Raises KeyError / ValueError naming a tensor."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of name to tensor, got {type(state_dict).__name__}")
        return {k: _local(state_dict[k]) for k in self.placements if k in state_dict}

    def update(self, state_dict: Mapping[str, Any], *, timeout: float | None = None) -> int:
        """Commit this rank's shards of ``state_dict`` (DTensors or the local tensors, the names
        and local shapes published) as its next version; returns it. Blocking while a pinned
        reader of the version it overwrites holds it (at most the reader's pin ttl; the wait
        is ``blocked_s``), then for the copy of the rank's local bytes. The sharded version
        exists once every rank has committed it.

        Raises:
            KeyError / ValueError / TypeError: a tensor missing, or of another dtype or local
                shape (before anything is written). As ``StateDictRef.update``.
        """
        srcs = self.ref.sources(self.local_tensors(state_dict))
        with self.ref.write_section(copy=False, timeout=timeout) as sec:
            self.ref.fill(sec, srcs)
        self.blocked_s = sec.blocked_s
        return sec.version

    def write_section(self, *, copy: bool = True, timeout: float | None = None) -> Any:
        """A write section on this rank's window (``StateDictRef.write_section``): change its
        ``tensors`` (the local shards) in place; leaving the block commits this rank's next
        version."""
        return self.ref.write_section(copy=copy, timeout=timeout)

    def close(self, timeout: float | None = None) -> None:
        """Unpublish this rank's windows (readers' later loads fail with a StaleReferenceError).
        Safe twice."""
        if self._closed:
            return
        self._closed = True
        for spec in (self._meta, self.ref.spec):
            try:
                self._core.unpublish_spec(spec, timeout=timeout)
            except StaleReferenceError:
                pass

    def __enter__(self) -> "ShardedPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def publish_sharded(rt: Any, state_dict: Mapping[str, Any], *, name: str, rank: int | None = None,
                    world_size: int | None = None, mesh_shape: Sequence[int] | None = None,
                    coordinate: Sequence[int] | None = None, placements: Mapping[str, Any] | None = None,
                    global_shapes: Mapping[str, Sequence[int]] | None = None,
                    replace: bool = False) -> ShardedPublisher:
    """Publish this trainer rank's shards of ``state_dict`` as rank ``rank`` of the sharded
    state dict ``name``; every rank of the trainer calls it (in any order).

    Args:
        rt: this process's ``memsem.Runtime``.
        state_dict: name -> tensor. A DTensor (FSDP2's ``fully_shard`` parameters, or any
            ``distribute_tensor``) carries its mesh, placements and global shape; its local
            shard is published. A plain tensor (numpy or torch, CPU, any dtype memsem
            supports) is this rank's local shard under ``placements[name]`` with global shape
            ``global_shapes[name]``; with neither, it is replicated (every rank holds it whole:
            buffers).
        name: the sharded state dict's name (readers' ``lookup_sharded(name)``).
        rank, world_size: this rank and the number of ranks (default: the DTensors' mesh:
            the rank's row-major index in it; else ``torch.distributed``'s rank and world
            size). coordinate / mesh_shape: this rank's coordinate in the mesh and the mesh's
            shape (default: a 1-d mesh of ``world_size``, ``(rank,)``).
        placements: name -> placements of a plain tensor, one per mesh dimension
            (``memsem.sync.Shard(d)`` / ``Replicate()``, torch's, or ``"S0"`` / ``"R"``); a
            single placement is taken for a 1-d mesh.
        global_shapes: name -> global shape of a plain tensor with a ``Shard`` placement
            (shards are uneven as ``torch.chunk`` cuts them: the global shape is not implied).
        replace: take over the names from a previous owner (a restarted rank).

    Returns:
        A :class:`ShardedPublisher` (``update``, ``write_section``, ``close``). Version 1 is
        ``state_dict``'s current values.

    Raises:
        ValueError: a local tensor whose shape is not the box its placement gives this rank
            (names the tensor, both shapes), a bad rank / mesh, a Shard placement without a
            global shape. NotSupportedError: a Partial or strided-shard placement, DTensors of
            different meshes. As ``Runtime.publish_state_dict``.
    """
    core = core_of(rt)
    name = _args.window_name(name, "name")
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise ValueError("state_dict must be a non-empty mapping of name to tensor")
    placements = dict(placements or {})
    global_shapes = dict(global_shapes or {})
    mesh, coord = _mesh_of(state_dict, mesh_shape, coordinate, rank, world_size)
    world = math.prod(mesh)
    r = int(np.ravel_multi_index(coord, mesh)) if mesh else 0
    if rank is not None and rank != r:
        raise ValueError(f"rank {rank} is not the row-major index {r} of coordinate {coord} in mesh {mesh}")
    if world > MAX_RANKS:
        raise ValueError(f"world_size must be at most {MAX_RANKS}, got {world}")
    local: dict[str, Any] = {}
    placed: dict[str, tuple] = {}
    for key, t in state_dict.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"state_dict keys must be non-empty str, got {key!r}")
        lt = _local(t)
        have = tuple(buffer_info(lt, f"state_dict[{key!r}]").shape)
        if _is_dtensor(t):
            pl = tuple(placement(p, f"state_dict[{key!r}].placements") for p in t.placements)
            gshape = tuple(int(x) for x in t.shape)
        else:
            pl = _placements_of(placements.get(key), len(mesh), key)
            gshape = global_shapes.get(key)
            if gshape is None:
                if any(isinstance(p, Shard) for p in pl):
                    raise ValueError(f"global_shapes[{key!r}] is needed: state_dict[{key!r}] is sharded "
                                     f"({[str(p) for p in pl]}) and its shards may be uneven")
                gshape = have
            gshape = tuple(int(x) for x in gshape)
        if len(gshape) > MAX_DIMS or any(isinstance(p, Shard) and not 0 <= p.dim < len(gshape) for p in pl):
            raise ValueError(f"state_dict[{key!r}]: placements {[str(p) for p in pl]} do not fit its shape {gshape}")
        off, box = local_box(gshape, mesh, coord, pl)
        if have != box:
            raise ValueError(f"state_dict[{key!r}]: the local shard is {have}, but placements "
                             f"{[str(p) for p in pl]} of {gshape} over mesh {mesh} give rank {r} {box}")
        local[key] = lt
        placed[key] = (gshape, pl, off, box)
    ref = publish_state_dict(core, local, name=shard_name(name, r), replace=replace)
    meta = json.dumps({"magic": META_MAGIC, "world_size": world, "mesh_shape": list(mesh), "rank": r,
                       "coordinate": list(coord),
                       "tensors": [[k, list(g), [str(p) for p in pl], list(o)] for k, (g, pl, o, _) in placed.items()]},
                      separators=(",", ":")).encode()
    try:
        spec = core.publish_spec(np.frombuffer(meta, np.uint8).copy(), name=meta_name(name, r), access="r",
                                 replace=replace)
    except BaseException:
        core.unpublish_spec(ref.spec)
        raise
    return ShardedPublisher(core, name, r, world, ref, spec, placed)


def _placements_of(value: Any, ndim_mesh: int, key: str) -> tuple[Placement, ...]:
    if value is None:
        return tuple(placement("R") for _ in range(ndim_mesh))
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        value = [value]
    pl = tuple(placement(p, f"placements[{key!r}]") for p in value)
    if len(pl) != ndim_mesh:
        raise ValueError(f"placements[{key!r}] has {len(pl)} placements; the mesh has {ndim_mesh} dimensions")
    return pl


def _mesh_of(state_dict: Mapping[str, Any], mesh_shape: Any, coordinate: Any, rank: int | None,
             world_size: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(mesh shape, this rank's coordinate)``: the DTensors' mesh, else the arguments."""
    meshes = {(tuple(t.device_mesh.shape), tuple(t.device_mesh.get_coordinate() or ()))
              for t in state_dict.values() if _is_dtensor(t)}
    if len(meshes) > 1:
        raise NotSupportedError(f"the DTensors of state_dict lie on {len(meshes)} different meshes "
                                f"({sorted(meshes)}): publish one sharded state dict per mesh")
    if meshes:
        mesh, coord = meshes.pop()
        if not coord:
            raise ValueError("this process is not in the DTensors' mesh")
    elif mesh_shape is not None:
        mesh = tuple(_args.count(m, "mesh_shape", minimum=1) for m in mesh_shape)
        if coordinate is None:
            if rank is None:
                raise ValueError("rank or coordinate is needed with mesh_shape")
            coord = tuple(int(c) for c in np.unravel_index(rank, mesh))
        else:
            coord = tuple(int(c) for c in coordinate)
    else:
        if world_size is None or rank is None:
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    world_size = dist.get_world_size() if world_size is None else world_size
                    rank = dist.get_rank() if rank is None else rank
            except ImportError:
                pass
        if world_size is None or rank is None:
            raise ValueError("rank and world_size are needed (no DTensor, no torch.distributed group)")
        mesh = (_args.count(world_size, "world_size", minimum=1),)
        coord = (_args.count(rank, "rank"),)
    if len(coord) != len(mesh) or any(not 0 <= c < m for c, m in zip(coord, mesh)):
        raise ValueError(f"coordinate {coord} is not in mesh {mesh}")
    if world_size is not None and world_size != math.prod(mesh):
        raise ValueError(f"world_size {world_size} is not the mesh's {math.prod(mesh)} ranks ({mesh})")
    return mesh, coord


__all__ = ["META_MAGIC", "MAX_RANKS", "ShardedPublisher", "core_of", "meta_name", "publish_sharded", "shard_name"]
