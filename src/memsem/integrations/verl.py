"""memsem as a verl checkpoint engine (``verl.checkpoint_engine``, verl 0.9.1).

Select it by config, no patch to verl::

    actor_rollout_ref.rollout.checkpoint_engine.backend=memsem
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=memsem.integrations.verl
    # optional: ...checkpoint_engine.engine_kwargs.memsem.directory=redis://host:6379/0

How it moves weights (bucketed, double-buffered, versions checked):

* The trainer (rank 0) publishes one **double-buffered window** of ``bucket_size`` bytes plus
  a metadata area: every bucket it fills is one *version* of that window, written inside a
  write section (so a rollout never reads a half-filled bucket), in the slot the rollouts are
  not reading. It also publishes a small window of **ready words**: two per rollout, one per
  slot, each meaning "this rollout is done with what the slot holds".
* Each rollout marks both its words when it joins. Before the trainer writes a bucket into a
  slot it awaits that slot's word of every rollout (the runtime's native word waiter: no
  polling), clears them, then writes; a rollout marks its word of the slot again once it has
  copied the bucket out. So the trainer is at most two buckets ahead of the slowest rollout,
  never overwrites a bucket someone still needs, and is blocked only as long as a rollout is
  still copying it. The words are marked with one-sided ready marks, which work on every
  route: on one node in the window's control block, across nodes (tcp) checked and written by
  the trainer's runtime, which pushes the change to whoever waits.
* A rollout follows the window's versions with the follower loop (``Runtime.follow(...,
  every=True)``: each bucket is exactly the next version, waited for on the window's
  latest-version word; a gone version raises ``VersionGoneError`` naming both), copying each
  bucket (its slot: metadata and bytes of that one version) into one of two local buffers
  while the previous bucket's tensors are being consumed, and checks the bucket's index and
  step.

Errors are exceptions (``memsem.MemsemError`` subclasses, ``MemsemTimeoutError``), never an
``exit``. Every wait is bounded by ``timeout``. Same node: route host/shm; across nodes the
window is reached through memsem's remote routes and a ``redis://`` directory.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import struct
from collections.abc import AsyncGenerator, Generator
from typing import Any

import numpy as np
import torch
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)

import memsem

#: bucket header at the start of every slot: magic, bucket index, is_last, step, metadata bytes
_HEAD = struct.Struct("<8sQQqI")
_MAGIC = b"MSVERLB1"
#: first version a bucket gets (1 is the empty window right after publish)
FIRST_BUCKET_VERSION = 2


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"bucket metadata names an unknown torch dtype {name!r}")
    return dt


@CheckpointEngineRegistry.register("memsem")
class MemsemCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over memsem windows (see the module docstring).

    Args:
        bucket_size: bytes of one bucket (verl's ``update_weights_bucket_megabytes``); the
            trainer's window holds two (double buffering), each rollout two local buffers.
        device: where received tensors live ("cpu"; a GPU rollout copies them on).
        rollout_dtype: kept for verl's signature (tensors travel in their own dtype).
        is_master: unused (the trainer is rank 0 of ``build_topology``).
        directory: memsem directory URL (``local`` by default; ``redis://`` across nodes).
        timeout: bound in seconds of every wait (joins, buckets, write sections).
        meta_bytes: bytes reserved per slot for the bucket's metadata.
    """

    def __init__(self, bucket_size: int, device: str = "cpu", rollout_dtype: torch.dtype = torch.bfloat16,
                 is_master: bool = False, directory: str | None = None, timeout: float = 300.0,
                 meta_bytes: int = 1 << 20) -> None:
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"bucket_size must be an int > 0 (bytes), got {bucket_size!r}")
        self.bucket_size = bucket_size
        self.device = device
        self.rollout_dtype = rollout_dtype
        self.is_master = is_master
        self.directory = directory
        self.timeout = float(timeout)
        self.meta_bytes = int(meta_bytes)
        self._rt: memsem.Runtime | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self._window = None
        self._acks = None
        self._token = ""
        #: per-sync figures of the last send (verl merges the trainer's into its metrics)
        self.metrics: dict[str, float] = {}

    @property
    def runtime(self) -> memsem.Runtime:
        if self._rt is None or self._rt.closed:
            self._rt = memsem.Runtime(directory=self.directory, timeout=self.timeout)
        return self._rt

    # -- verl's setup calls -----------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """A fresh token per sync (the windows' names); the runtime is started here."""
        self._token = secrets.token_hex(8)
        _ = self.runtime
        return {"token": self._token, "pid": os.getpid(), "node": memsem.native.node_id()}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """One trainer (rank 0: the first actor) to every rollout (ranks 1..N); other actors
        are rank -1 and send nothing."""
        world = rollout_world_size + 1
        master = metadata[0]
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master_metadata": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master_metadata": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        """Rank 0 publishes the bucket window and the ready words; the others remember where."""
        if not isinstance(master_metadata, dict) or not isinstance(master_metadata.get("token"), str):
            raise ValueError(f"master_metadata must be the trainer's prepare() result, got {master_metadata!r}")
        self.rank, self.world_size = int(rank), int(world_size)
        self._name = f"verl-ckpt/{master_metadata['token']}"
        if self.rank == 0:
            rt = self.runtime
            cap = self.meta_bytes + self.bucket_size
            self._window = rt.publish(np.zeros(cap, np.uint8), name=self._name, slots=2)
            n = 2 * max(1, self.world_size - 1)  # per rollout: slot 0 free, slot 1 free
            self._acks = rt.publish(np.zeros(n, np.uint8), name=self._name + "/ready", tiles=n, access="rw")

    def finalize(self) -> None:
        """Rank 0 unpublishes (waiting, within ``timeout``, for copies still running)."""
        if self._window is not None:
            rt = self.runtime
            for ref in (self._window, self._acks):
                rt.unpublish(ref, timeout=self.timeout)
            self._window = self._acks = None
        self.rank = self.world_size = None

    def close(self) -> None:
        if self._rt is not None:
            self._rt.close()
            self._rt = None

    # -- trainer ----------------------------------------------------------------------------------
    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        """Send every (name, tensor) bucket by bucket; returns per-sync figures."""
        if self.rank is None:
            raise RuntimeError("init_process_group() must run before send_weights()")
        if self.rank < 0:
            async for _ in _aiter(weights):
                pass
            return {}
        if self.rank != 0:
            raise RuntimeError(f"only the trainer (rank 0) sends weights; this is rank {self.rank}")
        rt = self.runtime
        core = rt.core
        loop = asyncio.get_running_loop()
        step = -1 if global_steps is None else int(global_steps)
        buckets = 0
        blocked = await self._await_slot(loop, 0)
        sec = await core.submit("open bucket", lambda: rt.write_section(self._window, copy=False,
                                                                        timeout=self.timeout))
        meta: list[list[Any]] = []
        offset = 0
        data = None
        try:
            async for tm, chunk in split_weight_chunks(weights, self.bucket_size):
                entry = [tm.name, str(tm.dtype), list(tm.shape), tm.chunk_offset, tm.chunk_size, 0]
                if meta and (offset + tm.chunk_size > self.bucket_size or self._meta_len(meta + [entry]) > self.meta_bytes):
                    self._seal(sec, buckets, False, step, meta)
                    blocked += sec.blocked_s
                    sec.commit()
                    buckets += 1
                    blocked += await self._await_slot(loop, buckets)
                    sec = await core.submit("open bucket", lambda: rt.write_section(self._window, copy=False,
                                                                                    timeout=self.timeout))
                    meta, offset = [], 0
                data = torch.from_numpy(sec.array()[self.meta_bytes:])
                entry[5] = offset
                data[offset:offset + tm.chunk_size].copy_(chunk.reshape(-1).view(torch.uint8).cpu())
                meta.append(entry)
                offset += tm.chunk_size
            self._seal(sec, buckets, True, step, meta)
            blocked += sec.blocked_s
            sec.commit()
            buckets += 1
        except BaseException:
            sec.abort()
            raise
        self.metrics = {"memsem/buckets": float(buckets), "memsem/trainer_blocked_s": blocked}
        return dict(self.metrics)

    def _meta_len(self, meta: list) -> int:
        return _HEAD.size + len(json.dumps(meta, separators=(",", ":")))

    def _seal(self, sec: Any, index: int, last: bool, step: int, meta: list) -> None:
        body = json.dumps(meta, separators=(",", ":")).encode()
        arr = sec.array()
        head = _HEAD.pack(_MAGIC, index, 1 if last else 0, step, len(body))
        arr[:_HEAD.size] = np.frombuffer(head, np.uint8)
        arr[_HEAD.size:_HEAD.size + len(body)] = np.frombuffer(body, np.uint8)

    async def _await_slot(self, loop: asyncio.AbstractEventLoop, bucket: int) -> float:
        """Before bucket ``bucket`` is written: every rollout is done with what its slot holds
        (its word of that slot is marked), awaited on the words, which are then cleared.
        Returns the seconds waited."""
        core = self.runtime.core
        slot = (FIRST_BUCKET_VERSION + bucket) % 2
        t0 = loop.time()
        deadline = t0 + self.timeout
        n = core.n_tiles(self._acks.spec) // 2
        for i in range(n):
            try:
                await core.wait_tile_async(self._acks.spec, 2 * i + slot, max(0.0, deadline - loop.time()))
            except memsem.MemsemTimeoutError as exc:
                what = "join" if bucket < 2 else f"finish copying bucket {bucket - 2}"
                raise memsem.MemsemTimeoutError(f"rollout rank {i + 1} did not {what} of {self._name} in "
                                                f"{self.timeout:g} s", what=f"rollout {i + 1}",
                                                timeout=self.timeout) from exc
        for i in range(n):
            core.clear_ready(self._acks.spec, 2 * i + slot)
        return loop.time() - t0 if bucket >= 2 else 0.0  # joining is not blocking by readers

    # -- rollout ----------------------------------------------------------------------------------
    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield (name, tensor) of every weight; a tensor is valid until the bucket after the
        next one arrives (copy it, as verl's loaders do)."""
        async for name, weight in merge_weight_chunks(self._chunks(global_steps), self.bucket_size):
            yield name, weight.to(self.device) if self.device != "cpu" else weight

    async def _chunks(self, global_steps: int | None) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        if self.rank is None or self.rank < 1:
            raise RuntimeError("receive_weights() runs on rollout ranks (>= 1) after init_process_group()")
        rt = self.runtime
        core = rt.core
        win = rt.lookup(self._name)
        acks = rt.lookup(self._name + "/ready")
        v = FIRST_BUCKET_VERSION
        me = 2 * (self.rank - 1)
        acks.mark_ready(me)  # joined: both slots may be written
        acks.mark_ready(me + 1)
        cap = self.meta_bytes + self.bucket_size
        bufs = [np.empty(cap, np.uint8) for _ in range(2)]
        # every bucket in order, exactly its version (the ready words keep it readable)
        follower = rt.follow(win, timeout=self.timeout, every=True, pin=False, after=v - 1)

        async def fetch(version: int, buf: np.ndarray) -> tuple[dict, int]:
            got, _ = await follower.next_async(into=buf)  # the whole slot of exactly the next version
            magic, index, last, step, mlen = _HEAD.unpack(buf[:_HEAD.size].tobytes())
            if got != version or magic != _MAGIC or mlen > self.meta_bytes - _HEAD.size:
                raise memsem.MemsemError(f"{win.spec.label}: version {got} is not memsem verl bucket {version}")
            meta = json.loads(buf[_HEAD.size:_HEAD.size + mlen].tobytes())
            used = max((e[5] + e[4] for e in meta), default=0)
            if used > self.bucket_size:
                raise memsem.MemsemError(f"bucket {index} claims {used} bytes of a {self.bucket_size}-byte bucket")
            if index != version - FIRST_BUCKET_VERSION:
                raise memsem.MemsemError(f"bucket {index} arrived as version {version}: the stream is out of order")
            if global_steps is not None and step != int(global_steps):
                raise memsem.MemsemError(f"bucket {index} is of step {step}, this rollout expects {global_steps}")
            return {"meta": meta, "last": bool(last)}, index

        task = asyncio.ensure_future(fetch(v, bufs[v % 2]))
        try:
            while True:
                got, _ = await task
                buf = torch.from_numpy(bufs[v % 2])
                # copied out: the trainer may write this slot again (bucket v + 2)
                await core.submit(f"done with v{v}", lambda v=v: acks.mark_ready(me + v % 2))
                if not got["last"]:
                    task = asyncio.ensure_future(fetch(v + 1, bufs[(v + 1) % 2]))
                for name, dt, shape, chunk_offset, chunk_size, off in got["meta"]:
                    at = self.meta_bytes + off
                    yield (TensorMeta(name=name, shape=torch.Size(shape), dtype=_dtype(dt), chunk_offset=chunk_offset,
                                      chunk_size=chunk_size, offset=off), buf[at:at + chunk_size])
                if got["last"]:
                    break
                v += 1
        finally:
            if not task.done():
                task.cancel()


async def _aiter(weights: Any) -> AsyncGenerator[Any, None]:
    if hasattr(weights, "__aiter__"):
        async for x in weights:
            yield x
    else:
        for x in weights:
            yield x


__all__ = ["MemsemCheckpointEngine"]
