"""memsem as a verl checkpoint engine (``verl.checkpoint_engine``, verl 0.9.1).

Select it by config, no patch to verl::

    actor_rollout_ref.rollout.checkpoint_engine.backend=memsem
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=memsem.integrations.verl
    # optional: ...checkpoint_engine.engine_kwargs.memsem.directory=redis://host:6379/0

How the refs travel: through verl's own metadata channel, no name lookup and no job secret.
verl calls ``prepare()`` on every worker before each sync, hands the results to
``build_topology()`` and passes what that returns to each worker's ``init_process_group()``:

* the master actor (verl makes actor rank 0's engine with ``is_master=True``) publishes the
  **bucket window** in ``prepare()`` and returns its serialized ref;
* every other engine (the rollouts, and actors that send nothing) publishes its **status
  window** in ``prepare()`` and returns its ref: three ready words (0 and 1: "done with what
  bucket slot 0 / 1 holds", 2: "failed") and a message area;
* ``build_topology`` gives every rollout the master's ref and the master the rollouts' refs,
  in rank order.

A ref carries its window's access key (it is a capability, like an rkey), so the directory holds
only the windows' records: the backend works on any directory, ``redis://`` across nodes, with no
``MEMSEM_JOB_SECRET`` and nothing passed by hand.

How it moves weights (bucketed, double-buffered, versions checked):

* The trainer writes bucket b as version ``FIRST_BUCKET_VERSION + b`` of its double-buffered
  window, inside a write section (a rollout never reads a half-filled bucket), in the slot of
  that version, which the rollouts are not reading.
* A rollout marks both slot words of its status window when it joins, and the word of slot s
  again once it has copied the bucket out of slot s. Before the trainer writes a bucket into
  slot s it waits for word s of every rollout, then clears them: the trainer is at most two
  buckets ahead of the slowest rollout and never overwrites a bucket someone still needs.
* A rollout follows the window's versions with the follower loop (``Runtime.follow(...,
  every=True)``: each bucket is exactly the next version, waited for on the window's
  latest-version word; a gone version raises ``VersionGoneError`` naming both), copying each
  bucket (its slot: metadata and bytes of that one version) into one of two local buffers
  while the previous bucket's tensors are being consumed, and checks the bucket's index and
  step.
* Awaiting a rollout's word is a memsem wait on that rollout's window, so a rollout that dies
  is reported by memsem's liveness (its process on the same node; its connection and heartbeat
  across nodes) as ``PeerLostError`` naming the rollout, within the library's liveness bound,
  not after ``timeout``. A rollout whose receive fails (or whose consumer stops) writes the
  error into its status window and marks "failed" and both slot words: the trainer raises it at
  once, naming the rollout (``PeerLostError``: the rollout left the sync).

Errors are exceptions (``memsem.MemsemError`` subclasses, ``MemsemTimeoutError``), never an
``exit``. Every wait is bounded by ``timeout``. Same node: route host/shm; across nodes the
windows are reached through memsem's remote routes (tcp, rdma) and a ``redis://`` directory.
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
#: ready words of a status window: done with slot 0, done with slot 1, failed
W_SLOT0, W_SLOT1, W_FAILED = 0, 1, 2
#: bytes of a status window (the failure message, UTF-8, NUL-terminated)
STATUS_BYTES = 4096


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
        is_master: True on the actor that sends (verl passes ``rank == 0``): its ``prepare``
            publishes the bucket window, whose ref travels to the rollouts in verl's metadata.
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
        self.is_master = bool(is_master)
        self.directory = directory
        self.timeout = float(timeout)
        self.meta_bytes = int(meta_bytes)
        self._rt: memsem.Runtime | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self._window: Any = None  # the bucket window (published on the master, a ref elsewhere)
        self._status: Any = None  # this engine's status window (not on the master)
        self._rollouts: list[tuple[Any, str]] = []  # the master's: (status ref, label) per rollout
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
        """Publish this sync's window (the master: the bucket window; others: a status window)
        and return its serialized ref with this process's identity: the metadata verl hands to
        ``build_topology``."""
        self._drop_windows()
        self._token = secrets.token_hex(8)
        rt = self.runtime
        out: dict[str, Any] = {"token": self._token, "pid": os.getpid(), "node": memsem.native.node_id(),
                               "rank": rt.rank}
        if self.is_master:
            cap = self.meta_bytes + self.bucket_size
            self._window = rt.publish(np.zeros(cap, np.uint8), slots=2)
            out["window"] = self._window.to_bytes().hex()
        else:
            self._status = rt.publish(np.zeros(STATUS_BYTES, np.uint8), tiles=3, access="rw")
            out["status"] = self._status.to_bytes().hex()
        return out

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """One trainer (rank 0: the first actor, the master) to every rollout (ranks 1..N);
        other actors are rank -1 and send nothing. The master gets the rollouts' metadata (their
        status windows), every rollout the master's (the bucket window).

        Raises:
            ValueError: the first actor's metadata has no bucket window (its engine was not made
                with ``is_master=True``), or the metadata are not this backend's.
        """
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(f"expected {actor_wg_world_size} + {rollout_world_size} prepare() results, "
                             f"got {len(metadata)}")
        master = metadata[0]
        if not isinstance(master, dict) or not isinstance(master.get("window"), str):
            raise ValueError("the first actor's prepare() published no bucket window: make the sending actor's "
                             "memsem engine with is_master=True (verl's actor workers pass is_master=(rank == 0))")
        rollouts = list(metadata[actor_wg_world_size:])
        for i, md in enumerate(rollouts, 1):
            if not isinstance(md, dict) or not isinstance(md.get("status"), str):
                raise ValueError(f"rollout {i}'s prepare() result is not a memsem status window: {md!r:.200}")
        world = rollout_world_size + 1
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master_metadata": [master] * actor_wg_world_size,
                 "rollouts": [rollouts] + [None] * (actor_wg_world_size - 1)}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master_metadata": [master] * rollout_world_size, "rollouts": [None] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict[str, Any],
                           rollouts: list[dict[str, Any]] | None = None) -> None:
        """Rank 0 (the master) resolves every rollout's status window; rollouts resolve the
        bucket window from the master's ref.

        Raises:
            ValueError: metadata that are not ``build_topology``'s.
        """
        if not isinstance(master_metadata, dict) or not isinstance(master_metadata.get("window"), str):
            raise ValueError(f"master_metadata must be the master's prepare() result, got {master_metadata!r:.200}")
        self.rank, self.world_size = int(rank), int(world_size)
        rt = self.runtime
        if self.rank == 0:
            if self._window is None:
                raise ValueError("rank 0 sends, but this engine published no bucket window in prepare(): "
                                 "make it with is_master=True")
            if not isinstance(rollouts, list) or len(rollouts) != self.world_size - 1:
                raise ValueError(f"rank 0 needs the metadata of its {self.world_size - 1} rollouts, got {rollouts!r:.200}")
            self._rollouts = [(rt.ref(bytes.fromhex(md["status"])),
                               f"rollout {i} (pid {md.get('pid')} on {md.get('node')!r})")
                              for i, md in enumerate(rollouts, 1)]
        elif self.rank > 0:
            self._window = rt.ref(bytes.fromhex(master_metadata["window"]))

    def finalize(self) -> None:
        """Unpublish this sync's window (waiting, within ``timeout``, for copies still running)."""
        self._drop_windows()
        self.rank = self.world_size = None

    def _drop_windows(self) -> None:
        rt = self._rt
        for ref, owned in ((self._window, self.is_master), (self._status, True)):
            if ref is not None and owned and rt is not None and not rt.closed:
                rt.unpublish(ref, timeout=self.timeout)
        self._window = self._status = None
        self._rollouts = []

    def close(self) -> None:
        if self._rt is not None:
            self._rt.close()
            self._rt = None
        self._window = self._status = None
        self._rollouts = []

    # -- trainer ----------------------------------------------------------------------------------
    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        """Send every (name, tensor) bucket by bucket; returns per-sync figures.

        Raises:
            PeerLostError: a rollout died or failed (named, with its error).
            MemsemTimeoutError: a rollout did not join or finish a bucket within ``timeout``.
        """
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
        (its status word of that slot is marked), then the words are cleared. Returns the
        seconds waited (joining is not counted as blocking).

        Raises:
            PeerLostError: a rollout died while awaited, or reported a failure.
            MemsemTimeoutError: a rollout's word was not marked within ``timeout``.
        """
        core = self.runtime.core
        slot = (FIRST_BUCKET_VERSION + bucket) % 2
        what = "join" if bucket < 2 else f"finish copying bucket {bucket - 2}"
        t0 = loop.time()
        deadline = t0 + self.timeout
        for status, label in self._rollouts:
            left = max(0.0, deadline - loop.time())
            try:
                failed = await core.submit(f"{label}: {what}", lambda st=status, t=left: _await_word(st, slot, t))
            except memsem.PeerLostError as exc:
                raise memsem.PeerLostError(f"{label} died before it could {what} (bucket slot {slot}): {exc}") from exc
            except memsem.MemsemTimeoutError as exc:
                raise memsem.MemsemTimeoutError(f"{label} did not {what} within {self.timeout:g} s",
                                                what=label, timeout=self.timeout) from exc
            if failed:
                raw = await core.submit(f"{label}: its error", status.get)
                msg = bytes(raw).split(b"\0", 1)[0].decode("utf-8", "replace") or "no message"
                raise memsem.PeerLostError(f"{label} left the sync before it could {what}: {msg}")
        await core.submit("clear slot words", lambda: [core.clear_ready(st.spec, slot) for st, _ in self._rollouts])
        return loop.time() - t0 if bucket >= 2 else 0.0

    # -- rollout ----------------------------------------------------------------------------------
    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield (name, tensor) of every weight; a tensor is valid until the bucket after the
        next one arrives (copy it, as verl's loaders do). A failure here, or a consumer that
        stops before the last weight, is reported to the trainer (see the module docstring)."""
        if self.rank is None or self.rank < 1 or self._window is None or self._status is None:
            raise RuntimeError("receive_weights() runs on rollout ranks (>= 1) after prepare() and init_process_group()")
        try:
            async for name, weight in merge_weight_chunks(self._chunks(global_steps), self.bucket_size):
                yield name, weight.to(self.device) if self.device != "cpu" else weight
        except GeneratorExit:
            self._report_failure("it stopped receiving before the last weight (its consumer closed the stream)")
            raise
        except BaseException as exc:
            self._report_failure(f"it failed: {type(exc).__name__}: {exc}")
            raise

    def _report_failure(self, why: str) -> None:
        """Tell the trainer this rollout leaves the sync: the message into the status window,
        then "failed" and both slot words marked (failed first: whoever sees a slot word sees
        it). Best effort: the rollout's own window, local operations."""
        status, rt = self._status, self._rt
        if status is None or rt is None or rt.closed:
            return
        try:
            with rt.write_section(status, timeout=self.timeout) as sec:
                body = why.encode("utf-8", "replace")[:STATUS_BYTES - 1] + b"\0"
                sec.array()[:len(body)] = np.frombuffer(body, np.uint8)
            for w in (W_FAILED, W_SLOT0, W_SLOT1):
                status.mark_ready(w)
        except memsem.MemsemError:
            pass

    async def _chunks(self, global_steps: int | None) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        rt = self.runtime
        win, status = self._window, self._status
        v = FIRST_BUCKET_VERSION
        status.mark_ready(W_SLOT0)  # joined: both slots may be written
        status.mark_ready(W_SLOT1)
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
                status.mark_ready(v % 2)
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
            follower.close()


def _await_word(status: Any, slot: int, timeout: float) -> bool:
    """Block until a rollout's word of ``slot`` is marked (memsem's wait: PeerLostError when the
    rollout dies); True when the rollout also marked "failed"."""
    status.wait_tile(slot, timeout=timeout)
    return status.is_ready(W_FAILED)


async def _aiter(weights: Any) -> AsyncGenerator[Any, None]:
    if hasattr(weights, "__aiter__"):
        async for x in weights:
            yield x
    else:
        for x in weights:
            yield x


__all__ = ["MemsemCheckpointEngine"]
